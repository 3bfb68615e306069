"""Build the model with parameters on meta and buffers real; record ties and non-persistent buffers.

(all ranks, no collectives) :func:`build_on_meta` runs ``model_fn`` (initialisers run on meta for
free; buffers such as ``inv_freq`` keep their eager values); :func:`describe` makes the ``ModelLayout``.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from ..common._failure import UserCodeFailure, user_code
from ..integrations._compat import hf_init_weights, non_persistent_buffers, parameters_on_meta, to_meta
from ..integrations._peft import adapters_built_real, base_key, building_adapters, tuner_layers_without_values

# The dtypes torch.set_default_dtype accepts (from_pretrained builds in them the same way).
_DEFAULTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def build_on_meta(
    model_fn: Callable[[], nn.Module],
    dtype: torch.dtype | None = None,
    rng_state: torch.Tensor | None = None,
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """(all ranks) Call ``model_fn()`` with parameters on meta and buffers real; with ``dtype``, with
    torch's default dtype set to it. PEFT adapters are built for real, from ``rng_state`` (rank 0's
    CPU random state; this rank's own is restored after; rank 0 passes None). Returns the model, and
    the values of the parameters built real (by first name), for ``_model.apply_built``."""
    peft_before = "peft" in sys.modules
    start = torch.get_rng_state()
    model = _build_once(model_fn, dtype, rng_state)
    if not peft_before and "peft" in sys.modules and tuner_layers_without_values(model, set()):
        # model_fn imported peft itself: build again, peft now patched, from the same random state
        torch.set_rng_state(start)
        model = _build_once(model_fn, dtype, rng_state)
    return model, _take_built(model)


def _build_once(
    model_fn: Callable[[], nn.Module], dtype: torch.dtype | None, rng_state: torch.Tensor | None
) -> nn.Module:
    default = torch.get_default_dtype()
    own_state = torch.get_rng_state() if rng_state is not None else None
    with parameters_on_meta(building_adapters), adapters_built_real(default), _MetaValuesSkipped():
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        if dtype in _DEFAULTABLE:
            torch.set_default_dtype(dtype)
        try:
            model = user_code("model_fn", model_fn)
        finally:
            torch.set_default_dtype(default)
            if own_state is not None:
                torch.set_rng_state(own_state)
    if not isinstance(model, nn.Module):
        raise UserCodeFailure(f"model_fn must return an nn.Module, got {type(model).__name__}")
    return model


# In-place Tensor methods that only set a tensor's values: on meta (no values) they change nothing.
_VALUE_ONLY_METHODS = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "normal_", "uniform_", "exponential_", "log_normal_", "cauchy_", "geometric_", "random_",
        "bernoulli_", "erfinv_", "clamp_", "clamp_min_", "clamp_max_", "zero_", "fill_",
    )
)  # fmt: skip
# torch.nn.init's value-only functions, and transformers 5's guarded stand-ins for them
# (guard_torch_init_functions), by name -> the fewest dimensions they accept (fan-based ones: 2)
_VALUE_ONLY_INIT = {
    "uniform_": 0, "normal_": 0, "trunc_normal_": 0, "constant_": 0, "ones_": 0, "zeros_": 0,
    "kaiming_uniform_": 2, "kaiming_normal_": 2, "xavier_uniform_": 2, "xavier_normal_": 2,
}  # fmt: skip
_INIT_MODULES = ("torch.nn.init", "transformers.initialization")
_SET_DATA = torch.Tensor.data.__set__  # type: ignore[attr-defined]  # ``tensor.data = other`` (equal, not identical)


def _min_dims(func: object) -> int | None:
    """The fewest dimensions a value-only initialiser accepts; None for any other function."""
    if func in _VALUE_ONLY_METHODS:
        return 0
    if getattr(func, "__module__", None) in _INIT_MODULES:
        return _VALUE_ONLY_INIT.get(getattr(func, "__name__", ""))
    return None


class _MetaValuesSkipped(TorchFunctionMode):
    """Value-only initialisers (:func:`_min_dims`) return at once on a floating meta tensor with no
    other tensor argument (fan-based ones from 2 dimensions up, below which they raise): torch runs
    some on meta through slow Python references. The random stream is untouched. ``meta.data = real``
    assigns a meta copy (torch refuses to mix the two)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func == _SET_DATA and len(args) == 2 and isinstance(args[1], torch.Tensor):
            target, value = args
            if isinstance(target, torch.Tensor) and target.is_meta and not value.is_meta:
                # ``param.data = real`` in an initialiser (transformers 4.57's Mamba A_log): the shape and
                # dtype taken, on meta, as for any other parameter (the checkpoint brings the values)
                return func(target, value.to("meta"))
        dims = _min_dims(func)
        if dims is not None:
            target = args[0] if args else kwargs.get("tensor")
            others = [*args[1:], *(v for k, v in kwargs.items() if k != "tensor" or args)]
            if (
                isinstance(target, torch.Tensor)
                and target.is_meta
                and target.is_floating_point()
                and target.dim() >= dims
                and not any(isinstance(a, torch.Tensor) for a in others)
            ):
                return target
        return func(*args, **kwargs)


def _take_built(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters ``model_fn`` left real: their values (by first name), each replaced by a meta
    parameter of the same kind (one replacement for every module that holds it: ties survive)."""
    values: dict[str, torch.Tensor] = {}
    replaced: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for leaf, p in module._parameters.items():
            if p is None or p.is_meta:
                continue
            meta = replaced.get(id(p))
            if meta is None:
                values[f"{module_name}.{leaf}" if module_name else leaf] = p.detach().clone()
                meta = replaced[id(p)] = to_meta(p)
            module._parameters[leaf] = meta
    return values


@dataclass(frozen=True)
class TensorInfo:
    """One state-dict tensor of the model, as every rank sees it after sharding."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    is_param: bool
    is_dtensor: bool


@dataclass(frozen=True)
class ModelLayout:
    """What the manifest is validated against (derived identically on every rank)."""

    tensors: dict[str, TensorInfo]  # each canonical state-dict key -> its description
    aliases: dict[str, str]  # every further name (ties, shared buffers, wrapper-free) -> canonical key
    tie_groups: tuple[tuple[str, ...], ...]
    non_persistent: frozenset[str]  # buffers the model keeps out of its state dict
    initialisable: frozenset[str]  # canonical parameter keys the model can initialise itself
    # parameters model_fn built real (PEFT adapters): kept where the checkpoint lacks them, strict or not
    built: frozenset[str]

    def canonical(self, key: str) -> str | None:
        """The canonical model key for a checkpoint key (after ``key_map``), or None. Wrapper segments
        (``_orig_mod.``, ``_checkpoint_wrapped_module.``) are ignored on both sides."""
        return self._names.get(key) or self._names.get(strip_wrappers(key))

    def canonical_all(self, keys: Sequence[str]) -> list[str | None]:
        """``[self.canonical(k) for k in keys]``, in bulk."""
        found = list(map(self._names.get, keys))
        left = [i for i, hit in enumerate(found) if hit is None]
        if left and _WRAPPED.search("\n".join([keys[i] for i in left])) is not None:
            for i in left:
                found[i] = self.canonical(keys[i])
        return found

    @functools.cached_property
    def _names(self) -> dict[str, str]:
        """Every name the model answers to directly -> its canonical key (a key its own name)."""
        return {**self.aliases, **{k: k for k in self.tensors}}

    def fingerprint(self) -> tuple:
        """A picklable summary that differs whenever two ranks built different models."""
        return (
            tuple((k, t.shape, str(t.dtype), t.is_param, t.is_dtensor) for k, t in self.tensors.items()),
            tuple(sorted(self.aliases.items())),
            tuple(sorted(self.non_persistent)),
            tuple(sorted(self.built)),
        )


# Module-name segments that wrappers insert without changing the state a checkpoint holds.
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module")
_WRAPPED = re.compile("|".join(WRAPPER_SEGMENTS))


def strip_wrappers(key: str) -> str:
    """``"_orig_mod.layers.0._checkpoint_wrapped_module.fc.weight"`` -> ``"layers.0.fc.weight"``."""
    if _WRAPPED.search(key) is None:  # called for every checkpoint key: one C-level search
        return key
    return ".".join(part for part in key.split(".") if part not in WRAPPER_SEGMENTS)


def resolve_module(model: nn.Module, key: str) -> tuple[nn.Module, str]:
    """``"a.b.weight"`` -> (``model.a.b``, ``"weight"``)."""
    prefix, _, leaf = key.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), leaf


def describe(model: nn.Module, built: Collection[str] = ()) -> ModelLayout:
    """(all ranks) Describe the state-dict tensors of a (possibly sharded) meta model; ``built``: the
    names of the parameters model_fn built with real values (``build_on_meta``)."""
    tensors: dict[str, TensorInfo] = {}
    aliases: dict[str, str] = {}
    groups: dict[int, list[str]] = {}  # id(tensor) -> its names, the first one canonical
    initialisable: set[str] = set()
    non_persistent: set[str] = set()
    modules = dict(model.named_modules(remove_duplicate=False))  # one walk, not one lookup per parameter
    named: list[tuple[str, torch.Tensor, bool]] = [
        (name, param, True) for name, param in model.named_parameters(remove_duplicate=False)
    ]
    for name, buf in model.named_buffers(remove_duplicate=False):
        module_name, _, leaf = name.rpartition(".")
        if leaf in non_persistent_buffers(modules[module_name]):
            non_persistent.add(name)
        else:
            named.append((name, buf, False))

    for name, tensor, is_param in named:
        names = groups.setdefault(id(tensor), [])
        names.append(name)
        if len(names) > 1:
            aliases[name] = names[0]
            continue
        is_dtensor = is_param and isinstance(tensor, DTensor)
        tensors[name] = TensorInfo(tuple(tensor.shape), tensor.dtype, is_param, is_dtensor)
        owner = name.rpartition(".")[0]
        if is_param and (  # what _model.init_missing can re-initialise
            callable(getattr(modules[owner], "reset_parameters", None))
            or hf_init_weights(model, owner) is not None
        ):
            initialisable.add(name)

    for name in [*tensors, *aliases]:  # wrapper-free and PEFT base names, overriding no existing name
        for plain in (strip_wrappers(name), base_key(strip_wrappers(name))):
            if plain != name and plain not in tensors and plain not in aliases:
                aliases[plain] = aliases.get(name, name)
    non_persistent |= {strip_wrappers(name) for name in non_persistent}
    non_persistent |= {base_key(strip_wrappers(name)) for name in non_persistent}
    return ModelLayout(
        tensors=tensors,
        aliases=aliases,
        tie_groups=tuple(tuple(names) for names in groups.values() if len(names) > 1),
        non_persistent=frozenset(non_persistent),
        initialisable=frozenset(initialisable),
        built=frozenset(aliases.get(name, name) for name in built),
    )
