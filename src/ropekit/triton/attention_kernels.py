"""RoPE fused into attention (:func:`ropekit.rope_attention`): flash-attention kernels that rotate q and k as they
load them, forward and backward.

Tensors arrive canonical, ``[B, S, H, D]`` with any strides but a contiguous last dim. The rotation's angles come
as one float32 row per token (``tab``: the core kernel's rotation of a unit vector, so every position mode and
frequency source of :func:`ropekit.apply_rope` gives the same exact angles here): for the pair ``(c1, c2)`` of
rotated columns, ``tab[c1]`` is its cosine and ``tab[c2]`` its sine, in both pairings. ``q_r = q_scale * R(theta) q``
and ``k_r = k_scale * R(theta) k`` are rounded to the input dtype, as :func:`ropekit.apply_rope` would store them.
Each kernel rotates the rows it keeps resident as it loads them (q in the forward and dq kernels, k in the dk/dv
kernel); the operand it streams over, which every program re-reads, it takes either rotated as it loads (the
``*_ROTATED`` constexprs False) or from a transient copy rotated once by :func:`rope_attention_rotate_kernel`. The
backward rotates dq and dk by -theta before storing them.

Scores are kept in base 2: ``t = (q_r . k_r) * QK_MULT`` with ``QK_MULT = scale * log2(e)`` (base-e softmax) or
``scale`` (base-2 softmax), so the softmax runs on ``exp2``. ``lse`` is stored as the natural log of the row's sum.
"""

from __future__ import annotations

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _pair_columns(HALF_BLOCK: tl.constexpr, ROT_START: tl.constexpr, ROT_HALF: tl.constexpr, NEOX: tl.constexpr):
    """Column indices of each pair's two halves and the mask of real pairs (the block is padded to a power of 2)."""
    i = tl.arange(0, HALF_BLOCK)
    if NEOX:
        c1 = ROT_START + i
        c2 = c1 + ROT_HALF
    else:
        c1 = ROT_START + 2 * i
        c2 = c1 + 1
    return c1, c2, i < ROT_HALF


@triton.jit
def _load_tile(ptr, row_ok, col_ok, ROWS_IN: tl.constexpr, COLS_IN: tl.constexpr):
    """Load a [rows, cols] tile, masking only what may lie outside (``ROWS_IN``/``COLS_IN``: known in range), 0
    where masked: interior tiles take no mask at all."""
    if ROWS_IN:
        if COLS_IN:
            x = tl.load(ptr)
        else:
            x = tl.load(ptr, mask=col_ok[None, :], other=0.0)
    else:
        if COLS_IN:
            x = tl.load(ptr, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(ptr, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    return x


@triton.jit
def _operand(x, DTYPE: tl.constexpr, DOT_F32: tl.constexpr):
    """``x`` rounded to the input dtype, as a matrix-product operand: in that dtype, or (``DOT_F32``: the
    interpreter, whose bf16 products are wrong) its exact float32 value."""
    x = x.to(DTYPE)
    if DOT_F32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _load_rotated(row_ptr, tab_row_ptr, row_ok, c1, c2, pair_ok, scale, ROWS_IN: tl.constexpr,
                  PAIRS_IN: tl.constexpr, DTYPE: tl.constexpr, DOT_F32: tl.constexpr, ROTATE: tl.constexpr,
                  ARRIVE_ROTATED: tl.constexpr):
    """The rows' rotated halves ``scale * R(theta) x`` rounded to ``DTYPE`` ([rows, HALF_BLOCK] each; 0 where
    masked), as product operands. ``ARRIVE_ROTATED``: the rows are a copy already rotated and scaled
    (:func:`rope_attention_rotate_kernel`), loaded straight into the products. ``ROTATE`` False (benchmarks only:
    the cost of the rotation apart from the attention) skips the rotation."""
    if ARRIVE_ROTATED:
        x1 = _load_tile(row_ptr + c1[None, :], row_ok, pair_ok, ROWS_IN, PAIRS_IN)
        x2 = _load_tile(row_ptr + c2[None, :], row_ok, pair_ok, ROWS_IN, PAIRS_IN)
        return _operand(x1, DTYPE, DOT_F32), _operand(x2, DTYPE, DOT_F32)
    x1 = _load_tile(row_ptr + c1[None, :], row_ok, pair_ok, ROWS_IN, PAIRS_IN).to(tl.float32)
    x2 = _load_tile(row_ptr + c2[None, :], row_ok, pair_ok, ROWS_IN, PAIRS_IN).to(tl.float32)
    if ROTATE:
        cos = _load_tile(tab_row_ptr + c1[None, :], row_ok, pair_ok, ROWS_IN, PAIRS_IN)
        sin = _load_tile(tab_row_ptr + c2[None, :], row_ok, pair_ok, ROWS_IN, PAIRS_IN)
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return _operand(x1 * scale, DTYPE, DOT_F32), _operand(x2 * scale, DTYPE, DOT_F32)


@triton.jit
def _load_pass(row_ptr, row_ok, pc, pass_ok, scale, ROWS_IN: tl.constexpr, PASS_IN: tl.constexpr,
               DTYPE: tl.constexpr, DOT_F32: tl.constexpr):
    x = _load_tile(row_ptr + pc[None, :], row_ok, pass_ok, ROWS_IN, PASS_IN).to(tl.float32)
    return _operand(x * scale, DTYPE, DOT_F32)


@triton.jit
def _store_unrotated(row_ptr, tab_row_ptr, row_ok, c1, c2, pair_ok, d1, d2, scale, ROTATE: tl.constexpr):
    """Store ``scale * R(-theta) d`` for the gradient halves ``d1``, ``d2`` (fp32) of rotated rows."""
    m = row_ok[:, None] & pair_ok[None, :]
    if ROTATE:
        cos = tl.load(tab_row_ptr + c1[None, :], mask=m, other=0.0)
        sin = tl.load(tab_row_ptr + c2[None, :], mask=m, other=0.0)
        d1, d2 = d1 * cos + d2 * sin, d2 * cos - d1 * sin
    ty = row_ptr.dtype.element_ty
    tl.store(row_ptr + c1[None, :], (d1 * scale).to(ty), mask=m)
    tl.store(row_ptr + c2[None, :], (d2 * scale).to(ty), mask=m)


@triton.jit
def _columns(HALF_BLOCK: tl.constexpr, ROT_START: tl.constexpr, ROT_HALF: tl.constexpr, NEOX: tl.constexpr,
             PASS_START: tl.constexpr, PASS_LEN: tl.constexpr, PASS_BLOCK: tl.constexpr, DV: tl.constexpr,
             DV_BLOCK: tl.constexpr):
    """Every kernel's column indices and masks: the rotated pairs' halves, the pass-through run, v's columns."""
    c1, c2, pair_ok = _pair_columns(HALF_BLOCK, ROT_START, ROT_HALF, NEOX)
    pc = PASS_START + tl.arange(0, PASS_BLOCK)
    pass_ok = tl.arange(0, PASS_BLOCK) < PASS_LEN
    dv = tl.arange(0, DV_BLOCK)
    return c1, c2, pair_ok, pc, pass_ok, dv, dv < DV


@triton.jit
def _sequence(cu_ptr, b, S, VARLEN: tl.constexpr):
    """(batch index into the tensors, first token, length) of sequence ``b``. ``VARLEN``: packed sequences, the
    tensors [1, T, H, D] and sequence b the tokens ``cu[b]:cu[b+1]``, clamped into 0..T so that a bad boundary
    reads and writes nothing outside the tensors; else the batch's b, its tokens 0..S."""
    if VARLEN:
        start = tl.minimum(tl.maximum(tl.load(cu_ptr + b), 0), S)
        end = tl.minimum(tl.maximum(tl.load(cu_ptr + b + 1), start), S)
        return b * 0, start.to(tl.int64), (end - start).to(tl.int32)
    return b, b * 0, S


@triton.jit
def _load_resident(rows_ptr, tab_rows, ok, c1, c2, pair_ok, pc, pass_ok, scale, ROT_HALF: tl.constexpr,
                   HALF_BLOCK: tl.constexpr, PASS_LEN: tl.constexpr, PASS_BLOCK: tl.constexpr, DTYPE: tl.constexpr,
                   DOT_F32: tl.constexpr, ROTATE: tl.constexpr):
    """A program's resident rows (q in the forward and dq kernels, k in the dk/dv kernel), rotated and scaled:
    the two halves and the pass-through columns (the first half again where there are none; never read)."""
    x1, x2 = _load_rotated(rows_ptr, tab_rows, ok, c1, c2, pair_ok, scale, False, HALF_BLOCK == ROT_HALF, DTYPE,
                           DOT_F32, ROTATE, False)
    xp = x1
    if PASS_LEN > 0:
        xp = _load_pass(rows_ptr, ok, pc, pass_ok, scale, False, PASS_BLOCK == PASS_LEN, DTYPE, DOT_F32)
    return x1, x2, xp


@triton.jit
def _scores(a1, a2, ap, b_rows, tab_rows, b_ok, c1, c2, pair_ok, pc, pass_ok, b_scale, ROWS_IN: tl.constexpr,
            ROT_HALF: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_LEN: tl.constexpr,
            PASS_BLOCK: tl.constexpr, DTYPE: tl.constexpr, DOT_F32: tl.constexpr, ROTATE: tl.constexpr,
            PRECISION: tl.constexpr, B_ROTATED: tl.constexpr):
    """Raw scores ``a . b^T`` ([A, B]) between the resident rotated rows ``a`` (halves a1, a2 and pass-through ap)
    and the rows at ``b_rows``, rotated as they load (``B_ROTATED``: a copy rotated and scaled already); and b's
    rotated parts."""
    b1, b2 = _load_rotated(b_rows, tab_rows, b_ok, c1, c2, pair_ok, b_scale, ROWS_IN, HALF_BLOCK == ROT_HALF, DTYPE,
                           DOT_F32, ROTATE, B_ROTATED)
    s = tl.dot(a1, tl.trans(b1), input_precision=PRECISION)
    s = tl.dot(a2, tl.trans(b2), s, input_precision=PRECISION)
    bp = b1  # placeholder when there are no pass-through columns (never read)
    if PASS_LEN > 0:
        if B_ROTATED:
            bp = _operand(_load_tile(b_rows + pc[None, :], b_ok, pass_ok, ROWS_IN, PASS_BLOCK == PASS_LEN), DTYPE,
                          DOT_F32)
        else:
            bp = _load_pass(b_rows, b_ok, pc, pass_ok, b_scale, ROWS_IN, PASS_BLOCK == PASS_LEN, DTYPE, DOT_F32)
        s = tl.dot(ap, tl.trans(bp), s, input_precision=PRECISION)
    return s, b1, b2, bp


@triton.jit
def _fwd_tile(q1, q2, qp, m_i, l_i, acc, n0, rows, k_base, v_base, tab_b, k_ss, v_ss, t_ss, S, c1, c2, pair_ok,
              pc, pass_ok, dv, dv_ok, k_scale, qk_mult, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              BLOCK_N: tl.constexpr, ROT_HALF: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_LEN: tl.constexpr,
              PASS_BLOCK: tl.constexpr, DV: tl.constexpr, DV_BLOCK: tl.constexpr, DTYPE: tl.constexpr,
              DOT_F32: tl.constexpr, ROTATE: tl.constexpr, PRECISION: tl.constexpr, K_ROTATED: tl.constexpr):
    """One key tile of the online softmax. ``MASKED``: the tile may hold keys past S or (causal) past a row."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < S
    cols64 = cols.to(tl.int64)[:, None]
    qk, k1, k2, kp = _scores(q1, q2, qp, k_base + cols64 * k_ss, tab_b + cols64 * t_ss, col_ok, c1, c2, pair_ok, pc,
                             pass_ok, k_scale, not MASKED, ROT_HALF, HALF_BLOCK, PASS_LEN, PASS_BLOCK, DTYPE,
                             DOT_F32, ROTATE, PRECISION, K_ROTATED)
    qk = qk * qk_mult
    if MASKED:
        keep = col_ok[None, :]
        if CAUSAL:
            keep = keep & (rows[:, None] >= cols[None, :])
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _operand(_load_tile(v_base + cols64 * v_ss + dv[None, :], col_ok, dv_ok, not MASKED, DV_BLOCK == DV), DTYPE,
                 DOT_F32)
    acc = tl.dot(_operand(p, DTYPE, DOT_F32), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def rope_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, tab_ptr, o_ptr, lse_ptr, cu_ptr,
    q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, t_sb, t_ss, o_sb, o_ss, o_sh,
    S, HQ, GROUP, q_scale, k_scale, qk_mult,
    ROT_START: tl.constexpr, ROT_HALF: tl.constexpr, NEOX: tl.constexpr, PASS_START: tl.constexpr,
    PASS_LEN: tl.constexpr, DV: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
    DV_BLOCK: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, ROTATE: tl.constexpr,
    K_ROTATED: tl.constexpr, VARLEN: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch or packed sequence, q head). Grid: (B * HQ, cdiv(S or the
    longest sequence, BLOCK_M)); the last row blocks (the longest under a causal mask) start first. Key tiles
    wholly inside the sequence and (causal) wholly before the block's first row run without masks; the rest with
    them. BLOCK_M is a multiple of BLOCK_N."""
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    bh = tl.program_id(0)
    h = (bh % HQ).to(tl.int64)
    b, start, seq_len = _sequence(cu_ptr, (bh // HQ).to(tl.int64), S, VARLEN)
    if VARLEN:
        if pid_m * BLOCK_M >= seq_len:  # a packed sequence shorter than the grid's longest
            return
    hk = h // GROUP
    DTYPE = q_ptr.dtype.element_ty
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seq_len
    c1, c2, pair_ok, pc, pass_ok, dv, dv_ok = _columns(HALF_BLOCK, ROT_START, ROT_HALF, NEOX, PASS_START, PASS_LEN,
                                                       PASS_BLOCK, DV, DV_BLOCK)

    rows64 = rows.to(tl.int64)[:, None]
    q_rows = q_ptr + b * q_sb + start * q_ss + h * q_sh + rows64 * q_ss
    tab_b = tab_ptr + b * t_sb + start * t_ss
    q1, q2, qp = _load_resident(q_rows, tab_b + rows64 * t_ss, row_ok, c1, c2, pair_ok, pc, pass_ok, q_scale,
                                ROT_HALF, HALF_BLOCK, PASS_LEN, PASS_BLOCK, DTYPE, DOT_F32, ROTATE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_BLOCK], tl.float32)
    k_base = k_ptr + b * k_sb + start * k_ss + hk * k_sh
    v_base = v_ptr + b * v_sb + start * v_ss + hk * v_sh
    if CAUSAL:
        interior = pid_m * BLOCK_M
        end = tl.minimum((pid_m + 1) * BLOCK_M, seq_len)
    else:
        interior = seq_len // BLOCK_N * BLOCK_N
        end = seq_len
    for n0 in range(0, interior, BLOCK_N):
        m_i, l_i, acc = _fwd_tile(q1, q2, qp, m_i, l_i, acc, n0, rows, k_base, v_base, tab_b, k_ss, v_ss, t_ss,
                                  seq_len,
                                  c1, c2, pair_ok, pc, pass_ok, dv, dv_ok, k_scale, qk_mult, False, CAUSAL, BLOCK_N,
                                  ROT_HALF, HALF_BLOCK, PASS_LEN, PASS_BLOCK, DV, DV_BLOCK, DTYPE, DOT_F32, ROTATE,
                                  PRECISION, K_ROTATED)
    for n0 in range(interior, end, BLOCK_N):
        m_i, l_i, acc = _fwd_tile(q1, q2, qp, m_i, l_i, acc, n0, rows, k_base, v_base, tab_b, k_ss, v_ss, t_ss,
                                  seq_len,
                                  c1, c2, pair_ok, pc, pass_ok, dv, dv_ok, k_scale, qk_mult, True, CAUSAL, BLOCK_N,
                                  ROT_HALF, HALF_BLOCK, PASS_LEN, PASS_BLOCK, DV, DV_BLOCK, DTYPE, DOT_F32, ROTATE,
                                  PRECISION, K_ROTATED)

    acc = acc / l_i[:, None]
    o_rows = o_ptr + b * o_sb + start * o_ss + h * o_sh + rows64 * o_ss
    tl.store(o_rows + dv[None, :], acc.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    # lse [B, HQ, S] ([1, HQ, T] packed), natural log
    tl.store(lse_ptr + (b * HQ + h) * S + start + rows, (m_i + tl.math.log2(l_i)) * LN2, mask=row_ok)


@triton.jit
def rope_attention_bwd_delta_kernel(
    o_ptr, do_ptr, dlse_ptr, delta_ptr, o_sb, o_ss, o_sh, do_sb, do_ss, do_sh, S, HQ,
    DV: tl.constexpr, HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, DV_BLOCK: tl.constexpr,
):
    """delta = rowsum(o * do) - dlse per (batch, head, row), [B, HQ, S] float32: the gradient of the natural-log
    lse enters the score gradient as ``p * dlse``, which is a shift of delta."""
    bh = tl.program_id(0)
    b = (bh // HQ).to(tl.int64)
    h = (bh % HQ).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dv = tl.arange(0, DV_BLOCK)
    m = (rows < S)[:, None] & (dv < DV)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    o = tl.load(o_ptr + b * o_sb + h * o_sh + r64 * o_ss + dv[None, :], mask=m, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + b * do_sb + h * do_sh + r64 * do_ss + dv[None, :], mask=m, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:  # dlse [B, HQ, S], contiguous
        delta -= tl.load(dlse_ptr + bh.to(tl.int64) * S + rows, mask=rows < S, other=0.0).to(tl.float32)
    tl.store(delta_ptr + bh.to(tl.int64) * S + rows, delta, mask=rows < S)


@triton.jit
def _dkdv_tile(k1, k2, kp, v, dk1, dk2, dkp, dv_acc, m0, cols, q_base, do_base, tab_b, q_ss, do_ss, t_ss, lse_ptr,
               delta_ptr, stat, S, c1, c2, pair_ok, pc, pass_ok, dv, dv_ok, q_scale, qk_mult, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, ROT_HALF: tl.constexpr, HALF_BLOCK: tl.constexpr,
               PASS_LEN: tl.constexpr, PASS_BLOCK: tl.constexpr, DV: tl.constexpr, DV_BLOCK: tl.constexpr,
               DTYPE: tl.constexpr, DOT_F32: tl.constexpr, ROTATE: tl.constexpr, PRECISION: tl.constexpr,
               Q_ROTATED: tl.constexpr):
    """One query tile's contribution to a key tile's dk and dv. Query rows past S load as zeros and contribute
    nothing (their do and delta are 0), so only loads and the causal mask need ``MASKED``."""
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < S
    rows64 = rows.to(tl.int64)[:, None]
    s_t, q1, q2, qp = _scores(k1, k2, kp, q_base + rows64 * q_ss, tab_b + rows64 * t_ss, row_ok, c1, c2, pair_ok,
                              pc, pass_ok, q_scale, not MASKED, ROT_HALF, HALF_BLOCK, PASS_LEN, PASS_BLOCK,
                              DTYPE, DOT_F32, ROTATE, PRECISION, Q_ROTATED)
    if MASKED:
        lse2 = tl.load(lse_ptr + stat + rows, mask=row_ok, other=0.0) * (1.0 / LN2)
        delta = tl.load(delta_ptr + stat + rows, mask=row_ok, other=0.0)
    else:
        lse2 = tl.load(lse_ptr + stat + rows) * (1.0 / LN2)
        delta = tl.load(delta_ptr + stat + rows)
    p_t = tl.math.exp2(s_t * qk_mult - lse2[None, :])
    if MASKED:
        if CAUSAL:
            p_t = tl.where(rows[None, :] >= cols[:, None], p_t, 0.0)
    do = _operand(_load_tile(do_base + rows64 * do_ss + dv[None, :], row_ok, dv_ok, not MASKED, DV_BLOCK == DV),
                  DTYPE, DOT_F32)
    dv_acc = tl.dot(_operand(p_t, DTYPE, DOT_F32), do, dv_acc, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    ds_t = _operand(p_t * (dp_t - delta[None, :]), DTYPE, DOT_F32)
    dk1 = tl.dot(ds_t, q1, dk1, input_precision=PRECISION)
    dk2 = tl.dot(ds_t, q2, dk2, input_precision=PRECISION)
    if PASS_LEN > 0:
        dkp = tl.dot(ds_t, qp, dkp, input_precision=PRECISION)
    return dk1, dk2, dkp, dv_acc


@triton.jit
def rope_attention_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, tab_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_ptr,
    q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, t_sb, t_ss, do_sb, do_ss, do_sh,
    dk_sb, dk_ss, dk_sh, dv_sb, dv_ss, dv_sh,
    S, HQ, HK, GROUP, q_scale, k_scale, qk_mult,
    ROT_START: tl.constexpr, ROT_HALF: tl.constexpr, NEOX: tl.constexpr, PASS_START: tl.constexpr,
    PASS_LEN: tl.constexpr, DV: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
    DV_BLOCK: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, ROTATE: tl.constexpr,
    Q_ROTATED: tl.constexpr, VARLEN: tl.constexpr,
):
    """One program: BLOCK_N key rows of one (batch or packed sequence, kv head), summed over the GROUP query heads
    that share them (GQA): k and v are loaded and rotated once. Grid: (B * HK, cdiv(S or the longest sequence,
    BLOCK_N)). Query tiles on the causal diagonal or past the sequence run with masks, the rest without."""
    pid_n = tl.program_id(1)
    bh = tl.program_id(0)
    hk = (bh % HK).to(tl.int64)
    b, start, seq_len = _sequence(cu_ptr, (bh // HK).to(tl.int64), S, VARLEN)
    c0 = pid_n * BLOCK_N
    if VARLEN:
        if c0 >= seq_len:  # a packed sequence shorter than the grid's longest
            return
    DTYPE = q_ptr.dtype.element_ty
    cols = c0 + tl.arange(0, BLOCK_N)
    col_ok = cols < seq_len
    cols64 = cols.to(tl.int64)[:, None]
    c1, c2, pair_ok, pc, pass_ok, dv, dv_ok = _columns(HALF_BLOCK, ROT_START, ROT_HALF, NEOX, PASS_START, PASS_LEN,
                                                       PASS_BLOCK, DV, DV_BLOCK)

    tab_b = tab_ptr + b * t_sb + start * t_ss
    k_rows = k_ptr + b * k_sb + start * k_ss + hk * k_sh + cols64 * k_ss
    k1, k2, kp = _load_resident(k_rows, tab_b + cols64 * t_ss, col_ok, c1, c2, pair_ok, pc, pass_ok, k_scale,
                                ROT_HALF, HALF_BLOCK, PASS_LEN, PASS_BLOCK, DTYPE, DOT_F32, ROTATE)
    v_rows = v_ptr + b * v_sb + start * v_ss + hk * v_sh + cols64 * v_ss
    v = _operand(_load_tile(v_rows + dv[None, :], col_ok, dv_ok, False, DV_BLOCK == DV), DTYPE, DOT_F32)
    dk1 = tl.zeros([BLOCK_N, HALF_BLOCK], tl.float32)
    dk2 = tl.zeros([BLOCK_N, HALF_BLOCK], tl.float32)
    dkp = tl.zeros([BLOCK_N, PASS_BLOCK], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, DV_BLOCK], tl.float32)
    full_rows = seq_len // BLOCK_M * BLOCK_M
    if CAUSAL:  # query tiles before the key tile see none of it; those that reach into it need the mask
        first = c0 // BLOCK_M * BLOCK_M
        diagonal_end = tl.minimum(tl.cdiv(c0 + BLOCK_N, BLOCK_M) * BLOCK_M, seq_len)
    else:
        first = 0
        diagonal_end = 0
    tail = tl.maximum(diagonal_end, full_rows)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = q_ptr + b * q_sb + start * q_ss + h * q_sh
        do_base = do_ptr + b * do_sb + start * do_ss + h * do_sh
        stat = (b * HQ + h) * S + start
        for m0 in range(first, diagonal_end, BLOCK_M):
            dk1, dk2, dkp, dv_acc = _dkdv_tile(
                k1, k2, kp, v, dk1, dk2, dkp, dv_acc, m0, cols, q_base, do_base, tab_b, q_ss, do_ss, t_ss, lse_ptr,
                delta_ptr, stat, seq_len, c1, c2, pair_ok, pc, pass_ok, dv, dv_ok, q_scale, qk_mult, True, CAUSAL,
                BLOCK_M, ROT_HALF, HALF_BLOCK, PASS_LEN, PASS_BLOCK, DV, DV_BLOCK, DTYPE, DOT_F32, ROTATE, PRECISION,
                Q_ROTATED)
        for m0 in range(diagonal_end, full_rows, BLOCK_M):
            dk1, dk2, dkp, dv_acc = _dkdv_tile(
                k1, k2, kp, v, dk1, dk2, dkp, dv_acc, m0, cols, q_base, do_base, tab_b, q_ss, do_ss, t_ss, lse_ptr,
                delta_ptr, stat, seq_len, c1, c2, pair_ok, pc, pass_ok, dv, dv_ok, q_scale, qk_mult, False, CAUSAL,
                BLOCK_M, ROT_HALF, HALF_BLOCK, PASS_LEN, PASS_BLOCK, DV, DV_BLOCK, DTYPE, DOT_F32, ROTATE, PRECISION,
                Q_ROTATED)
        for m0 in range(tail, seq_len, BLOCK_M):
            dk1, dk2, dkp, dv_acc = _dkdv_tile(
                k1, k2, kp, v, dk1, dk2, dkp, dv_acc, m0, cols, q_base, do_base, tab_b, q_ss, do_ss, t_ss, lse_ptr,
                delta_ptr, stat, seq_len, c1, c2, pair_ok, pc, pass_ok, dv, dv_ok, q_scale, qk_mult, True, CAUSAL,
                BLOCK_M, ROT_HALF, HALF_BLOCK, PASS_LEN, PASS_BLOCK, DV, DV_BLOCK, DTYPE, DOT_F32, ROTATE, PRECISION,
                Q_ROTATED)
    # d(loss)/d(q_r . k_r) = ln 2 * qk_mult * p * (dp - delta); then dk = k_scale * R(-theta) dk_r
    ds_scale = LN2 * qk_mult * k_scale
    dk_rows = dk_ptr + b * dk_sb + start * dk_ss + hk * dk_sh + cols64 * dk_ss
    _store_unrotated(dk_rows, tab_b + cols64 * t_ss, col_ok, c1, c2, pair_ok, dk1, dk2, ds_scale, ROTATE)
    if PASS_LEN > 0:
        tl.store(dk_rows + pc[None, :], (dkp * ds_scale).to(dk_ptr.dtype.element_ty),
                 mask=col_ok[:, None] & pass_ok[None, :])
    dv_rows = dv_ptr + b * dv_sb + start * dv_ss + hk * dv_sh + cols64 * dv_ss
    tl.store(dv_rows + dv[None, :], dv_acc.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None] & dv_ok[None, :])


@triton.jit
def _dq_tile(q1, q2, qp, do, lse2, delta, dq1, dq2, dqp, n0, rows, k_base, v_base, tab_b, k_ss, v_ss, t_ss, S, c1,
             c2, pair_ok, pc, pass_ok, dv, dv_ok, k_scale, qk_mult, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
             BLOCK_N: tl.constexpr, ROT_HALF: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_LEN: tl.constexpr,
             PASS_BLOCK: tl.constexpr, DV: tl.constexpr, DV_BLOCK: tl.constexpr, DTYPE: tl.constexpr,
             DOT_F32: tl.constexpr, ROTATE: tl.constexpr, PRECISION: tl.constexpr, K_ROTATED: tl.constexpr):
    """One key tile's contribution to a query tile's dq. Keys past S load as zeros and add nothing (``ds * k``
    with k = 0), so only loads and the causal mask need ``MASKED``."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < S
    cols64 = cols.to(tl.int64)[:, None]
    s, k1, k2, kp = _scores(q1, q2, qp, k_base + cols64 * k_ss, tab_b + cols64 * t_ss, col_ok, c1, c2, pair_ok, pc,
                            pass_ok, k_scale, not MASKED, ROT_HALF, HALF_BLOCK, PASS_LEN, PASS_BLOCK, DTYPE,
                            DOT_F32, ROTATE, PRECISION, K_ROTATED)
    p = tl.math.exp2(s * qk_mult - lse2[:, None])
    if MASKED:
        if CAUSAL:
            p = tl.where(rows[:, None] >= cols[None, :], p, 0.0)
    v = _operand(_load_tile(v_base + cols64 * v_ss + dv[None, :], col_ok, dv_ok, not MASKED, DV_BLOCK == DV), DTYPE,
                 DOT_F32)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = _operand(p * (dp - delta[:, None]), DTYPE, DOT_F32)
    dq1 = tl.dot(ds, k1, dq1, input_precision=PRECISION)
    dq2 = tl.dot(ds, k2, dq2, input_precision=PRECISION)
    if PASS_LEN > 0:
        dqp = tl.dot(ds, kp, dqp, input_precision=PRECISION)
    return dq1, dq2, dqp


@triton.jit
def rope_attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, tab_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_ptr,
    q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, t_sb, t_ss, do_sb, do_ss, do_sh, dq_sb, dq_ss, dq_sh,
    S, HQ, GROUP, q_scale, k_scale, qk_mult,
    ROT_START: tl.constexpr, ROT_HALF: tl.constexpr, NEOX: tl.constexpr, PASS_START: tl.constexpr,
    PASS_LEN: tl.constexpr, DV: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
    DV_BLOCK: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, ROTATE: tl.constexpr,
    K_ROTATED: tl.constexpr, VARLEN: tl.constexpr,
):
    """One program: dq for BLOCK_M query rows of one (batch or packed sequence, q head). Grid as the forward's;
    key tiles split as in the forward."""
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    bh = tl.program_id(0)
    h = (bh % HQ).to(tl.int64)
    b, start, seq_len = _sequence(cu_ptr, (bh // HQ).to(tl.int64), S, VARLEN)
    if VARLEN:
        if pid_m * BLOCK_M >= seq_len:  # a packed sequence shorter than the grid's longest
            return
    hk = h // GROUP
    DTYPE = q_ptr.dtype.element_ty
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seq_len
    rows64 = rows.to(tl.int64)[:, None]
    c1, c2, pair_ok, pc, pass_ok, dv, dv_ok = _columns(HALF_BLOCK, ROT_START, ROT_HALF, NEOX, PASS_START, PASS_LEN,
                                                       PASS_BLOCK, DV, DV_BLOCK)

    tab_b = tab_ptr + b * t_sb + start * t_ss
    q_rows = q_ptr + b * q_sb + start * q_ss + h * q_sh + rows64 * q_ss
    q1, q2, qp = _load_resident(q_rows, tab_b + rows64 * t_ss, row_ok, c1, c2, pair_ok, pc, pass_ok, q_scale,
                                ROT_HALF, HALF_BLOCK, PASS_LEN, PASS_BLOCK, DTYPE, DOT_F32, ROTATE)
    do = _operand(_load_tile(do_ptr + b * do_sb + start * do_ss + h * do_sh + rows64 * do_ss + dv[None, :], row_ok,
                             dv_ok, False, DV_BLOCK == DV), DTYPE, DOT_F32)
    stat = (b * HQ + h) * S + start
    lse2 = tl.load(lse_ptr + stat + rows, mask=row_ok, other=0.0) * (1.0 / LN2)
    delta = tl.load(delta_ptr + stat + rows, mask=row_ok, other=0.0)
    dq1 = tl.zeros([BLOCK_M, HALF_BLOCK], tl.float32)
    dq2 = tl.zeros([BLOCK_M, HALF_BLOCK], tl.float32)
    dqp = tl.zeros([BLOCK_M, PASS_BLOCK], tl.float32)
    k_base = k_ptr + b * k_sb + start * k_ss + hk * k_sh
    v_base = v_ptr + b * v_sb + start * v_ss + hk * v_sh
    if CAUSAL:
        interior = pid_m * BLOCK_M // BLOCK_N * BLOCK_N
        end = tl.minimum((pid_m + 1) * BLOCK_M, seq_len)
    else:
        interior = seq_len // BLOCK_N * BLOCK_N
        end = seq_len
    for n0 in range(0, interior, BLOCK_N):
        dq1, dq2, dqp = _dq_tile(q1, q2, qp, do, lse2, delta, dq1, dq2, dqp, n0, rows, k_base, v_base, tab_b, k_ss,
                                 v_ss, t_ss, seq_len, c1, c2, pair_ok, pc, pass_ok, dv, dv_ok, k_scale, qk_mult, False,
                                 CAUSAL, BLOCK_N, ROT_HALF, HALF_BLOCK, PASS_LEN, PASS_BLOCK, DV, DV_BLOCK, DTYPE,
                                 DOT_F32, ROTATE, PRECISION, K_ROTATED)
    for n0 in range(interior, end, BLOCK_N):
        dq1, dq2, dqp = _dq_tile(q1, q2, qp, do, lse2, delta, dq1, dq2, dqp, n0, rows, k_base, v_base, tab_b, k_ss,
                                 v_ss, t_ss, seq_len, c1, c2, pair_ok, pc, pass_ok, dv, dv_ok, k_scale, qk_mult, True,
                                 CAUSAL, BLOCK_N, ROT_HALF, HALF_BLOCK, PASS_LEN, PASS_BLOCK, DV, DV_BLOCK, DTYPE,
                                 DOT_F32, ROTATE, PRECISION, K_ROTATED)
    ds_scale = LN2 * qk_mult * q_scale
    dq_rows = dq_ptr + b * dq_sb + start * dq_ss + h * dq_sh + rows64 * dq_ss
    _store_unrotated(dq_rows, tab_b + rows64 * t_ss, row_ok, c1, c2, pair_ok, dq1, dq2, ds_scale, ROTATE)
    if PASS_LEN > 0:
        tl.store(dq_rows + pc[None, :], (dqp * ds_scale).to(dq_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & pass_ok[None, :])


@triton.jit
def rope_attention_rotate_kernel(
    x_ptr, tab_ptr, out_ptr, x_sb, x_ss, x_sh, t_sb, t_ss, o_sb, o_ss, o_sh, S, num_tokens, scale,
    ROT_START: tl.constexpr, ROT_HALF: tl.constexpr, NEOX: tl.constexpr, PASS_START: tl.constexpr,
    PASS_LEN: tl.constexpr, BLOCK_T: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr,
    ROTATE: tl.constexpr,
):
    """``out = scale * R(theta) x`` rounded to x's dtype, for the operand that the attention loop re-reads (k in
    the forward and dq kernels, q in the dk/dv kernel): rotated once here instead of once per program that loads
    it. One program: BLOCK_T tokens of one head. Grid: (cdiv(B * S, BLOCK_T), H)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = tokens < num_tokens
    b = (tokens // S).to(tl.int64)[:, None]
    s = (tokens % S).to(tl.int64)[:, None]
    h = tl.program_id(1).to(tl.int64)
    DTYPE = x_ptr.dtype.element_ty
    c1, c2, pair_ok = _pair_columns(HALF_BLOCK, ROT_START, ROT_HALF, NEOX)
    x_rows = x_ptr + b * x_sb + s * x_ss + h * x_sh
    o_rows = out_ptr + b * o_sb + s * o_ss + h * o_sh
    x1, x2 = _load_rotated(x_rows, tab_ptr + b * t_sb + s * t_ss, ok, c1, c2, pair_ok, scale, False,
                           HALF_BLOCK == ROT_HALF, DTYPE, False, ROTATE, False)
    m = ok[:, None] & pair_ok[None, :]
    tl.store(o_rows + c1[None, :], x1, mask=m)
    tl.store(o_rows + c2[None, :], x2, mask=m)
    if PASS_LEN > 0:
        pc = PASS_START + tl.arange(0, PASS_BLOCK)
        pass_ok = tl.arange(0, PASS_BLOCK) < PASS_LEN
        xp = _load_pass(x_rows, ok, pc, pass_ok, scale, False, PASS_BLOCK == PASS_LEN, DTYPE, False)
        tl.store(o_rows + pc[None, :], xp, mask=ok[:, None] & pass_ok[None, :])
