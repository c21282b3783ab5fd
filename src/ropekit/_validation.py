"""Validation: every check of a public call, run before anything is written, turning its arguments into the specs
of :mod:`ropekit._spec` -- :func:`validate_args` (the rotation), :func:`validate_norm`, :func:`validate_out_quant` and
:func:`check_inplace_targets` (the prologue's caches: :mod:`ropekit._cache_validation`). Raises
``TypeError``/``ValueError``/``IndexError`` naming the argument.

This module imports nothing of ropekit above the leaves (``_spec``, ``_config``, ``_memory``, ``frequencies``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from ropekit import _config
from ropekit._memory import has_internal_overlap, overlap
from ropekit._spec import (
    BACKENDS,
    FLOAT_DTYPES,
    FORWARD,
    FP8_DTYPES,
    INT_DTYPES,
    LAYOUTS,
    MAX_AXES,
    MAX_POSITION,
    ROTARY_AT,
    SECTION_LAYOUTS,
    Mode,
    NormSpec,
    OutQuant,
    OutScales,
    RopeArgs,
    RopeSpec,
    layout_ndim,
    layout_shape,
    needs_grad,
    to_canonical,
)
from ropekit.frequencies import STYLES, default_inv_freq

_SYMBOLIC = (torch.SymFloat, torch.SymInt)


def _is_real(value) -> bool:
    """A real Python number (not a bool), or a symbolic one (:func:`_is_symbolic`); the exact-type test first
    because ABC checks cost microseconds."""
    t = type(value)
    return t is float or t is int or (isinstance(value, (numbers.Real, *_SYMBOLIC)) and t is not bool)


def _is_symbolic(value) -> bool:
    """A ``torch.SymFloat``/``torch.SymInt`` (symbolic tracing): a number whose value is not known here, so only its
    type is checked. (torch.compile hands the float and int arguments of a ``dynamic=True`` graph to validation as
    numbers whose comparisons it can trace, specialising the graph on them; ``math.isfinite`` it cannot trace.)"""
    return isinstance(value, _SYMBOLIC)


def _finite(value) -> bool:
    """``value`` is finite (by comparisons, which torch.compile traces), or symbolic."""
    return _is_symbolic(value) or -math.inf < value < math.inf


def _is_int(value) -> bool:
    """An integer (Python, numpy or symbolic), not a bool."""
    return type(value) is int or (isinstance(value, (numbers.Integral, torch.SymInt)) and not isinstance(value, bool))


def _dense(t: Tensor) -> Tensor:
    """``t`` (1-D) with unit stride: the kernels index per-sequence offsets and cu_seqlens densely (a copy only for
    a strided or expanded view)."""
    return t if t.numel() <= 1 or t.stride(0) == 1 else t.contiguous()


def check_last_dim(name: str, x: Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``x``'s last dim is contiguous (stride 1; an empty tensor passes):
    the kernels step through a row's columns one element apart. The rule for q and k here, and for the tensors the
    registered ops write in place (``rope_``'s q and k, the caches), whose callers may skip validation; with a
    stride of 0 (an ``expand()``ed view) several columns would also share one element."""
    if x.stride(-1) != 1 and x.numel() > 0:
        shared = " (stride 0: an expand()ed view, whose columns share one element)" if x.stride(-1) == 0 else ""
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides "
                         f"{tuple(x.stride())}{shared}")


def _check_offset_tensor(positions: Tensor, q: Tensor) -> None:
    """A 0-d ``positions`` tensor (one offset for every sequence): an integer tensor on q's device."""
    if positions.dtype not in INT_DTYPES:
        raise TypeError(f"positions must be an int32 or int64 tensor, got {positions.dtype}")
    if positions.device != q.device:
        raise ValueError(f"positions (a 0-d offset tensor) must be on q's device {q.device}, got {positions.device}; "
                         "pass int(positions) for an offset held on the host")


def _host_readable(t: Tensor) -> bool:
    """Whether the values of ``t`` can be checked on the host without a device sync. CPU tensors that run the
    kernels (:func:`ropekit.testing.kernels_on_cpu`) stand in for device tensors, so they are not read either."""
    return t.device.type == "cpu" and not _config.kernels_on_cpu


def check_cu_seqlens_bounds(cu_seqlens: Tensor, tokens: int) -> Tensor:
    """``cu_seqlens`` read on the host (one sync for a device tensor) and checked: from 0 to ``tokens``, never
    decreasing. The one check of the boundaries' values (:func:`ropekit.rope_attention` reads them too)."""
    cu = cu_seqlens.cpu()
    if cu[0] != 0 or cu[-1] != tokens or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the token count {tokens}; "
                         f"got {cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}")
    return cu


def _check_tensor(name: str, x, ref: Tensor, dtypes: tuple, what: str, ref_name: str = "q") -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must be {what}, got {x.dtype}")
    if x.device != ref.device:
        raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {x.device}")


def _resolve_table(name: str, table, q: Tensor, batch: int, seqlen: int, rotary_dim: int | None,
                   head_dim: int) -> tuple[Tensor, bool, int]:
    """A cos/sin/angles table as a 3-D [Bt, rows, W] view, whether rows are tokens, and the rotary_dim."""
    _check_tensor(name, table, q, FLOAT_DTYPES, "a float16/bfloat16/float32/float64 tensor")
    if table.dim() == 2:  # [P, W]: one row per position
        table3, by_token = table.unsqueeze(0), False
    elif table.dim() == 3:  # [B|1, S, W]: one row per token, already gathered
        if table.shape[0] not in (1, batch) or table.shape[1] != seqlen:
            raise ValueError(f"{name} with 3 dims holds one row per token and must be [B, S, W] or [1, S, W] "
                             f"with B={batch}, S={seqlen}; got {tuple(table.shape)}")
        table3, by_token = table, True
    else:
        raise ValueError(f"{name} must be [P, W] (rows indexed by position) or [B, S, W] (one row per token), "
                         f"got shape {tuple(table.shape)}")
    width = table3.shape[-1]
    if rotary_dim is None:
        rotary_dim = width if width == head_dim else 2 * width
        if not 2 <= rotary_dim <= head_dim:
            raise ValueError(f"{name} last dim must be in [1, head_dim/2 = {head_dim // 2}] (one value per pair of "
                             f"the rotary_dim = 2 * W rotated columns) or head_dim = {head_dim} (one per column), "
                             f"got {width}")
    if width not in (rotary_dim // 2, rotary_dim):
        raise ValueError(f"{name} last dim must be rotary_dim/2 = {rotary_dim // 2} (one value per pair) or "
                         f"rotary_dim = {rotary_dim} (one per column), got {width}")
    return table3, by_token, rotary_dim


def validate(q: Tensor, k: Tensor | None, *, mode: Mode = FORWARD, **keywords) -> RopeSpec:
    """:func:`validate_args` of the :class:`RopeArgs` that ``keywords`` (the public API's keywords) make: the
    convenient form for tests, probes and the other backends."""
    return validate_args(q, k, RopeArgs(**keywords), mode)


def validate_args(q: Tensor, k: Tensor | None, args: RopeArgs, mode: Mode = FORWARD) -> RopeSpec:
    """Check a public call's arguments (see :func:`ropekit.apply_rope`) and return its :class:`RopeSpec`. ``mode``
    says whether the call rotates in place (its targets are checked too), by -theta, and what errors call q and k.
    Raises ``TypeError``/``ValueError``/``IndexError`` naming the argument."""
    positions, inv_freq, base, cos, sin, angles = (args.positions, args.inv_freq, args.base, args.cos, args.sin,
                                                   args.angles)
    style, layout, rotary_dim, rotary_at = args.style, args.layout, args.rotary_dim, args.rotary_at
    q_scale, k_scale, rotary_scale = args.q_scale, args.k_scale, args.rotary_scale
    cu_seqlens, sections, section_layout = args.cu_seqlens, args.sections, args.section_layout
    check_positions, out_dtype, backend = args.check_positions, args.out_dtype, args.backend
    qn, kn = mode.names
    # --- q and k ---------------------------------------------------------------------------------------------
    if not isinstance(q, Tensor):
        raise TypeError(f"{qn} must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{qn} must be a floating tensor (float16, bfloat16, float32 or float64), got {q.dtype}")
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    ndim = layout_ndim(layout)
    if q.dim() != ndim:
        raise ValueError(f"{qn} must have {ndim} dims for layout {layout!r} ({layout_shape(layout)}), "
                         f"got shape {tuple(q.shape)}")
    qc = to_canonical(q, layout)
    B, S, HQ, D = qc.shape
    if k is not None:
        _check_tensor(kn, k, q, (q.dtype,), f"of {qn}'s dtype {q.dtype}", qn)
        if k.dim() != ndim:
            raise ValueError(f"{kn} must have {ndim} dims for layout {layout!r}, got shape {tuple(k.shape)}")
        kc = to_canonical(k, layout)
        if kc.shape[0] != B or kc.shape[1] != S:
            raise ValueError(f"{kn} must have {qn}'s batch and sequence sizes ({B}, {S}) in layout {layout!r}, "
                             f"got {tuple(kc.shape[:2])}")
        if kc.shape[3] != D:
            raise ValueError(f"{kn} head_dim {kc.shape[3]} must equal {qn} head_dim {D}")
    check_last_dim(qn, q)
    if k is not None:
        check_last_dim(kn, k)
    if D % 2:
        raise ValueError(f"head_dim must be even, got {D}")
    if not isinstance(style, str) or style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if not isinstance(rotary_at, str) or rotary_at not in ROTARY_AT:
        raise ValueError(f"rotary_at must be 'front' or 'back', got {rotary_at!r}")
    for name, value in (("q_scale", q_scale), ("k_scale", k_scale), ("rotary_scale", rotary_scale)):
        if not _is_real(value) or not _finite(value):
            raise TypeError(f"{name} must be a finite real number, got {value!r}")
    if rotary_dim is not None and (not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool)):
        raise TypeError(f"rotary_dim must be an int, got {type(rotary_dim).__name__}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if out_dtype is not None:
        if not isinstance(out_dtype, torch.dtype) or out_dtype not in FLOAT_DTYPES + FP8_DTYPES:
            raise TypeError(f"out_dtype must be None or a floating dtype (float16, bfloat16, float32, float64, "
                            f"float8_e4m3fn, float8_e5m2), got {out_dtype!r}")
        if mode.inplace and out_dtype != q.dtype:
            raise ValueError(f"an in-place rotation writes {qn}'s own dtype {q.dtype}; got out_dtype={out_dtype}")
        if out_dtype in FP8_DTYPES and (mode.conjugate or needs_grad(q, k)):
            raise RuntimeError(f"out_dtype={out_dtype} is for inference: not for rope_backward or inputs that "
                               "require grad (call under torch.no_grad() or torch.inference_mode())")
        if out_dtype == q.dtype:
            out_dtype = None  # one spelling of "the input dtype", so equal calls get equal specs

    # --- frequencies -----------------------------------------------------------------------------------------
    sources = [n for n, v in (("inv_freq", inv_freq), ("cos/sin", cos if cos is not None else sin),
                              ("angles", angles)) if v is not None]
    if len(sources) > 1:
        raise ValueError(f"give one frequency source, got {' and '.join(sources)}")
    table_by_token, table_rows = False, None
    if inv_freq is not None:
        _check_tensor("inv_freq", inv_freq, q, (torch.float32, torch.float64), "a float32 or float64 tensor")
        if inv_freq.dim() != 1:
            raise ValueError(f"inv_freq must be 1-D [rotary_dim/2], got shape {tuple(inv_freq.shape)}")
        if rotary_dim is None:
            rotary_dim = 2 * inv_freq.shape[0]
            if not 2 <= rotary_dim <= D:
                raise ValueError(f"inv_freq must have rotary_dim/2 entries, one per rotated pair: 1 to head_dim/2 = "
                                 f"{D // 2}; got {inv_freq.shape[0]}")
        if inv_freq.shape[0] != rotary_dim // 2:
            raise ValueError(f"inv_freq must have rotary_dim/2 = {rotary_dim // 2} entries, got "
                             f"{inv_freq.shape[0]}")
        inv_freq = inv_freq.contiguous()  # the kernels index it densely (a copy only for a strided view)
        freq_mode = "inv_freq"
    elif cos is not None or sin is not None:
        if cos is None or sin is None:
            raise ValueError("cos and sin must be given together")
        cos, table_by_token, rotary_dim = _resolve_table("cos", cos, q, B, S, rotary_dim, D)
        sin, _, _ = _resolve_table("sin", sin, q, B, S, rotary_dim, D)
        if sin.shape != cos.shape:
            raise ValueError(f"sin shape {tuple(sin.shape)} must equal cos shape {tuple(cos.shape)}")
        if sin.stride() != cos.stride():  # the kernel addresses both tables with one set of strides
            cos, sin = cos.contiguous(), sin.contiguous()
        freq_mode, table_rows = "table", cos.shape[1]
    elif angles is not None:
        cos, table_by_token, rotary_dim = _resolve_table("angles", angles, q, B, S, rotary_dim, D)
        freq_mode, table_rows = "angles", cos.shape[1]
    else:
        if not _is_real(base) or not 1.0 < base < math.inf:
            raise ValueError(f"base must be a finite real number > 1, got {base!r}")
        rotary_dim = D if rotary_dim is None else rotary_dim
        freq_mode = "inv_freq"
    if rotary_dim % 2 or not 2 <= rotary_dim <= D:
        raise ValueError(f"rotary_dim must be even and in [2, head_dim={D}], got {rotary_dim}")
    if freq_mode == "inv_freq" and inv_freq is None:
        inv_freq = default_inv_freq(float(base), rotary_dim, q.device)

    # --- positions -------------------------------------------------------------------------------------------
    seq_offsets = pos_tensor = None
    pos_offset = 0
    if cu_seqlens is not None:
        if layout != "thd":
            raise ValueError(f"cu_seqlens needs layout='thd', got layout={layout!r}")
        _check_tensor("cu_seqlens", cu_seqlens, q, INT_DTYPES, "an int32 or int64 tensor")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D [num_seqs + 1] with at least 2 entries, got shape "
                             f"{tuple(cu_seqlens.shape)}")
        if (_host_readable(cu_seqlens) or check_positions) and not torch.compiler.is_compiling():
            check_cu_seqlens_bounds(cu_seqlens, S)
        cu_seqlens = _dense(cu_seqlens)
    num_seqs = cu_seqlens.numel() - 1 if cu_seqlens is not None else B
    if sections is not None:
        pos_tensor, sections = _multi_axis(q, positions, sections, section_layout, layout, B, S, rotary_dim,
                                           freq_mode)
        cu_seqlens = None  # per-token positions already say everything
    elif section_layout != "contiguous":
        raise ValueError("section_layout applies to multi-axis positions: give sections= too")
    if sections is not None or positions is None:
        pass
    elif _is_int(positions):
        pos_offset = int(positions)
        if pos_offset < 0:
            raise ValueError(f"positions (an offset) must be >= 0, got {pos_offset}")
        if table_by_token:
            raise ValueError("positions cannot be combined with per-token cos/sin/angles rows (3-D tables are already "
                             "gathered per token); pass [P, W] tables to index them by position")
    elif isinstance(positions, Tensor) and positions.dim() == 0:  # one offset for every sequence
        _check_offset_tensor(positions, q)
        if table_by_token:
            raise ValueError("positions cannot be combined with per-token cos/sin/angles rows (3-D tables are already "
                             "gathered per token); pass [P, W] tables to index them by position")
        if _host_readable(positions) and not torch.compiler.is_compiling():
            pos_offset = int(positions)  # a host scalar: the int offset
            if pos_offset < 0:
                raise ValueError(f"positions (an offset) must be >= 0, got {pos_offset}")
        else:  # a device scalar: the kernel reads it as every sequence's offset, without a host sync
            seq_offsets = _dense(positions.reshape(1).expand(num_seqs))
    elif isinstance(positions, Tensor):
        _check_tensor("positions", positions, q, INT_DTYPES, "an int32 or int64 tensor")
        if table_by_token:
            raise ValueError("positions cannot be combined with per-token cos/sin rows (3-D tables are already "
                             "gathered per token); pass [P, W] tables to index them by position")
        if positions.dim() == 1 and positions.shape[0] == num_seqs and (cu_seqlens is not None or layout != "thd"):
            seq_offsets = _dense(positions)
        elif layout == "thd" and positions.dim() == 1 and positions.shape[0] == S:
            pos_tensor = positions.unsqueeze(0)
        elif layout != "thd" and positions.dim() == 2 and positions.shape[1] == S and positions.shape[0] in (1, B):
            pos_tensor = positions.expand(B, S)
        else:
            want = (f"[{num_seqs}] per-sequence offsets or [T={S}] per-token positions" if layout == "thd"
                    else f"[B={B}] per-sequence offsets or [B, S] = [{B}, {S}] (or [1, {S}]) per-token positions")
            hint = ""
            if positions.dim() == (2 if layout == "thd" else 3):
                hint = (f"; a {positions.dim()}-D positions tensor holds multi-axis positions (one row of ids per "
                        f"axis, M-RoPE): pass sections= too (rotary pairs per axis)")
            raise ValueError(f"positions must be {want}, got shape {tuple(positions.shape)}{hint}")
        if pos_tensor is not None and cu_seqlens is not None:
            cu_seqlens = None  # per-token positions already say everything
    else:
        raise TypeError(f"positions must be None, an int offset or an integer tensor, got "
                        f"{type(positions).__name__}")
    _check_position_values(S, pos_offset, seq_offsets, pos_tensor, table_rows, table_by_token, check_positions,
                           cu_seqlens)
    if mode.inplace:
        check_inplace_targets(q, k, mode.names)

    return RopeSpec(
        positions=pos_tensor, seq_offsets=seq_offsets, cu_seqlens=cu_seqlens, inv_freq=inv_freq,
        cos=cos if freq_mode != "inv_freq" else None, sin=sin if freq_mode == "table" else None,
        pos_offset=pos_offset, sections=sections, section_layout=section_layout, layout=layout, style=style,
        freq_mode=freq_mode, rotary_dim=rotary_dim,
        rotary_start=0 if rotary_at == "front" else D - rotary_dim, table_by_token=table_by_token,
        q_scale=float(q_scale), k_scale=float(k_scale), rotary_scale=float(rotary_scale),
        conjugate=mode.conjugate, out_dtype=out_dtype)


def _multi_axis(q: Tensor, positions, sections, section_layout: str, layout: str, B: int, S: int, rotary_dim: int,
                freq_mode: str) -> tuple[Tensor, tuple[int, ...]]:
    """Check multi-axis (M-RoPE) arguments; the positions as an [A, B, S] view and the sections as a tuple."""
    if isinstance(sections, (str, bytes)) or not isinstance(sections, Sequence) or not sections:
        raise TypeError(f"sections must be a non-empty sequence of ints (pairs per axis), got {sections!r}")
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in sections):
        raise ValueError(f"sections must hold ints >= 0 (pairs per axis), got {list(sections)}")
    sections = tuple(sections)
    A = len(sections)
    if A > MAX_AXES:
        raise ValueError(f"sections may name at most {MAX_AXES} axes (pairs per axis), got {A}: {list(sections)}")
    if sum(sections) != rotary_dim // 2:
        raise ValueError(f"sections must sum to rotary_dim/2 = {rotary_dim // 2} (pairs), got {list(sections)} "
                         f"(sum {sum(sections)})")
    if not isinstance(section_layout, str) or section_layout not in SECTION_LAYOUTS:
        raise ValueError(f"section_layout must be one of {SECTION_LAYOUTS}, got {section_layout!r}")
    if freq_mode != "inv_freq":
        raise ValueError("multi-axis positions (sections=) take their frequencies from base or inv_freq; cos/sin "
                         "tables and raw angles are per position of one axis")
    want = f"[{A}, T={S}]" if layout == "thd" else f"[{A}, B={B}, S={S}] (or [{A}, 1, {S}])"
    if not isinstance(positions, Tensor):
        raise TypeError(f"sections need positions as an integer tensor {want}, one row of ids per axis; got "
                        f"{type(positions).__name__}")
    _check_tensor("positions", positions, q, INT_DTYPES, "an int32 or int64 tensor")
    if layout == "thd" and positions.dim() == 2 and tuple(positions.shape) == (A, S):
        pos = positions.unsqueeze(1)
    elif layout != "thd" and positions.dim() == 3 and positions.shape[0] == A and positions.shape[2] == S \
            and positions.shape[1] in (1, B):
        pos = positions.expand(A, B, S)
    else:
        raise ValueError(f"with {A} sections, positions must be {want}, one row per axis; got shape "
                         f"{tuple(positions.shape)}")
    if (A - 1) * pos.stride(0) >= 2**31:  # the kernels offset an axis's row in int32
        raise ValueError(f"positions: the rows of the {A} axes lie {pos.stride(0)} elements apart; the kernels "
                         f"address them within 2**31 elements -- pass positions.contiguous(), and split calls "
                         f"of more than {(2**31 - 1) // max(A - 1, 1)} tokens")
    return pos, sections


def _last_position(offsets: Tensor, lens: Tensor) -> int | None:
    """The largest position ``offsets[i] + lens[i] - 1`` among the non-empty sequences (int64 tensors on the host),
    or None where every sequence is empty. A Python int: an offset near 2**63 does not wrap around (of offsets
    past 2**62, the position returned is one the call reaches, not necessarily the largest)."""
    used = lens > 0
    if not bool(used.any()):
        return None
    offsets, lens = offsets[used], lens[used]
    i = int((offsets.clamp(max=2**62) + lens).argmax())
    return int(offsets[i]) + int(lens[i]) - 1


def _check_position_values(S, pos_offset, seq_offsets, pos_tensor, table_rows, table_by_token, check_positions,
                           cu_seqlens) -> None:
    """Raise for a position < 0, past a position-indexed table or past ``MAX_POSITION``, wherever the values are
    known on the host (an int offset, CPU tensors, or ``check_positions``: one sync). Otherwise the kernel writes
    NaN for the offending tokens. Empty sequences have no positions to check."""
    if torch.compiler.is_compiling():  # values are unknown while tracing; the kernel marks bad tokens NaN
        return
    limit = None if table_by_token else table_rows

    def readable(t: Tensor) -> bool:
        return check_positions or _host_readable(t)

    lengths = None  # [num_seqs] int64 on the host, for packed sequences whose boundaries can be read
    if cu_seqlens is not None and readable(cu_seqlens):
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to("cpu", torch.int64)
    if pos_tensor is not None:
        if not readable(pos_tensor) or pos_tensor.numel() == 0:
            return
        name, (lo, hi) = "positions", (int(v) for v in torch.aminmax(pos_tensor))  # one pass, one op
    elif seq_offsets is not None:
        if not readable(seq_offsets) or (cu_seqlens is not None and lengths is None):
            return
        offsets = seq_offsets.to("cpu", torch.int64)
        lens = lengths if cu_seqlens is not None else torch.full_like(offsets, S)
        hi = _last_position(offsets, lens)
        if hi is None:
            return
        name, lo = "positions (per-sequence offsets)", int(offsets[lens > 0].min())
    else:
        if cu_seqlens is None:
            longest = S
        elif lengths is None:
            return
        else:
            longest = int(lengths.max()) if lengths.numel() else 0
        if longest == 0:
            return
        name, lo, hi = "positions", pos_offset, pos_offset + longest - 1
    if lo < 0:
        raise IndexError(f"{name} must be >= 0, got {lo}")
    if limit is not None and hi >= limit:
        raise IndexError(f"{name} reach {hi} but the cos/sin table has {limit} rows")
    if hi > MAX_POSITION:
        raise ValueError(f"{name} reach {hi}, past the largest supported position 2**31 - 1 = {MAX_POSITION} "
                         "(ropekit's angles are exact to ~5e-7 rad up to there)")


def check_inplace_targets(q: Tensor, k: Tensor | None, names: tuple[str, str]) -> None:
    """Refuse, before anything is written, what an in-place rotation cannot do correctly: tensors whose own
    elements overlap (one element would be rotated twice), q and k sharing memory (their stores would race),
    inference tensors outside inference mode, and leaves that require grad (autograd would notice only after
    the kernel ran)."""
    pairs = ((names[0], q),) if k is None else ((names[0], q), (names[1], k))
    for name, x in pairs:
        if has_internal_overlap(x):
            raise ValueError(f"{name} cannot be rotated in place: its strides {tuple(x.stride())} for shape "
                             f"{tuple(x.shape)} reach some elements more than once (an expand()ed or overlapping "
                             "as_strided view); rotate a .clone() or use apply_rope")
    if torch.compiler.is_compiling():  # no addresses while tracing; autograd and torch raise at trace time
        return
    for name, x in pairs:
        if x.is_inference() and not torch.is_inference_mode_enabled():
            raise RuntimeError(f"{name} is an inference tensor: it can be rotated in place only inside "
                               "torch.inference_mode(); use apply_rope, or rotate a .clone()")
    if k is not None and overlap(q, k):
        raise ValueError(f"{names[0]} and {names[1]} share memory; an in-place rotation would write some elements "
                         "twice. Pass non-overlapping views (e.g. the q and k parts of a packed QKV buffer)")
    if not torch.is_grad_enabled():
        return
    for name, x in pairs:
        if not x.requires_grad:
            continue
        root = x._base if x._base is not None else x
        if root.is_leaf:
            raise RuntimeError(f"apply_rope_ cannot rotate {name} in place: it is a leaf tensor that requires grad "
                               "(or a view of one); use apply_rope, or rotate a non-leaf tensor")


def validate_norm(q: Tensor, k: Tensor | None, norm: NormSpec, required: bool) -> NormSpec | None:
    """Check per-head RMSNorm arguments (weights [D] of a float dtype on q's device, eps > 0): the norm with
    Python-float scalars (symbolic ones kept as they are while tracing), or None where there is none.
    ``required``: both weights must be given."""
    q_weight, k_weight, weight_offset, eps = norm.q_weight, norm.k_weight, norm.weight_offset, norm.eps
    if q_weight is None and k_weight is None and not required:
        return None
    if q_weight is None or (k is not None and k_weight is None):
        missing = "q_weight" if q_weight is None else "k_weight"
        raise ValueError(f"{missing} is missing: pass both q_weight and k_weight (the per-head RMSNorm weights) "
                         "or neither")
    D = q.shape[-1]
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is None:
            continue
        _check_tensor(name, w, q, FLOAT_DTYPES, "a floating tensor")
        if tuple(w.shape) != (D,):
            raise ValueError(f"{name} must have shape [head_dim] = [{D}], got {tuple(w.shape)}")
    if not _is_real(eps) or not _finite(eps) or (not _is_symbolic(eps) and eps <= 0):
        raise ValueError(f"eps must be a finite float > 0, got {eps!r}")
    if not _is_real(weight_offset) or not _finite(weight_offset):
        raise ValueError(f"weight_offset must be a finite float, got {weight_offset!r}")
    return norm._replace(weight_offset=float(weight_offset), eps=float(eps))


def _scale(name: str, scale, device: torch.device, where: str, check_values: bool, heads: int = 1):
    """A float8 scale as the kernels take it (1.0 for None): a Python float, or a float tensor of one element (0-d
    or [1], as vLLM passes them) or of ``heads`` elements (per head) on ``device``, as float32; a tensor's values
    are checked where they are on the host (or ``check_values``: one sync)."""
    if scale is None:
        return 1.0
    if isinstance(scale, Tensor):
        if scale.shape not in ((), (1,), (heads,)) or not scale.dtype.is_floating_point or scale.device != device:
            raise ValueError(f"{name} must be a Python float or a floating tensor of shape [] or [1]"
                             f"{f', [{heads}] (one per head)' if heads > 1 else ''} on {where} {device}, got shape "
                             f"{tuple(scale.shape)} {scale.dtype} on {scale.device}")
        if (check_values or _host_readable(scale)) and not torch.compiler.is_compiling():
            if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
                raise ValueError(f"{name} must be finite and > 0, got a tensor holding {scale.tolist()!r}")
        return scale.to(torch.float32).contiguous()
    if not _is_real(scale) or not _finite(scale) or (not _is_symbolic(scale) and scale <= 0):
        raise ValueError(f"{name} must be a finite float > 0, got {scale!r}")
    return scale if _is_symbolic(scale) else float(scale)


def validate_out_quant(dtype, scales: OutScales, q: Tensor, k: Tensor | None, check_values: bool) -> OutQuant | None:
    """Check the prologue's float8 output arguments (``out_dtype``, ``q_out_scale``, ``k_out_scale``): None where the
    outputs keep the inputs' dtype; else the validated :class:`OutQuant` (the caller refuses autograd)."""
    names = tuple(zip(OutScales._fields[:2], scales[:2]))
    if dtype is None:
        for name in (n for n, v in names if v is not None):
            raise ValueError(f"{name} applies to float8 outputs only (out_dtype float8_e4m3fn or float8_e5m2)")
        return None
    if dtype not in FP8_DTYPES:
        raise TypeError(f"out_dtype must be None, torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    dynamic = [isinstance(v, str) for v in scales[:2]]
    if any(dynamic):
        if not dynamic[0]:
            raise ValueError('k_out_scale="dynamic" needs q_out_scale="dynamic" (they apply to q and k together)')
        for name, value in names:
            if value is not None and not (isinstance(value, str) and value == "dynamic"):
                raise ValueError(f'{name} must be "dynamic" (as the other scale), None, a float or a one-element '
                                 f"float tensor, got {value!r}; dynamic scales apply to q and k together")
        return OutQuant(dtype, None, None, True)
    return OutQuant(dtype, *(_scale(n, v, q.device, "q's device", check_values) for n, v in names), False)
