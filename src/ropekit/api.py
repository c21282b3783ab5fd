"""Public API: validate, normalise, dispatch (CUDA -> Triton kernel, CPU -> float64 reference).

Every check that can fail runs before anything is written, so a call that raises leaves its inputs untouched.
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from ropekit import _config, _eager
from ropekit import autograd as _autograd
from ropekit import ops
from ropekit._layout import LAYOUTS, layout_ndim, to_canonical
from ropekit._memory import has_internal_overlap, overlap
from ropekit.reference import MAX_POSITION

Positions = Union[None, int, Tensor]
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.int32, torch.int64)
_STYLES = ("neox", "interleaved")


class _Normalised(NamedTuple):
    tensors: tuple  # positions, seq_offsets, cu_seqlens, inv_freq, cos, sin (see ropekit.ops)
    scalars: dict  # pos_offset, layout, style, freq_mode, rotary_dim, rotary_start, table_by_token, scales, conjugate

    def launch_kwargs(self) -> dict:
        """Everything as keyword arguments of the launcher (``launch_rope``/``bind_rope``) and the reference."""
        return dict(zip(ops._TENSOR_ARGS, self.tensors), **self.scalars)


_INV_FREQ_CACHE: OrderedDict = OrderedDict()
_INV_FREQ_CACHE_SIZE = 64


def default_inv_freq(base: float, rotary_dim: int, device: torch.device) -> Tensor:
    """``base ** (-2i / R)`` for i < R/2, formed in float64 and rounded once to fp32 [R/2].

    Rounded once, the values are the same whether computed eagerly or inside a ``torch.compile`` graph (they agree
    with transformers' fp32 formula except where that formula is itself an ulp off; ``ropekit.from_hf_config``
    reproduces transformers bit for bit). Cached per (base, R, device) in eager mode (the 64 most recently used),
    so calls stay free of host work and allocations."""
    key = (base, rotary_dim, device)
    cached = _INV_FREQ_CACHE.get(key)
    if cached is not None:
        _INV_FREQ_CACHE.move_to_end(key)
        return cached
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    inv_freq = torch.pow(base, -exponent).to(torch.float32).to(device)
    if not torch.compiler.is_compiling():
        _INV_FREQ_CACHE[key] = inv_freq
        if len(_INV_FREQ_CACHE) > _INV_FREQ_CACHE_SIZE:
            _INV_FREQ_CACHE.popitem(last=False)
    return inv_freq


def _is_real(value) -> bool:
    """A real Python number (not a bool); the exact-type test first because ABC checks cost microseconds."""
    t = type(value)
    return t is float or t is int or (isinstance(value, numbers.Real) and t is not bool)


def _host_readable(t: Tensor) -> bool:
    """Whether the values of ``t`` can be checked on the host without a device sync. CPU tensors that run the
    kernels (:func:`ropekit.testing.kernels_on_cpu`) stand in for device tensors, so they are not read either."""
    return t.device.type == "cpu" and not _config.kernels_on_cpu


def _check_tensor(name: str, x: Tensor, ref: Tensor, dtypes: tuple, what: str, ref_name: str = "q") -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must be {what}, got {x.dtype}")
    if x.device != ref.device:
        raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {x.device}")


def _resolve_table(name: str, table: Tensor, q: Tensor, batch: int, seqlen: int, rotary_dim: Optional[int],
                   head_dim: int) -> tuple[Tensor, bool, int]:
    """A cos/sin/angles table as a 3-D [Bt, rows, W] view, whether rows are tokens, and the rotary_dim."""
    _check_tensor(name, table, q, (torch.float16, torch.bfloat16, torch.float32, torch.float64),
                  "a float16/bfloat16/float32/float64 tensor")
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
    if width not in (rotary_dim // 2, rotary_dim):
        raise ValueError(f"{name} last dim must be rotary_dim/2 = {rotary_dim // 2} (one value per pair) or "
                         f"rotary_dim = {rotary_dim} (one per column), got {width}")
    return table3, by_token, rotary_dim


def _normalise(q: Tensor, k: Optional[Tensor], *, positions: Positions = None, inv_freq: Optional[Tensor] = None,
               base: float = 10000.0, cos: Optional[Tensor] = None, sin: Optional[Tensor] = None,
               angles: Optional[Tensor] = None, style: str = "neox", layout: str = "bshd",
               rotary_dim: Optional[int] = None, rotary_at: str = "front", q_scale: float = 1.0, k_scale: float = 1.0,
               rotary_scale: float = 1.0, cu_seqlens: Optional[Tensor] = None, check_positions: bool = False,
               conjugate: bool = False, names: tuple[str, str] = ("q", "k")) -> _Normalised:
    """Validate a call's arguments (the public API's defaults) and normalise them for ``ropekit::rope``.
    ``names``: what errors call the two rotated tensors (``rope_backward`` takes gradients)."""
    qn, kn = names
    # --- q and k ---------------------------------------------------------------------------------------------
    if not isinstance(q, Tensor):
        raise TypeError(f"{qn} must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{qn} must be a floating tensor (float16, bfloat16, float32 or float64), got {q.dtype}")
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    ndim = layout_ndim(layout)
    if q.dim() != ndim:
        raise ValueError(f"{qn} must have {ndim} dims for layout {layout!r} ({_layout_shape(layout)}), "
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
    for name, x in ((qn, q), (kn, k)):
        if x is not None and x.numel() > 0 and x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {x.stride()}")
    if D % 2:
        raise ValueError(f"head_dim must be even, got {D}")
    if not isinstance(style, str) or style not in _STYLES:
        raise ValueError(f"style must be one of {_STYLES}, got {style!r}")
    if not isinstance(rotary_at, str) or rotary_at not in ("front", "back"):
        raise ValueError(f"rotary_at must be 'front' or 'back', got {rotary_at!r}")
    for name, value in (("q_scale", q_scale), ("k_scale", k_scale), ("rotary_scale", rotary_scale)):
        if not _is_real(value) or not math.isfinite(value):
            raise TypeError(f"{name} must be a finite real number, got {value!r}")
    if rotary_dim is not None and (not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool)):
        raise TypeError(f"rotary_dim must be an int, got {type(rotary_dim).__name__}")

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
        rotary_dim = 2 * inv_freq.shape[0] if rotary_dim is None else rotary_dim
        if inv_freq.shape[0] != rotary_dim // 2:
            raise ValueError(f"inv_freq must have rotary_dim/2 = {rotary_dim // 2} entries, got "
                             f"{inv_freq.shape[0]}")
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
        _check_tensor("cu_seqlens", cu_seqlens, q, _INT_DTYPES, "an int32 or int64 tensor")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D [num_seqs + 1] with at least 2 entries, got shape "
                             f"{tuple(cu_seqlens.shape)}")
        if (_host_readable(cu_seqlens) or check_positions) and not torch.compiler.is_compiling():
            cu = cu_seqlens.cpu()
            if cu[0] != 0 or cu[-1] != S or bool((cu[1:] < cu[:-1]).any()):
                raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the token count {S}; "
                                 f"got {cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}")
    num_seqs = cu_seqlens.numel() - 1 if cu_seqlens is not None else B
    if positions is None:
        pass
    elif type(positions) is int or (isinstance(positions, numbers.Integral) and not isinstance(positions, bool)):
        pos_offset = int(positions)
        if pos_offset < 0:
            raise ValueError(f"positions (an offset) must be >= 0, got {pos_offset}")
        if table_by_token:
            raise ValueError("positions cannot be combined with per-token cos/sin/angles rows (3-D tables are already "
                             "gathered per token); pass [P, W] tables to index them by position")
    elif isinstance(positions, Tensor):
        _check_tensor("positions", positions, q, _INT_DTYPES, "an int32 or int64 tensor")
        if table_by_token:
            raise ValueError("positions cannot be combined with per-token cos/sin rows (3-D tables are already "
                             "gathered per token); pass [P, W] tables to index them by position")
        if positions.dim() == 1 and positions.shape[0] == num_seqs and (cu_seqlens is not None or layout != "thd"):
            seq_offsets = positions
        elif layout == "thd" and positions.dim() == 1 and positions.shape[0] == S:
            pos_tensor = positions.unsqueeze(0)
        elif layout != "thd" and positions.dim() == 2 and positions.shape[1] == S and positions.shape[0] in (1, B):
            pos_tensor = positions.expand(B, S)
        else:
            want = (f"[{num_seqs}] per-sequence offsets or [T={S}] per-token positions" if layout == "thd"
                    else f"[B={B}] per-sequence offsets or [B, S] = [{B}, {S}] (or [1, {S}]) per-token positions")
            raise ValueError(f"positions must be {want}, got shape {tuple(positions.shape)}")
        if pos_tensor is not None and cu_seqlens is not None:
            cu_seqlens = None  # per-token positions already say everything
    else:
        raise TypeError(f"positions must be None, an int offset or an integer tensor, got "
                        f"{type(positions).__name__}")
    _check_position_values(S, pos_offset, seq_offsets, pos_tensor, table_rows, table_by_token, check_positions,
                           cu_seqlens)

    tensors = (pos_tensor, seq_offsets, cu_seqlens, inv_freq,
               cos if freq_mode != "inv_freq" else None, sin if freq_mode == "table" else None)
    scalars = dict(pos_offset=pos_offset, layout=layout, style=style, freq_mode=freq_mode, rotary_dim=rotary_dim,
                   rotary_start=0 if rotary_at == "front" else D - rotary_dim, table_by_token=table_by_token,
                   q_scale=float(q_scale), k_scale=float(k_scale), rotary_scale=float(rotary_scale),
                   conjugate=conjugate)
    return _Normalised(tensors, scalars)


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
        name, lo, hi = "positions", int(pos_tensor.min()), int(pos_tensor.max())
    elif seq_offsets is not None:
        if not readable(seq_offsets) or (cu_seqlens is not None and lengths is None):
            return
        offsets = seq_offsets.to("cpu", torch.int64)
        lens = lengths if cu_seqlens is not None else torch.full_like(offsets, S)
        used = lens > 0
        if not bool(used.any()):
            return
        name = "positions (per-sequence offsets)"
        lo, hi = int(offsets[used].min()), int((offsets + lens - 1)[used].max())
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


def _layout_shape(layout: str) -> str:
    return {"bshd": "[B, S, H, D]", "bhsd": "[B, H, S, D]", "sbhd": "[S, B, H, D]", "thd": "[T, H, D]"}[layout]


def _needs_grad(q: Tensor, k: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))


def _check_inplace_targets(q: Tensor, k: Optional[Tensor], names: tuple[str, str]) -> None:
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
        base = x._base if x._base is not None else x
        if base.is_leaf:
            raise RuntimeError(f"apply_rope_ cannot rotate {name} in place: it is a leaf tensor that requires grad "
                               "(or a view of one); use apply_rope, or rotate a non-leaf tensor")


def _rope_in_place_with_grad(q: Tensor, k: Optional[Tensor], n: _Normalised) -> tuple:
    """In-place rotation recorded by autograd. Compiled: the functional op (which has the autograd formula)
    and a copy back, which functionalization turns into the same in-place write. Eager: one autograd Function
    per tensor where either is a view (autograd allows only one output for a Function that writes into a view,
    e.g. q and k of one packed QKV buffer), else one Function and one launch for both."""
    if torch.compiler.is_compiling():
        rotated = ops.rope(q, k, *n.tensors, **n.scalars, promote_dtype=None)
        q.copy_(rotated[0])
        if k is not None:
            k.copy_(rotated[1])
        return (q, k)
    if k is not None and (q._is_view() or k._is_view()):
        (q,) = _autograd.InplaceRope.apply(q, None, n.tensors, n.scalars)
        (k,) = _autograd.InplaceRope.apply(k, None, n.tensors, dict(n.scalars, q_scale=n.scalars["k_scale"]))
        return (q, k)
    return _autograd.InplaceRope.apply(q, k, n.tensors, n.scalars)


def _rope(q: Tensor, k: Optional[Tensor], *, inplace: bool = False, conjugate: bool = False,
          promote_dtype: Optional[torch.dtype] = None, positions: Positions = None, inv_freq: Optional[Tensor] = None,
          base: float = 10000.0, cos: Optional[Tensor] = None, sin: Optional[Tensor] = None,
          angles: Optional[Tensor] = None, style: str = "neox", layout: str = "bshd",
          rotary_dim: Optional[int] = None, rotary_at: str = "front", q_scale: float = 1.0, k_scale: float = 1.0,
          rotary_scale: float = 1.0, cu_seqlens: Optional[Tensor] = None, check_positions: bool = False,
          backend: str = "auto", names: tuple[str, str] = ("q", "k")):
    """Shared body of the public functions; ``promote_dtype`` sets out dtype = promote(input, promote_dtype)."""
    # Eager calls: replay the launch plan of an earlier call with the same signature (ropekit._eager).
    optional = (positions, inv_freq, cos, sin, angles, cu_seqlens)
    sig = None
    if _config.fast_path and backend == "auto" and not check_positions:
        sig = _eager.signature(q, k, optional, (inplace, conjugate, promote_dtype, base, style, layout, rotary_dim,
                                                rotary_at, q_scale, k_scale, rotary_scale))
    if sig is not None:
        try:
            plan = _eager.lookup(sig[0])
        except TypeError:  # an unhashable argument: the full path names it
            plan = sig = None
        if plan is not None:
            outs = plan(q, k, positions, sig[1], optional)
            if outs is not None:
                return outs
    if backend not in ("auto", "webgpu"):
        raise ValueError(f"backend must be 'auto' or 'webgpu', got {backend!r}")
    n = _normalise(q, k, positions=positions, inv_freq=inv_freq, base=base, cos=cos, sin=sin, angles=angles,
                   style=style, layout=layout, rotary_dim=rotary_dim, rotary_at=rotary_at, q_scale=q_scale,
                   k_scale=k_scale, rotary_scale=rotary_scale, cu_seqlens=cu_seqlens,
                   check_positions=check_positions, conjugate=conjugate, names=names)
    if inplace:
        _check_inplace_targets(q, k, names)
    if backend == "webgpu":
        return _rope_webgpu(q, k, n, inplace)
    # Eager calls without autograd skip the dispatcher (host time); tracing and autograd use the registered ops.
    compiling = torch.compiler.is_compiling()
    grad = _needs_grad(q, k)
    if inplace:
        if grad:
            outs = _rope_in_place_with_grad(q, k, n)
        elif compiling:
            ops.rope_(q, k, *n.tensors, **n.scalars)
            outs = (q, k)
        else:
            ops.rope_in_place(q, k, *n.tensors, **n.scalars)
            outs = (q, k)
    elif not compiling and not grad:
        outs = ops.rope_out_of_place(q, k, *n.tensors, **n.scalars, promote_dtype=promote_dtype)
    elif not compiling:
        outs = _autograd.Rope.apply(q, k, n.tensors, n.scalars, promote_dtype)
    else:
        outs = ops.rope(q, k, *n.tensors, **n.scalars, promote_dtype=promote_dtype)
    if sig is not None:
        _eager.record(sig[0], q, k, optional, n, outs, inplace, dict(
            conjugate=conjugate, promote_dtype=promote_dtype, base=base, style=style, layout=layout,
            rotary_dim=rotary_dim, rotary_at=rotary_at, q_scale=q_scale, k_scale=k_scale, rotary_scale=rotary_scale))
    return outs[0] if k is None else (outs[0], outs[1])


def _rope_webgpu(q: Tensor, k: Optional[Tensor], n: _Normalised, inplace: bool):
    """The WGSL kernels (:mod:`ropekit.webgpu`) for the subset of arguments they implement."""
    from ropekit import webgpu

    positions, seq_offsets, cu_seqlens, inv_freq, cos, sin = n.tensors
    sc = n.scalars
    unsupported = [name for name, bad in (
        ("a positions tensor (only an int offset)", positions is not None or seq_offsets is not None),
        ("cu_seqlens", cu_seqlens is not None),
        (f"layout={sc['layout']!r} (only 'bshd' or 'thd')", sc["layout"] not in ("bshd", "thd")),
        ("rotary_dim < head_dim", sc["rotary_dim"] != q.shape[-1]),
        ("q_scale/k_scale/rotary_scale other than 1", (sc["q_scale"], sc["k_scale"], sc["rotary_scale"]) != (1, 1, 1)),
        ("raw angles or per-token cos/sin", sc["freq_mode"] == "angles" or sc["table_by_token"]),
        ("autograd (inputs that require grad)", _needs_grad(q, k)),
    ) if bad]
    if unsupported:
        raise ValueError(f"backend='webgpu' does not support {', '.join(unsupported)}")
    outs = webgpu.apply_rope(q, k, pos_offset=sc["pos_offset"], inv_freq=inv_freq if cos is None else None,
                             cos=cos, sin=sin, style=sc["style"], conjugate=sc["conjugate"])
    outs = (outs,) if k is None else outs
    if inplace:
        for x, out in zip((q, k), outs):
            x.copy_(out)
        outs = (q, k)
    return outs[0] if k is None else (outs[0], outs[1])


_ARGS_DOC = """
    Parameters
    ----------
    q, k : Tensor
        Queries and (optionally) keys in ``layout``: ``"bshd"`` [B, S, H, D], ``"bhsd"`` [B, H, S, D],
        ``"sbhd"`` [S, B, H, D] or ``"thd"`` [T, H, D] (packed tokens). Head counts may differ (GQA/MQA); both
        are rotated in one kernel launch. Any strides with a contiguous last dim (views into a packed QKV
        projection are used in place, never copied). float16, bfloat16, float32 (float64 on CPU); k has q's
        dtype. Math is fp32 on GPU (float64 on CPU) with one rounding at the store; outputs keep the input dtype.
    positions : None, int or Tensor
        ``None``: 0..S-1. ``int``: offset added to 0..S-1 (KV-cache continuation). Tensor [B] (int32/int64):
        per-sequence offsets (with ``cu_seqlens``: one per packed sequence). Tensor [B, S] or [1, S] (``thd``:
        [T]): per-token position ids, any order. Every position lies in [0, 2**31 - 1]; see ``check_positions``
        for what happens outside.
    inv_freq : Tensor, optional
        fp32 (or fp64) [R/2] inverse frequencies; the angle ``pos * inv_freq[i]`` is formed in float64 and reduced
        modulo 2*pi before fp32 sin/cos (error about 1e-7 at any position below 2**24).
    base : float
        Used when no other frequency source is given: ``inv_freq[i] = base ** (-2i / R)``.
    cos, sin : Tensor, optional
        Tables [P, W] indexed by position, or [B, S, W] / [1, S, W] already gathered per token (``thd``:
        [1, T, W]). W = R/2 (one value per pair) or R (one per column, transformers' duplicated halves).
        Any float dtype; read in fp32.
    angles : Tensor, optional
        Raw angles (cuDNN's ``freqs``), shaped like ``cos``; sin/cos taken in the kernel after exact reduction.
    style : {"neox", "interleaved"}
        ``neox`` pairs column i with i + R/2 (transformers' ``rotate_half``); ``interleaved`` pairs 2i with 2i+1
        (GPT-J, Meta's original LLaMA, seed 000).
    rotary_dim : int, optional
        Number R of rotated columns (even, <= head_dim). Default: from ``inv_freq``/tables, else head_dim.
    rotary_at : {"front", "back"}
        Rotated columns first (partial_rotary_factor; the tail passes through) or last (cuDNN ``rope_dim``, MLA:
        the leading columns pass through).
    q_scale, k_scale : float
        Multiply the whole output of q / k (rotated and pass-through columns), e.g. 1/sqrt(D) folded into q.
    rotary_scale : float
        Multiplies cos and sin (rotated columns only): transformers' ``attention_scaling`` (YaRN, LongRoPE).
    cu_seqlens : Tensor, optional
        int32/int64 [num_seqs + 1] boundaries of packed sequences (``layout="thd"``); positions restart at 0 (plus
        the sequence's offset) in each sequence.
    check_positions : bool
        Also check device-resident ``positions``/``cu_seqlens`` values on the host (one sync). Without it, CPU
        tensors and int offsets are always checked (a position < 0 or past a table raises ``IndexError``, past
        2**31 - 1 ``ValueError``) and CUDA tokens with an invalid position come out as NaN (never an
        out-of-bounds access or a wrong number).
    backend : {"auto", "webgpu"}
        ``auto``: the Triton kernels for CUDA tensors, the float64 reference for CPU tensors. ``webgpu``: the WGSL
        kernels through wgpu on CPU tensors (``pip install "ropekit[webgpu]"``), for layouts ``bshd``/``thd``,
        an int offset, full rotary, unit scales and no autograd; other arguments raise ``ValueError``.

    Sign convention: the forward rotation is by +theta, ``x0' = x0*cos - x1*sin``, ``x1' = x0*sin + x1*cos``.
    Raises ``TypeError``/``ValueError``/``IndexError`` naming the argument; nothing is written when it raises.
"""


def _signature_doc(fn):
    fn.__doc__ = fn.__doc__.replace("{ARGS}", _ARGS_DOC)
    return fn


@_signature_doc
def apply_rope(
    q: Tensor, k: Optional[Tensor] = None, *, positions: Positions = None, inv_freq: Optional[Tensor] = None,
    base: float = 10000.0, cos: Optional[Tensor] = None, sin: Optional[Tensor] = None,
    angles: Optional[Tensor] = None, style: str = "neox", layout: str = "bshd", rotary_dim: Optional[int] = None,
    rotary_at: str = "front", q_scale: float = 1.0, k_scale: float = 1.0, rotary_scale: float = 1.0,
    cu_seqlens: Optional[Tensor] = None, check_positions: bool = False, backend: str = "auto",
):
    """Rotate ``q`` (and ``k``) by their positions; returns new tensors ``(q_rot, k_rot)``, or ``q_rot`` alone
    when ``k`` is None. Differentiable in q and k (the backward is the conjugate rotation).
    {ARGS}"""
    return _rope(q, k, inplace=False, conjugate=False, positions=positions, inv_freq=inv_freq, base=base, cos=cos,
                 sin=sin, angles=angles, style=style, layout=layout, rotary_dim=rotary_dim, rotary_at=rotary_at,
                 q_scale=q_scale, k_scale=k_scale, rotary_scale=rotary_scale, cu_seqlens=cu_seqlens,
                 check_positions=check_positions, backend=backend)


@_signature_doc
def apply_rope_(
    q: Tensor, k: Optional[Tensor] = None, *, positions: Positions = None, inv_freq: Optional[Tensor] = None,
    base: float = 10000.0, cos: Optional[Tensor] = None, sin: Optional[Tensor] = None,
    angles: Optional[Tensor] = None, style: str = "neox", layout: str = "bshd", rotary_dim: Optional[int] = None,
    rotary_at: str = "front", q_scale: float = 1.0, k_scale: float = 1.0, rotary_scale: float = 1.0,
    cu_seqlens: Optional[Tensor] = None, check_positions: bool = False, backend: str = "auto",
):
    """In-place :func:`apply_rope`: rotates ``q`` (and ``k``) in their own memory and returns them.

    The write is declared to autograd (``mark_dirty``) and to ``torch.library`` (``mutates_args``): rotating a
    leaf that requires grad, or a tensor another op saved for its backward, raises instead of corrupting
    gradients.
    {ARGS}"""
    return _rope(q, k, inplace=True, conjugate=False, positions=positions, inv_freq=inv_freq, base=base, cos=cos,
                 sin=sin, angles=angles, style=style, layout=layout, rotary_dim=rotary_dim, rotary_at=rotary_at,
                 q_scale=q_scale, k_scale=k_scale, rotary_scale=rotary_scale, cu_seqlens=cu_seqlens,
                 check_positions=check_positions, backend=backend)


@_signature_doc
def rope_backward(
    dq_rot: Tensor, dk_rot: Optional[Tensor] = None, *, positions: Positions = None,
    inv_freq: Optional[Tensor] = None, base: float = 10000.0, cos: Optional[Tensor] = None,
    sin: Optional[Tensor] = None, angles: Optional[Tensor] = None, style: str = "neox", layout: str = "bshd",
    rotary_dim: Optional[int] = None, rotary_at: str = "front", q_scale: float = 1.0, k_scale: float = 1.0,
    rotary_scale: float = 1.0, cu_seqlens: Optional[Tensor] = None, check_positions: bool = False,
    backend: str = "auto",
):
    """Explicit backward of :func:`apply_rope` (cuDNN's ``rope_backward``): the gradients w.r.t. q (and k)
    given those w.r.t. the rotated outputs -- the rotation by -theta, times the same ``q_scale``/``k_scale``
    and ``rotary_scale``. Pass the same arguments as to the forward call. Autograd uses the same kernel.
    {ARGS}"""
    return _rope(dq_rot, dk_rot, inplace=False, conjugate=True, positions=positions, inv_freq=inv_freq, base=base,
                 cos=cos, sin=sin, angles=angles, style=style, layout=layout, rotary_dim=rotary_dim,
                 rotary_at=rotary_at, q_scale=q_scale, k_scale=k_scale, rotary_scale=rotary_scale,
                 cu_seqlens=cu_seqlens, check_positions=check_positions, backend=backend,
                 names=("dq_rot", "dk_rot"))
