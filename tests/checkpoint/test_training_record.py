"""The training state's JSON and its checks (rank 0's side, no process group): the codec round-trips
what users resume with, and a damaged or mixed training state folder is refused with the file named."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

from rank0load.checkpoint._training import (
    FOLDER,
    RECORD,
    TrainingRecord,
    decode,
    encode,
    read_training_record,
    save_metadata,
    save_of,
)
from rank0load.errors import CheckpointFormatError, CheckpointNotFoundError


def test_the_codec_round_trips_a_scheduler_an_rng_state_and_special_floats():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    state = {
        "scheduler": scheduler.state_dict(),
        "rng": torch.get_rng_state(),
        "weights": torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16),
        "fp8": torch.tensor([0.5, 2.0]).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 3, dtype=torch.int64),
        "floats": [math.inf, -math.inf, 0.1, 1e-300],
        "pair": (1, "two"),
        "nothing": None,
    }
    text = json.dumps(encode(state), allow_nan=False)  # strict JSON: no bare Infinity or NaN
    back = decode(json.loads(text))
    assert back["scheduler"] == json.loads(json.dumps(scheduler.state_dict()))  # tuples become lists
    for key in ("rng", "weights", "fp8", "empty"):
        assert back[key].dtype == state[key].dtype and back[key].shape == state[key].shape, key
        assert torch.equal(back[key].view(torch.uint8), state[key].view(torch.uint8)), key
    assert back["floats"] == [math.inf, -math.inf, 0.1, 1e-300]
    assert back["pair"] == [1, "two"] and back["nothing"] is None
    assert math.isnan(decode(json.loads(json.dumps(encode(math.nan)))))
    scheduler2 = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    scheduler2.load_state_dict(back["scheduler"])
    assert scheduler2.state_dict() == scheduler.state_dict()


@pytest.mark.parametrize(
    "value, words",
    [({1: "a"}, "has key 1, not a string"), ({"f": object()}, "training_state['f'] is a object")],
)
def test_what_json_cannot_hold_is_named(value, words):
    with pytest.raises(TypeError, match=words.replace("[", r"\[").replace("]", r"\]")):
        encode(value)


def _write(root, record: TrainingRecord, tensors: dict[str, dict[str, torch.Tensor]]) -> str:
    folder = os.path.join(root, FOLDER)
    os.makedirs(folder, exist_ok=True)
    for name, (save_id, values) in tensors.items():
        save_file(values, os.path.join(folder, name), metadata={"format": "pt", **save_metadata(save_id, 3)})
    with open(os.path.join(folder, RECORD), "w") as f:
        json.dump(record.as_json(), f)
    return folder


def _record(files=("optimizer.safetensors",), save_id="aa") -> TrainingRecord:
    return TrainingRecord(".", save_id, 3, None, tuple(files), encode({"step": 3}))


def test_a_training_record_is_read_with_its_files_checked(tmp_path):
    _write(tmp_path, _record(), {"optimizer.safetensors": ("aa", {"state.w.step": torch.tensor(3.0)})})
    record = read_training_record(tmp_path)
    assert record.save_id == "aa" and record.step == 3 and decode(record.training_state) == {"step": 3}
    assert save_of(os.path.join(tmp_path, FOLDER, "optimizer.safetensors")) == ("aa", "3")


def test_no_training_state_is_not_found(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="holds no training state.*optimizer=optimizer"):
        read_training_record(tmp_path)


def test_a_folder_mixing_two_saves_is_refused(tmp_path):
    _write(tmp_path, _record(), {"optimizer.safetensors": ("bb", {"state.w.step": torch.tensor(3.0)})})
    with pytest.raises(CheckpointFormatError, match="belongs to save bb, but training_state.json to save aa"):
        read_training_record(tmp_path)


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda d: "{not json", "cannot be read as JSON"),
        (lambda d: json.dumps({**d, "format": "other"}), "is not a rank0load training state"),
        (lambda d: json.dumps({**d, "version": 99}), "version 99 .* upgrade rank0load"),
        (lambda d: json.dumps({k: v for k, v in d.items() if k != "files"}), "lacks a field"),
        (lambda d: json.dumps({**d, "files": ["../model.safetensors"]}), "outside its folder"),
    ],
)
def test_a_damaged_record_is_refused(tmp_path, damage, words):
    folder = _write(tmp_path, _record(), {"optimizer.safetensors": ("aa", {"s": torch.tensor(1.0)})})
    path = os.path.join(folder, RECORD)
    with open(path) as f:
        data = json.load(f)
    with open(path, "w") as f:
        f.write(damage(data))
    with pytest.raises(CheckpointFormatError, match=words):
        read_training_record(tmp_path)


def test_a_missing_optimizer_file_is_not_found(tmp_path):
    _write(tmp_path, _record(files=("optimizer.safetensors", "gone.safetensors")), {})
    with pytest.raises(CheckpointNotFoundError, match="optimizer.safetensors does not exist"):
        read_training_record(tmp_path)
