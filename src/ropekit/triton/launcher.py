"""Launcher of :func:`ropekit.triton.kernel.rope_kernel`: its arguments and constexprs, by name, from a call's
tensors and its validated :class:`ropekit._spec.RopeSpec` (the arguments of ``ropekit::rope``); no copies.

``launch_rope`` writes into the given outputs (which may be the inputs: in place) and allocates nothing, so it is
CUDA-graph capturable. Benchmarks may call it directly to skip the dispatcher. The block shape comes from
:mod:`ropekit.triton.heuristics`, the launch itself goes through :func:`ropekit.triton.runtime.launch`; the
eager fast path replays it through :class:`ropekit.triton.runtime.Replay`.
"""

from __future__ import annotations

import math

import torch

from ropekit._spec import MAX_AXES, RopeSpec, to_canonical
from ropekit.triton import heuristics, kernel, runtime
from ropekit.triton.heuristics import TILE_BYTES

_FREQ_MODES = {"inv_freq": kernel.FREQ_INV_FREQ.value, "table": kernel.FREQ_TABLE.value,
               "angles": kernel.FREQ_ANGLES.value}

_FP8_KINDS = {torch.float8_e4m3fn: kernel.FP8_E4M3.value, torch.float8_e5m2: kernel.FP8_E5M2.value}
_NVIDIA = heuristics.fast_trig("cuda", torch.version.hip)  # fast_trig on CUDA devices: not a ROCm build
ROPE = runtime.KernelRoles(kernel.rope_kernel, ("q_scale", "k_scale", "rotary_scale"), ("pos_offset",))
#: rope_kernel's row strides, which it takes in units of STRIDE_UNIT elements
ROW_STRIDES = tuple(f"{t}_s{d}" for t in ("q", "qo", "k", "ko") for d in ("b", "s", "h"))


def stride_unit(*tensors: torch.Tensor) -> int:
    """The unit, in elements, in which ``rope_kernel`` takes the row strides (dims 0-2) of ``tensors`` and
    multiplies them back, so that the compiler knows how rows are aligned: Triton itself marks only ints divisible
    by 16, and a head stride of 72 elements (head_dim 72) would otherwise leave every access a 2-byte scalar.
    1 when every stride is divisible by 16 (Triton knows then, and the kernel stays as it was); else the largest
    power of two, at most 16 bytes of the widest tensor's elements, that divides them all."""
    return _unit_of(math.gcd(*[stride for t in tensors for stride in t.stride()[:3]]),
                    max(t.element_size() for t in tensors))


def _unit_of(strides_gcd: int, widest_element_bytes: int) -> int:
    """:func:`stride_unit` from the strides' greatest common divisor (0 when all are 0, which 16 divides)."""
    if strides_gcd % 16 == 0:
        return 1
    unit = 16 // widest_element_bytes
    while unit > 1 and strides_gcd % unit:
        unit //= 2
    return unit


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
                config: tuple[int, int, int, int] | None = None, q_scales: torch.Tensor | None = None,
                k_scales: torch.Tensor | None = None) -> None:
    """Rotate ``q`` (and ``k``) as ``spec`` says into ``q_out`` (and ``k_out``); outputs may alias their inputs
    exactly. ``config`` = (BLOCK_T, BLOCK_HQ, BLOCK_HK, num_warps) overrides the heuristic (tuning only).
    ``q_scales``/``k_scales`` (float32, q's and k's shapes without the last dim): float8 outputs with dynamic
    scales, each (token, head) row divided by its own ``max |row| / fp8 max``, which is stored there."""
    launch = rope_arguments(q, k, q_out, k_out, spec, tile_bytes, config, q_scales, k_scales, tokens_first_ok=True)
    if launch is not None:
        runtime.launch(ROPE, *launch, q.device)


def kernel_launch(q, k, q_out, k_out, spec: RopeSpec, tile_bytes: int = TILE_BYTES, config=None):
    """(grid, args, constexprs, num_warps) of :func:`rope_arguments`, the arguments and constexprs in
    ``rope_kernel``'s order (what its compiled handle takes); None when there is nothing to rotate."""
    launch = rope_arguments(q, k, q_out, k_out, spec, tile_bytes, config, tokens_first_ok=True)
    if launch is None:
        return None
    grid, args, constexprs, num_warps = launch
    return (grid, *ROPE.ordered(args, constexprs), num_warps)


def rope_arguments(q, k, q_out, k_out, spec: RopeSpec, tile_bytes: int = TILE_BYTES, config=None, q_scales=None,
                   k_scales=None, tokens_first_ok: bool = False):
    """(grid, args, constexprs, num_warps) of ``rope_kernel`` for :func:`launch_rope`'s arguments, ``args`` and
    ``constexprs`` as dicts by parameter name; None when there is nothing to rotate. ``tokens_first_ok``: the
    grid may be ``rope_kernel``'s tokens-first order (``TOKENS_FIRST``); the prologue, MLA and hidden-norm
    launchers, which reuse the grid, keep the (head blocks, token blocks) one."""
    # fields by name: a new RopeSpec field must not shift these
    positions, seq_offsets, cu_seqlens = spec.positions, spec.seq_offsets, spec.cu_seqlens
    inv_freq, cos, sin, freq_mode = spec.inv_freq, spec.cos, spec.sin, spec.freq_mode
    pos_offset, table_by_token, sections, section_layout = (spec.pos_offset, spec.table_by_token, spec.sections,
                                                            spec.section_layout)
    layout, style, rotary_dim, rotary_start = spec.layout, spec.style, spec.rotary_dim, spec.rotary_start
    q_scale, k_scale, rotary_scale, conjugate = spec.q_scale, spec.k_scale, spec.rotary_scale, spec.conjugate
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
    n_search_steps = max(1, (max(n_seqs, 1) - 1).bit_length()) + 1  # 1 + ceil(log2(n_seqs)), at least 2

    if cos is not None:  # tables are [Bt, rows, W], W = R/2 (one value per pair) or R (one per column)
        t_sb = cos.stride(0) if cos.shape[0] > 1 else 0
        t_sr, t_sc = cos.stride(1), cos.stride(2)
        table_rows = cos.shape[1]
        table_full = cos.shape[2] != rotary_dim // 2
    else:
        t_sb = t_sr = t_sc = table_rows = 0
        table_full = False

    # host time: this runs on every call without a plan, so device facts are read once
    device = q.device
    on_cuda = device.type == "cuda"
    elem = q.element_size()
    freq_mode_id = _FREQ_MODES[freq_mode]
    if freq_mode == "inv_freq" and inv_freq.dtype == torch.float32 and heuristics.integer_angles(device):
        freq_mode_id = kernel.FREQ_INV_FREQ_INT.value
    copy_pass_q = D != rotary_dim and (q_out.data_ptr() != q.data_ptr() or q_scale != 1.0)
    copy_pass_k = has_k and D != rotary_dim and (k_out.data_ptr() != k.data_ptr() or k_scale != 1.0)
    if not on_cuda:  # the CPU interpreter pays per program: fewer, larger ones
        tile_bytes = max(tile_bytes, heuristics.INTERPRETER_TILE_BYTES)
    # Streaming (heuristics.STREAM_*): range or per-sequence positions, the whole head rotated, slower DRAM.
    stream = (on_cuda and pos_mode in (kernel.POS_RANGE.value, kernel.POS_PER_SEQ.value)
              and rotary_dim == D and 0 < heuristics.dram_gbps(device.index) < heuristics.STREAM_DRAM_GBPS)
    # Axes that share one row (stride 0: positions expanded from one id tensor, as transformers' Qwen2-VL text
    # model builds them without images) are 1-D positions: one load a token instead of one a pair.
    axes = axis_constexprs(sections if pos_sa != 0 else None, section_layout)  # (NUM_AXES, AXES_INTERLEAVED, ...)
    stride_constant = axes[0] > 1 and num_tokens <= heuristics.AXIS_STRIDE_CONSTANT_TOKENS
    shape, axis_loads = heuristics.block_plan(
        num_tokens, HQ, HK, D, elem, heuristics.num_programs_wanted(device), tile_bytes, stream,
        freq_mode == "table" and table_full and on_cuda, pair_axes=axes[1],
        small_grid=elem == 2 and freq_mode == "inv_freq",  # measured faster only there
        axis_stride_constant=stride_constant)
    block_t, block_hq, block_hk, num_warps = config or shape  # an override changes the shape, not the loads
    # Per-axis position loads (POS_PER_AXIS) only where they measured faster: 2-byte dtypes, interleaved sections
    # or a constant axis stride (docs/perf-notes.md, "Tuning constants", POS_PER_AXIS).
    axis_loads = axis_loads and elem == 2 and (axes[1] or stride_constant)
    n_hb = heuristics.cdiv(HQ, block_hq) + (heuristics.cdiv(HK, block_hk) if has_k else 0)
    # Token blocks over grid axes 1 and 2 (see rope_kernel), split evenly: at most n_z - 1 programs past the end.
    n_tb = heuristics.cdiv(num_tokens, block_t)
    # Head-major q (its head stride past its token stride: bhsd) on a large grid walks tokens first, as a copy
    # would; decode grids keep a token's programs together (they share its position and angles).
    tokens_first = (tokens_first_ok and qc.stride(2) > qc.stride(1) and S > 1
                    and n_tb >= heuristics.num_programs_wanted(device))
    if tokens_first:
        grid = (n_tb, n_hb, 1)
    else:
        n_z = heuristics.cdiv(n_tb, heuristics.MAX_GRID_Y)
        grid = (n_hb, heuristics.cdiv(n_tb, n_z), n_z)
    dummy = q  # stands for absent tensors (never read)
    (q_sb, q_ss, q_sh), (qo_sb, qo_ss, qo_sh) = qc.stride()[:3], qoc.stride()[:3]
    (k_sb, k_ss, k_sh), (ko_sb, ko_ss, ko_sh) = kc.stride()[:3], koc.stride()[:3]
    # stride_unit's rule on the strides read once (this runs on every call without a plan: host time)
    unit = _unit_of(math.gcd(q_sb, q_ss, q_sh, qo_sb, qo_ss, qo_sh, k_sb, k_ss, k_sh, ko_sb, ko_ss, ko_sh),
                    max(elem, q_out.element_size(), kc.element_size(), koc.element_size()))
    args = {
        "q_ptr": qc, "qo_ptr": qoc, "k_ptr": kc, "ko_ptr": koc,
        # ROW_STRIDES, in units of STRIDE_UNIT elements
        "q_sb": q_sb // unit, "q_ss": q_ss // unit, "q_sh": q_sh // unit,
        "qo_sb": qo_sb // unit, "qo_ss": qo_ss // unit, "qo_sh": qo_sh // unit,
        "k_sb": k_sb // unit, "k_ss": k_ss // unit, "k_sh": k_sh // unit,
        "ko_sb": ko_sb // unit, "ko_ss": ko_ss // unit, "ko_sh": ko_sh // unit,
        "HQ": HQ, "HK": HK, "S": S, "num_tokens": num_tokens,
        "pos_ptr": pos_t, "pos_sb": pos_sb, "pos_ss": pos_ss,
        "seq_off_ptr": seq_offsets if seq_offsets is not None else dummy, "pos_offset": pos_offset,
        "cu_ptr": cu_seqlens if cu_seqlens is not None else dummy, "n_seqs": n_seqs, "n_search_steps": n_search_steps,
        "freq_ptr": inv_freq if inv_freq is not None else dummy,
        "cos_ptr": cos if cos is not None else dummy, "sin_ptr": sin if sin is not None else dummy,
        "t_sb": t_sb, "t_sr": t_sr, "t_sc": t_sc, "table_rows": table_rows,
        "q_scale": q_scale, "k_scale": k_scale, "rotary_scale": rotary_scale, "pos_sa": pos_sa,
    }
    for name, scales in (("qdyn", q_scales), ("kdyn", k_scales)):  # dynamic float8 scales: [B, S, H] strides
        strides = to_canonical(scales.unsqueeze(-1), layout).stride()[:3] if scales is not None else (0, 0, 0)
        args.update({f"{name}_ptr": scales if scales is not None else dummy, f"{name}_sb": strides[0],
                     f"{name}_ss": strides[1], f"{name}_sh": strides[2]})
    num_axes, interleaved, bound_1, bound_2, bound_3 = axes
    constexprs = {
        "HEAD_DIM": D, "ROT_DIM": rotary_dim, "ROT_START": rotary_start, "NEOX": style == "neox",
        "POS_MODE": pos_mode, "HAS_SEQ_OFFSETS": seq_offsets is not None, "FREQ_MODE": freq_mode_id,
        "TABLE_BY_TOKEN": table_by_token, "TABLE_FULL": table_full, "CONJUGATE": conjugate, "HAS_K": has_k,
        "COPY_PASS_Q": copy_pass_q, "COPY_PASS_K": copy_pass_k,
        "BLOCK_T": block_t, "BLOCK_HQ": block_hq, "BLOCK_HK": block_hk,
        "HALF_BLOCK": heuristics.next_pow2(rotary_dim // 2), "PASS_BLOCK": heuristics.next_pow2(max(D - rotary_dim, 1)),
        "FAST_TRIG": on_cuda and _NVIDIA,
        "NUM_AXES": num_axes, "AXES_INTERLEAVED": interleaved, "AXIS_BOUND_1": bound_1, "AXIS_BOUND_2": bound_2,
        "AXIS_BOUND_3": bound_3, "STRIDE_UNIT": unit, "POS_AXIS_STRIDE": pos_sa if stride_constant else 0,
        "POS_PER_AXIS": axis_loads, "OUT_FP8": _FP8_KINDS.get(q_out.dtype, 0),
        "ROUND_FP8": q_out.dtype in _FP8_KINDS and not on_cuda, "OUT_DYNAMIC": q_scales is not None,
        "TOKENS_FIRST": tokens_first,
    }
    return grid, args, constexprs, num_warps
