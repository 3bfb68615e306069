"""rank0load.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on the unsharded gradients.

The multi-rank cases share one spawn of 4 gloo ranks: FSDP2 over 4 ranks (6-row weights leave rank 3
an empty shard), HSDP 2x2, and the README's TP + FSDP2 recipe on a 2x2 (dp, tp) mesh (parameters on
the 2-D mesh and on ``mesh["dp"]``, ``_StridedShard`` and ``Shard(1)``), each with a plain replicated
tensor mixed in. The gradients come from a real backward; the reference is torch's own clipping of
their ``full_tensor()`` in one process. Plain tensors alone need no process group: those cases run
here in the test process.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import rank0load
from tests import _dist

# The 4-rank spawn takes 35-40 s on 2 busy cores: those tests are slow; the plain-tensor ones are not.
slow = pytest.mark.slow
WORLD = 4
NORMS = (2.0, 1.0, 3.0, math.inf)
RTOL, ATOL = 2e-6, 1e-7  # float32 rounding: per-shard norms summed in another order than torch's


class Attention(nn.Module):
    """Llama's projection names, without the attention itself: enough for the TP plan to apply."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(dim, heads)
        self.k_proj = nn.Linear(dim, heads)
        self.v_proj = nn.Linear(dim, heads)
        self.o_proj = nn.Linear(heads, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.q_proj(x) * self.k_proj(x) + self.v_proj(x))


class MLP(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, inner, bias=False)
        self.up_proj = nn.Linear(dim, inner, bias=False)
        self.down_proj = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, inner: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(dim)
        self.self_attn = Attention(dim, heads)
        self.post_attention_layernorm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


class Inner(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, inner: int, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim, heads, inner) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)


class TinyLM(nn.Module):
    """Llama-shaped names (``model.layers[i].self_attn.q_proj``...), sizes that split unevenly: vocab
    7, width 6 (rows 2, 2, 2, 0 over 4 ranks), heads 6 and MLP 10 (over tp=2, then dp=2: 2/1, 3/2)."""

    def __init__(
        self, vocab: int = 7, dim: int = 6, heads: int = 6, inner: int = 10, layers: int = 2
    ) -> None:
        super().__init__()
        self.model = Inner(vocab, dim, heads, inner, layers)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h)
        return self.lm_head(self.model.norm(h))


def ids_of(dp_rank: int) -> torch.Tensor:
    """Data-parallel rank ``dp_rank``'s own batch (a tensor-parallel group shares one)."""
    return torch.randint(0, 7, (2, 4), generator=torch.Generator().manual_seed(40 + dp_rank))


def _tiny_lm() -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)  # LayerNorm weights off 1, biases off 0: every gradient distinct
    return model


def _fsdp(model: TinyLM, mesh) -> TinyLM:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _tp_then_fsdp(model: TinyLM, mesh) -> TinyLM:
    """The README's recipe."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _params(model: TinyLM, dp_rank: int) -> tuple[list[str], list[torch.Tensor]]:
    """The model's parameters after a backward on data-parallel rank ``dp_rank``'s own batch, then a
    plain tensor (the same on every rank) with its own gradient."""
    model(ids_of(dp_rank)).square().mean().backward()
    g = torch.Generator().manual_seed(5)
    extra = nn.Parameter(torch.zeros(4, 3))
    extra.grad = torch.randn(4, 3, generator=g)
    names = [n for n, _ in model.named_parameters()] + ["extra"]
    return names, [*model.parameters(), extra]


def _full(g: torch.Tensor | None) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor

    if g is None:
        return None
    return g.full_tensor() if isinstance(g, DTensor) else g.clone()


def _case(params: list[torch.Tensor], norm_type: float, max_norm: float, clip=None) -> dict:
    """Clip ``params`` with rank0load (or ``clip``) and torch's reference on the full gradients;
    restore the gradients afterwards so the next case starts from the same ones."""
    from rank0load.integrations._compat import local_tensor

    clip = clip or rank0load.clip_grad_norm_
    before = [_full(p.grad) for p in params]
    saved = [None if p.grad is None else local_tensor(p.grad).clone() for p in params]
    refs = []
    for f in before:
        r = torch.zeros(1) if f is None else torch.zeros_like(f)
        r.grad = None if f is None else f.clone()
        refs.append(r)
    ref_norm = torch.nn.utils.clip_grad_norm_(refs, max_norm, norm_type)
    norm = clip(params, max_norm, norm_type)
    after = [_full(p.grad) for p in params]
    for p, s in zip(params, saved, strict=True):
        if s is not None:
            local_tensor(p.grad).copy_(s)
    return {
        "norm": norm,
        "norm_type": type(norm).__name__,
        "ref_norm": ref_norm,
        "before": before,
        "after": after,
        "ref_after": [r.grad for r in refs],
    }


def _counted(params: list[torch.Tensor]) -> list[tuple[tuple[int, ...], int]]:
    """The all-reduces one clip_grad_norm_ makes: (group ranks, elements) each."""
    import torch.distributed as dist

    calls: list[tuple[tuple[int, ...], int]] = []
    original = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append((tuple(sorted(dist.get_process_group_ranks(group))), tensor.numel()))
        return original(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting
    try:
        rank0load.clip_grad_norm_(params, 1e9)  # no clipping: the gradients stay as they are
    finally:
        dist.all_reduce = original
    return calls


def _naive(world: int):
    """rank0load's clip with every sharded tensor summed over the whole world (what a clip that
    ignores Replicate dimensions does): used to show the HSDP test can fail."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    from rank0load.integrations._compat import StridedShard
    from rank0load.train import _clip

    def world_groups(mesh, placements, what):
        if any(isinstance(p, (Shard, StridedShard)) for p in placements):
            return (_clip._Group(tuple(range(world)), dist.group.WORLD, torch.device("cpu")),)
        return ()

    def clip(params, max_norm, norm_type):
        saved = _clip._shard_groups
        _clip._shard_groups = world_groups
        try:
            return rank0load.clip_grad_norm_(params, max_norm, norm_type)
        finally:
            _clip._shard_groups = saved

    return clip


def _empty_rank(rank: int, params: list[torch.Tensor], max_norm: float) -> dict:
    """Rank 3 alone has no gradients: the others must not wait for it in vain, and the norm is that
    of the other ranks' shards."""
    from torch.distributed.tensor import DTensor

    from rank0load.integrations._compat import local_tensor

    zeroed = []
    for p in params:
        g = p.grad
        if isinstance(g, DTensor):
            local = local_tensor(g) * (rank != 3)
            g = DTensor.from_local(local, g.device_mesh, g.placements, shape=g.shape, stride=g.stride())
            zeroed.append(g.full_tensor())
        else:
            zeroed.append(g.clone())
    refs = []
    for z in zeroed:
        r = torch.zeros_like(z)
        r.grad = z
        refs.append(r)
    ref_norm = torch.nn.utils.clip_grad_norm_(refs, max_norm)
    saved = [local_tensor(p.grad).clone() for p in params]
    if rank == 3:
        for p in params:
            p.grad = None
    norm = rank0load.clip_grad_norm_(params, max_norm)
    coef = min(max_norm / (ref_norm.item() + 1e-6), 1.0)
    if rank == 3:
        diff = 0.0 if all(p.grad is None for p in params) else math.inf
    else:
        diff = max(
            float((local_tensor(p.grad) - s * coef).abs().max()) if s.numel() else 0.0
            for p, s in zip(params, saved)
        )
    return {"norm": norm, "ref_norm": ref_norm, "local_diff": diff}


def _ranks(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    from rank0load.integrations._compat import local_tensor

    out: dict = {}
    flat = init_device_mesh("cpu", (world,))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    dptp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    setups = {
        "fsdp": _params(_fsdp(_tiny_lm(), flat), rank),
        "hsdp": _params(_fsdp(_tiny_lm(), hsdp), rank),
        "tp": _params(_tp_then_fsdp(_tiny_lm(), dptp), dptp["dp"].get_local_rank()),
    }
    for setup, (names, params) in setups.items():
        out[setup, "names"] = names
        out[setup, "placements"] = {
            n: (str(p.placements), p.device_mesh.ndim, local_tensor(p).numel())
            for n, p in zip(names, params)
            if isinstance(p, DTensor)
        }
        out[setup, "calls"] = _counted(params)
        for norm_type in NORMS:
            for max_norm in (1e6, 0.05):
                out[setup, norm_type, max_norm] = _case(params, norm_type, max_norm)
        # Partially frozen: no gradients for the embedding and the first layer's MLP (on every rank).
        frozen = [n == "model.embed_tokens.weight" or n.startswith("model.layers.0.mlp.") for n in names]
        held = [p.grad for p in params]
        for p, f in zip(params, frozen):
            if f:
                p.grad = None
        out[setup, "frozen"] = {t: _case(params, t, 0.05) for t in (2.0, math.inf)}
        out[setup, "frozen_calls"] = _counted(params)
        for p, g in zip(params, held):
            p.grad = g

    out["naive_hsdp"] = _case(setups["hsdp"][1], 2.0, 0.05, clip=_naive(world))
    out["naive_tp"] = _case(setups["tp"][1], 2.0, 0.05, clip=_naive(world))
    out["plain_calls"] = _counted([setups["fsdp"][1][-1]])
    # The plain tensor is left out: with its gradient on some ranks only it would not be replicated.
    out["empty_rank"] = _empty_rank(rank, setups["fsdp"][1][:-1], 0.05)

    # A Partial gradient is refused on every rank, before any collective.
    param = nn.Parameter(distribute_tensor(torch.ones(4, 2), flat, [Replicate()]))
    param.grad = DTensor.from_local(torch.ones(4, 2), flat, [Partial()])
    try:
        rank0load.clip_grad_norm_([param], 1.0)
    except ValueError as exc:
        out["partial"] = str(exc)
    # A non-finite entry in one rank's shard: every rank raises the same error.
    params = setups["fsdp"][1]
    if rank == 0:
        local_tensor(params[0].grad).view(-1)[0] = math.inf
    try:
        rank0load.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    except RuntimeError as exc:
        out["nonfinite"] = str(exc)
    # A NaN in one rank's shard under the inf norm: every rank ends with nan and raises alike.
    # On rank 2, not 0: gloo's MAX keeps a nan from rank 0 but drops one from a later rank (rank 3's
    # gradients are None since the empty-rank case).
    if rank == 2:
        local_tensor(params[0].grad).view(-1)[0] = math.nan
    out["nan_inf_norm"] = rank0load.clip_grad_norm_(params, 1.0, math.inf).item()
    try:
        rank0load.clip_grad_norm_(params, 1.0, math.inf, error_if_nonfinite=True)
    except RuntimeError as exc:
        out["nan_inf_raised"] = str(exc)
    out["groups"] = {
        "world": tuple(range(world)),
        "dp": tuple(sorted(dist.get_process_group_ranks(dptp.get_group("dp")))),
        "tp": tuple(sorted(dist.get_process_group_ranks(dptp.get_group("tp")))),
        "shard": tuple(sorted(dist.get_process_group_ranks(hsdp.get_group("shard")))),
    }
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return _dist.ok(_dist.run(_ranks, WORLD, timeout=300))


def _check(case: dict, what: str) -> None:
    assert case["norm_type"] == "Tensor", f"{what}: returned a {case['norm_type']}"
    torch.testing.assert_close(
        case["norm"], case["ref_norm"], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}"
    )
    for i, (got, want) in enumerate(zip(case["after"], case["ref_after"], strict=True)):
        if want is None:
            assert got is None, f"{what}: parameter {i} gained a gradient"
        else:
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} #{i}: {m}")


def _check_setup(ranks: list[dict], setup: str) -> None:
    for norm_type in NORMS:
        for max_norm in (1e6, 0.05):
            cases = [r[setup, norm_type, max_norm] for r in ranks]
            for rank, case in enumerate(cases):
                _check(case, f"{setup} p={norm_type} max_norm={max_norm} rank {rank}")
            # Every rank ends with the same total, bit for bit.
            assert len({c["norm"].item() for c in cases}) == 1, [c["norm"] for c in cases]
            if max_norm == 1e6:  # no clipping: the gradients are untouched
                for case in cases:
                    for got, want in zip(case["after"], case["before"], strict=True):
                        assert (got is None and want is None) or torch.equal(got, want)
            else:  # clipped: the gradients changed and their norm is now max_norm
                case = cases[0]
                assert case["ref_norm"] > 2 * max_norm, case["ref_norm"]
                flat = torch.cat([g.flatten() for g in case["after"] if g is not None])
                torch.testing.assert_close(
                    torch.linalg.vector_norm(flat, norm_type), torch.tensor(max_norm), rtol=1e-5, atol=0
                )
        for rank, r in enumerate(ranks):
            for t, case in r[setup, "frozen"].items():
                _check(case, f"{setup} frozen p={t} rank {rank}")
                assert sum(g is None for g in case["after"]) >= 3


@slow
def test_fsdp2_with_empty_shards(ranks):
    placements = ranks[3]["fsdp", "placements"]
    assert placements["model.layers.0.self_attn.q_proj.weight"] == ("(Shard(dim=0),)", 1, 0)  # rank 3: empty
    _check_setup(ranks, "fsdp")


@slow
def test_hsdp_counts_replicas_once(ranks):
    placements = ranks[0]["hsdp", "placements"]
    assert set(p for p, _, _ in placements.values()) == {"(Replicate(), Shard(dim=0))"}
    _check_setup(ranks, "hsdp")


@slow
def test_hsdp_test_fails_a_clip_that_sums_over_the_world(ranks):
    """The HSDP and TP checks above can fail: summing every shard over all 4 ranks counts each HSDP
    replica twice (and each ``mesh["dp"]`` parameter twice under TP)."""
    for setup in ("naive_hsdp", "naive_tp"):
        for r in ranks:
            with pytest.raises(AssertionError):
                _check(r[setup], setup)
    # Every sharded gradient counted twice, the plain tensor (last) once.
    case = ranks[0]["naive_hsdp"]
    sharded = sum(g.square().sum() for g in case["before"][:-1])
    plain = case["before"][-1].square().sum()
    torch.testing.assert_close(case["norm"], (2 * sharded + plain).sqrt(), rtol=RTOL, atol=ATOL)


@slow
def test_tensor_parallel_then_fsdp_on_two_meshes(ranks):
    placements = ranks[0]["tp", "placements"]
    # The layouts that break torch's own clip_grad_norm_: 1-D mesh["dp"] and the 2-D mesh together.
    assert placements["model.embed_tokens.weight"][:2] == ("(Shard(dim=0),)", 1)
    assert "_StridedShard" in placements["model.layers.0.mlp.up_proj.weight"][0]
    assert placements["model.layers.0.mlp.down_proj.weight"][:2] == ("(Shard(dim=0), Shard(dim=1))", 2)
    assert placements["model.layers.0.self_attn.o_proj.bias"][:2] == ("(Shard(dim=0), Replicate())", 2)
    _check_setup(ranks, "tp")


@slow
def test_one_all_reduce_per_group_not_per_parameter(ranks):
    for r in ranks:
        g = r["groups"]
        assert len(r["tp", "names"]) > 20
        assert r["fsdp", "calls"] == r["fsdp", "frozen_calls"] == [(g["world"], 1)]
        assert r["hsdp", "calls"] == r["hsdp", "frozen_calls"] == [(g["shard"], 1)]
        # Stage 0: mesh["dp"] parameters, the (Shard, Replicate) biases and the 2-D-sharded weights
        # share the dp group (2 buckets, 1 all-reduce); stage 1: the 2-D-sharded weights over tp.
        assert r["tp", "calls"] == r["tp", "frozen_calls"] == [(g["dp"], 2), (g["tp"], 1)]
        assert r["plain_calls"] == []


@slow
def test_a_rank_without_gradients_reaches_the_same_collectives(ranks):
    norms = {r["empty_rank"]["norm"].item() for r in ranks}
    assert len(norms) == 1, norms
    for r in ranks:
        torch.testing.assert_close(r["empty_rank"]["norm"], r["empty_rank"]["ref_norm"], rtol=RTOL, atol=ATOL)
        assert r["empty_rank"]["local_diff"] <= 1e-6


@slow
def test_partial_and_nonfinite_raise_on_every_rank(ranks):
    messages = {r.get("partial") for r in ranks}
    assert len(messages) == 1 and "Partial gradient is not yet reduced" in messages.pop()
    messages = {r.get("nonfinite") for r in ranks}
    assert len(messages) == 1 and "non-finite" in messages.pop()
    assert all(math.isnan(r["nan_inf_norm"]) for r in ranks), [r["nan_inf_norm"] for r in ranks]
    messages = {r.get("nan_inf_raised") for r in ranks}
    assert len(messages) == 1 and "non-finite" in messages.pop()


# Plain tensors: no process group, no collectives.


def _plain(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in ((5, 3), (0, 4), (7,), (2, 2, 2)):
        p = nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = torch.randn(shape, generator=g).to(dtype)
        params.append(p)
    params.append(nn.Parameter(torch.zeros(3)))  # no gradient
    return params


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("norm_type", NORMS)
def test_plain_tensors_match_torch(norm_type, foreach):
    for max_norm in (1e6, 0.1):
        ours = _plain(0)
        # torch refuses the inf norm of an empty gradient ("no identity"); rank0load counts it as 0.
        ref = [p for p in _plain(0) if p.numel()]
        got = rank0load.clip_grad_norm_(ours, max_norm, norm_type, foreach=foreach)
        want = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type, foreach=foreach)
        ours = [p for p in ours if p.numel()]
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        for a, b in zip(ours, ref):
            assert (a.grad is None) == (b.grad is None)
            if a.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, rtol=RTOL, atol=ATOL)


def test_plain_float64_and_bfloat16():
    got = rank0load.clip_grad_norm_(_plain(1, torch.float64), 0.1)
    want = torch.nn.utils.clip_grad_norm_(_plain(1, torch.float64), 0.1)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    # bf16 gradients: the norm is taken (and returned) in float32, clipping multiplies in bf16.
    got = rank0load.clip_grad_norm_(_plain(1, torch.bfloat16), 0.1)
    upcast = []
    for p in _plain(1, torch.bfloat16):
        q = torch.zeros(p.shape)
        q.grad = None if p.grad is None else p.grad.float()
        upcast.append(q)
    exact = torch.nn.utils.clip_grad_norm_(upcast, 0.1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, exact, rtol=1e-6, atol=0)


def test_single_tensor_empty_and_no_grads():
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    assert rank0load.clip_grad_norm_(p, 1.0).item() == pytest.approx(5.0)
    torch.testing.assert_close(p.grad, torch.tensor([3.0, 4.0, 0.0]) / (5.0 + 1e-6))
    assert rank0load.clip_grad_norm_([], 1.0).item() == 0.0
    with pytest.warns(UserWarning, match="empty generator"):
        rank0load.clip_grad_norm_((q for q in []), 1.0)
    assert rank0load.clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0).item() == 0.0


@pytest.mark.parametrize("norm_type", [0, 0.0, -1.0, -math.inf, math.nan])
def test_norm_type_that_is_no_norm_is_refused(norm_type):
    with pytest.raises(ValueError, match="norm_type must be > 0 or inf"):
        rank0load.clip_grad_norm_(_plain(0), 1.0, norm_type)


def test_nonfinite_raises_only_when_asked():
    params = _plain(0)
    params[0].grad[0, 0] = math.nan
    with pytest.raises(RuntimeError, match="non-finite"):
        rank0load.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    assert rank0load.clip_grad_norm_(params, 1.0).isnan()


def test_foreach_true_on_a_device_without_foreach_is_refused():
    p = nn.Parameter(torch.zeros(2, device="meta"))
    p.grad = torch.zeros(2, device="meta")
    with pytest.raises(RuntimeError, match="foreach=True"):
        rank0load.clip_grad_norm_([p], 1.0, foreach=True)
