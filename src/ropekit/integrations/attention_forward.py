"""Patched attention forwards: the attention prologue of a patched transformers model in ropekit's fused ops.

:func:`ropekit.integrations.patching.patch` swaps the rotation; for the attention modules listed here it also replaces
the module's ``forward`` (per instance) with one that keeps the family's math and runs

* per-head QK-norm and the rotation as one :func:`ropekit.qk_norm_rope` (forward and backward), where the family
  normalises each head of q and k with an RMSNorm before the rotation (Qwen3, Qwen3-MoE, Qwen3-Next, Gemma 3, Apertus,
  GLM-4.5 MoE with ``use_qk_norm``);
* with transformers' ``StaticCache``, norm, rotation and the K/V write as one :func:`ropekit.rope_kv_write` into the
  cache layer's own tensors (inference only; other cache classes keep ``cache.update``);
* with ``attention=True``, the rotation and the attention as one :func:`ropekit.rope_attention` (Llama's, Mistral's,
  Qwen2's and Qwen3's forwards), where that is the same attention: sdpa with no mask (causal, no padding, no packed
  sequences, no sliding window), no dropout, and no cache or an empty ``DynamicCache`` layer (which then receives the
  rotated k from :func:`ropekit.apply_rope`, as it would have). While compiled, transformers 5.17 (and 5.24 before
  torch 2.14) hands sdpa the causal mask as a tensor, whose values a traced graph cannot inspect: those calls take
  the usual path.

Anything else takes the family's own math (modules and the patched rotation) inside the same forward.

Which forward a class has is recognised by its code, not its name: the ``forward`` of the attention class is parsed
and its syntax tree (less docstring, annotations and decorators) fingerprinted; only fingerprints whose code was read
and checked against this module's forward are patched (:data:`_SHAPES`), so a family whose attention changes in a new
transformers release keeps the rotation-only patch rather than running stale math. Families that copy one of these
forwards verbatim (Qwen3-MoE's is Qwen3's; Granite's, Arcee's and Qwen2-MoE's are Llama's; Mixtral's is Mistral's,
CWM's Qwen2's) are covered by the same fingerprint. The QK-norm modules are checked by behaviour: a probe through the
module must equal ``x / sqrt(mean(x**2) + eps) * (w + offset)`` with offset 0 (Qwen3) or 1 (Gemma 3, Qwen3-Next), and
the two norms must agree in offset and eps.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import inspect
import textwrap
import types

import torch
from torch import Tensor, nn

from ropekit._device_cache import device_cache
from ropekit.api import apply_rope, qk_norm_rope, rope_kv_write
from ropekit.attention import rope_attention

__all__ = ["install", "uninstall", "fused_modules"]

_STATE_ATTR = "_ropekit_attention"
#: the attribute a patched rotary module tags its cos table with (the patch's plan: positions and frequencies)
PLAN_ATTR = "_ropekit_plan"


@dataclasses.dataclass(frozen=True)
class _Code:
    """What one checked attention forward does around the rotation (each checked line by line against the
    forward below; the rest of the forward is the same in all of them)."""

    norms: str | None  # QK-norm "before" or "after" the transpose to [B, H, S, D], or None: no QK-norm
    sliding: str | None  # sliding_window= given to the attention function: "module" (self.sliding_window),
    # "config" (getattr(self.config, "sliding_window", None)), None: not given
    gated: bool = False  # q_proj gives [q | gate] per head, the output is multiplied by sigmoid(gate) (Qwen3-Next)
    norm_switch: str | None = None  # an attribute that turns the norms on (GLM-4.5 MoE's use_qk_norm)
    attention: bool = False  # patch(model, attention=True) may route it through rope_attention (tested)


@dataclasses.dataclass(frozen=True)
class _Shape:
    """One checked attention forward: its code, and how its transformers version passes the cache."""

    code: _Code
    cache_arg: str  # "cache" (transformers 5.24) or "past_key_values" (5.17)
    update_kwargs: bool  # cache.update(..., kwargs=kwargs)


_LLAMA = _Code(norms=None, sliding=None, attention=True)  # Llama, Arcee, Granite, Qwen2-MoE
_MISTRAL = _Code(norms=None, sliding="config", attention=True)  # Mistral, Mixtral
_QWEN2 = _Code(norms=None, sliding="module", attention=True)  # Qwen2, CWM
_QWEN3 = _Code(norms="before", sliding="module", attention=True)  # Qwen3, Qwen3-MoE
_QWEN3_NEXT = _Code(norms="before", sliding=None, gated=True)
_GEMMA3 = _Code(norms="after", sliding="module")
_APERTUS = _Code(norms="after", sliding=None)
_GLM4_MOE = _Code(norms="before", sliding=None, norm_switch="use_qk_norm")

# fingerprint of an attention class's forward (see _fingerprint) -> its shape. Read and checked: transformers 5.17
# (past_key_values, update without kwargs) and 5.24 (cache, update with kwargs=kwargs).
_SHAPES: dict[str, _Shape] = {
    **{fingerprint: _Shape(code, "cache", True) for fingerprint, code in (
        ("daf1ef2bf100ce9b", _LLAMA), ("f146b586c6ae9e09", _MISTRAL), ("037c37244b113100", _QWEN2),
        ("1dcf44bd1ea05d8e", _QWEN3), ("3f9ea87c15756fbb", _QWEN3_NEXT), ("60c3e01f01227383", _GEMMA3),
        ("f8cb3636524abc21", _APERTUS), ("2e5e41d7f5ce8270", _GLM4_MOE))},
    **{fingerprint: _Shape(code, "past_key_values", False) for fingerprint, code in (
        ("278ad3fc6ab29dd0", _LLAMA), ("a6e939190a0b7dcc", _MISTRAL), ("3fd64a29d3536685", _QWEN2),
        ("f7f295877b0808ca", _QWEN3), ("d24ce3b033ec9d7c", _QWEN3_NEXT), ("e82526f005aaec94", _GEMMA3),
        ("3d43d6eaad5a4b85", _APERTUS), ("f124ead91d722355", _GLM4_MOE))},
}
# what the decoder layers pass on to the attention function that sdpa's ignores (output_attentions when false), so
# rope_attention's route may too; any other keyword takes the usual path
_IGNORABLE_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions",
                               "output_hidden_states", "output_router_logits", "return_dict"})


def _serialise(node) -> str:
    """A syntax tree as text, every field written (ast.dump leaves empty ones out in newer Pythons)."""
    if isinstance(node, ast.AST):
        fields = ",".join(f"{name}={_serialise(value)}" for name, value in ast.iter_fields(node)
                          if name not in ("type_comment", "type_params", "ctx"))
        return f"{type(node).__name__}({fields})"
    if isinstance(node, list):
        return "[" + ",".join(_serialise(n) for n in node) + "]"
    return repr(node)


def _fingerprint(function) -> str | None:
    """16 hex digits identifying a function's code (docstring, annotations and decorators left out), or None
    when its source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
        tree = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if not isinstance(tree, ast.FunctionDef):
        return None
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    args = tree.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    text = f"{names}|{args.vararg and args.vararg.arg}|{args.kwarg and args.kwarg.arg}|{_serialise(body)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_SHAPE_OF_CLASS: dict[type, _Shape | None] = {}


def _shape_of(cls: type) -> _Shape | None:
    if cls not in _SHAPE_OF_CLASS:
        _SHAPE_OF_CLASS[cls] = _SHAPES.get(_fingerprint(cls.forward) or "")
    return _SHAPE_OF_CLASS[cls]


def _norm_form(norm: object, head_dim: int) -> tuple[float, float] | None:
    """``(weight_offset, eps)`` of a per-head RMSNorm module, or None when it is not one: a probe through the module
    must give ``x / sqrt(mean(x**2) + eps) * (weight + offset)`` over the head_dim columns (offset 0 or 1)."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(norm, nn.Module) or not isinstance(weight, Tensor) or tuple(weight.shape) != (head_dim,) \
            or weight.is_meta or not weight.is_floating_point() or isinstance(eps, bool) \
            or not isinstance(eps, (int, float)) or not eps > 0:
        return None
    generator = torch.Generator().manual_seed(0)  # the global RNG stays untouched
    x = torch.randn(4, head_dim, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        try:
            got = norm.forward(x.to(weight.device, torch.float32)).double().cpu()  # (hooks not run)
        except Exception:  # noqa: BLE001 -- a module that cannot take the probe is not fused
            return None
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + float(eps))
    for offset in (0.0, 1.0):
        want = normed * (weight.detach().double().cpu() + offset)
        if got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            return offset, float(eps)
    return None


@dataclasses.dataclass(frozen=True)
class _CacheClasses:
    """transformers' cache classes the forward recognises, resolved when the model is patched: an import inside the
    forward would be traced by torch.compile, whose older releases (2.11) cannot import from transformers' lazy
    top-level module with fullgraph=True."""

    cache: type | None  # Cache
    static_layer: type | None  # StaticLayer
    hybrid_layer: type | None  # LinearAttentionAndStaticFullAttentionLayer (Qwen3-Next's static layers)
    dynamic_cache: type | None  # DynamicCache
    dynamic_layer: type | None  # DynamicLayer


def _cache_classes() -> _CacheClasses:
    cache_utils = importlib.import_module("transformers.cache_utils")
    return _CacheClasses(*(getattr(cache_utils, name, None) for name in (
        "Cache", "StaticLayer", "LinearAttentionAndStaticFullAttentionLayer", "DynamicCache", "DynamicLayer")))


@dataclasses.dataclass
class _State:
    shape: _Shape
    modeling: types.ModuleType
    caches: _CacheClasses
    style: str  # the family's pairing: "neox" or "interleaved"
    prologue: bool  # QK-norm + rotation (+ the static-cache write) fused
    attention: bool  # rope_attention where exact
    q_norm: tuple[float, float] | None = None  # (weight_offset, eps)
    k_norm: tuple[float, float] | None = None


def install(model: nn.Module, modeling: str, style: str | None, *, prologue: bool, attention: bool) -> int:
    """Give the attention modules of ``model`` from the modeling module ``modeling`` whose forward is a checked
    shape the fused forward (or update the switches of those that have it); returns how many modules have it.

    ``style``: how the family's ``apply_rotary_pos_emb`` pairs the columns of the first ``cos.shape[-1]`` of each
    head (its tables' duplicated-halves layout), "neox" or "interleaved"; None for a family whose rotation is
    neither (its attention keeps the rotation-only patch, whatever its code: GLM's shares Llama's code but pairs
    columns (2i, 2i+1))."""
    if style not in ("neox", "interleaved"):
        for attn in model.modules():
            uninstall(attn)
        return 0
    module = importlib.import_module(modeling)
    caches = _cache_classes()
    count = 0
    for attn in model.modules():
        cls = type(attn)
        if cls.__module__ != modeling or not cls.__name__.endswith("Attention"):
            continue
        shape = _shape_of(cls)
        if shape is None or ("forward" in attn.__dict__ and _STATE_ATTR not in attn.__dict__):
            continue  # unchecked code, or a forward someone else set on the instance (accelerate's hooks): kept
        code = shape.code
        head_dim = getattr(attn, "head_dim", None)
        norms = (None, None)
        if code.norms is not None and isinstance(head_dim, int) and _norms_on(attn, code):
            norms = (_norm_form(getattr(attn, "q_norm", None), head_dim),
                     _norm_form(getattr(attn, "k_norm", None), head_dim))
            if None in norms or norms[0][0] != norms[1][0]:
                norms = (None, None)  # the two norms must be one kind for one launch
        fused_norm = norms[0] is not None and prologue
        fused_attention = attention and code.attention
        if not (fused_norm or fused_attention):
            uninstall(attn)
            continue
        state = _State(shape, module, caches, style, prologue=fused_norm, attention=fused_attention, q_norm=norms[0],
                       k_norm=norms[1])
        object.__setattr__(attn, _STATE_ATTR, state)
        attn.forward = types.MethodType(_forward, attn)
        count += 1
    return count


def uninstall(attn: nn.Module) -> None:
    if attn.__dict__.pop(_STATE_ATTR, None) is not None:
        attn.__dict__.pop("forward", None)


def fused_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of ``model`` that have the fused forward."""
    return [m for m in model.modules() if _STATE_ATTR in m.__dict__]


# ------------------------------------------------------------------------------------------------ the forward


def _rotation(plan, q: Tensor, cos: Tensor, style: str) -> dict | None:
    """The rotation keywords of a patched model's plan for q [B, S, H, D] (bshd), or None when the plan does not
    cover this call (then the family's rotation function decides, as in the rotation-only patch)."""
    if plan is None or plan.sections is not None or plan.positions.dim() != 2 or cos.dim() != 3:
        return None
    B, S, _, D = q.shape
    rotary_dim = plan.rotary_dim or plan.width
    if plan.positions.shape[-1] != S or plan.positions.shape[0] not in (1, B) or cos.shape[-1] != plan.width \
            or rotary_dim > D or plan.width != rotary_dim:
        return None
    return dict(positions=plan.positions, inv_freq=plan.inv_freq, rotary_scale=plan.scale, rotary_dim=rotary_dim,
                style=style, layout="bshd")


def _forward(self: nn.Module, hidden_states: Tensor, position_embeddings=None, attention_mask=None, *args,
             **kwargs):
    """The family's attention forward (see the module docstring) with the fused ops where they are exact."""
    state: _State = self.__dict__[_STATE_ATTR]
    shape = state.shape
    original = type(self).forward
    cos = position_embeddings[0] if isinstance(position_embeddings, (tuple, list)) \
        and len(position_embeddings) == 2 else None
    plan = getattr(cos, PLAN_ATTR, None)
    if args or plan is None or not isinstance(hidden_states, Tensor) or type(hidden_states) is not Tensor:
        return original(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    cache = kwargs.pop(shape.cache_arg, None)
    if cache is None and shape.cache_arg == "cache":  # the old name, as the class's deprecate_kwarg renames it
        cache = kwargs.pop("past_key_values", None)

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states)
    gate = None
    if shape.code.gated:
        q, gate = torch.chunk(q.view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(*input_shape, -1)
    q = q.view(hidden_shape)  # [B, S, H, D]
    k = self.k_proj(hidden_states).view(hidden_shape)
    v = self.v_proj(hidden_states).view(hidden_shape)
    rotation = _rotation(plan, q, cos, state.style)

    attn_output = attn_weights = None
    if state.attention and rotation is not None and _attention_route(self, state, q, k, v, cos, cache,
                                                                      attention_mask, kwargs):
        attn_output = _rope_attention(self, state, q, k, v, cache, rotation, kwargs)
    else:
        query, key, value = _prologue(self, state, q, k, v, cos, position_embeddings[1], cache, rotation, kwargs)
        attention_interface = state.modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, state.modeling.eager_attention_forward)
        extra = {} if shape.code.sliding is None else {"sliding_window": _sliding_window(self, shape.code)}
        attn_output, attn_weights = attention_interface(
            self, query, key, value, attention_mask,
            dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling, **extra, **kwargs)

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    if gate is not None:
        attn_output = attn_output * torch.sigmoid(gate)
    return self.o_proj(attn_output), attn_weights


def _norms_on(attn: nn.Module, code: _Code) -> bool:
    return code.norm_switch is None or bool(getattr(attn, code.norm_switch))


def _sliding_window(attn: nn.Module, code: _Code):
    """The sliding_window the family's forward gives its attention function (None where it gives none)."""
    if code.sliding == "module":
        return attn.sliding_window
    if code.sliding == "config":
        return getattr(attn.config, "sliding_window", None)
    return None


def _update(state: _State, cache, key: Tensor, value: Tensor, layer_idx: int, kwargs: dict):
    if state.shape.update_kwargs:
        return cache.update(key, value, layer_idx, kwargs=kwargs)
    return cache.update(key, value, layer_idx)


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _prologue(self, state: _State, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, cache, rotation,
              kwargs: dict) -> tuple[Tensor, Tensor, Tensor]:
    """Norms, rotation and cache update: query [B, H, S, D] and the key and value states the attention reads."""
    fused = (state.prologue and rotation is not None and q.dtype == k.dtype == v.dtype == cos.dtype
             == self.q_norm.weight.dtype == self.k_norm.weight.dtype
             and not _hooked(self.q_norm) and not _hooked(self.k_norm))
    if fused:
        offset, q_eps = state.q_norm
        if q_eps == state.k_norm[1]:
            if cache is not None and _static_layer(self, state.caches, cache, q, k, v):
                return _static_write(self, state, q, k, v, cache, rotation)
            q_rot, k_rot = qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, eps=q_eps,
                                        weight_offset=offset, **rotation)
            query, key, value = q_rot.transpose(1, 2), k_rot.transpose(1, 2), v.transpose(1, 2)
            if cache is not None:
                key, value = _update(state, cache, key, value, self.layer_idx, kwargs)
            return query, key, value
    # the family's own order of operations
    code = state.shape.code
    normed = code.norms is not None and _norms_on(self, code)
    if normed and code.norms == "before":
        q, k = self.q_norm(q), self.k_norm(k)
    query, key, value = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if normed and code.norms == "after":
        query, key = self.q_norm(query), self.k_norm(key)
    query, key = state.modeling.apply_rotary_pos_emb(query, key, cos, sin)
    if cache is not None:
        key, value = _update(state, cache, key, value, self.layer_idx, kwargs)
    return query, key, value


# ------------------------------------------------------------------------------------- the static-cache write


def _static_layer(self, classes: _CacheClasses, cache, q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether this layer's update is exactly ``StaticLayer.update`` (a ``StaticCache``'s full-attention layer, or
    the full-attention half of a hybrid model's, as Qwen3-Next's), reached through ``Cache.update`` without
    offloading, on caches rope_kv_write can write (the inputs' dtype and device), with nothing needing gradients."""
    base, static_layer = classes.cache, classes.static_layer
    if base is None or static_layer is None or not isinstance(cache, base) or type(cache).update is not base.update \
            or getattr(cache, "offloading", False):
        return False
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or self.layer_idx >= len(layers) \
            or type(layers[self.layer_idx]).update is not static_layer.update:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, self.q_norm.weight, self.k_norm.weight)):
        return False  # rope_kv_write is inference only
    if q.device.type not in ("cpu", "cuda"):
        return False
    layer = layers[self.layer_idx]
    if not getattr(layer, "is_initialized", False):
        # StaticLayer's own initialisation, or the hybrid layer's, which hands two positional tensors to it
        known = {static_layer.lazy_initialization, getattr(classes.hybrid_layer, "lazy_initialization", None)}
        return type(layer).lazy_initialization in known and k.shape[1] <= layer.max_cache_len
    keys, values = layer.keys, layer.values
    want = (k.shape[0], k.shape[2], layer.max_cache_len, k.shape[3])
    return (isinstance(keys, Tensor) and isinstance(values, Tensor) and keys.dtype == values.dtype == k.dtype
            and keys.device == values.device == k.device and tuple(keys.shape) == tuple(values.shape) == want
            and keys.stride(-1) == values.stride(-1) == 1 and k.shape[1] <= layer.max_cache_len
            and isinstance(getattr(layer, "cumulative_length", None), Tensor))


@device_cache(maxsize=16)
def _slot_rows(batch: int, seqlen: int, rows: int, device: torch.device) -> Tensor:
    """int64 [2, B, S]: the slot of token s of sequence b at cache row s (``b * rows + s``), and the end of
    sequence b's block (``(b + 1) * rows``)."""
    first = torch.arange(batch, device=device)[:, None] * rows + torch.arange(seqlen, device=device)
    end = (torch.arange(batch, device=device)[:, None] + 1) * rows
    return torch.stack([first, end.expand(batch, seqlen)])


def _static_write(self, state: _State, q: Tensor, k: Tensor, v: Tensor, cache, rotation: dict):
    """``StaticLayer.update`` with the norm and rotation in one rope_kv_write: token s of sequence b goes to row
    ``cumulative_length + s`` of the layer's [B, Hkv, max_cache_len, D] tensors, as there. The cache row and the
    rotation's position are different numbers with left padding, so the caches are written as "paged" blocks (one
    block of max_cache_len rows per sequence, read through a transposed view) with a slot per token, and the
    rotation takes the model's position ids."""
    layer = cache.layers[self.layer_idx]
    if not layer.is_initialized:
        layer.lazy_initialization(k.transpose(1, 2), v.transpose(1, 2))
    B, S = k.shape[:2]
    rows = layer.max_cache_len
    start = layer.cumulative_length
    if start.device.type == "cpu" and not torch.compiler.is_compiling() and int(start) + S > rows:
        raise IndexError(f"the static cache holds {rows} tokens per sequence; writing {S} at row {int(start)} "
                         "passes its end")
    first, end = _slot_rows(B, S, rows, k.device)
    slots = first + start.to(k.device)
    slots = slots.masked_fill(slots >= end, -1)  # never into the next sequence's rows (an IndexError on CPU)
    offset, eps = state.q_norm
    q_rot = rope_kv_write(q, k, v, layer.keys.transpose(1, 2), layer.values.transpose(1, 2), slot_mapping=slots,
                          cache_layout="paged", q_weight=self.q_norm.weight, k_weight=self.k_norm.weight, eps=eps,
                          weight_offset=offset, **rotation)
    layer.cumulative_length.add_(S)
    return q_rot.transpose(1, 2), layer.keys, layer.values


# ------------------------------------------------------------------------------------------ rope_attention


def _empty_dynamic_layer(classes: _CacheClasses, cache, layer_idx: int) -> bool:
    """Whether ``cache`` is a plain DynamicCache whose layer ``layer_idx`` holds nothing yet (its update then
    returns exactly the keys and values given)."""
    dynamic_cache, dynamic_layer = classes.dynamic_cache, classes.dynamic_layer
    if dynamic_layer is None or type(cache) is not dynamic_cache or getattr(cache, "offloading", False):
        return False
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return False
    if layer_idx < len(layers):
        layer = layers[layer_idx]
        return type(layer) is dynamic_layer and layer.get_seq_length() == 0
    return getattr(cache, "layer_class_to_replicate", None) is dynamic_layer


def _attention_route(self, state: _State, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, cache, attention_mask,
                     kwargs: dict) -> bool:
    """Whether rope_attention computes exactly what this call's attention would: transformers' sdpa with no mask,
    i.e. where its call takes ``is_causal`` (no padding; packed position ids without a mask attend causally over the
    whole row there as here), no sliding window, no dropout, no other keyword for the attention function, and every
    key of the attention among this call's tokens."""
    if self.config._attn_implementation != "sdpa" or attention_mask is not None:
        return False
    if getattr(self, "is_causal", True) is not True or _sliding_window(self, state.shape.code) is not None:
        return False
    if self.training and self.attention_dropout:
        return False
    if any(key not in _IGNORABLE_KWARGS for key in kwargs) or kwargs.get("output_attentions"):
        return False
    if q.device.type not in ("cpu", "cuda") or q.device != k.device or v.shape[-1] != q.shape[-1]:
        return False
    if not (q.dtype == k.dtype == v.dtype == cos.dtype):
        return False
    if state.shape.code.norms is not None and _norms_on(self, state.shape.code) \
            and not (self.q_norm.weight.dtype == self.k_norm.weight.dtype == q.dtype):
        return False  # Qwen3's norm returns the weight's dtype promoted with the input's
    return cache is None or _empty_dynamic_layer(state.caches, cache, self.layer_idx)


def _rope_attention(self, state: _State, q: Tensor, k: Tensor, v: Tensor, cache, rotation: dict,
                    kwargs: dict) -> Tensor:
    """The attention of q, k, v [B, S, H, D] (unrotated) through rope_attention: [B, S, Hq, D]."""
    if state.shape.code.norms is not None and _norms_on(self, state.shape.code):
        q, k = self.q_norm(q), self.k_norm(k)  # (before or after the transpose: the same per-row math)
    if cache is not None:  # the layer is empty: it stores the rotated keys, and its update returns them as given
        k_rot = apply_rope(k, **rotation)
        _update(state, cache, k_rot.transpose(1, 2), v.transpose(1, 2), self.layer_idx, kwargs)
    return rope_attention(q, k, v, scale=self.scaling, is_causal=True, **rotation)
