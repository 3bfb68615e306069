"""Small models and checkpoint helpers used by the tests (importable in spawned ranks)."""

from __future__ import annotations

import json
import os
import struct

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class Toy(nn.Module):
    """Tied embedding / head, a BatchNorm (persistent running stats), a non-persistent buffer,
    uneven first dimensions (vocab 7, dims 5) so 2 and 3 ranks get unequal shards."""

    def __init__(self, vocab: int = 7, dim: int = 5, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.bn = nn.BatchNorm1d(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.arange(dim, dtype=torch.float32) / 3, persistent=False)
        self.register_buffer("step", torch.tensor(3, dtype=torch.int64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) * self.scale
        for b in self.blocks:
            h = b(h)
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h)


def toy() -> Toy:
    return Toy()


def trained_toy(seed: int = 0) -> Toy:
    """A Toy with random weights and non-default BatchNorm statistics."""
    torch.manual_seed(seed)
    m = Toy()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2)
        m.bn.num_batches_tracked.fill_(11)
        m.step.fill_(42)
        for p in m.parameters():
            p.uniform_(-1, 1)
    return m.eval()


class HeadToy(nn.Module):
    """A bf16 body (embedding, two blocks, final norm) under an fp32 head of its own (not tied)."""

    def __init__(self, vocab: int = 7, dim: int = 5, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h).float())


def head_toy() -> HeadToy:
    """HeadToy in bf16, its head fp32; block 0 frozen, and block 1's norm: the default policy gives
    the head a group of its own, and keeps the frozen bf16 parameters in their blocks' groups."""
    model = HeadToy().to(torch.bfloat16)
    model.head.float()
    model.blocks[0].requires_grad_(False)
    model.blocks[1].norm.requires_grad_(False)
    return model


# head_toy()'s FSDP groups under the default policy: (module, parameters, elements, trainable
# dtypes, frozen dtypes), the root's first (emb 7 x 5 and the norm's 2 x 5; a block 5 x 5 + 3 x 5).
HEAD_TOY_GROUPS = [
    ("", 3, 45, (torch.bfloat16,), ()),
    ("blocks.0", 4, 40, (), (torch.bfloat16,)),
    ("blocks.1", 4, 40, (torch.bfloat16,), (torch.bfloat16,)),
    ("head", 1, 35, (torch.float32,), ()),
]


def save_state(model: nn.Module, path: str, dtype: torch.dtype | None = None) -> None:
    """Save like save_pretrained does: tied aliases once."""
    from safetensors.torch import save_model

    if dtype is not None:
        model = model.to(dtype)
    save_model(model, path)


def toy_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """``trained_toy(seed)``'s state dict as a checkpoint stores it: the tied ``head.weight`` (an alias
    of ``emb.weight``) left out, every tensor contiguous and detached."""
    state = trained_toy(seed).state_dict()
    return {k: v.detach().contiguous().clone() for k, v in state.items() if k != "head.weight"}


def save_sharded(state: dict[str, torch.Tensor], directory: str) -> dict[str, str]:
    """Two shards and ``model.safetensors.index.json`` in ``directory``, laid out the way
    ``save_pretrained`` does (sorted keys, first half in shard 1). Returns the weight map."""
    import json
    import os

    from safetensors.torch import save_file

    keys = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": keys[: len(keys) // 2],
        "model-00002-of-00002.safetensors": keys[len(keys) // 2 :],
    }
    weight_map = {}
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, os.path.join(directory, name))
        weight_map.update({k: name for k in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())}}
    index["weight_map"] = weight_map
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return weight_map


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t.full_tensor()`` (collective); a ``_StridedShard`` on a 1-D mesh gathered by hand: all-gather
    the local shards and put each rank's rows where ``_split_tensor`` took them from. torch 2.10 and
    2.11 cannot redistribute one (2.11: "ValueError: use_strided_shard_as_shard_order is True, but
    placements ... is unable to be interpreted into a corresponding shard_order"; 2.10: a bare
    AssertionError in ``_gen_transform_infos_non_cached``)."""
    import torch.distributed as dist

    from rank0load.integrations._compat import StridedShard, split_chunks

    mesh, placements = t.device_mesh, t.placements  # type: ignore[attr-defined]
    if not (mesh.ndim == 1 and isinstance(placements[0], StridedShard)):
        return t.full_tensor()  # type: ignore[attr-defined]
    dim = placements[0].dim
    pieces: list = [None] * mesh.size()
    dist.all_gather_object(pieces, t.to_local().detach().cpu(), group=mesh.get_group())  # type: ignore[attr-defined]
    rows = split_chunks(
        StridedShard(0, split_factor=placements[0].split_factor), torch.arange(t.shape[dim]), mesh.size()
    )
    full = torch.empty(t.shape, dtype=t.dtype)
    for index, piece in zip(rows, pieces):
        full.index_copy_(dim, index, piece)
    return full.to(t.device)


def gather(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full tensor and every buffer, on CPU (collective on DTensors)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        t = full_tensor(p) if isinstance(p, DTensor) else p
        out[name] = t.detach().cpu().clone()
    for name, b in model.named_buffers(remove_duplicate=False):
        out[name] = b.detach().cpu().clone()
    return out


def reference(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    out.update({n: b.detach().clone() for n, b in model.named_buffers(remove_duplicate=False)})
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for k in want:
        g, w = got[k], want[k]
        assert g.dtype == w.dtype, f"{k}: dtype {g.dtype} != {w.dtype}"
        assert g.shape == w.shape, f"{k}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert torch.equal(
            g.view(torch.uint8) if g.dtype.itemsize == 1 else g,
            w.view(torch.uint8) if w.dtype.itemsize == 1 else w,
        ) or _bits_equal(g, w), f"{k}: values differ"


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0:
        return True
    return bytes(a.contiguous().view(-1).view(torch.uint8).numpy()) == bytes(
        b.contiguous().view(-1).view(torch.uint8).numpy()
    )


# Every safetensors dtype string; test_dtypes fails if torch lacks one instead of skipping it.
ALL_DTYPES = [
    "F64",
    "F32",
    "F16",
    "BF16",
    "I64",
    "I32",
    "I16",
    "I8",
    "U64",
    "U32",
    "U16",
    "U8",
    "BOOL",
    "C64",
    "F8_E4M3",
    "F8_E5M2",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "F8_E8M0",
    "F4",
]


class TPNet(nn.Module):
    """Uneven over 3 ranks on purpose: 38 and 20 split 13/13/12 and 7/7/6."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 20)  # ColwiseParallel: Shard(1)
        self.up = nn.Linear(20, 38)  # ColwiseParallel: Shard(0), the row path
        self.down = nn.Linear(38, 20)  # RowwiseParallel: Shard(1), bias replicated
        self.wide = nn.Linear(300, 10, bias=False)  # Shard(1); rows of 1200 bytes
        self.cube = nn.Parameter(torch.randn(5, 7, 9))  # Shard(2), set by the shard_fn
        # _StridedShard(split_factor=2), set by the shard_fn: two runs of indices per rank
        self.strided_rows = nn.Parameter(torch.randn(11, 4))
        self.strided_cols = nn.Parameter(torch.randn(4, 11))
        self.register_buffer("scale", torch.arange(4.0))


def tp_net() -> TPNet:
    return TPNet()


def trained_net() -> TPNet:
    torch.manual_seed(3)
    net = TPNet()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 1)
    return net


def shard_tp(model: nn.Module, mesh) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor.placement_types import _StridedShard

    parallelize_module(
        model,
        mesh,
        {
            "emb": ColwiseParallel(),
            "up": ColwiseParallel(),
            "down": RowwiseParallel(),
            "wide": RowwiseParallel(),
        },
    )
    model.cube = nn.Parameter(distribute_tensor(model.cube, mesh, [Shard(2)], src_data_rank=None))
    for name, dim in (("strided_rows", 0), ("strided_cols", 1)):
        placement = _StridedShard(dim, split_factor=2)
        setattr(
            model,
            name,
            nn.Parameter(distribute_tensor(getattr(model, name), mesh, [placement], src_data_rank=None)),
        )


def read_checkpoint(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of a saved directory, through safetensors, after checking each file's layout."""
    from safetensors import safe_open

    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    index_path = os.path.join(directory, "model.safetensors.index.json")
    out: dict[str, torch.Tensor] = {}
    for name in names:
        check_layout(os.path.join(directory, name))
        with safe_open(os.path.join(directory, name), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            out.update({k: f.get_tensor(k) for k in f.keys()})
    if len(names) > 1:
        with open(index_path) as f:
            index = json.load(f)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
        assert set(index["weight_map"].values()) == set(names)
        assert set(index["weight_map"]) == set(out)
    else:
        assert names == ["model.safetensors"] and not os.path.exists(index_path)
    return out


def check_layout(path: str) -> None:
    """Header padded to 8, offsets contiguous from 0, each tensor aligned to its element size."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        size = os.fstat(f.fileno()).st_size
    assert n % 8 == 0
    entries = sorted((v["data_offsets"], v["dtype"]) for k, v in header.items() if k != "__metadata__")
    at = 0
    for (begin, end), dtype in entries:
        assert begin == at
        width = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2}.get(dtype, 1)
        assert (8 + n + begin) % width == 0, (path, begin, dtype)
        at = end
    assert size == 8 + n + at


class OwnMixed(nn.Module):
    """A module that registers a bf16 and an fp32 trainable parameter itself: no group can take the fp32
    one apart (the default policy replicates it)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w``, scaled only for the rows whose first entry is positive (a data-dependent use, as
        routing is: a batch with none gives ``scale`` no gradient)."""
        y = (x.to(self.w.dtype) @ self.w).float()
        hit = x[:, 0] > 0
        if not bool(hit.any()):
            return y
        return torch.where(hit[:, None], y * self.scale, y)


def own_mixed() -> nn.Module:
    return nn.Sequential(OwnMixed())


# --- optimizer state, as torch flattens it ----------------------------------------------------------------


def fqns(model: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter's name without the wrapper segments FSDP2 does not add but ``torch.compile`` and
    activation checkpointing do (``_orig_mod.``, ``_checkpoint_wrapped_module.``): torch's fqn."""
    out = {}
    for name, p in model.named_parameters():
        for segment in ("_orig_mod.", "_checkpoint_wrapped_module."):
            name = name.replace(segment, "")
        out[p] = name
    return out


def gather_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """(all ranks: collective on DTensors) Every tensor state of ``optimizer`` as a full tensor on CPU,
    under torch's flattened name ``state.<fqn>.<key>``, in the optimizer's parameter order."""
    from torch.distributed.tensor import DTensor

    names = fqns(model)
    out: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor):
                    full = value.full_tensor() if isinstance(value, DTensor) else value
                    out[f"state.{names[p]}.{key}"] = full.detach().cpu().clone()
    return out


def optimizer_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's hyperparameters, and its parameters by fqn; tuples as lists (as JSON has them)."""
    names = fqns(model)

    def plain(value):
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        return value

    return [
        {**{k: plain(v) for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
        for g in optimizer.param_groups
    ]


def read_optimizer_files(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``directory/training_state``'s optimizer files, through safetensors' own reader."""
    from safetensors.torch import load_file

    folder = os.path.join(directory, "training_state")
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("optimizer") and name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out
