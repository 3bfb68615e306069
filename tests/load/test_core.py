"""load_sharded's contract beyond the happy path of test_toy: rank 0 alone touches the checkpoint,
strict=False with a new head, key_map, the ways to name a checkpoint."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests import _dist, hf
from tests.fakes import hide
from tests.models import assert_same, gather, reference, save_sharded, save_state, toy, toy_state, trained_toy


def _load_hidden(rank: int, world: int, hidden: str, ckpt: str) -> dict:
    import rank0load

    touched: list[str] = []
    if rank != 0:
        touched = hide(hidden)
        assert not os.path.exists(ckpt), "the checkpoint is still visible on this rank"
    model = rank0load.load_sharded(toy, ckpt)
    return {"tensors": gather(model), "touched": list(touched)}


@pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")
@pytest.mark.parametrize("layout", [pytest.param("dir", marks=pytest.mark.slow), "index"])
def test_only_rank0_touches_the_checkpoint(tmp_path, toy_reference, layout):
    """The checkpoint does not exist for ranks other than 0 (a tmpfs hides it): they load anyway."""
    root = tmp_path / "node0"  # in tmp_path, which the other ranks hide: not a shared fixture
    root.mkdir()
    if layout == "dir":
        save_state(trained_toy(), str(root / "model.safetensors"))
        ckpt = str(root)
    else:
        save_sharded(toy_state(), str(root))
        ckpt = str(root / "model.safetensors.index.json")
    results = _dist.ok(_dist.run(_load_hidden, 3, str(tmp_path), ckpt))
    for r in results:
        assert_same(r["tensors"], toy_reference)
        assert r["touched"] == []


def _load(rank: int, world: int, ckpt: str, kwargs: dict, fn=toy) -> dict:
    import rank0load

    model = rank0load.load_sharded(fn, ckpt, **kwargs)
    return {"tensors": gather(model), "report": model.rank0load_report}


def _load_each(rank: int, world: int, loads: list[tuple[str, dict]], fn=toy) -> list:
    """``_load`` of each (checkpoint, kwargs) in turn, in one process group (one spawn, not one per
    load: a rank's start-up costs more than these loads). A load that raises gives its
    :class:`_dist.Raised` and ends the list: the ranks may be out of step after it."""
    import traceback

    out: list = []
    for ckpt, kwargs in loads:
        try:
            out.append(_load(rank, world, ckpt, kwargs, fn))
        except Exception as exc:
            bases = tuple(c.__name__ for c in type(exc).__mro__)
            out.append(_dist.Raised(type(exc).__name__, bases, str(exc), traceback.format_exc()))
            break
    return out


@pytest.mark.slow  # one 2-rank spawn, four loads
def test_ways_to_name_a_checkpoint(tmp_path, toy_sharded, toy_reference):
    """A .safetensors file, an index .json, and a directory holding either; 2 ranks each."""
    single = tmp_path / "single"
    single.mkdir()
    save_state(trained_toy(), str(single / "weights.safetensors"))  # not named model.safetensors
    index = os.path.join(toy_sharded, "model.safetensors.index.json")
    ckpts = [str(c) for c in (single / "weights.safetensors", single, index, toy_sharded)]
    per_rank = _dist.ok(_dist.run(_load_each, 2, [(c, {}) for c in ckpts]))
    for i in range(len(ckpts)):  # in order: the first failed load is on every rank's list
        for r in _dist.ok([done[i] for done in per_rank]):
            assert_same(r["tensors"], toy_reference)


def _renaming(key: str) -> str | None:
    if key == "debug.note":
        return None
    return key.replace("backbone.", "").replace("tok_embeddings", "emb")


@pytest.mark.slow
def test_key_map(tmp_path, toy_reference):
    from safetensors.torch import save_file

    renamed = {f"backbone.{k}".replace("emb", "tok_embeddings"): v for k, v in toy_state().items()}
    renamed["debug.note"] = torch.zeros(3)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    results = _dist.ok(_dist.run(_load, 3, str(tmp_path), {"key_map": _renaming}))
    for r in results:
        assert_same(r["tensors"], toy_reference)
        assert r["report"].ignored == ("debug.note",)


@pytest.mark.slow
def test_key_with_a_newline_in_files_without_an_index(tmp_path, toy_reference):
    """Two files and no index: an unexpected key holding a newline is one key (strict=False skips
    it), not a key stored twice nor a checkpoint that changed during the load."""
    from safetensors.torch import save_file

    state = toy_state()
    keys = sorted(state)
    save_file({k: state[k] for k in keys[:4]}, str(tmp_path / "a.safetensors"))
    rest = {k: state[k] for k in keys[4:]}
    save_file({**rest, "odd\nkey": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    results = _dist.ok(_dist.run(_load, 2, str(tmp_path), {"strict": False}))
    for r in results:
        assert_same(r["tensors"], toy_reference)
        assert r["report"].unexpected == ("odd\nkey",)


class WithHead(nn.Module):
    """A pretrained body (the Toy) plus a new head and norm the checkpoint does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.body = toy()
        self.new_norm = nn.LayerNorm(5)
        self.new_head = nn.Linear(5, 3)


def _with_head() -> nn.Module:
    return WithHead()


@pytest.mark.slow  # one 2-rank spawn, two loads
def test_new_head_strict_false(tmp_path, toy_reference):
    """Missing parameters get the model's own initialisation (reset_parameters), never
    uninitialised memory; the body loads bit for bit; strict=True refuses."""
    from safetensors.torch import save_file

    state = {f"body.{k}": v for k, v in toy_state().items()}
    save_file(state, str(tmp_path / "model.safetensors"))

    loads = [(str(tmp_path), {"strict": False}), (str(tmp_path), {})]  # the refusal last
    per_rank = _dist.ok(_dist.run(_load_each, 2, loads, _with_head))
    results = _dist.ok([done[0] for done in per_rank])
    want = {f"body.{k}": v for k, v in toy_reference.items()}
    for r in results:
        got = r["tensors"]
        for k, v in want.items():
            assert torch.equal(got[k], v), k
        assert torch.equal(got["new_norm.weight"], torch.ones(5))
        assert torch.equal(got["new_norm.bias"], torch.zeros(5))
        w, b = got["new_head.weight"], got["new_head.bias"]
        bound = 1 / 5**0.5  # nn.Linear.reset_parameters: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        assert torch.isfinite(w).all() and w.abs().max() <= bound and w.std() > bound / 10
        assert torch.isfinite(b).all() and b.abs().max() <= bound and b.abs().sum() > 0
        assert sorted(r["report"].missing) == [
            "new_head.bias",
            "new_head.weight",
            "new_norm.bias",
            "new_norm.weight",
        ]

    err = _dist.same_error([done[1] for done in per_rank], "ModelMismatchError")
    assert "new_head.weight" in err.message and "strict=False" in err.message


def _hf_classifier(rank: int, world: int, ckpt: str) -> dict:
    import transformers

    import rank0load

    hf._quiet()
    fn = lambda: transformers.LlamaForSequenceClassification(hf.config("llama"))
    model = rank0load.load_sharded(fn, ckpt, strict=False)
    return {"tensors": gather(model), "report": model.rank0load_report}


@pytest.mark.slow  # imports transformers on every rank
def test_transformers_new_head_uses_init_weights(tmp_path):
    """A causal-LM checkpoint loaded into the sequence-classification model: `score` is new and
    gets transformers' own _init_weights (normal, std=initializer_range), the body loads exactly."""
    ref = hf.pretrained("llama")
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    results = _dist.ok(_dist.run(_hf_classifier, 2, str(tmp_path)))
    want = reference(ref)
    std = hf.config("llama").initializer_range
    for r in results:
        got = r["tensors"]
        for k, v in want.items():
            if k.startswith("model."):
                assert torch.equal(got[k], v), k
        score = got["score.weight"]
        assert torch.isfinite(score).all()
        assert 0.5 * std < score.std().item() < 2 * std  # normal(0, 0.02), not kaiming, not garbage
        assert r["report"].missing == ("score.weight",)
        assert r["report"].unexpected == ()


class BodyAndFp32Head(nn.Module):
    """A bf16 body with an fp32 head added on top: FSDP2 refuses one group with mixed original
    dtypes (at the first forward), so the default policy must give the head its own group."""

    def __init__(self) -> None:
        super().__init__()
        self.body = toy().to(torch.bfloat16)
        self.value_head = nn.Linear(7, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.value_head(self.body(ids).float())


def _ids(rank: int) -> torch.Tensor:
    return (torch.tensor([[1, 2, 3], [4, 5, 6]]) + rank) % 7  # the toy's vocabulary


def _mixed_dtype_forward(rank: int, world: int, ckpt: str) -> dict:
    import rank0load

    model = rank0load.load_sharded(BodyAndFp32Head, ckpt)
    loaded = gather(model)
    out = model.eval()(_ids(rank))  # each rank its own batch
    out.sum().backward()  # FSDP2 runs its all-gathers and reduce-scatters for both groups
    return {
        "tensors": loaded,
        "out": out.detach(),
        "grads": all(p.grad is not None for p in model.parameters() if p.requires_grad),
    }


@pytest.mark.slow  # 3 ranks, forward and backward
def test_default_policy_separates_a_head_of_another_dtype(tmp_path):
    torch.manual_seed(0)
    ref = BodyAndFp32Head()
    with torch.no_grad():
        for p in ref.parameters():
            p.uniform_(-1, 1)
    save_state(ref, str(tmp_path / "model.safetensors"))
    results = _dist.ok(_dist.run(_mixed_dtype_forward, 3, str(tmp_path)))
    want = reference(ref)
    for rank, r in enumerate(results):
        with torch.no_grad():
            out_ref = ref.eval()(_ids(rank))
        assert_same(r["tensors"], want)
        assert r["grads"]
        torch.testing.assert_close(r["out"], out_ref, rtol=0, atol=1e-2)


def _collector(rank: int, world: int, ckpt: str, missing: str) -> dict:
    """Whether the garbage collector was on while the bytes streamed, and after each load: a clean
    one, a failing one (a checkpoint that is not there), and one the caller started with it off."""
    import gc

    import rank0load
    from rank0load import _api

    streaming: list[bool] = []
    stream = _api._transfer.stream

    def watched(*args, **kwargs):
        streaming.append(gc.isenabled())
        return stream(*args, **kwargs)

    _api._transfer.stream = watched
    try:
        rank0load.load_sharded(toy, ckpt)
        after_load = gc.isenabled()
        try:
            rank0load.load_sharded(toy, missing)
            failed = None
        except rank0load.LoadError as exc:
            failed = type(exc).__name__
        after_error = gc.isenabled()
        gc.disable()
        rank0load.load_sharded(toy, ckpt)
        kept_off = not gc.isenabled()
        gc.enable()
    finally:
        _api._transfer.stream = stream
    return {"streaming": streaming, "after": (after_load, after_error, kept_off), "failed": failed}


def test_the_collector_is_off_while_streaming_and_back_as_it_was(tmp_path, toy_sharded):
    """The collector is paused from the headers to the stream's end (each collection would walk the
    manifest, plan and targets: at 16 x 256 experts the stream took 11.7 s with it on, 6.3 off), and
    left as the caller had it afterwards, a failed load included."""
    results = _dist.ok(_dist.run(_collector, 2, toy_sharded, str(tmp_path / "absent")))
    for r in results:
        assert r["streaming"] == [False, False], r  # the two loads that reached the stream
        assert r["after"] == (True, True, True), r
        assert r["failed"] is not None, r
