"""The default policy never puts two dtypes in one FSDP group, at any depth; a caller's shard_fn that
does is told so before any data moves; failures inside rank0load are named as rank0load's.

On 2 and 3 gloo ranks: a bf16 toy with an fp32 module two levels deep inside each block, an fp32 block
norm, and an fp32 head on top loads bit for bit (checkpoint hidden from ranks other than 0), runs a
forward and a backward step, and every FSDP group holds one dtype. Then, each raised the same on every
rank: a shard_fn with one group for everything (ModelMismatchError naming the module and the dtypes);
a module holding parameters of two dtypes itself, which no policy can split; an exception inside
rank0load's own code (InternalError, naming the versions, not model_fn); ``max_staging_bytes`` of
4 TiB; a ``.safetensors`` symlink to a device.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests import _dist
from tests.fakes import hide
from tests.models import assert_same, gather, own_mixed, reference

pytestmark = pytest.mark.slow


class Gate(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(x.float()))


class Router(nn.Module):  # the fp32 piece sits two levels below the block
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate = Gate(dim)


class MixedBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.router = Router(dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.router.gate(x).to(x.dtype)
        return x + g * self.fc(self.norm(x.float()).to(x.dtype))


class MixedNet(nn.Module):
    """bf16 body; fp32: each block's router (two levels down) and norm, and the head on top."""

    def __init__(self, vocab: int = 11, dim: int = 7, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(MixedBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h.float())


def mixed_net() -> MixedNet:
    model = MixedNet().to(torch.bfloat16)
    for b in model.blocks:
        b.router.float()
        b.norm.float()
    model.head.float()
    return model


def trained_mixed(seed: int = 0) -> MixedNet:
    torch.manual_seed(seed)
    model = mixed_net()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-1, 1)
    return model


def one_group(model: nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh)


IDS = torch.tensor([[1, 5, 9, 2], [4, 10, 8, 0]])


def _groups(model) -> list[tuple[str, list[str]]]:
    from rank0load.integrations._compat import fsdp_groups

    return [(name, sorted({str(p.dtype) for _, p in ps})) for name, _, ps in fsdp_groups(model)]


def _attempt(fn):
    import traceback

    try:
        return fn()
    except Exception as exc:
        return _dist.Raised(
            type(exc).__name__, tuple(c.__name__ for c in type(exc).__mro__), str(exc), traceback.format_exc()
        )


def _rank(rank: int, world: int, root: str) -> dict:
    import rank0load
    from rank0load.load import _model

    touched = hide(root) if rank != 0 and os.geteuid() == 0 else []
    good = os.path.join(root, "mixed.safetensors")
    out: dict = {"touched": touched}
    model = rank0load.load_sharded(mixed_net, good)
    out["tensors"] = gather(model)
    out["groups"] = _groups(model)
    logits = model(IDS)
    logits.float().square().mean().backward()
    out["logits"] = logits.detach()
    out["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    out["one_group"] = _attempt(lambda: rank0load.load_sharded(mixed_net, good, shard_fn=one_group))
    out["own_mixed"] = _attempt(lambda: rank0load.load_sharded(own_mixed, good, strict=False))
    original = _model.describe

    def broken(*args):
        raise AttributeError("'PreTrainedModel' has no attribute 'injected'")

    _model.describe = broken  # an exception inside rank0load's own build step
    try:
        out["internal"] = _attempt(lambda: rank0load.load_sharded(mixed_net, good))
    finally:
        _model.describe = original
    out["internal_reading"] = _attempt(lambda: _fails_matching_on_rank0(rank, good))
    out["staging"] = _attempt(lambda: rank0load.load_sharded(mixed_net, good, max_staging_bytes=4 << 40))
    out["device"] = _attempt(lambda: rank0load.load_sharded(mixed_net, os.path.join(root, "dev.safetensors")))
    out["after"] = sorted(gather(rank0load.load_sharded(mixed_net, good)))  # the group is still usable
    return out


def _fails_matching_on_rank0(rank: int, good: str) -> None:
    """A load in which rank 0's own code raises while it matches the headers to the model (the
    manifest's builder raises TypeError): rank 0 alone fails."""
    import rank0load
    from rank0load.checkpoint import _manifest

    original = _manifest._merge

    def broken(*args, **kwargs):
        raise TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'")

    if rank == 0:
        _manifest._merge = broken
    try:
        rank0load.load_sharded(mixed_net, good)
    finally:
        _manifest._merge = original


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def outcomes(request, tmp_path_factory) -> tuple[list[dict], nn.Module]:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("policy")
    ref = trained_mixed()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(root / "mixed.safetensors"))
    os.symlink("/dev/zero", root / "dev.safetensors")
    return _dist.ok(_dist.run(_rank, request.param, str(root), timeout=300)), ref


def test_fp32_modules_at_any_depth_load_and_train(outcomes):
    results, ref = outcomes
    torch.set_num_threads(1)
    logits = ref(IDS)
    logits.float().square().mean().backward()
    for r in results:
        assert r["touched"] == []
        assert_same(r["tensors"], reference(ref))
        assert torch.equal(r["logits"], logits.detach())
        for n, p in ref.named_parameters():
            torch.testing.assert_close(r["grads"][n], p.grad, rtol=2e-2, atol=1e-6, msg=n)
        assert all(len(dtypes) == 1 for _, dtypes in r["groups"]), r["groups"]
        fp32 = {name for name, dtypes in r["groups"] if dtypes == ["torch.float32"]}
        # Router has no forward of its own (it is never called): its Gate is the unit
        assert {"blocks.0.router.gate", "blocks.1.router.gate", "blocks.0.norm", "blocks.1.norm"} <= fp32


def _same(results: list[dict], case: str, cls: str) -> str:
    raised = [r[case] for r in results]
    return _dist.same_error(raised, cls).message


def test_a_shard_fn_that_mixes_dtypes_is_told_before_data_moves(outcomes):
    message = _same(outcomes[0], "one_group", "ModelMismatchError")
    for words in (
        "FSDP group of 'the root module'",
        "bfloat16: emb.weight",
        "float32: blocks.0.router.gate.proj.weight",
        "innermost first",
    ):
        assert words in message, message


def test_a_module_holding_two_dtypes_itself_cannot_be_split(outcomes):
    message = _same(outcomes[0], "own_mixed", "ModelMismatchError")
    assert "bfloat16: 0.w" in message and "float32: 0.scale" in message, message


def test_an_exception_inside_rank0load_is_named_as_ours(outcomes):
    message = _same(outcomes[0], "internal", "InternalError")
    assert "rank0load's own code raised AttributeError" in message, message
    assert "torch 2." in message and "report it" in message, message
    assert "model_fn" not in message and "disagree" not in message, message
    assert "RankMismatchError" not in outcomes[0][0]["internal"].bases


def test_an_exception_in_rank0s_reading_is_named_as_ours_on_every_rank(outcomes):
    """rank0load's own code failing on rank 0 while it matches the headers: every rank raises the
    same InternalError, naming the checkpoint, where it was raised and the versions, not the model."""
    message = _same(outcomes[0], "internal_reading", "InternalError")
    assert "rank 0 could not read checkpoint" in message and "mixed.safetensors" in message, message
    assert "rank0load's own code raised TypeError" in message and "read_manifest" in message, message
    assert "torch 2." in message and "report it" in message, message
    assert "model_fn" not in message, message


def test_max_staging_bytes_too_large_names_it(outcomes):
    message = _same(outcomes[0], "staging", "LoadError")
    assert f"max_staging_bytes={4 << 40}" in message and "bytes" in message, message
    assert "model_fn" not in message, message


def test_a_symlink_to_a_device_names_the_device(outcomes):
    message = _same(outcomes[0], "device", "CheckpointFormatError")
    assert "/dev/zero" in message and "character device" in message, message


def test_the_group_is_usable_after_every_failure(outcomes):
    results, ref = outcomes
    for r in results:
        assert r["after"] == sorted(reference(ref))
