"""Property: whatever is done to a valid safetensors file, ``load_sharded`` either loads it exactly
as the safetensors reference implementation reads it, or raises a ``LoadError`` — never another
exception, a crash or a hang.

Most examples run in this process on a one-rank gloo group (spawning ranks per example would be
far too slow); a handful of mutated files then run on two ranks, where every rank must reach the
same outcome.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import signal
import struct
import tempfile

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from tests import _dist
from tests.models import ALL_DTYPES, save_state, toy, trained_toy

EXAMPLE_SECONDS = 20  # one in-process load; a hang fails the example instead of the suite
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _valid_file() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.safetensors")
        save_state(trained_toy(), path)
        return open(path, "rb").read()


VALID = _valid_file()
(N,) = struct.unpack("<Q", VALID[:8])
HEADER = json.loads(VALID[8 : 8 + N])
DATA = VALID[8 + N :]
KEYS = sorted(k for k in HEADER if k != "__metadata__")


def _assemble(header: object, data: bytes = DATA) -> bytes:
    hb = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(hb)) + hb + data


# --------------------------------------------------------------------------------------------
# Checking one candidate file.


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
    return out


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""


def outcome(path: str, mesh=None) -> tuple[str, object]:
    """("error", (class, message)) for a LoadError, ("ok", {key: bytes}) for a load; anything else raises."""
    import rank0load

    try:
        model = rank0load.load_sharded(toy, path, mesh)
    except rank0load.LoadError as exc:
        return "error", (type(exc).__name__, str(exc))
    return "ok", {k: (str(t.dtype), tuple(t.shape), _bits(t)) for k, t in _model_tensors(model).items()}


def expect_reference(path: str, loaded: dict) -> None:
    """A file we loaded must load in safetensors too, to the same bits (cast like the model, if at all)."""
    from safetensors.torch import load_file

    try:
        ref = load_file(path)
    except Exception as exc:
        pytest.fail(f"load_sharded accepted a file safetensors refuses: {type(exc).__name__}: {exc}")
    aliases = {"head.weight": "emb.weight"}
    for key, (dtype, shape, bits) in loaded.items():
        stored = ref.get(key, ref.get(aliases.get(key, ""), None))
        if stored is None:
            assert key == "scale", f"loaded {key!r}, which the file does not store"  # non-persistent buffer
            continue
        want = stored if str(stored.dtype) == dtype else stored.to(getattr(torch, dtype.split(".")[1]))
        assert tuple(want.shape) == shape, f"{key}: shape {shape} != stored {tuple(want.shape)}"
        assert bits == _bits(want), f"{key}: loaded bytes differ from what safetensors reads"


@contextlib.contextmanager
def _time_limit(seconds: int):
    def on_alarm(signum, frame):
        raise TimeoutError(f"load_sharded still running after {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A one-rank gloo process group in this process, and its mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.fail("a process group is already initialised in the test process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def check(one_rank, tmp_path):
    counter = [0]

    def run(raw: bytes) -> str:
        counter[0] += 1
        path = str(tmp_path / f"m{counter[0]}.safetensors")
        with open(path, "wb") as f:
            f.write(raw)
        with _time_limit(EXAMPLE_SECONDS):
            kind, value = outcome(path, one_rank)
        if kind == "ok":
            expect_reference(path, value)  # type: ignore[arg-type]
        if currently_in_test_context():  # --hypothesis-show-statistics: how often each outcome occurs
            event("loaded" if kind == "ok" else value[0])  # type: ignore[index]
        os.unlink(path)
        return kind

    return run


def test_valid_file_loads(check):
    """The unmutated file loads (so the properties below are not vacuous)."""
    assert check(VALID) == "ok"


# --------------------------------------------------------------------------------------------
# Mutations.


@FUZZ
@given(length=st.one_of(st.integers(0, 2**64 - 1), st.integers(-40, 40).map(lambda d: max(0, N + d))))
def test_header_length(check, length):
    check(struct.pack("<Q", length) + VALID[8:])


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(8, 8 + N - 1), st.integers(0, 255)), min_size=1, max_size=4))
def test_header_bytes(check, edits):
    raw = bytearray(VALID)
    for pos, value in edits:
        raw[pos] = value
    check(bytes(raw))


# Digits, quotes and brackets: edits that keep the header JSON-ish but change numbers and strings.
@FUZZ
@given(
    edits=st.lists(
        st.tuples(st.integers(8, 8 + N - 1), st.sampled_from(b'0123456789[],"{}: -.eE')),
        min_size=1,
        max_size=3,
    )
)
def test_header_json_characters(check, edits):
    raw = bytearray(VALID)
    for pos, value in edits:
        raw[pos] = value
    check(bytes(raw))


# Every dtype string safetensors defines, and some it does not (unknown ones must be refused).
_DTYPE_NAMES = [*ALL_DTYPES, "F6_E3M2", "F7", "", "f32", "I128"]
_ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 2**65) | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=2),
    max_leaves=4,
)
_FIELD_VALUES = {
    "dtype": st.sampled_from(_DTYPE_NAMES) | _ANY_JSON,
    "shape": st.lists(st.integers(-2, 12), max_size=3)
    | st.lists(st.integers(0, 2**63), max_size=2)
    | _ANY_JSON,
    "data_offsets": st.lists(st.integers(-2, len(DATA) + 8), min_size=0, max_size=3)
    | st.tuples(st.integers(-8, 8), st.integers(-8, 8)).map(list)
    | _ANY_JSON,
}


@st.composite
def _header_edit(draw):
    header = json.loads(json.dumps(HEADER))
    key = draw(st.sampled_from(KEYS))
    action = draw(
        st.sampled_from(
            [
                "set",
                "set",
                "set",
                "shift",
                "delete_field",
                "drop_key",
                "rename_key",
                "metadata",
                "extra_field",
            ]
        )
    )
    if action == "set":
        name = draw(st.sampled_from(sorted(_FIELD_VALUES)))
        header[key][name] = draw(_FIELD_VALUES[name])
    elif action == "shift":  # move a tensor's range a little: overlaps, gaps, out of range
        begin, end = header[key]["data_offsets"]
        db, de = draw(st.integers(-8, 8)), draw(st.integers(-8, 8))
        header[key]["data_offsets"] = [begin + db, end + de]
    elif action == "delete_field":
        del header[key][draw(st.sampled_from(sorted(_FIELD_VALUES)))]
    elif action == "drop_key":
        del header[key]
    elif action == "rename_key":
        header[draw(st.text(max_size=8))] = header.pop(key)
    elif action == "metadata":
        header["__metadata__"] = draw(_ANY_JSON)
    else:
        header[key][draw(st.text(max_size=5))] = draw(_ANY_JSON)
    return header


@FUZZ
@given(header=_header_edit())
def test_header_fields(check, header):
    check(_assemble(header))


@FUZZ
@given(
    edits=st.lists(st.tuples(st.integers(0, len(DATA) - 1), st.integers(0, 255)), min_size=1, max_size=8),
    cut=st.one_of(st.none(), st.integers(0, len(VALID) - 1)),
    extra=st.binary(max_size=16),
)
def test_data_bytes_and_length(check, edits, cut, extra):
    """Flipped data bytes load (and must match safetensors exactly); truncation or trailing bytes fail."""
    data = bytearray(DATA)
    for pos, value in edits:
        data[pos] = value
    raw = VALID[: 8 + N] + bytes(data)
    raw = (raw[:cut] if cut is not None else raw) + extra
    kind = check(raw)
    if cut is None and not extra:
        assert kind == "ok", "changing only data bytes must still load"


# --------------------------------------------------------------------------------------------
# A few mutated files on two ranks: every rank reaches the same outcome.


def _mutants(seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    data = bytearray(DATA)
    for _ in range(6):
        data[rng.randrange(len(data))] = rng.randrange(256)
    out.append(VALID[: 8 + N] + bytes(data))  # loads, with different values
    raw = bytearray(VALID)
    raw[8 + rng.randrange(N)] = ord("]")
    out.append(bytes(raw))  # header no longer JSON
    header = json.loads(json.dumps(HEADER))
    header["bn.bias"]["data_offsets"] = list(header["bn.weight"]["data_offsets"])
    out.append(_assemble(header))  # overlap
    header = json.loads(json.dumps(HEADER))
    header["emb.weight"]["shape"] = [5, 7]
    out.append(_assemble(header))  # same bytes, shape the model does not have
    out.append(VALID[:-3])  # truncated
    out.append(struct.pack("<Q", len(VALID)) + VALID[8:])  # header length past the end
    return out


def _two_rank_outcomes(rank: int, world: int, paths: list[str]) -> list:
    return [outcome(p) for p in paths]


@pytest.mark.slow  # a 2-rank spawn; the in-process examples above stay in the quick loop
def test_mutated_files_on_two_ranks(tmp_path):
    paths = []
    for i, raw in enumerate(_mutants()):
        paths.append(str(tmp_path / f"m{i}.safetensors"))
        with open(paths[-1], "wb") as f:
            f.write(raw)
    r0, r1 = _dist.ok(_dist.run(_two_rank_outcomes, 2, paths, timeout=120, pg_timeout=30))
    kinds = [o[0] for o in r0]
    assert kinds == ["ok", "error", "error", "error", "error", "error"], kinds
    for path, a, b in zip(paths, r0, r1):
        assert a == b, f"{path}: ranks disagree: {a[0]} vs {b[0]}"
        if a[0] == "ok":
            expect_reference(path, a[1])
