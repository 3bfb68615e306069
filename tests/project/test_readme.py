"""The README is the page a user reads (issue #57): at most 300 lines, its quickstart runs as written
under torchrun, and every relative link in it reaches a file of this repository (and, for a
Markdown file, a heading of it). Everything else lives in docs/, built by mkdocs --strict in CI."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from tests._dist import EXIT_ABORT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
MAX_LINES = 300
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _readme() -> str:
    with open(README) as f:
        return f.read()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lowercase, punctuation but '-' and '_' dropped, spaces
    to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    with open(path) as f:
        text = re.sub(r"^```.*?^```", "", f.read(), flags=re.M | re.S)  # no headings in code blocks
    return {_slug(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_readme_is_at_most_300_lines():
    lines = _readme().count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines: move the rest to docs/ (at most {MAX_LINES})"


def test_readme_starts_with_the_two_commands():
    """CI runs the first block's commands (.ci/run): install and test, then the main job."""
    first = re.search(r"```bash\n(.*?)```", _readme(), re.S)
    assert first is not None
    assert 'pip install -e ".[test,bench]" && python -m pytest -q' in first[1]
    assert "python -m benchmarks.bench" in first[1]


def test_readme_relative_links_reach_files_and_headings():
    links = [m[1] for m in LINK.finditer(_readme())]
    relative = [link for link in links if not re.match(r"[a-z]+:|#", link)]
    assert len(relative) >= 10, relative  # the API, the recipes, docs/, benchmarks/
    for link in relative:
        path, _, anchor = link.partition("#")
        target = os.path.join(ROOT, path)
        assert os.path.exists(target), f"README.md links to {link}, which does not exist"
        if anchor and path.endswith(".md"):
            assert anchor in _anchors(target), f"README.md links to {link}: {path} has no such heading"


@pytest.mark.slow
@pytest.mark.transformers
def test_readme_quickstart_runs_as_written(tmp_path):
    """The README's quickstart_cpu.py, copied as printed, run as it says (torchrun, 2 CPU processes),
    twice: the first run writes tiny-llama, the second loads it again. Both ranks print their line,
    rank 0's INFO summary appears once, and the run exits 0 (or, after every rank's line, with the
    known exit-time abort of torch 2.13 on the CPU, as tests/project/test_examples.py forgives it)."""
    readme = _readme()
    blocks = re.findall(r"```python\n(# quickstart_cpu\.py\n.*?)```", readme, re.S)
    assert len(blocks) == 1
    (tmp_path / "quickstart_cpu.py").write_text(blocks[0])
    assert "`torchrun --nproc-per-node 2 quickstart_cpu.py`" in readme
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for attempt in ("writes tiny-llama", "loads it again"):
        proc = subprocess.run(
            [*command, str(_free_port()), "quickstart_cpu.py"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        log = proc.stdout + proc.stderr
        tail = (attempt, proc.returncode, log[-4000:])
        for rank in (0, 1):
            assert f"rank {rank}: 39 tensors loaded, logits (1, 3, 32000)" in proc.stdout, tail
        summaries = re.findall(r"INFO:rank0load\.common\._report:rank0load: 39 tensors, 0\.08 GB in ", log)
        assert len(summaries) == 1, tail
        if proc.returncode != 0:
            assert EXIT_ABORT.search(proc.stderr), tail
        assert (tmp_path / "tiny-llama" / "config.json").exists()
