"""The one place rank0load leans on private torch, transformers and diffusers behaviour that could change
(transformers' checkpoint conversions: ``_convert``). ``tests/integrations/test_compat.py`` and
``tests/api/test_diffusers.py`` fail loudly when a release changes any of it. (all ranks, no collectives)
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

# Private: FSDP2 places it on top of a tensor-parallel Shard of the same dimension.
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard


def host_bytes(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous uint8 CPU tensor's bytes, without numpy (else ValueError).
    The view, and every slice of it, keeps ``t`` alive."""
    if not (t.device.type == "cpu" and t.dtype == torch.uint8 and t.is_contiguous()):
        raise ValueError(f"host_bytes needs a contiguous uint8 CPU tensor, got {t.dtype} on {t.device}")
    if t.numel() == 0:
        return memoryview(bytearray())
    array = (ctypes.c_char * t.numel()).from_address(t.data_ptr())
    array.owner = t  # type: ignore[attr-defined]  # from_address holds no reference: the view holds the array
    return memoryview(array).cast("B")


def foreach_supported(device: torch.device) -> bool:
    """Whether ``_foreach_*`` kernels run on ``device``. Private: ``_device_has_foreach_support``."""
    from torch.utils._foreach_utils import _device_has_foreach_support

    return bool(_device_has_foreach_support(device))


def foreach_norm(tensors: list[torch.Tensor], ord: float, dtype: torch.dtype) -> list[torch.Tensor]:
    """One ``ord``-norm per tensor in ``dtype``: ``torch._foreach_norm`` (non-empty tensors for ``inf``)."""
    return list(torch._foreach_norm(tensors, ord, dtype=dtype))


def foreach_mul_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every tensor in place by the one-element ``factor`` (on their device): ``_foreach_mul_``."""
    torch._foreach_mul_(tensors, factor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's data: a DTensor's local shard itself (FSDP2's storage, not an autograd view: writing
    into it loads the parameter), or ``t`` itself for a plain tensor."""
    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():
        return t.to_local()


def one_dim_placement(placement: object, dim: int) -> Placement | None:
    """``placement`` as it acts on tensor dimension ``dim`` alone, as a placement of a 1-D tensor;
    None for ``Partial`` or a placement rank0load does not know."""
    if type(placement) is Replicate:
        return Replicate()
    if isinstance(placement, StridedShard):
        return StridedShard(0, split_factor=placement.split_factor) if placement.dim == dim else Replicate()
    if type(placement) is Shard:
        return Shard(0) if placement.dim == dim else Replicate()
    return None


def split_chunks(placement: Placement, t: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """The ``parts`` unpadded pieces of dimension 0 of ``t`` under ``placement`` (``Shard(0)`` or
    ``_StridedShard(0)``), one per mesh coordinate, as ``distribute_tensor`` splits it.
    Private: ``Placement._split_tensor``."""
    chunks, _ = placement._split_tensor(t, parts, with_padding=False, contiguous=False)  # type: ignore[attr-defined]
    return list(chunks)


def fsdp_groups(
    model: nn.Module, names: dict[int, str] | None = None
) -> list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Every FSDP2 group in ``model``, in ``named_modules()`` order: its module's qualified name, the
    module, and each sharded DTensor parameter with its qualified name. ``names``: module names by
    ``id``, if the caller has them. Private: ``FSDPModule._get_fsdp_state``,
    ``FSDPState._fsdp_param_groups`` (torch 2.12 and later; ``_fsdp_param_group``, one or None, before),
    ``FSDPParam.sharded_param`` and ``FSDPParam._module_info``."""
    from torch.distributed.fsdp import FSDPModule

    if names is None:
        names = {id(m): n for n, m in model.named_modules()}
    out: list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]] = []
    for name, module in model.named_modules():
        for group in _param_groups(module) if isinstance(module, FSDPModule) else []:
            params = []
            for fp in group.fsdp_params:
                owner = names.get(id(fp._module_info.module), "")
                leaf = fp._module_info.param_name
                params.append((f"{owner}.{leaf}" if owner else leaf, fp.sharded_param))
            out.append((name, module, params))
    return out


def _param_groups(module: Any) -> list[Any]:
    """An FSDP module's ``FSDPParamGroup`` objects: torch 2.12 keeps a list (``_fsdp_param_groups``),
    2.11 and before one group or None (``_fsdp_param_group``)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward ends, after the callbacks queued before it (call it in a
    backward only). Private: ``Variable._execution_engine.queue_callback``, as FSDP2 queues its own."""
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(fn)


def backward_task_id() -> int | None:
    """An id of the backward running now (-1 outside one), or None where torch has no such call.
    Private: ``torch._C._current_graph_task_id``."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return None if task is None else int(task())


def can_reduce_scatter_unused_params() -> bool:
    """Whether FSDP2 has ``FSDPModule.set_reduce_scatter_unused_params`` (torch 2.13 and later)."""
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "set_reduce_scatter_unused_params")


def fsdp_shards_integer_parameters() -> bool:
    """Whether ``fully_shard`` can shard an integer or bool parameter: torch 2.12 and later. Before,
    ``FSDPParam`` wraps each shard as ``nn.Parameter(dtensor)`` with the default ``requires_grad=True``
    and only then sets the parameter's own flag: 2.11 raises ("only Tensors of floating point dtype can
    require gradients") and older releases leave a frozen one requiring grad. 2.12 passes the flag to
    ``nn.Parameter`` (``_fsdp_param.py``, ``_init_sharded_param``)."""
    return torch_release() >= (2, 12)


def torch_release() -> tuple[int, int]:
    """(major, minor) of the installed torch: ``2.11.0+cu130`` -> (2, 11)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def parse_to(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """The (device, dtype) a ``Tensor.to(*args, **kwargs)`` call names. Private: ``_C._nn._parse_to``."""
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    return device, dtype


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """Names of ``module``'s own buffers kept out of its state dict (``persistent=False``)."""
    return module._non_persistent_buffers_set


def no_split_modules(model: nn.Module) -> set[str]:
    """transformers' ``_no_split_modules``: class names of the model's decoder/encoder layers."""
    names = getattr(model, "_no_split_modules", None) or ()
    return {names} if isinstance(names, str) else set(names)


def hf_init_weights(model: nn.Module, module_name: str) -> Callable[[nn.Module], object] | None:
    """The nearest ancestor's (or the module's own) transformers ``_init_weights``, or None."""
    parts = module_name.split(".") if module_name else []
    for depth in range(len(parts), -1, -1):
        ancestor = model.get_submodule(".".join(parts[:depth])) if depth else model
        init = getattr(ancestor, "_init_weights", None)
        if callable(init):
            return init
    return None


def clear_hf_initialized(module: nn.Module, tensors: list[torch.Tensor]) -> None:
    """Drop transformers' ``_is_hf_initialized`` flags, so that ``_init_weights`` skips nothing."""
    module.__dict__.pop("_is_hf_initialized", None)
    for t in tensors:
        if hasattr(t, "_is_hf_initialized"):
            del t._is_hf_initialized


_patch_lock = threading.Lock()


@contextlib.contextmanager
def parameters_on_meta(keep_real: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """Patch ``nn.Module.register_parameter`` so every registered parameter lives on meta, except
    while ``keep_real()`` is true (PEFT's new adapters). A ``Parameter`` registered twice (a tie)
    maps to one meta parameter, so ties survive."""
    original = nn.Module.register_parameter
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta" and not keep_real():
            if id(param) not in replaced:
                # Keep `param` alive in the dict so its id() cannot be reused during the build.
                replaced[id(param)] = (param, to_meta(param))
            param = replaced[id(param)][1]
        original(self, name, param)

    with _patch_lock:
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        try:
            yield
        finally:
            nn.Module.register_parameter = original  # type: ignore[method-assign]


def to_meta(param: nn.Parameter) -> nn.Parameter:
    data = param.detach().to("meta")
    if type(param) is nn.Parameter:
        return nn.Parameter(data, requires_grad=param.requires_grad)
    # Parameter subclasses carry extra state in __dict__ (as accelerate's init_empty_weights does).
    kwargs = dict(param.__dict__)
    kwargs["requires_grad"] = param.requires_grad
    return type(param)(data, **kwargs)


def peft_base_model(model: nn.Module) -> nn.Module:
    """The base model a PEFT wrapper holds, or ``model``; never imports peft for another model."""
    if "peft" not in sys.modules:
        return model
    from peft.tuners.tuners_utils import BaseTuner

    inner = getattr(model, "base_model", None)
    if isinstance(inner, BaseTuner) and inner is not model:  # a PeftModel
        model = inner
    if isinstance(model, BaseTuner):
        return model.model
    return model


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``PreTrainedModel``, without importing transformers for another model."""
    if not any(c.__module__.startswith("transformers.") for c in type(model).__mro__):
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def transformers_5() -> bool:
    """Whether transformers is 5.x (not 4.57): it then has checkpoint conversions (4.57 only renames
    keys), ``from_pretrained`` without ``dtype`` uses the config's dtype, and with remote code registers
    the remote class for the Auto class (``register_for_auto_class``) even where transformers has a
    model for the config."""
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (``mesh["dp"]`` -> the 2-D mesh), or ``mesh``: private
    (``DeviceMesh._get_root_mesh``, torch 2.10 to 2.15); without it, ``mesh``."""
    get = getattr(mesh, "_get_root_mesh", None)
    root = get() if callable(get) else None
    return root if isinstance(root, DeviceMesh) else mesh


def hf_key_mapping(model: nn.Module) -> dict[str, str] | None:
    """transformers 4.57's ``key_mapping`` for ``model``: its class's ``_checkpoint_conversion_mapping``
    (regex -> replacement) where a class of its MRO names one of ``modeling_utils.VLMS`` (Gemma 3,
    Fuyu, GOT-OCR2, LLaVA, ...), as 4.57's ``from_pretrained`` applies it and ``save_pretrained``
    reverts it; None otherwise, and on transformers 5 (whose conversion mapping replaces it)."""
    if transformers_5():
        return None
    from transformers import modeling_utils

    vlms = getattr(modeling_utils, "VLMS", ())
    names = [c.__name__.lower() for c in type(model).__mro__[:-1]]
    if not any(v in n for n in names for v in vlms):
        return None
    return dict(getattr(model, "_checkpoint_conversion_mapping", None) or {}) or None


def hf_config_dict(config_class: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` as ``config_class`` reads it (``_dict_from_json_file`` after ``json.loads``):
    transformers 5 decodes the non-finite floats it writes as ``{"__float__": "Infinity"}`` (``"NaN"``,
    ``"-Infinity"``: Falcon-H1's ``time_step_limit``); 4.57 writes and reads them as bare JSON
    ``Infinity``, which ``json.loads`` already takes, and has no decoder."""
    decode = getattr(config_class, "_decode_special_floats", None)
    return decode(raw) if callable(decode) else raw


def hf_registered_class_wins(cls: object) -> bool:
    """Whether transformers' Auto classes take the registered ``cls`` over the checkpoint's remote code
    even with ``trust_remote_code=True``: transformers 5 does for a ``cls`` defined outside
    transformers (``explicit_local_code``); 4.57 never. None (nothing registered): False."""
    return (
        cls is not None
        and transformers_5()
        and not str(getattr(cls, "__module__", "")).startswith("transformers.")
    )


def hf_auto_class(cls: type) -> str | None:
    """The Auto class a remote-code class was registered for (private ``_auto_class``), or None."""
    auto = getattr(cls, "_auto_class", None)
    return auto if isinstance(auto, str) else getattr(auto, "__name__", None)


def hf_with_generation_mixin(model_class: type) -> type:
    """``model_class`` with ``GenerationMixin`` added where it generates, as ``from_pretrained`` builds
    a remote-code class. Internal: ``auto_factory.add_generation_mixin_to_remote_model``."""
    from transformers.models.auto.auto_factory import add_generation_mixin_to_remote_model

    return add_generation_mixin_to_remote_model(model_class)  # type: ignore[no-any-return]


def hf_keep_in_fp32(model: nn.Module, dtype: torch.dtype) -> Callable[[str], bool] | None:
    r"""Which tensor names transformers keeps in float32 when the rest is cast to ``dtype``
    (``_keep_in_fp32_modules`` for float16, ``..._strict`` for float16 and bfloat16), or None.
    transformers 5: ``_get_dtype_plan``; 4.57: the lists, matched as ``from_pretrained`` matches them."""
    if hasattr(model, "_get_dtype_plan"):
        plan = model._get_dtype_plan(dtype)  # type: ignore[operator]
        if not plan:
            return None
        from transformers.core_model_loading import build_glob_alternation

        regex = build_glob_alternation(list(plan))[0]
    else:
        modules: list[str] = []
        loose = getattr(model, "_keep_in_fp32_modules", None)
        strict = getattr(model, "_keep_in_fp32_modules_strict", None)
        if loose and dtype == torch.float16:
            modules += list(loose)
        if strict and dtype in (torch.float16, torch.bfloat16):
            modules += list(strict)
        if not modules:
            return None
        regex = re.compile("|".join(rf"((^|\.){m}($|\.))" for m in modules))
    return lambda name: regex.search(name) is not None


def is_diffusers_class(cls: object) -> bool:
    """Whether ``cls`` is a diffusers ``ModelMixin`` subclass, without importing diffusers for another."""
    if not isinstance(cls, type) or not any(c.__module__.startswith("diffusers.") for c in cls.__mro__):
        return False
    from diffusers import ModelMixin

    return issubclass(cls, ModelMixin)


def diffusers_keep_in_fp32(model: nn.Module, dtype: torch.dtype) -> Callable[[str], bool] | None:
    """Which state-dict keys diffusers' ``from_pretrained(torch_dtype=dtype)`` keeps in float32: those
    with a ``.``-segment in the class's ``_keep_in_fp32_modules`` (diffusers 0.42,
    ``load_model_dict_into_meta``). None when it keeps none."""
    modules = getattr(type(model), "_keep_in_fp32_modules", None)
    if modules is None:
        return None
    entries = modules if isinstance(modules, list) else [modules]
    return lambda name: any(entry in name.split(".") for entry in entries)


def diffusers_config_json(model: nn.Module) -> tuple[str, str]:
    """(file name, text) of the config diffusers' ``save_config`` writes for ``model``, naming the
    class ``fully_shard`` wrapped, ``model`` unchanged. Private: ``ConfigMixin.to_json_string``."""
    from diffusers.configuration_utils import ConfigMixin, FrozenDict
    from torch.distributed.fsdp import FSDPModule

    cls: Any = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    attrs = {"__module__": cls.__module__, "_auto_class": getattr(model, "_auto_class", None)}
    stand_in: Any = type(cls.__name__, (), attrs)()
    stand_in._internal_dict = FrozenDict(dict(model.config))  # type: ignore[arg-type]
    return str(cls.config_name), ConfigMixin.to_json_string(stand_in)
