"""Launcher of :func:`ropekit.triton.kernel.rope_kernel`: strides, modes and block sizes, no copies.

``launch_rope`` writes into the given outputs (which may be the inputs: in place) and allocates nothing, so it is
CUDA-graph capturable. It takes the normalised arguments of ``ropekit::rope`` (see :mod:`ropekit.ops`); the public
API validates them first. Benchmarks may call it directly to skip the dispatcher.
"""

from __future__ import annotations

import functools
import math

import torch

from ropekit._layout import to_canonical
from ropekit.triton import kernel as K

_FREQ_MODES = {"inv_freq": K.FREQ_INV_FREQ, "table": K.FREQ_TABLE, "angles": K.FREQ_ANGLES}

# Bytes of Q (or K) each program reads per pass, over its tokens; tuned on Hopper (see BENCHMARKS.md).
TILE_BYTES = 16384
# Elements of one token's head tile: [BLOCK_H, head_dim].
HEAD_TILE_ELEMS = 4096
MAX_UNROLL = 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    # triton.cdiv / triton.next_power_of_2 are constexpr functions whose Python call costs microseconds each
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_programs_wanted(device: torch.device) -> int:
    """Programs that keep every SM busy; the CPU interpreter wants as few as possible."""
    if device.type != "cuda":
        return 1
    return 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=4096)
def block_config(num_tokens: int, hq: int, hk: int, head_dim: int, elem_size: int, min_programs: int,
                 tile_bytes: int = TILE_BYTES) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_HQ, BLOCK_HK, num_warps).

    A program rotates ``BLOCK_T`` tokens of one head block of at most ``HEAD_TILE_ELEMS``
    elements per token, about ``tile_bytes`` in all; tokens per program shrink first, then heads, until the grid
    has ``min_programs`` programs (small decode batches)."""
    d_pad = _next_pow2(head_dim)
    heads_cap = max(1, HEAD_TILE_ELEMS // d_pad)
    block_hq = min(_next_pow2(hq), heads_cap)
    block_hk = min(_next_pow2(max(hk, 1)), heads_cap)
    per_token_bytes = block_hq * d_pad * elem_size
    block_t = max(1, min(MAX_UNROLL, tile_bytes // per_token_bytes, _next_pow2(num_tokens)))

    def programs(bt: int, bq: int, bk: int) -> int:
        return _cdiv(num_tokens, bt) * (_cdiv(hq, bq) + (_cdiv(hk, bk) if hk else 0))

    while block_t > 1 and programs(block_t, block_hq, block_hk) < min_programs:
        block_t //= 2
    while block_t == 1 and block_hq > 2 and programs(1, block_hq, block_hk) < min_programs:
        block_hq //= 2
        block_hk = min(block_hk, block_hq)
    # About 128 bytes (eight 16-byte vectors) per thread was best across the sweep (scripts/tune.py).
    num_warps = max(1, min(8, block_t * block_hq * d_pad * elem_size // 4096))
    return block_t, block_hq, block_hk, num_warps


def launch_rope(
    q: torch.Tensor,
    k: torch.Tensor | None,
    q_out: torch.Tensor,
    k_out: torch.Tensor | None,
    *,
    layout: str,
    style: str,
    freq_mode: str,
    rotary_dim: int,
    rotary_start: int,
    positions: torch.Tensor | None = None,
    seq_offsets: torch.Tensor | None = None,
    pos_offset: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    inv_freq: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    table_by_token: bool = False,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    rotary_scale: float = 1.0,
    conjugate: bool = False,
    tile_bytes: int = TILE_BYTES,
    config: tuple[int, int, int, int] | None = None,
) -> None:
    """Rotate ``q`` (and ``k``) into ``q_out`` (and ``k_out``); outputs may alias their inputs exactly.

    ``config`` = (BLOCK_T, BLOCK_HQ, BLOCK_HK, num_warps) overrides the heuristic (tuning only)."""
    qc, qoc = to_canonical(q, layout), to_canonical(q_out, layout)
    B, S, HQ, D = qc.shape
    has_k = k is not None
    kc = to_canonical(k, layout) if has_k else qc
    koc = to_canonical(k_out, layout) if has_k else qoc
    HK = kc.shape[2] if has_k else 0
    num_tokens = B * S
    if num_tokens == 0 or (HQ == 0 and HK == 0):
        return

    if positions is not None:
        pos_mode, pos_t = K.POS_PER_TOKEN, positions
        pos_sb, pos_ss = positions.stride()
    else:
        pos_t, pos_sb, pos_ss = q, 0, 0
        pos_mode = K.POS_VARLEN if cu_seqlens is not None else K.POS_PER_SEQ if seq_offsets is not None \
            else K.POS_RANGE
    n_seqs = cu_seqlens.numel() - 1 if cu_seqlens is not None else 1
    n_search_steps = max(1, math.ceil(math.log2(max(n_seqs, 1)))) + 1

    if cos is not None:  # tables are [Bt, rows, W], W = R/2 (one value per pair) or R (one per column)
        t_sb = cos.stride(0) if cos.shape[0] > 1 else 0
        t_sr, t_sc = cos.stride(1), cos.stride(2)
        table_rows = cos.shape[1]
        table_full = cos.shape[2] != rotary_dim // 2
    else:
        t_sb = t_sr = t_sc = table_rows = 0
        table_full = False

    copy_pass_q = D != rotary_dim and (q_out.data_ptr() != q.data_ptr() or q_scale != 1.0)
    copy_pass_k = has_k and D != rotary_dim and (k_out.data_ptr() != k.data_ptr() or k_scale != 1.0)
    block_t, block_hq, block_hk, num_warps = config or block_config(
        num_tokens, HQ, HK, D, q.element_size(), _num_programs_wanted(q.device), tile_bytes)
    n_hb = _cdiv(HQ, block_hq) + (_cdiv(HK, block_hk) if has_k else 0)
    grid = (_cdiv(num_tokens, block_t) * n_hb, 1, 1)
    dummy = q
    args = (
        qc, qoc, kc, koc,
        qc.stride(0), qc.stride(1), qc.stride(2), qoc.stride(0), qoc.stride(1), qoc.stride(2),
        kc.stride(0), kc.stride(1), kc.stride(2), koc.stride(0), koc.stride(1), koc.stride(2),
        HQ, HK, S, num_tokens,
        pos_t, pos_sb, pos_ss,
        seq_offsets if seq_offsets is not None else dummy, pos_offset,
        cu_seqlens if cu_seqlens is not None else dummy, n_seqs, n_search_steps,
        inv_freq if inv_freq is not None else dummy,
        cos if cos is not None else dummy, sin if sin is not None else dummy,
        t_sb, t_sr, t_sc, table_rows,
        q_scale, k_scale, rotary_scale,
    )
    constexprs = (
        D, rotary_dim, rotary_start, style == "neox", pos_mode, seq_offsets is not None,
        _FREQ_MODES[freq_mode], table_by_token, table_full, conjugate, has_k, copy_pass_q, copy_pass_k,
        block_t, block_hq, block_hk, _next_pow2(rotary_dim // 2),
        _next_pow2(max(D - rotary_dim, 1)), q.device.type == "cuda",
    )
    _launch(grid, args, constexprs, num_warps, q.device)


_CONSTEXPR_NAMES = ("HEAD_DIM", "ROT_DIM", "ROT_START", "NEOX", "POS_MODE", "HAS_SEQ_OFFSETS", "FREQ_MODE",
                    "TABLE_BY_TOKEN", "TABLE_FULL", "CONJUGATE", "HAS_K", "COPY_PASS_Q", "COPY_PASS_K", "BLOCK_T",
                    "BLOCK_HQ", "BLOCK_HK", "HALF_BLOCK", "PASS_BLOCK", "FAST_TRIG")
_COMPILED: dict = {}


_VARYING = (18, 19, 24, 26, 27, 34)  # S, num_tokens, pos_offset, n_seqs, n_search_steps, table_rows: per call
_POINTERS = (0, 1, 2, 3, 20, 23, 25, 28, 29, 30)


def _cache_key(args, constexprs, num_warps, device_index) -> tuple:
    """Everything Triton specialises the kernel on. Pointers: dtype and 16-byte alignment; ints that vary from
    call to call (positions offsets, token counts): == 1, divisible by 16, 32-bit; the other ints (strides, head
    counts): their values, which pins every specialisation and is cheaper to build."""
    ptrs = [args[i] for i in _POINTERS]
    return (*[p.dtype for p in ptrs], *[p.data_ptr() & 15 for p in ptrs],
            *[(v == 1) + 2 * (v & 15 == 0) + 4 * (not -(2**31) <= v < 2**31) for v in (args[i] for i in _VARYING)],
            args[4:18], args[21:23], args[31:34], constexprs, num_warps, device_index)


def _launch(grid, args, constexprs, num_warps, device) -> None:
    """Launch ``rope_kernel``; on CUDA, keep the compiled kernel per specialisation and call it directly.

    ``kernel[grid](...)`` re-binds and re-hashes ~50 arguments on every call (tens of microseconds of host
    time); the cached handle skips that. The first call for a specialisation goes through Triton (compiling if
    needed), so behaviour is Triton's own."""
    if device.type != "cuda":
        K.rope_kernel[grid](*args, **dict(zip(_CONSTEXPR_NAMES, constexprs)), num_warps=num_warps)
        return
    key = _cache_key(args, constexprs, num_warps, device.index)
    compiled = _COMPILED.get(key)
    if compiled is not None:
        compiled[grid](*args, *constexprs)
        return
    compiled = K.rope_kernel[grid](*args, **dict(zip(_CONSTEXPR_NAMES, constexprs)), num_warps=num_warps)
    if compiled is not None and hasattr(compiled, "__getitem__"):
        _COMPILED[key] = compiled
