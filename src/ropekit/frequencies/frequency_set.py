"""One set of RoPE frequencies: :class:`RopeFrequencies` (the inverse frequencies and the settings that go with
them) and :func:`rope_frequencies`, which builds one from explicit parameters; :func:`_build` is the one
constructor behind it and :func:`~ropekit.frequencies.from_hf_config`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ropekit.frequencies._checks import _float_table, _integer, _length_arg, _positions_arg, _real
from ropekit.frequencies.formulas import (
    _OMP,
    _TYPE_KEYS,
    _apply_knobs,
    _as_factors,
    _canonical_type,
    _check_params,
    _evaluate,
    _yarn_mscale,
)

__all__ = ["STYLES", "RopeFrequencies", "rope_frequencies"]

#: The pairing styles: ``"neox"`` pairs (i, i + rotary_dim/2), ``"interleaved"`` pairs (2i, 2i+1).
STYLES = ("neox", "interleaved")


@dataclasses.dataclass(frozen=True, eq=False)
class RopeFrequencies:
    """Inverse frequencies and the settings that go with them.

    Attributes
    ----------
    inv_freq : torch.Tensor
        float32 ``[rotary_dim // 2]`` on the CPU: pair ``i`` rotates by ``position * inv_freq[i]`` radians. For
        ``dynamic`` and ``longrope`` this is the set in force for short sequences (transformers' value at model
        construction); :meth:`for_seq_len` gives the set for a given length.
    inv_freq_float64 : torch.Tensor
        The same set evaluated in float64. ``inv_freq`` is it rounded once (``arithmetic="float64"``) or
        transformers' float32 evaluation, within a few float32 ulps of it (``arithmetic="transformers"``).
    attention_scaling : float
        Multiplies cos and sin of every rotated pair (transformers' ``attention_scaling``, the same Python float);
        pass it as ``rotary_scale`` to :func:`ropekit.apply_rope`.
    rotary_dim : int
        Rotated columns per head (even); the other ``head_dim - rotary_dim`` pass through.
    head_dim : int
        Columns per head.
    rope_type : str
        One of :data:`ROPE_TYPES`.
    style : str
        ``"neox"`` (pairs i, i + rotary_dim/2) or ``"interleaved"`` (pairs 2i, 2i+1).
    rotary_at : str
        ``"front"`` (transformers' partial rotary) or ``"back"``.
    base : float or None
        ``rope_theta``; None for a table given by :meth:`from_inv_freq`.
    max_position_embeddings, original_max_position_embeddings : int or None
        Context lengths read by ``dynamic``, ``yarn``, ``longrope`` and ``llama3``.
    parameters : dict
        The scaling parameters in force (``factor``, ``beta_fast``, ...), after defaults were filled in.
    freq_scale : float
        ggml's multiplier of every frequency.
    freq_factors : torch.Tensor or None
        float64 ``[rotary_dim // 2]`` per-pair divisors (ggml ``freq_factors``), or None.
    softmax_scale : float
        The factor DeepSeek-V2/V3 attention multiplies its softmax scale by (``mscale(factor, mscale_all_dim)**2``
        for YaRN with ``mscale_all_dim``; 1 otherwise). ropekit does not apply it: it belongs to attention.
    seq_len : int or None
        The length a ``dynamic`` / ``longrope`` set was computed for (None: the construction-time set).
    arithmetic : str
        ``"transformers"`` (bit-exact transformers float32 evaluation, :func:`from_hf_config`) or ``"float64"``
        (float64 evaluation rounded once); see :mod:`ropekit.frequencies`.
    sections : tuple of int or None
        Multi-axis positions (M-RoPE of Qwen2-VL and its successors): pairs per position axis, or None for 1-D.
    section_layout : str
        Which pairs each axis takes: ``"contiguous"`` (Qwen2-VL, Qwen2.5-VL) or ``"interleaved"`` (Qwen3-VL).
    """

    inv_freq: torch.Tensor
    inv_freq_float64: torch.Tensor
    attention_scaling: float
    rotary_dim: int
    head_dim: int
    rope_type: str = "default"
    style: str = "neox"
    rotary_at: str = "front"
    base: float | None = None
    max_position_embeddings: int | None = None
    original_max_position_embeddings: int | None = None
    parameters: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    freq_scale: float = 1.0
    freq_factors: torch.Tensor | None = None
    softmax_scale: float = 1.0
    seq_len: int | None = None
    arithmetic: str = "float64"
    sections: tuple[int, ...] | None = None
    section_layout: str = "contiguous"

    # ---- derived views ----------------------------------------------------------------------------------------

    @property
    def is_dynamic(self) -> bool:
        """True when the frequencies depend on the sequence length (``dynamic``, ``longrope``)."""
        return self.rope_type in ("dynamic", "longrope") and self.base is not None

    @property
    def wavelengths(self) -> torch.Tensor:
        """float64 ``[rotary_dim // 2]``: positions per full turn of each pair, ``2*pi / inv_freq`` (inf for 0)."""
        inv = self.inv_freq.to(torch.float64)
        return torch.where(inv > 0, 2 * math.pi / inv, torch.full_like(inv, math.inf))

    def apply_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`ropekit.apply_rope` that reproduce this set:
        ``inv_freq``, ``style``, ``rotary_dim``, ``rotary_at`` and ``rotary_scale``, plus ``sections`` and
        ``section_layout`` for multi-axis (M-RoPE) sets, whose positions are then [A, B, S]."""
        kwargs = {
            "inv_freq": self.inv_freq,
            "style": self.style,
            "rotary_dim": self.rotary_dim,
            "rotary_at": self.rotary_at,
            "rotary_scale": float(self.attention_scaling),
        }
        if self.sections is not None:
            kwargs.update(sections=self.sections, section_layout=self.section_layout)
        return kwargs

    def for_seq_len(self, seq_len: int | torch.Tensor) -> RopeFrequencies:
        """The frequencies transformers uses for a sequence whose largest position is ``seq_len - 1``.

        ``dynamic``: recomputed from ``max(seq_len, max_position_embeddings)`` (stateless; transformers' module
        additionally keeps the largest length seen until a short sequence resets it, which
        :class:`ropekit.RotaryEmbedding` mirrors). ``longrope``: the long factors when ``seq_len`` exceeds
        ``original_max_position_embeddings``, else the short ones. Other types return ``self``.

        With ``arithmetic="transformers"`` the result equals transformers' bit for bit. transformers itself gives
        two dynamic-NTK values for one length, and ``seq_len``'s type picks which: a Python int gives
        ``ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=int)`` (new base computed in float64), a 0-dim integer
        tensor gives what the model's rotary module uses (``seq_len = position_ids.max() + 1``, a tensor, so the
        new base is computed in float32); they can differ by a float32 ulp.
        """
        as_tensor = isinstance(seq_len, torch.Tensor)
        n = _length_arg(seq_len, "seq_len")
        if not self.is_dynamic:
            return self
        if self.rope_type == "longrope":
            orig = self.original_max_position_embeddings
            key = orig + 1 if n > orig else None  # what transformers' module passes for any longer sequence
        else:
            key = n if n > self.max_position_embeddings else None
        if key == self.seq_len and (key is None or self.rope_type == "longrope"):
            return self
        hf_len = torch.tensor(key) if as_tensor and key is not None and self.rope_type == "dynamic" else key
        inv, inv64, scaling = _evaluate(self.rope_type, self.base, self.rotary_dim, self.head_dim, self.parameters,
                                        self.max_position_embeddings, hf_len, self.arithmetic, self.freq_scale,
                                        self.freq_factors)
        return dataclasses.replace(self, inv_freq=inv, inv_freq_float64=inv64, attention_scaling=scaling,
                                   seq_len=key)

    def angles(self, positions: torch.Tensor | int | Sequence[int]) -> torch.Tensor:
        """float64 ``[*positions.shape, rotary_dim // 2]``: ``position * inv_freq`` with the float32 ``inv_freq``
        (the angles the kernels form), computed exactly in float64 and not reduced."""
        pos = _positions_arg(positions)
        return pos.to(torch.float64)[..., None] * self.inv_freq.to(device=pos.device, dtype=torch.float64)

    def cos_sin(
        self,
        positions: torch.Tensor | int | Sequence[int],
        dtype: torch.dtype = torch.float32,
        *,
        full: bool = True,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables ``[*positions.shape, W]`` times ``attention_scaling``, rounded once to ``dtype``.

        ``full=True`` gives transformers' layout, ``W = rotary_dim`` with the two halves equal
        (``cat(angles, angles)``), which every transformers model consumes whatever its pairing; ``full=False``
        gives ``W = rotary_dim // 2``, one column per pair, which :func:`ropekit.apply_rope` reads for either
        style. Angles are formed in float64 (exactly, for positions below 2**29) and their cos and sin taken in
        float64, so the tables are correct to float64 rounding at any position.
        """
        pos = _positions_arg(positions).to(device)
        ang = self.angles(pos)
        c = torch.cos(ang) * self.attention_scaling
        s = torch.sin(ang) * self.attention_scaling
        if full:
            c, s = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
        return c.to(dtype), s.to(dtype)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly summary (no tensors)."""
        return {
            "rope_type": self.rope_type, "base": self.base, "rotary_dim": self.rotary_dim, "head_dim": self.head_dim,
            "style": self.style, "rotary_at": self.rotary_at, "attention_scaling": self.attention_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "parameters": dict(self.parameters), "freq_scale": self.freq_scale,
            "freq_factors": None if self.freq_factors is None else self.freq_factors.tolist(),
            "softmax_scale": self.softmax_scale, "seq_len": self.seq_len, "arithmetic": self.arithmetic,
        }

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in self.parameters.items() if not isinstance(v, (list, tuple)))
        return (f"RopeFrequencies(rope_type={self.rope_type!r}, base={self.base}, rotary_dim={self.rotary_dim}, "
                f"head_dim={self.head_dim}, style={self.style!r}, attention_scaling={self.attention_scaling:.6g}"
                f"{extra})")

    # ---- constructors -----------------------------------------------------------------------------------------

    @classmethod
    def from_inv_freq(
        cls,
        inv_freq: torch.Tensor | Sequence[float],
        *,
        attention_scaling: float = 1.0,
        head_dim: int | None = None,
        style: str = "neox",
        rotary_at: str = "front",
        freq_scale: float = 1.0,
        freq_factors: torch.Tensor | Sequence[float] | None = None,
    ) -> RopeFrequencies:
        """Wrap a precomputed frequency table ``inv_freq`` ``[rotary_dim // 2]`` (any float dtype; kept in
        float64 and rounded once to float32). ``freq_scale`` and ``freq_factors`` apply on top."""
        inv64 = _float_table(inv_freq, "inv_freq")
        if inv64.numel() == 0:
            raise ValueError("inv_freq must hold at least one frequency, got an empty table")
        if not torch.isfinite(inv64).all():
            raise ValueError("inv_freq must be finite")
        rotary_dim = 2 * inv64.numel()
        head_dim = rotary_dim if head_dim is None else _integer(head_dim, "head_dim", arg=True)
        _check_layout(rotary_dim, head_dim, style, rotary_at)
        scaling = _real(attention_scaling, "attention_scaling", arg=True)
        freq_scale = _real(freq_scale, "freq_scale", arg=True)
        factors = _as_factors(freq_factors, inv64.numel())
        inv64 = _apply_knobs(inv64, freq_scale, factors)
        return cls(inv_freq=inv64.to(torch.float32), inv_freq_float64=inv64, attention_scaling=scaling,
                   rotary_dim=rotary_dim, head_dim=head_dim, rope_type="default", style=style, rotary_at=rotary_at,
                   base=None, freq_scale=freq_scale, freq_factors=factors)


def rope_frequencies(
    rotary_dim: int,
    base: float = 10000.0,
    *,
    rope_type: str = "default",
    head_dim: int | None = None,
    style: str = "neox",
    rotary_at: str = "front",
    max_position_embeddings: int | None = None,
    freq_scale: float = 1.0,
    freq_factors: torch.Tensor | Sequence[float] | None = None,
    **scaling: Any,
) -> RopeFrequencies:
    """Frequencies from explicit parameters, each formula evaluated in float64 and rounded to float32 once
    (``arithmetic="float64"``: within a few float32 ulps of transformers' float32 values, not bit-equal to them;
    use :func:`from_hf_config` for those).

    Parameters
    ----------
    rotary_dim : int
        Rotated columns per head (even). For ``proportional`` it is the whole head (``head_dim``).
    base : float
        ``rope_theta``.
    rope_type : str
        One of :data:`ROPE_TYPES`.
    head_dim : int, optional
        Columns per head (default ``rotary_dim``).
    style, rotary_at : str
        Pairing (``"neox"`` or ``"interleaved"``) and side of the rotated columns (``"front"`` or ``"back"``).
    max_position_embeddings : int, optional
        The model's context length; ``dynamic`` needs it, and it is the default ``original_max_position_embeddings``.
    freq_scale : float
        ggml's ``freq_scale``: every frequency is multiplied by it (0.5 = positions interpolated 2x).
    freq_factors : sequence of float, optional
        ggml's per-pair ``freq_factors`` ``[rotary_dim // 2]``: frequency ``i`` is divided by ``freq_factors[i]``.
    **scaling
        The keys of the rope type, named as in transformers' ``rope_parameters``: ``factor``,
        ``original_max_position_embeddings``, ``attention_factor``, ``beta_fast``, ``beta_slow``, ``mscale``,
        ``mscale_all_dim``, ``truncate`` (yarn), ``short_factor``, ``long_factor`` (longrope),
        ``low_freq_factor``, ``high_freq_factor`` (llama3), ``partial_rotary_factor`` (proportional).

    Raises
    ------
    ValueError
        For an unknown rope type, a key the type does not read, a missing required key or a bad value (the
        message names it).
    TypeError
        For a wrong-typed argument (``rotary_dim``, ``head_dim``, ``base``, ...).
    """
    rope_type = _canonical_type(rope_type, "rope_type", arg=True)
    allowed = set(_TYPE_KEYS[rope_type]) | ({"partial_rotary_factor"} if rope_type == "proportional" else set())
    unknown = sorted(set(scaling) - allowed)
    if unknown:
        raise ValueError(f"rope_type {rope_type!r} does not read {unknown}; its keys are {sorted(allowed) or 'none'}")
    rotary_dim = _integer(rotary_dim, "rotary_dim", arg=True)
    head_dim = rotary_dim if head_dim is None else _integer(head_dim, "head_dim", arg=True)
    params = dict(scaling)
    if rope_type == "proportional":
        params.setdefault("partial_rotary_factor", 1.0)
    base = _real(base, "base", arg=True, above=1.0)
    if max_position_embeddings is not None:
        max_position_embeddings = _integer(max_position_embeddings, "max_position_embeddings", arg=True)
    return _build(rope_type=rope_type, base=base, rotary_dim=rotary_dim, head_dim=head_dim, params=params,
                  max_pos=max_position_embeddings, style=style, rotary_at=rotary_at, freq_scale=freq_scale,
                  freq_factors=freq_factors, arithmetic="float64")


def _build(*, rope_type: str, base: float, rotary_dim: int, head_dim: int, params: dict[str, Any],
           max_pos: int | None, style: str, rotary_at: str, freq_scale: Any, freq_factors: Any,
           arithmetic: str) -> RopeFrequencies:
    _check_layout(rotary_dim, head_dim, style, rotary_at)
    if rope_type == "proportional" and rotary_dim != head_dim:
        raise ValueError(f"rope_type 'proportional' rotates the whole head: rotary_dim ({rotary_dim}) must equal "
                         f"head_dim ({head_dim}); partial_rotary_factor sets the share of non-zero frequencies")
    params = _check_params(rope_type, dict(params), max_pos, rotary_dim)
    freq_scale = _real(freq_scale, "freq_scale", arg=True)
    factors = _as_factors(freq_factors, rotary_dim // 2)
    inv, inv64, scaling = _evaluate(rope_type, base, rotary_dim, head_dim, params, max_pos, None, arithmetic,
                                    freq_scale, factors)
    softmax_scale = 1.0
    if rope_type == "yarn" and params.get("mscale_all_dim"):
        m = _yarn_mscale(params["factor"], params["mscale_all_dim"])
        softmax_scale = m * m
    # finite inputs can still overflow or underflow float32 (a factor of 1e-300, rope_theta of 1e300, ...)
    rotated = inv[: int(params["partial_rotary_factor"] * head_dim // 2)] if rope_type == "proportional" else inv
    if not (torch.isfinite(inv).all() and (rotated > 0).all() and math.isfinite(scaling) and scaling > 0
            and math.isfinite(softmax_scale)):
        shown = {k: v for k, v in params.items() if not isinstance(v, list)}
        raise ValueError(f"rope_type {rope_type!r} with rope_theta (base) {base}, {shown}, freq_scale={freq_scale} "
                         f"gives infinite, NaN or zero frequencies or attention scaling {scaling}: a value is out of "
                         "range")
    return RopeFrequencies(
        inv_freq=inv, inv_freq_float64=inv64, attention_scaling=scaling, rotary_dim=rotary_dim, head_dim=head_dim,
        rope_type=rope_type, style=style, rotary_at=rotary_at, base=base, max_position_embeddings=max_pos,
        original_max_position_embeddings=params.get(_OMP), parameters=params, freq_scale=freq_scale,
        freq_factors=factors, softmax_scale=float(softmax_scale), arithmetic=arithmetic)


def _check_layout(rotary_dim: int, head_dim: int, style: str, rotary_at: str) -> None:
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if head_dim < rotary_dim:
        raise ValueError(f"head_dim ({head_dim}) must be at least rotary_dim ({rotary_dim})")
    if not isinstance(style, str) or style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if not isinstance(rotary_at, str) or rotary_at not in ("front", "back"):
        raise ValueError(f"rotary_at must be 'front' or 'back', got {rotary_at!r}")
