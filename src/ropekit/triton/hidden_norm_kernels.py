"""The whole-hidden QK-norm + RoPE kernel of diffusion transformers (``qk_norm_rope(..., norm_over="hidden")``):
each token's q (and k) is RMS-normalised over all its heads at once (weight [H * D]), then every head is rotated
as ``prologue_kernel`` rotates it, and v (optional) is copied into its new tensor, in one launch.

Work decomposition: a program owns ``BLOCK_T`` tokens and all heads of q (grid axis 0 = 0), of k (1) or of v (2),
so a token's sum of squares is one fixed tree in one program: per head over its columns
(:func:`_pairwise_sum`, as the per-head norm), then over the heads padded to ``BLOCK_H`` (padded heads add zeros).
The order depends on neither the batch nor the block shape: a token's bits do not depend on the batch it came in.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ropekit.triton.kernel import (
    _head_tile,
    _load_heads,
    _rotation,
    _store_pairs,
    _token_block,
    _token_positions,
    _turn,
)
from ropekit.triton.prologue_kernels import _copy_block, _norm_weights, _pairwise_sum


@triton.jit
def _hidden_norm_rope_block(
    x_ptr, x_sb, x_ss, x_sh, o_ptr, o_row, o_sh, w_ptr, w_offset, eps, scale, b, s, pos, valid, mask_t, H,
    pos_ptr, pos_sb, pos_ss, freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale, pos_sa,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, ROT_START: tl.constexpr, NEOX: tl.constexpr,
    FREQ_MODE: tl.constexpr, TABLE_BY_TOKEN: tl.constexpr, TABLE_FULL: tl.constexpr, FAST_TRIG: tl.constexpr,
    NUM_AXES: tl.constexpr, AXES_INTERLEAVED: tl.constexpr, AXIS_BOUND_1: tl.constexpr,
    AXIS_BOUND_2: tl.constexpr, AXIS_BOUND_3: tl.constexpr, BLOCK_H: tl.constexpr, HALF_BLOCK: tl.constexpr,
    PASS_BLOCK: tl.constexpr,
):
    """Normalise [BLOCK_T, all H heads] of ``x`` over each token's H * HEAD_DIM values and rotate every head; row
    (t, h) goes to ``o_ptr + o_row[t] + h * o_sh``."""
    HAS_PASS: tl.constexpr = HEAD_DIM != ROT_DIM
    x_base, m = _head_tile(b, s, mask_t, 0, H, x_sb, x_ss, x_sh, BLOCK_H)
    x_lo, x_hi, x_p = _load_heads(x_ptr, x_base, m, HEAD_DIM, ROT_DIM, ROT_START, NEOX, HALF_BLOCK, PASS_BLOCK,
                                  HAS_PASS, True)
    ss = _pairwise_sum(x_lo * x_lo + x_hi * x_hi, HALF_BLOCK.bit_length() - 1)  # [BLOCK_T, BLOCK_H]
    if HAS_PASS:
        ss = ss + _pairwise_sum(x_p * x_p, PASS_BLOCK.bit_length() - 1)
    total = _pairwise_sum(tl.reshape(ss, [ss.shape[0], 1, BLOCK_H]), BLOCK_H.bit_length() - 1)  # [BLOCK_T, 1]
    r = (1.0 / tl.sqrt(total / (H * HEAD_DIM) + eps))[:, :, None]
    h = tl.arange(0, BLOCK_H)
    # each head's weights start at h * HEAD_DIM; padded heads read the last head's (in bounds, never stored)
    w_heads = w_ptr + (tl.minimum(h, H - 1) * HEAD_DIM)[None, :, None]
    w_lo, w_hi, w_p = _norm_weights(w_heads, w_offset, ROT_DIM, ROT_START, NEOX, HEAD_DIM, HALF_BLOCK, PASS_BLOCK,
                                    HAS_PASS)
    x_lo = x_lo * r * w_lo
    x_hi = x_hi * r * w_hi
    x_p = x_p * r * w_p
    c_lo, c_hi, s_a, s_b = _rotation(
        b, s, pos, valid, mask_t, freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale * scale,
        pos_ptr, pos_sa, pos_sb, pos_ss, ROT_DIM, HALF_BLOCK, NEOX, FREQ_MODE, TABLE_BY_TOKEN, TABLE_FULL,
        False, FAST_TRIG, NUM_AXES, AXES_INTERLEAVED, AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3, False)
    y_lo, y_hi = _turn(x_lo, x_hi, c_lo, c_hi, s_a, s_b)
    y_p = x_p * scale
    o_base = o_row[:, None, None] + (h.to(tl.int64) * o_sh)[None, :, None]
    _store_pairs(o_ptr, o_base, m, y_lo, y_hi, y_p, HEAD_DIM, ROT_DIM, ROT_START, NEOX, HALF_BLOCK, PASS_BLOCK,
                 HAS_PASS, 0, False)


# pos_offset changes on every decode step: not specialised on (see rope_kernel).
@triton.jit(do_not_specialize=["pos_offset"])
def hidden_norm_rope_kernel(
    q_ptr, qo_ptr, k_ptr, ko_ptr, v_ptr, vo_ptr,
    q_sb, q_ss, q_sh, qo_sb, qo_ss, qo_sh, k_sb, k_ss, k_sh, ko_sb, ko_ss, ko_sh,
    v_sb, v_ss, v_sh, vo_sb, vo_ss, vo_sh,
    HQ, HK, S, num_tokens,
    pos_ptr, pos_sb, pos_ss, seq_off_ptr, pos_offset, cu_ptr, n_seqs, n_search_steps,
    freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows,
    q_scale, k_scale, rotary_scale, pos_sa, qw_ptr, kw_ptr, w_offset, eps,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, ROT_START: tl.constexpr, NEOX: tl.constexpr,
    POS_MODE: tl.constexpr, HAS_SEQ_OFFSETS: tl.constexpr, FREQ_MODE: tl.constexpr,
    TABLE_BY_TOKEN: tl.constexpr, TABLE_FULL: tl.constexpr, FAST_TRIG: tl.constexpr, NUM_AXES: tl.constexpr,
    AXES_INTERLEAVED: tl.constexpr, AXIS_BOUND_1: tl.constexpr, AXIS_BOUND_2: tl.constexpr,
    AXIS_BOUND_3: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr,
):
    """Program (0, tb) normalises and rotates q's rows of token block tb into ``qo``, (1, tb) k's into ``ko``,
    (2, tb) copies v's into ``vo`` (converted to its dtype)."""
    role = tl.program_id(0)
    tb = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
    t, mask_t, b, s = _token_block(tb, num_tokens, S, BLOCK_T)
    pos, valid = _token_positions(t, b, s, mask_t, pos_ptr, pos_sb, pos_ss, seq_off_ptr, pos_offset, cu_ptr,
                                  n_seqs, n_search_steps, POS_MODE, HAS_SEQ_OFFSETS)
    valid = valid & mask_t
    if role == 0:
        _hidden_norm_rope_block(
            q_ptr, q_sb, q_ss, q_sh, qo_ptr, b * qo_sb + s * qo_ss, qo_sh, qw_ptr, w_offset, eps, q_scale,
            b, s, pos, valid, mask_t, HQ, pos_ptr, pos_sb, pos_ss, freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc,
            table_rows, rotary_scale, pos_sa, HEAD_DIM, ROT_DIM, ROT_START, NEOX, FREQ_MODE, TABLE_BY_TOKEN,
            TABLE_FULL, FAST_TRIG, NUM_AXES, AXES_INTERLEAVED, AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3, BLOCK_HQ,
            HALF_BLOCK, PASS_BLOCK)
    elif role == 1:
        _hidden_norm_rope_block(
            k_ptr, k_sb, k_ss, k_sh, ko_ptr, b * ko_sb + s * ko_ss, ko_sh, kw_ptr, w_offset, eps, k_scale,
            b, s, pos, valid, mask_t, HK, pos_ptr, pos_sb, pos_ss, freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc,
            table_rows, rotary_scale, pos_sa, HEAD_DIM, ROT_DIM, ROT_START, NEOX, FREQ_MODE, TABLE_BY_TOKEN,
            TABLE_FULL, FAST_TRIG, NUM_AXES, AXES_INTERLEAVED, AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3, BLOCK_HK,
            HALF_BLOCK, PASS_BLOCK)
    else:
        _copy_block(v_ptr, v_sb, v_ss, v_sh, vo_ptr, b * vo_sb + s * vo_ss, mask_t, vo_sh, b, s, mask_t, 0, HK,
                    1.0, HEAD_DIM, D_BLOCK, BLOCK_HK, 0, False)
