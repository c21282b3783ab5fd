"""Readable float64 reference for every ropekit rotation (the CPU path of float64 tensors; float16/bfloat16/float32
CPU tensors take :mod:`ropekit.float32_path`).

Everything here is plain torch, computed in float64 and rounded once to the output dtype (positions and angle
tables: :mod:`ropekit._angle_tables`). The kernels never import this module; tests compare them against it.

Conventions (shared with the kernels):

* A head vector of ``head_dim`` D holds a rotated part of ``rotary_dim`` R starting at column ``rotary_start``
  (0, or D - R for ``rotary_at="back"``); the rest passes through.
* Pairs: ``neox`` pairs column i with i + R/2 ("lo" and "hi"); ``interleaved`` pairs 2i with 2i + 1.
* Forward rotation by +theta: ``lo' = lo*cos - hi*sin``, ``hi' = hi*cos + lo*sin``.
* Tables may be full width (R columns, one cos/sin per output column, as transformers' duplicated-halves tables);
  then ``lo' = lo*cos_lo - hi*sin_lo`` and ``hi' = hi*cos_hi + lo*sin_hi``. The conjugate (backward) is the
  transpose: ``lo' = lo*cos_lo + hi*sin_hi``, ``hi' = hi*cos_hi - lo*sin_lo`` -- the rotation by -theta when the
  halves agree.
* The whole output (rotated and pass-through columns) is multiplied by the tensor's scale; cos and sin are
  multiplied by ``rotary_scale`` (transformers' ``attention_scaling``).
"""

from __future__ import annotations

import math

import torch

from ropekit._angle_tables import rotation_tables, token_positions
from ropekit._spec import FP8_MAX, MAX_POSITION, CacheSpec, RopeSpec, to_canonical
from ropekit.float32_path import rope_float32


def rotate(
    x: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    rotary_dim: int,
    rotary_start: int,
    neox: bool,
    scale: float = 1.0,
    rotary_scale: float = 1.0,
    conjugate: bool = False,
    valid: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Rotate canonical ``x`` [B, S, H, D] in ``dtype`` (the tables' dtype: float64 for the reference); returns a
    tensor of ``dtype`` and ``x``'s shape.

    ``valid`` [B, S] marks tokens with a usable position; the others become NaN (the kernels do the same).
    """
    c_lo, c_hi, s_lo, s_hi = (t[:, :, None, :] * rotary_scale for t in tables)
    if conjugate:
        s_lo, s_hi = -s_hi, -s_lo
    y = x.to(dtype).clone()
    rot = y[..., rotary_start : rotary_start + rotary_dim]
    if neox:
        lo, hi = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
    else:
        lo, hi = rot[..., 0::2], rot[..., 1::2]
    new_lo = lo * c_lo - hi * s_lo
    new_hi = hi * c_hi + lo * s_hi
    lo.copy_(new_lo)
    hi.copy_(new_hi)
    y = y * scale
    if valid is not None:
        y = torch.where(valid[:, :, None, None], y, torch.full_like(y, math.nan))
    return y


def rope_reference(q: torch.Tensor, k: torch.Tensor | None, spec: RopeSpec) -> list[torch.Tensor]:
    """The rotation of ``q`` (and ``k``) described by ``spec`` in float64, returned in float64 when
    ``spec.out_dtype`` is float64, else rounded once to ``spec.out_dtype`` (None: each input's dtype)."""
    return _rope_torch(q, k, spec, math_dtype=torch.float64, angle_device=q.device)


def _rope_torch(q, k, spec: RopeSpec, *, math_dtype: torch.dtype, angle_device: torch.device) -> list[torch.Tensor]:
    if math_dtype == torch.float32:  # one float32 path, so that its callers agree bit for bit
        return rope_float32(q, k, spec)
    # fields by name: a new RopeSpec field must not shift these
    positions, seq_offsets, cu_seqlens = spec.positions, spec.seq_offsets, spec.cu_seqlens
    inv_freq, cos, sin, freq_mode = spec.inv_freq, spec.cos, spec.sin, spec.freq_mode
    pos_offset, table_by_token, sections, section_layout = (spec.pos_offset, spec.table_by_token, spec.sections,
                                                            spec.section_layout)
    layout, style, rotary_dim, rotary_start = spec.layout, spec.style, spec.rotary_dim, spec.rotary_start
    q_scale, k_scale, rotary_scale = spec.q_scale, spec.k_scale, spec.rotary_scale
    conjugate, out_dtype = spec.conjugate, spec.out_dtype
    qc = to_canonical(q, layout)
    B, S = qc.shape[:2]
    pos = token_positions(B, S, positions=positions, seq_offsets=seq_offsets, pos_offset=pos_offset,
                          cu_seqlens=cu_seqlens, device=angle_device)
    valid = (pos >= 0) & (pos <= MAX_POSITION)
    if pos.dim() == 3:  # multi-axis: a token is valid when every axis is
        valid = valid.all(0)
    if freq_mode != "inv_freq" and not table_by_token:
        valid &= pos < cos.shape[1]
    neox = style == "neox"
    tables = rotation_tables(pos, half=rotary_dim // 2, neox=neox, freq_mode=freq_mode, inv_freq=inv_freq,
                             cos=cos, sin=sin, table_by_token=table_by_token, sections=sections,
                             section_layout=section_layout)
    tables = tuple(t.to(device=q.device, dtype=math_dtype) for t in tables)
    valid = valid.to(q.device)
    outs = []
    for x, scale in ((q, q_scale), (k, k_scale)):
        if x is None:
            continue
        y = rotate(to_canonical(x, layout), tables, rotary_dim=rotary_dim, rotary_start=rotary_start, neox=neox,
                   scale=scale, rotary_scale=rotary_scale, conjugate=conjugate, valid=valid, dtype=math_dtype)
        dtype = x.dtype if out_dtype is None else out_dtype
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
        to_canonical(out, layout).copy_(y)
        outs.append(out)
    return outs


# --- the attention prologue ---------------------------------------------------------------------------------------

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, weight_offset: float, eps: float,
                       dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Per-head RMSNorm over the last dim in ``dtype`` math: ``x / sqrt(mean(x**2) + eps) * (weight +
    weight_offset)`` (``weight_offset=1``: Gemma's ``1 + w``)."""
    xf = x.to(dtype)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (weight.to(dtype) + weight_offset)



def rms_norm_backward_reference(x: torch.Tensor, weight: torch.Tensor, weight_offset: float, eps: float,
                                grad: torch.Tensor, dtype: torch.dtype = torch.float64) -> tuple:
    """(dx, dweight) of :func:`rms_norm_reference` for the gradient ``grad`` of its output, in ``dtype`` math:
    with ``xh = x * r`` (r = 1 / rms), ``dx = r * (g*w' - xh * mean(g*w'*xh))``, ``dweight = sum(g * xh)``."""
    xf, g = x.to(dtype), grad.to(dtype)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xh = xf * r
    dxh = g * (weight.to(dtype) + weight_offset)
    dx = r * (dxh - xh * (dxh * xh).mean(-1, keepdim=True))
    return dx, (g * xh).reshape(-1, x.shape[-1]).sum(0)

def to_float8(x: torch.Tensor, dtype: torch.dtype, scale=1.0) -> torch.Tensor:
    """``x / scale`` as a float8 ``dtype`` stores it: saturated to the format's largest finite value (+-448 for
    float8_e4m3fn, +-57344 for float8_e5m2), rounded to nearest even; NaN stays NaN. ``scale``: a float or a
    tensor that broadcasts against ``x``."""
    big = FP8_MAX[dtype]
    return (x / scale).clamp(-big, big).to(torch.float32).to(dtype)


def to_float8_dynamic(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` as float8 ``dtype``, float32 scales x.shape[:-1]): each row (last dim) divided by its own scale
    ``max |row| / fp8 max`` (an all-zero row: scale 0, zeros stored)."""
    scale = x.abs().amax(-1, keepdim=True) / FP8_MAX[dtype]
    return to_float8(x, dtype, torch.where(scale > 0, scale, 1.0)), scale.squeeze(-1).to(torch.float32)


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale) -> torch.Tensor:
    """Values [..., H, D] as a cache of ``dtype`` stores them: float8 caches hold ``x / scale`` (:func:`to_float8`;
    ``scale`` a float, a one-element tensor, or per head [H])."""
    if dtype in FP8_MAX:
        if isinstance(scale, torch.Tensor):
            scale = scale.to(x.device, x.dtype).reshape(-1, 1) if scale.numel() > 1 else float(scale)
        return to_float8(x, dtype, scale)
    return x.to(dtype)


def kv_write_reference(q, k, v, q_weight, k_weight, weight_offset: float, eps: float, spec: RopeSpec,
                       cache: CacheSpec, math_dtype: torch.dtype = torch.float64,
                       k_out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`ropekit.rope_kv_write` in ``math_dtype``: writes the normalised (with weights) and rotated k and
    v into ``cache`` and returns the rotated q in q's dtype. q, k, v are 4-D in ``spec.layout``; ``k_out`` (k's
    shape) receives the rotated k too."""
    q_dtype = q.dtype
    if q_weight is not None:
        q, k = (rms_norm_reference(x, w, weight_offset, eps, math_dtype) for x, w in ((q, q_weight), (k, k_weight)))
    rotate_spec = spec._replace(out_dtype=math_dtype)
    angle_device = q.device if math_dtype == torch.float64 else torch.device("cpu")
    q_rot, k_rot = _rope_torch(q, k, rotate_spec, math_dtype=math_dtype, angle_device=angle_device)
    kc = to_canonical(k_rot, spec.layout)
    if k_out is not None:
        k_out.copy_(k_rot)
    vc = to_canonical(v, spec.layout)
    B, S = kc.shape[:2]
    k_view, v_view = cache.views()
    if cache.page_table:
        first, second, ok = _page_table_rows(cache, spec, B, S, q.device)
    elif cache.paged:
        slot = cache.slots.to(torch.int64).reshape(-1)
        # a slot_mapping shorter than the tokens: the rest are padding (slot -1)
        slot = torch.cat([slot, slot.new_full((B * S - slot.numel(),), -1)]).view(B, S)
        ok = (slot >= 0) & (slot < cache.rows)
        first, second = slot // cache.block_size, slot % cache.block_size
    else:
        pos = token_positions(B, S, positions=spec.positions, seq_offsets=spec.seq_offsets,
                              pos_offset=spec.pos_offset, cu_seqlens=spec.cu_seqlens, device=q.device)
        ok = (pos >= 0) & (pos < cache.rows)
        batch = torch.arange(B, device=q.device)[:, None].expand(B, S)
        first = cache.cache_batch[None, :].expand(B, S) if cache.cache_batch is not None else batch
        second = pos
    first, second = first[ok], second[ok]
    k_rows = to_cache(kc[ok], k_view.dtype, cache.k_scale)
    k_view[first, second] = k_rows.reshape(k_rows.shape[0], *k_view.shape[2:])  # "paged_x": [H, D/x, x] per row
    v_rows = vc[ok]
    v_view[first, second] = v_rows if v_view.dtype == v.dtype else to_cache(v_rows.to(math_dtype), v_view.dtype,
                                                                            cache.v_scale)
    return q_rot.to(q_dtype)


def _page_table_rows(cache: CacheSpec, spec: RopeSpec, B: int, S: int, device) -> tuple:
    """(page, row, writes) [B, S] of each token under a page table: token (b, s) of request r at position p goes
    to row p % page_size of page ``kv_indices[kv_indptr[r] + p // page_size]`` if that page is one of r's and p is
    below r's length ``(pages - 1) * page_size + kv_last_page_len[r]``."""
    pos = token_positions(B, S, positions=spec.positions, seq_offsets=spec.seq_offsets, pos_offset=spec.pos_offset,
                          cu_seqlens=spec.cu_seqlens, device=device).to(torch.int64)
    if cache.batch_indices is not None:
        req = cache.batch_indices.to(torch.int64).expand(B, S)
    elif cache.cache_batch is not None:
        req = cache.cache_batch[None, :].expand(B, S)
    else:
        req = torch.arange(B, device=device)[:, None].expand(B, S)
    indptr, last = cache.kv_indptr.to(torch.int64), cache.kv_last_page_len.to(torch.int64)
    indices = torch.cat([cache.kv_indices.to(torch.int64), indptr.new_full((1,), -1)])  # index -1: no page
    requests, page_size = indptr.numel() - 1, cache.block_size
    ok = (req >= 0) & (req < requests) & (pos >= 0)
    r = torch.where(ok, req, 0)
    start, end = indptr[r] if requests else pos, indptr[r + 1] if requests else pos
    pages = end - start
    page_i = torch.where(ok, pos, 0) // page_size
    ok &= (start >= 0) & (end <= indices.numel() - 1) & (page_i < pages)
    ok &= pos < (pages - 1) * page_size + (last[r] if requests else 0)
    page = indices[torch.where(ok, start + page_i, -1)]
    ok &= (page >= 0) & (page < cache.views()[0].shape[0])
    return page, pos % page_size, ok


def _attention_rotation(angles: torch.Tensor, rotary_start: int, rotary_dim: int, neox: bool):
    """(c1, c2, cos, sin): the pairs' columns and their float64 cos/sin [B or 1, S, 1, R/2] from the angle rows."""
    half = rotary_dim // 2
    i = torch.arange(half, device=angles.device)
    c1 = rotary_start + (i if neox else 2 * i)
    c2 = c1 + (half if neox else 1)
    return c1, c2, angles[..., c1].double()[:, :, None, :], angles[..., c2].double()[:, :, None, :]


def _rotate_pairs(x: torch.Tensor, c1, c2, cos, sin, scale: float, inverse: bool = False) -> torch.Tensor:
    """``scale * R(+-theta) x`` in float64 on the pairs' columns; other columns scaled only."""
    x = x.double()
    x1, x2 = x[..., c1], x[..., c2]
    sign = -1.0 if inverse else 1.0
    out = x.clone()
    out[..., c1] = x1 * cos - sign * x2 * sin
    out[..., c2] = x2 * cos + sign * x1 * sin
    return out * scale


def _attention_probs(qr, kr, qk_mult: float, causal: bool, cu_seqlens=None):
    """(P [B, H, S, S], lse [B, H, S]) of base-2 scores ``(qr . kr) * qk_mult`` ([B, H, S, D] inputs); with
    ``cu_seqlens`` (B = 1) a token attends only to tokens of its own packed sequence."""
    s = (qr @ kr.transpose(-1, -2)) * (qk_mult * math.log(2.0))  # natural-log scores
    S = qr.shape[2]
    hidden = torch.zeros(S, S, dtype=torch.bool, device=qr.device)
    if causal:
        hidden |= torch.ones(S, S, dtype=torch.bool, device=qr.device).triu(1)
    if cu_seqlens is not None:
        bounds = cu_seqlens.to(device=qr.device, dtype=torch.int64)
        sequence = torch.searchsorted(bounds[1:], torch.arange(S, device=qr.device), right=True)
        hidden |= sequence[:, None] != sequence[None, :]
    if causal or cu_seqlens is not None:
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]), lse


def rope_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, angles: torch.Tensor,
                             rotary_start: int, rotary_dim: int, neox: bool, q_scale: float, k_scale: float,
                             qk_mult: float, causal: bool, cu_seqlens: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE attention in float64 on canonical [B, S, H, D] tensors, the math of
    :mod:`ropekit.triton.attention_kernels`: ``q_r = q_scale * R q``, ``k_r = k_scale * R k`` with the cosine and
    sine of each pair read from ``angles`` [B or 1, S, D] at the pair's columns; base-2 scores
    ``t = (q_r . k_r) * qk_mult``, causal (top-left) or not, within each packed sequence of ``cu_seqlens``
    (tensors [1, T, H, D]) where given; ``o = softmax_2(t) v`` [B, S, H, Dv] and the natural-log
    ``lse = ln(sum 2**t)`` [B, H, S], both float64."""
    c1, c2, cos, sin = _attention_rotation(angles, rotary_start, rotary_dim, neox)
    group = q.shape[2] // k.shape[2]
    qr = _rotate_pairs(q, c1, c2, cos, sin, q_scale).transpose(1, 2)
    kr = _rotate_pairs(k, c1, c2, cos, sin, k_scale).transpose(1, 2).repeat_interleave(group, dim=1)
    p, lse = _attention_probs(qr, kr, qk_mult, causal, cu_seqlens)
    o = p @ v.double().transpose(1, 2).repeat_interleave(group, dim=1)
    return o.transpose(1, 2), lse


def rope_attention_backward_reference(do, dlse, q, k, v, angles, rotary_start: int, rotary_dim: int, neox: bool,
                                      q_scale: float, k_scale: float, qk_mult: float, causal: bool,
                                      cu_seqlens: torch.Tensor | None = None) -> tuple:
    """(dq, dk, dv) in float64 of :func:`rope_attention_reference` given the gradients of o (``do``, canonical)
    and of lse (``dlse`` or None), written out: ``dS = P * (dP - rowsum(do * o) + dlse)`` on the natural-log
    scores, the rotated gradients ``dS k_r`` and ``dS^T q_r`` times ``ln 2 * qk_mult``, then ``R(-theta)`` and the
    rotation's scale; GQA heads summed into their shared k and v head."""
    c1, c2, cos, sin = _attention_rotation(angles, rotary_start, rotary_dim, neox)
    B, S, HQ, _ = q.shape
    HK = k.shape[2]
    group = HQ // HK
    qr = _rotate_pairs(q, c1, c2, cos, sin, q_scale).transpose(1, 2)
    kr = _rotate_pairs(k, c1, c2, cos, sin, k_scale).transpose(1, 2).repeat_interleave(group, dim=1)
    vv = v.double().transpose(1, 2).repeat_interleave(group, dim=1)
    p, _ = _attention_probs(qr, kr, qk_mult, causal, cu_seqlens)
    g = do.double().transpose(1, 2)
    o = p @ vv
    dp = g @ vv.transpose(-1, -2)
    delta = (g * o).sum(-1)
    if dlse is not None:
        delta = delta - dlse.double()
    ds = p * (dp - delta[..., None]) * (qk_mult * math.log(2.0))
    dqr = (ds @ kr).transpose(1, 2)
    dkr = (ds.transpose(-1, -2) @ qr).view(B, HK, group, S, qr.shape[-1]).sum(2).transpose(1, 2)
    dv = (p.transpose(-1, -2) @ g).view(B, HK, group, S, g.shape[-1]).sum(2).transpose(1, 2)
    dq = _rotate_pairs(dqr, c1, c2, cos, sin, q_scale, inverse=True)
    dk = _rotate_pairs(dkr, c1, c2, cos, sin, k_scale, inverse=True)
    return dq, dk, dv


def mla_reference(q, k_pe, outs: list, spec: RopeSpec, kv_c=None, ckv_cache=None, kpe_cache=None, slots=None,
                  paged: bool = True, cache_scale=1.0, out_scales=(1.0, 1.0),
                  math_dtype: torch.dtype = torch.float64) -> None:
    """:func:`ropekit.mla_rope_kv_write` in ``math_dtype`` (float32: the float32 path of devices without float64,
    angles formed on the host): q's last ``spec.rotary_dim`` columns rotated and the others
    times ``q_scale`` into ``outs`` (``[q_out, k_out]`` or ``[q_nope, q_pe, k_out]``), ``k_pe`` (one head)
    rotated into ``k_out`` (each of its heads), and with ``ckv_cache`` each token's ``[kv_c | R(k_pe)]`` into its
    cache row (``kpe_cache`` None: one cache, the key after the latent columns); float8 outputs hold the values
    divided by ``out_scales`` (q's, k's), as a float8 cache stores them. q, k_pe in ``spec.layout``;
    ``kv_c``, ``slots`` and the caches as the launcher takes them (3-D views)."""
    rot = spec._replace(out_dtype=math_dtype)
    angle_device = q.device if math_dtype == torch.float64 else torch.device("cpu")
    (q_rot,) = _rope_torch(q, None, rot, math_dtype=math_dtype, angle_device=angle_device)
    (k_rot,) = _rope_torch(k_pe, None, rot._replace(rotary_start=0, q_scale=spec.k_scale), math_dtype=math_dtype,
                           angle_device=angle_device)
    R = spec.rotary_dim
    q_parts = [q_rot[..., :-R], q_rot[..., -R:]] if len(outs) == 3 else [q_rot]
    for out, x, scale in (*((o, x, out_scales[0]) for o, x in zip(outs, q_parts)),
                          (outs[-1], k_rot.expand(outs[-1].shape), out_scales[1])):
        out.copy_(to_cache(x, out.dtype, scale) if out.dtype in FP8_MAX else x)
    if ckv_cache is None:
        return
    B, S = to_canonical(k_pe, spec.layout).shape[:2]
    kc = to_canonical(k_rot, spec.layout)[:, :, 0]  # [B, S, R]
    latent = kv_c.reshape(B, S, kv_c.shape[-1])
    if paged:
        rows = ckv_cache.shape[0] * ckv_cache.shape[1]
        slot = slots.to(torch.int64).reshape(B, S)
        ok = (slot >= 0) & (slot < rows)
        first, second = slot // ckv_cache.shape[1], slot % ckv_cache.shape[1]
    else:
        pos = token_positions(B, S, positions=spec.positions, seq_offsets=spec.seq_offsets,
                              pos_offset=spec.pos_offset, cu_seqlens=spec.cu_seqlens, device=q.device)
        ok = (pos >= 0) & (pos < ckv_cache.shape[1])
        first, second = torch.arange(B, device=q.device)[:, None].expand(B, S), pos
    first, second, L = first[ok], second[ok], latent.shape[-1]
    kpe_view = ckv_cache[..., L:] if kpe_cache is None else kpe_cache
    kpe_view[first, second] = to_cache(kc[ok], kpe_view.dtype, cache_scale)
    rows = latent[ok]
    ckv_cache[first, second, :L] = rows if ckv_cache.dtype == rows.dtype else to_cache(rows.to(math_dtype),
                                                                                        ckv_cache.dtype, cache_scale)
