"""The package's folders form layers: a module imports only from its own folder or a lower layer,
and no modules import each other in a cycle (imports under ``TYPE_CHECKING`` and inside functions
count too). docs/how-it-works.md, "Where the code is", shows the same order."""

from __future__ import annotations

import ast
import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rank0load"

# lowest first; a module may import from its own layer's folder or any layer before it
LAYERS = [
    {"errors"},
    {"integrations"},
    {"common"},
    {"model"},
    {"checkpoint"},
    {"load", "save", "train"},
    {"top"},  # rank0load/*.py: the entry points (errors aside)
]


def _modules() -> dict[str, Path]:
    """Dotted name below rank0load (``load._plan``, ``_api``) -> file."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports (``from . import _x`` counts as importing ``_x``)."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if name else []
    base_parts = here if is_package else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = base_parts[: len(base_parts) - (node.level - 1)]
            elif node.module and node.module.split(".")[0] == "rank0load":
                base = []
                node_module = node.module.split(".", 1)[1] if "." in node.module else None
                target = ".".join([*base, *([node_module] if node_module else [])])
                found |= _targets(target, node, known)
                continue
            else:
                continue
            target = ".".join([*base, *([node.module] if node.module else [])])
            found |= _targets(target, node, known)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("rank0load."):
                    found.add(alias.name.split(".", 1)[1])
    return {m for m in found if m in known and m != name}


def _targets(target: str, node: ast.ImportFrom, known: set[str]) -> set[str]:
    """``from target import names``: the submodules among ``names``, and ``target`` itself when
    some name is not a submodule (``from . import _x`` does not make a module depend on ``__init__``)."""
    subs = {a.name: f"{target}.{a.name}".lstrip(".") for a in node.names}
    found = {s for s in subs.values() if s in known}
    if target in known and len(found) < len(subs):
        found.add(target)
    return found


def _folder(name: str) -> str:
    if name == "errors":
        return "errors"
    return (
        name.split(".")[0]
        if "." in name or name in {"integrations", "common", "model", "checkpoint", "load", "save", "train"}
        else "top"
    )


def _layer(folder: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if folder in layer)


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def test_imports_only_go_down():
    wrong = []
    for name, deps in _graph().items():
        for dep in deps:
            mine, theirs = _folder(name), _folder(dep)
            if mine != theirs and _layer(theirs) >= _layer(mine):
                wrong.append(f"{name} ({mine}) imports {dep} ({theirs})")
    assert not wrong, wrong


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_checker_sees_imports():
    """The graph is not empty by mistake: the entry point's known imports are found."""
    graph = _graph()
    assert {"load._transfer", "checkpoint._manifest", "common._distribute"} <= graph["_api"]
    assert "load._localread" in graph["load._transfer"]  # a TYPE_CHECKING import
    assert "common._distribute" in graph["load._sink"]  # from ..common import _distribute


def test_rank0loads_own_frames_are_recognised_in_every_folder():
    """``user_code`` blames the caller's code, except for an exception raised inside rank0load's own
    code that it called: the package root, not the folder ``_failure`` sits in, decides."""
    import pytest
    import torch

    from rank0load.common import _failure
    from rank0load.model import _shard

    assert _failure._PACKAGE == str(PACKAGE) + os.sep

    def shard_fn_into_rank0load():  # the caller's shard_fn calling rank0load's policy, which fails
        _shard.default_shard_fn(torch.nn.Linear(2, 2), None)  # type: ignore[arg-type]

    with pytest.raises(Exception) as raised:
        _failure.user_code("shard_fn", shard_fn_into_rank0load)
    assert not isinstance(raised.value, _failure.UserCodeFailure), raised.value

    def own_failure():
        raise ValueError("the caller's bug")

    with pytest.raises(_failure.UserCodeFailure, match="shard_fn raised ValueError: the caller's bug"):
        _failure.user_code("shard_fn", own_failure)
