"""A copy through ``rope_kernel``'s own access path, shared by the probes that split a kernel's time between its
access pattern and its arithmetic (``decode_probe.py``, ``sass_count.py``).

Not a probe itself; found by ``from _copies import ...`` as ``_graphs.py`` is.
"""

import triton
import triton.language as tl

from ropekit.triton.kernel import _head_tile, _load_heads, _store_pairs, _token_block


@triton.jit
def same_grid_copy_kernel(q_ptr, qo_ptr, k_ptr, ko_ptr, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, HQ, HK, S, num_tokens,
                           D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                           TOKENS_FIRST: tl.constexpr):
    """rope_kernel's grid (head blocks, token blocks over axes 1 and 2; or with ``TOKENS_FIRST`` token blocks,
    head blocks), token block, addresses, loads and stores (NeoX halves, outputs with the inputs' strides), with
    the positions, angles and rotation left out: y = x."""
    if TOKENS_FIRST:
        tb, hb = tl.program_id(0), tl.program_id(1)
    else:
        hb, tb = tl.program_id(0), tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
    t, mask_t, b, s = _token_block(tb, num_tokens, S, BLOCK_T)
    n_qb = tl.cdiv(HQ, BLOCK_HQ)
    if hb < n_qb:
        base, m = _head_tile(b, s, mask_t, hb * BLOCK_HQ, HQ, q_sb, q_ss, q_sh, BLOCK_HQ)
        x_lo, x_hi, x_p = _load_heads(q_ptr, base, m, D, D, 0, True, D // 2, 1, False, False)
        _store_pairs(qo_ptr, base, m, x_lo, x_hi, x_p, D, D, 0, True, D // 2, 1, False, False, False)
    else:
        base, m = _head_tile(b, s, mask_t, (hb - n_qb) * BLOCK_HK, HK, k_sb, k_ss, k_sh, BLOCK_HK)
        x_lo, x_hi, x_p = _load_heads(k_ptr, base, m, D, D, 0, True, D // 2, 1, False, False)
        _store_pairs(ko_ptr, base, m, x_lo, x_hi, x_p, D, D, 0, True, D // 2, 1, False, False, False)
