"""A custom training loop: load, AdamW steps with gradient clipping and an lr schedule, save; and
resume it exactly.

    torchrun --nproc-per-node 2 examples/train.py CKPT OUT_DIR [--steps 4] [--stop-at 2]
    torchrun --nproc-per-node 2 examples/train.py CKPT OUT_DIR --resume [--steps 4]

CKPT: a directory written by ``save_pretrained``, a .safetensors file, or a Hub repo id. Only rank 0
reads it (other nodes need not have it); OUT_DIR is written by rank 0 alone and loads with
``from_pretrained`` as it is. ``--stop-at N`` stops after step N, saving the weights with the
optimizer's state and the loop's own (step, lr schedule, random state); ``--resume`` goes on from
OUT_DIR at any world size, and the run that stopped and resumed ends where one that never stopped
does, bit for bit (at the same world size).
"""

from __future__ import annotations

import argparse

import torch
from _common import batch, finish, init, say
from transformers import AutoModelForCausalLM

import rank0load


def main(ckpt: str, out_dir: str, steps: int = 4, stop_at: int | None = None, resume: bool = False) -> None:
    device = init()
    torch.manual_seed(0)  # a fresh process's random state is not the same from run to run
    # --- recipe: train ---
    model = rank0load.load_pretrained(AutoModelForCausalLM, out_dir if resume else ckpt, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    start = 0
    if resume:  # the optimizer's state, sharded like the model, and the loop's own, read on rank 0 only
        state = rank0load.load_training_state(model, optimizer, out_dir)
        schedule.load_state_dict(state["schedule"])
        torch.set_rng_state(state["rng"])
        start = state["step"]
    model.train()
    end = steps if stop_at is None else stop_at
    for step in range(start, end):
        loss = model(**batch(model.config.vocab_size, device, step)).loss
        loss.backward()
        norm = rank0load.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        say(f"step {step}: loss {loss.item():.4f}, grad norm {norm.item():.4f}")
    # the weights, and what a resume needs: one checkpoint, renamed into place once all is written
    training_state = {"step": end, "schedule": schedule.state_dict(), "rng": torch.get_rng_state()}
    report = rank0load.save_sharded(model, out_dir, optimizer=optimizer, training_state=training_state)
    # --- end recipe ---
    say(
        f"saved {report.tensors} tensors, {report.bytes} bytes and {report.state_tensors} optimizer "
        f"tensors, {report.state_bytes} bytes to {out_dir} at step {end}"
    )
    finish()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt")
    parser.add_argument("out_dir")
    parser.add_argument(
        "--steps", type=int, default=4, help="steps of the whole run (the lr schedule's length)"
    )
    parser.add_argument("--stop-at", type=int, default=None, help="stop (and save) after this many steps")
    parser.add_argument(
        "--resume", action="store_true", help="go on from OUT_DIR's weights and training state"
    )
    args = parser.parse_args()
    main(args.ckpt, args.out_dir, args.steps, args.stop_at, args.resume)
