"""Structural facts about the package ``rank0load/`` (``bench/`` apart, in one summary line):

1. modules (``.py`` files), their line counts, those over 350 lines;
2. the import graph between them, from the AST: every ``import`` / ``from ... import`` in a module,
   each edge ``top`` (module level), ``typing`` (under ``if TYPE_CHECKING:``) or ``local`` (in a
   function), relative imports resolved from the module's own package (``from . import _foo`` is an
   edge to ``_foo``); import cycles (strongly connected components), over all edges and ``top`` alone;
3. functions longer than 60 lines (``def`` line to last line), methods and nested ones included,
   each with its body's lines without the docstring (the issue's "function bodies"); those whose
   body alone is over 60 counted apart;
4. a real 2-rank gloo load on the CPU of a small checkpoint, with ``local_reads`` True and False: a
   profile hook on each rank and thread sees every ``os.preadv`` / ``os.pread``, ``dist.recv`` /
   ``irecv`` / ``broadcast`` and ``Tensor.copy_`` that rank0load code calls; those whose destination
   overlaps a parameter's or buffer's local storage wrote into a shard. For the longest chain of
   rank0load frames from ``load_sharded`` to such a call, over both ranks (a thread's chain prefixed by
   the one that started it): (a) its depth in frames, both ends included, (b) its modules, (c) itself.

Run from the repository root: ``python benchmarks/structure.py [--json] [--no-runtime]``.
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import datetime
import inspect
import json
import os
import socket
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "rank0load"
LONG_MODULE, LONG_FUNCTION = 350, 60


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def short(name: str) -> str:
    return name.removeprefix("rank0load.") if name != "rank0load" else "rank0load(__init__)"


def scan(name: str, path: Path, known: set[str]) -> tuple[list[tuple[str, str]], list[tuple[str, int]]]:
    """A module's imports of ``known`` modules ``(module, kind)`` and long functions ``(name, lines,
    body lines)``: the body from its first statement after the docstring to the last line."""
    here = name.split(".")[: None if path.name == "__init__.py" else -1]  # the module's package
    found, long = [], []

    def visit(node: ast.AST, kind: str, prefix: str) -> None:
        for c in ast.iter_child_nodes(node):
            k, p, test = kind, prefix, getattr(c, "test", None)
            if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if c.end_lineno - c.lineno + 1 > LONG_FUNCTION:
                    first = c.body[0]
                    documented = isinstance(first, ast.Expr) and isinstance(
                        getattr(first, "value", None), ast.Constant
                    )
                    start = c.body[1].lineno if documented and len(c.body) > 1 else first.lineno
                    long.append((prefix + c.name, c.end_lineno - c.lineno + 1, c.end_lineno - start + 1))
                k, p = "local", f"{prefix}{c.name}.<locals>."
            elif isinstance(c, (ast.ClassDef, ast.Lambda)):
                k, p = (k, f"{prefix}{c.name}.") if isinstance(c, ast.ClassDef) else ("local", p)
            elif isinstance(c, ast.If) and kind == "top" and "TYPE_CHECKING" in ast.unparse(test):
                k = "typing"  # (an else branch counts as typing too)
            elif isinstance(c, ast.Import):
                found.extend((a.name, k) for a in c.names)
            elif isinstance(c, ast.ImportFrom):
                base = ".".join([*(here[: len(here) + 1 - c.level] if c.level else []), c.module or ""])
                found.extend((f"{base.strip('.')}.{a.name}", k) for a in c.names)  # base.a, else base
            visit(c, k, p)

    visit(ast.parse(path.read_text()), "top", "")
    out = []
    for target, kind in found:
        while target and target not in known:  # the nearest known module: base.a if a is one, else base
            target = target.rpartition(".")[0]
        out += [(target, kind)] if target and target != name else []
    return out, long


def sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node: each node with the nodes it reaches back."""
    reach: dict[str, set[str]] = {v: set() for v in graph}
    for v, seen in reach.items():
        todo = [v]
        while todo:
            todo += (new := graph.get(todo.pop(), set()) - seen)
            seen |= new
    comps = {tuple(sorted(w for w in reach[v] if v in reach.get(w, ()))) for v in graph if v in reach[v]}
    return sorted((list(c) for c in comps if len(c) > 1), key=lambda c: (-len(c), c))


def static_report() -> dict:
    files = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}
    mods = {n: p for n, p in files.items() if not n.startswith("rank0load.bench")}
    size = {n: len(p.read_text().splitlines()) for n, p in files.items()}
    edges: dict[tuple[str, str], set[str]] = {}
    long = []
    for name, path in mods.items():
        found, functions = scan(name, path, set(mods))
        long += [(short(name), f, n, body) for f, n, body in functions]
        _ = [edges.setdefault((name, target), set()).add(kind) for target, kind in found]
    text = {e: f"{short(e[0])} -> {short(e[1])} [{','.join(sorted(k))}]" for e, k in sorted(edges.items())}
    cycles = {}
    for label, kinds in (("all", {"top", "typing", "local"}), ("top", {"top"})):
        graph: dict[str, set[str]] = {}
        _ = [graph.setdefault(a, set()).update([b] if ks & kinds else []) for (a, b), ks in edges.items()]
        cycles[label] = [
            {
                "modules": [short(m) for m in c],
                "edges": [text[a, b] for a in c for b in sorted(graph[a]) if b in c],
            }
            for c in sccs(graph)
        ]
    big = sorted((n for n in mods if size[n] > LONG_MODULE), key=lambda n: -size[n])
    return {
        "modules": len(mods),
        "lines": sum(size[n] for n in mods),
        "module_lines": {short(n): size[n] for n in mods},
        "over_350": {short(n): size[n] for n in big},
        "bench": {"modules": len(files) - len(mods), "lines": sum(size[n] for n in files if n not in mods)},
        "edges": list(text.values()),
        "cycles": cycles,
        "long_functions": sorted(long, key=lambda f: -f[2]),
    }


def make_model():
    import torch.nn as nn  # uneven shapes over 2 ranks

    return nn.Sequential(*(nn.Linear(i, o) for i, o in ((7, 13), (13, 5), (5, 11), (11, 9))), nn.Linear(9, 3))


def _preadv(fd, buffers, offset, *rest, real=os.preadv):  # a stand-in whose arguments the hook sees
    return real(fd, buffers, offset, *rest)


def span(t) -> tuple[int, int]:
    """(address, bytes) of a memoryview, or of a tensor's whole storage."""
    if isinstance(t, memoryview):
        return (ctypes.addressof(ctypes.c_char.from_buffer(t)), t.nbytes) if t.nbytes else (0, 0)
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def tracer(events: list, keep: list):
    """A profile function appending ``(chain + [call], destination ranges)`` for every candidate call."""
    import torch
    import torch.distributed as dist

    torch_dir = os.path.dirname(torch.__file__)
    py = {inspect.unwrap(f).__code__: f"dist.{f.__name__}" for f in (dist.recv, dist.irecv, dist.broadcast)}
    py[_preadv.__code__] = "os.preadv"
    parents: dict[threading.Thread, list[str]] = {}

    def ours(frame) -> bool:
        f = frame.f_code.co_filename
        return f.startswith(str(PKG) + os.sep) and not f.startswith(str(PKG / "bench") + os.sep)

    def chain(frame) -> list[str] | None:
        names = []
        while frame is not None:
            code = frame.f_code  # co_qualname: Python 3.11+
            mod = short(module_name(Path(code.co_filename))) if ours(frame) else None
            names += [f"{mod}:{getattr(code, 'co_qualname', code.co_name)}"] if mod else []
            frame = frame.f_back
        me = threading.current_thread()
        names = (parents[me] + [f"[thread {me.name.split('_')[0]}]"] if me in parents else []) + names[::-1]
        starts = [i for i, n in enumerate(names) if n.endswith(":load_sharded")]
        return names[starts[0] :] if starts else None

    def prof(frame, event, arg):
        what, dests = None, []
        if event == "c_call" and ours(frame):
            if arg is os.pread:
                what = "os.pread"  # returns new bytes: never writes into a shard itself
            elif getattr(arg, "__name__", "") == "copy_" and torch.is_tensor(getattr(arg, "__self__", None)):
                what, dests = "Tensor.copy_", [arg.__self__]
        elif event == "call" and frame.f_code is threading.Thread.start.__code__:
            if c := chain(frame.f_back):
                parents[frame.f_locals["self"]] = c
        elif event == "call" and frame.f_code in py:
            caller = frame.f_back
            while caller is not None and caller.f_code.co_filename.startswith(torch_dir):
                caller = caller.f_back  # dist's wrappers
            if caller is not None and ours(caller):
                what, loc = py[frame.f_code], frame.f_locals
                dests = list(loc["buffers"]) if "buffers" in loc else [loc["tensor"]]
        if what and (c := chain(frame if event == "c_call" else frame.f_back)):
            keep.extend(dests)  # so that no destination is freed and its memory taken by a shard
            events.append((c + [what], list(map(span, dests))))

    return prof


def rank_main(rank: int, world: int, port: int, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh

    import rank0load

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    mesh, want = init_device_mesh("cpu", (world,)), load_file(f"{tmp}/ckpt/model.safetensors")
    out: dict = {"file": rank0load.__file__}
    os.preadv = _preadv
    for local in (True, False):
        events, keep = [], []
        threading.setprofile(prof := tracer(events, keep))
        sys.setprofile(prof)
        try:
            model = rank0load.load_sharded(make_model, f"{tmp}/ckpt", mesh, local_reads=local)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        state = model.state_dict()  # parameters and buffers
        shards = [span(t.to_local() if hasattr(t, "to_local") else t) for t in state.values()]
        landed = [c for c, at in events if any(a < s + m and s < a + n for a, n in at for s, m in shards)]
        got = {k: v.full_tensor() for k, v in state.items()}
        out[f"local_reads={local}"] = {
            "seen": Counter(c[-1] for c, _ in events),
            "landed": Counter(json.dumps(c) for c in landed),
            "weights_ok": got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want),
        }
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def runtime_report() -> dict:
    import torch.multiprocessing as mp
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(f"{tmp}/ckpt")
        save_file(make_model().state_dict(), f"{tmp}/ckpt/model.safetensors")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(rank_main, args=(2, port, tmp), nprocs=2, start_method="spawn")  # 120 s timeout
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    report: dict = {"imported": ranks[0]["file"]}
    for mode in ("local_reads=True", "local_reads=False"):
        landed = [(i, c, n) for i, r in enumerate(ranks) for c, n in r[mode]["landed"].items()]
        chains = [{"rank": i, "calls": n, "chain": json.loads(c)} for i, c, n in landed]
        chains = chains or [{"rank": None, "calls": 0, "chain": ["(no call wrote into a shard)"]}]
        frames = [[x for x in c["chain"][:-1] if not x.startswith("[")] for c in chains]
        best = max(range(len(chains)), key=lambda i: len(frames[i]))  # the first of the longest
        report[mode] = {
            "weights_ok": all(r[mode]["weights_ok"] for r in ranks),
            "seen": dict(sum((Counter(r[mode]["seen"]) for r in ranks), Counter())),
            "into": dict(sum((Counter({c["chain"][-1]: c["calls"]}) for c in chains), Counter())),
            "depth": len(frames[best]),
            "modules": sorted({x.split(":")[0] for x in frames[best]}),
            "rank": chains[best]["rank"],
            "chain": chains[best]["chain"],
            "all_chains": chains,
        }
    return report


def text(report: dict) -> list[str]:
    st, b, rt = report["static"], report["static"]["bench"], report.get("runtime", {})
    o = [f"1. modules: {st['modules']}, {st['lines']} lines (bench/: {b['modules']}, {b['lines']} lines)"]
    o += [f"   {n:5d}  {m}{' *' * (n > LONG_MODULE)}" for m, n in sorted(st["module_lines"].items())]
    o += [f"   * over {LONG_MODULE} lines: {len(st['over_350'])}: {', '.join(st['over_350'])}"]
    o += [f"2. import edges: {len(st['edges'])} (typing: if TYPE_CHECKING; local: in a function)"]
    o += [f"   {e}" for e in st["edges"]]
    for label, cycles in st["cycles"].items():
        o += [f"   import cycles over {label} edges: {len(cycles)}"]
        o += [f"   - {', '.join(c['modules'])}: {'; '.join(c['edges'])}" for c in cycles]
    bodies = sum(body > LONG_FUNCTION for *_, body in st["long_functions"])
    o += [
        f"3. functions over {LONG_FUNCTION} lines: {len(st['long_functions'])} "
        f"(of which {bodies} with a body over {LONG_FUNCTION} lines, docstring excluded)"
    ]
    o += [f"   {n:4d} (body {body:3d})  {mod}.{qual}" for mod, qual, n, body in st["long_functions"]]
    o += [f"4. longest chain load_sharded -> bytes in a shard (2 gloo ranks, CPU: {rt.get('imported', '-')})"]
    for mode in [m for m in rt if m != "imported"]:
        r = rt[mode]
        seen, into = (", ".join(f"{k} x{n}" for k, n in sorted(r[x].items())) for x in ("seen", "into"))
        o += [f"   {mode}: weights {'ok' if r['weights_ok'] else 'WRONG'}; calls {seen}; in a shard: {into}"]
        o += [f"     (a) depth {r['depth']} (rank {r['rank']}); (b) {len(r['modules'])} modules: "]
        o[-1] += f"{', '.join(r['modules'])}; (c) the chain:"
        d = [sum(y[0] != "[" for y in r["chain"][:i]) for i in range(len(r["chain"]))]
        o += [
            f"      {'' if x[0] == '[' else d[i]:>2} {x.replace(':', '.')}" for i, x in enumerate(r["chain"])
        ]
        o[-1] = f"         -> {r['chain'][-1]}"
    return o


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the text report")
    parser.add_argument("--no-runtime", action="store_true", help="static facts only (no 2-rank load)")
    args = parser.parse_args()
    sys.path.insert(0, str(PKG.parent))  # the ranks import the rank0load this script sits next to
    report = {"static": static_report(), **({} if args.no_runtime else {"runtime": runtime_report()})}
    print(json.dumps(report, indent=1) if args.json else "\n".join(text(report)))


if __name__ == "__main__":
    main()
