"""Launcher of :func:`ropekit.triton.kernel.rope_kernel`: strides, modes and block sizes, no copies.

``launch_rope`` writes into the given outputs (which may be the inputs: in place) and allocates nothing, so it is
CUDA-graph capturable. It takes a validated :class:`ropekit._spec.RopeSpec` (the arguments of ``ropekit::rope``).
Benchmarks may call it directly to skip the dispatcher. :mod:`ropekit.triton.bound` binds a compiled launch for
the eager fast path.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict

import torch

from ropekit import _config
from ropekit._spec import MAX_AXES, RopeSpec, to_canonical
from ropekit.triton import kernel

_FREQ_MODES = {"inv_freq": kernel.FREQ_INV_FREQ.value, "table": kernel.FREQ_TABLE.value,
               "angles": kernel.FREQ_ANGLES.value}

# Block shapes (measurements: docs/perf-notes.md, "Block shape per card"; the sweeps: benchmarks/probes/).
# Bytes of Q (or K) each program reads per pass, and elements of one token's head tile [BLOCK_H, head_dim]: small
# programs of one token (D 128: 8 heads, 2 KB) with 64 bytes per thread, every load issued before the angle math,
# were best across the block sweep on Hopper (tune.py --sweep).
TILE_BYTES = 2048
HEAD_TILE_ELEMS = 1024
BYTES_PER_THREAD = 64
# One 16-byte vector per thread streams faster on cards with less DRAM bandwidth than STREAM_DRAM_GBPS (the H100),
# but only for large grids whose angles need no gathered position and no pass-through columns; on faster memory
# (the H200) programs need more bytes per thread in flight, and a gathered position stalls short programs.
STREAM_BYTES_PER_THREAD = 16
STREAM_DRAM_GBPS = 4000
STREAM_MIN_PROGRAMS_FACTOR = 8
# Decode grids (fewer programs than the card runs at once) are latency-bound: a thread's instruction path grows
# with the elements it handles, and more, smaller programs cost launch time, so one token's 8 heads per program
# with one 16-byte vector per thread (decode_probe.py --sweep).
LATENCY_BYTES_PER_THREAD = 16
LATENCY_BOUND_FACTOR = 2
# Interleaved M-RoPE sections give each pair its own axis, address and position load, work that every thread of a
# head block repeats. Once a decode grid has a program on about two thirds of the SMs (min_programs /
# PAIR_AXES_SM_FRACTION programs), two heads per thread share it: H100, the interleaved call / the 1-D call at
# 32-128 tokens went from 1.04-1.11x to 0.95-1.00x, at 22-26 tokens (Qwen3-VL-8B) from 1.025-1.032x to 0.99-1.01x.
# Smaller grids that the small-grid shape does not take are latency-bound: two pairs a thread
# (PAIR_AXES_LATENCY_BYTES_PER_THREAD, twice the warps) shorten each thread's path from position load to store,
# 9-17 tokens 1.007-1.029x -> 0.98-1.00x. On the H200 9-26 tokens went from 1.02-1.05x to 0.98-1.01x
# (docs/perf-notes.md, "Multi-axis positions"). With the axis stride a compile-time constant (2-byte calls of at
# most AXIS_STRIDE_CONSTANT_TOKENS tokens) that shape, with per-axis position loads, holds until the grid has a
# program per SM (min_programs / PAIR_AXES_CONSTANT_STRIDE_SM_FRACTION): H100, 88-130 programs (Qwen3-VL-2B/8B/32B
# heads at 10-32 tokens) 0.967-0.994x against 0.989-1.029x for two heads a thread; at 135-160 programs (32/8,
# 64/8) the two shapes measured alike (0.974-1.001x), at 162-171 the 8-warp one read 1.012-1.014x. Measured in
# bf16; fp16 takes the rule as the other 2-byte rules do.
PAIR_AXES_BYTES_PER_THREAD = 32
PAIR_AXES_SM_FRACTION = 6
PAIR_AXES_CONSTANT_STRIDE_SM_FRACTION = 4
PAIR_AXES_LATENCY_BYTES_PER_THREAD = 8
# The smallest decode grids (at most min_programs / SMALL_GRID_SM_FRACTION programs with half the heads per program,
# about two thirds of the SMs) take half the heads per program at the same warps: half the pairs a thread, so a
# shorter path. H100 (results 2026-11-27-h100-small-grid), 1-8 tokens, kernel time over 8 heads per program: 1-D
# positions 0.94-0.97x at D 64 and 128 (Llama-3-8B/70B, Qwen2-VL), M-RoPE 0.93-1.00x, D 256 0.96-1.00x. Only for
# 2-byte dtypes with angles computed in the kernel (not loaded from tables or per-token angles): fp32 M-RoPE
# measured 1.02-1.05x and full cos/sin tables up to 1.04x at 4-8 tokens; larger grids (Gemma-2 D 256 at 96
# programs, Qwen2-VL at 128) lost up to 3% in replay.
SMALL_GRID_SM_FRACTION = 6
# Angles from full-width cos/sin tables (transformers' layout, a value per column): every thread also gathers its
# columns' cos and sin at both halves, and one warp per 2 KB program leaves too few loads in flight -- at head_dim
# 256 (4 heads per program) the transformers drop-in ran at 1.31x copy on the H100. One 16-byte vector per thread
# and at least 8 heads per program: 1.05x there, and the fastest or within 0.3% of it at head_dim 64 and 128
# (table_probe.py, 2x4096 and 8x4096). Half-width tables keep the default shape: the rule made MLA's partial
# rotary (64 of 192 columns, fp32 [S, 32] tables) 1.00-1.02x -> 1.03-1.06x (ropekit bench, ae76efe).
TABLE_BYTES_PER_THREAD = 16
TABLE_MIN_HEADS = 8
# Multi-axis positions of a call of at most AXIS_STRIDE_CONSTANT_TOKENS tokens reach the kernel with their axis
# stride as a compile-time constant (POS_AXIS_STRIDE). H100, interleaved M-RoPE over the 1-D call at 2-8 decode
# tokens: 1.035-1.044x under graph replay with a runtime stride, 1.012-1.020x with a constant one (at one token
# Triton specialises the stride of 1 itself); contiguous sections at 17-32 tokens (Qwen2-VL-2B's 12/2 heads,
# Qwen2.5-VL-3B's 16/2) 0.997-1.032x -> 0.979-1.016x. The constant is the stride of the positions tensor, so a
# [3, T] tensor compiles one variant per token count up to this bound, and a slice of a persistent buffer one in
# all (docs/perf-notes.md, "Multi-axis positions").
AXIS_STRIDE_CONSTANT_TOKENS = 32
# 2-byte multi-axis calls on decode grids below block_plan's "filled" bound (min_programs / PAIR_AXES_SM_FRACTION
# programs, or PAIR_AXES_CONSTANT_STRIDE_SM_FRACTION for interleaved sections with a constant axis stride; the
# small-grid and twice-the-warps shapes) load each axis's position once a token, at an address every thread
# shares, and select per pair (POS_PER_AXIS): the loads then issue before the per-pair axis math instead of after
# it. H100, over the 1-D call under replay: interleaved at 1-8 tokens, three runs, 1.007-1.028x -> 0.996-1.016x;
# contiguous at 1-16 tokens 0.986-1.029x -> 0.999-1.017x (Qwen2-VL's 28/4 heads, two runs) and 1.010-1.034x ->
# 0.996-1.013x (Qwen2.5-VL-3B's 16/2). Contiguous sections with a runtime axis stride measured slower with them
# (1.011-1.044x against 0.992-1.040x at 17-29 tokens), as did grids where two heads a thread run (1.12-1.17x) and
# fp32 (1.017-1.026x against 1.002-1.012x at 1-16 tokens): those keep the per-pair loads (docs/perf-notes.md,
# "Multi-axis positions").
INTERPRETER_TILE_BYTES = 65536
MAX_UNROLL = 8
MAX_GRID_Y = 65535  # CUDA's limit on the second grid axis


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def stride_unit(*tensors: torch.Tensor) -> int:
    """The unit, in elements, in which ``rope_kernel`` takes the row strides (dims 0-2) of ``tensors`` and
    multiplies them back, so that the compiler knows how rows are aligned: Triton itself marks only ints divisible
    by 16, and a head stride of 72 elements (head_dim 72) would otherwise leave every access a 2-byte scalar.
    1 when every stride is divisible by 16 (Triton knows then, and the kernel stays as it was); else the largest
    power of two, at most 16 bytes of the widest tensor's elements, that divides them all."""
    strides = [stride for t in tensors for stride in t.stride()[:3]]
    if all(stride % 16 == 0 for stride in strides):
        return 1
    unit = 16 // max(t.element_size() for t in tensors)
    while unit > 1 and any(stride % unit for stride in strides):
        unit //= 2
    return unit


def _next_pow2(n: int) -> int:
    # triton.cdiv / triton.next_power_of_2 are constexpr functions whose Python call costs microseconds each
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _dram_gbps(device_index: int) -> float:
    """The card's DRAM bandwidth from its memory clock and bus width (what triton.testing.get_dram_gbps
    computes); 0 where Triton does not report them."""
    try:
        from triton.runtime import driver

        props = driver.active.utils.get_device_properties(device_index)
        return props["mem_clock_rate"] * props["mem_bus_width"] * 2 / 1e6 / 8  # kHz * bits, double data rate
    except Exception:
        return 0.0


def fast_trig(device_type: str, hip_version: str | None) -> bool:
    """Whether kernels for this device use the hardware ``sin.approx``/``cos.approx`` (inline NVIDIA PTX): on
    NVIDIA GPUs only. ROCm builds of torch also call their devices "cuda"; there (``torch.version.hip`` set) and
    under the interpreter the kernel calls ``tl.sin``/``tl.cos``."""
    return device_type == "cuda" and hip_version is None


# GPUs whose float64 runs at 1/2 the fp32 rate (data-centre parts); the rest run it at 1/32-1/64.
_FAST_FLOAT64_NVIDIA = {(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)}
_FAST_FLOAT64_AMD = ("gfx90a", "gfx940", "gfx941", "gfx942", "gfx950")


@functools.cache
def _fast_float64(device_index: int) -> bool:
    props = torch.cuda.get_device_properties(device_index)
    if torch.version.hip:
        return getattr(props, "gcnArchName", "").split(":")[0] in _FAST_FLOAT64_AMD
    return (props.major, props.minor) in _FAST_FLOAT64_NVIDIA


def integer_angles(device: torch.device) -> bool:
    """Whether in-kernel angles on ``device`` are reduced in 64-bit integer turns (``kernel.FREQ_INV_FREQ_INT``)
    rather than float64: on GPUs without fast float64, or as ``ropekit._config.exact_angles`` says. Both are
    exact to the same bound; float64 stays where it is fast (it is the path measured at the copy limit)."""
    choice = _config.exact_angles
    if choice is not None:
        if choice not in ("float64", "integer"):
            raise ValueError(f"ROPEKIT_EXACT_ANGLES / exact_angles must be 'float64' or 'integer', got {choice!r}")
        return choice == "integer"
    if device.type != "cuda":
        return False
    return not _fast_float64(device.index if device.index is not None else torch.cuda.current_device())


def _num_programs_wanted(device: torch.device) -> int:
    """Programs that keep every SM busy; the CPU interpreter wants as few as possible."""
    if device.type != "cuda":
        return 1
    return 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def block_config(num_tokens: int, hq: int, hk: int, head_dim: int, elem_size: int, min_programs: int,
                 tile_bytes: int = TILE_BYTES, stream: bool = False, full_table: bool = False,
                 head_tile_elems: int = HEAD_TILE_ELEMS, pair_axes: bool = False,
                 small_grid: bool = False, axis_stride_constant: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_HQ, BLOCK_HK, num_warps); see :func:`block_plan`."""
    return block_plan(num_tokens, hq, hk, head_dim, elem_size, min_programs, tile_bytes, stream, full_table,
                      head_tile_elems, pair_axes, small_grid, axis_stride_constant)[0]


@functools.lru_cache(maxsize=4096)
def block_plan(num_tokens: int, hq: int, hk: int, head_dim: int, elem_size: int, min_programs: int,
               tile_bytes: int = TILE_BYTES, stream: bool = False, full_table: bool = False,
               head_tile_elems: int = HEAD_TILE_ELEMS, pair_axes: bool = False, small_grid: bool = False,
               axis_stride_constant: bool = False) -> tuple[tuple[int, int, int, int], bool]:
    """((BLOCK_T, BLOCK_HQ, BLOCK_HK, num_warps), axis_loads): the block shape, and whether the grid is a decode
    grid below ``min_programs / PAIR_AXES_SM_FRACTION`` programs (``PAIR_AXES_CONSTANT_STRIDE_SM_FRACTION`` for
    2-byte interleaved calls whose positions' axis stride is a compile-time constant, ``axis_stride_constant``,
    which :func:`kernel_launch` decides), where multi-axis positions are loaded once per axis (``POS_PER_AXIS``) --
    decided here with the shape, so that no interleaved grid takes those loads with two heads a thread.
    :func:`kernel_launch` narrows it to where the loads measured faster (2-byte dtypes; contiguous sections up to
    ``AXIS_STRIDE_CONSTANT_TOKENS`` tokens).

    A program rotates ``BLOCK_T`` tokens of one head block of at most ``head_tile_elems`` elements per token, about
    ``tile_bytes`` in all; tokens per program shrink until the grid has ``min_programs`` programs. A grid that stays
    under ``LATENCY_BOUND_FACTOR * min_programs`` (decode) gives each thread ``LATENCY_BYTES_PER_THREAD``; a large
    one ``BYTES_PER_THREAD``, or ``STREAM_BYTES_PER_THREAD`` where ``stream`` (the call qualifies, see there), or
    with ``full_table`` (angles from full-width cos/sin tables) ``TABLE_BYTES_PER_THREAD`` and ``TABLE_MIN_HEADS``
    heads or more. With ``pair_axes`` (interleaved M-RoPE sections: a position load per pair) a decode grid of at
    least that bound gives each thread ``PAIR_AXES_BYTES_PER_THREAD``, a smaller one that the small-grid shape
    does not take ``PAIR_AXES_LATENCY_BYTES_PER_THREAD``. With ``small_grid`` (the call qualifies, see there) a
    decode grid that stays within ``min_programs / SMALL_GRID_SM_FRACTION`` programs with half the heads per program
    takes that half at the same warps."""
    d_pad = _next_pow2(head_dim)
    heads_cap = max(1, head_tile_elems // d_pad)
    block_hq = min(_next_pow2(hq), heads_cap)
    block_hk = min(_next_pow2(max(hk, 1)), heads_cap)
    per_token_bytes = block_hq * d_pad * elem_size
    block_t = max(1, min(MAX_UNROLL, tile_bytes // per_token_bytes, _next_pow2(num_tokens)))

    def programs(bt: int, bhq: int = block_hq, bhk: int = block_hk) -> int:
        return _cdiv(num_tokens, bt) * (_cdiv(hq, bhq) + (_cdiv(hk, bhk) if hk else 0))

    while block_t > 1 and programs(block_t) < min_programs:
        block_t //= 2
    n_programs = programs(block_t)
    half_heads = None  # the small-grid shape's (BLOCK_HQ, BLOCK_HK), taken after the warps are set
    axis_loads = False
    if n_programs < LATENCY_BOUND_FACTOR * min_programs:
        constant_stride = pair_axes and elem_size == 2 and axis_stride_constant
        fraction = PAIR_AXES_CONSTANT_STRIDE_SM_FRACTION if constant_stride else PAIR_AXES_SM_FRACTION
        filled = fraction * n_programs >= min_programs
        axis_loads = not filled
        per_thread = PAIR_AXES_BYTES_PER_THREAD if pair_axes and filled else LATENCY_BYTES_PER_THREAD
        if small_grid and block_t == 1 and not (pair_axes and filled):
            half = min(block_hq, max(1, heads_cap // 2)), min(block_hk, max(1, heads_cap // 2))
            if half[0] < block_hq and SMALL_GRID_SM_FRACTION * programs(1, *half) <= min_programs:
                half_heads = half
        if pair_axes and not filled and half_heads is None:
            per_thread = PAIR_AXES_LATENCY_BYTES_PER_THREAD
    elif full_table:
        if heads_cap < TABLE_MIN_HEADS:
            return block_plan(num_tokens, hq, hk, head_dim, elem_size, min_programs, tile_bytes, stream, True,
                              TABLE_MIN_HEADS * d_pad, pair_axes)
        per_thread = TABLE_BYTES_PER_THREAD
    elif stream and n_programs >= STREAM_MIN_PROGRAMS_FACTOR * min_programs:
        per_thread = STREAM_BYTES_PER_THREAD
    else:
        per_thread = BYTES_PER_THREAD
    num_warps = max(1, min(8, block_t * block_hq * d_pad * elem_size // (32 * per_thread)))
    if half_heads is not None:
        block_hq, block_hk = half_heads
    return (block_t, block_hq, block_hk, num_warps), axis_loads


def axis_constexprs(sections, section_layout: str) -> tuple[int, bool, int, int, int]:
    """(NUM_AXES, AXES_INTERLEAVED, AXIS_BOUND_1, AXIS_BOUND_2, AXIS_BOUND_3) of ``rope_kernel`` for a spec's
    ``sections`` (None: 1-D positions) and ``section_layout``; see ``kernel._pair_axis``. Per axis a >= 1 the bound
    is the first pair of axis a (contiguous) or ``A * n_a`` (interleaved); those of absent axes are 0 (never
    read)."""
    if sections is None or len(sections) == 1:
        return 1, False, 0, 0, 0
    A = len(sections)
    if A > MAX_AXES:  # validate refuses these first
        raise ValueError(f"sections may name at most {MAX_AXES} axes, got {list(sections)}")
    if section_layout == "interleaved":
        bounds = [A * n for n in sections[1:]]
    else:
        bounds = [sum(sections[:a]) for a in range(1, A)]
    return (A, section_layout == "interleaved", *bounds, *[0] * (MAX_AXES - A))


def launch_rope(q: torch.Tensor, k: torch.Tensor | None, q_out: torch.Tensor, k_out: torch.Tensor | None,
                spec: RopeSpec, *, tile_bytes: int = TILE_BYTES,
                config: tuple[int, int, int, int] | None = None) -> None:
    """Rotate ``q`` (and ``k``) as ``spec`` says into ``q_out`` (and ``k_out``); outputs may alias their inputs
    exactly. ``config`` = (BLOCK_T, BLOCK_HQ, BLOCK_HK, num_warps) overrides the heuristic (tuning only)."""
    launch = kernel_launch(q, k, q_out, k_out, spec, tile_bytes, config)
    if launch is not None:
        _launch(*launch, q.device)


def kernel_launch(q, k, q_out, k_out, spec: RopeSpec, tile_bytes: int = TILE_BYTES, config=None):
    """(grid, args, constexprs, num_warps) of ``rope_kernel`` for :func:`launch_rope`'s arguments; None when
    there is nothing to rotate."""
    (positions, seq_offsets, cu_seqlens, inv_freq, cos, sin, pos_offset, sections, section_layout, layout, style,
     freq_mode, rotary_dim, rotary_start, table_by_token, q_scale, k_scale, rotary_scale, conjugate, _) = spec
    qc, qoc = to_canonical(q, layout), to_canonical(q_out, layout)
    B, S, HQ, D = qc.shape
    has_k = k is not None
    kc = to_canonical(k, layout) if has_k else qc
    koc = to_canonical(k_out, layout) if has_k else qoc
    HK = kc.shape[2] if has_k else 0
    num_tokens = B * S
    if num_tokens == 0 or (HQ == 0 and HK == 0):
        return None
    if num_tokens >= 2**31:  # the kernel indexes tokens in int32
        raise ValueError(f"at most 2**31 - 1 tokens (batch * seqlen) per call, got {num_tokens}; split the call")

    pos_sa = 0
    if sections is not None:  # multi-axis: positions [A, B, S]
        pos_mode, pos_t = kernel.POS_PER_TOKEN.value, positions
        pos_sa, pos_sb, pos_ss = positions.stride()
    elif positions is not None:
        pos_mode, pos_t = kernel.POS_PER_TOKEN.value, positions
        pos_sb, pos_ss = positions.stride()
    else:
        pos_t, pos_sb, pos_ss = q, 0, 0
        pos_mode = (kernel.POS_VARLEN if cu_seqlens is not None else kernel.POS_PER_SEQ if seq_offsets is not None
                    else kernel.POS_RANGE).value
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

    freq_mode_id = _FREQ_MODES[freq_mode]
    if freq_mode == "inv_freq" and inv_freq.dtype == torch.float32 and integer_angles(q.device):
        freq_mode_id = kernel.FREQ_INV_FREQ_INT.value
    copy_pass_q = D != rotary_dim and (q_out.data_ptr() != q.data_ptr() or q_scale != 1.0)
    copy_pass_k = has_k and D != rotary_dim and (k_out.data_ptr() != k.data_ptr() or k_scale != 1.0)
    if q.device.type != "cuda":  # the CPU interpreter pays per program: fewer, larger ones
        tile_bytes = max(tile_bytes, INTERPRETER_TILE_BYTES)
    stream = (q.device.type == "cuda" and pos_mode in (kernel.POS_RANGE.value, kernel.POS_PER_SEQ.value)
              and rotary_dim == D and 0 < _dram_gbps(q.device.index) < STREAM_DRAM_GBPS)
    # Axes that share one row (stride 0: positions expanded from one id tensor, as transformers' Qwen2-VL text
    # model builds them without images) are 1-D positions: one load a token instead of one a pair.
    axes = axis_constexprs(sections if pos_sa != 0 else None, section_layout)  # (NUM_AXES, AXES_INTERLEAVED, ...)
    stride_constant = axes[0] > 1 and num_tokens <= AXIS_STRIDE_CONSTANT_TOKENS
    shape, axis_loads = block_plan(
        num_tokens, HQ, HK, D, q.element_size(), _num_programs_wanted(q.device), tile_bytes, stream,
        freq_mode == "table" and table_full and q.device.type == "cuda", pair_axes=axes[1],
        small_grid=q.element_size() == 2 and freq_mode == "inv_freq",  # measured faster only there
        axis_stride_constant=stride_constant)
    block_t, block_hq, block_hk, num_warps = config or shape  # an override changes the shape, not the loads
    # Per-axis position loads (POS_PER_AXIS) only where they measured faster: see the note on them at the top.
    axis_loads = axis_loads and q.element_size() == 2 and (axes[1] or stride_constant)
    n_hb = _cdiv(HQ, block_hq) + (_cdiv(HK, block_hk) if has_k else 0)
    # Token blocks over grid axes 1 and 2 (see rope_kernel), split evenly: at most n_z - 1 programs past the end.
    n_tb = _cdiv(num_tokens, block_t)
    n_z = _cdiv(n_tb, MAX_GRID_Y)
    grid = (n_hb, _cdiv(n_tb, n_z), n_z)
    dummy = q
    unit = stride_unit(qc, qoc, kc, koc)
    args = (
        qc, qoc, kc, koc,
        *(stride // unit for t in (qc, qoc, kc, koc) for stride in t.stride()[:3]),
        HQ, HK, S, num_tokens,
        pos_t, pos_sb, pos_ss,
        seq_offsets if seq_offsets is not None else dummy, pos_offset,
        cu_seqlens if cu_seqlens is not None else dummy, n_seqs, n_search_steps,
        inv_freq if inv_freq is not None else dummy,
        cos if cos is not None else dummy, sin if sin is not None else dummy,
        t_sb, t_sr, t_sc, table_rows,
        q_scale, k_scale, rotary_scale, pos_sa,
    )
    constexprs = (
        D, rotary_dim, rotary_start, style == "neox", pos_mode, seq_offsets is not None,
        freq_mode_id, table_by_token, table_full, conjugate, has_k, copy_pass_q, copy_pass_k,
        block_t, block_hq, block_hk, _next_pow2(rotary_dim // 2),
        _next_pow2(max(D - rotary_dim, 1)), fast_trig(q.device.type, torch.version.hip),
        *axes, unit, pos_sa if stride_constant else 0,
        axis_loads,
    )
    return grid, args, constexprs, num_warps


_CONSTEXPR_NAMES = ("HEAD_DIM", "ROT_DIM", "ROT_START", "NEOX", "POS_MODE", "HAS_SEQ_OFFSETS", "FREQ_MODE",
                    "TABLE_BY_TOKEN", "TABLE_FULL", "CONJUGATE", "HAS_K", "COPY_PASS_Q", "COPY_PASS_K", "BLOCK_T",
                    "BLOCK_HQ", "BLOCK_HK", "HALF_BLOCK", "PASS_BLOCK", "FAST_TRIG", "NUM_AXES", "AXES_INTERLEAVED",
                    "AXIS_BOUND_1", "AXIS_BOUND_2", "AXIS_BOUND_3", "STRIDE_UNIT", "POS_AXIS_STRIDE",
                    "POS_PER_AXIS")
#: rope_kernel's row strides, which it takes in units of STRIDE_UNIT elements
ROW_STRIDES = tuple(f"{t}_s{d}" for t in ("q", "qo", "k", "ko") for d in ("b", "s", "h"))


class KernelRoles:
    """A kernel's runtime arguments by role, as positions in its signature (derived from its parameter names, so
    that a new argument cannot shift a hard-coded index): pointers (names ending in ``_ptr``), the ints Triton
    specialises on (all but ``floats`` and ``dynamic`` ones), and the constexprs, which its compiled handle takes
    positionally after the runtime arguments."""

    def __init__(self, fn, constexprs: tuple[str, ...], floats: tuple[str, ...], dynamic: tuple[str, ...]):
        names = fn.arg_names
        if tuple(names[-len(constexprs):]) != constexprs:
            raise ImportError(f"{fn.__name__}'s constexpr parameters changed: update its KernelRoles")
        self.fn, self.constexprs = fn, constexprs
        self.index = {name: i for i, name in enumerate(names)}
        self.pointers = tuple(i for i, n in enumerate(names) if n.endswith("_ptr"))
        self.ints = tuple(i for i, n in enumerate(names[:-len(constexprs)])
                          if i not in self.pointers and n not in floats and n not in dynamic)

    def key(self, args, constexprs, num_warps, device_index) -> tuple:
        """Everything Triton specialises the kernel on, and nothing else, so that the cache holds one entry per
        compiled variant (not one per sequence length): pointers' dtypes and 16-byte alignment, each int's class
        (:func:`_int_class`), the constexprs, the warp count and the device."""
        ptrs = [args[i] for i in self.pointers]
        return (self.fn, *[p.dtype for p in ptrs], *[p.data_ptr() & 15 for p in ptrs],
                *[_int_class(args[i]) for i in self.ints], constexprs, num_warps, device_index)


ROPE = KernelRoles(kernel.rope_kernel, _CONSTEXPR_NAMES, ("q_scale", "k_scale", "rotary_scale"), ("pos_offset",))
POINTER_ARGS = tuple(kernel.rope_kernel.arg_names[i] for i in ROPE.pointers)
_MAX_COMPILED = 256
_COMPILED: OrderedDict = OrderedDict()
# What Triton's own launch path reads to pick the device (no torch.cuda wrapper).
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
# What Triton's own launch path reads for the stream (its CUDA driver calls this torch function).
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

try:
    from triton import knobs as _knobs

    _RUNTIME_KNOBS = _knobs.runtime
except ImportError:  # older Triton: hooks live on CompiledKernel
    from triton.compiler import CompiledKernel as _RUNTIME_KNOBS


def _launch_hooks_idle() -> bool:
    """No launch hooks installed in Triton (None, or an empty hook chain in Triton >= 3.4)."""
    enter, exit_ = _RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook
    return (enter is None or not getattr(enter, "calls", True)) and (exit_ is None or not getattr(exit_, "calls", True))


def _run_compiled(compiled, grid, args, constexprs, device_index: int) -> None:
    """Launch an already compiled (and once launched) kernel through Triton's compiled launcher directly: what
    ``compiled[grid](...)`` ends in, without its per-call set-up; through ``compiled[grid]`` when a profiler hooked
    Triton's launches or this Triton lacks the attributes."""
    if _current_raw_stream is not None and _launch_hooks_idle() and getattr(compiled, "function", None) is not None:
        compiled.run(*grid, _current_raw_stream(device_index), compiled.function, compiled.packed_metadata, None,
                     None, None, *args, *constexprs)
    else:
        compiled[grid](*args, *constexprs)


def _int_class(v: int) -> int:
    """What Triton specialises an int argument on: == 1, divisible by 16, and whether it needs 64 bits."""
    return (v == 1) + 2 * (v & 15 == 0) + 4 * (not -(2**31) <= v < 2**31)


def _cache_key(args, constexprs, num_warps, device_index) -> tuple:
    return ROPE.key(args, constexprs, num_warps, device_index)


def _launch(grid, args, constexprs, num_warps, device, roles: KernelRoles = ROPE) -> None:
    """Launch ``roles.fn`` (``rope_kernel`` unless said); on CUDA, keep the compiled kernel per specialisation
    and call it directly.

    ``kernel[grid](...)`` re-binds and re-hashes ~50 arguments on every call (tens of microseconds of host
    time); the cached handle skips that. The first call for a specialisation goes through Triton (compiling if
    needed), so behaviour is Triton's own. The cache is bounded (least recently used out)."""
    if device.type != "cuda":
        roles.fn[grid](*args, **dict(zip(roles.constexprs, constexprs)), num_warps=num_warps)
        return
    if device.index is not None and device.index != _current_device():
        # Triton launches (and compiles) for the current device: make it the tensors' device.
        with torch.cuda.device(device.index):
            _launch(grid, args, constexprs, num_warps, device, roles)
        return
    key = roles.key(args, constexprs, num_warps, device.index)
    compiled = _COMPILED.get(key)
    if compiled is not None:
        _COMPILED.move_to_end(key)
        _run_compiled(compiled, grid, args, constexprs, device.index if device.index is not None else _current_device())
        return
    compiled = roles.fn[grid](*args, **dict(zip(roles.constexprs, constexprs)), num_warps=num_warps)
    if compiled is not None and hasattr(compiled, "__getitem__"):
        _COMPILED[key] = compiled
        if len(_COMPILED) > _MAX_COMPILED:
            _COMPILED.popitem(last=False)
