"""The scripts in examples/ run as a user runs them (torchrun, CPU/gloo) on a tiny checkpoint written
here, and do what they print; the recipes in docs/recipes/ are excerpts of them (so they cannot drift).

Losses and gradient norms are compared with the same steps on one process (transformers'
``from_pretrained``, ``torch.nn.utils.clip_grad_norm_``): the example's loop is the loop it claims.
(AdamW's step barely depends on a constant scaling of the gradient, so the losses do not show the
clipping itself: tests/train/test_clip.py checks every clipped gradient against torch's.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from tests._dist import EXIT_ABORT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
RANKS = 2  # the training examples' data-parallel ranks (each its own batch)
REGION = re.compile(
    r"^[ ]*# --- recipe: (?P<name>[^\n]+?) ---\n(?P<body>.*?)^\s*# --- end recipe ---", re.M | re.S
)


def _common():
    """examples/_common.py: the examples' own data."""
    spec = importlib.util.spec_from_file_location("examples_common", os.path.join(EXAMPLES, "_common.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _batch(vocab_size: int, device: str, step: int, rank: int) -> dict:
    """examples/_common.py's batch: data-parallel rank ``rank``'s at ``step``."""
    return _common().batch(vocab_size, device, step, rank)


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=38,  # over tp=2: 19 rows each
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    path = str(tmp_path_factory.mktemp("examples") / "llama")
    model.save_pretrained(path, max_shard_size="40KB")
    return path


# Not anchored at the line start: another rank's print may end its text and its newline apart.
DONE = re.compile(r"rank (\d+)/(\d+): done, (\d+) process groups left$", re.M)


def _run(script: str, ranks: int, *args: str, env: dict[str, str] | None = None) -> str:
    """Run an example under torchrun; judge it by what every rank reported when its work was done
    (examples/_common.finish): each rank must say so, with no process group left. A non-zero exit after
    that is torch 2.13's exit-time abort in interpreter shutdown (shared/DESIGN.md), not the script's.
    ``env``: more environment variables for the ranks."""
    env = dict(
        os.environ, OMP_NUM_THREADS="1", HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_OFFLINE="1", **(env or {})
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    done = subprocess.run(
        [*command, os.path.join(EXAMPLES, script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    reported = {int(m[0]): (int(m[1]), int(m[2])) for m in DONE.findall(done.stdout)}
    failed = f"{script} (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"
    assert sorted(reported) == list(range(ranks)), f"not every rank finished its work: {failed}"
    assert all(r == (ranks, 0) for r in reported.values()), f"process groups left at exit: {failed}"
    if done.returncode != 0:  # only the known abort is forgiven, and only after every rank's work
        assert EXIT_ABORT.search(done.stderr), failed
        print(f"{script}: every rank finished, then the run exited {done.returncode} in shutdown")
    return done.stdout


def _numbers(pattern: str, text: str) -> list[tuple[float, ...]]:
    return [tuple(float(x) for x in m) for m in re.findall(pattern, text)]


def _reference_steps(
    path: str, batches: list[list[dict]], schedule: bool = False
) -> list[tuple[float, float]]:
    """(loss of the first batch of each step, gradient norm) of the same steps on one process: each
    step's gradient is the mean over its batches (what FSDP2's reduce-scatter gives). ``schedule``:
    with train.py's cosine lr schedule over the steps."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=len(batches)) if schedule else None
    model.train()
    out = []
    for step_batches in batches:
        losses = [model(**b).loss for b in step_batches]
        (sum(losses) / len(losses)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if lr is not None:
            lr.step()
        out.append((losses[0].item(), norm.item()))
    return out


@pytest.mark.slow
def test_train(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    out_dir = str(tmp_path / "trained")
    text = _run("train.py", RANKS, checkpoint, out_dir)
    got = _numbers(r"step \d+: loss ([\d.]+), grad norm ([\d.]+)", text)
    # Each rank its own batch; the printed loss is rank 0's.
    batches = [[_batch(64, "cpu", s, r) for r in range(RANKS)] for s in range(4)]
    want = _reference_steps(checkpoint, batches, schedule=True)
    assert len(got) == 4, text
    for (loss, norm), (ref_loss, ref_norm) in zip(got, want):
        assert loss == pytest.approx(ref_loss, rel=1e-3) and norm == pytest.approx(ref_norm, rel=1e-3), text
    assert want[0][1] > 1.0  # the clipping was in force
    # The saved checkpoint loads with from_pretrained and holds the trained weights.
    saved = AutoModelForCausalLM.from_pretrained(out_dir)
    original = AutoModelForCausalLM.from_pretrained(checkpoint)
    names = dict(original.named_parameters())
    assert set(dict(saved.named_parameters())) == set(names)
    assert all(not torch.equal(p, names[n]) for n, p in saved.named_parameters())
    assert re.search(r"saved \d+ tensors", text), text


def _saved(out_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a training save: the weights and the optimizer's state."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for folder in (out_dir, os.path.join(out_dir, "training_state")):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                out.update(load_file(os.path.join(folder, name)))
    return out


@pytest.mark.slow
def test_train_stops_and_resumes_as_if_it_never_stopped(checkpoint, tmp_path):
    """train.py --stop-at 2, then --resume (fresh processes, only rank 0 reading), ends bit for bit
    where the 4 steps run straight end: weights, every optimizer state, the lr schedule's state."""
    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
    _run("train.py", RANKS, checkpoint, straight)
    first = _run("train.py", RANKS, checkpoint, stopped, "--stop-at", "2")
    assert re.findall(r"step (\d+):", first) == ["0", "1"], first
    second = _run("train.py", RANKS, checkpoint, stopped, "--resume")
    assert re.findall(r"step (\d+):", second) == ["2", "3"], second
    want, got = _saved(straight), _saved(stopped)
    assert sorted(got) == sorted(want) and any(k.endswith(".exp_avg_sq") for k in got)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    with open(os.path.join(straight, "training_state", "training_state.json")) as f:
        want_state = json.load(f)
    with open(os.path.join(stopped, "training_state", "training_state.json")) as f:
        got_state = json.load(f)
    assert got_state["training_state"] == want_state["training_state"]  # step, schedule, RNG
    assert got_state["optimizer"] == want_state["optimizer"]


@pytest.mark.slow
def test_new_head(checkpoint):
    text = _run("new_head.py", 2, checkpoint)
    assert "missing: ('score.weight',)" in text, text
    assert "unexpected: ('lm_head.weight',)" in text, text
    assert "num_labels 3" in text, text


@pytest.mark.slow
def test_hsdp(checkpoint):
    text = _run("hsdp.py", 4, checkpoint)
    assert "(Replicate(), Shard(dim=0)) on (2, 2)" in text, text
    assert "{'sharded'}" in text, text


@pytest.mark.slow
def test_tensor_parallel(checkpoint):
    """TP + FSDP2 and rank0load.clip_grad_norm_ over parameters on two meshes: the norm of the mean
    gradient over the two data-parallel batches, as one process computes it."""
    text = _run("tensor_parallel.py", 4, checkpoint)
    assert "down_proj travels as 'block', embed_tokens as 'sharded'" in text, text
    ((loss, norm),) = _numbers(r"loss ([\d.]+), grad norm ([\d.]+)", text)
    ((ref_loss, ref_norm),) = _reference_steps(checkpoint, [[_batch(64, "cpu", 0, r) for r in (0, 1)]])
    assert loss == pytest.approx(ref_loss, rel=1e-4) and norm == pytest.approx(ref_norm, rel=1e-4), text


@pytest.mark.slow
def test_measure_ram(checkpoint):
    text = _run("measure_ram.py", 2, checkpoint)
    rows = [
        tuple(float(x) for x in line.split()) for line in text.splitlines() if re.match(r"^\s+\d\s", line)
    ]
    assert [int(r[0]) for r in rows] == [0, 1], text
    for _, before, after, local in rows:
        assert 0 < before <= after and local > 0, text


def _reference_denoising(pipeline: str, steps: int) -> list[tuple[float, float]]:
    """(rank 0's loss, gradient norm) of examples/diffusion.py's steps on one process, one thread:
    diffusers' own from_pretrained in bf16, every rank's batch (each rank's backward, summed and divided
    by the ranks, as FSDP2 averages), torch's gradient norm and clipping."""
    import torch.nn.functional as F
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(
        pipeline, subfolder="transformer", torch_dtype=torch.bfloat16
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        for step in range(steps):
            losses = []
            for rank in range(RANKS):  # each rank's batch; FSDP2 averages their gradients
                b = _common().denoising_batch(
                    model.config.in_channels, model.config.text_dim, "cpu", step, rank
                )
                t = b["t"].view(-1, 1, 1, 1, 1)
                noisy = ((1 - t) * b["latents"] + t * b["noise"]).to(torch.bfloat16)
                text = b["text"].to(torch.bfloat16)
                pred = model(hidden_states=noisy, timestep=b["t"] * 1000, encoder_hidden_states=text).sample
                losses.append(F.mse_loss(pred.float(), b["noise"] - b["latents"]))
                losses[-1].backward()
            for p in model.parameters():
                if p.grad is not None:
                    p.grad /= RANKS
            loss = losses[0]  # what rank 0 prints
            # torch's norm of the gradients in float32 (rank0load's accumulation; clip_grad_norm_ would
            # take each bf16 gradient's norm in bf16), then torch's clipping with it
            grads = [p.grad.float() for p in model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, norm)
            optimizer.step()
            optimizer.zero_grad()
            out.append((loss.item(), norm.item()))
    finally:
        torch.set_num_threads(threads)
    return out


def _reference_lora(path: str, steps: int) -> tuple[list[tuple[float, float]], dict]:
    """examples/lora.py's loop in one process: get_peft_model(from_pretrained(base, bf16)), seed 0, every
    rank's batch."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    out = []
    for step in range(steps):
        losses = []
        for rank in range(RANKS):  # each rank's batch; FSDP2 averages their gradients
            losses.append(model(**_batch(64, "cpu", step, rank)).loss)
            losses[-1].backward()
        for p in trainable:
            p.grad /= RANKS
        loss = losses[0]  # what rank 0 prints
        norm = torch.nn.utils.clip_grad_norm_(trainable, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        out.append((loss.item(), norm.item()))
    return out, {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.slow
@pytest.mark.peft
def test_lora(checkpoint, tmp_path):
    """The base checkpoint into a bf16 PeftModel, the adapters trained as one process trains them,
    saved in PEFT's layout (PeftModel.from_pretrained reads it) and resumed equal."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out_dir = str(tmp_path / "adapter")
    text = _run("lora.py", RANKS, checkpoint, out_dir)
    assert "kept 8 adapter tensors" in text, text  # 2 layers x (q_proj, v_proj) x (lora_A, lora_B)
    got = _numbers(r"step \d+: loss ([\d.]+), grad norm ([\d.]+)", text)
    want, trained = _reference_lora(checkpoint, 3)
    assert len(got) == 3, text
    for (loss, norm), (ref_loss, ref_norm) in zip(got, want):
        assert loss == pytest.approx(ref_loss, rel=1e-3) and norm == pytest.approx(ref_norm, rel=1e-3), text
    assert "saved ['adapter_config.json', 'adapter_model.safetensors']" in text, text
    assert "resumed adapters equal the trained ones: True" in text, text
    back = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16), out_dir
    )
    loaded = {n: p for n, p in back.named_parameters() if "lora_" in n}
    assert sorted(loaded) == sorted(trained)
    for name, value in loaded.items():
        torch.testing.assert_close(
            value, trained[name], rtol=2e-2, atol=1e-4, msg=name
        )  # 3 AdamW steps apart
        if ".lora_B." in name:
            assert value.abs().max() > 0, name  # trained away from PEFT's zeros


def _example(script: str):
    """examples/``script`` as a module (its constants and helpers), importing its ``_common`` as the
    script does."""
    sys.path.insert(0, EXAMPLES)
    try:
        name = "examples_" + script.removesuffix(".py")
        spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, script))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(EXAMPLES)
    return module


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory) -> tuple[str, str]:
    """(the FP8 remote-code checkpoint remote_fp8_moe.py --write writes, its dequantised copy)."""
    folder = tmp_path_factory.mktemp("fp8-moe")
    fp8, plain = str(folder / "fp8"), str(folder / "dequantized")
    subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "remote_fp8_moe.py"), "--write", fp8],
        check=True,
        capture_output=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    from tests.moe_models import headers, save_dequantized

    save_dequantized(fp8, plain)  # transformers' formula per block, the scales dropped, the code files kept
    stored = headers(plain)
    assert stored and not any(k.endswith("_scale_inv") or d == "F8_E4M3" for k, (d, _) in stored.items())
    return fp8, plain


def _reference_remote_fp8_moe(path: str, ranks: int, steps: int):
    """examples/remote_fp8_moe.py's loop in one process, one thread (as each rank runs): transformers'
    ``from_pretrained(dequantized copy, bf16, trust_remote_code=True)``, seed 0 then ``get_peft_model``,
    seed 1 then the fp32 head, every rank's batch. Returns ([(rank 0's loss, norm)], the trained LoRA
    parameters, the trained head).

    As FSDP2 does: each rank's loss has its own backward and the float32 gradients are averaged
    afterwards. (A backward of the mean of the losses is not the same on 3 ranks: its 1/3 passes through
    the bf16 graph and rounds there, moving the losses and norms by up to 6e-5; 1/2 is exact.) A LoRA
    parameter no token reached on any rank gets a zero gradient, as its FSDP2 shard does, not None:
    AdamW's weight decay then moves it (by ~4e-6 here), as it moves the example's."""
    from peft import get_peft_model
    from torch import nn
    from transformers import AutoModelForCausalLM

    example = _example("remote_fp8_moe.py")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, trust_remote_code=True)
    torch.manual_seed(0)
    model = get_peft_model(base, example.LORA)
    torch.manual_seed(1)
    head = nn.Linear(model.config.hidden_size, 1)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad] + list(head.parameters())
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        for step in range(steps):
            losses = []
            for rank in range(ranks):  # each rank's batch and backward; FSDP2 averages the gradients
                data = _batch(model.config.vocab_size, "cpu", step, rank)
                lm = model(**data, output_hidden_states=True)
                value = head(lm.hidden_states[-1][:, -1].float()).squeeze(-1)
                losses.append(
                    lm.loss + nn.functional.mse_loss(value, example.value_target(data["input_ids"]))
                )
                losses[-1].backward()
            for p in trainable:
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad / ranks
            norm = torch.nn.utils.clip_grad_norm_(trainable, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            out.append((losses[0].item(), norm.item()))  # rank 0's loss, as it prints
    finally:
        torch.set_num_threads(threads)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    return out, adapters, {n: p.detach().clone() for n, p in head.named_parameters()}


@pytest.mark.slow
@pytest.mark.transformers
@pytest.mark.peft
def test_remote_fp8_moe(fp8_moe, tmp_path, hf_modules_cache):
    """The seed team's stack: remote code (read on rank 0 only), FP8 dequantised into bf16, LoRA on
    attention and on every expert, a new fp32 head on the model's mesh, a different batch on every rank;
    trained as one process trains it (the dequantised copy through transformers and PEFT), the adapter
    and head saved, read back by PeftModel.from_pretrained and safetensors, and resumed equal. On 3
    ranks (8 experts split unevenly); the 2-rank split of the same model is tests/integrations/test_remote_code.py's.

    Tolerances: on both transformers legs (4.57, 5.24), on 2 and 3 ranks, the example printed the
    reference's numbers to every digit (6 decimals, ~1e-7 relative); rel=1e-5 leaves room for summation
    order alone (the norm over shards, the reduce-scatter's sum). Looser would check little: the LoRA's
    share of these numbers is small (lora_A drawn from another seed moves them by 2e-5 to 2e-4, every
    lora_B gradient dropped by up to 4e-4), unseen at the other tests' 1e-3; a head drawn from another
    seed moves them by ~30%. The adapters are checked themselves: the saved ones equal the reference's
    within 4e-8 after 3 AdamW steps (float32 rounding of the clipped update), while a None gradient for
    the experts no token reached (AdamW skips them; FSDP2 gives zeros) moves those by ~4e-6."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    fp8, plain = fp8_moe
    out_dir = str(tmp_path / "trained")
    modules = {"HF_MODULES_CACHE": str(tmp_path / "hf-modules")}  # the ranks' own, not ~/.cache
    ranks = 3
    text = _run("remote_fp8_moe.py", ranks, fp8, out_dir, env=modules)
    got = _numbers(r"step \d+: loss ([\d.]+), grad norm ([\d.]+)", text)
    want, adapters, head = _reference_remote_fp8_moe(plain, ranks, 3)
    assert len(got) == 3, text
    for (loss, norm), (ref_loss, ref_norm) in zip(got, want):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5), (
            got,
            want,
        )
    assert max(norm for _, norm in want) > 1.0  # the clipping was in force
    # LoRA on q_proj, v_proj (2 layers) and w1, w2, w3 of 8 experts (2 layers), A and B; the head's 2
    assert len(adapters) == 2 * 2 * 2 + 2 * 8 * 3 * 2 == 104
    assert "resumed 106 adapter and head tensors, equal to the trained ones: True" in text, text
    back = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(plain, dtype=torch.bfloat16, trust_remote_code=True),
        os.path.join(out_dir, "adapter"),
    )
    loaded = {n: p for n, p in back.named_parameters() if "lora_" in n}
    assert sorted(loaded) == sorted(adapters)
    for name, value in loaded.items():
        torch.testing.assert_close(value, adapters[name], rtol=1e-6, atol=1e-7, msg=name)
    saved_head = load_file(os.path.join(out_dir, "head", "model.safetensors"))
    assert sorted(saved_head) == sorted(head)
    for name, value in saved_head.items():
        torch.testing.assert_close(value, head[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.slow
@pytest.mark.diffusers
def test_diffusion(tmp_path):
    """The tiny Wan the example writes, loaded in bf16 with diffusers' fp32 modules, trained as one
    process trains it, saved under diffusers' names and read back by diffusers' from_pretrained."""
    from diffusers import WanTransformer3DModel

    out_dir = str(tmp_path / "wan-trained")
    text = _run("diffusion.py", RANKS, out_dir)
    got = _numbers(r"step \d+: loss ([\d.]+), grad norm ([\d.]+)", text)
    want = _reference_denoising(out_dir + "-input", 3)
    assert len(got) == 3, text
    for (loss, norm), (ref_loss, ref_norm) in zip(got, want):
        assert loss == pytest.approx(ref_loss, rel=1e-3) and norm == pytest.approx(ref_norm, rel=1e-3), (
            got,
            want,
        )
    assert want[0][1] > 1.0  # the clipping was in force
    assert "saved 69 tensors as diffusion_pytorch_model.safetensors" in text, text
    assert "proj_out.weight equal: True" in text, text
    assert sorted(os.listdir(out_dir)) == ["config.json", "diffusion_pytorch_model.safetensors"]
    saved = WanTransformer3DModel.from_pretrained(out_dir, torch_dtype=torch.bfloat16)
    original = WanTransformer3DModel.from_pretrained(
        out_dir + "-input", subfolder="transformer", torch_dtype=torch.bfloat16
    )
    names = dict(original.named_parameters())
    assert saved.scale_shift_table.dtype == torch.float32 and saved.proj_out.weight.dtype == torch.bfloat16
    # Trained: every parameter moved, but the bf16 RMSNorm weights (all ones: a step of lr=1e-4 is below
    # bf16's spacing at 1.0 and rounds away, in one process too)
    unchanged = [n for n, p in saved.named_parameters() if torch.equal(p, names[n])]
    assert all(".norm_q." in n or ".norm_k." in n for n in unchanged), unchanged


def _regions() -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(EXAMPLES)):
        if name.endswith(".py"):
            with open(os.path.join(EXAMPLES, name)) as f:
                source = f.read()
            found = list(REGION.finditer(source))
            # every marker read as a region: a name the pattern missed would leave its recipe unchecked
            assert len(found) == source.count("# --- recipe:") == source.count("# --- end recipe ---"), name
            for m in found:
                out[f"{name}: {m['name']}"] = textwrap.dedent(m["body"]).strip()
    return out


def test_docs_recipes_are_excerpts_of_the_examples():
    """Every region marked ``# --- recipe: NAME ---`` in examples/*.py appears verbatim in a recipe page
    of docs/recipes/ (where the README's recipes link to), so a page cannot drift from what runs."""
    recipes = os.path.join(ROOT, "docs", "recipes")
    pages = {}
    for name in sorted(os.listdir(recipes)):
        if name.endswith(".md"):
            with open(os.path.join(recipes, name)) as f:
                pages[name] = f.read()
    regions = _regions()
    assert len(regions) >= 4, regions
    for where, body in regions.items():
        assert any(body in page for page in pages.values()), (
            f"no page of docs/recipes/ holds {where}:\n{body}"
        )
