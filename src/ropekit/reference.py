"""Readable float64 reference for every ropekit rotation, and ropekit's CPU path.

Everything here is plain torch, computed in float64 and rounded once to the output dtype. The kernels never import
this module; tests compare them against it.

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

import functools
import math
from collections.abc import Sequence

import torch

from ropekit._spec import FP8_MAX, MAX_POSITION, CacheSpec, RopeSpec, pair_axis_map, to_canonical


def token_positions(
    batch: int,
    seqlen: int,
    *,
    positions: torch.Tensor | None = None,
    seq_offsets: torch.Tensor | None = None,
    pos_offset: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The position of every token of the canonical [B, S] grid, int64 on ``device``.

    ``positions`` [B, S] per-token ids win; else ``cu_seqlens`` (varlen, B == 1, S == total tokens): the position
    is the token's index inside its sequence plus ``seq_offsets[seq]`` or ``pos_offset``; else ``s`` plus
    ``seq_offsets[b]`` or ``pos_offset``. Tokens outside every sequence of ``cu_seqlens`` get -1 (invalid).
    """
    if positions is not None and positions.dim() == 3:  # multi-axis: [A, B, S], one row of ids per axis
        return positions.to(device=device, dtype=torch.int64).expand(-1, batch, seqlen)
    if positions is not None:
        return positions.to(device=device, dtype=torch.int64).reshape(batch, seqlen)
    base = torch.arange(seqlen, dtype=torch.int64, device=device)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        seq = torch.searchsorted(cu[1:], base, right=True)  # sequence index of every token
        inside = (base >= cu[0]) & (base < cu[-1])
        seq = seq.clamp(max=cu.numel() - 2)
        offset = seq_offsets.to(device=device, dtype=torch.int64)[seq] if seq_offsets is not None else pos_offset
        pos = base - cu[seq] + offset
        return torch.where(inside, pos, torch.full_like(pos, -1)).reshape(1, seqlen)
    if seq_offsets is not None:
        return base[None, :] + seq_offsets.to(device=device, dtype=torch.int64)[:, None]
    return (base + pos_offset).expand(batch, seqlen)


def reduced_angle(angle: torch.Tensor) -> torch.Tensor:
    """``angle`` (float64) reduced to [-pi, pi]; exact enough for any position below 2**40."""
    return torch.remainder(angle + math.pi, 2 * math.pi) - math.pi


def rotation_tables(
    pos: torch.Tensor,
    *,
    half: int,
    neox: bool,
    freq_mode: str,
    inv_freq: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    table_by_token: bool = False,
    sections: Sequence[int] | None = None,
    section_layout: str = "contiguous",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``(cos_lo, cos_hi, sin_lo, sin_hi)``, each float64 [B, S, R/2].

    Multi-axis positions ``pos`` [A, B, S] (``freq_mode="inv_freq"``, ``sections`` pairs per axis): pair i turns
    by ``pos[axis[i]] * inv_freq[i]``, ``axis = pair_axis_map(sections, section_layout)``.

    ``freq_mode``: ``"inv_freq"`` (angle = pos * inv_freq[i]), ``"table"`` (cos/sin rows), ``"angles"`` (raw angle
    rows in ``cos``). Tables are 3-D [Bt, rows, W] with Bt in {1, B} and W in {R/2, R}; rows are positions, or
    tokens ``s`` when ``table_by_token``.
    """
    B, S = pos.shape[-2:]
    if freq_mode == "inv_freq":
        angle = pos.to(torch.float64)[..., None] * inv_freq.to(device=pos.device, dtype=torch.float64)
        if pos.dim() == 3:  # [A, B, S, R/2]: each pair takes its axis
            axis = torch.tensor(pair_axis_map(tuple(sections), section_layout), device=pos.device)
            angle = angle.gather(0, axis.expand(1, B, S, -1))[0]
        angle = reduced_angle(angle)
        c, s = torch.cos(angle), torch.sin(angle)
        return c, c, s, s

    def rows(table: torch.Tensor) -> torch.Tensor:  # [B, S, W] gathered per token
        table = table.to(device=pos.device, dtype=torch.float64).expand(B, -1, -1)
        if table_by_token:
            return table[:, :S]
        return torch.gather(table, 1, pos.clamp(0, table.shape[1] - 1)[..., None].expand(B, S, table.shape[-1]))

    def halves(full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if full.shape[-1] == half:
            return full, full
        return (full[..., :half], full[..., half:]) if neox else (full[..., 0::2], full[..., 1::2])

    if freq_mode == "angles":
        a_lo, a_hi = halves(rows(cos))
        return torch.cos(a_lo), torch.cos(a_hi), torch.sin(a_lo), torch.sin(a_hi)
    c_lo, c_hi = halves(rows(cos))
    s_lo, s_hi = halves(rows(sin))
    return c_lo, c_hi, s_lo, s_hi


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


def rope_float32(q: torch.Tensor, k: torch.Tensor | None, spec: RopeSpec) -> list[torch.Tensor]:
    """The rotation of :func:`rope_reference` with float32 math, into new tensors (in q's and k's layout and shape;
    ``spec.out_dtype``, None: each input's dtype); see :func:`rope_float32_into`."""
    outs = []
    for x in (q, k):
        if x is not None:
            outs.append(torch.empty(x.shape, dtype=x.dtype if spec.out_dtype is None else spec.out_dtype,
                                    device=x.device))
    rope_float32_into(q, k, outs[0], outs[1] if k is not None else None, spec)
    return outs


# Elements of one tensor rotated per step of :func:`_rotate_float32`: the step's float32 working copy (1 MiB) and
# its half-width temporary stay in the cache between the few elementwise ops of the step, and a step still has
# enough elements for torch to split it over threads.
_CHUNK_ELEMENTS = 1 << 18


def rope_float32_into(q: torch.Tensor, k: torch.Tensor | None, q_out: torch.Tensor, k_out: torch.Tensor | None,
                      spec: RopeSpec) -> None:
    """Rotate ``q`` (and ``k``) as ``spec`` says into ``q_out`` (and ``k_out``) -- which may be the inputs
    themselves (in place) -- with float32 math: the CPU path for float16/bfloat16/float32 tensors, and the path of
    devices without Triton kernels or float64 (MPS, XPU, ...).

    Positions and angles are formed in float64 on the CPU, once per call at the size of positions x frequencies
    (one row for all sequences when they share their positions; exact at any position; reading device positions
    is a host sync), and their cos/sin rounded to float32 tables with the rotation's scales folded in.
    The rotation then runs on the tensors' device in float32 torch ops, a block of tokens at a time, with one
    rounding to the output's dtype: the kernels' precision. ``q``/``k`` [in ``spec.layout``] of any strides;
    outputs of the inputs' shapes, any floating dtype (``spec.out_dtype`` is not read: the outputs' dtypes are
    the rotation's). Tokens without a valid position come out NaN, as on the kernels."""
    layout = spec.layout
    B, S = to_canonical(q, layout).shape[:2]
    neox = spec.style == "neox"
    pos, valid = _float32_path_positions(spec, B, S)
    if spec.freq_mode == "inv_freq" and pos.dim() == 2:
        # rotation_tables' angles, without reduced_angle: its fmod by the float64 2*pi is off by up to 2e-7 near
        # position 2**31 (and slow), while torch's float64 cos/sin are accurate at any such angle
        angle = torch.mul(pos.unsqueeze(-1), spec.inv_freq.to(device=pos.device, dtype=torch.float64))
        cosine, sine = torch.cos(angle), torch.sin(angle)
        tables = (cosine, cosine, sine, sine)
    else:
        tables = rotation_tables(pos, half=spec.rotary_dim // 2, neox=neox, freq_mode=spec.freq_mode,
                                 inv_freq=spec.inv_freq, cos=spec.cos, sin=spec.sin,
                                 table_by_token=spec.table_by_token, sections=spec.sections,
                                 section_layout=spec.section_layout)
    if valid is not None:  # NaN cos/sin make the token's rotated columns NaN; its other columns by ``passed`` below
        tables = tuple(torch.where(valid[..., None], t, math.nan) for t in tables)
    device, D = q.device, q.shape[-1]
    made: dict[float, tuple] = {}  # q and k share their tables when their scales agree
    for x, out, scale in ((q, q_out, spec.q_scale), (k, k_out, spec.k_scale)):
        if x is None:
            continue
        if scale not in made:
            passed = scale if valid is None else torch.where(valid, scale, math.nan)[:, :, None, None]
            made[scale] = _float32_tables(tables, scale * spec.rotary_scale, spec.conjugate, passed, D,
                                          spec.rotary_start, spec.rotary_dim, neox, device)
        _rotate_float32(to_canonical(x, layout), to_canonical(out, layout), made[scale], spec.rotary_start,
                        spec.rotary_dim, neox, inplace=out is x)


def _float32_path_positions(spec: RopeSpec, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(int64 CPU positions of the canonical grid -- one row for all sequences when they share their positions
    and frequencies -- and None when every position is usable, else the per-token validity mask). An offset's
    range is known without a tensor op, a position tensor's is read by one aminmax; the mask is built only
    when some position is negative or past ``MAX_POSITION`` or a position-indexed table."""
    rows = None if spec.freq_mode == "inv_freq" or spec.table_by_token else spec.cos.shape[1]
    tables_by_sequence = spec.freq_mode != "inv_freq" and spec.cos.shape[0] != 1
    if spec.positions is None and spec.seq_offsets is None and spec.cu_seqlens is None:  # 0.. S-1 plus an offset
        first = spec.pos_offset
        pos = torch.arange(first, first + S, dtype=torch.int64)[None]
        pos = pos.expand(B, S) if tables_by_sequence else pos
        last = first + S - 1
        if S == 0 or (first >= 0 and last <= MAX_POSITION and (rows is None or last < rows)):
            return pos, None
    else:
        pos = token_positions(B, S, positions=spec.positions, seq_offsets=spec.seq_offsets,
                              pos_offset=spec.pos_offset, cu_seqlens=spec.cu_seqlens, device=torch.device("cpu"))
        if pos.dim() == 2 and pos.shape[0] > 1 and pos.stride(0) == 0 and not tables_by_sequence:
            pos = pos[:1]  # every sequence has the same positions and frequencies: one row of angles serves all
        if pos.numel() == 0:
            return pos, None
        lo, hi = (int(v) for v in torch.aminmax(pos))
        if lo >= 0 and hi <= MAX_POSITION and (rows is None or hi < rows):
            return pos, None
    valid = (pos >= 0) & (pos <= MAX_POSITION)
    if pos.dim() == 3:  # multi-axis: a token is valid when every axis is
        valid = valid.all(0)
    if rows is not None:
        valid &= pos < rows
    return pos, valid


# Tokens up to which :func:`_float32_tables` builds both tables in one product.
_ONE_PRODUCT_ROWS = 1024


@functools.lru_cache(maxsize=64)
def _table_factors(factor: float, conjugate: bool, neox: bool) -> torch.Tensor:
    """float64 factors of ``(cos, sin)`` into ``(C, T)`` per pair column (lo, hi): C ``(factor, factor)``, T
    ``(-factor, +factor)`` forward, ``(+factor, -factor)`` for the conjugate; [2, 2, 1] for ``neox`` (columns in
    halves), else [2, 1, 2]. A constant of its arguments, never written."""
    sines = [factor, -factor] if conjugate else [-factor, factor]
    factors = torch.tensor([[factor, factor], sines], dtype=torch.float64)
    return factors[:, :, None] if neox else factors[:, None, :]


def _paired(y: torch.Tensor, neox: bool) -> torch.Tensor:
    """``y``'s last dim [R] as pairs: [..., 2, R/2] (``neox``: lo half, hi half) or [..., R/2, 2] (interleaved)."""
    half = y.shape[-1] // 2
    return y.unflatten(-1, (2, half) if neox else (half, 2))


def _float32_tables(tables: tuple, factor: float, conjugate: bool, passed, D: int, rotary_start: int,
                    rotary_dim: int, neox: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 tables ``(C, T)`` of :func:`_rotate_float32` from the float64 ``(cos_lo, cos_hi, sin_lo,
    sin_hi)`` [Bt, S, R/2], each value rounded once with ``factor`` (the tensor's scale times ``rotary_scale``)
    folded in. ``C`` [Bt, S, 1, D] holds ``cos * factor`` at the rotary columns and ``passed`` (the scale, or
    [Bt, S, 1, 1] with NaN for invalid tokens) at the others. ``T`` [Bt, S, 1, R] holds each rotary column's
    signed sine: with ``swap(x)`` exchanging the lo and hi column of every pair, the rotation is
    ``x * C + swap(x) * T`` on the rotary columns: ``T = (-sin_lo, +sin_hi) * factor`` forward,
    ``(+sin_hi, -sin_lo) * factor`` for the conjugate (the transpose)."""
    c_lo, c_hi, s_lo, s_hi = tables
    Bt, S, half = c_lo.shape
    if c_lo is c_hi and s_lo is s_hi and rotary_dim == D and Bt * S <= _ONE_PRODUCT_ROWS:
        # one product rounds both tables: fewest ops for decode's few tokens (torch's float64 -> float32 store
        # in a product is slower per element than a copy, so many tokens take the copy and a half-size product)
        both = torch.empty(Bt, S, 1, 2, D, dtype=torch.float32, device=device)  # [.., (C, T), D]
        cos_sin = torch.stack((c_lo, s_lo), 2)  # [Bt, S, (cos, sin), R/2], float64
        if neox:  # [.., (C, T), (lo, hi), R/2]
            cos_sin, out = cos_sin.view(Bt, S, 1, 2, 1, half), both.view(Bt, S, 1, 2, 2, half)
        else:  # [.., (C, T), R/2, (lo, hi)]
            cos_sin, out = cos_sin.view(Bt, S, 1, 2, half, 1), both.view(Bt, S, 1, 2, half, 2)
        torch.mul(cos_sin, _table_factors(float(factor), conjugate, neox).to(device), out=out)
        return both.select(3, 0), both.select(3, 1)
    C = torch.empty(Bt, S, 1, D, dtype=torch.float32, device=device)
    T = torch.empty(Bt, S, 1, rotary_dim, dtype=torch.float32, device=device)
    axis = -2 if neox else -1  # the pair axis of _paired's views
    cp = _paired(C if rotary_dim == D else C.narrow(-1, rotary_start, rotary_dim), neox)
    tp = _paired(T, neox)
    # Each copy or product computes in float64 and rounds once into the float32 table.
    cosines = ((cp, c_lo.unsqueeze(2).unsqueeze(axis)),) if c_lo is c_hi else (
        (cp.select(axis, 0), c_lo[:, :, None, :]), (cp.select(axis, 1), c_hi[:, :, None, :]))
    for dst, src in cosines:
        if factor == 1.0:
            dst.copy_(src)
        else:
            torch.mul(src.expand(dst.shape), factor, out=dst)
    if s_lo is s_hi:  # the positive column rounded once (a copy, or a half-size product), the other its negation
        positive, negative = tp.unbind(axis) if conjugate else tp.unbind(axis)[::-1]
        if factor == 1.0:
            positive.copy_(s_lo[:, :, None, :])
        else:
            torch.mul(s_lo[:, :, None, :], factor, out=positive)
        torch.neg(positive, out=negative)  # exact
    else:  # T's lo column takes the pair's hi sine for the conjugate, its lo sine forward
        sines = ((s_hi, factor), (s_lo, -factor)) if conjugate else ((s_lo, -factor), (s_hi, factor))
        for i, (src, signed) in enumerate(sines):
            dst = tp.select(axis, i)
            torch.mul(src[:, :, None, :].expand(dst.shape), signed, out=dst)
    for cols in (slice(0, rotary_start), slice(rotary_start + rotary_dim, D)):
        if cols.start < cols.stop:
            if isinstance(passed, torch.Tensor):
                C[..., cols].copy_(passed.to(device))
            else:
                C[..., cols].fill_(passed)
    return C, T


def _swapped(x: torch.Tensor, neox: bool) -> torch.Tensor:
    """A new tensor of ``x``'s rotary columns [..., R] with the lo and hi column of every pair exchanged."""
    if neox:
        return torch.roll(x, x.shape[-1] // 2, -1)
    return _paired(x, False).flip(-1).flatten(-2)


def _rotate_float32(x: torch.Tensor, out: torch.Tensor, tables: tuple, rotary_start: int, rotary_dim: int,
                    neox: bool, *, inplace: bool) -> None:
    """``out = rotate(x)`` on canonical [B, S, H, D] views (``out`` may be ``x``: ``inplace``) in float32 with the
    tables ``(C, T)`` of :func:`_float32_tables`: ``x * C``, plus ``swap(x) * T`` on the rotary columns, then one
    rounding to ``out``'s dtype. A call that fits one block (decode sizes) takes three to five torch ops, so that
    per-call host time stays low; larger calls go a block of tokens at a time through two reused float32 buffers
    (the working copy and the result) that stay in the cache, and float32 out of place writes straight into
    ``out``."""
    C, T = tables
    B, S, H, D = x.shape
    if B * S * H * D <= _CHUNK_ELEMENTS:  # one block: few ops on float32 operands (mixed-dtype ops are slow)
        if S == 0:
            return
        src = x if x.dtype == torch.float32 else x.to(torch.float32)
        swapped = _swapped(src if rotary_dim == D else src.narrow(-1, rotary_start, rotary_dim), neox)
        # the products land in a float32 tensor already at hand (out, or src when it is a copy), so that the call
        # allocates at most two float32 temporaries: fresh memory costs page faults at these sizes
        dst = out if out.dtype == torch.float32 else src if src is not x else torch.empty_like(src)
        torch.mul(src, C, out=dst)  # in place (dst is src, or out is x) is fine: swapped was read already
        (dst if rotary_dim == D else dst.narrow(-1, rotary_start, rotary_dim)).addcmul_(swapped, T)
        if dst is not out:
            out.copy_(dst)  # the one rounding to the output's dtype
        return
    # Blocks of s_step tokens of b_step sequences: all sequences at once unless one token of each is too much.
    s_step = max(1, min(S, _CHUNK_ELEMENTS // (B * H * D)))
    b_step = B if s_step > 1 else max(1, min(B, _CHUNK_ELEMENTS // (H * D)))
    direct = x.dtype == torch.float32 and out.dtype == torch.float32 and not inplace
    copy_in = x.dtype != torch.float32
    work = None if direct else torch.empty(b_step, s_step, H, D, dtype=torch.float32, device=x.device)
    copy = torch.empty(b_step, s_step, H, D, dtype=torch.float32, device=x.device) if copy_in else None
    t_lo, t_hi = _pairs(T, 0, rotary_dim, neox)
    tables = (C, t_lo, t_hi)  # below: the full buffers' pair views, made once (views cost host time)
    copy_pairs = _pairs(copy, rotary_start, rotary_dim, neox) if copy_in else None
    work_pairs = _pairs(work, rotary_start, rotary_dim, neox) if work is not None else None
    for b0 in range(0, B, b_step):
        nb = min(b_step, B - b0)
        for s0 in range(0, S, s_step):
            n = min(s_step, S - s0)
            full = nb == b_step and n == s_step  # the buffers need no narrowing
            xs, os_ = _block(x, b0, nb, s0, n), _block(out, b0, nb, s0, n)
            c, ta, tb = (_block(t, b0 if t.shape[0] > 1 else 0, min(nb, t.shape[0]), s0, n) for t in tables)
            if copy_in:
                xs = (copy if full else _block(copy, 0, nb, 0, n)).copy_(xs)
                lo, hi = copy_pairs if full else _pairs(xs, rotary_start, rotary_dim, neox)
            else:
                lo, hi = _pairs(xs, rotary_start, rotary_dim, neox)
            if direct:
                res = os_
                rlo, rhi = _pairs(res, rotary_start, rotary_dim, neox)
            else:
                res = work if full else _block(work, 0, nb, 0, n)
                rlo, rhi = work_pairs if full else _pairs(res, rotary_start, rotary_dim, neox)
            torch.mul(xs, c, out=res)
            rlo.addcmul_(hi, ta)
            rhi.addcmul_(lo, tb)
            if not direct:
                os_.copy_(res)  # the one rounding to the output's dtype (in place: after the block is read)


def _block(t: torch.Tensor, b0: int, nb: int, s0: int, n: int) -> torch.Tensor:
    """``t[b0:b0 + nb, s0:s0 + n]``, narrowing only the dims the block does not cover whole."""
    t = t if nb == t.shape[0] else t.narrow(0, b0, nb)
    return t if n == t.shape[1] else t.narrow(1, s0, n)


def _pairs(y: torch.Tensor, rotary_start: int, rotary_dim: int, neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) views of the rotary part of ``y``'s last dim: halves for ``neox``, even/odd columns else."""
    half = rotary_dim // 2
    if neox:
        return y.narrow(-1, rotary_start, half), y.narrow(-1, rotary_start + half, half)
    rot = y.narrow(-1, rotary_start, rotary_dim)
    return rot[..., 0::2], rot[..., 1::2]


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
