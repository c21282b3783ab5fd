"""Make a transformers model rotate its queries and keys with ropekit, and undo it.

How it works
------------
A transformers model computes ``(cos, sin) = model.rotary_emb(hidden_states, position_ids)`` once per forward
and every attention layer then calls its modeling module's ``apply_rotary_pos_emb(q, k, cos, sin)``.
:func:`patch` changes both ends, per model instance:

* the model's rotary-embedding module gets a ropekit :class:`~ropekit.RotaryEmbedding` (built from the model
  config by :func:`~ropekit.from_hf_config`, so dynamic NTK and LongRoPE switch exactly as in transformers). Its
  forward chooses the frequencies as transformers would and returns transformers-style ``(cos, sin)`` -- the shape,
  dtype (the hidden states'), device and strides of transformers' tables -- that are *lazy*: private tensor
  subclasses whose values are built (one build for the pair) only when some torch op reads either of them. Any
  code that reads the tables keeps working and sees plain tensors; a model whose rotations all go through ropekit
  builds no table at all. The cos tensor carries the positions, the float32 ``inv_freq`` and the attention scaling
  it came from. Position ids changed in place between the forward and the first read of its tables make that read
  raise ``RuntimeError`` (they are kept by reference, not copied). While compiled or traced (``torch.compile``,
  ``torch.export``, ``torch.jit.trace``, a dispatch mode such as fake tensors) the tables are plain tensors built
  at once, as a compiler drops the ones nobody reads;
* the family's ``apply_rotary_pos_emb`` (and DeepSeek-V3's ``apply_rotary_pos_emb_interleave``) is replaced by a
  dispatcher: given a cos tensor from a patched model it rotates with :func:`ropekit.apply_rope` using those
  positions and frequencies (angles formed exactly in the kernel, fp32 math, no bf16 table); given anything else
  (an unpatched model of the same family) it calls the original function unchanged.

Vision towers of the same form (Qwen2-VL's and Qwen3-VL's with transformers 5.x: a rotary module that turns the
patches' (h, w) ids [N, 2] into [N, D] tables) are patched the same way, except that their rotary module still
builds its tables (small: one row per patch) and tags cos with the ids; ``apply_rotary_pos_emb_vision``'s dispatcher
then rotates them as M-RoPE with two contiguous sections, one frequency set shared by both axes.

The module-level replacement is shared by all patched models of a family and reference-counted: the original
function comes back when the last such model is unpatched.

The attention modules whose code ropekit has checked (Llama's, Mistral's, Qwen2's, Qwen3's, Qwen3-Next's, Gemma 3's,
Apertus's and GLM-4.5 MoE's, and the families that share it) also get a forward of their own, per instance, that runs
the fused attention prologue (``qk_norm_rope``, ``rope_kv_write`` into a ``StaticCache``) and, with ``patch(model,
attention=True)``, ``rope_attention`` where they are exact: :mod:`ropekit.integrations.attention_forward`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect
import threading
import types
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils._pytree import tree_map_only

from ropekit._spec import pair_axis_tensor
from ropekit.api import apply_rope
from ropekit.frequencies.families import MODEL_FAMILIES
from ropekit.integrations import attention_forward
from ropekit.integrations.attention_forward import PLAN_ATTR as _PLAN_ATTR
from ropekit.modules import RotaryEmbedding, hf_tables

__all__ = ["SUPPORTED_MODEL_TYPES", "is_patched", "patch", "unpatch"]

# The families patch knows, and per family the functions of its modeling module it replaces with how each pairs
# columns ("neox", "interleaved", "interleaved_to_halves", "vision"): ModelFamily.patched_functions in the one table
# of model families (ropekit/frequencies/families.py), which from_hf_config reads too.
_FAMILIES: dict[str, dict[str, str]] = {
    model_type: dict(family.patched_functions) for model_type, family in MODEL_FAMILIES.items()
    if family.patched_functions}
#: ``config.model_type`` values :func:`patch` accepts.
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))

_STATE_ATTR = "_ropekit_patch"
_LOCK = threading.Lock()
_GLOBAL_REFS: dict[str, int] = {}  # modeling module name -> patched models using its dispatchers
_ORIGINALS: dict[tuple[str, str], Callable] = {}


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a patched rotary module knew when it built the tables: enough to rotate without them."""

    positions: Tensor  # int64 [B|1, S] on the tables' device; [A, B|1, S] for multi-axis (M-RoPE) models; [2, N]
    # (h, w) for a vision tower's patches
    inv_freq: Tensor  # float32 [R/2]
    scale: float  # attention_scaling
    width: int  # cos.shape[-1]
    sections: tuple[int, ...] | None = None  # M-RoPE pairs per axis
    section_layout: str = "contiguous"
    rotary_dim: int | None = None  # R, when the table is not R wide (one column per pair, complex): None = width


# --------------------------------------------------------------------------------------------------------------
# the patched rotary-embedding forward
# --------------------------------------------------------------------------------------------------------------


class _TableBuilder:
    """Builds one rotary forward's ``(cos, sin)`` the first time either is read, with the ``hf_tables`` call the
    eager forward would have made; later reads reuse the pair.

    The position ids are kept by reference, not copied (a copy would be work on every forward), with their version
    counter: if the caller changes them in place before the first read, the build raises ``RuntimeError`` instead
    of using the new values. Inference tensors have no version counter; those are copied (one small copy)."""

    __slots__ = ("_args", "_shape", "_tables", "_version")

    def __init__(self, position_ids: Tensor, inv: Tensor, scale: float, sections, section_layout: str,
                 dtype: torch.dtype, shape: tuple[int, ...], layout: str = "halves"):
        self._shape = shape
        if position_ids.is_inference():
            position_ids, self._version = position_ids.clone(), None
        else:
            self._version = position_ids._version
        self._args = (position_ids, inv, scale, sections, section_layout, dtype, layout)
        self._tables: tuple[Tensor, Tensor] | None = None

    def tables(self) -> tuple[Tensor, Tensor]:
        if self._tables is None:
            position_ids, *rest = self._args
            if self._version is not None and position_ids._version != self._version:
                raise RuntimeError("ropekit: the position ids given to the patched rotary embedding were changed in "
                                   "place after its forward, before its cos/sin tables were first read; the tables "
                                   "would no longer match that forward (pass a new tensor rather than changing it)")
            tables = _eager_tables(position_ids, *rest)
            if tables[0].shape != self._shape:  # the lazy tables promised this shape to everyone who looked
                raise RuntimeError(f"ropekit: internal error, lazy cos/sin tables of shape {self._shape} built as "
                                   f"{tuple(tables[0].shape)}")
            if self._tables is None:  # two threads may race to the first read: both build, one pair is kept
                self._tables = tables
        return self._tables


def _eager_tables(position_ids: Tensor, inv: Tensor, scale: float, sections, section_layout: str,
                  dtype: torch.dtype, layout: str = "halves") -> tuple[Tensor, ...]:
    """The ``(cos, sin)`` transformers returns, built by ropekit: float32 from exact angles, then ``dtype``.

    ``layout`` (the family's ``rotary_tables``): ``"halves"`` [..., R] ``cat(a, a)``, ``"pairs"`` [..., R]
    ``repeat_interleave(a, 2)``, ``"half"`` [..., R/2] one column per pair (``dtype`` for all three), or
    ``"complex"``: the one-tensor tuple ``(cos + i sin,)`` [..., R/2], complex64 whatever ``dtype`` says."""
    with torch.no_grad():
        pair_axis = None
        if sections is not None:  # vision-language models: position_ids [3, B, S]
            pair_axis = pair_axis_tensor(sections, section_layout, position_ids.device)
        cos, sin = hf_tables(position_ids, inv, scale, full=layout == "halves", pair_axis=pair_axis)
        if layout == "complex":
            return (torch.complex(cos, sin),)
        if layout == "pairs":
            cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        return cos.to(dtype), sin.to(dtype)


class _LazyTable(Tensor):
    """A cos or sin table that is built on first use: shape, dtype, device and strides are those of the table
    transformers returns, the values come from a :class:`_TableBuilder` shared with the other table of the pair.

    Every torch op on it runs on the built (plain) tensor and returns plain tensors, so code that reads the tables
    (an unpatched ``apply_rotary_pos_emb``, user code) sees ordinary tensors, autograd included; the dispatcher
    reads only ``shape``/``dtype``, which need no build. A conversion with nothing to do (``.to`` its own device or
    dtype, ``.float()`` of a float32 table) returns the table itself, as torch does for any tensor."""

    _builder: _TableBuilder
    _index: int

    # not subclass-preserving: results of ops are plain tensors
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, builder: _TableBuilder, index: int, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device):
        # no strides given: contiguous, as the torch.cat that ends transformers' table build
        self = Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        self._builder, self._index = builder, index
        return self

    def _value(self) -> Tensor:
        return self._builder.tables()[self._index]

    def _plain(self) -> Tensor:
        """The built table as a plain tensor standing for this one: a leaf with this table's ``requires_grad``."""
        value = self._builder.tables()[self._index]
        return value.detach().requires_grad_() if self.requires_grad else value

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map_only(_LazyTable, _LazyTable._value, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self, *, tensor_contents=None) -> str:
        return repr(self._plain())

    def __deepcopy__(self, memo):
        return copy.deepcopy(self._plain(), memo)

    def __reduce_ex__(self, protocol):  # pickles (torch.save) as the plain tensor
        return self._plain().__reduce_ex__(protocol)


# Conversions (``to``, ``cpu``, ``float``, ``type``, ...) are torch's own: with nothing to do they return the table
# itself, as for a plain tensor -- still lazy and still carrying its plan, which device-map hooks that send every
# input ``.to(device)`` (accelerate) rely on -- and otherwise a plain converted copy (the op reads the table).


def _plain_method(name: str, returns_self: bool):
    """A method that reads the table's memory (``data_ptr``, ``numpy``, ...), which a wrapper subclass has none of,
    or ``contiguous`` (the usual step before handing memory to a kernel): run it on the built tensor, so that the
    result is that of a plain tensor."""
    method = getattr(Tensor, name)

    @functools.wraps(method)
    def plain(self, *args, **kwargs):
        if returns_self and self.requires_grad:  # the table is a leaf of the caller's graph: torch returns it
            return method(self, *args, **kwargs)
        return method(self._plain(), *args, **kwargs)

    return plain


_LazyTable.contiguous = _plain_method("contiguous", returns_self=True)
for _name in ("numpy", "tolist", "__array__", "data_ptr", "untyped_storage"):
    setattr(_LazyTable, _name, _plain_method(_name, returns_self=False))
del _name


def _tracing() -> bool:
    """Whether this call is being compiled or traced: tables are then plain (a compiler drops the unread ones, and
    a tracer would have to see through the subclass)."""
    # (FX symbolic tracing passes proxies, not tensors: the caller checks the types)
    return (torch.compiler.is_compiling() or torch.jit.is_tracing()
            or _get_current_dispatch_mode() is not None  # fake tensors, make_fx, ...
            or torch._C._functorch.maybe_current_level() is not None)  # vmap / grad transforms


def _rotary_forward(self: nn.Module, x: Tensor, position_ids: Tensor, layer_type: str | None = None
                    ) -> tuple[Tensor, Tensor] | Tensor:
    """Replacement of a transformers ``*RotaryEmbedding.forward``: HF-style tables, built lazily (on first read),
    with cos tagged with a plan, from which the dispatcher rotates without reading the tables. A module with one
    frequency set per layer type (Gemma 3) takes ``layer_type`` as the original does; Llama 4's returns one complex
    ``freqs_cis`` tensor (tagged the same way) instead of a pair."""
    state: _ModuleState = getattr(self, _STATE_ATTR)
    if state.per_layer is not None:
        rope = state.per_layer.get(layer_type)
        if rope is None:
            raise ValueError(f"layer_type {layer_type!r} has no rope parameters in this model's config; it has "
                             f"{sorted(state.per_layer)}")
    elif layer_type is not None and state.takes_layer_type is False:
        raise TypeError(f"this rotary embedding takes no layer_type, got layer_type={layer_type!r}")
    else:
        rope = state.rope
    layout = state.tables
    if rope.frequencies.sections is not None:
        # as the original M-RoPE module: ids [B, S], [1, B, S] or [A, B|1, S] broadcast to the A axes (a view);
        # other shapes raise here, as there
        position_ids = position_ids.expand(len(rope.frequencies.sections), -1, -1)
    # (no grad mode to set: nothing here records autograd history, and _eager_tables builds under no_grad)
    # transformers reads max(position_ids) here too; the choice is committed at once (the tables, if ever built,
    # use these frequencies), so threads sharing the model each get the frequencies their call selected
    seq_len = int(position_ids.max()) + 1 if rope.frequencies.is_dynamic else None
    f, cached, inv = rope._choose(seq_len, x.device)
    dtype = {"halves_float32": torch.float32, "complex": torch.complex64}.get(layout, x.dtype)
    layout = "halves" if layout == "halves_float32" else layout
    if _tracing() or type(x) is not Tensor or type(position_ids) is not Tensor:
        tables = _eager_tables(position_ids, inv, f.attention_scaling, f.sections, f.section_layout, dtype, layout)
    else:
        # hf_tables' shape: the positions' ([B, S]; M-RoPE's [A, B, S] less the axis dim), then W
        width = inv.shape[-1] * (1 if layout in ("half", "complex") else 2)
        shape = (*position_ids.shape[f.sections is not None:], width)
        builder = _TableBuilder(position_ids, inv, f.attention_scaling, f.sections, f.section_layout, dtype,
                                shape, layout)
        tables = tuple(_LazyTable(builder, i, shape, dtype, position_ids.device)
                       for i in range(1 if layout == "complex" else 2))
    rope._commit(f, cached, inv)
    setattr(tables[0], _PLAN_ATTR, _Plan(positions=position_ids, inv_freq=inv, scale=float(f.attention_scaling),
                                         width=tables[0].shape[-1], sections=f.sections,
                                         section_layout=f.section_layout, rotary_dim=2 * inv.shape[-1]))
    return tables[0] if layout == "complex" else tables


def _is_vision_rotary(module: nn.Module, modeling: str) -> bool:
    """A vision tower's rotary module of the form transformers 5.x gives Qwen2-VL and Qwen3-VL: ``forward(x,
    position_ids)`` with (h, w) ids [N, 2], one float32 ``inv_freq`` [D/4] for both axes, and tables [N, D] laid out
    ``[h angles, w angles]`` twice (``recomposition_frequencies``). Older towers return raw frequencies instead."""
    cls = type(module)
    if not (cls.__name__.endswith("VisionRotaryEmbedding") and cls.__module__ == modeling
            and hasattr(cls, "recomposition_frequencies") and isinstance(getattr(module, "inv_freq", None), Tensor)):
        return False
    return list(inspect.signature(cls.forward).parameters) == ["self", "x", "position_ids"]


def _vision_rotary_forward(self: nn.Module, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Replacement of a vision tower's ``*VisionRotaryEmbedding.forward``: the tables of the class's own forward
    (built as before: they are [N, D], built once per forward), with cos tagged with a plan: pair i < D/4 turns by
    the patch's row h and pair D/4 + i by its column w, both with ``inv_freq[i]`` -- M-RoPE with two contiguous
    sections over the (h, w) ids."""
    cos, sin = type(self).forward(self, x, position_ids)
    inv = self.inv_freq.float()
    n = inv.shape[-1]
    if (isinstance(position_ids, Tensor) and position_ids.dim() == 2 and position_ids.shape[-1] == 2
            and cos.shape == (position_ids.shape[0], 4 * n)):
        setattr(cos, _PLAN_ATTR, _Plan(positions=position_ids.t(), inv_freq=torch.cat([inv, inv]),
                                       scale=float(self.attention_scaling), width=4 * n, sections=(n, n)))
    return cos, sin


# --------------------------------------------------------------------------------------------------------------
# the module-level dispatchers
# --------------------------------------------------------------------------------------------------------------


def _unsqueeze_dim(signature: inspect.Signature, args: tuple, kwargs: dict) -> int | None:
    if not args and not kwargs:
        return 1
    try:
        bound = signature.bind(None, None, None, None, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound.arguments.get("unsqueeze_dim", 1)


def _make_dispatcher(original: Callable, kind: str) -> Callable:
    if kind == "complex":
        return _make_complex_dispatcher(original)
    signature = inspect.signature(original)

    @functools.wraps(original)
    def dispatcher(q, k, cos, sin, *args, **kwargs):
        plan = getattr(cos, _PLAN_ATTR, None)
        if plan is not None:
            out = _rotate(plan, kind, q, k, cos, _unsqueeze_dim(signature, args, kwargs))
            if out is not None:
                return out
        return original(q, k, cos, sin, *args, **kwargs)

    dispatcher._ropekit_original = original  # type: ignore[attr-defined]
    return dispatcher


def _make_complex_dispatcher(original: Callable) -> Callable:
    """Llama 4's ``apply_rotary_emb(xq, xk, freqs_cis)``: the table is the third argument and there is no sin."""

    @functools.wraps(original)
    def dispatcher(xq, xk, freqs_cis, *args, **kwargs):
        plan = getattr(freqs_cis, _PLAN_ATTR, None)
        if plan is not None and not args and not kwargs:
            out = _rotate(plan, "complex", xq, xk, freqs_cis, None)
            if out is not None:
                return out
        return original(xq, xk, freqs_cis, *args, **kwargs)

    dispatcher._ropekit_original = original  # type: ignore[attr-defined]
    return dispatcher


def _dispatch_kind(kind: str, family) -> str:
    """The dispatcher's kind for a family's function of ``kind`` (its pairing, "vision" or
    "interleaved_to_halves"), given the tables its rotary module returns and the dtype its function returns."""
    if family.rotary_tables == "complex":
        return "complex"
    if family.rotary_tables == "half":
        return "half_tables"
    if family.rotary_tables == "pairs":
        return "pairs_cast" if family.rotation_dtype == "q" else "pairs"
    if family.rotation_dtype == "q" and kind in ("neox", "interleaved"):
        return f"{kind}_cast"
    return kind


# How each kind pairs columns, and whether its outputs keep q's dtype (the function casts back, or does its math in
# float32 and casts) rather than promoting q's dtype with the table's.
_STYLE = {"neox": "neox", "neox_cast": "neox", "half_tables": "neox", "interleaved": "interleaved",
          "interleaved_cast": "interleaved", "interleaved_to_halves": "interleaved", "pairs": "interleaved",
          "pairs_cast": "interleaved", "complex": "interleaved"}
_KEEPS_DTYPE = {"neox_cast", "interleaved_cast", "pairs_cast", "complex"}
# kinds whose function rotates the whole head (no pass-through tail): other widths go to the original
_WHOLE_HEAD = {"pairs", "pairs_cast", "half_tables", "complex"}


def _rotate(plan: _Plan, kind: str, q: Tensor, k: Tensor, cos: Tensor, unsqueeze_dim: int | None):
    """The ropekit rotation for one dispatcher call, or None when the call falls outside what the plan covers
    (then the original function runs). Reads only cos's metadata (shape, dtype): reading its values would build the
    lazy tables."""
    if kind == "vision":
        return _rotate_patches(plan, q, k, cos)
    layout = "bshd" if kind == "complex" else {1: "bhsd", 2: "bshd"}.get(unsqueeze_dim)
    if layout is None or not isinstance(q, Tensor) or not isinstance(k, Tensor) or q.dim() != 4 or k.dim() != 4:
        return None
    if k.dtype != q.dtype or cos.shape[-1] != plan.width:
        return None
    if plan.positions.dim() != (2 if plan.sections is None else 3):
        return None
    seq_axis = 2 if layout == "bhsd" else 1
    B, S = q.shape[0], q.shape[seq_axis]
    if plan.positions.shape[-1] != S or plan.positions.shape[-2] not in (1, B) or k.shape[seq_axis] != S:
        return None
    rotary_dim = plan.rotary_dim or plan.width
    if kind in ("interleaved_to_halves", *_WHOLE_HEAD) and q.shape[-1] != rotary_dim:
        return None
    if q.shape[-1] < rotary_dim or k.shape[-1] != q.shape[-1] or q.stride(-1) != 1 or k.stride(-1) != 1:
        return None
    style = _STYLE[kind]
    # transformers' output dtype: q's where the function casts back, else q's promoted with the table's
    out_dtype = q.dtype if kind in _KEEPS_DTYPE else torch.promote_types(q.dtype, cos.dtype)
    multi_axis = {} if plan.sections is None else dict(sections=plan.sections, section_layout=plan.section_layout)
    q_out, k_out = apply_rope(q, k, positions=plan.positions, inv_freq=plan.inv_freq, style=style, layout=layout,
                              rotary_dim=rotary_dim, rotary_scale=plan.scale, out_dtype=out_dtype, **multi_axis)
    if kind == "interleaved_to_halves":
        q_out = torch.cat((q_out[..., 0::2], q_out[..., 1::2]), dim=-1)
        k_out = torch.cat((k_out[..., 0::2], k_out[..., 1::2]), dim=-1)
    return q_out, k_out


def _rotate_patches(plan: _Plan, q: Tensor, k: Tensor, cos: Tensor):
    """A vision tower's rotation (``apply_rotary_pos_emb_vision``: q, k [N, H, D] patches, cos [N, D], outputs in
    q's and k's dtypes) from its plan, or None when the call is not of that form."""
    if not isinstance(q, Tensor) or not isinstance(k, Tensor) or q.dim() != 3 or k.dim() != 3:
        return None
    if plan.sections is None or plan.positions.dim() != 2 or cos.shape[-1] != plan.width:
        return None
    n = plan.positions.shape[-1]
    if q.shape[0] != n or k.shape[0] != n or q.shape[-1] != plan.width or k.shape[-1] != plan.width:
        return None
    if k.dtype != q.dtype or q.stride(-1) != 1 or k.stride(-1) != 1:
        return None
    return apply_rope(q, k, positions=plan.positions, inv_freq=plan.inv_freq, style="neox", layout="thd",
                      rotary_dim=plan.width, rotary_scale=plan.scale, sections=plan.sections)


# --------------------------------------------------------------------------------------------------------------
# patch / unpatch
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _ModuleState:
    rope: RotaryEmbedding | None  # None for a vision tower's rotary (its own forward builds the tables)
    modeling: str
    tables: str = "halves"  # the family's rotary_tables
    per_layer: dict[str, RotaryEmbedding] | None = None  # forward(x, position_ids, layer_type): a set per type
    takes_layer_type: bool = False  # the original forward has a layer_type parameter


def _per_layer_ropes(rotary: nn.Module) -> dict[str, RotaryEmbedding] | None:
    """One ropekit module per layer type for a rotary module whose ``forward`` chooses its frequencies by
    ``layer_type`` (Gemma 3's ``{layer_type}_inv_freq`` buffers), else None."""
    layer_types = getattr(rotary, "layer_types", None)
    if "layer_type" not in inspect.signature(type(rotary).forward).parameters or not layer_types:
        return None
    ropes = {}
    parameters = getattr(rotary.config, "rope_parameters", None) or {}
    for layer_type in layer_types:
        if isinstance(parameters, dict) and layer_type in parameters and parameters[layer_type] is None:
            continue  # the original module builds nothing for it either
        ropes[layer_type] = RotaryEmbedding(rotary.config, layer_type=layer_type)
    return ropes


def _rotary_modules(model: nn.Module, modeling: str) -> list[nn.Module]:
    found = []
    for module in model.modules():
        cls = type(module)
        if (cls.__name__.endswith("RotaryEmbedding") and cls.__module__ == modeling and hasattr(module, "config")
                and "Vision" not in cls.__name__):  # a vision tower's rotary has a rotation of its own
            found.append(module)
    return found


def _check_model(model: object, caller: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}: model must be a torch.nn.Module (a transformers model), got "
                        f"{type(model).__name__}")


def _model_type(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise TypeError(f"patch expects a transformers PreTrainedModel (with .config.model_type), got "
                        f"{type(model).__name__}")
    return model_type


def patch(model: nn.Module, *, prologue: bool = True, attention: bool = False) -> nn.Module:
    """Make ``model`` (a transformers model) apply its rotary embedding with ropekit; returns ``model``.

    ``prologue`` (default on): where the family normalises each head of q and k before the rotation (Qwen3,
    Qwen3-MoE, Qwen3-Next, Gemma 3, Apertus, GLM-4.5 MoE), the attention runs both norms and the rotation as one
    :func:`ropekit.qk_norm_rope`, and with transformers' ``StaticCache`` (``cache_implementation="static"``) as one
    :func:`ropekit.rope_kv_write` that also writes the layer's keys and values (inference). ``attention``: Llama's,
    Mistral's, Qwen2's and Qwen3's attention (and the families that share their attention code) run rotation and
    attention as one :func:`ropekit.rope_attention` where that is the same attention (sdpa without a mask, i.e. causal
    with no padding; no sliding window or dropout; no cache or an empty ``DynamicCache``: training and prefill); other
    calls take the usual path. See :mod:`ropekit.integrations.attention_forward`. Calling ``patch`` again on a patched
    model applies the new switches.

    Supported ``config.model_type``: see :data:`SUPPORTED_MODEL_TYPES` (Llama, Mistral, Mixtral, Qwen2/3 and their
    MoE, Qwen3-Next, Gemma 1/2/3 (one frequency set per layer type), Llama 4 (complex ``freqs_cis``), OLMo 1/2/3,
    GPT-OSS, Cohere 1/2 (interleaved pairs), Falcon, StableLM, Phi, Phi-3, SmolLM3, GPT-NeoX, GLM, GLM-4, GLM-4.5
    MoE, DeepSeek-V3, ERNIE 4.5, and more; a multimodal family's ``<type>_text`` model too), and the language model
    of Qwen2-VL, Qwen2.5-VL and Qwen3-VL, whose multi-axis
    M-RoPE positions ropekit rotates by exactly; the vision towers of Qwen2-VL and Qwen3-VL too, by their patches'
    (h, w) ids, while Qwen2.5-VL's, which reorders its tables for window attention, keeps its own). Every rope type
    works (default, linear, dynamic, yarn, longrope, llama3, ...); partial rotary and attention scaling follow the
    model. Logits and gradients match the unpatched model (to float32 rounding in fp32; in bf16 ropekit is the more
    accurate of the two, since transformers rounds its cos/sin tables to bf16). The language model's rotary
    ``(cos, sin)`` are built only if something reads them (see the module docstring); its position ids must not be
    changed in place before then. A vision tower's tables ([patches, head_dim]) are built as before. Patching twice
    is a no-op. Undo with :func:`unpatch`.

    Raises
    ------
    TypeError
        ``model`` is not a transformers model (an ``nn.Module`` with ``config.model_type``).
    ValueError
        For an unsupported model type, or a model without a rotary-embedding module of its family.
    """
    _check_model(model, "patch")
    for name, value in (("prologue", prologue), ("attention", attention)):
        if not isinstance(value, bool):
            raise TypeError(f"patch: {name} must be a bool, got {type(value).__name__}")
    model_type = _model_type(model)
    if model_type not in _FAMILIES and model_type.removesuffix("_text") in _FAMILIES:
        model_type = model_type.removesuffix("_text")  # a multimodal family's text-only model (gemma3_text)
    if model_type not in _FAMILIES:
        raise ValueError(f"ropekit cannot patch model_type {model_type!r}: patch(model) supports the model types "
                         f"{list(SUPPORTED_MODEL_TYPES)} (a multimodal family's '<type>_text' models too)")
    modeling = f"transformers.models.{model_type}.modeling_{model_type}"
    tables = MODEL_FAMILIES[model_type].rotary_tables
    module = importlib.import_module(modeling)
    rotaries = _rotary_modules(model, modeling)
    if not rotaries:
        raise ValueError(f"found no rotary-embedding module of {modeling} in {type(model).__name__}")
    towers = [] if "vision" not in _FAMILIES[model_type].values() else [
        m for m in model.modules() if _is_vision_rotary(m, modeling)]
    todo = [(m, is_tower) for ms, is_tower in ((rotaries, False), (towers, True)) for m in ms
            if not hasattr(m, _STATE_ATTR)]
    with _LOCK:
        family = MODEL_FAMILIES[model_type]
        kind = family.patched_functions.get("apply_rotary_pos_emb")
        style = kind if family.rotary_tables in ("halves", "halves_float32") else None
        attention_forward.install(model, modeling, style, prologue=prologue, attention=attention)
        for rotary, is_tower in todo:
            if is_tower:
                state, forward = _ModuleState(rope=None, modeling=modeling), _vision_rotary_forward
            else:
                per_layer = _per_layer_ropes(rotary)
                rope = RotaryEmbedding(rotary.config) if per_layer is None else None
                buffer = next((b for b in rotary.buffers(recurse=False) if b.is_floating_point()), None)
                for own in [rope] if per_layer is None else per_layer.values():
                    if isinstance(buffer, Tensor):
                        own.to(buffer.device)
                takes = "layer_type" in inspect.signature(type(rotary).forward).parameters
                state = _ModuleState(rope=rope, modeling=modeling, tables=tables, per_layer=per_layer,
                                     takes_layer_type=takes)
                forward = _rotary_forward
            # not registered as a submodule: the model's module tree and state dict stay as they were
            object.__setattr__(rotary, _STATE_ATTR, state)
            rotary.forward = types.MethodType(forward, rotary)
            _GLOBAL_REFS[modeling] = _GLOBAL_REFS.get(modeling, 0) + 1
        for name, kind in _FAMILIES[model_type].items():
            current = getattr(module, name, None)
            if current is None:
                continue
            if not hasattr(current, "_ropekit_original"):
                _ORIGINALS[(modeling, name)] = current
                setattr(module, name, _make_dispatcher(current, _dispatch_kind(kind, MODEL_FAMILIES[model_type])))
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch` on ``model``; returns ``model``. A model that is not patched is returned unchanged.
    ``TypeError`` if ``model`` is not an ``nn.Module``."""
    _check_model(model, "unpatch")
    with _LOCK:
        for attn in model.modules():
            attention_forward.uninstall(attn)
        for rotary in list(model.modules()):
            state = rotary.__dict__.get(_STATE_ATTR)
            if state is None:
                continue
            del rotary.__dict__[_STATE_ATTR]
            rotary.__dict__.pop("forward", None)
            refs = _GLOBAL_REFS.get(state.modeling, 0) - 1
            _GLOBAL_REFS[state.modeling] = max(refs, 0)
            if refs <= 0:
                _restore_globals(state.modeling)
    return model


def _restore_globals(modeling: str) -> None:
    module = importlib.import_module(modeling)
    for (mod_name, name), original in list(_ORIGINALS.items()):
        if mod_name == modeling:
            setattr(module, name, original)
            del _ORIGINALS[(mod_name, name)]


def is_patched(model: nn.Module) -> bool:
    """Whether any rotary-embedding module of ``model`` is patched (``TypeError`` if it is not an ``nn.Module``)."""
    _check_model(model, "is_patched")
    return any(_STATE_ATTR in m.__dict__ for m in model.modules())


def _ropekit_module(model: nn.Module) -> RotaryEmbedding | None:
    """The ropekit module behind a patched model's (first) rotary embedding, for inspection."""
    _check_model(model, "_ropekit_module")
    for m in model.modules():
        state = m.__dict__.get(_STATE_ATTR)
        if state is not None and state.rope is not None:
            return state.rope
        if state is not None and state.per_layer:
            return next(iter(state.per_layer.values()))
    return None
