"""``python -m rank0load inspect``, run as subprocesses: the summary, the --model dry run (with a
--key-map too), the FSDP groups of the default policy, and the exit codes (0 fits / readable, 1
mismatches, 2 unreadable checkpoint or bad command line, 3 model factory or key map failed).

One command runs as ``python -m rank0load`` in a fresh process (the entry point itself); the others
call the same ``main()`` in this process (a fresh one costs seconds of importing torch each)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch

from rank0load.__main__ import main
from tests.models import HEAD_TOY_GROUPS, head_toy, own_mixed, save_state, trained_toy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mismatched_checkpoint(path: str) -> None:
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in trained_toy().state_dict().items() if k != "head.weight"}
    del state["bn.bias"]  # missing
    state["blocks.0.fc.weight"] = torch.zeros(4, 5)  # shape
    state["blocks.1.fc.weight"] = state["blocks.1.fc.weight"].to(torch.int32)  # dtype
    state["extra.bias"] = torch.zeros(3)  # unexpected
    save_file(state, path)


def _prefixed_checkpoint(path: str) -> None:
    """The toy's keys under ``model.``, plus an optimizer entry the model has no place for."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in trained_toy().state_dict().items() if k != "head.weight"}
    state = {f"model.{k}": v for k, v in state.items()}
    state["optimizer.step"] = torch.tensor(5)
    save_file(state, path)


def from_prefixed(key: str) -> str | None:
    """--key-map for _prefixed_checkpoint: drop the optimizer entry, strip ``model.``."""
    return None if key.startswith("optimizer.") else key.removeprefix("model.")


def noisy_toy():
    """The toy, built by a factory that prints to stdout three ways: Python's print, file descriptor 1
    (as C++ writes: torch 2.10's gloo prints its connection there) and C stdio, buffered on a pipe."""
    import ctypes

    print("noisy: print")
    os.write(1, b"noisy: fd 1\n")
    ctypes.CDLL(None).printf(b"noisy: printf\n")
    return trained_toy()


def broken_key_map(key: str) -> str:
    raise KeyError(key)


def _sharded_checkpoint(path) -> None:
    """Two shards and an index, the layout save_pretrained writes."""
    from safetensors.torch import save_file

    path.mkdir()
    state = {k: v.contiguous() for k, v in trained_toy().state_dict().items() if k != "head.weight"}
    keys = sorted(state)
    parts = {"model-00001-of-00002.safetensors": keys[:7], "model-00002-of-00002.safetensors": keys[7:]}
    for name, part in parts.items():
        save_file({k: state[k] for k in part}, str(path / name))
    index = {"metadata": {}, "weight_map": {k: name for name, part in parts.items() for k in part}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def _in_process(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` here, as the subprocess would run it: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    _sharded_checkpoint(tmp / "sharded")
    save_state(trained_toy(), str(tmp / "toy.safetensors"))
    _mismatched_checkpoint(str(tmp / "mismatched.safetensors"))
    _prefixed_checkpoint(str(tmp / "prefixed.safetensors"))
    save_state(head_toy(), str(tmp / "head.safetensors"))
    commands = {
        "summary": [str(tmp / "sharded"), "--json"],
        "fits": [str(tmp / "toy.safetensors"), "--model", "tests.models:toy"],
        "mismatched": [str(tmp / "mismatched.safetensors"), "--model", "tests.models:toy", "--json"],
        "key_map": [
            str(tmp / "prefixed.safetensors"),
            "--model",
            "tests.models:toy",
            "--key-map",
            "tests.api.test_cli:from_prefixed",
            "--json",
        ],
        "groups": [str(tmp / "head.safetensors"), "--model", "tests.models:head_toy", "--json"],
        "absent": [str(tmp / "absent")],
        "no_module": [str(tmp / "toy.safetensors"), "--model", "tests.no_such_module:build"],
    }
    # the entry point, in a fresh process
    summary = subprocess.Popen(
        [sys.executable, "-m", "rank0load", "inspect", *commands.pop("summary")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    results = {name: _in_process(["inspect", *args]) for name, args in commands.items()}
    out, err = summary.communicate(timeout=180)
    results["summary"] = (summary.returncode, out, err)
    return tmp, results


def test_summary_json(cli):
    from safetensors import safe_open

    tmp, results = cli
    code, out, err = results["summary"]
    assert code == 0, err
    got = json.loads(out)
    shards = sorted(p for p in os.listdir(tmp / "sharded") if p.endswith(".safetensors"))
    sizes = {}
    for name in shards:
        with safe_open(str(tmp / "sharded" / name), "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                sizes[key] = t.numel() * t.element_size()
    assert len(shards) > 1
    assert [os.path.basename(f["path"]) for f in got["files"]] == shards
    assert sum(f["tensors"] for f in got["files"]) == got["tensors"] == len(sizes)
    assert got["total_bytes"] == sum(sizes.values())
    assert got["dtypes"] == {
        "F32": {"tensors": len(sizes) - 2, "bytes": sum(sizes.values()) - 16},
        "I64": {"tensors": 2, "bytes": 16},
    }
    assert got["largest"]["key"] == max(sizes, key=sizes.get) == "emb.weight"
    assert got["largest"]["shape"] == [7, 5] and got["model_checked"] is False and got["fits"] is True


def test_json_stdout_holds_the_report_alone(cli):
    """What the model factory, torch or gloo print while inspecting goes to stderr: stdout parses."""
    tmp, _ = cli
    run = subprocess.run(
        [sys.executable, "-m", "rank0load", "inspect", str(tmp / "toy.safetensors"), "--json"]
        + ["--model", "tests.api.test_cli:noisy_toy"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads(run.stdout)["fits"] is True
    for way in ("print", "fd 1", "printf"):
        assert f"noisy: {way}" in run.stderr, run.stderr


def test_model_dry_run_fits(cli):
    code, out, err = cli[1]["fits"]
    assert code == 0, out + err
    assert "fits the model" in out and "largest: emb.weight F32 [7, 5] 140 B" in out


def test_model_dry_run_lists_fsdp_groups(cli):
    code, out, err = cli[1]["fits"]  # the toy: fp32, its head tied to the embedding (counted once)
    assert code == 0, out + err
    lines = out.splitlines()
    at = lines.index("FSDP groups, default policy (3):")
    assert lines[at + 1 : at + 4] == [
        "  (root): 3 parameters, 45 elements, trainable float32",
        "  blocks.0: 4 parameters, 40 elements, trainable float32",
        "  blocks.1: 4 parameters, 40 elements, trainable float32",
    ]
    code, out, err = cli[1]["groups"]  # bf16 with an fp32 head, frozen parameters
    assert code == 0, out + err
    got = json.loads(out)
    assert got["fits"] is True and got["fsdp_unlisted"] == ""
    assert got["fsdp_groups"] == [
        {
            "module": name,
            "parameters": parameters,
            "elements": elements,
            "trainable_dtypes": [str(d).removeprefix("torch.") for d in trainable],
            "frozen_dtypes": [str(d).removeprefix("torch.") for d in frozen],
            "replicated": [],
        }
        for name, parameters, elements, trainable, frozen in HEAD_TOY_GROUPS
    ]
    assert got["fsdp_groups"][-1] == {
        "module": "head",
        "parameters": 1,
        "elements": 35,
        "trainable_dtypes": ["float32"],
        "frozen_dtypes": [],
        "replicated": [],
    }
    assert got["replicated"] == []


def test_a_parameter_no_group_can_take_is_listed_replicated(tmp_path, capsys):
    """A module that holds a bf16 and an fp32 trainable parameter itself: no group can take the fp32
    one (fully_shard groups whole modules), so the default policy keeps it out of FSDP, replicated
    (a load averages its gradient over the ranks): listed, the model fits, exit 0."""
    from safetensors.torch import save_model

    path = str(tmp_path / "mixed.safetensors")
    save_model(own_mixed(), path)
    assert main(["inspect", path, "--model", "tests.models:own_mixed", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["fits"] and got["mismatched"] == [] and got["replicated"] == ["0.scale"]
    assert got["fsdp_groups"] == [
        {
            "module": "",
            "parameters": 1,
            "elements": 12,
            "trainable_dtypes": ["bfloat16"],
            "frozen_dtypes": [],
            "replicated": ["0.scale"],
        }
    ]
    assert main(["inspect", path, "--model", "tests.models:own_mixed"]) == 0
    text = capsys.readouterr().out
    assert "(root): 1 parameter, 12 elements, trainable bfloat16, replicated 0.scale" in text, text
    assert "replicated (kept out of FSDP" in text and "  0.scale" in text, text


def test_fsdp_groups_not_listed_inside_a_process_group(cli, capsys):
    """inspect shards over a one-rank world of its own; a process that has a process group keeps it
    untouched, and is told why no groups are listed."""
    import datetime

    import torch.distributed as dist

    tmp, _ = cli
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        assert main(["inspect", str(tmp / "toy.safetensors"), "--model", "tests.models:toy"]) == 0
        out = capsys.readouterr().out
        assert "FSDP groups: not listed (this process already has a process group)" in out
        assert "fits the model" in out and dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_model_dry_run_reports_every_mismatch(cli):
    code, out, err = cli[1]["mismatched"]
    assert code == 1, out + err
    got = json.loads(out)
    assert got["missing"] == ["bn.bias"]
    assert got["unexpected"] == ["extra.bias"]
    assert len(got["mismatched"]) == 2
    assert "blocks.0.fc.weight" in got["mismatched"][0] and "(4, 5)" in got["mismatched"][0]
    assert "blocks.1.fc.weight" in got["mismatched"][1] and "I32" in got["mismatched"][1]
    assert got["fits"] is False


def test_unreadable_checkpoint_exit_2(cli, tmp_path, capsys):
    code, out, err = cli[1]["absent"]
    assert code == 2 and "CheckpointNotFoundError" in err and out == ""
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    assert main(["inspect", str(bad)]) == 2  # in process: the same main() the subprocesses run
    assert "CheckpointFormatError" in capsys.readouterr().err


def test_model_factory_failure_exit_3(cli, capsys):
    tmp, results = cli
    code, _, err = results["no_module"]
    assert code == 3 and "ModuleNotFoundError" in err
    assert (
        main(["inspect", str(tmp / "toy.safetensors"), "--model", "tests.hf:Factory"]) == 3
    )  # needs an argument
    assert "failed to build" in capsys.readouterr().err


def test_key_map_renamed_keys_match(cli):
    code, out, err = cli[1]["key_map"]
    assert code == 0, out + err
    got = json.loads(out)
    model_keys = set(trained_toy().state_dict()) - {"head.weight"}  # head.weight: tied to emb.weight
    assert got["matched"] == got["model_tensors"] == len(model_keys)
    assert got["missing"] == [] and got["unexpected"] == [] and got["mismatched"] == []
    assert got["fits"] is True


def test_key_map_none_lists_the_key_as_ignored(cli):
    got = json.loads(cli[1]["key_map"][1])
    assert got["ignored"] == ["optimizer.step"]


def test_key_map_without_it_nothing_matches(cli, capsys):
    tmp, _ = cli
    assert main(["inspect", str(tmp / "prefixed.safetensors"), "--model", "tests.models:toy", "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["matched"] == 0 and "model.emb.weight" in got["unexpected"] and "emb.weight" in got["missing"]


def test_key_map_failures(cli, capsys):
    tmp, _ = cli
    ckpt = str(tmp / "prefixed.safetensors")
    # The same ModelMismatchError load_sharded raises, as a key-map failure (exit 3).
    assert (
        main(
            ["inspect", ckpt, "--model", "tests.models:toy", "--key-map", "tests.api.test_cli:broken_key_map"]
        )
        == 3
    )
    err = capsys.readouterr().err
    assert "--key-map tests.api.test_cli:broken_key_map: key_map('model." in err and "raised KeyError" in err
    assert (
        main(["inspect", ckpt, "--model", "tests.models:toy", "--key-map", "tests.api.test_cli:absent"]) == 3
    )
    assert "cannot load --key-map 'tests.api.test_cli:absent': AttributeError" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["inspect", ckpt, "--key-map", "tests.api.test_cli:from_prefixed"])
    assert exc.value.code == 2 and "--key-map needs --model" in capsys.readouterr().err


def test_tied_names_stored_twice_are_flagged(tmp_path, capsys):
    """A checkpoint holding both names of the toy's tied embedding / head: the keys fit, but only a
    load reads their bytes, so inspect lists them and does not say "fits the model"."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in trained_toy().state_dict().items()}
    state["head.weight"] = state["head.weight"].clone()  # both names stored, as torch.save keeps them
    path = str(tmp_path / "twice.safetensors")
    save_file(state, path)
    assert main(["inspect", path, "--model", "tests.models:toy"]) == 0
    out = capsys.readouterr().out
    assert "tied names stored more than once" in out and "  emb.weight = head.weight" in out
    assert "fits the model" not in out
    assert out.rstrip().endswith("the values of tied names stored twice are unchecked")
    assert main(["inspect", path, "--model", "tests.models:toy", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tied_twice"] == ["emb.weight = head.weight"] and got["fits"] is True


def test_tied_name_stored_once_fits(cli):
    code, out, _ = cli[1]["fits"]
    assert code == 0 and "tied names stored more than once" not in out
    assert out.rstrip().endswith("fits the model")
