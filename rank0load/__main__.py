"""``python -m rank0load inspect PATH_OR_REPO [--model MODULE:FACTORY [--key-map MODULE:FUNCTION]]``
(also the ``rank0load`` script).

Reads headers only (one process, no tensor data). With --model, also shards the meta model with the
default policy over a one-rank gloo world of its own and lists its FSDP groups (no collectives).
Exit codes, for scripts:

    0  the checkpoint is readable (and, with --model, its keys, shapes and dtypes fit the model; tied
       names it stores twice are listed, since only a load compares their values)
    1  --model given: missing, unexpected or mismatched (shape / dtype) keys were found, or an FSDP
       group of the default policy would hold trainable parameters of two dtypes
    2  the checkpoint cannot be found or read (malformed file or index), or a bad command line
    3  --model / --key-map: could not be imported, the factory failed to build the model, or
       the key map failed on a key (raised, returned a non-str, mapped two keys to one)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

from .checkpoint._inspect import Inspection, inspect_checkpoint, load_factory
from .errors import LoadError, ModelMismatchError

EXIT_OK, EXIT_MISMATCH, EXIT_UNREADABLE, EXIT_MODEL = 0, 1, 2, 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rank0load",
        description="Tools for rank0load checkpoints.",
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ins = sub.add_parser(
        "inspect",
        help="files, tensors, dtypes and sizes of a checkpoint; with --model, a dry run of the key matching",
        description="Summarise a safetensors checkpoint from its headers. With --model, build the model on "
        "meta and report missing, unexpected and mismatched keys and the FSDP groups the default policy "
        "makes (a dry run: no data is read).",
    )
    ins.add_argument(
        "path", metavar="PATH_OR_REPO", help="directory, .safetensors file, index .json or Hub repo id"
    )
    ins.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) for a repo id")
    ins.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        default=None,
        help="zero-argument callable building the model, e.g. mypkg.models:build",
    )
    ins.add_argument(
        "--key-map",
        metavar="MODULE:FUNCTION",
        default=None,
        help="the key_map load_sharded would get: checkpoint key -> model key, or None to drop the key "
        "(needs --model)",
    )
    ins.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


# (Inspection field, its heading in the text): the key lists, in the order the text shows them
_LISTS = (
    ("missing", "missing from the checkpoint"),
    ("unexpected", "unexpected in the checkpoint"),
    ("converted", "assembled or dequantised (conversions)"),
    ("mismatched", "mismatched"),
    ("ignored", "ignored (dropped by the key map, or non-persistent buffers in the model)"),
    (
        "tied_twice",
        "tied names stored more than once (their values are not read here: a load compares them and "
        "raises if they differ)",
    ),
)


def _listing(title: str, items: Sequence[object], limit: int = 20) -> list[str]:
    lines = [f"{title} ({len(items)}):", *(f"  {k}" for k in items[:limit])]
    if len(items) > limit:
        lines.append(f"  ... and {len(items) - limit} more")
    return lines


def _text(result: Inspection, model_spec: str | None, key_map_spec: str | None) -> str:
    lines = [f"checkpoint: {result.checkpoint}", f"files: {len(result.files)}"]
    for f in result.files:
        lines.append(f"  {f.name}  {_size(f.bytes)}  {f.tensors} tensors")
    lines.append(f"tensors: {result.tensors}, {_size(result.total_bytes)} of data")
    lines.append("dtypes: " + ", ".join(f"{d} {n} ({_size(b)})" for d, (n, b) in result.dtypes.items()))
    if result.largest is not None:
        t = result.largest
        lines.append(f"largest: {t.key} {t.dtype} {list(t.shape)} {_size(t.nbytes)}")
    if result.model_checked:
        mapped = f" (key map {key_map_spec})" if key_map_spec else ""
        lines.append(
            f"model {model_spec}: {result.model_tensors} tensors, {result.matched} found in the checkpoint{mapped}"
        )
        for name, title in _LISTS:
            keys = getattr(result, name)
            if keys:
                lines += _listing(title, keys)
        if result.fsdp_groups is None:
            lines.append(f"FSDP groups: not listed ({result.fsdp_unlisted})")
        else:
            lines += _listing("FSDP groups, default policy", result.fsdp_groups)
        if result.replicated:
            lines += _listing(
                "replicated (kept out of FSDP: a full copy on every rank, gradients averaged over the ranks)",
                result.replicated,
            )
        if not result.fits:
            lines.append("does NOT fit the model")
        elif result.tied_twice:
            lines.append(
                "keys, shapes and dtypes fit the model; the values of tied names stored twice are unchecked"
            )
        else:
            lines.append("fits the model")
    return "\n".join(lines)


def _json(result: Inspection) -> str:
    found = {**asdict(result), "fits": result.fits}
    found["dtypes"] = {d: {"tensors": n, "bytes": b} for d, (n, b) in result.dtypes.items()}
    t = result.largest
    if t is not None:
        found["largest"] = {"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes}
    return json.dumps(
        found,
        indent=2,
        default=lambda dtype: str(dtype).removeprefix("torch."),  # the groups' torch.dtypes
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (see the module docstring)."""
    parser = _parser()
    args = parser.parse_args(argv)  # a bad command line exits with 2
    if args.key_map is not None and args.model is None:
        parser.error("--key-map needs --model: it maps checkpoint keys to the model's")
    loaded: dict[str, Callable[..., Any]] = {}
    for option, spec in (("--model", args.model), ("--key-map", args.key_map)):
        if spec is None:
            continue
        try:
            loaded[option] = load_factory(spec, option)
        except (ImportError, AttributeError, ValueError, TypeError) as exc:
            return _fail(f"cannot load {option} {spec!r}: {type(exc).__name__}: {exc}", EXIT_MODEL)
    try:
        with _stdout_to_stderr():
            result = inspect_checkpoint(
                args.path,
                revision=args.revision,
                model_fn=loaded.get("--model"),
                key_map=loaded.get("--key-map"),
            )
    except ModelMismatchError as exc:  # only the key map raises it: key mismatches are reported
        return _fail(f"--key-map {args.key_map}: {exc}", EXIT_MODEL)
    except LoadError as exc:  # resolving or reading the checkpoint
        return _fail(f"{type(exc).__name__}: {exc}", EXIT_UNREADABLE)
    except Exception as exc:
        return _fail(f"--model {args.model} failed to build: {type(exc).__name__}: {exc}", EXIT_MODEL)
    print(_json(result) if args.json else _text(result, args.model, args.key_map))
    return EXIT_OK if result.fits else EXIT_MISMATCH


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """While inspecting, whatever the model factory, transformers or torch print goes to stderr, so
    stdout holds the report alone (--json is parsed by scripts): Python's ``sys.stdout`` and file
    descriptor 1, which C++ writes to (torch 2.10's gloo prints its connection to stdout when the
    one-rank world for --model starts)."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no descriptor 1: nothing to keep clean
        saved = -1
    if saved >= 0:
        os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved >= 0:
            _flush_c_stdio()  # C++ output still buffered (stdout a pipe) must go to stderr too
            os.dup2(saved, 1)
            os.close(saved)


def _flush_c_stdio() -> None:
    """``fflush(NULL)``: write out every C stdio buffer (``std::cout`` shares them)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)


def _fail(message: str, code: int) -> int:
    print(f"rank0load inspect: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
