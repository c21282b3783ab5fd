"""Public API: :func:`rope_attention`, RoPE(q) + RoPE(k) + scaled dot-product attention as one op (cuDNN's
RoPE -> SDPA graph), forward and backward, with the attention scale (and the softmax's 1/ln 2) foldable into the
rotation's output scales.

The rotation's angles are formed once per token by the core rotation (a unit vector rotated with the call's
position and frequency options, so every option of :func:`ropekit.apply_rope` gives its exact angles). Then
``ropekit::rope_attention`` attends:

- on CUDA (and on the CPU under :func:`ropekit.testing.kernels_on_cpu`) its Triton kernels rotate q and k tile by
  tile as they load them: no rotated copy of q or k is written, no S x S matrix is stored;
- elsewhere (CPU tensors, float64 anywhere) it computes the float64 definition
  (:func:`ropekit.reference.rope_attention_reference`, scores materialised) and rounds o to the input dtype.

``return_rotated`` adds the rotated, scaled q and k from one more rotation call. Packed sequences
(``layout="thd"`` with ``cu_seqlens``) attend within their own sequence, positions restarting at each; the
boundaries are checked with the rotation's arguments, and ``max_seqlen`` sizes the kernels' grid without a host
read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ropekit._device_cache import device_cache
from ropekit._fastpath.attention import attention_outputs, planned_attention
from ropekit._spec import FORWARD, LAYOUTS, Positions, RopeArgs, RopeSpec, to_canonical
from ropekit._validation import check_cu_seqlens_bounds, validate_args
from ropekit.autograd import attend
from ropekit.autograd import rotate as rotate_spec

__all__ = ["rope_attention", "FOLDS"]

_LOG2E = 1.0 / math.log(2.0)


class Fold(NamedTuple):
    """Where a fold preset moves the attention scale ``a``: factors on q's and k's rotation outputs (as powers:
    ``a ** q_power * (1/ln 2) ** q_log2``), and whether the softmax then runs in base 2."""

    q_power: float
    k_power: float
    log2: bool


# seed 003's table: "none" keeps a in the attention; "q" moves it into q's rotation; "q_log2" also 1/ln 2, with a
# base-2 softmax; "symmetric" sqrt(a) into each; "symmetric_log2" that and 1/ln 2 into q's.
FOLDS = {
    "none": None,
    "q": Fold(1.0, 0.0, False),
    "q_log2": Fold(1.0, 0.0, True),
    "symmetric": Fold(0.5, 0.5, False),
    "symmetric_log2": Fold(0.5, 0.5, True),
}


def _check_inputs(q, k, v, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    rank = 3 if layout == "thd" else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D in layout {layout!r}, got shape {tuple(t.shape)}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    (B, S, HQ, D), (Bk, Sk, HK, Dk), (Bv, Sv, HV, DV) = (to_canonical(t, layout).shape for t in (q, k, v))
    if (Bk, Sk) != (B, S) or (Bv, Sv) != (B, S):
        raise ValueError(f"q, k and v must have one batch and sequence length, got {(B, S)}, {(Bk, Sk)}, {(Bv, Sv)}")
    if Dk != D:
        raise ValueError(f"k's head_dim must be q's ({D}), got {Dk}")
    if HV != HK:
        raise ValueError(f"v must have k's number of heads ({HK}), got {HV}")
    if HK == 0 or HQ % HK:
        raise ValueError(f"q's heads ({HQ}) must be a multiple of k's ({HK}) (GQA/MQA)")
    if DV == 0 or D == 0:
        raise ValueError("head_dim must be positive")


def _sequences(q: Tensor, cu_seqlens, max_seqlen, check: bool) -> tuple[Tensor | None, int]:
    """(the packed sequences' boundaries as the kernels take them -- int32 on q's device -- and the longest
    sequence's length), or (None, 0) without ``cu_seqlens``. ``cu_seqlens`` itself (layout, type, shape, device,
    and its values where they are on the host or ``check``) is checked by ``validate_args`` before this runs; here
    ``max_seqlen``, and the values wherever they are read for the longest length (one sync for device tensors)
    unless they live on the device and ``max_seqlen`` is given without ``check``."""
    if cu_seqlens is None:
        if max_seqlen is not None:
            raise ValueError("max_seqlen is the longest packed sequence's length: it needs cu_seqlens")
        return None, 0
    if max_seqlen is not None and (not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool)
                                   or max_seqlen < 0):
        raise ValueError(f"max_seqlen must be an int >= 0, got {max_seqlen!r}")
    if torch.compiler.is_compiling():  # no host reads in a graph: the kernels clamp the boundaries
        if max_seqlen is None:
            raise ValueError("under torch.compile, give max_seqlen with cu_seqlens (it sizes the kernels' grid)")
    elif check or max_seqlen is None or cu_seqlens.device.type == "cpu":
        bounds = check_cu_seqlens_bounds(cu_seqlens, q.shape[0])
        longest = int((bounds[1:] - bounds[:-1]).max())
        if max_seqlen is not None and max_seqlen < longest:
            raise ValueError(f"max_seqlen ({max_seqlen}) is below the longest packed sequence ({longest})")
        max_seqlen = longest if max_seqlen is None else max_seqlen
    return cu_seqlens.to(device=q.device, dtype=torch.int32), max_seqlen


def _scales(fold: str, scale: float | None, log2_softmax: bool, q_scale: float, k_scale: float,
            head_dim: int) -> tuple[float, float, float, bool]:
    """(q's and k's rotation scales, the attention scale, base-2 softmax) after the fold preset."""
    if fold not in FOLDS:
        raise ValueError(f"fold must be one of {tuple(FOLDS)}, got {fold!r}")
    a = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if not isinstance(a, (int, float)) or isinstance(a, bool) or not math.isfinite(a) or a <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    for name, value in (("q_scale", q_scale), ("k_scale", k_scale)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    preset = FOLDS[fold]
    if preset is None:
        return float(q_scale), float(k_scale), float(a), bool(log2_softmax)
    if log2_softmax:
        raise ValueError(f"fold={fold!r} sets the softmax's base itself; leave log2_softmax False")
    q_factor = a ** preset.q_power * (_LOG2E if preset.log2 else 1.0)
    return float(q_scale) * q_factor, float(k_scale) * a ** preset.k_power, 1.0, preset.log2


@device_cache(maxsize=16)
def _zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zero tensor to validate the angle rows' rotation on (never written)."""
    return torch.zeros(shape, dtype=dtype, device=device)


@device_cache(maxsize=16)
def _unit(shape: tuple, dtype: torch.dtype, device: torch.device, rotary_start: int, rotary_dim: int,
          neox: bool) -> Tensor:
    """Rows with 1 in the first column of every rotated pair and 0 elsewhere (never written)."""
    unit = torch.zeros(shape, dtype=dtype, device=device)
    first = torch.arange(rotary_dim // 2, device=device) * (1 if neox else 2) + rotary_start
    unit[..., first] = 1.0
    return unit


def _per_batch(args: RopeArgs) -> bool:
    """Whether the angles differ between sequences of the batch (else one row set serves all)."""
    p = args.positions
    if isinstance(p, Tensor) and p.dim() > 0:
        batch_dim = 1 if args.sections is not None else 0  # [A, B, S] / [B, S] ids / [B] offsets
        if p.dim() > batch_dim and p.shape[batch_dim] > 1:
            return True
    return any(t is not None and t.dim() == 3 and t.shape[0] > 1 for t in (args.cos, args.sin, args.angles))


class _UnitRows(NamedTuple):
    """The angle rows' shape and dtype, the rotation arguments for them, (rotary_start, rotary_dim, neox), and the
    validated rotation of them."""

    shape: tuple
    dtype: torch.dtype
    args: RopeArgs
    rotation: tuple[int, int, bool]
    spec: RopeSpec


def _unit_plan(q: Tensor, args: RopeArgs) -> _UnitRows:
    """Every rotation argument checked -- ``validate_args`` on zero rows with q's tokens, so positions,
    frequencies and ``cu_seqlens`` are checked there, once -- and the angle rows to compute."""
    layout = args.layout
    B, S, _, D = to_canonical(q, layout).shape
    rows = B if _per_batch(args) else 1
    shape = {"bshd": (rows, S, 1, D), "bhsd": (rows, 1, S, D), "sbhd": (S, rows, 1, D), "thd": (S, 1, D)}[layout]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    unit_args = args._replace(q_scale=1.0, k_scale=1.0, out_dtype=None)
    spec = validate_args(_zeros(shape, dtype, q.device), None, unit_args, FORWARD)
    return _UnitRows(shape, dtype, unit_args, (spec.rotary_start, spec.rotary_dim, spec.style == "neox"), spec)


def _unit_rows(q: Tensor, args: RopeArgs, plan: _UnitRows | None = None) -> tuple[Tensor, tuple[int, int, bool]]:
    """Per-token angles [B or 1, S, D] (float32; float64 for float64 q): the rotation of a unit vector, whose pair
    (c1, c2) comes out as (cos, sin) -- and (rotary_start, rotary_dim, neox). ``plan``: :func:`_unit_plan`'s, where
    the caller checked the arguments already."""
    plan = _unit_plan(q, args) if plan is None else plan
    # the rotation validated already (spec): straight to its launch, which the attention's plans record
    table = rotate_spec(_unit(plan.shape, plan.dtype, q.device, *plan.rotation), None, plan.spec, False)[0]
    return to_canonical(table, args.layout)[:, :, 0], plan.rotation


def rope_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, is_causal: bool = False,
    log2_softmax: bool = False, fold: str = "none", return_lse: bool = False, return_rotated: bool = False,
    positions: Positions = None, inv_freq: Tensor | None = None, base: float = 10000.0, cos: Tensor | None = None,
    sin: Tensor | None = None, angles: Tensor | None = None, style: str = "neox", layout: str = "bshd",
    rotary_dim: int | None = None, rotary_at: str = "front", q_scale: float = 1.0, k_scale: float = 1.0,
    rotary_scale: float = 1.0, cu_seqlens: Tensor | None = None, max_seqlen: int | None = None,
    sections: Sequence[int] | None = None, section_layout: str = "contiguous", check_positions: bool = False,
):
    """Attention over rotated queries and keys in one op (seed 003's RoPE -> SDPA graph):
    ``o = softmax_b(scale * (q_scale R q) (k_scale R k)^T + mask) v`` per head, where R rotates by each token's
    angles as :func:`apply_rope` with the same keywords, and ``softmax_b`` is the base-e softmax or, with
    ``log2_softmax=True``, the base-2 one (``2**(s - max) / sum 2**(s - max)``, cuDNN's
    ``softmax_input_is_log2``). Differentiable in q, k and v (not in positions or frequencies).

    Parameters
    ----------
    q : Tensor [B, S, Hq, D] (``layout="bhsd"``: [B, Hq, S, D]; ``"sbhd"``: [S, B, Hq, D]; ``"thd"``: [T, Hq, D],
        packed sequences)
    k : Tensor, like q with Hkv heads (Hq a multiple of Hkv: GQA/MQA)
    v : Tensor, like k with its own head dim Dv (MLA: D 192, Dv 128)
        float16, bfloat16 or float32 (float64 on CPU), one dtype; any strides with a contiguous last dim. fp32
        accumulation; the rotated q and k are rounded to the input dtype before the products, as
        :func:`apply_rope` would store them.
    scale : float, optional
        The attention scale ``a``; default ``1/sqrt(D)`` as torch's ``scaled_dot_product_attention``.
    is_causal : bool
        Query i attends to keys 0..i (top-left aligned, as torch's ``is_causal``).
    log2_softmax : bool
        Base-2 softmax (with ``fold="none"`` only).
    fold : {"none", "q", "q_log2", "symmetric", "symmetric_log2"}
        Where the attention scale lives; every preset computes standard attention ``softmax(a (Rq)(Rk)^T) v``.
        ``"none"``: in the attention. ``"q"``: in q's rotation (q_scale times a; attention scale 1).
        ``"q_log2"``: q's rotation takes a/ln 2 and the softmax runs in base 2 (the kernel then uses exp2 with no
        multiply). ``"symmetric"``: sqrt(a) into each rotation. ``"symmetric_log2"``: sqrt(a)/ln 2 into q's,
        sqrt(a) into k's, base-2 softmax. The backward takes each rotation's scale from its forward (the chain
        rule does the rest), so o and every gradient agree across presets up to rounding.
    return_lse : bool
        Also return the log-sum-exp of each row's scores [B, Hq, S] (``thd``: [Hq, T]), float32 (float64 for
        float64 inputs), natural log (whatever the softmax's base); differentiable.
    return_rotated : bool
        Also return the rotated, scaled ``q_rot``, ``k_rot`` (cuDNN's user-bound outputs, e.g. for a KV cache), by
        one more rotation launch.
    cu_seqlens : Tensor, optional
        With ``layout="thd"``: int32/int64 [num_seqs + 1] boundaries of the packed sequences (0, then each
        sequence's end; empty sequences allowed). A token attends only to its own sequence (causal: top-left
        within it), and its position restarts at 0 there (plus ``positions`` as :func:`apply_rope` reads them with
        ``cu_seqlens``). Without it a ``thd`` input is one sequence.
    max_seqlen : int, optional
        The longest packed sequence's length (it sizes the kernels' grid). Without it, it is read from
        ``cu_seqlens`` on the host (one sync for a device tensor), which also checks the boundaries. Give it with a
        device ``cu_seqlens`` to avoid the sync (CUDA graphs), and always under ``torch.compile``: the boundaries
        are then not checked (unless ``check_positions`` in eager calls); the kernels clamp them into the tensors,
        so bad ones never read or write outside them, but rows outside every sequence, or past ``max_seqlen``,
        are left unwritten.

    Every other keyword is :func:`apply_rope`'s: positions (offset, per-sequence, per-token, multi-axis
    ``sections``), frequencies (``base``, ``inv_freq``, ``cos``/``sin`` tables, raw ``angles``), ``style``,
    partial rotary (``rotary_dim``, ``rotary_at="back"`` for MLA's trailing rope columns), ``q_scale``/``k_scale``
    (cuDNN's ``output_scale``), ``rotary_scale``.

    Returns ``o`` (q's layout, Dv columns, q's dtype), or a tuple ``(o, lse)``, ``(o, q_rot, k_rot)`` or
    ``(o, lse, q_rot, k_rot)`` as asked. Raises ``TypeError``/``ValueError``/``IndexError`` naming the argument.

    >>> o = ropekit.rope_attention(q, k, v, positions=position_ids, base=500000.0, is_causal=True, fold="q_log2")
    """
    options = AttentionOptions(scale, is_causal, log2_softmax, fold, return_lse, return_rotated, positions, inv_freq,
                               base, cos, sin, angles, style, layout, rotary_dim, rotary_at, q_scale, k_scale,
                               rotary_scale, cu_seqlens, max_seqlen, sections, section_layout, check_positions)
    return planned_attention(q, k, v, options, _rope_attention_full)


class AttentionOptions(NamedTuple):
    """:func:`rope_attention`'s keywords, in its order (what the eager fast path keys a call's plan on)."""

    scale: float | None
    is_causal: bool
    log2_softmax: bool
    fold: str
    return_lse: bool
    return_rotated: bool
    positions: Positions
    inv_freq: Tensor | None
    base: float
    cos: Tensor | None
    sin: Tensor | None
    angles: Tensor | None
    style: str
    layout: str
    rotary_dim: int | None
    rotary_at: str
    q_scale: float
    k_scale: float
    rotary_scale: float
    cu_seqlens: Tensor | None
    max_seqlen: int | None
    sections: Sequence[int] | None
    section_layout: str
    check_positions: bool


class AttentionRun(NamedTuple):
    """What a full-path call ran, for the fast path to record its plan from: the rotation's arguments and the angle
    rows' validated rotation, the unit rows rotated (a constant), the tensors the attention took (q, k, v with a
    contiguous last dim, the angle rows, the packed boundaries), its other arguments, and its (o, lse)."""

    args: RopeArgs
    unit_spec: RopeSpec
    unit: Tensor
    inputs: tuple
    angles: Tensor
    sequences: Tensor | None
    params: tuple
    o: Tensor
    lse: Tensor


def _rope_attention_full(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, note=None):
    """The full path of :func:`rope_attention`: check every argument, form the angle rows, attend; ``note``
    (where not None) is handed the :class:`AttentionRun` once the attention ran."""
    _check_inputs(q, k, v, opts.layout)
    for name in ("is_causal", "log2_softmax", "return_lse", "return_rotated"):
        if not isinstance(getattr(opts, name), bool):  # None or 0 would silently pick a behaviour
            raise TypeError(f"{name} must be a bool, got {getattr(opts, name)!r}")
    layout = opts.layout
    D = to_canonical(q, layout).shape[3]
    q_eff, k_eff, a, log2 = _scales(opts.fold, opts.scale, opts.log2_softmax, opts.q_scale, opts.k_scale, D)
    args = RopeArgs(positions=opts.positions, inv_freq=opts.inv_freq, base=opts.base, cos=opts.cos, sin=opts.sin,
                    angles=opts.angles, style=opts.style, layout=layout, rotary_dim=opts.rotary_dim,
                    rotary_at=opts.rotary_at, q_scale=q_eff, k_scale=k_eff, rotary_scale=opts.rotary_scale,
                    cu_seqlens=opts.cu_seqlens, sections=opts.sections, section_layout=opts.section_layout,
                    check_positions=opts.check_positions)
    plan = _unit_plan(q, args)  # checks cu_seqlens with the other rotation arguments
    sequences, longest = _sequences(q, opts.cu_seqlens, opts.max_seqlen, opts.check_positions)
    table, (rotary_start, rot_dim, neox) = _unit_rows(q, args, plan)
    qk_mult = a * (1.0 if log2 else _LOG2E)
    q_in, k_in, v_in = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    params = (layout, rotary_start, rot_dim, neox, q_eff, k_eff, qk_mult, opts.is_causal, longest)
    o, lse = attend(q_in, k_in, v_in, table, sequences, *params)
    if note is not None:
        note(AttentionRun(args, plan.spec, _unit(plan.shape, plan.dtype, q.device, *plan.rotation),
                          (q_in, k_in, v_in), table, sequences, params, o, lse))
    rotated = None
    if opts.return_rotated:
        from ropekit.api import _rope

        rotated = _rope(q, k, FORWARD, args)
    return attention_outputs(o, lse, opts, rotated)

