"""What rank0load assumes of private torch and transformers behaviour (rank0load/integrations/_compat.py): each
test fails loudly when a release changes what the wrapper relies on.

All multi-rank checks share one spawn of 3 gloo ranks (3: sizes 7 and 11 split unevenly, and a
size-2 dimension leaves the last rank empty)."""

from __future__ import annotations

import gc
import inspect
import weakref

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from rank0load.integrations._compat import (
    StridedShard,
    backward_task_id,
    can_reduce_scatter_unused_params,
    clear_hf_initialized,
    foreach_mul_,
    foreach_norm,
    foreach_supported,
    fsdp_groups,
    hf_auto_class,
    hf_config_dict,
    hf_init_weights,
    hf_key_mapping,
    hf_registered_class_wins,
    hf_with_generation_mixin,
    host_bytes,
    local_tensor,
    no_split_modules,
    non_persistent_buffers,
    one_dim_placement,
    parameters_on_meta,
    parse_to,
    queue_backward_callback,
    root_mesh,
    split_chunks,
    transformers_5,
)
from tests import _dist

WORLD = 3
SIZES = (7, 2, 11)
PLACEMENTS = {
    "Shard(0)": Shard(0),
    "StridedShard(0, split_factor=2)": StridedShard(0, split_factor=2),
    "StridedShard(0, split_factor=3)": StridedShard(0, split_factor=3),
}


def _index(placements: tuple, mesh_shape: tuple[int, ...], coord: tuple[int, ...], dim: int, size: int):
    """The global indices of tensor dimension ``dim`` the rank at ``coord`` holds, from the _compat
    helpers alone: ``one_dim_placement`` then ``split_chunks`` mesh dimension by mesh dimension."""
    index = torch.arange(size)
    for mesh_dim, p in enumerate(placements):
        one = one_dim_placement(p, dim)
        assert one is not None, p
        if type(one) is not Replicate:
            index = split_chunks(one, index, mesh_shape[mesh_dim])[coord[mesh_dim]]
    return index


def _ranks(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    out: dict = {"split": {}, "block": {}}
    mesh = init_device_mesh("cpu", (world,))

    # split_chunks: what distribute_tensor(..., src_data_rank=None) keeps at this coordinate (it does
    # not communicate: each rank cuts its own piece of the tensor it is given).
    for size in SIZES:
        t = torch.arange(size)
        for name, p in PLACEMENTS.items():
            kept = distribute_tensor(t, mesh, [p], src_data_rank=None).to_local()
            out["split"][size, name] = (kept.tolist(), split_chunks(p, t, world)[rank].tolist())

    # one_dim_placement: a 2-D tensor's local block is the cross product of per-dimension indices.
    full = torch.arange(5 * 11).reshape(5, 11)
    for p in (Shard(0), Shard(1), StridedShard(1, split_factor=2), Replicate()):
        kept = distribute_tensor(full, mesh, [p], src_data_rank=None).to_local()
        rows, cols = (_index((p,), (world,), (rank,), d, full.shape[d]) for d in (0, 1))
        out["block"][repr(p)] = (kept.tolist(), full[rows][:, cols].tolist())

    # FSDP2 over a colwise tensor-parallel shard stores the weight as our StridedShard; writing each
    # rank's predicted rows into local_tensor() loads the parameter (what rank0load's BLOCK path does).
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 7, bias=False))
    parallelize_module(model, mesh2["tp"], {"0": ColwiseParallel()})
    fully_shard(model, mesh=mesh2["dp"])
    model.to_empty(device="cpu")
    weight = model[0].weight
    want = torch.arange(7 * 4, dtype=torch.float32).reshape(7, 4)
    rows = _index(tuple(weight.placements), tuple(mesh2.shape), tuple(mesh2.get_coordinate()), 0, 7)
    local_tensor(weight).copy_(want[rows])
    out["fsdp_tp_placements"] = [type(p).__name__ for p in weight.placements]
    out["fsdp_tp_is_strided"] = type(weight.placements[0]) is StridedShard
    out["fsdp_tp_loaded"] = torch.equal(weight.full_tensor(), want)
    # root_mesh: the mesh a sub-mesh was sliced from (load_training_state's default load mesh)
    out["root_of_slice"] = root_mesh(mesh2["dp"]) == mesh2 and root_mesh(mesh2) == mesh2

    # local_tensor: the storage FSDP2 keeps (writing it loads the parameter), torch.chunk row counts.
    with torch.device("meta"):
        linear = nn.Linear(4, 7)  # 7 rows over 3 ranks: chunk gives 3, 3, 1 (an even split: 3, 2, 2)
    fully_shard(linear, mesh=mesh)
    linear.to_empty(device="cpu")
    local = local_tensor(linear.weight)
    local.copy_(torch.full_like(local, float(rank + 1)))
    out["local_full"] = linear.weight.full_tensor()
    out["local_is_storage"] = (
        local.untyped_storage().data_ptr() == linear.weight.to_local().untyped_storage().data_ptr()
    )
    out["local_contiguous"] = local.is_contiguous()
    out["local_rows"] = local.shape[0]

    # fsdp_groups: each group under the module fully_shard was applied to, in
    # named_modules() order, holding the very parameters the modules register (whole shapes), and
    # a frozen parameter's requires_grad; the FSDP+TP weight above is one group of one DTensor.
    with torch.device("meta"):
        seq = nn.Sequential(nn.Linear(4, 7), nn.Linear(7, 3, bias=False))
    seq[0].bias.requires_grad_(False)
    fully_shard(seq[1], mesh=mesh)
    fully_shard(seq, mesh=mesh)
    own = {id(p): n for n, p in seq.named_parameters()}
    out["group_params"] = [
        (name, module is seq.get_submodule(name), [(own.get(id(p)), tuple(p.shape)) for _, p in params])
        for name, module, params in fsdp_groups(seq)
    ]
    out["groups"] = [
        (name, [(n, p.dtype, p.requires_grad) for n, p in ps]) for name, _, ps in fsdp_groups(seq)
    ]
    out["tp_group"] = [(n, [type(p).__name__ for _, p in ps]) for n, _, ps in fsdp_groups(model)]
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return _dist.ok(_dist.run(_ranks, WORLD))


def test_split_chunks_is_what_distribute_tensor_keeps(ranks):
    for rank, r in enumerate(ranks):
        for size in SIZES:
            for name in PLACEMENTS:
                kept, predicted = r["split"][size, name]
                assert predicted == kept, f"rank {rank}, size {size}, {name}: {predicted} != {kept}"
    # The uneven cases really are uneven (and strided ones strided), so the check means something.
    assert [r["split"][7, "Shard(0)"][0] for r in ranks] == [[0, 1, 2], [3, 4, 5], [6]]
    assert ranks[0]["split"][11, "StridedShard(0, split_factor=2)"][0] == [0, 1, 6, 7]
    assert ranks[2]["split"][2, "Shard(0)"][0] == []


def test_one_dim_placement_gives_each_dimensions_indices(ranks):
    for rank, r in enumerate(ranks):
        assert len(r["block"]) == 4
        for name, (kept, predicted) in r["block"].items():
            assert predicted == kept, f"rank {rank}, {name}: {predicted} != {kept}"


def test_root_mesh_is_the_mesh_a_slice_was_cut_from(ranks):
    assert all(r["root_of_slice"] for r in ranks), (
        "DeviceMesh._get_root_mesh changed: update _compat.root_mesh"
    )


def test_fsdp2_over_tensor_parallel_uses_strided_shard(ranks):
    for r in ranks:
        assert r["fsdp_tp_placements"] == ["_StridedShard", "Shard"]
        assert r["fsdp_tp_is_strided"], (
            "FSDP2 no longer places torch's _StridedShard: update _compat.StridedShard"
        )
        assert r["fsdp_tp_loaded"]


def test_local_tensor_is_the_parameters_storage(ranks):
    want = torch.tensor([1.0] * 3 + [2.0] * 3 + [3.0]).unsqueeze(1).expand(7, 4)
    for r in ranks:
        assert r["local_is_storage"] and r["local_contiguous"]
        assert torch.equal(r["local_full"], want)
    assert [r["local_rows"] for r in ranks] == [3, 3, 1]  # torch.chunk semantics, as _plan.rows_of assumes
    plain = torch.zeros(3)
    assert local_tensor(plain) is plain


def test_fsdp_groups_name_each_groups_parameters(ranks):
    f32 = torch.float32
    for r in ranks:
        assert r["group_params"] == [
            ("", True, [("0.weight", (7, 4)), ("0.bias", (7,))]),
            ("1", True, [("1.weight", (3, 7))]),
        ], "FSDP2's group state changed: update _compat.fsdp_groups"
        assert r["groups"] == [
            ("", [("0.weight", f32, True), ("0.bias", f32, False)]),
            ("1", [("1.weight", f32, True)]),
        ]
        assert r["tp_group"] == [("", ["DTensor"])]


def test_one_dim_placement_and_strided_shard_fields():
    strided = StridedShard(1, split_factor=4)
    assert (strided.dim, strided.split_factor) == (1, 4)  # the fields one_dim_placement reads
    assert one_dim_placement(Shard(1), 1) == Shard(0)
    assert one_dim_placement(Shard(1), 0) == Replicate()
    got = one_dim_placement(strided, 1)
    assert isinstance(got, StridedShard) and (got.dim, got.split_factor) == (0, 4)
    assert one_dim_placement(strided, 0) == Replicate()
    assert one_dim_placement(Replicate(), 0) == Replicate()
    assert one_dim_placement(Partial(), 0) is None


def test_foreach_helpers_clip_grad_norm_relies_on():
    assert foreach_supported(torch.device("cpu")) and not foreach_supported(torch.device("meta"))
    tensors = [torch.tensor([3.0, -4.0]), torch.tensor([1.0, 2.0], dtype=torch.bfloat16)]
    norms = foreach_norm(tensors, 2.0, torch.float32)  # one norm per tensor, in the dtype asked for
    assert [n.dtype for n in norms] == [torch.float32] * 2
    torch.testing.assert_close(torch.stack(norms), torch.tensor([5.0, 5**0.5]))
    assert foreach_norm([torch.tensor([1.0, -7.0])], float("inf"), torch.float32)[0].item() == 7.0
    with pytest.raises(RuntimeError, match="empty tensor"):  # why clip_grad_norm_ drops empty shards
        foreach_norm([torch.empty(0)], float("inf"), torch.float32)
    foreach_mul_(tensors, torch.tensor(0.5))
    assert tensors[0].tolist() == [1.5, -2.0] and tensors[1].tolist() == [0.5, 1.0]


def test_reduce_scatter_unused_params_is_there_from_torch_2_13():
    """Where FSDP2 has the switch, a group holding routed experts reduce-scatters zeros for unused
    ones; where it has not (torch 2.12), rank0load refuses to train them (model/_shard.py)."""
    from torch.distributed.fsdp import FSDPModule

    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert can_reduce_scatter_unused_params() is (release >= (2, 13)), torch.__version__
    if can_reduce_scatter_unused_params():
        params = inspect.signature(FSDPModule.set_reduce_scatter_unused_params).parameters
        assert list(params)[::2] == ["self", "recurse"] and len(params) == 3, params


def test_backward_callbacks_run_once_at_the_end_in_queue_order():
    """train._replicas queues its gradient averaging once per backward, after FSDP2's final callback:
    callbacks run in the order queued, after every gradient; each backward has its own task id."""
    seen: list[object] = []
    x = torch.ones(2, requires_grad=True)

    def hook(grad: torch.Tensor) -> None:
        seen.append(backward_task_id())
        queue_backward_callback(lambda: seen.append(("first", x.grad is not None)))
        queue_backward_callback(lambda: seen.append("second"))

    for _ in range(2):
        y = x * 2
        y.register_hook(hook)
        y.sum().backward()
    assert backward_task_id() == -1
    first, second = seen[0], seen[3]
    assert isinstance(first, int) and isinstance(second, int) and first >= 0 and second != first, seen
    assert seen[1:3] == [("first", True), "second"] == seen[4:6], seen


def test_parse_to_names_what_tensor_to_would_do():
    """PEFT moves new adapters with ``Tensor.to``; _peft keeps them off meta by what it names."""
    assert parse_to("meta", torch.bfloat16) == (torch.device("meta"), torch.bfloat16)
    assert parse_to(dtype=torch.float16) == (None, torch.float16)
    assert parse_to(device="cpu") == (torch.device("cpu"), None)
    assert parse_to(torch.empty(0, dtype=torch.int8)) == (torch.device("cpu"), torch.int8)


def test_strided_shard_is_neither_shard_nor_is_shard():
    """clip_grad_norm_ names _StridedShard beside Shard: it is no subclass and is_shard() is False
    (were that to change, rank0load.train._clip._shard_groups could test Shard alone)."""
    strided = StridedShard(0, split_factor=2)
    assert not isinstance(strided, Shard) and not strided.is_shard() and not strided.is_replicate()


def test_host_bytes_keeps_its_tensor_alive():
    # A view that outlives its tensor would read or write freed memory: _broadcast_object unpickles
    # host_bytes(payload.cpu()), a temporary copy on an accelerator mesh.
    t = torch.arange(6, dtype=torch.uint8)
    alive = weakref.ref(t)
    view = host_bytes(t)[2:5]
    del t
    gc.collect()
    assert alive() is not None and bytes(view) == bytes([2, 3, 4])
    del view
    gc.collect()
    assert alive() is None  # and nothing more: the view is the tensor's last owner


def test_host_bytes_is_a_writable_alias():
    t = torch.arange(6, dtype=torch.uint8)
    view = host_bytes(t)
    assert bytes(view) == bytes(range(6)) and view.format == "B" and not view.readonly
    view[2:4] = b"\xff\xfe"
    assert t.tolist() == [0, 1, 255, 254, 4, 5]
    assert len(host_bytes(torch.empty(0, dtype=torch.uint8))) == 0
    with pytest.raises(ValueError, match="contiguous uint8 CPU tensor"):
        host_bytes(torch.zeros(3))
    with pytest.raises(ValueError, match="contiguous uint8 CPU tensor"):
        host_bytes(torch.zeros(4, 4, dtype=torch.uint8).t())


def test_non_persistent_buffers_is_what_state_dict_skips():
    m = nn.Module()
    m.register_buffer("kept", torch.zeros(2))
    m.register_buffer("computed", torch.ones(2), persistent=False)
    assert non_persistent_buffers(m) == {"computed"}
    assert set(m.state_dict()) == {"kept"}
    non_persistent_buffers(m).add("kept")  # the set itself is what state_dict consults
    assert set(m.state_dict()) == set()


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 5)
        self.head = nn.Linear(5, 7, bias=False)
        self.head.weight = self.emb.weight  # a tie made during construction
        self.bn = nn.BatchNorm1d(5)
        self.register_buffer("scale", torch.arange(5.0), persistent=False)


def test_parameters_on_meta_keeps_ties_and_real_buffers():
    original = nn.Module.register_parameter
    with parameters_on_meta():
        model = _Tied()
    assert nn.Module.register_parameter is original  # the patch is undone
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.head.weight is model.emb.weight
    assert [n for n, _ in model.named_parameters()] == ["emb.weight", "bn.weight", "bn.bias"]
    assert all(b.device.type == "cpu" for b in model.buffers())
    assert torch.equal(model.scale, torch.arange(5.0)) and torch.equal(model.bn.running_var, torch.ones(5))
    assert model.emb.weight.requires_grad and type(model.emb.weight) is nn.Parameter

    with pytest.raises(RuntimeError, match="boom"), parameters_on_meta():
        raise RuntimeError("boom")
    assert nn.Module.register_parameter is original  # undone on an exception too
    assert nn.Linear(2, 2).weight.device.type == "cpu"


# --- transformers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_no_split_modules_names_the_decoder_layer(llama):
    names = no_split_modules(llama)
    assert "LlamaDecoderLayer" in names
    assert type(llama.model.layers[0]).__name__ in names  # what _shard.find_blocks matches on
    string = nn.Module()
    string._no_split_modules = "Block"  # type: ignore[assignment]
    assert no_split_modules(string) == {"Block"} and no_split_modules(nn.Linear(2, 2)) == set()


def test_hf_init_weights_writes_the_modules_parameters(llama):
    up = llama.model.layers[0].mlp.up_proj
    norm = llama.model.layers[1].input_layernorm
    init = hf_init_weights(llama, "model.layers.0.mlp.up_proj")
    assert init is not None and init.__self__ is llama.model  # the nearest PreTrainedModel ancestor
    with torch.no_grad():
        up.weight.fill_(float("nan"))
        norm.weight.zero_()
        init(up)
        init(norm)
    assert not up.weight.isnan().any() and up.weight.std() > 0
    assert torch.equal(norm.weight, torch.ones_like(norm.weight))
    assert hf_init_weights(nn.Sequential(nn.Linear(2, 2)), "0") is None


@pytest.mark.transformers
def test_clear_hf_initialized_lets_init_weights_write_again(llama):
    import transformers
    from transformers import PreTrainedModel

    down = llama.model.layers[0].mlp.down_proj
    init = hf_init_weights(llama, "model.layers.0.mlp.down_proj")
    assert init is not None
    with torch.no_grad():
        down.weight.fill_(float("nan"))
        down.weight._is_hf_initialized = True  # what from_pretrained sets on loaded tensors
        down._is_hf_initialized = True
        init(down)
        # 5.x's init helpers skip a flagged tensor; 4.57's _init_weights writes it (only the module flag counts)
        skipped = bool(down.weight.isnan().all())
        assert skipped == (int(transformers.__version__.split(".")[0]) >= 5), (
            "transformers changed which flagged tensors it skips: review _compat"
        )
        down.weight.fill_(float("nan"))
        clear_hf_initialized(down, [down.weight])
        assert not hasattr(down.weight, "_is_hf_initialized") and "_is_hf_initialized" not in vars(down)
        init(down)
    assert not down.weight.isnan().any()
    # The module flag: transformers skips a flagged module before calling _init_weights on it.
    source = inspect.getsource(PreTrainedModel._initialize_weights)
    assert 'getattr(module, "_is_hf_initialized", False)' in source, (
        "transformers no longer reads the module's _is_hf_initialized: review _compat.clear_hf_initialized"
    )


# --- transformers' remote code (trust_remote_code=True) ---------------------------------------------------


def _remote_checkpoint(folder, config: dict, code: dict[str, str]) -> str:
    import json
    import os

    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    for name, text in code.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    return str(folder)


def test_remote_model_class_over_transformers_own(tmp_path, hf_modules_cache):
    """A Llama checkpoint whose auto_map names a model class of its own: from_pretrained runs it, and
    registers it for the Auto class (save_pretrained then copies its code) as
    ``_transformers._remote_model_class`` does for a config transformers has a model for (transformers 5)
    and for one it has none for (every release); ``_remote_code.read`` / ``import_class`` give the class
    under from_pretrained's module name."""
    transformers = pytest.importorskip("transformers")
    from rank0load import _transformers
    from rank0load.integrations import _remote_code
    from tests import hf

    folder = str(tmp_path / "my-llama")
    hf.pretrained("llama").save_pretrained(folder)
    code = "from transformers import LlamaForCausalLM\n\n\nclass MyLlama(LlamaForCausalLM):\n    pass\n"
    with open(f"{folder}/modeling_my_llama.py", "w") as f:
        f.write(code)
    auto_map = {"AutoModelForCausalLM": "modeling_my_llama.MyLlama"}
    hf._quiet()
    config = transformers.AutoConfig.from_pretrained(folder)
    config.auto_map = auto_map
    config.save_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert type(model).__name__ == "MyLlama" and type(model.config) is transformers.LlamaConfig
    expected = "AutoModelForCausalLM" if transformers_5() else None
    assert hf_auto_class(type(model)) == expected, "review _compat.transformers_5 in _transformers"

    read = _remote_code.read(folder, False, None, auto_map, ("AutoConfig", "AutoModelForCausalLM"), "c")
    (entry,) = read.classes.values()
    assert read.files == {entry.module: code.encode()}
    found = _remote_code.import_class(entry, transformers.PreTrainedModel, "c")
    assert found.__module__ == type(model).__module__ == entry.module.removesuffix(".py").replace("/", ".")

    found._auto_class = None  # unregistered: rank0load registers it as from_pretrained did
    local = _transformers._remote_model_class(transformers.AutoModelForCausalLM, model.config, read, "c")
    assert hf_auto_class(local) == expected

    class AutoModelForCausalLM:  # an Auto class with no model for LlamaConfig
        _model_mapping: dict = {}

        @classmethod
        def register(cls, config_class, model_class, exist_ok=False):
            cls._model_mapping[config_class] = model_class

    found._auto_class = None
    remote = _transformers._remote_model_class(AutoModelForCausalLM, transformers.LlamaConfig(), read, "c")
    assert AutoModelForCausalLM._model_mapping == {transformers.LlamaConfig: found}
    assert hf_auto_class(remote) == "AutoModelForCausalLM"


def test_registered_config_class_wins_from_transformers_5(tmp_path, hf_modules_cache):
    """A config class registered for the model type outside transformers: transformers 5's
    AutoConfig.from_pretrained takes it over the checkpoint's own (``explicit_local_code``), 4.57's runs
    the remote code; transformers' own classes never win."""
    transformers = pytest.importorskip("transformers")

    class Registered(transformers.PretrainedConfig):
        model_type = "rank0load_registered"

    transformers.AutoConfig.register("rank0load_registered", Registered, exist_ok=True)
    remote = (
        "from transformers import PretrainedConfig\n\n\n"
        "class RemoteConfig(PretrainedConfig):\n    model_type = 'rank0load_registered'\n"
    )
    folder = _remote_checkpoint(
        tmp_path / "registered",
        {"model_type": "rank0load_registered", "auto_map": {"AutoConfig": "configuration_r.RemoteConfig"}},
        {"configuration_r.py": remote},
    )
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True)
    wins = type(config) is Registered
    assert wins == hf_registered_class_wins(Registered), "review _compat.hf_registered_class_wins"
    assert wins == (int(transformers.__version__.split(".")[0]) >= 5)
    assert not hf_registered_class_wins(transformers.LlamaConfig) and not hf_registered_class_wins(None)
    assert hf_auto_class(type(config)) == ("AutoConfig" if not wins else None)


def test_hf_config_dict_reads_config_json_as_transformers_does(tmp_path):
    """Non-finite floats round-trip as the installed transformers writes and reads them (5: encoded as
    {"__float__": ...} and decoded by the class; 4.57: bare Infinity, which json.loads takes)."""
    import json

    from transformers import LlamaConfig

    LlamaConfig(time_step_limit=[0.0, float("inf")], scale=float("-inf")).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    read = hf_config_dict(LlamaConfig, raw)
    assert read == LlamaConfig._dict_from_json_file(path)  # transformers' own reader
    assert read["time_step_limit"] == [0.0, float("inf")] and read["scale"] == float("-inf")
    assert LlamaConfig.from_dict(read).time_step_limit == [0.0, float("inf")]


def test_hf_key_mapping_is_what_4_57_applies_to_a_vision_language_model():
    """transformers 4.57 renames a VLM's checkpoint keys by its class's _checkpoint_conversion_mapping
    (modeling_utils.VLMS); 5 has none (its conversion mapping does it); a text model has none either."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):
        gemma3 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma3"))
        llama = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=1))
    assert hf_key_mapping(llama) is None
    if transformers_5():
        assert hf_key_mapping(gemma3) is None
        return
    from transformers import modeling_utils

    assert "gemma3" in modeling_utils.VLMS, "4.57's VLMS changed: review _compat.hf_key_mapping"
    assert hf_key_mapping(gemma3) == dict(type(gemma3)._checkpoint_conversion_mapping)
    assert hf_key_mapping(gemma3), "Gemma 3 has a key mapping on 4.57"


def test_with_generation_mixin_adds_it_where_the_class_generates():
    transformers = pytest.importorskip("transformers")
    from transformers.generation import GenerationMixin

    class Plain(transformers.PreTrainedModel):
        config_class = transformers.PretrainedConfig

    class Generates(Plain):
        def prepare_inputs_for_generation(self, *args, **kwargs):
            return kwargs

    assert hf_with_generation_mixin(Plain) is Plain
    made = hf_with_generation_mixin(Generates)
    assert issubclass(made, Generates) and GenerationMixin in made.__mro__ and made.__name__ == "Generates"
