"""The default policy never puts two dtypes in one FSDP group, at any depth; a caller's shard_fn that
does is told so before any data moves; failures inside rank0load are named as rank0load's.

On 2 and 3 gloo ranks: a bf16 toy with an fp32 module two levels deep inside each block, an fp32 block
norm, and an fp32 head on top loads bit for bit (checkpoint hidden from ranks other than 0), runs a
forward and a backward step, and every FSDP group holds one dtype. A module holding parameters of two
dtypes itself (no group can take one apart) loads with the odd one replicated and trains in step with the
one-process reference, on a 1-D and an HSDP mesh. Then, each raised the same on every
rank: a shard_fn with one group for everything (ModelMismatchError naming the module and the dtypes);
an exception inside
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
    from torch.distributed.device_mesh import init_device_mesh

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
    for name, shape, dims in (("fsdp", (world,), ("shard",)), ("hsdp", (world, 1), ("replicate", "shard"))):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
        out[f"own_mixed_{name}"] = _train_own_mixed(rank, os.path.join(root, "own_mixed.safetensors"), mesh)
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


def own_mixed_batch(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows at ``step``: ``scale`` is used by every rank at step 0, by rank 0 alone at
    step 1, by none at step 2."""
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * step + rank))
    uses = step == 0 or (step == 1 and rank == 0)
    x[:, 0] = x[:, 0].abs() + 0.1 if uses else -x[:, 0].abs() - 0.1
    return x


OWN_MIXED_STEPS = 3


def _train_own_mixed(rank: int, path: str, mesh) -> dict:
    """Load own_mixed (``0.scale`` replicated), then AdamW steps with rank0load.clip_grad_norm_, each
    rank its own rows; rank 0 alone runs extra forwards under no_grad and in eval (nothing may be
    issued, or the ranks' collectives would mismatch)."""
    from torch.distributed.tensor import DTensor

    import rank0load

    model = rank0load.load_sharded(own_mixed, path, mesh)
    out: dict = {"replicated": model.rank0load_report.replicated, "grads": [], "norms": [], "params": []}
    out["plain"] = not isinstance(model[0].scale, DTensor) and isinstance(model[0].w, DTensor)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(OWN_MIXED_STEPS):
        if rank == 0:
            with torch.no_grad():
                model(own_mixed_batch(step, 1))
        model(own_mixed_batch(step, rank)).square().mean().backward()
        g = model[0].scale.grad
        out["grads"].append((None if g is None else g.clone(), model[0].w.grad.full_tensor().clone()))
        out["norms"].append(rank0load.clip_grad_norm_(model.parameters(), 0.05))
        optimizer.step()
        optimizer.zero_grad()
        out["params"].append((model[0].scale.detach().clone(), model[0].w.full_tensor().clone()))
    return out


def own_mixed_reference(world: int) -> dict:
    """One process: each step's gradients as the sum of each rank's backward over the world size."""
    torch.manual_seed(3)
    model = own_mixed()
    with torch.no_grad():
        model[0].w.uniform_(-1, 1)
        model[0].scale.uniform_(0.5, 1.5)
    out: dict = {"state": reference(model), "grads": [], "norms": [], "params": []}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(OWN_MIXED_STEPS):
        for r in range(world):
            model(own_mixed_batch(step, r)).square().mean().backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= world
        g = model[0].scale.grad
        out["grads"].append((None if g is None else g.clone(), model[0].w.grad.clone()))
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
        optimizer.step()
        optimizer.zero_grad()
        out["params"].append((model[0].scale.detach().clone(), model[0].w.detach().clone()))
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
    state = own_mixed_reference(request.param)["state"]
    save_file(state, str(root / "own_mixed.safetensors"))
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


@pytest.mark.parametrize("mesh", ["fsdp", "hsdp"])
def test_a_parameter_no_group_can_take_is_replicated_and_trains_in_step(outcomes, mesh):
    """own_mixed's module holds a bf16 and an fp32 trainable parameter itself: the fp32 one is kept out
    of FSDP, replicated; its gradient (from some ranks, all, or none) is averaged over the ranks after
    each backward, so every rank's copy equals the one-process reference after each AdamW step, bit
    for bit across ranks; clip_grad_norm_ counts it once. On a 1-D mesh and an HSDP (world, 1) mesh."""
    results, _ = outcomes
    want = own_mixed_reference(len(results))
    got = [r[f"own_mixed_{mesh}"] for r in results]
    for res in got:
        assert res["replicated"] == ("0.scale",) and res["plain"], res
        for step in range(OWN_MIXED_STEPS):
            (g, gw), (wg, wgw) = res["grads"][step], want["grads"][step]
            assert (g is None) == (wg is None) == (step == 2), step
            if g is not None:
                torch.testing.assert_close(g, wg, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(gw, wgw, rtol=3e-2, atol=1e-3)  # bf16, summed in another order
            torch.testing.assert_close(res["norms"][step], want["norms"][step].float(), rtol=2e-2, atol=1e-6)
            # the replicated gradient counted once, not once per rank (its part is not negligible)
            parts = torch.stack([gw.float().norm(), torch.zeros(()) if g is None else g.norm()])
            torch.testing.assert_close(res["norms"][step], parts.norm(), rtol=1e-5, atol=1e-7)
            assert step == 2 or parts[1] > 0.1 * parts[0], parts
            (scale, w), (want_scale, want_w) = res["params"][step], want["params"][step]
            torch.testing.assert_close(scale, want_scale, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(w, want_w, rtol=2e-2, atol=2e-2)  # bf16, AdamW: ~lr a step
    for step in range(OWN_MIXED_STEPS):  # the replicas never drift
        assert all(torch.equal(r["params"][step][0], got[0]["params"][step][0]) for r in got), step


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
