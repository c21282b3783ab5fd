"""Serving-engine drop-ins: the rotary entry points of vLLM, FlashInfer and SGLang, with their signatures and
semantics, on ropekit's ops (nothing of those engines is imported).

* :func:`rotary_embedding`: vLLM's ``rotary_embedding`` (in place).
* :func:`fused_qk_norm_rope`: vLLM's ``fused_qk_norm_rope`` (per-head RMSNorm + RoPE on a packed qkv, in place).
* :func:`apply_rope_with_cos_sin_cache`: FlashInfer's op of that name (new tensors).
* :func:`apply_rope_with_cos_sin_cache_inplace`: FlashInfer's op of that name (in place), and SGLang's, whose
  ``fused_set_kv_buffer_arg`` (:class:`FusedSetKVBufferArg`) also writes the rotated key and the value into the
  token-indexed KV buffers.

* :func:`rope_quantize_fp8`: FlashInfer's op of that name (RoPE of pre-split rope/nope parts, float8 outputs).

What they share:

* ``cos_sin_cache`` [max_position, rot_dim]: row p holds the cos of the rot_dim/2 pairs at position p, then their
  sin (``cat(cos, sin)``). Any float dtype, read in fp32; rot_dim even, 2 <= rot_dim <= head_size. The first rot_dim
  columns of each head are rotated, the rest pass through unchanged (partial rotary).
* ``is_neox``: True pairs column i with i + rot_dim/2 (GPT-NeoX, transformers' ``rotate_half``); False pairs 2i with
  2i + 1 (GPT-J). The rotation is ``x0' = x0 cos - x1 sin``, ``x1' = x1 cos + x0 sin``.
* ``positions``: int32/int64 [T] (or [B, S] for inputs with two token dims), any order; each indexes a row of
  ``cos_sin_cache``. CPU positions (and device positions with ``check_positions=True``: one host sync) outside
  [0, max_position) raise ``ValueError`` naming ``positions``; device positions are not read on the host, and a
  token with an invalid one comes out as NaN (ropekit's rule, never an out-of-bounds read).
* query/key/value: ``[T, H * head_size]`` or ``[T, H, head_size]`` (``[B, S, ...]`` with [B, S] positions),
  float16/bfloat16/float32, any strides with a contiguous last dim: the q and k slices of a packed qkv projection
  are used (and written) in place, never copied. The key may have fewer heads than the query (GQA/MQA).
* Math in fp32 (float64 for float64 inputs) with one rounding to the input dtype at the store.
* Bad input raises ``TypeError``/``ValueError`` naming the argument before anything is written. In-place writes go
  through ropekit's in-place ops or ``Tensor.copy_``: autograd's version counters see them, so a tensor saved for a
  backward and then rotated here makes that backward raise instead of giving a wrong gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ropekit._validation import check_inplace_targets
from ropekit.api import apply_rope, apply_rope_, qk_norm_rope, rope_kv_write

__all__ = [
    "rotary_embedding",
    "fused_qk_norm_rope",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "FusedSetKVBufferArg",
    "rope_quantize_fp8",
]

_INT_DTYPES = (torch.int32, torch.int64)


@dataclass
class FusedSetKVBufferArg:
    """SGLang's ``FusedSetKVBufferArg``, field for field (SGLang's own instances are accepted too: the fields are
    read by name).

    value : Tensor [T, Hkv * head_size] or [T, Hkv, head_size]
        The values of the tokens, the key's dtype; copied unchanged into ``v_buffer``.
    k_buffer, v_buffer : Tensor [num_slots, Hkv * head_size] or [num_slots, Hkv, head_size]
        One layer's token-indexed KV pool (SGLang's ``MHATokenToKVPool`` buffers), in the key's dtype or
        ``torch.float8_e4m3fn``. Written at rows ``cache_loc``.
    k_scale, v_scale : float or 0-d float tensor, optional
        float8 buffers store ``value / scale`` (rounded once, saturated to +-448). Buffers of the key's dtype
        ignore them, as SGLang's ``set_kv_buffer`` scales only when it converts the dtype.
    cache_loc : Tensor [T], int32/int64
        Each token's row of the buffers (-1 skips the token).
    """

    value: Tensor
    k_buffer: Tensor
    v_buffer: Tensor
    k_scale: float | Tensor | None = None
    v_scale: float | Tensor | None = None
    cache_loc: Tensor | None = None


# ----------------------------------------------------------------------------------------------------- checks

def _tables(cos_sin_cache, head_size: int, ref: Tensor) -> tuple[Tensor, Tensor, int]:
    """cos and sin [max_position, rot_dim/2] as views of ``cos_sin_cache``, and rot_dim."""
    if not isinstance(cos_sin_cache, Tensor):
        raise TypeError(f"cos_sin_cache must be a torch.Tensor, got {type(cos_sin_cache).__name__}")
    if not cos_sin_cache.dtype.is_floating_point or cos_sin_cache.dtype.itemsize < 2:
        raise TypeError(f"cos_sin_cache must be a float16/bfloat16/float32/float64 tensor, got {cos_sin_cache.dtype}")
    if cos_sin_cache.device != ref.device:
        raise ValueError(f"cos_sin_cache must be on the query's device {ref.device}, got {cos_sin_cache.device}")
    if cos_sin_cache.dim() != 2:
        raise ValueError(f"cos_sin_cache must be 2-D [max_position, rot_dim] (cat(cos, sin) per position), got shape "
                         f"{tuple(cos_sin_cache.shape)}")
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or not 2 <= rot_dim <= head_size:
        raise ValueError(f"cos_sin_cache's rot_dim (its last dim: cos then sin of each rotated pair) must be even and "
                         f"in [2, head_size = {head_size}], got {rot_dim}")
    half = rot_dim // 2
    return cos_sin_cache[:, :half], cos_sin_cache[:, half:], rot_dim


def _check_head_size(head_size) -> int:
    if isinstance(head_size, bool) or not isinstance(head_size, int):
        raise TypeError(f"head_size must be an int, got {type(head_size).__name__}")
    if head_size <= 0 or head_size % 2:
        raise ValueError(f"head_size must be a positive even int, got {head_size}")
    return head_size


def _check_positions(positions, rows: int, check_positions: bool, name: str = "positions") -> Tensor:
    if not isinstance(positions, Tensor):
        raise TypeError(f"{name} must be an int32/int64 tensor, got {type(positions).__name__}")
    if positions.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {positions.dtype}")
    if positions.dim() not in (1, 2):
        raise ValueError(f"{name} must be [T] (or [B, S]), one per token, got shape {tuple(positions.shape)}")
    if positions.numel() and (positions.device.type == "cpu" or check_positions) \
            and not torch.compiler.is_compiling():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= rows:
            raise ValueError(f"{name} must lie in [0, {rows}) (the rows of cos_sin_cache), got values in "
                             f"[{lo}, {hi}]")
    return positions


def _heads(name: str, x, head_size: int, positions: Tensor, ref: Tensor | None = None) -> Tensor:
    """``x`` [*lead, H * head_size] or [*lead, H, head_size] (lead = positions' shape) as a [*lead, H, head_size]
    view."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ref is not None and (x.dtype != ref.dtype or x.device != ref.device):
        raise TypeError(f"{name} must have the query's dtype {ref.dtype} and device {ref.device}, got {x.dtype} on "
                        f"{x.device}")
    lead = positions.dim()
    if tuple(x.shape[:lead]) != tuple(positions.shape) or x.dim() not in (lead + 1, lead + 2):
        want = "[T, H * head_size] or [T, H, head_size]" if lead == 1 else \
            "[B, S, H * head_size] or [B, S, H, head_size]"
        raise ValueError(f"{name} must be {want} with the token dims of positions {tuple(positions.shape)}, got shape "
                         f"{tuple(x.shape)}")
    if x.numel() and x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {tuple(x.stride())}")
    if x.dim() == lead + 2:
        if x.shape[-1] != head_size:
            raise ValueError(f"{name} is [.., H, head_size] and its last dim {x.shape[-1]} must equal head_size = "
                             f"{head_size}")
        return x
    width = x.shape[-1]
    if width % head_size:
        raise ValueError(f"head_size = {head_size} must divide the width of {name} ({width} = H * head_size)")
    return x.unflatten(-1, (width // head_size, head_size))


def _prepare(positions, query, key, head_size, cos_sin_cache, is_neox, check_positions):
    """The checked views q [*lead, H, D], k (or None) and apply_rope's keywords."""
    head_size = _check_head_size(head_size)
    if not isinstance(query, Tensor):
        raise TypeError(f"query must be a torch.Tensor, got {type(query).__name__}")
    cos, sin, rot_dim = _tables(cos_sin_cache, head_size, query)
    positions = _check_positions(positions, cos_sin_cache.shape[0], check_positions)
    q = _heads("query", query, head_size, positions)
    k = None if key is None else _heads("key", key, head_size, positions, query)
    options = dict(positions=positions, cos=cos, sin=sin, style="neox" if is_neox else "interleaved",
                   layout="thd" if positions.dim() == 1 else "bshd", rotary_dim=rot_dim)
    return q, k, options


# ------------------------------------------------------------------------------------------------ the drop-ins

def rotary_embedding(positions: Tensor, query: Tensor, key: Tensor | None, head_size: int, cos_sin_cache: Tensor,
                     is_neox: bool, *, check_positions: bool = False) -> None:
    """vLLM's ``rotary_embedding`` (``vllm._custom_ops``): rotate ``query`` and ``key`` in place.

    positions : Tensor [T] (or [B, S]), int32/int64
        Each token's row of ``cos_sin_cache``.
    query : Tensor [T, Hq * head_size] or [T, Hq, head_size] (or [B, S, ...])
        float16/bfloat16/float32; any strides with a contiguous last dim (a slice of a packed qkv is rotated where
        it lies).
    key : Tensor [T, Hkv * head_size] or [T, Hkv, head_size], optional
        The query's dtype; None rotates the query alone.
    head_size : int
        The width of one head; must divide the last dim of 2-D inputs.
    cos_sin_cache : Tensor [max_position, rot_dim]
        cat(cos, sin) of the rot_dim/2 pairs per position; rot_dim < head_size leaves the tail of each head as it
        is.
    is_neox : bool
        True: GPT-NeoX pairs (i, i + rot_dim/2); False: GPT-J pairs (2i, 2i + 1).
    check_positions : bool
        Also check device-resident positions on the host (one sync); CPU positions are always checked.

    Returns None (the inputs hold the result). Raises ``TypeError``/``ValueError`` naming the argument; nothing is
    written when it raises.
    """
    q, k, options = _prepare(positions, query, key, head_size, cos_sin_cache, is_neox, check_positions)
    apply_rope_(q, k, **options)


def apply_rope_with_cos_sin_cache(positions: Tensor, query: Tensor, key: Tensor | None, head_size: int,
                                  cos_sin_cache: Tensor, is_neox: bool = True, *,
                                  check_positions: bool = False) -> tuple[Tensor, Tensor | None]:
    """FlashInfer's ``apply_rope_with_cos_sin_cache``: returns new ``(query_out, key_out)`` with the inputs'
    shapes and dtype; the inputs are not modified. Arguments as :func:`rotary_embedding` (``key=None`` gives
    ``key_out=None``). Differentiable in query and key (ropekit's :func:`ropekit.apply_rope`).

    FlashInfer refuses a ``cos_sin_cache`` that is not float32; here any float dtype is read in fp32.
    """
    q, k, options = _prepare(positions, query, key, head_size, cos_sin_cache, is_neox, check_positions)
    if k is None:
        return apply_rope(q, None, **options).reshape(query.shape), None
    q_out, k_out = apply_rope(q, k, **options)
    return q_out.reshape(query.shape), k_out.reshape(key.shape)


def apply_rope_with_cos_sin_cache_inplace(positions: Tensor, query: Tensor, key: Tensor | None, head_size: int,
                                          cos_sin_cache: Tensor, is_neox: bool = True,
                                          fused_set_kv_buffer_arg: FusedSetKVBufferArg | None = None,
                                          enable_pdl: bool | None = None, *,
                                          check_positions: bool = False) -> None:
    """FlashInfer's ``apply_rope_with_cos_sin_cache_inplace`` and SGLang's (``sgl_kernel``) of that name: rotate
    ``query`` and ``key`` in place; arguments as :func:`rotary_embedding`.

    fused_set_kv_buffer_arg : :class:`FusedSetKVBufferArg`, optional (SGLang)
        Also write each token's rotated key and its unchanged value into row ``cache_loc[t]`` of
        ``k_buffer``/``v_buffer`` (SGLang's ``set_kv_buffer`` fused into the rotation), through
        :func:`ropekit.rope_kv_write` with the buffers as a paged cache of one-token blocks and ``cache_loc`` as its
        ``slot_mapping``. Needs 1-D positions and a key; inference only (raises where autograd would need
        gradients). ``cache_loc`` values outside the buffers raise ``ValueError`` where they are on the host.
    enable_pdl : bool, optional
        Accepted for the engines' signature and ignored; results are the same bits either way. The in-place
        rotation's kernel has no programmatic dependent launch (PDL) variant. Only the buffer write's kernel (the
        attention prologue's) has one, behind the process-wide, experimental ``ropekit._config.pdl_launches``,
        which one call cannot turn on for itself without racing other threads' calls. It stays off: after a cuBLAS
        GEMM (the QKV projection before this call) PDL measured slower, as that GEMM does not trigger its dependents
        early (docs/perf-notes.md, "The decode step with its QKV projection, and PDL").

    With the buffers this takes two launches: rope_kv_write (the buffer rows; its rotated q is not kept) and the
    in-place rotation of query and key, both from the same unrotated inputs, so the key left in ``key`` and the one
    stored agree to the rounding of the dtype (bit for bit on CPU). One launch would need rope_kv_write to write
    the rotated q and k back into its inputs, which it does not do.

    Returns None. Raises ``TypeError``/``ValueError`` naming the argument; nothing is written when it raises.
    """
    del enable_pdl  # ignored: see the docstring
    q, k, options = _prepare(positions, query, key, head_size, cos_sin_cache, is_neox, check_positions)
    arg = fused_set_kv_buffer_arg
    if arg is None:
        apply_rope_(q, k, **options)
        return
    if k is None:
        raise ValueError("fused_set_kv_buffer_arg needs a key to write into k_buffer; got key=None")
    if options["layout"] != "thd":
        raise ValueError(f"fused_set_kv_buffer_arg needs 1-D positions [T], got shape {tuple(positions.shape)}")
    name = "fused_set_kv_buffer_arg"
    v = _heads(f"{name}.value", getattr(arg, "value", None), head_size, positions, query)
    if v.shape != k.shape:
        raise ValueError(f"{name}.value must have the key's heads {tuple(k.shape)}, got {tuple(v.shape)}")
    Hkv = k.shape[1]
    caches = []
    for field in ("k_buffer", "v_buffer"):
        buf = getattr(arg, field, None)
        if not isinstance(buf, Tensor):
            raise TypeError(f"{name}.{field} must be a torch.Tensor, got {type(buf).__name__}")
        if buf.dim() == 2 and buf.shape[1] == Hkv * head_size:
            buf = buf.unflatten(-1, (Hkv, head_size))
        if buf.dim() != 3 or tuple(buf.shape[1:]) != (Hkv, head_size):
            raise ValueError(f"{name}.{field} must be [num_slots, Hkv * head_size] or [num_slots, Hkv, head_size] "
                             f"with Hkv = {Hkv}, head_size = {head_size}, got shape {tuple(buf.shape)}")
        caches.append(buf.unsqueeze(1))  # [num_slots, 1, Hkv, D]: a paged cache of one-token blocks
    loc = getattr(arg, "cache_loc", None)
    if not isinstance(loc, Tensor) or loc.dtype not in _INT_DTYPES:
        raise TypeError(f"{name}.cache_loc must be an int32/int64 tensor, got "
                        f"{loc.dtype if isinstance(loc, Tensor) else type(loc).__name__}")
    if tuple(loc.shape) != tuple(positions.shape):
        raise ValueError(f"{name}.cache_loc must be [T] = {tuple(positions.shape)}, one row per token, got shape "
                         f"{tuple(loc.shape)}")
    slots = caches[0].shape[0]
    if loc.numel() and (loc.device.type == "cpu" or check_positions) and not torch.compiler.is_compiling():
        lo, hi = int(loc.min()), int(loc.max())
        if lo < -1 or hi >= slots:
            raise ValueError(f"{name}.cache_loc must lie in [0, {slots}) (the rows of k_buffer) or be -1, got "
                             f"values in [{lo}, {hi}]")
    scales = [getattr(arg, s, None) if c.dtype != query.dtype else None
              for s, c in (("k_scale", caches[0]), ("v_scale", caches[1]))]
    # The in-place targets first: rope_kv_write writes the buffers, and nothing may be written if the rotation
    # that follows it would be refused.
    check_inplace_targets(q, k, ("query", "key"))
    rope_kv_write(q, k, v, caches[0], caches[1], slot_mapping=loc, cache_layout="paged", k_cache_scale=scales[0],
                  v_cache_scale=scales[1], check_positions=check_positions, **options)
    apply_rope_(q, k, **options)


def fused_qk_norm_rope(qkv: Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int, head_dim: int,
                       eps: float, q_weight: Tensor, k_weight: Tensor, cos_sin_cache: Tensor, is_neox: bool,
                       position_ids: Tensor, *, check_positions: bool = False) -> None:
    """vLLM's ``fused_qk_norm_rope`` (``vllm._custom_ops``): in the packed projection ``qkv``, replace each q and k
    head by ``rope(x / sqrt(mean(x**2) + eps) * weight)`` (RMSNorm over the head's head_dim columns, then the
    rotation by ``cos_sin_cache`` at ``position_ids``); the v heads are left as they are.

    qkv : Tensor [T, (num_heads_q + num_heads_k + num_heads_v) * head_dim] (or [T, heads, head_dim])
        float16/bfloat16/float32, q heads then k heads then v heads; any strides with a contiguous last dim.
    q_weight, k_weight : Tensor [head_dim]
        The norms' weights, any float dtype (read in fp32).
    eps : float
        Added to the mean square (> 0).
    cos_sin_cache : Tensor [max_position, rot_dim], is_neox : bool
        As :func:`rotary_embedding`; the columns past rot_dim come out normalised, not rotated.
    position_ids : Tensor [T], int32/int64
        Each token's row of ``cos_sin_cache``.
    check_positions : bool
        As :func:`rotary_embedding`.

    The norm is computed in fp32 (float64 for float64 inputs) and not rounded before the rotation (vLLM's kernel
    rounds the normalised value to the input dtype before the weight; the results differ by that rounding). Computed by
    :func:`ropekit.qk_norm_rope` into new tensors and copied back into ``qkv`` (differentiable where qkv is not a
    leaf). Returns None. Raises ``TypeError``/``ValueError`` naming the argument; nothing is written when it raises.
    """
    head_dim = _check_head_size(head_dim)
    if not isinstance(qkv, Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    counts = {"num_heads_q": num_heads_q, "num_heads_k": num_heads_k, "num_heads_v": num_heads_v}
    for n, c in counts.items():
        if isinstance(c, bool) or not isinstance(c, int) or c < (0 if n == "num_heads_v" else 1):
            raise ValueError(f"{n} must be an int >= {0 if n == 'num_heads_v' else 1}, got {c!r}")
    heads = num_heads_q + num_heads_k + num_heads_v
    cos, sin, rot_dim = _tables(cos_sin_cache, head_dim, qkv)
    positions = _check_positions(position_ids, cos_sin_cache.shape[0], check_positions, "position_ids")
    if positions.dim() != 1:
        raise ValueError(f"position_ids must be [T], got shape {tuple(positions.shape)}")
    if qkv.dim() == 2 and qkv.shape[-1] % head_dim:
        raise ValueError(f"head_dim = {head_dim} must divide the width of qkv ({qkv.shape[-1]})")
    x = _heads("qkv", qkv, head_dim, positions)
    if x.shape[1] != heads:
        raise ValueError(f"qkv must hold num_heads_q + num_heads_k + num_heads_v = {heads} heads of head_dim = "
                         f"{head_dim} per token ({heads * head_dim} columns), got shape {tuple(qkv.shape)}")
    q, k = x[:, :num_heads_q], x[:, num_heads_q:num_heads_q + num_heads_k]
    check_inplace_targets(q, k, ("qkv (its q heads)", "qkv (its k heads)"))
    q_out, k_out = qk_norm_rope(q, k, q_weight, k_weight, eps=eps, positions=positions, cos=cos, sin=sin,
                                style="neox" if is_neox else "interleaved", layout="thd", rotary_dim=rot_dim)
    q.copy_(q_out)
    k.copy_(k_out)


# ------------------------------------------------------------------------------------- FlashInfer's fp8 prologue

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _float8_target(name: str, out, like: Tensor, dtype: torch.dtype) -> None:
    """A caller's output tensor: None, or ``like``'s shape in ``dtype`` on its device."""
    if out is None:
        return
    if not isinstance(out, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(like.shape) or out.dtype != dtype or out.device != like.device:
        raise ValueError(f"{name} must be {tuple(like.shape)} {dtype} on {like.device}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")


def _quant_scale(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite float > 0, got {value!r}")
    return float(value)


def rope_quantize_fp8(q_rope: Tensor, k_rope: Tensor, q_nope: Tensor | None, k_nope: Tensor | None,
                      cos_sin_cache: Tensor, pos_ids: Tensor, is_neox: bool = True,
                      quantize_dtype: torch.dtype | None = None, quant_scale_q: float = 1.0,
                      quant_scale_kv: float = 1.0, q_rope_out: Tensor | None = None, k_rope_out: Tensor | None = None,
                      q_nope_out: Tensor | None = None, k_nope_out: Tensor | None = None, enable_pdl: bool = False,
                      *, check_positions: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FlashInfer's ``rope_quantize_fp8``: rotate the rotary parts of q and k and quantize them and the non-rotary
    parts to float8; returns ``(q_rope_out, k_rope_out, q_nope_out, k_nope_out)``. Inference only.

    q_rope : Tensor [nnz, Hq, rope_dim]
    k_rope : Tensor [nnz, Hkv, rope_dim], or [nnz, rope_dim] (MLA: one shared key head)
        float16/bfloat16 (float32 too), one dtype; rotated whole (rope_dim = cos_sin_cache's width).
    q_nope, k_nope : Tensor [nnz, Hq, no_rope_dim] / [nnz, Hkv, no_rope_dim] (MLA: [nnz, no_rope_dim]), or None
        Not rotated, only quantized (None: empty outputs with no_rope_dim 0).
    cos_sin_cache : Tensor [max_seq_len, rope_dim]
        cat(cos, sin) of the rope_dim/2 pairs per position (FlashInfer's float32; any float dtype here).
    pos_ids : Tensor [nnz], int32/int64
    is_neox : bool
        True: NeoX pairs (i, i + rope_dim/2); False: GPT-J pairs (2i, 2i + 1).
    quantize_dtype : torch.float8_e4m3fn or torch.float8_e5m2, optional
        Default: the dtype of the output tensors given, else float8_e4m3fn.
    quant_scale_q, quant_scale_kv : float
        Multiply q's and k's values before the conversion (FlashInfer's quantization scales: stored = value *
        scale, rounded once to nearest even, saturated to +-448 / +-57344).
    q_rope_out, k_rope_out, q_nope_out, k_nope_out : Tensor, optional
        Where to write (their inputs' shapes, ``quantize_dtype``; views, such as the two parts of one q buffer,
        are fine); new tensors where None.
    enable_pdl : bool
        Accepted for FlashInfer's signature and ignored; results are the same bits either way. The rotation's
        kernel has no programmatic dependent launch (PDL) variant (ropekit's experimental, process-wide
        ``ropekit._config.pdl_launches`` covers only the attention prologue's kernel, and measured slower after a
        cuBLAS GEMM: docs/perf-notes.md, "The decode step with its QKV projection, and PDL").

    Raises ``TypeError``/``ValueError`` naming the argument before anything is written.
    """
    outs = (q_rope_out, k_rope_out, q_nope_out, k_nope_out)
    if quantize_dtype is None:
        quantize_dtype = next((o.dtype for o in outs if isinstance(o, Tensor)), torch.float8_e4m3fn)
    if quantize_dtype not in _FP8_MAX:
        raise TypeError(f"quantize_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {quantize_dtype}")
    scale_q, scale_kv = _quant_scale("quant_scale_q", quant_scale_q), _quant_scale("quant_scale_kv", quant_scale_kv)
    for name, x in (("q_rope", q_rope), ("k_rope", k_rope)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if q_rope.dim() != 3:
        raise ValueError(f"q_rope must be [nnz, num_qo_heads, rope_dim], got shape {tuple(q_rope.shape)}")
    nnz, hq, rope_dim = q_rope.shape
    mla = k_rope.dim() == 2
    if k_rope.dim() not in (2, 3) or k_rope.shape[0] != nnz or k_rope.shape[-1] != rope_dim:
        raise ValueError(f"k_rope must be [{nnz}, num_kv_heads, {rope_dim}] or (MLA) [{nnz}, {rope_dim}], got shape "
                         f"{tuple(k_rope.shape)}")
    cos, sin, rot_dim = _tables(cos_sin_cache, rope_dim, q_rope)
    if rot_dim != rope_dim:
        raise ValueError(f"cos_sin_cache must be [max_seq_len, rope_dim = {rope_dim}], got "
                         f"{tuple(cos_sin_cache.shape)}")
    positions = _check_positions(pos_ids, cos_sin_cache.shape[0], check_positions, "pos_ids")
    if positions.dim() != 1 or positions.shape[0] != nnz:
        raise ValueError(f"pos_ids must be [nnz] = [{nnz}], got shape {tuple(positions.shape)}")
    nopes = []
    for name, x, rope in (("q_nope", q_nope, q_rope), ("k_nope", k_nope, k_rope)):
        if x is None:
            x = rope.new_empty(*rope.shape[:-1], 0)
        if not isinstance(x, Tensor) or x.dim() != rope.dim() or tuple(x.shape[:-1]) != tuple(rope.shape[:-1]) \
                or x.device != rope.device or not x.dtype.is_floating_point:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a float tensor {tuple(rope.shape[:-1])} + (no_rope_dim,) on "
                             f"{rope.device}, or None, got {got}")
        nopes.append(x)
    for name, out, like in zip(("q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out"), outs,
                               (q_rope, k_rope, *nopes)):
        _float8_target(name, out, like, quantize_dtype)
    big = _FP8_MAX[quantize_dtype]
    q_r, k_r = apply_rope(q_rope, k_rope.unsqueeze(1) if mla else k_rope, positions=positions, cos=cos, sin=sin,
                          style="neox" if is_neox else "interleaved", layout="thd", out_dtype=quantize_dtype,
                          q_scale=scale_q, k_scale=scale_kv)
    results = [q_r, k_r.view(k_rope.shape)] + [(x.float() * s).clamp(-big, big).to(quantize_dtype)
                                                for x, s in zip(nopes, (scale_q, scale_kv))]
    return tuple(r if out is None else out.copy_(r) for r, out in zip(results, outs))

