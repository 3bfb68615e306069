"""rank0load's CUDA path on one GPU: world size 1 on NCCL (and on "cpu:gloo,cuda:nccl"), each rank
spawned with ``tests._dist.run(..., backend=...)`` and a CUDA mesh. Skipped without a GPU (CI has none).

- the toy checkpoint loaded onto the GPU, on both backends: every parameter's full tensor and every
  buffer bit for bit as ``trained_toy()``, all of them on ``cuda:0``;
- a wider toy (1.6 MB) streamed with 16 KiB of staging (4 KiB pieces: hundreds of pieces, several
  rounds, each through rank 0's pinned slots and device buffer), and loads that cast (fp32 file into a
  bf16 and an fp16 model, a bf16 file into an fp32 model): each equal to the same load on the CPU
  (gloo, world 1) and to the reference cast with ``.to(dtype)``;
- ``_fp8.dequantize`` / ``dequantize_at`` on CUDA tensors: the bits of the same call on the CPU,
  ragged last blocks, several parts, float32 and ``into=`` bf16 / fp16 / fp32;
- an FP8 block-quantised per-expert Mixtral checkpoint into a bf16 model: the same load on the CPU,
  and transformers' ``from_pretrained`` of the dequantised copy;
- ``load_pretrained`` of a tiny Llama against transformers' ``from_pretrained`` (on the CPU: both
  build the buffers on the host, and parameters are the checkpoint's bits wherever they live);
- ``save_sharded`` from CUDA shards: the files read back through safetensors, bit for bit.

Every spawned function takes its paths as arguments and returns tensors moved to the CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests import _dist
from tests.models import Toy, assert_same, gather, read_checkpoint, reference, save_state, toy, toy_state

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)"),
]

TIMEOUT = 180  # seconds for a spawn: CUDA and NCCL start-up, transformers' import, a few tiny loads
SMALL_STAGING = 16 << 10  # 4 KiB pieces (max_staging_bytes / 4 slots)
WIDE = {"vocab": 4099, "dim": 96, "layers": 2}  # emb 4099 x 96 fp32: 1.57 MB, ~385 pieces of 4 KiB
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
ModelFn = Callable[[], nn.Module]


# --- models (module level: spawned ranks import them by name) -------------------------------------------


def wide_toy() -> Toy:
    return Toy(**WIDE)


def trained_wide_toy() -> Toy:
    """A wide Toy with random weights and BatchNorm statistics, as ``trained_toy`` makes the small one."""
    torch.manual_seed(1)
    m = wide_toy()
    state = m.state_dict(keep_vars=True)
    with torch.no_grad():
        state["bn.running_mean"].uniform_(-1, 1)
        state["bn.running_var"].uniform_(0.5, 2)
        state["bn.num_batches_tracked"].fill_(11)
        state["step"].fill_(42)
        for p in m.parameters():
            p.uniform_(-1, 1)
    return m.eval()


def mixtral_model():
    """model_fn: the tiny Mixtral from its config, as tests/integrations/test_hf_range.py builds it."""
    from transformers import AutoModelForCausalLM

    from tests import moe_models as mm

    return AutoModelForCausalLM.from_config(mm.config("mixtral"))


# --- every rank ---------------------------------------------------------------------------------------------


def _summary(model: nn.Module) -> dict:
    """Every full tensor and buffer on the CPU, where they lived, and the load's report (if any)."""
    tensors = [*model.parameters(), *model.buffers()]
    return {
        "tensors": gather(model),
        "devices": sorted({str(t.device) for t in tensors}),
        "report": getattr(model, "rank0load_report", None),
    }


def _load_all(rank: int, world: int, device: str, jobs: list[tuple[str, ModelFn, dict]]) -> list[dict]:
    """``load_sharded(model_fn, path, mesh, **kwargs)`` for each job, on a ``device`` mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    import rank0load

    mesh = init_device_mesh(device, (world,))
    return [_summary(rank0load.load_sharded(fn, path, mesh, **kwargs)) for path, fn, kwargs in jobs]


def _pretrained(rank: int, world: int, device: str, path: str, dtype: torch.dtype) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    import rank0load
    from tests import hf

    hf._quiet()
    mesh = init_device_mesh(device, (world,))
    return _summary(rank0load.load_pretrained(AutoModelForCausalLM, path, mesh, dtype=dtype))


def _save_all(rank: int, world: int, device: str, jobs: list[tuple[str, ModelFn, str, dict]]) -> list[dict]:
    """Load ``path`` into ``model_fn()`` on a ``device`` mesh, then ``save_sharded(model, out, **kwargs)``."""
    from torch.distributed.device_mesh import init_device_mesh

    import rank0load

    mesh = init_device_mesh(device, (world,))
    out = []
    for path, fn, out_dir, kwargs in jobs:
        model = rank0load.load_sharded(fn, path, mesh)
        summary = _summary(model)
        summary["save"] = rank0load.save_sharded(model, out_dir, **kwargs)
        out.append(summary)
    return out


# --- the test process ---------------------------------------------------------------------------------------


def _on_gpu(fn, *args, backend: str = "nccl"):
    """``fn(0, 1, "cuda", *args)`` on one NCCL rank (cuda:0); its result, or the test fails with its traceback."""
    return _dist.ok(_dist.run(fn, 1, "cuda", *args, timeout=TIMEOUT, pg_timeout=120, backend=backend))[0]


def _on_cpu(fn, *args):
    """The same on one gloo rank with a CPU mesh: what the GPU must match bit for bit."""
    return _dist.ok(_dist.run(fn, 1, "cpu", *args, timeout=TIMEOUT, pg_timeout=120, backend="gloo"))[0]


def _on_cuda(got: dict, what: str) -> None:
    assert got["devices"] == ["cuda:0"], (
        f"{what}: parameters and buffers live on {got['devices']}, not all on cuda:0"
    )


def _cast(state: dict[str, torch.Tensor], dtype: torch.dtype, keep: tuple[str, ...] = ()) -> dict:
    """``state`` with every floating tensor but ``keep`` cast with ``.to(dtype)``."""
    return {k: v.to(dtype) if v.is_floating_point() and k not in keep else v for k, v in state.items()}


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``trained_wide_toy()`` saved in fp32 and in bf16, and its reference (every parameter and buffer)."""
    tmp = tmp_path_factory.mktemp("cuda-wide")
    save_state(trained_wide_toy(), str(tmp / "fp32.safetensors"))
    save_state(trained_wide_toy(), str(tmp / "bf16.safetensors"), dtype=BF16)
    return {
        "fp32": str(tmp / "fp32.safetensors"),
        "bf16": str(tmp / "bf16.safetensors"),
        "reference": reference(trained_wide_toy()),
    }


# --- a: the toy onto the GPU ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_toy_loads_onto_the_gpu(toy_checkpoint, toy_reference, backend):
    """load_sharded on a 1-rank CUDA mesh: every full tensor and buffer bit for bit, all on cuda:0."""
    (got,) = _on_gpu(_load_all, [(toy_checkpoint, toy, {})], backend=backend)
    _on_cuda(got, f"toy on {backend}")
    assert_same(got["tensors"], toy_reference)
    assert got["report"].world_size == 1 and got["report"].tensors == len(toy_state())


# --- b: many staging pieces; dtype casts ------------------------------------------------------------------


def test_small_staging_streams_in_many_pieces(wide):
    """16 KiB of staging (4 KiB pieces) for a 1.6 MB checkpoint: every piece lands in the right place."""
    assert os.path.getsize(wide["fp32"]) > 300 * (SMALL_STAGING // 4), (
        "the checkpoint is too small to test pieces"
    )
    (got,) = _on_gpu(_load_all, [(wide["fp32"], wide_toy, {"max_staging_bytes": SMALL_STAGING})])
    _on_cuda(got, "wide toy, small staging")
    assert_same(got["tensors"], wide["reference"])


def test_dtype_casts_match_the_cpu(wide):
    """An fp32 file into bf16 and fp16 models (dtype=), a bf16 file into the fp32 model: the GPU's casts
    give the CPU load's bits, which are the reference's ``.to(dtype)`` (the bf16 file: ``.to(bf16)``
    then back to fp32; the non-persistent ``scale`` is the model's own, never cast)."""
    jobs = [
        (wide["fp32"], wide_toy, {"dtype": BF16, "max_staging_bytes": SMALL_STAGING}),
        (wide["fp32"], wide_toy, {"dtype": FP16}),
        (wide["bf16"], wide_toy, {"max_staging_bytes": SMALL_STAGING}),
    ]
    ref = wide["reference"]
    wants = [
        _cast(ref, BF16),
        _cast(ref, FP16),
        _cast(_cast(ref, BF16, ("scale",)), FP32),
    ]
    gpu = _on_gpu(_load_all, jobs)
    cpu = _on_cpu(_load_all, jobs)
    for job, want, g, c in zip(jobs, wants, gpu, cpu):
        what = f"{os.path.basename(job[0])} with {job[2]}"
        _on_cuda(g, what)
        assert c["devices"] == ["cpu"], f"{what}: the CPU load's tensors on {c['devices']}"
        assert_same(g["tensors"], c["tensors"])  # the GPU's bits are the CPU's
        assert_same(c["tensors"], want)


# --- c: FP8 dequantisation on CUDA tensors ------------------------------------------------------------------

# (block, cols, part_rows, start, n): one run of an entry's elements; n None: to the entry's end.
FP8_CASES = [
    ((16, 16), 24, [40], 0, None),  # the whole entry: the last row and column blocks partial (40, 24)
    ((16, 16), 24, [40, 24], 37, 1000),  # from mid-row, across two parts, ending mid-row
    ((3, 5), 13, [7, 11, 2], 5, 200),  # tiny odd blocks, three parts
    ((128, 128), 1000, [700, 900], 123, None),  # over 1 MiB of rows, 1000 and 700 no multiples of 128
    ((128, 128), 256, [384], 0, None),  # whole blocks only: the one-multiply path
]


def _quantised(block, cols, part_rows, seed=0):
    """An entry of 2-D parts, quantised: (float8 values, scale grids, the formula's float32 values)."""
    from tests import moe_models as mm

    generator = torch.Generator().manual_seed(seed)
    weights, grids, want = [], [], []
    for rows in part_rows:
        q, scale = mm.quantize(torch.randn(rows, cols, generator=generator) * 10, block)
        weights.append(q.reshape(-1))
        grids.append(scale.reshape(-1))
        want.append(mm.dequantize(q, scale, block).reshape(-1))
    return torch.cat(weights), torch.cat(grids), torch.cat(want)


def _same_bits(gpu: torch.Tensor, cpu: torch.Tensor, what: str) -> None:
    assert gpu.device.type == "cuda", f"{what}: the result is on {gpu.device}, not the GPU"
    g = gpu.cpu()
    assert g.dtype == cpu.dtype and g.shape == cpu.shape, (
        f"{what}: {g.dtype} {g.shape} != {cpu.dtype} {cpu.shape}"
    )
    same = g.view(-1).view(torch.uint8).view(-1, g.element_size()) == cpu.view(-1).view(torch.uint8).view(
        -1, cpu.element_size()
    )
    differ = (~same.all(dim=1)).nonzero().flatten()
    if len(differ):
        i = int(differ[0])
        pytest.fail(
            f"{what}: {len(differ)} of {g.numel()} elements differ from the CPU's, "
            f"first at {i}: GPU {g.view(-1)[i].item()!r}, CPU {cpu.view(-1)[i].item()!r}"
        )


@pytest.mark.parametrize("case", FP8_CASES, ids=[f"case{i}" for i in range(len(FP8_CASES))])
def test_fp8_dequantize_on_cuda_matches_the_cpu(case):
    """dequantize (float32, and into= bf16 / fp16 / fp32) and dequantize_at on CUDA tensors give the
    bits of the same call on the CPU, which are the documented formula's."""
    from rank0load.checkpoint._fp8 import dequantize, dequantize_at

    block, cols, part_rows, start, n = case
    values, scales, full = _quantised(block, cols, part_rows)
    n = values.numel() - start if n is None else n
    run = values[start : start + n]
    args = (start, part_rows, cols, block)
    cpu = dequantize(run, *args, scales)
    assert torch.equal(cpu, full[start : start + n]), f"{case}: the CPU's values are not the formula's"
    gpu_values, gpu_scales = run.cuda(), scales.cuda()
    _same_bits(dequantize(gpu_values, *args, gpu_scales), cpu, f"{case} float32")
    for dtype in (BF16, FP16, FP32):
        into_cpu = torch.empty(n, dtype=dtype)
        into_gpu = torch.empty(n, dtype=dtype, device="cuda")
        dequantize(run, *args, scales, into=into_cpu)
        got = dequantize(gpu_values, *args, gpu_scales, into=into_gpu)
        assert got.data_ptr() == into_gpu.data_ptr(), f"{case} into {dtype}: not returned as given"
        _same_bits(into_gpu, into_cpu, f"{case} into {dtype}")
        assert torch.equal(into_cpu, full[start : start + n].to(dtype)), f"{case} into {dtype}: not .to()'s"
    total = values.numel()
    flat = torch.randperm(total, generator=torch.Generator().manual_seed(7))[: total // 2 + 1]
    at_cpu = dequantize_at(values[flat], flat, part_rows, cols, block, scales)
    assert torch.equal(at_cpu, full[flat]), f"{case}: dequantize_at on the CPU is not the formula's"
    at_gpu = dequantize_at(values.cuda()[flat.cuda()], flat.cuda(), part_rows, cols, block, gpu_scales)
    _same_bits(at_gpu, at_cpu, f"{case} dequantize_at")


# --- d: an FP8 checkpoint into a bf16 model ------------------------------------------------------------------


@pytest.mark.transformers
def test_fp8_mixtral_into_bf16_matches_the_cpu(tmp_path):
    """The FP8 per-expert Mixtral (16x16 blocks, partial ones: 24 rows) into a bf16 model on the GPU:
    the CPU load's bits and from_pretrained's of the dequantised copy (as tests/integrations/test_hf_range.py)."""
    from transformers import AutoModelForCausalLM

    from tests import moe_models as mm

    path, ref_path = str(tmp_path / "mixtral-fp8"), str(tmp_path / "mixtral-fp8-reference")
    mm.save_fp8("mixtral", path, (16, 16))
    mm.save_dequantized(path, ref_path)
    jobs = [(path, mixtral_model, {"dtype": BF16})]
    (gpu,) = _on_gpu(_load_all, jobs)
    (cpu,) = _on_cpu(_load_all, jobs)
    _on_cuda(gpu, "FP8 Mixtral")
    assert gpu["report"].dequantised > 0, "nothing was dequantised: is the checkpoint FP8?"
    assert gpu["report"].dequantised == cpu["report"].dequantised
    assert_same(gpu["tensors"], cpu["tensors"])
    mm._quiet()
    want = reference(AutoModelForCausalLM.from_pretrained(ref_path, dtype=BF16))
    assert_same(gpu["tensors"], want)


# --- e: load_pretrained against from_pretrained ---------------------------------------------------------------


@pytest.mark.transformers
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_load_pretrained_llama_matches_from_pretrained(tmp_path, dtype):
    """A tiny Llama saved with save_pretrained in several shards, load_pretrained onto the GPU: every
    parameter and buffer (rotary inv_freq included, float32 under bf16) as from_pretrained gives them."""
    from transformers import AutoModelForCausalLM

    from tests import hf

    path = str(tmp_path / "llama")
    hf.pretrained("llama").save_pretrained(path, max_shard_size="20KB")
    got = _on_gpu(_pretrained, path, dtype)
    _on_cuda(got, f"Llama load_pretrained({dtype})")
    hf._quiet()
    want = reference(AutoModelForCausalLM.from_pretrained(path, dtype=dtype))
    assert want["model.rotary_emb.inv_freq"].dtype == FP32
    assert_same(got["tensors"], want)


# --- f: save_sharded from CUDA shards ------------------------------------------------------------------------


def test_save_sharded_from_the_gpu(tmp_path, toy_checkpoint, wide):
    """Load on the GPU, save_sharded, read the files back through safetensors: the checkpoint's tensors
    bit for bit (one file; several files with small staging; cast to bf16)."""
    outs = {name: str(tmp_path / name) for name in ("toy", "wide-shards", "toy-bf16")}
    jobs = [
        (toy_checkpoint, toy, outs["toy"], {}),
        (
            wide["fp32"],
            wide_toy,
            outs["wide-shards"],
            {"max_shard_size": "200KB", "max_staging_bytes": SMALL_STAGING},
        ),
        (toy_checkpoint, toy, outs["toy-bf16"], {"dtype": BF16}),
    ]
    results = _on_gpu(_save_all, jobs)
    for (_, _, out, _), got in zip(jobs, results):
        _on_cuda(got, f"the model saved to {os.path.basename(out)}")
        assert got["save"].files, f"{out}: save_sharded reported no files"
    wide_state = {k: v for k, v in trained_wide_toy().state_dict().items() if k != "head.weight"}
    assert_same(read_checkpoint(outs["toy"]), toy_state())
    saved = read_checkpoint(outs["wide-shards"])
    assert len([n for n in os.listdir(outs["wide-shards"]) if n.endswith(".safetensors")]) > 1
    assert_same(saved, wide_state)
    assert_same(read_checkpoint(outs["toy-bf16"]), _cast(toy_state(), BF16))
