"""mkdocs hook: a public name without a docstring is a warning, so ``mkdocs build --strict`` fails.

mkdocstrings renders a name without a docstring as a bare signature and says nothing. Checked here,
through griffe (what mkdocstrings itself reads, so attribute docstrings count): every name in
``rank0load.__all__``, every public class and function of ``rank0load.errors``, and the public
methods and properties of each of those classes, each with a docstring of its own (an inherited one
is not rendered).
"""

from __future__ import annotations

import logging
import os

import griffe

log = logging.getLogger("mkdocs.plugins.rank0load")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _undocumented(obj: griffe.Object | griffe.Alias, where: str) -> list[str]:
    if obj.is_alias:  # rank0load.X is an alias of where X is defined: check the definition
        obj = obj.final_target
    missing = [] if obj.docstring and obj.docstring.value.strip() else [where]
    if obj.is_class:
        for name, member in obj.members.items():
            if name.startswith("_") or member.is_alias:
                continue
            if member.is_function or "property" in member.labels:
                if not (member.docstring and member.docstring.value.strip()):
                    missing.append(f"{where}.{name}")
    return missing


def on_pre_build(config, **kwargs) -> None:
    import sys

    sys.path.insert(0, ROOT)
    import rank0load  # the names the package exports when imported, not as parsed

    package = griffe.load("rank0load", search_paths=[ROOT], resolve_aliases=True)
    missing: list[str] = []
    for name in rank0load.__all__:
        missing += _undocumented(package[name], f"rank0load.{name}")
    errors = package["errors"]
    for name, member in errors.members.items():
        if not name.startswith("_") and not member.is_alias and (member.is_class or member.is_function):
            missing += _undocumented(member, f"rank0load.errors.{name}")
    for where in missing:
        log.warning("%s has no docstring: the API reference would show it undocumented", where)
