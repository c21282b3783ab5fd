"""The RoPE Triton kernel: one launch rotates Q and K, forward or conjugate (backward).

Work decomposition: a grid of programs, each owning ``BLOCK_T`` consecutive tokens of the canonical [B, S, H, D]
view and one block of heads (grid axis 0: Q head blocks first, then K head blocks; axes 1 and 2: token
blocks), token-major so that the programs sharing a token's cos/sin run together. A program's tile is
[BLOCK_T, BLOCK_H, R/2]: tokens are a tensor dimension (not a loop) so that every load is issued before the first
store -- the compiler cannot move a load above a store that might alias it, and in-place calls do alias. cos/sin
are formed once per token ([BLOCK_T, R/2]) and reused for every head of the block.

Precision: fp32 math on every element, one rounding at the store. In-kernel angles are formed in float64
(``pos * inv_freq`` is exact there for positions below 2**29 with fp32 ``inv_freq``), reduced modulo 2*pi in
float64 and only then handed to fp32 sin/cos, so the angle error does not grow with the position.

Tokens whose position is invalid (negative, past 2**31 - 1 or the table, outside every ``cu_seqlens`` sequence)
get NaN outputs instead of an out-of-bounds read: loud on the device without a host sync. The launcher's callers
raise earlier where the check is cheap.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The modes a launch picks, as constexpr globals (the kernels compare against them; the launchers pass their
# ``.value``).
# Position modes (POS_MODE)
POS_RANGE = tl.constexpr(0)  # s + pos_offset
POS_PER_SEQ = tl.constexpr(1)  # s + seq_offsets[b]
POS_PER_TOKEN = tl.constexpr(2)  # positions[b, s]
POS_VARLEN = tl.constexpr(3)  # t - cu_seqlens[seq] + (seq_offsets[seq] or pos_offset), B == 1

# Frequency sources (FREQ_MODE)
FREQ_INV_FREQ = tl.constexpr(0)  # angle = pos * inv_freq[i], in the kernel
FREQ_TABLE = tl.constexpr(1)  # cos/sin rows
FREQ_ANGLES = tl.constexpr(2)  # raw angle rows (cuDNN's freqs)
# as FREQ_INV_FREQ, the angle reduced in 64-bit integer turns: no float64 (see _angle_turns)
FREQ_INV_FREQ_INT = tl.constexpr(3)

_TWO_PI = tl.constexpr(6.283185307179586)
_TWO_PI_LO = tl.constexpr(2.4492935982947064e-16)  # 2*pi - float64(2*pi)
_INV_TWO_PI = tl.constexpr(0.15915494309189535)
# NaN as its bit pattern: a float NaN global never equals itself, and Triton >= 3.8 refuses a global whose value
# differs between the kernels that use it.
_NAN_BITS = tl.constexpr(0x7FC00000)
# 1 / (2*pi) to 96 bits, as three 32-bit words from the most significant (the WGSL shader's constants).
_INV_TWO_PI_2 = tl.constexpr(0x28BE60DB)
_INV_TWO_PI_1 = tl.constexpr(0x9391054A)
_INV_TWO_PI_0 = tl.constexpr(0x7F09D5F4)
_TWO_PI_OVER_2_64 = tl.constexpr(3.4061215800865545e-19)  # one 2**-64 turn in radians
# Positions past this are invalid (NaN): the angle accuracy is documented up to here (ropekit.reference).
_MAX_POSITION = tl.constexpr(2**31 - 1)


@triton.jit
def _sincos_reduced(angle, FAST_TRIG: tl.constexpr):
    """fp32 (cos, sin) of a float64 angle, reduced to [-pi, pi] in float64 first.

    With ``FAST_TRIG`` (NVIDIA GPUs only: inline PTX; see ``heuristics.fast_trig``) the reduced angle goes to the
    hardware approximations ``cos.approx``/``sin.approx``, whose absolute error on [-pi, pi] is below 2**-20.9
    (~5e-7): within the 2e-6 budget once the reduction is exact, and several times cheaper than the libdevice
    functions, which matters at head_dim 256 and in decode. The interpreter (and other targets, ROCm included)
    use ``tl.cos``/``tl.sin``."""
    two_pi = tl.full([], _TWO_PI, tl.float64)
    two_pi_lo = tl.full([], _TWO_PI_LO, tl.float64)
    inv_two_pi = tl.full([], _INV_TWO_PI, tl.float64)
    turns = tl.floor(angle * inv_two_pi + 0.5)
    r = ((angle - turns * two_pi) - turns * two_pi_lo).to(tl.float32)
    return _cos_sin(r, FAST_TRIG)


@triton.jit
def _cos_sin(r, FAST_TRIG: tl.constexpr):
    """fp32 (cos, sin) of a reduced fp32 angle (|r| <= pi): the hardware approximations with ``FAST_TRIG``."""
    if FAST_TRIG:
        c = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True,
                                      pack=1)
        s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True,
                                      pack=1)
        return c, s
    else:
        return tl.cos(r), tl.sin(r)


@triton.jit
def _turns_per_unit(freq):
    """``freq / (2*pi)`` of fp32 ``freq`` as a 64-bit fraction of a turn (uint64, whole turns dropped): the 24-bit
    significand times the 96 bits of 1/(2*pi), shifted by the exponent, in integer arithmetic (as the WGSL
    shader's ``turns_per_position``). Its error, below 2**-64 turn per unit, stays below 1e-9 rad for positions
    under 2**31. Zero and subnormal frequencies give 0; the sign is the caller's."""
    bits = freq.to(tl.int32, bitcast=True)
    be = ((bits >> 23) & 0xFF).to(tl.int64)
    sig = ((bits & 0x7FFFFF) | 0x800000).to(tl.uint64)
    t2 = sig * tl.full([], _INV_TWO_PI_0, tl.uint64)  # each < 2**56
    t1 = sig * tl.full([], _INV_TWO_PI_1, tl.uint64)
    t0 = sig * tl.full([], _INV_TWO_PI_2, tl.uint64)
    # the 120-bit product as two 64-bit words
    lo = t2 + (t1 << 32)
    hi = t0 + (t1 >> 32) + (lo < t2).to(tl.uint64)
    # freq = sig * 2**(be - 150): the fraction of a turn is the product shifted right by r = 182 - be
    r = 182 - be
    right = tl.minimum(tl.maximum(r, 1), 63).to(tl.uint64)
    mid = (hi << (64 - right)) | (lo >> right)
    high = hi >> (tl.minimum(tl.maximum(r - 64, 0), 63)).to(tl.uint64)
    left = lo << (tl.minimum(tl.maximum(-r, 0), 63)).to(tl.uint64)
    zero = tl.zeros_like(lo)
    g = tl.where(r == 0, lo, tl.where((r > 0) & (r < 64), mid, tl.where((r >= 64) & (r < 128), high, zero)))
    g = tl.where((r < 0) & (r > -64), left, g)
    return tl.where(be == 0, zero, g)


@triton.jit
def _sincos_turns(turns, FAST_TRIG: tl.constexpr):
    """fp32 (cos, sin) of a 64-bit fraction of a turn (uint64): the nearest quarter turn from the top bits, the
    rest (at most an eighth of a turn) as an fp32 angle, then the quarter turns applied exactly."""
    shifted = turns + tl.full([], 1 << 61, tl.uint64)
    quadrant = (shifted >> 62).to(tl.int32)
    rest = (shifted & tl.full([], (1 << 62) - 1, tl.uint64)).to(tl.int64) - (1 << 61)
    c, s = _cos_sin(rest.to(tl.float32) * _TWO_PI_OVER_2_64, FAST_TRIG)
    # + q quarter turns: (c, s) -> (-s, c) -> (-c, -s) -> (s, -c)
    cq = tl.where(quadrant == 0, c, tl.where(quadrant == 1, -s, tl.where(quadrant == 2, -c, s)))
    sq = tl.where(quadrant == 0, s, tl.where(quadrant == 1, c, tl.where(quadrant == 2, -s, -c)))
    return cq, sq


@triton.jit
def _angle_turns(pos, freq):
    """``pos * freq`` as a 64-bit fraction of a turn (uint64): the position (>= 0, < 2**31; broadcast by the
    caller) times the frequency's turns per unit, modulo whole turns -- exact integer arithmetic, so the angle's
    error does not grow with the position and no float64 is needed (GPUs with slow float64)."""
    turns = pos.to(tl.uint64) * _turns_per_unit(freq)
    return tl.where(freq < 0, tl.zeros_like(turns) - turns, turns)


@triton.jit
def _token_positions(
    t, b, s, mask_t, pos_ptr, pos_sb, pos_ss, seq_off_ptr, pos_offset, cu_ptr, n_seqs, n_search_steps,
    POS_MODE: tl.constexpr, HAS_SEQ_OFFSETS: tl.constexpr,
):
    """(pos, valid) of canonical token indices ``t`` = ``b * S + s`` (``b``, ``s`` int64). Tokens outside
    ``mask_t`` (past the last token) read nothing."""
    valid = t == t
    if POS_MODE == POS_RANGE:
        pos = s + pos_offset
    elif POS_MODE == POS_PER_SEQ:
        pos = s + tl.load(seq_off_ptr + b, mask=mask_t, other=0).to(tl.int64)
    elif POS_MODE == POS_PER_TOKEN:
        pos = tl.load(pos_ptr + b * pos_sb + s * pos_ss, mask=mask_t, other=0).to(tl.int64)
    else:  # POS_VARLEN
        # Largest seq with cu[seq] <= t, by a branch-free binary search over the B + 1 boundaries.
        t = t.to(tl.int64)
        lo = tl.zeros_like(t)
        hi = tl.zeros_like(t) + (n_seqs - 1)
        for _ in range(n_search_steps):
            mid = (lo + hi + 1) // 2
            go_right = tl.load(cu_ptr + mid).to(tl.int64) <= t
            active = lo < hi
            lo = tl.where(active & go_right, mid, lo)
            hi = tl.where(active & ~go_right, mid - 1, hi)
        start = tl.load(cu_ptr + lo).to(tl.int64)
        end = tl.load(cu_ptr + n_seqs).to(tl.int64)
        first = tl.load(cu_ptr).to(tl.int64)
        valid = (t >= first) & (t < end)
        if HAS_SEQ_OFFSETS:
            pos = t - start + tl.load(seq_off_ptr + lo).to(tl.int64)
        else:
            pos = t - start + pos_offset
    valid = valid & (pos >= 0) & (pos <= _MAX_POSITION)
    return pos, valid


@triton.jit
def _table_columns(i, HALF: tl.constexpr, NEOX: tl.constexpr, TABLE_FULL: tl.constexpr):
    """Table columns read for the lo and hi element of pair ``i``."""
    if TABLE_FULL:
        if NEOX:
            return i, i + HALF
        else:
            return 2 * i, 2 * i + 1
    else:
        return i, i


@triton.jit
def _mod_axes(i, NUM_AXES: tl.constexpr):
    """``i % NUM_AXES`` for pair indices ``i`` (int32, 0 <= i < 2**15) in int32 multiply-shift form: the compiler
    lowers ``i % 3`` of a small range through 8- and 16-bit arithmetic, about twice the instructions."""
    if NUM_AXES == 3:
        tl.static_assert(i.shape[0] <= 2**15)
        r = i - 3 * ((i * 43691) >> 17)  # 43691 / 2**17 = 1/3 + 2.5e-6: exact quotient below 2**15
    else:
        r = i % NUM_AXES
    return r


@triton.jit
def _pair_axis(i, NUM_AXES: tl.constexpr, AXES_INTERLEAVED: tl.constexpr, AXIS_BOUND_1: tl.constexpr,
               AXIS_BOUND_2: tl.constexpr, AXIS_BOUND_3: tl.constexpr):
    """int32 axis of each pair ``i`` (``ropekit._spec.pair_axis_map``), from compile-time bounds: no load.

    Contiguous: ``AXIS_BOUND_a`` is the first pair of axis a (n_0 + ... + n_{a-1}), and the axis is the number of
    bounds passed. Interleaved: pair i takes axis ``a = i % NUM_AXES`` (a >= 1) while ``i < AXIS_BOUND_a``
    (``NUM_AXES * n_a``), else axis 0. Bounds of axes past ``NUM_AXES`` are never read."""
    if AXES_INTERLEAVED:
        r = _mod_axes(i, NUM_AXES)
        if NUM_AXES == 2 or (AXIS_BOUND_2 == AXIS_BOUND_1 and (NUM_AXES == 3 or AXIS_BOUND_3 == AXIS_BOUND_1)):
            axis = tl.where(i < AXIS_BOUND_1, r, 0)  # one bound for every axis >= 1 (equal sections): one test
        else:
            axis = tl.where((r == 1) & (i < AXIS_BOUND_1), 1, 0)
            if NUM_AXES > 2:
                axis = tl.where((r == 2) & (i < AXIS_BOUND_2), 2, axis)
            if NUM_AXES > 3:
                axis = tl.where((r == 3) & (i < AXIS_BOUND_3), 3, axis)
    else:
        axis = (i >= AXIS_BOUND_1).to(tl.int32)
        if NUM_AXES > 2:
            axis += (i >= AXIS_BOUND_2).to(tl.int32)
        if NUM_AXES > 3:
            axis += (i >= AXIS_BOUND_3).to(tl.int32)
    return axis


@triton.jit
def _axis_valid(a: tl.constexpr, b, s, mask_t, pos_ptr, pos_sa, pos_sb, pos_ss):
    """Tokens whose position on axis ``a`` is valid."""
    p = tl.load(pos_ptr + a * pos_sa + b * pos_sb + s * pos_ss, mask=mask_t, other=0)
    return (p >= 0) & (p <= _MAX_POSITION)


@triton.jit
def _pair_positions(b, s, mask_t, i, pos_ptr, pos_sa, pos_sb, pos_ss, HALF: tl.constexpr, NUM_AXES: tl.constexpr,
                    AXES_INTERLEAVED: tl.constexpr, AXIS_BOUND_1: tl.constexpr, AXIS_BOUND_2: tl.constexpr,
                    AXIS_BOUND_3: tl.constexpr, POS_PER_AXIS: tl.constexpr):
    """Multi-axis positions: int32 [BLOCK_T, HALF_BLOCK] the position of each pair's axis for every token, and
    the tokens whose positions are valid on every axis [BLOCK_T].

    By default each pair's position is loaded from its own axis's row (the compiler merges the loads of a
    thread's pairs that share an axis), not loaded per axis and selected per pair: on larger grids ptxas issued
    the data loads after the selects, which wait for every axis's load, so a program paid the position round
    trip and then the data round trip. The token's validity is then the minimum over its pairs (a reduction off
    the angle path), plus a load for any axis no pair reads (a section of 0 pairs). With ``POS_PER_AXIS`` (small
    multi-axis decode grids, ``heuristics.block_plan``) each axis's position is loaded once a token at
    an address every thread shares, which issues without waiting for the per-pair axis math, and each pair
    selects its own. The position is exact in int32: a valid one is at most 2**31 - 1, and a token invalid on
    any axis is NaN."""
    axis = _pair_axis(i, NUM_AXES, AXES_INTERLEAVED, AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3)[None, :]
    row = b * pos_sb + s * pos_ss
    if POS_PER_AXIS:
        p0 = tl.load(pos_ptr + row, mask=mask_t, other=0)
        valid = (p0 >= 0) & (p0 <= _MAX_POSITION)
        p = tl.broadcast_to(p0.to(tl.int32)[:, None], (p0.shape[0], i.shape[0]))
        for a in tl.static_range(1, NUM_AXES):
            pa = tl.load(pos_ptr + a * pos_sa + row, mask=mask_t, other=0)
            valid = valid & (pa >= 0) & (pa <= _MAX_POSITION)
            p = tl.where(axis == a, pa.to(tl.int32)[:, None], p)
        return p, valid
    # axis * pos_sa in int32 (int64 costs 7% more instructions): ropekit._spec refuses strides where it overflows
    p = tl.load(pos_ptr + axis * pos_sa + row[:, None], mask=mask_t[:, None], other=0)
    # Padded pairs (i >= HALF) read some axis's position too: any axis's invalid position voids the token.
    valid = tl.min(((p >= 0) & (p <= _MAX_POSITION)).to(tl.int32), axis=1) > 0
    # Axes no pair reads (compile-time): contiguous axis a reads pairs [bound_a, bound_{a+1}); interleaved axis
    # a >= 1 reads pairs a, a + A, ... below min(bound_a, HALF), axis 0 always pair 0.
    if AXES_INTERLEAVED:
        if AXIS_BOUND_1 <= 1 or HALF <= 1:
            valid = valid & _axis_valid(1, b, s, mask_t, pos_ptr, pos_sa, pos_sb, pos_ss)
        if NUM_AXES > 2 and (AXIS_BOUND_2 <= 2 or HALF <= 2):
            valid = valid & _axis_valid(2, b, s, mask_t, pos_ptr, pos_sa, pos_sb, pos_ss)
        if NUM_AXES > 3 and (AXIS_BOUND_3 <= 3 or HALF <= 3):
            valid = valid & _axis_valid(3, b, s, mask_t, pos_ptr, pos_sa, pos_sb, pos_ss)
    else:
        if AXIS_BOUND_1 == 0:
            valid = valid & _axis_valid(0, b, s, mask_t, pos_ptr, pos_sa, pos_sb, pos_ss)
        if (NUM_AXES == 2 and HALF == AXIS_BOUND_1) or (NUM_AXES > 2 and AXIS_BOUND_2 == AXIS_BOUND_1):
            valid = valid & _axis_valid(1, b, s, mask_t, pos_ptr, pos_sa, pos_sb, pos_ss)
        if (NUM_AXES == 3 and HALF == AXIS_BOUND_2) or (NUM_AXES > 3 and AXIS_BOUND_3 == AXIS_BOUND_2):
            valid = valid & _axis_valid(2, b, s, mask_t, pos_ptr, pos_sa, pos_sb, pos_ss)
        if NUM_AXES > 3 and HALF == AXIS_BOUND_3:
            valid = valid & _axis_valid(3, b, s, mask_t, pos_ptr, pos_sa, pos_sb, pos_ss)
    return p.to(tl.int32), valid


@triton.jit
def _rotation(
    b, s, pos, valid, mask_t, freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale,
    pos_ptr, pos_sa, pos_sb, pos_ss,
    ROT_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr, NEOX: tl.constexpr, FREQ_MODE: tl.constexpr,
    TABLE_BY_TOKEN: tl.constexpr, TABLE_FULL: tl.constexpr, CONJUGATE: tl.constexpr, FAST_TRIG: tl.constexpr,
    NUM_AXES: tl.constexpr, AXES_INTERLEAVED: tl.constexpr, AXIS_BOUND_1: tl.constexpr,
    AXIS_BOUND_2: tl.constexpr, AXIS_BOUND_3: tl.constexpr, POS_PER_AXIS: tl.constexpr,
):
    """fp32 [BLOCK_T, HALF_BLOCK] (cos_lo, cos_hi, sin_a, sin_b) with ``lo' = lo*cos_lo - hi*sin_a`` and
    ``hi' = hi*cos_hi + lo*sin_b``; invalid tokens get NaN. With ``NUM_AXES`` > 1 (M-RoPE; in-kernel angles only)
    pair i turns by the position of its axis (:func:`_pair_axis`), read here with its validity
    (:func:`_pair_positions`); ``pos`` is not read then."""
    HALF: tl.constexpr = ROT_DIM // 2
    i = tl.arange(0, HALF_BLOCK)
    mask_i = i < HALF
    if FREQ_MODE == FREQ_INV_FREQ_INT:
        inv_freq = tl.load(freq_ptr + i, mask=mask_i, other=0.0)
        if NUM_AXES > 1:
            pair_pos, axes_valid = _pair_positions(b, s, mask_t, i, pos_ptr, pos_sa, pos_sb, pos_ss, HALF, NUM_AXES,
                                                   AXES_INTERLEAVED, AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3,
                                                   POS_PER_AXIS)
            valid = valid & axes_valid
            turns = _angle_turns(pair_pos, inv_freq[None, :])
        else:
            turns = _angle_turns(pos[:, None], inv_freq[None, :])
        c_lo, s_lo = _sincos_turns(turns, FAST_TRIG)
        c_hi = c_lo
        s_hi = s_lo
    elif FREQ_MODE == FREQ_INV_FREQ:
        inv_freq = tl.load(freq_ptr + i, mask=mask_i, other=0.0).to(tl.float64)
        if NUM_AXES > 1:
            pair_pos, axes_valid = _pair_positions(b, s, mask_t, i, pos_ptr, pos_sa, pos_sb, pos_ss, HALF, NUM_AXES,
                                                   AXES_INTERLEAVED, AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3,
                                                   POS_PER_AXIS)
            valid = valid & axes_valid
            angle = pair_pos.to(tl.float64) * inv_freq[None, :]
        else:
            angle = pos.to(tl.float64)[:, None] * inv_freq[None, :]
        c_lo, s_lo = _sincos_reduced(angle, FAST_TRIG)
        c_hi = c_lo
        s_hi = s_lo
    else:  # FREQ_TABLE or FREQ_ANGLES
        if TABLE_BY_TOKEN:
            row = s
        else:
            row = pos
            valid = valid & (pos < table_rows)
        row = tl.where(valid, row, 0)  # invalid rows read row 0, never out of bounds
        base = (b * t_sb + row * t_sr)[:, None]
        m = mask_t[:, None] & mask_i[None, :]
        col_lo, col_hi = _table_columns(i, HALF, NEOX, TABLE_FULL)
        if FREQ_MODE == FREQ_TABLE:
            c_lo = tl.load(cos_ptr + base + col_lo[None, :] * t_sc, mask=m, other=0.0).to(tl.float32)
            s_lo = tl.load(sin_ptr + base + col_lo[None, :] * t_sc, mask=m, other=0.0).to(tl.float32)
            if TABLE_FULL:
                c_hi = tl.load(cos_ptr + base + col_hi[None, :] * t_sc, mask=m, other=0.0).to(tl.float32)
                s_hi = tl.load(sin_ptr + base + col_hi[None, :] * t_sc, mask=m, other=0.0).to(tl.float32)
            else:
                c_hi = c_lo
                s_hi = s_lo
        else:
            a_lo = tl.load(cos_ptr + base + col_lo[None, :] * t_sc, mask=m, other=0.0).to(tl.float64)
            c_lo, s_lo = _sincos_reduced(a_lo, FAST_TRIG)
            if TABLE_FULL:
                a_hi = tl.load(cos_ptr + base + col_hi[None, :] * t_sc, mask=m, other=0.0).to(tl.float64)
                c_hi, s_hi = _sincos_reduced(a_hi, FAST_TRIG)
            else:
                c_hi = c_lo
                s_hi = s_lo
    ok = valid[:, None]
    nan = tl.full([], _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    c_lo = tl.where(ok, c_lo * rotary_scale, nan)
    c_hi = tl.where(ok, c_hi * rotary_scale, nan)
    s_lo = tl.where(ok, s_lo * rotary_scale, nan)
    s_hi = tl.where(ok, s_hi * rotary_scale, nan)
    if CONJUGATE:  # transpose of the forward matrix: rotation by -theta
        return c_lo, c_hi, -s_hi, -s_lo
    else:
        return c_lo, c_hi, s_lo, s_hi


@triton.jit
def _turn(x_lo, x_hi, c_lo, c_hi, s_a, s_b):
    """Pairs [BLOCK_T, BLOCK_H, HALF_BLOCK] turned by a token rotation [BLOCK_T, HALF_BLOCK] (:func:`_rotation`'s
    four factors)."""
    c_lo, c_hi, s_a, s_b = c_lo[:, None, :], c_hi[:, None, :], s_a[:, None, :], s_b[:, None, :]
    return x_lo * c_lo - x_hi * s_a, x_hi * c_hi + x_lo * s_b


@triton.jit
def _token_block(tb, num_tokens, S, BLOCK_T: tl.constexpr):
    """(t, mask_t, b, s) of token block ``tb``: canonical token indices (int32) ``t = b * S + s``, the ones before
    ``num_tokens``, and b, s (int64, for addresses)."""
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    b32 = t // S
    return t, t < num_tokens, b32.to(tl.int64), (t - b32 * S).to(tl.int64)


@triton.jit
def _head_tile(b, s, mask_t, h0, H, x_sb, x_ss, x_sh, BLOCK_H: tl.constexpr):
    """Element offsets of the start of each row [BLOCK_T, BLOCK_H, 1] of a block of heads, and its row mask."""
    h = h0 + tl.arange(0, BLOCK_H)
    m = (mask_t[:, None] & (h < H)[None, :])[:, :, None]
    base = (b * x_sb + s * x_ss)[:, None, None] + (h.to(tl.int64) * x_sh)[None, :, None]
    return base, m


@triton.jit
def _within(m, idx, limit: tl.constexpr, BLOCK: tl.constexpr):
    """``m`` restricted to ``idx < limit``; the extra term only where the block is padded, so that an unpadded
    mask stays constant along the columns and the accesses stay vectorised."""
    if BLOCK != limit:
        m = m & (idx < limit)
    return m


@triton.jit
def _pass_columns(m, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, ROT_START: tl.constexpr,
                  PASS_BLOCK: tl.constexpr):
    """Columns of the pass-through span (the head's columns outside the rotated span), and ``m`` restricted to
    them."""
    p = tl.arange(0, PASS_BLOCK)[None, None, :]
    mp = m & (p < HEAD_DIM - ROT_DIM)
    if ROT_START == 0:
        p = p + ROT_DIM
    return p, mp


FP8_E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def _round_to_e4m3(x):
    """``x`` (fp32, |x| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, in fp32 arithmetic, so
    that the cast after it is exact: the interpreter's own fp32 -> fp8 cast does not round to nearest even
    (compiled kernels' does, and skip this)."""
    bits = x.to(tl.int32, bitcast=True)
    # below 2**-6 the spacing is the subnormals' 2**-9; above 2**8 only NaN or inf remain (|x| <= 448)
    e = tl.minimum(tl.maximum(((bits >> 23) & 0xFF) - 127, -6), 8)
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    big = ulp * 12582912.0  # 1.5 * 2**23 ulps: adding and removing it rounds to a multiple of ulp
    r = (tl.abs(x) + big) - big
    return tl.where(x < 0, -r, r)


# float8_e4m3fn's NaN bits, S.1111.111, as the fp32 value 1.875 * 2**8 whose conversion yields them
FP8_E4M3_NAN_BITS_VALUE = tl.constexpr(480.0)
# float8 kinds (the FP8 constexprs): 0 none, 1 float8_e4m3fn, 2 float8_e5m2
FP8_E4M3 = tl.constexpr(1)
FP8_E5M2 = tl.constexpr(2)
FP8_E5M2_MAX = tl.constexpr(57344.0)


@triton.jit
def _round_to_e5m2(x):
    """``x`` (fp32, |x| <= 57344) rounded to the nearest float8_e5m2 value, ties to even (as :func:`_round_to_e4m3`
    for e4m3): the interpreter's own cast rounds ties up and flushes small subnormals."""
    bits = x.to(tl.int32, bitcast=True)
    # below 2**-14 the spacing is the subnormals' 2**-16
    e = tl.minimum(tl.maximum(((bits >> 23) & 0xFF) - 127, -14), 15)
    ulp = ((e - 2 + 127) << 23).to(tl.float32, bitcast=True)  # 2 mantissa bits
    big = ulp * 12582912.0
    r = (tl.abs(x) + big) - big
    return tl.where(x < 0, -r, r)


@triton.jit
def _fp8_for_interpreter(y, FP8: tl.constexpr, ROUND_FP8: tl.constexpr):
    """``y`` (fp32) made ready for a store into a float8 target of kind ``FP8`` by a plain conversion. float8_e4m3fn
    under the interpreter (``ROUND_FP8``): saturated to +-448, rounded to nearest even, and NaN as a value the
    interpreter's conversion turns into NaN (it turns NaN itself into 384); compiled kernels saturate and convert
    in the store (``_to_store``): ``y`` unchanged. float8_e5m2: saturated to +-57344 (the conversion would give
    inf), and rounded to nearest even under the interpreter; NaN stays NaN."""
    if FP8 == FP8_E4M3 and ROUND_FP8:
        y = tl.where(y > FP8_E4M3_MAX, FP8_E4M3_MAX, tl.where(y < -FP8_E4M3_MAX, -FP8_E4M3_MAX, y))
        y = _round_to_e4m3(y)
        y = tl.where(y != y, FP8_E4M3_NAN_BITS_VALUE, y)
    elif FP8 == FP8_E5M2:
        y = tl.where(y > FP8_E5M2_MAX, FP8_E5M2_MAX, tl.where(y < -FP8_E5M2_MAX, -FP8_E5M2_MAX, y))
        if ROUND_FP8:
            y = _round_to_e5m2(y)
    return y


@triton.jit
def _to_store(y, o_ptr, FP8: tl.constexpr, ROUND_FP8: tl.constexpr):
    """``y`` (fp32) converted for a store into ``o_ptr``: saturated to +-448 first for a float8_e4m3fn target
    (NaN stays NaN)."""
    if FP8:
        y = tl.where(y > FP8_E4M3_MAX, FP8_E4M3_MAX, tl.where(y < -FP8_E4M3_MAX, -FP8_E4M3_MAX, y))
        if ROUND_FP8:
            y = _round_to_e4m3(y)
    return y.to(o_ptr.dtype.element_ty)


@triton.jit
def _load_heads(
    x_ptr, base, m, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, ROT_START: tl.constexpr, NEOX: tl.constexpr,
    HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, COPY_PASS: tl.constexpr, PAD_ZERO: tl.constexpr,
):
    """fp32 (x_lo, x_hi, x_pass) of a block of heads: the pairs' two elements, and the pass-through columns when
    ``COPY_PASS`` (else ``x_lo`` again, unused); zero in padded columns with ``PAD_ZERO`` (a norm sums them),
    undefined there otherwise (nothing reads them)."""
    HALF: tl.constexpr = ROT_DIM // 2
    other = 0.0 if PAD_ZERO else None
    if NEOX:
        i = tl.arange(0, HALF_BLOCK)[None, None, :]
        mi = _within(m, i, HALF, HALF_BLOCK)
        x_lo = tl.load(x_ptr + base + ROT_START + i, mask=mi, other=other).to(tl.float32)
        x_hi = tl.load(x_ptr + base + (ROT_START + HALF) + i, mask=mi, other=other).to(tl.float32)
    else:
        # Load the rotated span contiguously and de-interleave in registers (no stride-2 accesses).
        j = tl.arange(0, 2 * HALF_BLOCK)[None, None, :]
        x = tl.load(x_ptr + base + ROT_START + j, mask=_within(m, j, ROT_DIM, 2 * HALF_BLOCK),
                    other=other).to(tl.float32)
        x_lo, x_hi = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], HALF_BLOCK, 2]))
    if COPY_PASS:
        p, mp = _pass_columns(m, HEAD_DIM, ROT_DIM, ROT_START, PASS_BLOCK)
        x_p = tl.load(x_ptr + base + p, mask=mp, other=other).to(tl.float32)
    else:
        x_p = x_lo
    return x_lo, x_hi, x_p


@triton.jit
def _store_pairs(
    o_ptr, base, m, y_lo, y_hi, y_p,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, ROT_START: tl.constexpr, NEOX: tl.constexpr,
    HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, COPY_PASS: tl.constexpr, FP8: tl.constexpr,
    ROUND_FP8: tl.constexpr,
):
    """Store a block of heads' rotated pairs (fp32 [BLOCK_T, BLOCK_H, HALF_BLOCK]) and, with ``COPY_PASS``, its
    pass-through columns ``y_p``, converted by :func:`_to_store` (float8 targets saturate)."""
    HALF: tl.constexpr = ROT_DIM // 2
    if NEOX:
        i = tl.arange(0, HALF_BLOCK)[None, None, :]
        mi = _within(m, i, HALF, HALF_BLOCK)
        tl.store(o_ptr + base + ROT_START + i, _to_store(y_lo, o_ptr, FP8, ROUND_FP8), mask=mi)
        tl.store(o_ptr + base + (ROT_START + HALF) + i, _to_store(y_hi, o_ptr, FP8, ROUND_FP8), mask=mi)
    else:
        j = tl.arange(0, 2 * HALF_BLOCK)[None, None, :]
        y = tl.reshape(tl.join(y_lo, y_hi), [y_lo.shape[0], y_lo.shape[1], 2 * HALF_BLOCK])
        tl.store(o_ptr + base + ROT_START + j, _to_store(y, o_ptr, FP8, ROUND_FP8),
                 mask=_within(m, j, ROT_DIM, 2 * HALF_BLOCK))
    if COPY_PASS:
        p, mp = _pass_columns(m, HEAD_DIM, ROT_DIM, ROT_START, PASS_BLOCK)
        tl.store(o_ptr + base + p, _to_store(y_p, o_ptr, FP8, ROUND_FP8), mask=mp)


@triton.jit
def _row_amax(y_lo, y_hi, y_p, ROT_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_START: tl.constexpr,
              HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, HAS_PASS: tl.constexpr):
    """max |y| over each head row [BLOCK_T, BLOCK_H] (padded columns excluded): a max, exact in any order."""
    i = tl.arange(0, HALF_BLOCK)[None, None, :]
    a = tl.maximum(tl.max(tl.where(i < ROT_DIM // 2, tl.abs(y_lo), 0.0), axis=2),
                   tl.max(tl.where(i < ROT_DIM // 2, tl.abs(y_hi), 0.0), axis=2))
    if HAS_PASS:
        _, mp = _pass_columns(tl.full([1, 1, 1], 1, tl.int1), HEAD_DIM, ROT_DIM, ROT_START, PASS_BLOCK)
        a = tl.maximum(a, tl.max(tl.where(mp, tl.abs(y_p), 0.0), axis=2))
    return a


@triton.jit
def _store_heads(
    o_ptr, base, m, x_lo, x_hi, x_p, c_lo, c_hi, s_a, s_b, scale,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, ROT_START: tl.constexpr, NEOX: tl.constexpr,
    HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, COPY_PASS: tl.constexpr, OUT_FP8: tl.constexpr,
    ROUND_FP8: tl.constexpr, so_ptr=None, so_base=None, OUT_DYNAMIC: tl.constexpr = False,
):
    """Rotate a loaded block of heads by the token rotation ([BLOCK_T, HALF_BLOCK] each, which carries the output
    scale already), store; the pass-through columns are multiplied by ``scale``. ``OUT_FP8``: the float8 kind of
    the output (saturated, rounded to nearest even). ``OUT_DYNAMIC``: each row is divided by its own scale
    ``max |row| / fp8 max`` (pass-through columns included), stored as float32 at ``so_ptr + so_base``."""
    y_lo, y_hi = _turn(x_lo, x_hi, c_lo, c_hi, s_a, s_b)
    y_p = x_p * scale
    if OUT_DYNAMIC:
        amax = _row_amax(y_lo, y_hi, y_p, ROT_DIM, HEAD_DIM, ROT_START, HALF_BLOCK, PASS_BLOCK, COPY_PASS)
        if OUT_FP8 == FP8_E5M2:
            row_scale = amax / FP8_E5M2_MAX
        else:
            row_scale = amax / FP8_E4M3_MAX
        div = tl.where(row_scale > 0, row_scale, 1.0)[:, :, None]  # an all-zero row: scale 0, zeros stored
        y_lo, y_hi, y_p = y_lo / div, y_hi / div, y_p / div
        tl.store(so_ptr + so_base, row_scale[:, :, None], mask=m)
    if OUT_FP8:
        STORE_FP8: tl.constexpr = OUT_FP8 == FP8_E4M3 and not ROUND_FP8  # as _fp8_for_interpreter says
        _store_pairs(o_ptr, base, m, _fp8_for_interpreter(y_lo, OUT_FP8, ROUND_FP8),
                     _fp8_for_interpreter(y_hi, OUT_FP8, ROUND_FP8),
                     _fp8_for_interpreter(y_p, OUT_FP8, ROUND_FP8), HEAD_DIM, ROT_DIM, ROT_START, NEOX,
                     HALF_BLOCK, PASS_BLOCK, COPY_PASS, STORE_FP8, False)
    else:
        _store_pairs(o_ptr, base, m, y_lo, y_hi, y_p, HEAD_DIM, ROT_DIM, ROT_START, NEOX, HALF_BLOCK,
                     PASS_BLOCK, COPY_PASS, False, False)


@triton.jit
def _rope_head_block(
    x_ptr, o_ptr, x_sb, x_ss, x_sh, o_sb, o_ss, o_sh, t, b, s, mask_t, h0, H, scale,
    pos_ptr, pos_sb, pos_ss, seq_off_ptr, pos_offset, cu_ptr, n_seqs, n_search_steps,
    freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale, pos_sa,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, ROT_START: tl.constexpr, NEOX: tl.constexpr,
    POS_MODE: tl.constexpr, HAS_SEQ_OFFSETS: tl.constexpr, FREQ_MODE: tl.constexpr,
    TABLE_BY_TOKEN: tl.constexpr, TABLE_FULL: tl.constexpr, CONJUGATE: tl.constexpr,
    BLOCK_H: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, COPY_PASS: tl.constexpr,
    FAST_TRIG: tl.constexpr, NUM_AXES: tl.constexpr, AXES_INTERLEAVED: tl.constexpr, AXIS_BOUND_1: tl.constexpr,
    AXIS_BOUND_2: tl.constexpr, AXIS_BOUND_3: tl.constexpr, POS_PER_AXIS: tl.constexpr, OUT_FP8: tl.constexpr,
    ROUND_FP8: tl.constexpr, so_ptr=None, so_sb=0, so_ss=0, so_sh=0, OUT_DYNAMIC: tl.constexpr = False,
):
    """Rotate one [BLOCK_T, BLOCK_H] block of heads of ``x`` into ``o`` (``OUT_DYNAMIC``: with each row's float8
    scale into ``so`` at strides ``so_sb, so_ss, so_sh``).

    The block's loads come first, before the position load and the angle math they do not depend on: a decode
    call is one round trip to memory plus the sin/cos latency, not a position round trip, then the angles, then
    the data round trip."""
    x_base, m = _head_tile(b, s, mask_t, h0, H, x_sb, x_ss, x_sh, BLOCK_H)
    x_lo, x_hi, x_p = _load_heads(x_ptr, x_base, m, HEAD_DIM, ROT_DIM, ROT_START, NEOX, HALF_BLOCK, PASS_BLOCK,
                                  COPY_PASS, OUT_DYNAMIC)  # zeros where padded: no NaN in a row's max
    if NUM_AXES > 1:  # positions are read per pair, with their validity, by _rotation (_pair_positions)
        pos = s
        valid = mask_t
    else:
        pos, valid = _token_positions(t, b, s, mask_t, pos_ptr, pos_sb, pos_ss, seq_off_ptr, pos_offset, cu_ptr,
                                      n_seqs, n_search_steps, POS_MODE, HAS_SEQ_OFFSETS)
    # The output scale goes into cos/sin with the rotary scale (one scalar product): per column, not per element.
    c_lo, c_hi, s_a, s_b = _rotation(
        b, s, pos, valid & mask_t, mask_t, freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows,
        rotary_scale * scale, pos_ptr, pos_sa, pos_sb, pos_ss, ROT_DIM, HALF_BLOCK, NEOX, FREQ_MODE,
        TABLE_BY_TOKEN, TABLE_FULL, CONJUGATE, FAST_TRIG, NUM_AXES, AXES_INTERLEAVED, AXIS_BOUND_1, AXIS_BOUND_2,
        AXIS_BOUND_3, POS_PER_AXIS)
    o_base, _ = _head_tile(b, s, mask_t, h0, H, o_sb, o_ss, o_sh, BLOCK_H)
    so_base = o_base
    if OUT_DYNAMIC:
        so_base, _ = _head_tile(b, s, mask_t, h0, H, so_sb, so_ss, so_sh, BLOCK_H)
    _store_heads(o_ptr, o_base, m, x_lo, x_hi, x_p, c_lo, c_hi, s_a, s_b, scale, HEAD_DIM, ROT_DIM, ROT_START,
                 NEOX, HALF_BLOCK, PASS_BLOCK, COPY_PASS, OUT_FP8, ROUND_FP8, so_ptr, so_base, OUT_DYNAMIC)


@triton.jit
def _in_elements(sb, ss, sh, UNIT: tl.constexpr):
    """Row strides given in units of ``UNIT`` elements, in elements (int64: the product may pass 2**31). A stride
    of 1 unit arrives as a Python int (Triton specialises it), hence the int64 scalar rather than ``.to``."""
    unit = tl.full([], UNIT, tl.int64)
    return sb * unit, ss * unit, sh * unit


# pos_offset changes on every decode step: specialising on its value (== 1, divisible by 16) would compile new
# variants and make a launch replayed by the fast path (ropekit.triton.runtime.Replay) wrong for other offsets.
@triton.jit(do_not_specialize=["pos_offset"])
def rope_kernel(
    q_ptr, qo_ptr, k_ptr, ko_ptr,
    q_sb, q_ss, q_sh, qo_sb, qo_ss, qo_sh,
    k_sb, k_ss, k_sh, ko_sb, ko_ss, ko_sh,
    HQ, HK, S, num_tokens,
    pos_ptr, pos_sb, pos_ss, seq_off_ptr, pos_offset, cu_ptr, n_seqs, n_search_steps,
    freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows,
    q_scale, k_scale, rotary_scale, pos_sa,
    qdyn_ptr, qdyn_sb, qdyn_ss, qdyn_sh, kdyn_ptr, kdyn_sb, kdyn_ss, kdyn_sh,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, ROT_START: tl.constexpr, NEOX: tl.constexpr,
    POS_MODE: tl.constexpr, HAS_SEQ_OFFSETS: tl.constexpr, FREQ_MODE: tl.constexpr,
    TABLE_BY_TOKEN: tl.constexpr, TABLE_FULL: tl.constexpr, CONJUGATE: tl.constexpr, HAS_K: tl.constexpr,
    COPY_PASS_Q: tl.constexpr, COPY_PASS_K: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, FAST_TRIG: tl.constexpr, NUM_AXES: tl.constexpr,
    AXES_INTERLEAVED: tl.constexpr, AXIS_BOUND_1: tl.constexpr, AXIS_BOUND_2: tl.constexpr,
    AXIS_BOUND_3: tl.constexpr, STRIDE_UNIT: tl.constexpr, POS_AXIS_STRIDE: tl.constexpr,
    POS_PER_AXIS: tl.constexpr, OUT_FP8: tl.constexpr, ROUND_FP8: tl.constexpr, OUT_DYNAMIC: tl.constexpr,
    TOKENS_FIRST: tl.constexpr,
):
    """A program rotates one block of heads of q or of k for ``BLOCK_T`` tokens. The row strides come in units
    of ``STRIDE_UNIT`` elements (``launcher.stride_unit``): multiplied back here, in int64, the compiler knows
    their alignment. ``POS_AXIS_STRIDE`` > 0 is ``pos_sa`` as a compile-time constant (small multi-axis calls,
    ``heuristics.AXIS_STRIDE_CONSTANT_TOKENS``): each pair's position address is then a constant offset.
    ``POS_PER_AXIS``: multi-axis positions loaded once per axis and selected per pair (:func:`_pair_positions`).
    ``OUT_FP8``: float8 outputs of that kind (1 e4m3fn, 2 e5m2), saturated; ``ROUND_FP8``: rounded in software
    (the interpreter); ``OUT_DYNAMIC``: each (token, head) row scaled by its own ``max |row| / fp8 max``, the
    scales (float32) stored at ``qdyn_ptr``/``kdyn_ptr`` with strides in elements. ``TOKENS_FIRST``: the grid is
    (token blocks, head blocks) instead of (head blocks, token blocks over axes 1 and 2)."""
    if POS_AXIS_STRIDE > 0:
        pos_sa = POS_AXIS_STRIDE
    if STRIDE_UNIT > 1:
        q_sb, q_ss, q_sh = _in_elements(q_sb, q_ss, q_sh, STRIDE_UNIT)
        qo_sb, qo_ss, qo_sh = _in_elements(qo_sb, qo_ss, qo_sh, STRIDE_UNIT)
        k_sb, k_ss, k_sh = _in_elements(k_sb, k_ss, k_sh, STRIDE_UNIT)
        ko_sb, ko_ss, ko_sh = _in_elements(ko_sb, ko_ss, ko_sh, STRIDE_UNIT)
    # Grid: (head blocks, token blocks) with the token blocks over axes 1 and 2 (axis 1 holds at most 65535), so
    # that no program index is divided -- a division is ~40 dependent instructions before the first address -- and
    # the programs of one token run together. Token indices are int32 (the launcher refuses 2**31 tokens);
    # addresses are formed in int64.
    # TOKENS_FIRST (head-major q/k): grid (token blocks, head blocks), so that the programs running together
    # read one head's consecutive rows, as a copy does, instead of every head's rows of a few tokens.
    if TOKENS_FIRST:
        hb = tl.program_id(1)
        tb = tl.program_id(0)
    else:
        hb = tl.program_id(0)
        tb = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
    n_qb = tl.cdiv(HQ, BLOCK_HQ)
    t, mask_t, b, s = _token_block(tb, num_tokens, S, BLOCK_T)
    if hb < n_qb:
        _rope_head_block(
            q_ptr, qo_ptr, q_sb, q_ss, q_sh, qo_sb, qo_ss, qo_sh, t, b, s, mask_t, hb * BLOCK_HQ, HQ, q_scale,
            pos_ptr, pos_sb, pos_ss, seq_off_ptr, pos_offset, cu_ptr, n_seqs, n_search_steps,
            freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale, pos_sa,
            HEAD_DIM, ROT_DIM, ROT_START, NEOX, POS_MODE, HAS_SEQ_OFFSETS, FREQ_MODE, TABLE_BY_TOKEN, TABLE_FULL,
            CONJUGATE, BLOCK_HQ, HALF_BLOCK, PASS_BLOCK, COPY_PASS_Q, FAST_TRIG, NUM_AXES, AXES_INTERLEAVED,
            AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3, POS_PER_AXIS, OUT_FP8, ROUND_FP8, qdyn_ptr, qdyn_sb, qdyn_ss,
            qdyn_sh, OUT_DYNAMIC)
    elif HAS_K:
        _rope_head_block(
            k_ptr, ko_ptr, k_sb, k_ss, k_sh, ko_sb, ko_ss, ko_sh, t, b, s, mask_t, (hb - n_qb) * BLOCK_HK, HK,
            k_scale, pos_ptr, pos_sb, pos_ss, seq_off_ptr, pos_offset, cu_ptr, n_seqs, n_search_steps,
            freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale, pos_sa,
            HEAD_DIM, ROT_DIM, ROT_START, NEOX, POS_MODE, HAS_SEQ_OFFSETS, FREQ_MODE, TABLE_BY_TOKEN, TABLE_FULL,
            CONJUGATE, BLOCK_HK, HALF_BLOCK, PASS_BLOCK, COPY_PASS_K, FAST_TRIG, NUM_AXES, AXES_INTERLEAVED,
            AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3, POS_PER_AXIS, OUT_FP8, ROUND_FP8, kdyn_ptr, kdyn_sb, kdyn_ss,
            kdyn_sh, OUT_DYNAMIC)
