"""Block shapes and device queries: what the launchers ask before they build a launch, and what the probes in
``benchmarks/probes/`` sweep.

Each tuning constant states its rule; the measurements behind it are in docs/perf-notes.md, section "Tuning
constants: the measurements behind each", under the constant's name. Nothing here reads a tensor: the launchers
pass the numbers.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ropekit import _config

# --- rope_kernel's block shapes ----------------------------------------------------------------------------------
# Each rule's measurements: docs/perf-notes.md, "Tuning constants: the measurements behind each", under the name.
# A program rotates about TILE_BYTES of q (or k) per pass: one token's head tile of at most HEAD_TILE_ELEMS
# elements (D 128: 8 heads, 2 KB), with BYTES_PER_THREAD per thread on large grids.
TILE_BYTES = 2048
HEAD_TILE_ELEMS = 1024
BYTES_PER_THREAD = 64
# Streaming calls (see block_plan) on cards below STREAM_DRAM_GBPS take one 16-byte vector per thread, on grids of
# at least STREAM_MIN_PROGRAMS_FACTOR times the programs wanted.
STREAM_BYTES_PER_THREAD = 16
STREAM_DRAM_GBPS = 4000
STREAM_MIN_PROGRAMS_FACTOR = 8
# Decode grids (under LATENCY_BOUND_FACTOR times the programs wanted) are latency-bound: one 16-byte vector per
# thread.
LATENCY_BYTES_PER_THREAD = 16
LATENCY_BOUND_FACTOR = 2
# Interleaved M-RoPE sections on decode grids: two heads a thread once the grid fills about two thirds of the SMs
# (programs wanted / PAIR_AXES_SM_FRACTION; / PAIR_AXES_CONSTANT_STRIDE_SM_FRACTION, a program per SM, with a
# constant axis stride), two pairs a thread below that.
PAIR_AXES_BYTES_PER_THREAD = 32
PAIR_AXES_SM_FRACTION = 6
PAIR_AXES_CONSTANT_STRIDE_SM_FRACTION = 4
PAIR_AXES_LATENCY_BYTES_PER_THREAD = 8
# Decode grids of at most programs wanted / SMALL_GRID_SM_FRACTION programs with half the heads take half the
# heads per program at the same warps (2-byte dtypes with angles computed in the kernel only: the launcher says).
SMALL_GRID_SM_FRACTION = 6
# Full-width cos/sin tables (a value per column) on large grids: one 16-byte vector per thread, at least
# TABLE_MIN_HEADS heads per program; half-width tables keep the default.
TABLE_BYTES_PER_THREAD = 16
TABLE_MIN_HEADS = 8
# Multi-axis calls of at most this many tokens get the positions' axis stride as a compile-time constant
# (POS_AXIS_STRIDE): one compiled variant per token count up to it.
AXIS_STRIDE_CONSTANT_TOKENS = 32
INTERPRETER_TILE_BYTES = 65536  # the CPU interpreter pays per program: fewer, larger ones
MAX_UNROLL = 8  # tokens per program at most
MAX_GRID_Y = 65535  # CUDA's limit on the second grid axis

# --- the attention prologue's block shapes (measurements: as above) ------------------------------------------------
# Decode grids: one token and at most LATENCY_HEADS heads per program with LATENCY_WARPS warps, smaller programs
# than rope_kernel's decode shape (the norm's reduction and the cache rows favour them).
LATENCY_HEADS = 4
LATENCY_WARPS = 4
# Norm launches never stream. qk_norm_rope's forward with range or per-sequence positions: 2 tokens x 16 heads
# (NORM_FWD_TILE_BYTES, NORM_HEAD_TILE_ELEMS); its backward: 16 heads; partial rotary: the default shapes, the
# backward with twice the warps (its third accumulator spills registers otherwise).
NORM_FWD_TILE_BYTES = 8192
NORM_HEAD_TILE_ELEMS = 2048
# Backward programs per program wanted: each loops over token blocks, then writes one weight-gradient row and waits
# for its stores to be seen before it arrives in the rows' sum tree; fewer leave SMs idle, more wait more often.
BWD_PROGRAMS_PER_SM = 8
# Software-pipeline stages of the backward's loop over token blocks (1: none).
BWD_STAGES = 1
# Children per node of the tree in which the backward's programs add up those rows (sum_tree; a power of two): a
# [16, D] fp32 tile per node is 64 registers a thread at one warp and D 128, no more than the main loop holds. The
# kernel is compiled for WEIGHT_SUM_LEVELS levels (16 ** 4 rows; an H100's or H200's grid has about 4224, shared by
# q's and k's weights), so that the row count, which varies with short inputs, never compiles another variant.
WEIGHT_SUM_FAN_IN = 16
WEIGHT_SUM_LEVELS = 4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    # triton.cdiv / triton.next_power_of_2 are constexpr functions whose Python call costs microseconds each
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# --- device queries -----------------------------------------------------------------------------------------------

@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def dram_gbps(device_index: int) -> float:
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
def fast_float64(device_index: int) -> bool:
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
    return not fast_float64(device.index if device.index is not None else torch.cuda.current_device())


def num_programs_wanted(device: torch.device) -> int:
    """Programs that keep every SM busy; the CPU interpreter wants as few as possible."""
    if device.type != "cuda":
        return 1
    return 4 * sm_count(device.index if device.index is not None else torch.cuda.current_device())


# --- rope_kernel ---------------------------------------------------------------------------------------------------

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
    which the launcher decides), where multi-axis positions are loaded once per axis (``POS_PER_AXIS``) --
    decided here with the shape, so that no interleaved grid takes those loads with two heads a thread. The
    launcher narrows it to where the loads measured faster (2-byte dtypes; contiguous sections up to
    ``AXIS_STRIDE_CONSTANT_TOKENS`` tokens; docs/perf-notes.md, "Tuning constants", ``POS_PER_AXIS``).

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
    d_pad = next_pow2(head_dim)
    heads_cap = max(1, head_tile_elems // d_pad)
    block_hq = min(next_pow2(hq), heads_cap)
    block_hk = min(next_pow2(max(hk, 1)), heads_cap)
    per_token_bytes = block_hq * d_pad * elem_size
    block_t = max(1, min(MAX_UNROLL, tile_bytes // per_token_bytes, next_pow2(num_tokens)))

    def programs(bt: int, bhq: int = block_hq, bhk: int = block_hk) -> int:
        return cdiv(num_tokens, bt) * (cdiv(hq, bhq) + (cdiv(hk, bhk) if hk else 0))

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


# --- the attention prologue's kernels ------------------------------------------------------------------------------

def prologue_latency_config(dims: tuple, min_programs: int) -> tuple[int, int, int, int] | None:
    """The block shape of a prologue kernel's latency-bound (decode) grid, ``dims`` = (tokens, HQ, HK, head_dim,
    element size): one token and at most ``LATENCY_HEADS`` heads per program with ``LATENCY_WARPS`` warps. None
    elsewhere: the default."""
    T, HQ, HK, _, _ = dims
    bt, bhq, bhk, _ = block_config(*dims, min_programs)
    programs = cdiv(T, bt) * (cdiv(HQ, bhq) + cdiv(HK, bhk))
    if programs >= LATENCY_BOUND_FACTOR * min_programs:
        return None
    return 1, min(bhq, LATENCY_HEADS), min(bhk, LATENCY_HEADS), LATENCY_WARPS


def norm_block_config(num_tokens: int, hq: int, hk: int, head_dim: int, elem_size: int, min_programs: int,
                      kind: str, partial: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_HQ, BLOCK_HK, num_warps) of a norm kernel's launch: ``kind`` "forward" (qk_norm_rope's,
    positions as a range or per-sequence offsets), "backward", or "default" (cache writes, gathered positions);
    ``partial`` (pass-through columns): the default shape, with twice the warps for the backward."""
    dims = (num_tokens, hq, hk, head_dim, elem_size, min_programs)
    if partial or kind == "default":
        bt, bhq, bhk, warps = block_config(*dims)
        return bt, bhq, bhk, min(8, 2 * warps) if partial and kind == "backward" else warps
    tile_bytes = NORM_FWD_TILE_BYTES if kind == "forward" else TILE_BYTES
    return block_config(*dims, tile_bytes, head_tile_elems=NORM_HEAD_TILE_ELEMS)


def prologue_config(dims: tuple, min_programs: int, *, norm: bool, cache: bool, gathered: bool,
                    partial: bool) -> tuple[int, int, int, int] | None:
    """The block shape of ``prologue_kernel`` on a CUDA device (None: rope_kernel's own choice), ``dims`` as
    :func:`prologue_latency_config` takes them: decode grids the latency shape; with a norm,
    :func:`norm_block_config`'s "forward" shape for qk_norm_rope (no ``cache``) with range or per-sequence
    positions (not ``gathered``), else its "default"."""
    config = prologue_latency_config(dims, min_programs)
    if config is not None or not norm:
        return config
    return norm_block_config(*dims, min_programs, "default" if cache or gathered else "forward", partial=partial)


class SumTree(NamedTuple):
    """The deterministic tree in which ``norm_rope_bwd_kernel`` adds up one weight's partial gradient rows:
    ``levels`` of nodes above the rows, ``rows`` stored (the partial rows and every level below the root), one
    arrival counter per node (``counters``)."""

    levels: int
    rows: int
    counters: int


def sum_tree(n_rows: int, fan_in: int) -> SumTree:
    """The :class:`SumTree` of ``n_rows`` (at least 1) partial rows with ``fan_in`` (a power of two, at least 2)
    children per node."""
    if n_rows < 1 or fan_in < 2:
        raise ValueError(f"a sum tree needs at least one row and two children per node, got {n_rows}, {fan_in}")
    levels, rows, counters, n = 0, n_rows, 0, n_rows
    while True:
        n, levels = cdiv(n, fan_in), levels + 1
        counters += n
        if n == 1:
            return SumTree(levels, rows, counters)
        rows += n


def bwd_program_groups(n_token_blocks: int, n_head_blocks: int, device: torch.device) -> int:
    """Programs per head block of ``norm_rope_bwd_kernel``: enough to fill the device (``BWD_PROGRAMS_PER_SM``
    per program wanted), each looping over its share of the token blocks."""
    return min(n_token_blocks, max(1, cdiv(BWD_PROGRAMS_PER_SM * num_programs_wanted(device), n_head_blocks)))
