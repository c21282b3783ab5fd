"""The MLA attention prologue (multi-head latent attention: DeepSeek V2/V3, Kimi K2, GLM): :func:`mla_rope_kv_write`.

MLA splits each query head into a part without positions and a rotated part, ``q = [q_nope | q_pe]``, and shares
one rotated key ``k_pe`` between all heads; the cache keeps, per token, the latent ``kv_c`` (from which keys and
values are projected) beside the rotated ``k_pe``: the row ``[kv_c | R(k_pe)]``. One kernel launch rotates q's
rope columns and ``k_pe`` and writes the cache rows (:mod:`ropekit.triton.mla_launcher`); on CPU tensors the float64
reference runs (:func:`ropekit.reference.mla_reference`), or the kernel under the Triton interpreter inside
:func:`ropekit.testing.kernels_on_cpu`.

Without a cache the call is differentiable in q and ``k_pe`` (``ropekit::mla_rope``, whose registered backward is
the conjugate rotation through ``ropekit::rope``); with a cache the write goes through ``ropekit::mla_rope_kv_write``,
which mutates the caches and is inference only -- a call that needs gradients writes the cache under
``torch.no_grad()`` and takes its outputs from ``ropekit::mla_rope`` (two launches).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

import ropekit.autograd  # noqa: F401 - registers ropekit::rope's formula, which the backward here goes through
from ropekit import ops
from ropekit._memory import has_internal_overlap, overlap
from ropekit._spec import FLOAT_DTYPES, FORWARD, INT_DTYPES, Positions, RopeArgs, RopeSpec
from ropekit._validation import _host_readable, validate_args

__all__ = ["mla_rope_kv_write"]

MLA_CACHE_LAYOUTS = ("paged", "bshd")
FP8_CACHES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _host_values(t: Tensor, check: bool) -> bool:
    """Whether ``t``'s values may be read for a check: on the host (CPU tensors that run the kernels stand in for
    device tensors), or ``check`` (one sync); never while tracing."""
    return (check or _host_readable(t)) and t.numel() > 0 and not torch.compiler.is_compiling()


def _check_input(name: str, x, q: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != q.dtype:
        raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    if x.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")
    if x.numel() and x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {x.stride()}")


def _cache_scale(scale, cache: Tensor, check: bool):
    """``kv_cache_scale`` as the kernel takes it: 1.0 (None), a float, or a float32 tensor of one element."""
    if scale is None:
        return 1.0
    if cache.dtype not in FP8_CACHES:
        raise ValueError(f"kv_cache_scale applies to float8 caches only; the cache is {cache.dtype}")
    if isinstance(scale, Tensor):
        if scale.shape not in ((), (1,)) or not scale.dtype.is_floating_point or scale.device != cache.device:
            raise ValueError(f"kv_cache_scale must be a float or a floating tensor of shape [] or [1] on the cache's "
                             f"device {cache.device}, got shape {tuple(scale.shape)} {scale.dtype} on {scale.device}")
        if _host_values(scale, check) and not bool((torch.isfinite(scale) & (scale > 0)).all()):
            raise ValueError(f"kv_cache_scale must be finite and > 0, got {scale.tolist()!r}")
        return scale.to(torch.float32).reshape(())
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < float(scale) < float("inf"):
        raise ValueError(f"kv_cache_scale must be a finite float > 0, got {scale!r}")
    return float(scale)


def _check_caches(kv_cache, q: Tensor, latent: int, rope: int) -> tuple[Tensor, Tensor | None]:
    """(ckv, kpe): one cache [.., .., latent + rope] (kpe None), or two [.., .., latent] and [.., .., rope]."""
    if isinstance(kv_cache, Tensor):
        caches, widths, names = [kv_cache], [latent + rope], ["kv_cache"]
    elif isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2:
        caches, widths, names = list(kv_cache), [latent, rope], ["kv_cache[0] (ckv)", "kv_cache[1] (kpe)"]
    else:
        raise TypeError("kv_cache must be a tensor [num_blocks, block_size, D_latent + D_rope] or a pair of tensors "
                        f"(ckv [.., D_latent], kpe [.., D_rope]), got {type(kv_cache).__name__}")
    for name, c, width in zip(names, caches, widths):
        if not isinstance(c, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(c).__name__}")
        if c.dtype != q.dtype and c.dtype not in FP8_CACHES:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, float8_e4m3fn or float8_e5m2, got {c.dtype}")
        if c.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {c.device}")
        if c.dim() != 3 or c.shape[2] != width or c.stride(-1) != 1:
            raise ValueError(f"{name} must be a 3-D tensor [.., .., {width}] with a contiguous last dim "
                             f"(D_latent = {latent}, D_rope = {rope}), got shape {tuple(c.shape)} strides {c.stride()}")
    for name, c in zip(names, caches):
        if has_internal_overlap(c):  # expand(): rows of different tokens would land on one element
            raise ValueError(f"{name} reaches an element twice through its strides (expand()?): it cannot be "
                             f"written; pass a cache with memory of its own, got strides {c.stride()}")
    if len(caches) == 2:
        if caches[1].dtype != caches[0].dtype or caches[1].shape[:2] != caches[0].shape[:2]:
            raise ValueError("kv_cache's two caches must have one dtype and the same first two dims, got "
                             f"{tuple(caches[0].shape)} {caches[0].dtype} and {tuple(caches[1].shape)} "
                             f"{caches[1].dtype}")
        if not torch.compiler.is_compiling() and overlap(caches[0], caches[1]):
            raise ValueError("kv_cache's ckv and kpe caches share memory: pass two separate caches, or one cache")
    return caches[0], (caches[1] if len(caches) == 2 else None)


def _validate(q, k_pe, kv_c, positions, kv_cache, slot_mapping, cache_layout, kv_cache_scale, cu_seqlens,
              broadcast_k, args: RopeArgs):
    """Check every argument; returns (q, k_pe as views in the rotation's layout, the rotation's spec, the cache
    keywords of ``ops.mla_rotate`` or None, the number of k heads, tokens: 3-D inputs seen as [T, 1, ...])."""
    if not isinstance(q, Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [T, H, D_nope + D_rope] or [B, S, H, D_nope + D_rope], got shape "
                         f"{tuple(q.shape)}")
    _check_input("k_pe", k_pe, q)
    lead = tuple(q.shape[:-2])
    if k_pe.dim() == q.dim() - 1:
        k_pe = k_pe.unsqueeze(-2)  # [.., D_rope] -> [.., 1, D_rope]
    if k_pe.dim() != q.dim() or tuple(k_pe.shape[:-2]) != lead or k_pe.shape[-2] != 1:
        raise ValueError(f"k_pe must be [{', '.join(map(str, lead))}, 1, D_rope] or [{', '.join(map(str, lead))}, "
                         f"D_rope] (one key shared by q's heads), got shape {tuple(k_pe.shape)}")
    rope = k_pe.shape[-1]
    if rope < 2 or rope % 2 or rope > q.shape[-1]:
        raise ValueError(f"k_pe's last dim D_rope must be even, >= 2 and <= q's head dim {q.shape[-1]} (q's rope "
                         f"columns are its last D_rope), got {rope}")
    if q.shape[-2] < 1:
        raise ValueError(f"q must have at least one head, got shape {tuple(q.shape)}")
    tokens = q.dim() == 3
    if tokens and cu_seqlens is None:  # one token per sequence: [T, 1, ...], as rope_kv_write
        q, k_pe, layout = q.unsqueeze(1), k_pe.unsqueeze(1), "bshd"
        if isinstance(positions, Tensor) and positions.dim() == (1 if args.sections is None else 2):
            positions = positions.unsqueeze(-1)
    elif tokens:
        layout = "thd"
    elif cu_seqlens is not None:
        raise ValueError("cu_seqlens applies to 3-D [T, H, D] tokens only")
    else:
        layout = "bshd"
    spec = validate_args(q, None, args._replace(positions=positions, cu_seqlens=cu_seqlens, layout=layout,
                                                rotary_dim=rope, rotary_at="back"), FORWARD)
    B, S = (1, q.shape[0]) if layout == "thd" else q.shape[:2]
    k_heads = q.shape[-2] if broadcast_k else 1
    if kv_cache is None:
        for name, value in (("kv_c", kv_c), ("slot_mapping", slot_mapping), ("kv_cache_scale", kv_cache_scale)):
            if value is not None:
                raise ValueError(f"{name} is written to or read for the cache only: pass kv_cache too")
        return q, k_pe, spec, None, k_heads, tokens
    _check_input("kv_c", kv_c, q)
    want = (B * S,) if layout == "thd" else (B, S)
    if tokens and kv_c.dim() == 2 and kv_c.shape[0] == B * S and layout == "bshd":
        kv_c = kv_c.unsqueeze(1)
    if tuple(kv_c.shape[:-1]) != want or kv_c.shape[-1] < 1:
        raise ValueError(f"kv_c must be [{', '.join(map(str, want))}, D_latent] (one latent row per token of q), got "
                         f"shape {tuple(kv_c.shape)}")
    latent = kv_c.shape[-1]
    ckv, kpe = _check_caches(kv_cache, q, latent, rope)
    if not torch.compiler.is_compiling():  # addresses are unknown while tracing
        for c in (ckv, kpe):
            if c is None:
                continue
            if c.is_inference() and not torch.is_inference_mode_enabled():
                raise RuntimeError("kv_cache is an inference tensor: writing it outside torch.inference_mode() is "
                                   "refused, as torch refuses in-place updates of inference tensors there")
            for name, x in (("q", q), ("k_pe", k_pe), ("kv_c", kv_c)):
                if overlap(c, x):
                    raise ValueError(f"kv_cache and {name} share memory: the cache write would change the input "
                                     f"while it is read. Pass {name} as a tensor outside the cache")
    if not isinstance(cache_layout, str) or cache_layout not in MLA_CACHE_LAYOUTS:
        raise ValueError(f"cache_layout must be one of {MLA_CACHE_LAYOUTS}, got {cache_layout!r}")
    paged = cache_layout == "paged"
    if paged:
        if slot_mapping is None:
            raise ValueError('cache_layout="paged" needs slot_mapping (each token\'s slot, -1 to skip)')
        if not isinstance(slot_mapping, Tensor) or slot_mapping.dtype not in INT_DTYPES \
                or slot_mapping.device != q.device:
            raise TypeError(f"slot_mapping must be an int32 or int64 tensor on q's device {q.device}")
        if slot_mapping.numel() != B * S or slot_mapping.dim() != (1 if tokens else 2) \
                or (not tokens and tuple(slot_mapping.shape) != (B, S)):
            raise ValueError(f"slot_mapping must have shape {[B * S] if tokens else [B, S]} (one slot per token), "
                             f"got {tuple(slot_mapping.shape)}")
        rows = ckv.shape[0] * ckv.shape[1]
        if _host_values(slot_mapping, args.check_positions):
            lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
            if lo < -1 or hi >= rows:
                raise IndexError(f"slot_mapping must hold slots in [0, {rows}) (num_blocks * block_size) or -1, "
                                 f"got values in [{lo}, {hi}]")
        slot_mapping = slot_mapping.reshape(B, S)
    else:
        if slot_mapping is not None:
            raise ValueError(f'slot_mapping applies to cache_layout="paged" only, got cache_layout={cache_layout!r}')
        if layout == "thd" or args.sections is not None:
            raise ValueError('cache_layout="bshd" writes token (b, s) at row [b, position]: it takes 4-D q or 3-D '
                             'tokens (one per sequence) with 1-D positions; use cache_layout="paged" for packed '
                             "sequences (cu_seqlens) and multi-axis positions")
        if ckv.shape[0] < B:
            raise ValueError(f"kv_cache holds {ckv.shape[0]} sequences, fewer than the {B} written")
        _check_rows(spec, S, ckv.shape[1], args.check_positions)
    scale = _cache_scale(kv_cache_scale, ckv, args.check_positions)
    cache = dict(kv_c=kv_c, ckv_cache=ckv, kpe_cache=kpe, slots=slot_mapping if paged else None, paged=paged,
                 cache_scale=scale)
    return q, k_pe, spec, cache, k_heads, tokens


def _check_rows(spec: RopeSpec, S: int, rows: int, check: bool) -> None:
    """A "bshd" cache holds every row written: each token's position (its row) is below ``rows``."""
    if spec.positions is not None:
        reach = int(spec.positions.max()) if _host_values(spec.positions, check) else None
    elif spec.seq_offsets is not None:
        reach = int(spec.seq_offsets.max()) + S - 1 if _host_values(spec.seq_offsets, check) else None
    else:
        reach = spec.pos_offset + S - 1
    if reach is not None and reach >= rows:
        raise IndexError(f"positions reach {reach} but kv_cache holds {rows} rows per sequence "
                         '(cache_layout="bshd")')


def _setup_context(ctx, inputs, output) -> None:
    q, k_pe, k_heads, split_q, *fields = inputs
    spec = RopeSpec(*fields)
    ctx.save_for_backward(*spec.tensors)
    ctx.scalars = spec.scalars
    ctx.split_q = split_q


def _backward(ctx, grads):
    """The conjugate rotation of the output gradients (``ropekit::rope``): q's through q's spec (its rope columns
    at the back, the others times q_scale), k_pe's summed over the heads it was broadcast to, then rotated back."""
    spec = RopeSpec.from_parts(ctx.saved_tensors, ctx.scalars)._replace(conjugate=True, out_dtype=None)
    *g_q, g_k = grads
    dq = dk = None
    if any(g is not None for g in g_q):
        if ctx.split_q:  # an unused half has no gradient: zeros of its shape
            g_nope, g_pe = g_q
            ref = g_pe if g_pe is not None else g_nope
            if g_nope is None:
                g_nope = ref.new_zeros((*ref.shape[:-1], spec.rotary_start))
            if g_pe is None:
                g_pe = ref.new_zeros((*ref.shape[:-1], spec.rotary_dim))
            g = torch.cat([g_nope, g_pe], -1)
        else:
            g = g_q[0]
        dq = ops.rope(g if g.stride(-1) == 1 else g.contiguous(), None, *spec)[0]
    if g_k is not None:
        g = g_k.sum(-2, keepdim=True) if g_k.shape[-2] > 1 else g_k
        dk = ops.rope(g if g.stride(-1) == 1 else g.contiguous(), None,
                      *spec._replace(rotary_start=0, q_scale=spec.k_scale))[0]
    return dq, dk, None, None, *[None] * len(RopeSpec._fields)


torch.library.register_autograd("ropekit::mla_rope", _backward, setup_context=_setup_context)


def mla_rope_kv_write(
    q: Tensor, k_pe: Tensor, kv_c: Tensor | None = None, *, positions: Positions = None, kv_cache=None,
    slot_mapping: Tensor | None = None, cache_layout: str = "paged", kv_cache_scale=None, split_q: bool = False,
    broadcast_k: bool = False, q_out=None, out_dtype: torch.dtype | None = None, q_out_scale=None,
    k_out_scale=None, cu_seqlens: Tensor | None = None, inv_freq: Tensor | None = None,
    base: float = 10000.0, cos: Tensor | None = None, sin: Tensor | None = None, angles: Tensor | None = None,
    style: str = "neox", q_scale: float = 1.0, k_scale: float = 1.0, rotary_scale: float = 1.0,
    sections: Sequence[int] | None = None, section_layout: str = "contiguous", check_positions: bool = False,
) -> tuple[Tensor, ...]:
    """The MLA attention prologue (DeepSeek V2/V3, Kimi K2, GLM) in one kernel: rotate the rope columns of q and the
    shared key ``k_pe``, write each token's latent cache row ``[kv_c | R(k_pe)]``, return ``(q_out, k_pe_out)``
    (``split_q``: ``(q_nope, q_pe, k_pe_out)``). Inputs are never modified. It is differentiable in q and k_pe
    (the backward is the conjugate rotation), with or without ``kv_cache``; a ``kv_c`` that requires grad raises
    (the cache holds its copy outside autograd). ``torch.compile`` traces it as
    ``ropekit::mla_rope`` / ``ropekit::mla_rope_kv_write``.

    q : Tensor [T, H, D_nope + D_rope] (tokens) or [B, S, H, D_nope + D_rope]
        float16, bfloat16, float32 (float64 on CPU); the rope part is the last D_rope columns (MLA's
        ``[q_nope | q_pe]``); any strides with a contiguous last dim. The q_nope columns pass through (times
        ``q_scale``).
    k_pe : Tensor [T, 1, D_rope] or [T, D_rope] (4-D q: [B, S, 1, D_rope] or [B, S, D_rope])
        The key's rope part, one head shared by all of q's; q's dtype. D_rope even (64 for DeepSeek).
    kv_c : Tensor [T, D_latent] (4-D q: [B, S, D_latent]), with ``kv_cache`` only
        The compressed latent (512 for DeepSeek), copied into the cache bit for bit (float8: ``kv_c / scale``).
    positions : None, int or Tensor
        As :func:`ropekit.apply_rope`'s; 3-D tokens are one per sequence (as :func:`ropekit.rope_kv_write`), so
        their positions are a [T] tensor (an int: the same position for every token), or with ``cu_seqlens`` packed
        sequences whose positions restart in each.
    kv_cache : Tensor or (Tensor, Tensor), optional
        One cache [num_blocks, block_size, D_latent + D_rope] (vLLM's MLA cache: row ``[kv_c | R(k_pe)]``), or two,
        ckv [num_blocks, block_size, D_latent] and kpe [num_blocks, block_size, D_rope] (FlashInfer's paged MLA
        cache); ``cache_layout="bshd"``: [B, max_seq, ..] each, token (b, s) at row [b, its position]. q's dtype or
        ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (stored = value / ``kv_cache_scale``, rounded to nearest
        even and saturated to the format's largest finite value, +-448 or +-57344).
    slot_mapping : Tensor, optional
        int32/int64 [T] (4-D q: [B, S]) slots (= block * block_size + offset; -1 skips the token); required for
        ``cache_layout="paged"``.
    kv_cache_scale : float or 0-d / [1] float tensor, optional
        A float8 cache's per-tensor scale (default 1.0); a device tensor keeps the call capturable in a CUDA graph.
    split_q : bool
        Return q as two tensors, ``q_nope`` [.., H, D_nope] and ``q_pe`` [.., H, D_rope] (the rotated part).
    broadcast_k : bool
        ``k_pe_out`` with one copy of the rotated key per head of q, [.., H, D_rope] (else k_pe's own shape).
    q_out : Tensor or (Tensor | None, Tensor | None), optional
        Where to write q's output instead of a new tensor: [.., H, D_nope + D_rope], or with ``split_q`` a pair
        (q_nope_out [.., H, D_nope], q_pe_out [.., H, D_rope]), e.g. the q_pe columns of the buffer the attention
        reads; any strides with a contiguous last dim, the outputs' dtype, sharing no memory with the inputs or
        caches. Returned as given. Inference only (raises where autograd would need gradients).
    out_dtype : None, torch.float8_e4m3fn or torch.float8_e5m2
        float8 q and k_pe outputs for FP8 attention (FlashInfer's ``mla_rope_quantize_fp8``): ``value /
        q_out_scale`` (``k_out_scale`` for k_pe), rounded to nearest even and saturated to the format's largest
        finite value. Inference only.
    q_out_scale, k_out_scale : float or 0-d / [1] float tensor, optional
        The float8 outputs' per-tensor scales (default 1.0); device tensors keep the call capturable in a CUDA graph.

    Every other keyword is :func:`ropekit.apply_rope`'s (frequencies, ``style``: DeepSeek pairs interleaved
    columns, ``style="interleaved"``; scales; multi-axis positions). Slots outside the cache raise
    ``IndexError`` where their values are on the host (CPU tensors, or ``check_positions=True``: one sync); on the
    GPU such tokens write nothing. Raises ``TypeError``/``ValueError``/``IndexError`` naming the argument; nothing
    is written when it raises.

    >>> q_nope, q_pe, k_pe_rot = ropekit.mla_rope_kv_write(
    ...     q, k_pe, kv_c, positions=positions, kv_cache=kv_cache, slot_mapping=slot_mapping,
    ...     split_q=True, style="interleaved", inv_freq=inv_freq)
    """
    args = RopeArgs(inv_freq=inv_freq, base=base, cos=cos, sin=sin, angles=angles, style=style,
                    q_scale=q_scale, k_scale=k_scale, rotary_scale=rotary_scale, sections=sections,
                    section_layout=section_layout, check_positions=check_positions)
    q_shape = q.shape if isinstance(q, Tensor) else None
    q4, k4, spec, cache, k_heads, tokens = _validate(q, k_pe, kv_c, positions, kv_cache, slot_mapping, cache_layout,
                                                     kv_cache_scale, cu_seqlens, broadcast_k, args)
    grad = torch.is_grad_enabled() and (q.requires_grad or k_pe.requires_grad)
    if cache is not None and torch.is_grad_enabled() and kv_c.requires_grad:
        raise RuntimeError("kv_c requires grad, but it is only copied into kv_cache, which autograd does not track: "
                           "its gradient would be lost; pass kv_c.detach(), or call under torch.no_grad()")
    out_scales = _out_scales(out_dtype, q_out_scale, k_out_scale, q, grad, args.check_positions)
    spec = spec._replace(out_dtype=out_dtype)
    given = _check_q_out(q_out, q, k_pe, kv_c, cache, split_q, spec.rotary_dim, grad, out_dtype or q.dtype)
    writes = cache is not None or any(g is not None for g in given) or out_dtype is not None
    # Eager calls run the ops' bodies without the dispatcher, whose round trips cost more host time than a decode
    # kernel; traced calls (and gradients, through the registered formula) go through the ops.
    traced = torch.compiler.is_compiling()
    if writes:
        c = cache or dict(kv_c=None, ckv_cache=None, kpe_cache=None, slots=None, paged=True, cache_scale=1.0)
        q_outs = tuple(g.unsqueeze(1) if g is not None and q4.dim() == q.dim() + 1 else g for g in given)
        with torch.no_grad() if grad else contextlib.nullcontext():
            if traced:
                scale_t, scale_f = ((c["cache_scale"], 1.0) if isinstance(c["cache_scale"], Tensor)
                                    else (None, c["cache_scale"]))
                outs_t, outs_f = ((out_scales, (1.0, 1.0)) if isinstance(out_scales[0], Tensor)
                                  else ((None, None), out_scales))
                outs = ops.mla_rope_kv_write(q4, k4, c["kv_c"], c["ckv_cache"], c["kpe_cache"], *q_outs,
                                             c["slots"], c["paged"], scale_t, scale_f, *outs_t, *outs_f, k_heads,
                                             split_q, *spec)
                outs = list(outs) if split_q else [outs[0], outs[2]]
                for i, g in enumerate(q_outs[:len(outs) - 1]):
                    if g is not None:
                        outs[i] = g  # written in place; the op returned an empty stand-in
            else:
                outs = ops.mla_rotate(q4, k4, k_heads, split_q, spec, q_outs, **c, out_scales=out_scales)
    if grad or (traced and not writes):
        outs = ops.mla_rope(q4, k4, k_heads, split_q, *spec)
    elif not writes:
        outs = ops.mla_rotate(q4, k4, k_heads, split_q, spec)
    if tokens and spec.layout == "bshd":  # [T, 1, ...] back to [T, ...]
        outs = [o.squeeze(1) for o in outs]
    if k_pe.dim() == len(q_shape) - 1 and k_heads == 1:
        outs[-1] = outs[-1].squeeze(-2)
    for i, g in enumerate(given[:len(outs) - 1]):
        if g is not None:
            outs[i] = g  # the caller's own tensor, written
    return tuple(outs)


def _out_scales(out_dtype, q_out_scale, k_out_scale, q: Tensor, grad: bool, check: bool) -> tuple:
    """(q's, k's) float8 output scales as the kernel takes them: two floats, or two float32 0-d tensors."""
    if out_dtype is None:
        for name, value in (("q_out_scale", q_out_scale), ("k_out_scale", k_out_scale)):
            if value is not None:
                raise ValueError(f"{name} applies to float8 outputs only (out_dtype=torch.float8_e4m3fn or "
                                 "torch.float8_e5m2)")
        return (1.0, 1.0)
    if out_dtype not in FP8_CACHES:
        raise TypeError(f"out_dtype must be None, torch.float8_e4m3fn or torch.float8_e5m2, got {out_dtype!r}")
    if grad:
        raise RuntimeError("float8 outputs are not differentiable: call under torch.no_grad() or "
                           "torch.inference_mode(), or leave out_dtype None for training")
    scales = []
    for name, value in (("q_out_scale", q_out_scale), ("k_out_scale", k_out_scale)):
        if isinstance(value, Tensor):
            if value.shape not in ((), (1,)) or not value.dtype.is_floating_point or value.device != q.device:
                raise ValueError(f"{name} must be a float or a floating tensor of shape [] or [1] on q's device "
                                 f"{q.device}, got shape {tuple(value.shape)} {value.dtype} on {value.device}")
            if _host_values(value, check) and not bool((torch.isfinite(value) & (value > 0)).all()):
                raise ValueError(f"{name} must be finite and > 0, got {value.tolist()!r}")
            value = value.to(torch.float32).reshape(())
        elif value is None:
            value = 1.0
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < float(value) < float("inf"):
            raise ValueError(f"{name} must be a finite float > 0, got {value!r}")
        scales.append(value if isinstance(value, Tensor) else float(value))
    if isinstance(scales[0], Tensor) != isinstance(scales[1], Tensor):  # the kernel reads both or neither
        scales = [s if isinstance(s, Tensor) else torch.full((), s, dtype=torch.float32, device=q.device)
                  for s in scales]
    return tuple(scales)


def _check_q_out(q_out, q: Tensor, k_pe: Tensor, kv_c, cache, split_q: bool, rope: int, grad: bool,
                 dtype: torch.dtype) -> tuple:
    """(q_nope_out, q_pe_out) -- the whole q's output in the first slot without ``split_q`` -- each a checked
    tensor or None."""
    if q_out is None:
        return (None, None)
    if split_q:
        if not isinstance(q_out, (tuple, list)) or len(q_out) != 2:
            raise TypeError("with split_q=True, q_out must be a pair (q_nope_out, q_pe_out), each a tensor or None, "
                            f"got {type(q_out).__name__}")
        given = [(f"q_out[{i}]", t, (*q.shape[:-1], width)) for i, (t, width) in
                 enumerate(zip(q_out, (q.shape[-1] - rope, rope)))]
    else:
        given = [("q_out", q_out, tuple(q.shape))]
    if grad:
        raise RuntimeError("q_out is written in place, outside autograd: call under torch.no_grad() or "
                           "torch.inference_mode(), or leave q_out None for training")
    inputs = [("q", q), ("k_pe", k_pe), ("kv_c", kv_c)]
    if cache is not None:
        inputs += [("kv_cache", cache["ckv_cache"]), ("kv_cache", cache["kpe_cache"])]
    checked = []
    for name, t, shape in given:
        if t is None:
            checked.append(None)
            continue
        if not isinstance(t, Tensor) or t.dtype != dtype:
            raise TypeError(f"{name} must be a tensor of the outputs' dtype {dtype}, got "
                            f"{t.dtype if isinstance(t, Tensor) else type(t).__name__}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {tuple(t.shape)}")
        if not torch.compiler.is_compiling():
            if has_internal_overlap(t):
                raise ValueError(f"{name} reaches an element twice through its strides: it cannot be written")
            for other_name, other in inputs + [(n, c) for n, c, _ in given if c is not None and c is not t]:
                if isinstance(other, Tensor) and overlap(t, other):
                    raise ValueError(f"{name} and {other_name} share memory: pass an output outside the inputs, "
                                     "the caches and the other output")
        checked.append(t)
    return tuple(checked) if split_q else (checked[0], None)
