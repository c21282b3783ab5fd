"""The MLA prologue kernel (DeepSeek V2/V3 multi-head latent attention): RoPE of the rope columns of q, RoPE of
the shared ``k_pe`` and the latent cache row ``[kv_c | R(k_pe)]`` in one launch (``mla_kernel``).

Work decomposition as ``rope_kernel``: a program owns ``BLOCK_T`` tokens; grid axis 0 holds q's head blocks, then
one block for the token's shared key (``k_pe``, one head) and its latent ``kv_c``; axes 1 and 2 the token blocks.
q's rotated columns are its last ``ROT_DIM`` (MLA's ``[q_nope | q_pe]``); the ``q_nope`` columns pass through
(times ``q_scale``), into q's output or a separate one. The rotation is ``rope_kernel``'s own
(:func:`ropekit.triton.kernel._rotation`): the same exact angles, tables and multi-axis positions.

Cache rows as ``prologue_kernel``'s (:func:`_latent_rows`): ``CACHE_PAGED`` writes token t at slot
``slot_mapping[t]`` of a [num_blocks, block_size, W] cache, ``CACHE_ROWS`` token (b, s) at row [b, position] of a
[B, max_seq, W] cache.
The latent goes to columns ``0..LATENT_DIM`` of the ``ckv`` rows, the rotated ``k_pe`` to columns
``KPE_COL..KPE_COL + ROT_DIM`` of the ``kpe`` rows (one cache: the same rows, ``KPE_COL = LATENT_DIM``; separate
caches: their own rows, ``KPE_COL = 0``). A token whose slot or row lies outside the cache (slot -1 included), or
whose position is invalid, writes no cache row. float8 caches (``CACHE_FP8``: 1 float8_e4m3fn, 2 float8_e5m2)
store ``value / scale``, saturated to the format's largest finite value.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ropekit.triton.kernel import (
    FREQ_ANGLES,
    FREQ_TABLE,
    _axis_valid,
    _head_tile,
    _load_heads,
    _rotation,
    _store_pairs,
    _to_store,
    _token_block,
    _token_positions,
    _turn,
)
from ropekit.triton.prologue_kernels import FP8_E4M3, _fp8_for_interpreter

# Cache modes (CACHE_MODE), constexpr globals as kernel.py's modes
CACHE_NONE = tl.constexpr(0)  # no cache: the outputs only
CACHE_ROWS = tl.constexpr(1)  # token (b, s) at row [b, its position] of [B, max_seq, W] caches ("bshd")
CACHE_PAGED = tl.constexpr(2)  # token (b, s) at slot slots[b, s] of [num_blocks, block_size, W] caches ("paged")


@triton.jit
def _latent_rows(b, s, pos, valid, mask_t, slot_ptr, slot_sb, slot_ss, cache_rows, block_size,
                 CACHE_MODE: tl.constexpr):
    """(first index, second index, tokens that write) [BLOCK_T] of each token's cache row: ``CACHE_ROWS`` at
    (batch, position) below ``cache_rows`` rows, ``CACHE_PAGED`` at its slot below ``cache_rows`` slots (-1 and
    slots past the cache write nothing), for tokens ``valid`` (within ``mask_t``, with a valid position)."""
    if CACHE_MODE == CACHE_ROWS:
        ok = valid & (pos < cache_rows)
        r0 = b
        r1 = tl.where(ok, pos, 0)
    else:  # CACHE_PAGED
        slot = tl.load(slot_ptr + b * slot_sb + s * slot_ss, mask=mask_t, other=-1).to(tl.int64)
        ok = valid & (slot >= 0) & (slot < cache_rows)
        slot = tl.where(ok, slot, 0)
        r0 = slot // block_size
        r1 = slot - r0 * block_size
    return r0, r1, ok


@triton.jit
def _out_values(y, mult, OUT_FP8: tl.constexpr, ROUND_FP8: tl.constexpr):
    """``y`` (fp32) as an output stores it: unchanged, or for a float8 output (``OUT_FP8``) times ``mult`` and
    made ready for the store (:func:`_fp8_for_interpreter`)."""
    if OUT_FP8:
        y = _fp8_for_interpreter(y * mult, OUT_FP8, ROUND_FP8)
    return y


@triton.jit
def _mla_q_block(
    q_ptr, q_sb, q_ss, q_sh, qn_ptr, qn_sb, qn_ss, qn_sh, qpe_ptr, qpe_sb, qpe_ss, qpe_sh,
    b, s, mask_t, h0, H, c_lo, c_hi, s_a, s_b, q_scale, out_mult,
    Q_DIM: tl.constexpr, ROT_DIM: tl.constexpr, NEOX: tl.constexpr, QPE_START: tl.constexpr, OUT_FP8: tl.constexpr,
    ROUND_FP8: tl.constexpr, BLOCK_H: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
):
    """Rotate the last ``ROT_DIM`` columns of a block of q's heads into ``qpe`` (from column ``QPE_START``) and copy
    the others, times ``q_scale``, into ``qn`` (the rotation carries ``q_scale`` already); float8 outputs
    (``OUT_FP8``) hold the values times ``out_mult``."""
    STORE_FP8: tl.constexpr = OUT_FP8 == FP8_E4M3 and not ROUND_FP8  # see _mla_cache_write
    NOPE_DIM: tl.constexpr = Q_DIM - ROT_DIM
    HAS_NOPE: tl.constexpr = NOPE_DIM > 0
    x_base, m = _head_tile(b, s, mask_t, h0, H, q_sb, q_ss, q_sh, BLOCK_H)
    x_lo, x_hi, x_p = _load_heads(q_ptr, x_base, m, Q_DIM, ROT_DIM, NOPE_DIM, NEOX, HALF_BLOCK, PASS_BLOCK,
                                  HAS_NOPE, False)
    y_lo, y_hi = _turn(x_lo, x_hi, c_lo, c_hi, s_a, s_b)
    y_lo, y_hi = _out_values(y_lo, out_mult, OUT_FP8, ROUND_FP8), _out_values(y_hi, out_mult, OUT_FP8, ROUND_FP8)
    pe_base, _ = _head_tile(b, s, mask_t, h0, H, qpe_sb, qpe_ss, qpe_sh, BLOCK_H)
    _store_pairs(qpe_ptr, pe_base, m, y_lo, y_hi, y_lo, ROT_DIM, ROT_DIM, QPE_START, NEOX, HALF_BLOCK, PASS_BLOCK,
                 False, STORE_FP8, False)
    if HAS_NOPE:
        n_base, _ = _head_tile(b, s, mask_t, h0, H, qn_sb, qn_ss, qn_sh, BLOCK_H)
        p = tl.arange(0, PASS_BLOCK)[None, None, :]
        y_n = _out_values(x_p * q_scale, out_mult, OUT_FP8, ROUND_FP8)
        tl.store(qn_ptr + n_base + p, _to_store(y_n, qn_ptr, STORE_FP8, False), mask=m & (p < NOPE_DIM))


@triton.jit
def _mla_cache_write(
    kvc_ptr, kvc_sb, kvc_ss, ckv_ptr, ckv_row, kpc_ptr, kpc_row, ok, b, s, mask_t, y_lo, y_hi, scale,
    ROT_DIM: tl.constexpr, NEOX: tl.constexpr, LATENT_DIM: tl.constexpr, LATENT_BLOCK: tl.constexpr,
    KPE_COL: tl.constexpr, CACHE_FP8: tl.constexpr, ROUND_FP8: tl.constexpr, HALF_BLOCK: tl.constexpr,
    PASS_BLOCK: tl.constexpr,
):
    """Store the rotated key pairs (fp32 [BLOCK_T, 1, HALF_BLOCK]) and the latent row of each token in ``ok`` into
    its cache rows (element offsets ``ckv_row``/``kpc_row`` [BLOCK_T]): bit for bit in the latent's dtype, else
    ``value * scale`` converted to the float8 kind ``CACHE_FP8`` (saturated, rounded to nearest even)."""
    # the store saturates e4m3 itself on the GPU; every other float8 value comes ready (_fp8_for_interpreter)
    STORE_FP8: tl.constexpr = CACHE_FP8 == FP8_E4M3 and not ROUND_FP8
    okm = ok[:, None, None]
    _store_pairs(kpc_ptr, kpc_row[:, None, None], okm, _fp8_for_interpreter(y_lo * scale, CACHE_FP8, ROUND_FP8),
                 _fp8_for_interpreter(y_hi * scale, CACHE_FP8, ROUND_FP8), y_lo, ROT_DIM, ROT_DIM, KPE_COL, NEOX,
                 HALF_BLOCK, PASS_BLOCK, False, STORE_FP8, False)
    d = tl.arange(0, LATENT_BLOCK)[None, :]
    latent = tl.load(kvc_ptr + (b * kvc_sb + s * kvc_ss)[:, None] + d, mask=mask_t[:, None] & (d < LATENT_DIM))
    if CACHE_FP8:
        latent = _to_store(_fp8_for_interpreter(latent.to(tl.float32) * scale, CACHE_FP8, ROUND_FP8), ckv_ptr,
                           STORE_FP8, False)
    else:
        latent = latent.to(ckv_ptr.dtype.element_ty)
    tl.store(ckv_ptr + ckv_row[:, None] + d, latent, mask=ok[:, None] & (d < LATENT_DIM))


# pos_offset changes on every decode step: not specialised on (see rope_kernel).
@triton.jit(do_not_specialize=["pos_offset"])
def mla_kernel(
    q_ptr, qn_ptr, qpe_ptr, kpe_ptr, ko_ptr, kvc_ptr, ckv_ptr, kpc_ptr,
    q_sb, q_ss, q_sh, qn_sb, qn_ss, qn_sh, qpe_sb, qpe_ss, qpe_sh, k_sb, k_ss, ko_sb, ko_ss, ko_sh, kvc_sb, kvc_ss,
    HQ, KH, S, num_tokens,
    pos_ptr, pos_sb, pos_ss, seq_off_ptr, pos_offset, cu_ptr, n_seqs, n_search_steps,
    freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows,
    q_scale, k_scale, rotary_scale, pos_sa,
    slot_ptr, slot_sb, slot_ss, cache_rows, block_size, ckv_sb, ckv_ss, kpc_sb, kpc_ss, cs_ptr, cache_scale,
    qs_ptr, ks_ptr, q_out_mult, k_out_mult,
    Q_DIM: tl.constexpr, ROT_DIM: tl.constexpr, NEOX: tl.constexpr, POS_MODE: tl.constexpr,
    HAS_SEQ_OFFSETS: tl.constexpr, FREQ_MODE: tl.constexpr, TABLE_BY_TOKEN: tl.constexpr, TABLE_FULL: tl.constexpr,
    FAST_TRIG: tl.constexpr, NUM_AXES: tl.constexpr, AXES_INTERLEAVED: tl.constexpr, AXIS_BOUND_1: tl.constexpr,
    AXIS_BOUND_2: tl.constexpr, AXIS_BOUND_3: tl.constexpr, QPE_START: tl.constexpr, LATENT_DIM: tl.constexpr,
    LATENT_BLOCK: tl.constexpr, KPE_COL: tl.constexpr, CACHE_MODE: tl.constexpr, SCALE_PTR: tl.constexpr,
    CACHE_FP8: tl.constexpr, OUT_FP8: tl.constexpr, OUT_SCALE_PTR: tl.constexpr, ROUND_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
):
    """A program rotates one block of q's heads for ``BLOCK_T`` tokens, or (the last block of grid axis 0) their
    ``k_pe`` -- into ``ko`` (``KH`` copies: one per head when broadcast) and, unless ``CACHE_MODE`` is
    ``CACHE_NONE``, with their ``kv_c`` into the cache rows. ``cache_scale`` multiplies what a cache stores (1 /
    its scale), or with ``SCALE_PTR`` the scale is read from the device scalar ``cs_ptr`` (graph capture). float8
    outputs (``OUT_FP8``) hold the values times ``q_out_mult``/``k_out_mult`` (1 / their scales), or with
    ``OUT_SCALE_PTR`` divided by the device scalars ``qs_ptr``/``ks_ptr``."""
    hb = tl.program_id(0)
    tb = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
    n_qb = tl.cdiv(HQ, BLOCK_H)
    t, mask_t, b, s = _token_block(tb, num_tokens, S, BLOCK_T)
    pos, valid = _token_positions(t, b, s, mask_t, pos_ptr, pos_sb, pos_ss, seq_off_ptr, pos_offset, cu_ptr,
                                  n_seqs, n_search_steps, POS_MODE, HAS_SEQ_OFFSETS)
    valid = valid & mask_t
    if hb < n_qb:
        scale = q_scale
    else:
        scale = k_scale
    c_lo, c_hi, s_a, s_b = _rotation(
        b, s, pos, valid, mask_t, freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale * scale,
        pos_ptr, pos_sa, pos_sb, pos_ss, ROT_DIM, HALF_BLOCK, NEOX, FREQ_MODE, TABLE_BY_TOKEN, TABLE_FULL,
        False, FAST_TRIG, NUM_AXES, AXES_INTERLEAVED, AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3, False)
    if hb < n_qb:
        if OUT_SCALE_PTR:
            q_out_mult = 1.0 / tl.load(qs_ptr).to(tl.float32)
        _mla_q_block(q_ptr, q_sb, q_ss, q_sh, qn_ptr, qn_sb, qn_ss, qn_sh, qpe_ptr, qpe_sb, qpe_ss, qpe_sh,
                     b, s, mask_t, hb * BLOCK_H, HQ, c_lo, c_hi, s_a, s_b, q_scale, q_out_mult,
                     Q_DIM, ROT_DIM, NEOX, QPE_START, OUT_FP8, ROUND_FP8, BLOCK_H, HALF_BLOCK, PASS_BLOCK)
    else:
        k_base, mk = _head_tile(b, s, mask_t, 0, 1, k_sb, k_ss, 0, 1)
        k_lo, k_hi, _ = _load_heads(kpe_ptr, k_base, mk, ROT_DIM, ROT_DIM, 0, NEOX, HALF_BLOCK, PASS_BLOCK,
                                    False, False)
        y_lo, y_hi = _turn(k_lo, k_hi, c_lo, c_hi, s_a, s_b)
        if OUT_SCALE_PTR:
            k_out_mult = 1.0 / tl.load(ks_ptr).to(tl.float32)
        o_lo = _out_values(y_lo, k_out_mult, OUT_FP8, ROUND_FP8)
        o_hi = _out_values(y_hi, k_out_mult, OUT_FP8, ROUND_FP8)
        STORE_FP8: tl.constexpr = OUT_FP8 == FP8_E4M3 and not ROUND_FP8  # see _mla_cache_write
        row = (b * ko_sb + s * ko_ss)[:, None, None]
        for h in range(0, KH):  # the shared key, once per head where it is broadcast
            _store_pairs(ko_ptr, row + h * ko_sh, mk, o_lo, o_hi, o_lo, ROT_DIM, ROT_DIM, 0, NEOX, HALF_BLOCK,
                         PASS_BLOCK, False, STORE_FP8, False)
        if CACHE_MODE != CACHE_NONE:
            # Tokens whose rotation is NaN write no cache row (as prologue_kernel).
            row_valid = valid
            if FREQ_MODE == FREQ_TABLE or FREQ_MODE == FREQ_ANGLES:
                if not TABLE_BY_TOKEN:
                    row_valid = row_valid & (pos < table_rows)
            for a in tl.static_range(1, NUM_AXES):
                row_valid = row_valid & _axis_valid(a, b, s, mask_t, pos_ptr, pos_sa, pos_sb, pos_ss)
            r0, r1, ok = _latent_rows(b, s, pos, row_valid, mask_t, slot_ptr, slot_sb, slot_ss, cache_rows,
                                      block_size, CACHE_MODE)
            c_scale = cache_scale
            if SCALE_PTR:
                c_scale = 1.0 / tl.load(cs_ptr).to(tl.float32)
            _mla_cache_write(kvc_ptr, kvc_sb, kvc_ss, ckv_ptr, r0 * ckv_sb + r1 * ckv_ss, kpc_ptr,
                             r0 * kpc_sb + r1 * kpc_ss, ok, b, s, mask_t, y_lo, y_hi, c_scale, ROT_DIM, NEOX,
                             LATENT_DIM, LATENT_BLOCK, KPE_COL, CACHE_FP8, ROUND_FP8, HALF_BLOCK, PASS_BLOCK)
