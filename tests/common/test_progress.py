"""Progress bar, INFO summary and load report: rank 0 alone shows a bar (on a terminal, unless
HF_HUB_DISABLE_PROGRESS_BARS is set) and logs one INFO line per load; other ranks print and log
nothing; every rank gets a LoadReport with bytes, tensors, seconds, GB/s, peak RSS, the keys
that were missing or unexpected, and the model's FSDP groups (a bf16 model's fp32 head in a group of
its own, frozen blocks' dtypes apart).

HF_HUB_DISABLE_PROGRESS_BARS is read when huggingface_hub is imported, so it needs a fresh process
group: tests/checkpoint/test_hub.py's spawn, which sets it, checks that no bar appears on a terminal."""

from __future__ import annotations

import io
import logging
import sys

import pytest
import torch

from rank0load import FSDPGroup
from rank0load.__main__ import _listing
from tests import _dist
from tests.fakes import FakeTTY
from tests.models import HEAD_TOY_GROUPS, head_toy, save_state, toy


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[int, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.name, record.getMessage()))


def _rank(rank: int, world: int, path: str, partial_path: str, head_path: str) -> dict:
    import contextlib

    import rank0load
    import rank0load._api as api

    counted: list[int] = []
    shows: list[bool] = []
    real_bar = api.progress_bar

    @contextlib.contextmanager
    def counting_bar(total: int, show: bool):  # the real bar, plus a record of every byte count it is given
        shows.append(show)
        with real_bar(total, show) as update:

            def count(n: int) -> None:
                if show:
                    counted.append(n)
                update(n)

            yield count

    api.progress_bar = counting_bar
    handler = Records()
    root = logging.getLogger("rank0load")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    out: dict = {}
    real_stderr = sys.stderr
    try:
        sys.stderr = FakeTTY()
        model = rank0load.load_sharded(toy, path)
        out["tty"] = sys.stderr.getvalue()
        out["report"] = model.rank0load_report
        out["counted"], out["shows"] = list(counted), list(shows)
        api.progress_bar = real_bar
        sys.stderr = io.StringIO()
        rank0load.load_sharded(toy, path)
        out["pipe"] = sys.stderr.getvalue()
        sys.stderr = io.StringIO()
        model = rank0load.load_sharded(toy, partial_path, strict=False)
        out["partial_stderr"] = sys.stderr.getvalue()
        out["partial"] = model.rank0load_report
        out["head"] = rank0load.load_sharded(head_toy, head_path).rank0load_report
    finally:
        sys.stderr = real_stderr
    with open("/proc/self/status") as f:
        out["rss_now"] = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    out["records"] = handler.records
    return out


def _partial(path: str, tmp) -> tuple[str, dict]:
    """The checkpoint at ``path`` less ``bn.weight`` plus an ``extra.weight``; and its full state."""
    from safetensors.torch import load_file, save_file

    state = load_file(path)
    partial = dict(state)
    del partial["bn.weight"]
    partial["extra.weight"] = torch.ones(3)
    save_file(partial, str(tmp / "partial.safetensors"))
    return str(tmp / "partial.safetensors"), state


@pytest.fixture(scope="module")
def shown(tmp_path_factory, toy_checkpoint):
    tmp = tmp_path_factory.mktemp("progress")
    partial, state = _partial(toy_checkpoint, tmp)
    save_state(head_toy(), str(tmp / "head.safetensors"))
    return state, _dist.ok(_dist.run(_rank, 2, toy_checkpoint, partial, str(tmp / "head.safetensors")))


def test_bar_on_rank0_terminal_only(shown):
    _, (r0, r1) = shown
    assert "rank0load" in r0["tty"] and "B/s" in r0["tty"], r0["tty"]
    assert r0["pipe"] == "" and r0["partial_stderr"] == ""  # not a terminal: no bar
    assert r1["tty"] == r1["pipe"] == r1["partial_stderr"] == ""  # other ranks print nothing
    # The bar is fed every byte of the checkpoint once, on rank 0; no other rank makes a bar.
    assert sum(r0["counted"]) == r0["report"].bytes and len(r0["counted"]) >= r0["report"].tensors
    assert r0["shows"] == [True] and r1["shows"] == [False] and r1["counted"] == []


def test_one_info_line_per_load_from_rank0_only(shown):
    _, (r0, r1) = shown
    infos = [m for level, _, m in r0["records"] if level == logging.INFO]
    assert len(infos) == 4, r0["records"]
    assert all("GB/s" in m and "peak RSS" in m and "tensors" in m for m in infos), infos
    assert "over 2 ranks in 3 FSDP groups" in infos[0] and "in 4 FSDP groups" in infos[3], infos
    warnings = [m for level, _, m in r0["records"] if level == logging.WARNING]
    assert len(warnings) == 2 and "bn.weight" in warnings[0] + warnings[1]
    assert [rec for rec in r1["records"] if rec[0] >= logging.INFO] == []


def test_load_report(shown):
    state, results = shown
    for rank, r in enumerate(results):
        rep = r["report"]
        assert rep.tensors == len(state)
        assert rep.bytes == sum(t.numel() * t.element_size() for t in state.values())
        assert rep.seconds > 0 and rep.stream_seconds > 0 and rep.gb_per_s > 0
        assert rep.gb_per_s == pytest.approx(rep.bytes / 1e9 / rep.stream_seconds)
        assert (rep.rank, rep.world_size) == (rank, 2)
        assert 0 < r["rss_now"] <= rep.peak_rss_bytes * 1.5 and rep.peak_rss_bytes > 50e6
        assert rep.missing == () and rep.unexpected == ()
        partial = r["partial"]
        assert partial.missing == ("bn.weight",) and partial.unexpected == ("extra.weight",)


def test_load_report_lists_the_fsdp_groups(shown):
    _, results = shown
    f32 = (torch.float32,)
    for r in results:  # the same on every rank; elements are the whole parameters'
        assert r["report"].fsdp_groups == (
            FSDPGroup("", 3, 45, f32, ()),  # emb.weight (head.weight tied to it, once), bn.weight, bn.bias
            FSDPGroup("blocks.0", 4, 40, f32, ()),
            FSDPGroup("blocks.1", 4, 40, f32, ()),
        )
        assert r["partial"].fsdp_groups == r["report"].fsdp_groups
        assert r["head"].fsdp_groups == tuple(FSDPGroup(*g) for g in HEAD_TOY_GROUPS)


def test_fsdp_group_text():
    groups = (
        FSDPGroup("", 1, 1234567, (torch.bfloat16,), (torch.float32,)),
        FSDPGroup("layers.0", 9, 90, (), (torch.bfloat16, torch.float32)),
        FSDPGroup("head", 2, 8, (torch.float32,), ()),
    )
    assert str(groups[0]) == "(root): 1 parameter, 1,234,567 elements, trainable bfloat16, frozen float32"
    assert str(groups[1]) == "layers.0: 9 parameters, 90 elements, frozen bfloat16 + float32"
    assert _listing("FSDP groups", groups, limit=2) == [
        "FSDP groups (3):",
        "  (root): 1 parameter, 1,234,567 elements, trainable bfloat16, frozen float32",
        "  layers.0: 9 parameters, 90 elements, frozen bfloat16 + float32",
        "  ... and 1 more",
    ]
    assert _listing("FSDP groups", groups)[-1] == "  head: 2 parameters, 8 elements, trainable float32"
