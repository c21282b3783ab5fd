"""Launcher of :func:`ropekit.triton.kernel.rope_kernel`: strides and modes, no copies; the block shapes come from
:mod:`ropekit.triton.heuristics`.

``launch_rope`` writes into the given outputs (which may be the inputs: in place) and allocates nothing, so it is
CUDA-graph capturable. It takes a validated :class:`ropekit._spec.RopeSpec` (the arguments of ``ropekit::rope``).
Benchmarks may call it directly to skip the dispatcher. :mod:`ropekit.triton.bound` binds a compiled launch for
the eager fast path.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from ropekit._spec import MAX_AXES, RopeSpec, to_canonical
from ropekit.triton import heuristics, kernel
from ropekit.triton.heuristics import TILE_BYTES

_FREQ_MODES = {"inv_freq": kernel.FREQ_INV_FREQ.value, "table": kernel.FREQ_TABLE.value,
               "angles": kernel.FREQ_ANGLES.value}

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
    if freq_mode == "inv_freq" and inv_freq.dtype == torch.float32 and heuristics.integer_angles(q.device):
        freq_mode_id = kernel.FREQ_INV_FREQ_INT.value
    copy_pass_q = D != rotary_dim and (q_out.data_ptr() != q.data_ptr() or q_scale != 1.0)
    copy_pass_k = has_k and D != rotary_dim and (k_out.data_ptr() != k.data_ptr() or k_scale != 1.0)
    if q.device.type != "cuda":  # the CPU interpreter pays per program: fewer, larger ones
        tile_bytes = max(tile_bytes, heuristics.INTERPRETER_TILE_BYTES)
    # Streaming (heuristics.STREAM_*): range or per-sequence positions, the whole head rotated, slower DRAM.
    stream = (q.device.type == "cuda" and pos_mode in (kernel.POS_RANGE.value, kernel.POS_PER_SEQ.value)
              and rotary_dim == D and 0 < heuristics.dram_gbps(q.device.index) < heuristics.STREAM_DRAM_GBPS)
    # Axes that share one row (stride 0: positions expanded from one id tensor, as transformers' Qwen2-VL text
    # model builds them without images) are 1-D positions: one load a token instead of one a pair.
    axes = axis_constexprs(sections if pos_sa != 0 else None, section_layout)  # (NUM_AXES, AXES_INTERLEAVED, ...)
    stride_constant = axes[0] > 1 and num_tokens <= heuristics.AXIS_STRIDE_CONSTANT_TOKENS
    shape, axis_loads = heuristics.block_plan(
        num_tokens, HQ, HK, D, q.element_size(), heuristics.num_programs_wanted(q.device), tile_bytes, stream,
        freq_mode == "table" and table_full and q.device.type == "cuda", pair_axes=axes[1],
        small_grid=q.element_size() == 2 and freq_mode == "inv_freq",  # measured faster only there
        axis_stride_constant=stride_constant)
    block_t, block_hq, block_hk, num_warps = config or shape  # an override changes the shape, not the loads
    # Per-axis position loads (POS_PER_AXIS) only where they measured faster: 2-byte dtypes, interleaved sections
    # or a constant axis stride (docs/perf-notes.md, "Tuning constants", POS_PER_AXIS).
    axis_loads = axis_loads and q.element_size() == 2 and (axes[1] or stride_constant)
    n_hb = heuristics.cdiv(HQ, block_hq) + (heuristics.cdiv(HK, block_hk) if has_k else 0)
    # Token blocks over grid axes 1 and 2 (see rope_kernel), split evenly: at most n_z - 1 programs past the end.
    n_tb = heuristics.cdiv(num_tokens, block_t)
    n_z = heuristics.cdiv(n_tb, heuristics.MAX_GRID_Y)
    grid = (n_hb, heuristics.cdiv(n_tb, n_z), n_z)
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
        block_t, block_hq, block_hk, heuristics.next_pow2(rotary_dim // 2),
        heuristics.next_pow2(max(D - rotary_dim, 1)), heuristics.fast_trig(q.device.type, torch.version.hip),
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
