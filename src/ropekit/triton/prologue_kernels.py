"""The attention prologue kernels, built from ``rope_kernel``'s pieces: per-head RMSNorm (optional), RoPE and the
K/V cache write in one launch (``prologue_kernel``), and the backward of norm + RoPE (``norm_rope_bwd_kernel``).

Work decomposition as ``rope_kernel``: a program owns ``BLOCK_T`` tokens and one block of heads; grid axis 0 holds
q's head blocks, then k's, then v's (a cache write only), axes 1 and 2 the token blocks. The norm needs a head's
whole row, so with a norm every column (the pass-through span included) is loaded, normalised in fp32 and stored.

Cache rows: ``CACHE_ROWS`` writes token (b, pos) at ``cache[cb, pos]`` of a [B, max_seq, H, D] view (any strides:
the head-major [B, H, max_seq, D] cache is a permuted view), where ``cb`` is the token's canonical batch index or,
for packed varlen tokens, ``cache_batch[t]``; ``CACHE_PAGED`` writes token t at slot ``slot_mapping[t]`` of a
[num_blocks, block_size, H, D] cache. The k and v caches share that grid of rows, not their strides: each turns a
row into an address with its own (a padded view, a head-major view, two halves of one buffer). A token whose row
or slot lies outside the cache (slot -1 included), or whose position is invalid, writes nothing: never an
out-of-bounds write. ``CACHE_TABLE`` writes token t of request r at position p to row ``p % page_size`` of page
``kv_indices[kv_indptr[r] + p // page_size]`` (FlashInfer's page table); every index it reads is bounded first, so a
bad request, position or page writes nothing. A cache's columns are at ``d`` (unit stride), or with ``*_PACK`` at
``(d // PACK) * col_sa + (d % PACK) * col_sb``: vLLM's x-packed keys [.., D/x, block, x] and its values [.., D,
block], whose columns are strided. float8 caches and outputs (float8_e4m3fn, float8_e5m2) store ``value /
scale`` rounded to nearest even and saturated to the format's largest finite value (+-448, +-57344; NaN stays
NaN); the scale is per tensor, per cache head, or (outputs) each row's own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ropekit.triton.kernel import (
    FP8_E4M3,
    FP8_E4M3_MAX,
    FP8_E5M2,
    FP8_E5M2_MAX,
    FREQ_ANGLES,
    FREQ_TABLE,
    _axis_valid,
    _fp8_for_interpreter,
    _head_tile,
    _load_heads,
    _pass_columns,
    _rotation,
    _row_amax,
    _store_pairs,
    _table_columns,
    _to_store,
    _token_block,
    _token_positions,
    _turn,
    _within,
)

try:  # programmatic dependent launch (Triton >= 3.4 or so); ropekit launches with PDL only where it exists
    from triton.language.extra.cuda import gdc_wait

    HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton: never called, PDL stays off (the launcher reads HAS_GDC)
    HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

# Cache modes (CACHE_MODE), constexpr globals as kernel.py's modes
CACHE_NONE = tl.constexpr(0)  # k goes to k_out like q (qk_norm_rope)
CACHE_ROWS = tl.constexpr(1)  # k and v go to cache[batch, position] ("bshd", "bhsd")
CACHE_PAGED = tl.constexpr(2)  # k and v go to cache[slot // block_size, slot % block_size] ("paged")
CACHE_TABLE = tl.constexpr(3)  # k and v go to the page and row a page table gives a token's request and position


@triton.jit
def _cols(c, PACK: tl.constexpr, col_sa, col_sb):
    """Element offsets of head columns ``c`` in a cache row: ``c`` itself (``PACK`` 0: unit stride), else
    ``(c // PACK) * col_sa + (c % PACK) * col_sb``."""
    if PACK:
        c = (c // PACK) * col_sa + (c % PACK) * col_sb
    return c


@triton.jit
def _store_pairs_at(o_ptr, base, m, y_lo, y_hi, y_p, PACK: tl.constexpr, col_sa, col_sb,
                    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, ROT_START: tl.constexpr, NEOX: tl.constexpr,
                    HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, FP8: tl.constexpr):
    """``_store_pairs`` (rotated pairs and the pass-through columns) into a row whose columns are at
    :func:`_cols` (a packed or strided cache row)."""
    HALF: tl.constexpr = ROT_DIM // 2
    if NEOX:
        i = tl.arange(0, HALF_BLOCK)[None, None, :]
        mi = _within(m, i, HALF, HALF_BLOCK)
        tl.store(o_ptr + base + _cols(ROT_START + i, PACK, col_sa, col_sb), _to_store(y_lo, o_ptr, FP8, False),
                 mask=mi)
        tl.store(o_ptr + base + _cols(ROT_START + HALF + i, PACK, col_sa, col_sb),
                 _to_store(y_hi, o_ptr, FP8, False), mask=mi)
    else:
        j = tl.arange(0, 2 * HALF_BLOCK)[None, None, :]
        y = tl.reshape(tl.join(y_lo, y_hi), [y_lo.shape[0], y_lo.shape[1], 2 * HALF_BLOCK])
        tl.store(o_ptr + base + _cols(ROT_START + j, PACK, col_sa, col_sb), _to_store(y, o_ptr, FP8, False),
                 mask=_within(m, j, ROT_DIM, 2 * HALF_BLOCK))
    if HEAD_DIM != ROT_DIM:
        p, mp = _pass_columns(m, HEAD_DIM, ROT_DIM, ROT_START, PASS_BLOCK)
        tl.store(o_ptr + base + _cols(p, PACK, col_sa, col_sb), _to_store(y_p, o_ptr, FP8, False), mask=mp)


@triton.jit
def _pair_columns(ROT_START: tl.constexpr, HALF: tl.constexpr, NEOX: tl.constexpr, HALF_BLOCK: tl.constexpr):
    """Head columns of the lo and hi element of each pair [1, 1, HALF_BLOCK]."""
    i = tl.arange(0, HALF_BLOCK)
    col_lo, col_hi = _table_columns(i, HALF, NEOX, True)
    return (ROT_START + col_lo)[None, None, :], (ROT_START + col_hi)[None, None, :]


@triton.jit
def _norm_weights(w_ptr, w_offset, ROT_DIM: tl.constexpr, ROT_START: tl.constexpr, NEOX: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
                  HAS_PASS: tl.constexpr):
    """fp32 ``w + w_offset`` at the lo, hi and pass-through columns, [1, 1, block] each."""
    HALF: tl.constexpr = ROT_DIM // 2
    col_lo, col_hi = _pair_columns(ROT_START, HALF, NEOX, HALF_BLOCK)
    mi = tl.arange(0, HALF_BLOCK)[None, None, :] < HALF
    w_lo = tl.load(w_ptr + col_lo, mask=mi, other=0.0).to(tl.float32) + w_offset
    w_hi = tl.load(w_ptr + col_hi, mask=mi, other=0.0).to(tl.float32) + w_offset
    if HAS_PASS:
        p, mp = _pass_columns(tl.full([1, 1, 1], 1, tl.int1), HEAD_DIM, ROT_DIM, ROT_START, PASS_BLOCK)
        w_p = tl.load(w_ptr + p, mask=mp, other=0.0).to(tl.float32) + w_offset
    else:
        w_p = w_lo
    return w_lo, w_hi, w_p


@triton.jit
def _pairwise_sum(x, LEVELS: tl.constexpr):
    """The sum over the last axis of ``x`` [BLOCK_T, BLOCK_H, 2**LEVELS] as one fixed tree of adjacent pairs
    (``x[2j] + x[2j + 1]``, repeated: each step a reduction over an axis of two, one addition whatever the layout).
    A ``tl.sum`` adds in an order that follows the tile's layout, which the compiler derives from the block shape
    (elements per thread shrink for small tiles): a token's norm would then depend on the batch it came in and on
    the op (qk_norm_rope and rope_kv_write pick different blocks). Adjacent pairs keep the steps where ``tl.sum``
    has them: within threads first, then across lanes by shuffles."""
    for _ in tl.static_range(LEVELS):
        x = tl.sum(tl.reshape(x, [x.shape[0], x.shape[1], x.shape[2] // 2, 2]), axis=3)
    return tl.reshape(x, [x.shape[0], x.shape[1]])


@triton.jit
def _inv_rms(x_lo, x_hi, x_p, eps, HEAD_DIM: tl.constexpr, HAS_PASS: tl.constexpr, HALF_LEVELS: tl.constexpr,
             PASS_LEVELS: tl.constexpr):
    """1 / sqrt(mean(x**2) + eps) over each head row, [BLOCK_T, BLOCK_H, 1], summed in an order independent of the
    block shape (:func:`_pairwise_sum`; ``*_LEVELS``: log2 of the span blocks)."""
    ss = _pairwise_sum(x_lo * x_lo + x_hi * x_hi, HALF_LEVELS)
    if HAS_PASS:
        ss = ss + _pairwise_sum(x_p * x_p, PASS_LEVELS)
    return (1.0 / tl.sqrt(ss / HEAD_DIM + eps))[:, :, None]


@triton.jit
def _cache_rows(t, b, s, pos, valid, mask_t, cb_ptr, slot_ptr, slot_sb, slot_ss, cache_rows, block_size, n_slots,
                pages_ptr, indptr_ptr, last_ptr, n_requests, n_page_ids,
                CACHE_MODE: tl.constexpr, CACHE_BATCH_PER_TOKEN: tl.constexpr, SLOTS_SHORT: tl.constexpr,
                TABLE_BATCH: tl.constexpr):
    """(first index, second index, tokens that write) [BLOCK_T] of each token's row in the [B | num_blocks,
    rows | block_size] grid the two caches share -- each cache turns them into an offset with its own strides:
    ``CACHE_ROWS`` at (batch, position) with ``cache_rows`` rows per batch entry, ``CACHE_PAGED`` at its slot of
    ``cache_rows`` slots. ``SLOTS_SHORT``: only the first ``n_slots`` tokens have a slot (the rest are padding and
    write nothing). ``CACHE_TABLE``: the page table ``pages_ptr`` (kv_indices, ``n_page_ids`` entries),
    ``indptr_ptr`` and ``last_ptr`` (kv_last_page_len) of ``n_requests`` requests, over ``cache_rows`` pages; a
    token's request is ``slot_ptr[b, s]`` (``TABLE_BATCH``: batch_indices), its packed sequence or b."""
    if CACHE_MODE == CACHE_ROWS:
        if CACHE_BATCH_PER_TOKEN:
            r0 = tl.load(cb_ptr + s, mask=mask_t, other=0).to(tl.int64)
        else:
            r0 = b
        ok = valid & (pos < cache_rows)
        r1 = tl.where(ok, pos, 0)
    elif CACHE_MODE == CACHE_TABLE:
        if TABLE_BATCH:
            req = tl.load(slot_ptr + b * slot_sb + s * slot_ss, mask=mask_t, other=-1).to(tl.int64)
        elif CACHE_BATCH_PER_TOKEN:
            req = tl.load(cb_ptr + s, mask=mask_t, other=0).to(tl.int64)
        else:
            req = b
        ok = valid & (req >= 0) & (req < n_requests)
        req = tl.where(ok, req, 0)  # every index is bounded before it is read
        first = tl.load(indptr_ptr + req, mask=ok, other=0).to(tl.int64)
        end = tl.load(indptr_ptr + req + 1, mask=ok, other=0).to(tl.int64)
        last = tl.load(last_ptr + req, mask=ok, other=0).to(tl.int64)
        p = tl.where(ok, pos, 0)
        page_i = p // block_size
        pages = end - first
        ok = ok & (first >= 0) & (end <= n_page_ids) & (page_i < pages) & (p < (pages - 1) * block_size + last)
        page = tl.load(pages_ptr + tl.where(ok, first + page_i, 0), mask=ok, other=-1).to(tl.int64)
        ok = ok & (page >= 0) & (page < cache_rows)
        r0 = tl.where(ok, page, 0)
        r1 = tl.where(ok, p - page_i * block_size, 0)
    else:  # CACHE_PAGED
        has_slot = mask_t
        if SLOTS_SHORT:
            has_slot = has_slot & (t < n_slots)
        slot = tl.load(slot_ptr + b * slot_sb + s * slot_ss, mask=has_slot, other=-1).to(tl.int64)
        ok = valid & (slot >= 0) & (slot < cache_rows)  # valid: within mask_t, and a valid position
        slot = tl.where(ok, slot, 0)
        r0 = slot // block_size
        r1 = slot - r0 * block_size
    return r0, r1, ok


@triton.jit
def _norm_rope_block(
    x_ptr, x_sb, x_ss, x_sh, o_ptr, o_row, o_ok, o_sh, w_ptr, w_offset, eps, scale,
    b, s, pos, valid, mask_t, h0, H,
    pos_ptr, pos_sb, pos_ss, freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale, pos_sa,
    hs_ptr, so_ptr, so_row, so_sh,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, ROT_START: tl.constexpr, NEOX: tl.constexpr,
    FREQ_MODE: tl.constexpr, TABLE_BY_TOKEN: tl.constexpr, TABLE_FULL: tl.constexpr, FAST_TRIG: tl.constexpr,
    NUM_AXES: tl.constexpr, AXES_INTERLEAVED: tl.constexpr, AXIS_BOUND_1: tl.constexpr,
    AXIS_BOUND_2: tl.constexpr, AXIS_BOUND_3: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr,
    ROUND_FP8: tl.constexpr, BLOCK_H: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
    HEAD_SCALES: tl.constexpr, DYNAMIC: tl.constexpr, COL_PACK: tl.constexpr = 0, col_sa=0, col_sb=0,
):
    """Normalise (``NORM``) and rotate one [BLOCK_T, BLOCK_H] block of head rows of ``x``; store row (t, h) at
    ``o_ptr + o_row[t] + h * o_sh`` for the tokens in ``o_ok``. A float8 target (``FP8``: its kind) stores the
    values divided by ``hs_ptr[h]`` (``HEAD_SCALES``: per-head cache scales), or (``DYNAMIC``) by each row's own
    scale ``max |row| / fp8 max``, stored as float32 at ``so_ptr + so_row[t] + h * so_sh``. ``COL_PACK``: the
    target's columns are at :func:`_cols` (a packed or strided cache row)."""
    HAS_PASS: tl.constexpr = HEAD_DIM != ROT_DIM
    x_base, m = _head_tile(b, s, mask_t, h0, H, x_sb, x_ss, x_sh, BLOCK_H)
    x_lo, x_hi, x_p = _load_heads(x_ptr, x_base, m, HEAD_DIM, ROT_DIM, ROT_START, NEOX, HALF_BLOCK, PASS_BLOCK,
                                  HAS_PASS, True)
    if NORM:
        r = _inv_rms(x_lo, x_hi, x_p, eps, HEAD_DIM, HAS_PASS, HALF_BLOCK.bit_length() - 1,
                     PASS_BLOCK.bit_length() - 1)
        w_lo, w_hi, w_p = _norm_weights(w_ptr, w_offset, ROT_DIM, ROT_START, NEOX, HEAD_DIM, HALF_BLOCK,
                                        PASS_BLOCK, HAS_PASS)
        x_lo = x_lo * r * w_lo
        x_hi = x_hi * r * w_hi
        x_p = x_p * r * w_p
    c_lo, c_hi, s_a, s_b = _rotation(
        b, s, pos, valid, mask_t, freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale * scale,
        pos_ptr, pos_sa, pos_sb, pos_ss, ROT_DIM, HALF_BLOCK, NEOX, FREQ_MODE, TABLE_BY_TOKEN, TABLE_FULL,
        False, FAST_TRIG, NUM_AXES, AXES_INTERLEAVED, AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3, False)
    y_lo, y_hi = _turn(x_lo, x_hi, c_lo, c_hi, s_a, s_b)
    y_p = x_p * scale
    h = h0 + tl.arange(0, BLOCK_H)
    if HEAD_SCALES:
        hs = (1.0 / tl.load(hs_ptr + h, mask=h < H, other=1.0).to(tl.float32))[None, :, None]
        y_lo, y_hi, y_p = y_lo * hs, y_hi * hs, y_p * hs
    if DYNAMIC:
        amax = _row_amax(y_lo, y_hi, y_p, ROT_DIM, HEAD_DIM, ROT_START, HALF_BLOCK, PASS_BLOCK, HAS_PASS)
        if FP8 == FP8_E5M2:
            row_scale = amax / FP8_E5M2_MAX
        else:
            row_scale = amax / FP8_E4M3_MAX
        div = tl.where(row_scale > 0, row_scale, 1.0)[:, :, None]  # an all-zero row: scale 0, zeros stored
        y_lo, y_hi, y_p = y_lo / div, y_hi / div, y_p / div
        tl.store(so_ptr + so_row[:, None] + (h.to(tl.int64) * so_sh)[None, :], row_scale,
                 mask=o_ok[:, None] & (h < H)[None, :])
    o_base = o_row[:, None, None] + (h.to(tl.int64) * o_sh)[None, :, None]
    om = (o_ok[:, None] & (h < H)[None, :])[:, :, None]
    # compiled kernels saturate float8_e4m3fn in the store; the interpreter's values, and e5m2, come ready
    STORE_FP8: tl.constexpr = FP8 == FP8_E4M3 and not ROUND_FP8
    if COL_PACK:
        _store_pairs_at(o_ptr, o_base, om, _fp8_for_interpreter(y_lo, FP8, ROUND_FP8),
                        _fp8_for_interpreter(y_hi, FP8, ROUND_FP8), _fp8_for_interpreter(y_p, FP8, ROUND_FP8),
                        COL_PACK, col_sa, col_sb, HEAD_DIM, ROT_DIM, ROT_START, NEOX, HALF_BLOCK, PASS_BLOCK,
                        STORE_FP8)
    else:
        _store_pairs(o_ptr, o_base, om, _fp8_for_interpreter(y_lo, FP8, ROUND_FP8),
                     _fp8_for_interpreter(y_hi, FP8, ROUND_FP8), _fp8_for_interpreter(y_p, FP8, ROUND_FP8),
                     HEAD_DIM, ROT_DIM, ROT_START, NEOX, HALF_BLOCK, PASS_BLOCK, HAS_PASS, STORE_FP8, False)


@triton.jit
def _copy_block(x_ptr, x_sb, x_ss, x_sh, o_ptr, o_row, o_ok, o_sh, b, s, mask_t, h0, H, scale,
                HEAD_DIM: tl.constexpr, D_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, FP8: tl.constexpr,
                ROUND_FP8: tl.constexpr, COL_PACK: tl.constexpr = 0, col_sa=0, col_sb=0):
    """Copy one block of head rows of ``x`` to rows ``o_row`` of ``o`` (columns at :func:`_cols`): bit for bit in
    the same dtype, else ``x * scale`` (a scalar, or per head [1, BLOCK_H, 1]) converted to the float8 kind ``FP8``
    (saturated)."""
    x_base, m = _head_tile(b, s, mask_t, h0, H, x_sb, x_ss, x_sh, BLOCK_H)
    d = tl.arange(0, D_BLOCK)[None, None, :]
    x = tl.load(x_ptr + x_base + d, mask=_within(m, d, HEAD_DIM, D_BLOCK))
    h = h0 + tl.arange(0, BLOCK_H)
    o_base = o_row[:, None, None] + (h.to(tl.int64) * o_sh)[None, :, None]
    om = _within((o_ok[:, None] & (h < H)[None, :])[:, :, None], d, HEAD_DIM, D_BLOCK)
    if FP8:
        STORE_FP8: tl.constexpr = FP8 == FP8_E4M3 and not ROUND_FP8  # see _norm_rope_block
        y = _to_store(_fp8_for_interpreter(x.to(tl.float32) * scale, FP8, ROUND_FP8), o_ptr, STORE_FP8, False)
    else:
        y = x.to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + o_base + _cols(d, COL_PACK, col_sa, col_sb), y, mask=om)


# pos_offset changes on every decode step: not specialised on (see rope_kernel).
@triton.jit(do_not_specialize=["pos_offset"])
def prologue_kernel(
    q_ptr, qo_ptr, k_ptr, ko_ptr, v_ptr, vo_ptr,
    q_sb, q_ss, q_sh, qo_sb, qo_ss, qo_sh, k_sb, k_ss, k_sh, ko_sb, ko_ss, ko_sh,
    v_sb, v_ss, v_sh, vo_sh,
    HQ, HK, S, num_tokens,
    pos_ptr, pos_sb, pos_ss, seq_off_ptr, pos_offset, cu_ptr, n_seqs, n_search_steps,
    freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows,
    q_scale, k_scale, rotary_scale, pos_sa,
    qw_ptr, kw_ptr, w_offset, eps,
    cb_ptr, slot_ptr, slot_sb, slot_ss, cache_rows, block_size, kc_sb, kc_ss, vc_sb, vc_ss, ks_ptr, vs_ptr, v_scale,
    qs_ptr, qd_ptr, qd_sb, qd_ss, qd_sh, kd_ptr, kd_sb, kd_ss, kd_sh, n_slots, kr_ptr, kr_sb, kr_ss, kr_sh, kr_scale,
    pages_ptr, indptr_ptr, last_ptr, n_requests, n_page_ids, kc_sa, kc_sx, vc_sa, vc_sx,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, ROT_START: tl.constexpr, NEOX: tl.constexpr,
    POS_MODE: tl.constexpr, HAS_SEQ_OFFSETS: tl.constexpr, FREQ_MODE: tl.constexpr,
    TABLE_BY_TOKEN: tl.constexpr, TABLE_FULL: tl.constexpr, FAST_TRIG: tl.constexpr, NUM_AXES: tl.constexpr,
    AXES_INTERLEAVED: tl.constexpr, AXIS_BOUND_1: tl.constexpr, AXIS_BOUND_2: tl.constexpr,
    AXIS_BOUND_3: tl.constexpr, NORM: tl.constexpr, CACHE_MODE: tl.constexpr, CACHE_BATCH_PER_TOKEN: tl.constexpr,
    K_SCALE_PTR: tl.constexpr, V_SCALE_PTR: tl.constexpr, K_FP8: tl.constexpr, V_FP8: tl.constexpr,
    ROUND_FP8: tl.constexpr, Q_FP8: tl.constexpr, Q_SCALE_PTR: tl.constexpr, Q_DYNAMIC: tl.constexpr,
    K_DYNAMIC: tl.constexpr, SLOTS_SHORT: tl.constexpr, K_RETURN: tl.constexpr, TABLE_BATCH: tl.constexpr,
    K_PACK: tl.constexpr, V_PACK: tl.constexpr, K_UNIT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """A program normalises (``NORM``) and rotates one block of heads of q or of k for ``BLOCK_T`` tokens, q into
    ``qo`` and k into ``ko`` (a cache unless ``CACHE_MODE`` is ``CACHE_NONE``, whose row strides are
    ``kc_sb``/``kc_ss``), or copies a block of v's heads into the v cache ``vo`` (row strides ``vc_sb``/``vc_ss``,
    head stride ``vo_sh``: the two caches' strides may differ). With ``K_SCALE_PTR``/``V_SCALE_PTR`` a cache's
    scale is read from a device scalar (1: graph capture) or per head (2: ``[HK]``); else ``k_scale`` and
    ``v_scale`` already hold it (divided in). float8 outputs: ``Q_FP8``/``K_FP8`` name the float8 kind of q's and
    k's target (1 e4m3fn, 2 e5m2); ``Q_SCALE_PTR`` reads q's output scale from ``qs_ptr`` (k's, without a cache,
    from ``ks_ptr``); ``Q_DYNAMIC``/``K_DYNAMIC`` (k: no cache) scale each row by its own ``max |row| / fp8 max``,
    stored as float32 [B, S, H] at ``qd_ptr``/``kd_ptr`` (strides ``*d_sb``, ``*d_ss``, ``*d_sh``).
    ``SLOTS_SHORT``: a paged write's ``slot_mapping`` covers the first ``n_slots`` tokens only (the rest: padding,
    rotated but not written). ``K_RETURN`` (with a cache): k's rows are also rotated into ``kr_ptr`` (strides
    ``kr_sb``, ``kr_ss``, ``kr_sh``; scale ``kr_scale``, no cache scale), recomputed from the loaded rows.
    ``CACHE_TABLE``: rows from the page table (:func:`_cache_rows`; ``TABLE_BATCH``: ``slot_ptr`` holds
    batch_indices). ``K_PACK``/``V_PACK``: the k/v cache's columns are at ``(d // PACK) * c_sa + (d % PACK) *
    c_sx`` (``kc_sa``, ``kc_sx``, ``vc_sa``, ``vc_sx``), else at d. ``K_UNIT``: the k cache's strides other than
    ``kc_sx`` arrive divided by it (x-packed keys: x), so that the compiler sees each run of x columns aligned and
    stores it as one vector. ``PDL``: launched as a programmatic dependent launch, whose grid may start before
    the previous kernel on the stream ends: wait for that kernel's memory before the first load (and store)."""
    if PDL:
        gdc_wait()
    hb = tl.program_id(0)
    tb = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
    n_qb = tl.cdiv(HQ, BLOCK_HQ)
    n_kb = tl.cdiv(HK, BLOCK_HK)
    t, mask_t, b, s = _token_block(tb, num_tokens, S, BLOCK_T)
    pos, valid = _token_positions(t, b, s, mask_t, pos_ptr, pos_sb, pos_ss, seq_off_ptr, pos_offset, cu_ptr,
                                  n_seqs, n_search_steps, POS_MODE, HAS_SEQ_OFFSETS)
    valid = valid & mask_t
    if CACHE_MODE == CACHE_NONE:
        r0 = b
        r1 = s
        k_ok = mask_t
    else:
        # Tokens whose rotation is NaN write no cache row: past a position-indexed table, or (multi-axis) invalid
        # on a later axis, as well as invalid on the first.
        row_valid = valid
        if FREQ_MODE == FREQ_TABLE or FREQ_MODE == FREQ_ANGLES:
            if not TABLE_BY_TOKEN:
                row_valid = row_valid & (pos < table_rows)
        for a in tl.static_range(1, NUM_AXES):
            row_valid = row_valid & _axis_valid(a, b, s, mask_t, pos_ptr, pos_sa, pos_sb, pos_ss)
        r0, r1, k_ok = _cache_rows(t, b, s, pos, row_valid, mask_t, cb_ptr, slot_ptr, slot_sb, slot_ss, cache_rows,
                                   block_size, n_slots, pages_ptr, indptr_ptr, last_ptr, n_requests, n_page_ids,
                                   CACHE_MODE, CACHE_BATCH_PER_TOKEN, SLOTS_SHORT, TABLE_BATCH)
    if hb < n_qb:
        scale = q_scale
        if Q_SCALE_PTR:
            scale = scale / tl.load(qs_ptr).to(tl.float32)
        _norm_rope_block(
            q_ptr, q_sb, q_ss, q_sh, qo_ptr, b * qo_sb + s * qo_ss, mask_t, qo_sh, qw_ptr, w_offset, eps, scale,
            b, s, pos, valid, mask_t, hb * BLOCK_HQ, HQ,
            pos_ptr, pos_sb, pos_ss, freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale,
            pos_sa, qs_ptr, qd_ptr, b * qd_sb + s * qd_ss, qd_sh,
            HEAD_DIM, ROT_DIM, ROT_START, NEOX, FREQ_MODE, TABLE_BY_TOKEN, TABLE_FULL, FAST_TRIG,
            NUM_AXES, AXES_INTERLEAVED, AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3, NORM, Q_FP8, ROUND_FP8, BLOCK_HQ,
            HALF_BLOCK, PASS_BLOCK, False, Q_DYNAMIC)
    elif hb < n_qb + n_kb:
        scale = k_scale
        if K_SCALE_PTR == 1:
            scale = scale / tl.load(ks_ptr).to(tl.float32)
        if CACHE_MODE == CACHE_NONE:
            k_row = r0 * ko_sb + r1 * ko_ss
        else:
            k_row = r0 * kc_sb * K_UNIT + r1 * kc_ss * K_UNIT
        _norm_rope_block(
            k_ptr, k_sb, k_ss, k_sh, ko_ptr, k_row, k_ok, ko_sh * K_UNIT, kw_ptr, w_offset, eps, scale,
            b, s, pos, valid, mask_t, (hb - n_qb) * BLOCK_HK, HK,
            pos_ptr, pos_sb, pos_ss, freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale,
            pos_sa, ks_ptr, kd_ptr, b * kd_sb + s * kd_ss, kd_sh,
            HEAD_DIM, ROT_DIM, ROT_START, NEOX, FREQ_MODE, TABLE_BY_TOKEN, TABLE_FULL, FAST_TRIG,
            NUM_AXES, AXES_INTERLEAVED, AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3, NORM, K_FP8, ROUND_FP8, BLOCK_HK,
            HALF_BLOCK, PASS_BLOCK, K_SCALE_PTR == 2, K_DYNAMIC, K_PACK, kc_sa * K_UNIT, kc_sx)
        if K_RETURN:  # the rotated k itself too, in k's dtype (the same values qk_norm_rope returns)
            _norm_rope_block(
                k_ptr, k_sb, k_ss, k_sh, kr_ptr, b * kr_sb + s * kr_ss, mask_t, kr_sh, kw_ptr, w_offset, eps,
                kr_scale, b, s, pos, valid, mask_t, (hb - n_qb) * BLOCK_HK, HK,
                pos_ptr, pos_sb, pos_ss, freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale,
                pos_sa, ks_ptr, kd_ptr, 0, 0,
                HEAD_DIM, ROT_DIM, ROT_START, NEOX, FREQ_MODE, TABLE_BY_TOKEN, TABLE_FULL, FAST_TRIG,
                NUM_AXES, AXES_INTERLEAVED, AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3, NORM, 0, ROUND_FP8, BLOCK_HK,
                HALF_BLOCK, PASS_BLOCK, False, False)
    else:
        scale = v_scale
        if V_SCALE_PTR == 1:
            scale = 1.0 / tl.load(vs_ptr).to(tl.float32)
        elif V_SCALE_PTR == 2:  # per head
            h = (hb - n_qb - n_kb) * BLOCK_HK + tl.arange(0, BLOCK_HK)
            scale = (1.0 / tl.load(vs_ptr + h, mask=h < HK, other=1.0).to(tl.float32))[None, :, None]
        _copy_block(v_ptr, v_sb, v_ss, v_sh, vo_ptr, r0 * vc_sb + r1 * vc_ss, k_ok, vo_sh, b, s, mask_t,
                    (hb - n_qb - n_kb) * BLOCK_HK, HK, scale, HEAD_DIM, D_BLOCK, BLOCK_HK, V_FP8, ROUND_FP8, V_PACK,
                    vc_sa, vc_sx)


@triton.jit
def _norm_rope_bwd_block(
    g_ptr, g_sb, g_ss, g_sh, x_ptr, x_sb, x_ss, x_sh, dx_ptr, dx_sb, dx_ss, dx_sh, w_lo, w_hi, w_p, eps, scale,
    b, s, pos, valid, mask_t, h0, H,
    pos_ptr, pos_sb, pos_ss, freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale, pos_sa,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, ROT_START: tl.constexpr, NEOX: tl.constexpr,
    FREQ_MODE: tl.constexpr, TABLE_BY_TOKEN: tl.constexpr, TABLE_FULL: tl.constexpr, FAST_TRIG: tl.constexpr,
    NUM_AXES: tl.constexpr, AXES_INTERLEAVED: tl.constexpr, AXIS_BOUND_1: tl.constexpr,
    AXIS_BOUND_2: tl.constexpr, AXIS_BOUND_3: tl.constexpr, BLOCK_H: tl.constexpr, HALF_BLOCK: tl.constexpr,
    PASS_BLOCK: tl.constexpr,
):
    """Gradients of one block of head rows of ``y = rotate(x * r * w) * scale`` (``w``: the weights plus their
    offset at the lo, hi and pass-through columns, loaded once by the caller): the rotation's
    transpose first (the same rotation, conjugated), then the norm's backward. ``dx`` goes to ``dx_ptr``; returns
    the block's weight-gradient terms ``g * x * r`` at the lo, hi and pass-through columns, per row (the caller
    sums them once, after its loop: a sum over heads here would cross warps on every token block)."""
    HAS_PASS: tl.constexpr = HEAD_DIM != ROT_DIM
    g_base, m = _head_tile(b, s, mask_t, h0, H, g_sb, g_ss, g_sh, BLOCK_H)
    g_lo, g_hi, g_p = _load_heads(g_ptr, g_base, m, HEAD_DIM, ROT_DIM, ROT_START, NEOX, HALF_BLOCK, PASS_BLOCK,
                                  HAS_PASS, True)
    x_base, _ = _head_tile(b, s, mask_t, h0, H, x_sb, x_ss, x_sh, BLOCK_H)
    x_lo, x_hi, x_p = _load_heads(x_ptr, x_base, m, HEAD_DIM, ROT_DIM, ROT_START, NEOX, HALF_BLOCK, PASS_BLOCK,
                                  HAS_PASS, True)
    c_lo, c_hi, s_a, s_b = _rotation(
        b, s, pos, valid, mask_t, freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale * scale,
        pos_ptr, pos_sa, pos_sb, pos_ss, ROT_DIM, HALF_BLOCK, NEOX, FREQ_MODE, TABLE_BY_TOKEN, TABLE_FULL,
        True, FAST_TRIG, NUM_AXES, AXES_INTERLEAVED, AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3, False)
    # d loss / d(normalised x): the conjugate rotation of the output gradient
    n_lo, n_hi = _turn(g_lo, g_hi, c_lo, c_hi, s_a, s_b)
    n_p = g_p * scale
    r = _inv_rms(x_lo, x_hi, x_p, eps, HEAD_DIM, HAS_PASS, HALF_BLOCK.bit_length() - 1,
                     PASS_BLOCK.bit_length() - 1)
    dh_lo, dh_hi, dh_p = n_lo * w_lo, n_hi * w_hi, n_p * w_p
    # With xh = x * r: dx = r * (dh - xh * mean(dh * xh)) = r * dh - x * (r**3 * mean(dh * x)). The row sum of
    # dh * x needs no r, so it runs beside the sum of squares rather than after it (one row reduction on the
    # latency path of each token block instead of two), and no xh tile is formed.
    dot = tl.sum(dh_lo * x_lo, axis=2) + tl.sum(dh_hi * x_hi, axis=2)
    if HAS_PASS:
        dot += tl.sum(dh_p * x_p, axis=2)
    c = (dot / HEAD_DIM)[:, :, None] * r * r * r  # in this order: r**3 alone overflows for tiny rows and eps
    dx_base, _ = _head_tile(b, s, mask_t, h0, H, dx_sb, dx_ss, dx_sh, BLOCK_H)
    _store_pairs(dx_ptr, dx_base, m, r * dh_lo - x_lo * c, r * dh_hi - x_hi * c, r * dh_p - x_p * c,
                 HEAD_DIM, ROT_DIM, ROT_START, NEOX, HALF_BLOCK, PASS_BLOCK, HAS_PASS, False, False)
    # The weight's gradient n * x * r: rows outside the block (NaN rotations of padded tokens included) contribute
    # nothing.
    dw_lo = tl.where(m, n_lo * x_lo, 0.0) * r
    dw_hi = tl.where(m, n_hi * x_hi, 0.0) * r
    dw_p = dw_lo  # no pass-through columns: unused
    if HAS_PASS:
        dw_p = tl.where(m, n_p * x_p, 0.0) * r
    return dw_lo, dw_hi, dw_p


@triton.jit
def _norm_rope_bwd_heads(
    g_ptr, g_sb, g_ss, g_sh, x_ptr, x_sb, x_ss, x_sh, dx_ptr, dx_sb, dx_ss, dx_sh, w_ptr, w_offset, eps, scale,
    dw_ptr, dw_row, dw_rows, cnt_ptr, dwo_ptr, h0, H, S, num_tokens, n_token_blocks,
    pos_ptr, pos_sb, pos_ss, seq_off_ptr, pos_offset, cu_ptr, n_seqs, n_search_steps,
    freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale, pos_sa,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, ROT_START: tl.constexpr, NEOX: tl.constexpr,
    POS_MODE: tl.constexpr, HAS_SEQ_OFFSETS: tl.constexpr, FREQ_MODE: tl.constexpr, TABLE_BY_TOKEN: tl.constexpr,
    TABLE_FULL: tl.constexpr, FAST_TRIG: tl.constexpr, NUM_AXES: tl.constexpr, AXES_INTERLEAVED: tl.constexpr,
    AXIS_BOUND_1: tl.constexpr, AXIS_BOUND_2: tl.constexpr, AXIS_BOUND_3: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr,
    FAN_IN: tl.constexpr, SUM_LEVELS: tl.constexpr, STAGES: tl.constexpr,
):
    """One block of heads over every ``num_programs(1)``-th token block from ``program_id(1)`` on: the gradients
    of its rows, and the sum of their weight-gradient terms, stored once as row ``dw_row`` of the ``dw_rows``
    partial rows at ``dw_ptr``, which :func:`_sum_weight_rows` then adds into the weight's gradient ``dwo_ptr``.
    The program loops (rather than one program per token block writing a partial row) so that the partial rows
    are a few thousand at most, not one per token block."""
    HAS_PASS: tl.constexpr = HEAD_DIM != ROT_DIM
    HALF: tl.constexpr = ROT_DIM // 2
    # per-row accumulators, in the tiles' own layout: summed over tokens and heads once, after the loop
    acc_lo = tl.zeros([BLOCK_T, BLOCK_H, HALF_BLOCK], tl.float32)
    acc_hi = tl.zeros([BLOCK_T, BLOCK_H, HALF_BLOCK], tl.float32)
    acc_p = tl.zeros([BLOCK_T, BLOCK_H, PASS_BLOCK], tl.float32)
    w_lo, w_hi, w_p = _norm_weights(w_ptr, w_offset, ROT_DIM, ROT_START, NEOX, HEAD_DIM, HALF_BLOCK, PASS_BLOCK,
                                    HAS_PASS)
    for tb in tl.range(tl.program_id(1), n_token_blocks, tl.num_programs(1), num_stages=STAGES):
        t, mask_t, b, s = _token_block(tb, num_tokens, S, BLOCK_T)
        pos, valid = _token_positions(t, b, s, mask_t, pos_ptr, pos_sb, pos_ss, seq_off_ptr, pos_offset, cu_ptr,
                                      n_seqs, n_search_steps, POS_MODE, HAS_SEQ_OFFSETS)
        d_lo, d_hi, d_p = _norm_rope_bwd_block(
            g_ptr, g_sb, g_ss, g_sh, x_ptr, x_sb, x_ss, x_sh, dx_ptr, dx_sb, dx_ss, dx_sh, w_lo, w_hi, w_p, eps,
            scale, b, s, pos, valid & mask_t, mask_t, h0, H,
            pos_ptr, pos_sb, pos_ss, freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale, pos_sa,
            HEAD_DIM, ROT_DIM, ROT_START, NEOX, FREQ_MODE, TABLE_BY_TOKEN, TABLE_FULL, FAST_TRIG, NUM_AXES,
            AXES_INTERLEAVED, AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3, BLOCK_H, HALF_BLOCK, PASS_BLOCK)
        acc_lo += d_lo
        acc_hi += d_hi
        if HAS_PASS:
            acc_p += d_p
    col_lo, col_hi = _pair_columns(ROT_START, HALF, NEOX, HALF_BLOCK)
    i = tl.arange(0, HALF_BLOCK)
    row = dw_ptr + dw_row * HEAD_DIM
    tl.store(row + tl.reshape(col_lo, [HALF_BLOCK]), tl.sum(tl.sum(acc_lo, axis=1), axis=0), mask=i < HALF)
    tl.store(row + tl.reshape(col_hi, [HALF_BLOCK]), tl.sum(tl.sum(acc_hi, axis=1), axis=0), mask=i < HALF)
    if HAS_PASS:
        p, mp = _pass_columns(tl.full([1, 1, 1], 1, tl.int1), HEAD_DIM, ROT_DIM, ROT_START, PASS_BLOCK)
        tl.store(row + tl.reshape(p, [PASS_BLOCK]), tl.sum(tl.sum(acc_p, axis=1), axis=0),
                 mask=tl.reshape(mp, [PASS_BLOCK]))
    _sum_weight_rows(dw_ptr, cnt_ptr, dwo_ptr, dw_row, dw_rows, HEAD_DIM, D_BLOCK, FAN_IN, SUM_LEVELS)


@triton.jit
def _sum_weight_rows(dw_ptr, cnt_ptr, out_ptr, row, n_rows, HEAD_DIM: tl.constexpr, D_BLOCK: tl.constexpr,
                     FAN_IN: tl.constexpr, SUM_LEVELS: tl.constexpr):
    """Called by every program once it has stored its partial row ``row`` of the ``n_rows`` at ``dw_ptr``: the
    sum of all of them into ``out_ptr`` ([HEAD_DIM], in its dtype), as a tree of ``FAN_IN`` children per node,
    ``SUM_LEVELS`` levels (FAN_IN ** SUM_LEVELS >= n_rows), each level's rows stored after the one below in
    ``dw_ptr``. A node is summed by the last of its children to finish (one arrival counter per node in
    ``cnt_ptr``, zero at the start and set back to zero by that last child), which then arrives at its own
    parent; the root writes the output.
    Which program sums a node depends on timing, the order of each sum does not: the same bits on every run.
    This replaces a torch reduction and a cast after the launch (two more kernels per weight, and their host
    time)."""
    c = tl.arange(0, D_BLOCK)
    r = tl.arange(0, FAN_IN)[:, None]
    n = n_rows  # nodes at this level
    base = 0  # this level's first row in dw_ptr
    counters = cnt_ptr
    go = tl.full([], 1, tl.int1)  # this program still climbs: it was the last child of every node so far
    for _ in tl.static_range(SUM_LEVELS):
        parent = row // FAN_IN
        children = tl.minimum(n - parent * FAN_IN, FAN_IN)
        n_up = tl.cdiv(n, FAN_IN)
        if go:  # a branch, not a mask: a program that stopped climbing waits on no further arrival
            # every thread's stores of the child row come before the release of the arrival; the acquire of the
            # last arrival comes before its loads of the siblings' rows (read through L2: never a stale L1 line).
            # On NVIDIA the PTX is bar.sync, then one thread's atom.acq_rel.gpu, its result shared behind a second
            # bar.sync. On AMD (gfx942) the barrier is not preceded by a wait for the other waves' stores, so the
            # order rests on the compiler's memory model across a workgroup barrier: not run on AMD hardware yet.
            tl.debug_barrier()
            arrived = tl.atomic_add(counters + parent, 1, sem="acq_rel", scope="gpu")
            go = arrived == children - 1
            # the last arrival sets the counter back to zero for the next launch on the stream (the counters live
            # in a workspace kept between launches: no memset per launch); no other program touches it again
            tl.store(counters + parent, 0, mask=go)
            rows = base + parent * FAN_IN + r
            x = tl.load(dw_ptr + rows * HEAD_DIM + c[None, :], mask=go & (r < children) & (c[None, :] < HEAD_DIM),
                        other=0.0, cache_modifier=".cg")
            total = tl.sum(x, axis=0)
            tl.store(dw_ptr + (base + n + parent) * HEAD_DIM + c, total, mask=go & (c < HEAD_DIM) & (n_up > 1))
            tl.store(out_ptr + c, total.to(out_ptr.dtype.element_ty), mask=go & (c < HEAD_DIM) & (n_up == 1))
            go = go & (n_up > 1)
        base += n
        counters += n_up
        row = parent
        n = n_up


@triton.jit(do_not_specialize=["pos_offset"])
def norm_rope_bwd_kernel(
    gq_ptr, q_ptr, dq_ptr, gk_ptr, k_ptr, dk_ptr, dwq_ptr, dwk_ptr, cnt_ptr, dwqo_ptr, dwko_ptr,
    gq_sb, gq_ss, gq_sh, q_sb, q_ss, q_sh, dq_sb, dq_ss, dq_sh,
    gk_sb, gk_ss, gk_sh, k_sb, k_ss, k_sh, dk_sb, dk_ss, dk_sh,
    HQ, HK, S, num_tokens,
    pos_ptr, pos_sb, pos_ss, seq_off_ptr, pos_offset, cu_ptr, n_seqs, n_search_steps,
    freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows,
    q_scale, k_scale, rotary_scale, pos_sa,
    qw_ptr, kw_ptr, w_offset, eps, n_token_blocks, k_counters,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, ROT_START: tl.constexpr, NEOX: tl.constexpr,
    POS_MODE: tl.constexpr, HAS_SEQ_OFFSETS: tl.constexpr, FREQ_MODE: tl.constexpr,
    TABLE_BY_TOKEN: tl.constexpr, TABLE_FULL: tl.constexpr, FAST_TRIG: tl.constexpr, NUM_AXES: tl.constexpr,
    AXES_INTERLEAVED: tl.constexpr, AXIS_BOUND_1: tl.constexpr, AXIS_BOUND_2: tl.constexpr,
    AXIS_BOUND_3: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr, FAN_IN: tl.constexpr,
    Q_SUM_LEVELS: tl.constexpr, K_SUM_LEVELS: tl.constexpr, STAGES: tl.constexpr,
):
    """The backward of ``prologue_kernel`` with a norm and no cache. Grid (head blocks of q then k, G): a program
    handles one block of heads for every G-th token block and writes its weight-gradient sum to row
    ``program_id(1) * n_blocks + head block`` of ``dwq``/``dwk`` (fp32, [G * n_blocks, D] and the tree's upper
    levels after them); the tree's roots are the weight gradients ``dwqo``/``dwko`` ([D], the weights' dtypes).
    ``cnt_ptr``: the trees' arrival counters, zero, q's first and k's from ``k_counters`` on; zero again when the
    launch ends."""
    hb = tl.program_id(0)
    n_qb = tl.cdiv(HQ, BLOCK_HQ)
    n_kb = tl.cdiv(HK, BLOCK_HK)
    G = tl.num_programs(1)
    g = tl.program_id(1).to(tl.int64)
    if hb < n_qb:
        _norm_rope_bwd_heads(
            gq_ptr, gq_sb, gq_ss, gq_sh, q_ptr, q_sb, q_ss, q_sh, dq_ptr, dq_sb, dq_ss, dq_sh, qw_ptr, w_offset, eps,
            q_scale, dwq_ptr, g * n_qb + hb, G * n_qb, cnt_ptr, dwqo_ptr, hb * BLOCK_HQ, HQ, S, num_tokens,
            n_token_blocks,
            pos_ptr, pos_sb, pos_ss, seq_off_ptr, pos_offset, cu_ptr, n_seqs, n_search_steps,
            freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale, pos_sa,
            HEAD_DIM, ROT_DIM, ROT_START, NEOX, POS_MODE, HAS_SEQ_OFFSETS, FREQ_MODE, TABLE_BY_TOKEN, TABLE_FULL,
            FAST_TRIG, NUM_AXES, AXES_INTERLEAVED, AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3, BLOCK_T, BLOCK_HQ,
            HALF_BLOCK, PASS_BLOCK, D_BLOCK, FAN_IN, Q_SUM_LEVELS, STAGES)
    else:
        _norm_rope_bwd_heads(
            gk_ptr, gk_sb, gk_ss, gk_sh, k_ptr, k_sb, k_ss, k_sh, dk_ptr, dk_sb, dk_ss, dk_sh, kw_ptr, w_offset, eps,
            k_scale, dwk_ptr, g * n_kb + (hb - n_qb), G * n_kb, cnt_ptr + k_counters, dwko_ptr,
            (hb - n_qb) * BLOCK_HK, HK, S, num_tokens, n_token_blocks,
            pos_ptr, pos_sb, pos_ss, seq_off_ptr, pos_offset, cu_ptr, n_seqs, n_search_steps,
            freq_ptr, cos_ptr, sin_ptr, t_sb, t_sr, t_sc, table_rows, rotary_scale, pos_sa,
            HEAD_DIM, ROT_DIM, ROT_START, NEOX, POS_MODE, HAS_SEQ_OFFSETS, FREQ_MODE, TABLE_BY_TOKEN, TABLE_FULL,
            FAST_TRIG, NUM_AXES, AXES_INTERLEAVED, AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3, BLOCK_T, BLOCK_HK,
            HALF_BLOCK, PASS_BLOCK, D_BLOCK, FAN_IN, K_SUM_LEVELS, STAGES)
