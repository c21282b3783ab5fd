"""Public API: validate, normalise, dispatch (CUDA -> Triton kernel, CPU -> float64 reference).

Every check that can fail runs before anything is written, so a call that raises leaves its inputs untouched.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from ropekit import _eager
from ropekit import autograd as _autograd
from ropekit import ops
from ropekit._layout import LAYOUTS, layout_ndim, to_canonical

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


_INV_FREQ_CACHE: dict = {}


def default_inv_freq(base: float, rotary_dim: int, device: torch.device) -> Tensor:
    """``base ** (-2i / R)`` for i < R/2, formed in float64 and rounded once to fp32 [R/2].

    Rounded once, the values are the same whether computed eagerly or inside a ``torch.compile`` graph (they agree
    with transformers' fp32 formula except where that formula is itself an ulp off; ``ropekit.from_hf_config``
    reproduces transformers bit for bit). Cached per (base, R, device) in eager mode, so calls stay free of host
    work and allocations."""
    key = (base, rotary_dim, device)
    cached = _INV_FREQ_CACHE.get(key)
    if cached is not None:
        return cached
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    inv_freq = torch.pow(base, -exponent).to(torch.float32).to(device)
    if not torch.compiler.is_compiling():
        _INV_FREQ_CACHE[key] = inv_freq
    return inv_freq


def _is_real(value) -> bool:
    """A real Python number (not a bool); the exact-type test first because ABC checks cost microseconds."""
    t = type(value)
    return t is float or t is int or (isinstance(value, numbers.Real) and t is not bool)


def _check_tensor(name: str, x: Tensor, ref: Tensor, dtypes: tuple, what: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must be {what}, got {x.dtype}")
    if x.device != ref.device:
        raise ValueError(f"{name} must be on q's device {ref.device}, got {x.device}")


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
               conjugate: bool = False) -> _Normalised:
    """Validate a call's arguments (the public API's defaults) and normalise them for ``ropekit::rope``."""
    # --- q and k ---------------------------------------------------------------------------------------------
    if not isinstance(q, Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q must be a floating tensor (float16, bfloat16, float32 or float64), got {q.dtype}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    ndim = layout_ndim(layout)
    if q.dim() != ndim:
        raise ValueError(f"q must have {ndim} dims for layout {layout!r} ({_layout_shape(layout)}), "
                         f"got shape {tuple(q.shape)}")
    qc = to_canonical(q, layout)
    B, S, HQ, D = qc.shape
    if k is not None:
        _check_tensor("k", k, q, (q.dtype,), f"of q's dtype {q.dtype}")
        if k.dim() != ndim:
            raise ValueError(f"k must have {ndim} dims for layout {layout!r}, got shape {tuple(k.shape)}")
        kc = to_canonical(k, layout)
        if kc.shape[0] != B or kc.shape[1] != S:
            raise ValueError(f"k must have q's batch and sequence sizes ({B}, {S}) in layout {layout!r}, got "
                             f"{tuple(kc.shape[:2])}")
        if kc.shape[3] != D:
            raise ValueError(f"k head_dim {kc.shape[3]} must equal q head_dim {D}")
    for name, x in (("q", q), ("k", k)):
        if x is not None and x.numel() > 0 and x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {x.stride()}")
    if D % 2:
        raise ValueError(f"head_dim must be even, got {D}")
    if style not in _STYLES:
        raise ValueError(f"style must be one of {_STYLES}, got {style!r}")
    if rotary_at not in ("front", "back"):
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
        if not _is_real(base) or not base > 1.0:
            raise ValueError(f"base must be a real number > 1, got {base!r}")
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
        if (cu_seqlens.device.type == "cpu" or check_positions) and not torch.compiler.is_compiling():
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
    _check_position_values(q, S, pos_offset, seq_offsets, pos_tensor, table_rows, table_by_token,
                           check_positions, num_seqs, cu_seqlens)

    tensors = (pos_tensor, seq_offsets, cu_seqlens, inv_freq,
               cos if freq_mode != "inv_freq" else None, sin if freq_mode == "table" else None)
    scalars = dict(pos_offset=pos_offset, layout=layout, style=style, freq_mode=freq_mode, rotary_dim=rotary_dim,
                   rotary_start=0 if rotary_at == "front" else D - rotary_dim, table_by_token=table_by_token,
                   q_scale=float(q_scale), k_scale=float(k_scale), rotary_scale=float(rotary_scale),
                   conjugate=conjugate)
    return _Normalised(tensors, scalars)


def _check_position_values(q, S, pos_offset, seq_offsets, pos_tensor, table_rows, table_by_token, check_positions,
                           num_seqs, cu_seqlens) -> None:
    """Raise for positions < 0 or past the table. Device tensors are read only with ``check_positions`` (a host
    sync); otherwise the kernel writes NaN for the offending tokens."""
    if torch.compiler.is_compiling():  # values are unknown while tracing; the kernel marks bad tokens NaN
        return
    limit = None if table_by_token else table_rows
    if limit is not None:
        if cu_seqlens is None and pos_tensor is None and seq_offsets is None and pos_offset + S > limit:
            raise IndexError(f"positions reach {pos_offset + S - 1} but the cos/sin table has {limit} rows")
        if cu_seqlens is not None and pos_tensor is None and seq_offsets is None and pos_offset + S > limit \
                and (q.device.type == "cpu" or check_positions):
            longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            if pos_offset + longest > limit:
                raise IndexError(f"positions reach {pos_offset + longest - 1} but the cos/sin table has {limit} "
                                 "rows")
    for name, t, extent in (("positions", pos_tensor, 0), ("positions (per-sequence offsets)", seq_offsets, None)):
        if t is None or not (t.device.type == "cpu" or check_positions) or t.numel() == 0:
            continue
        lo = int(t.min())
        if lo < 0:
            raise IndexError(f"{name} must be >= 0, got {lo}")
        if limit is not None:
            if extent is None:  # offsets: the last position of a sequence is offset + length - 1
                lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(t.device) if cu_seqlens is not None else S
                hi = int((t.to(torch.int64) + lengths).max()) - 1
            else:
                hi = int(t.max())
            if hi >= limit:
                raise IndexError(f"{name} reach {hi} but the cos/sin table has {limit} rows")


def _layout_shape(layout: str) -> str:
    return {"bshd": "[B, S, H, D]", "bhsd": "[B, H, S, D]", "sbhd": "[S, B, H, D]", "thd": "[T, H, D]"}[layout]


def _needs_grad(q: Tensor, k: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))


def _check_inplace_allowed(q: Tensor, k: Optional[Tensor]) -> None:
    """Refuse in-place rotation of leaves that require grad before anything is written (autograd itself would
    only notice after the kernel ran)."""
    if not torch.is_grad_enabled():
        return
    for name, x in (("q", q), ("k", k)):
        if x is None or not x.requires_grad:
            continue
        base = x._base if x._base is not None else x
        if base.is_leaf:
            raise RuntimeError(f"apply_rope_ cannot rotate {name} in place: it is a leaf tensor that requires grad "
                               "(or a view of one); use apply_rope, or rotate a non-leaf tensor")


def _rope(q: Tensor, k: Optional[Tensor], *, inplace: bool = False, conjugate: bool = False,
          promote_dtype: Optional[torch.dtype] = None, positions: Positions = None, inv_freq: Optional[Tensor] = None,
          base: float = 10000.0, cos: Optional[Tensor] = None, sin: Optional[Tensor] = None,
          angles: Optional[Tensor] = None, style: str = "neox", layout: str = "bshd",
          rotary_dim: Optional[int] = None, rotary_at: str = "front", q_scale: float = 1.0, k_scale: float = 1.0,
          rotary_scale: float = 1.0, cu_seqlens: Optional[Tensor] = None, check_positions: bool = False,
          backend: str = "auto"):
    """Shared body of the public functions; ``promote_dtype`` sets out dtype = promote(input, promote_dtype)."""
    # Eager CUDA calls without autograd: replay the launch plan of an earlier call with the same signature.
    optional = (positions, inv_freq, cos, sin, angles, cu_seqlens)
    sig = None if backend != "auto" or check_positions else _eager.signature(
        q, k, optional, (inplace, conjugate, promote_dtype, base, style, layout, rotary_dim, rotary_at, q_scale,
                         k_scale, rotary_scale))
    if sig is not None:
        plan = _eager._PLANS.get(sig[0])
        if plan is not None:
            outs = plan(q, k, positions, sig[1], optional)
            if outs is not None:
                return outs
    if backend not in ("auto", "webgpu"):
        raise ValueError(f"backend must be 'auto' or 'webgpu', got {backend!r}")
    n = _normalise(q, k, positions=positions, inv_freq=inv_freq, base=base, cos=cos, sin=sin, angles=angles,
                   style=style, layout=layout, rotary_dim=rotary_dim, rotary_at=rotary_at, q_scale=q_scale,
                   k_scale=k_scale, rotary_scale=rotary_scale, cu_seqlens=cu_seqlens,
                   check_positions=check_positions, conjugate=conjugate)
    if backend == "webgpu":
        return _rope_webgpu(q, k, n, inplace)
    # Eager calls without autograd skip the dispatcher (host time); tracing and autograd use the registered ops.
    direct = not torch.compiler.is_compiling() and not _needs_grad(q, k)
    if inplace:
        _check_inplace_allowed(q, k)
        if direct:
            ops.rope_in_place(q, k, *n.tensors, **n.scalars)
            outs = (q, k)
        elif _needs_grad(q, k):
            outs = _autograd.InplaceRope.apply(q, k, n.tensors, n.scalars)
        else:
            ops.rope_(q, k, *n.tensors, **n.scalars)
            outs = (q, k)
    elif direct:
        outs = ops.rope_out_of_place(q, k, *n.tensors, **n.scalars, promote_dtype=promote_dtype)
    elif not torch.compiler.is_compiling():
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
        [T]): per-token position ids, any order.
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
        tensors are always checked and CUDA tokens with an invalid position come out as NaN (never an
        out-of-bounds access).
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
                 cu_seqlens=cu_seqlens, check_positions=check_positions, backend=backend)
