"""The version is defined once (``rank0load.__version__``; pyproject.toml reads it), and the
CHANGELOG's newest entry is that version. ``.ci/run`` builds the sdist and wheel and runs
``twine check`` on them."""

from __future__ import annotations

import os
import re
import tomllib

import rank0load

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_version_is_defined_once():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert "version" not in project["project"], "pyproject.toml defines the version again"
    assert project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "rank0load.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?", rank0load.__version__), rank0load.__version__


def test_the_changelog_starts_at_the_current_version():
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        entries = re.findall(r"^## (\S+)", f.read(), flags=re.MULTILINE)
    assert entries, "CHANGELOG.md has no version entry"
    assert entries[0] == rank0load.__version__, entries
    assert entries[-1] == "0.1.0", entries
