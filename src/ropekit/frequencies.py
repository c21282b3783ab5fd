"""RoPE frequencies: every scaling method of transformers, ggml's generic knobs, and model-config parsing.

A :class:`RopeFrequencies` holds what a rotation needs besides the tensors: the inverse frequencies ``inv_freq``
(float32, ``[rotary_dim // 2]``; pair ``i`` turns by ``position * inv_freq[i]`` radians), the ``attention_scaling``
that multiplies cos and sin, the pairing ``style`` and where the rotated columns sit in a head.

Three ways to get one:

* :func:`from_hf_config` -- from a transformers ``PretrainedConfig`` or a plain dict (a ``config.json``); no
  transformers install needed.
* :func:`rope_frequencies` -- from explicit parameters (a base, a rope type and its scaling keys, ggml's
  ``freq_scale`` and per-pair ``freq_factors``).
* :meth:`RopeFrequencies.from_inv_freq` -- from a precomputed frequency table.

Two arithmetics, recorded in :attr:`RopeFrequencies.arithmetic`:

* ``"transformers"`` (:func:`from_hf_config`): ``inv_freq`` is computed with the float32 torch operations
  transformers' ``modeling_rope_utils`` (and the models' default init) performs, on the CPU, in the same order,
  so it equals transformers' own ``inv_freq`` bit for bit (checked against the installed version), and so does
  ``attention_scaling``. This is ropekit's own code: transformers need not be installed.
* ``"float64"`` (:func:`rope_frequencies`, :meth:`~RopeFrequencies.from_inv_freq`): every formula is evaluated
  in float64 and rounded to float32 once -- the correctly rounded value, which can differ from transformers'
  float32 evaluation by a few float32 ulps (about 2e-7 relative).

``inv_freq_float64`` always holds the float64 evaluation. The formulas follow the published methods, in the form
transformers implements them:

=============  =====================================================================================================
rope type      inverse frequency of pair ``i`` (``d`` = rotary dim, ``b`` = base, ``e_i = 2i/d``, ``f`` = factor)
=============  =====================================================================================================
default        ``b ** -e_i`` (Su et al., RoFormer)
linear         ``b ** -e_i / f`` (position interpolation, Chen et al. 2023)
dynamic        ``b' ** -e_i`` with ``b' = b * (f*L/M - (f-1)) ** (d/(d-2))`` for the current length ``L > M``
               (``M`` = max_position_embeddings); ``b`` while ``L <= M`` (dynamic NTK)
yarn           per-pair blend of ``b ** -e_i`` and ``b ** -e_i / f`` along a linear ramp between the pair indices
               where a wavelength fits ``beta_fast`` and ``beta_slow`` turns in the original context
               (Peng et al. 2023); ``attention_scaling = 0.1 ln f + 1``, or DeepSeek's
               ``mscale(f, mscale) / mscale(f, mscale_all_dim)``, or ``attention_factor``
longrope       ``b ** -e_i / r_i`` with ``r = short_factor`` up to the original context and ``long_factor``
               beyond it (Ding et al. 2024, Phi-3); ``attention_scaling = sqrt(1 + ln f / ln M_orig)``
llama3         ``b ** -e_i`` for wavelengths below ``M_orig / high_freq_factor``, divided by ``f`` above
               ``M_orig / low_freq_factor``, and a smooth blend between (Llama 3.1)
proportional   ``b ** -(2i/head_dim) / f`` for the first ``partial_rotary_factor * head_dim / 2`` pairs of the
               whole head and 0 (no rotation) for the rest (Gemma 4)
=============  =====================================================================================================

After the rope type, ggml's knobs apply to every type: ``inv_freq[i] *= freq_scale / freq_factors[i]`` (in
float64, then rounded; transformers has no such knobs, so a set that uses them is no longer transformers').

Bad input raises ``ValueError`` naming the config key or argument and what was expected (a wrong-typed Python
argument raises ``TypeError``); degenerate values (0, negative, NaN or infinite factors, lengths, bases, ...)
are refused rather than turned into NaN or zero frequencies.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ropekit._device_cache import device_cache

__all__ = [
    "ROPE_TYPES",
    "RopeFrequencies",
    "from_hf_config",
    "rope_frequencies",
]

#: The rope types ropekit computes (transformers' ``ROPE_INIT_FUNCTIONS`` plus ``default``).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")

# Legacy or foreign names of rope types, mapped to ropekit's (transformers') names.
_TYPE_ALIASES = {
    "su": "longrope",  # early Phi-3 configs
    "mrope": "default",  # Qwen2-VL text frequencies; the multimodal sections are not a frequency change
    "deepseek_yarn": "yarn",  # vLLM's name for YaRN with mscale / mscale_all_dim
}

# Keys each rope type reads (besides rope_type / rope_theta / partial_rotary_factor).
_TYPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor", "short_factor", "long_factor"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "proportional": ("factor",),
}

# Model families whose attention pairs columns (2i, 2i+1) instead of (i, i + d/2).
_INTERLEAVED_MODEL_TYPES = {"glm", "glm4", "gptj", "codegen", "deepseek_v2", "deepseek_v3"}
# Families whose configs carry a rotary fraction default other than 1.
# Vision-language families whose text rotation is M-RoPE (time, height, width), and the sections their rotary
# modules take when the config gives no mrope_section; Qwen3-VL interleaves the axes.
_MROPE_DEFAULTS = {"qwen2_vl": (16, 24, 24), "qwen2_5_vl": (16, 24, 24), "qwen3_vl": (24, 20, 20),
                   "qwen3_vl_moe": (24, 20, 20)}
_PARTIAL_DEFAULTS = {"gpt_neox": 0.25, "glm": 0.5, "glm4": 0.5}
STYLES = ("neox", "interleaved")

@device_cache(maxsize=64)
def default_inv_freq(base: float, rotary_dim: int, device: torch.device) -> torch.Tensor:
    """``base ** (-2i / R)`` for i < R/2, formed in float64 and rounded once to fp32 [R/2]: the frequencies of
    ``apply_rope(..., base=...)``.

    Rounded once, the values are the same whether computed eagerly or inside a ``torch.compile`` graph (they agree
    with transformers' fp32 formula except where that formula is itself an ulp off; :func:`from_hf_config`
    reproduces transformers bit for bit). Cached per (base, R, device) in eager mode (the 64 most recently used),
    so calls stay free of host work and allocations."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return torch.pow(base, -exponent).to(torch.float32).to(device)


# --------------------------------------------------------------------------------------------------------------
# the frequency object
# --------------------------------------------------------------------------------------------------------------


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
        (float64 evaluation rounded once); see the module docstring.
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


# --------------------------------------------------------------------------------------------------------------
# explicit construction
# --------------------------------------------------------------------------------------------------------------


def axial_inv_freq(dims: Sequence[int], base: float = 10000.0) -> torch.Tensor:
    """Axial RoPE frequencies (vision and diffusion transformers): one set per axis, concatenated. Axis a rotates
    ``dims[a]`` columns with ``base ** (-2j / dims[a])`` for j < dims[a] / 2; float64, rounded once to float32
    [sum(dims) / 2].

    Use with multi-axis positions and ``sections = [d // 2 for d in dims]``: Flux's 3-axis RoPE is
    ``apply_rope(q, k, positions=ids, inv_freq=axial_inv_freq((16, 56, 56), 10000.0), sections=(8, 28, 28),
    style="interleaved")`` with ``ids`` [3, B, S]."""
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) or not dims:
        raise TypeError(f"dims must be a non-empty sequence of ints (columns per axis), got {dims!r}")
    if any(not isinstance(d, int) or isinstance(d, bool) or d <= 0 or d % 2 for d in dims):
        raise ValueError(f"dims must hold positive even ints (columns per axis, two per pair), got {list(dims)}")
    base = _real(base, "base", arg=True, above=1.0)
    parts = [base ** -(torch.arange(0, d, 2, dtype=torch.float64) / d) for d in dims]
    return torch.cat(parts).to(torch.float32)


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


# --------------------------------------------------------------------------------------------------------------
# transformers configs
# --------------------------------------------------------------------------------------------------------------


def from_hf_config(
    config: Any,
    *,
    layer_type: str | None = None,
    style: str | None = None,
    freq_scale: float = 1.0,
    freq_factors: torch.Tensor | Sequence[float] | None = None,
) -> RopeFrequencies:
    """The frequencies a transformers model builds from ``config``: ``inv_freq`` and ``attention_scaling`` equal
    transformers' bit for bit for every rope type (``arithmetic="transformers"``: the same float32 torch
    operations in the same order, on the CPU; see :meth:`RopeFrequencies.for_seq_len` for dynamic NTK and
    LongRoPE), unless ``freq_scale`` / ``freq_factors`` are used. ``inv_freq_float64`` holds the float64 values.

    Parameters
    ----------
    config : PretrainedConfig, Mapping, str or os.PathLike
        A transformers config object, a plain dict such as a parsed ``config.json``, or the path of a model's
        ``config.json`` (any JSON file of that form, or a folder holding ``config.json``: what ``ropekit plot
        --config`` takes; nothing is downloaded). Both spellings are read:
        transformers 5's ``rope_parameters`` (which carries ``rope_theta`` and ``partial_rotary_factor``) and the
        older ``rope_scaling`` with top-level ``rope_theta`` / ``partial_rotary_factor``. Also read:
        ``head_dim`` (or ``qk_rope_head_dim`` for MLA models, else ``hidden_size // num_attention_heads``),
        ``max_position_embeddings``, a top-level ``original_max_position_embeddings`` (Phi-3), GPT-NeoX's
        ``rotary_pct`` / ``rotary_emb_base``, GPT-J's absolute ``rotary_dim``, and ``model_type`` for the
        family's pairing and defaults. transformers need not be installed.
    layer_type : str, optional
        For configs with one parameter set per layer type (Gemma 3: ``"sliding_attention"``,
        ``"full_attention"``), which set to use.
    style : str, optional
        Override the pairing; by default ``"interleaved"`` for GLM, GPT-J, CodeGen and DeepSeek-V2/V3
        (``rope_interleave``), else ``"neox"``.
    freq_scale, freq_factors
        ggml's knobs, applied on top (see :func:`rope_frequencies`).

    Raises
    ------
    ValueError
        Unknown ``rope_type``, missing keys (``factor``, ``short_factor``, ...), a bad value (0, negative, NaN or
        infinite factors, lengths or bases, wrong-typed config entries, factor lists of the wrong length), an odd
        rotary dimension, or a per-layer config without ``layer_type``; the message names the key. For a path: a
        file that is not a JSON object.
    OSError
        For a path: no such file (``FileNotFoundError``; a folder without ``config.json``), or it cannot be read.
    TypeError
        ``config`` is neither a config object, a Mapping nor a path, or an argument has the wrong type.
    """
    if isinstance(config, (str, os.PathLike)):
        config = _read_config_json(config)[1]
    get = _getter(config)
    text_config = get("text_config")
    if text_config is not None and get("hidden_size") is None and get("head_dim") is None:
        # a vision-language model's config: the language model's rotation lives in its text config
        return from_hf_config(text_config, layer_type=layer_type, style=style, freq_scale=freq_scale,
                              freq_factors=freq_factors)
    if layer_type is not None and not isinstance(layer_type, str):
        raise TypeError(f"layer_type must be a str, got {type(layer_type).__name__}")
    model_type = get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ValueError(f"config['model_type'] must be a str, got {model_type!r}")
    key, rp = _first_key(get, "rope_parameters", "rope_scaling", falsy=True)
    rp = _mapping(rp or {}, key)
    if rp and _is_per_layer(rp):
        choices = sorted(k for k, v in rp.items() if v is not None)
        if layer_type is None:
            if len(choices) != 1:
                raise ValueError(f"this config has one rope parameter set per layer type {choices}; "
                                 "pass layer_type= to choose one")
            layer_type = choices[0]
        if rp.get(layer_type) is None:
            raise ValueError(f"layer_type {layer_type!r} has no rope parameters; the config has {choices}")
        rp = _mapping(rp[layer_type], f"{key}[{layer_type!r}]")
    # (a config with one parameter set uses it for every layer type, whatever layer_type says)

    raw_type = rp.get("rope_type") or rp.get("type") or "default"
    if raw_type == "yarn" and model_type in ("phi3", "phi4_multimodal"):
        raw_type = "longrope"  # transformers renames these configs' legacy "yarn" to longrope
    rope_type = _canonical_type(raw_type, "rope_parameters['rope_type']")

    if rp.get("rope_theta") is not None:
        base = _real(rp["rope_theta"], "rope_parameters['rope_theta']", above=1.0)
    else:
        name, base = _first_key(get, "rope_theta", "rotary_emb_base")
        base = 10000.0 if base is None else _real(base, name, above=1.0)
    name, head_dim = _first_key(get, "qk_rope_head_dim", "head_dim", falsy=True)
    if head_dim:
        head_dim = _integer(head_dim, name)
    else:
        hidden_key, hidden = _first_key(get, "hidden_size", "n_embd", "d_model")
        heads_key, heads = _first_key(get, "num_attention_heads", "n_head")
        if not hidden or not heads:
            raise ValueError("config needs head_dim, or hidden_size and num_attention_heads, to size the rotation")
        head_dim = _integer(hidden, hidden_key) // _integer(heads, heads_key)
        if head_dim < 2:
            raise ValueError(f"{hidden_key} // {heads_key} = {hidden} // {heads} = {head_dim}: a head needs at least "
                             "2 columns to rotate")
    name, partial = _first_key(lambda k: rp.get(k), "partial_rotary_factor")
    if partial is None:
        name, partial = _first_key(get, "partial_rotary_factor", "rotary_pct")
    if partial is None:
        partial = _PARTIAL_DEFAULTS.get(model_type, 1.0)
    partial = _real(partial, name, above=0.0, closed=rope_type == "proportional", at_most=1.0)
    if rope_type == "proportional":
        rotary_dim = how = head_dim
    elif get("rotary_dim") is not None:  # GPT-J / CodeGen: absolute width
        rotary_dim = _integer(get("rotary_dim"), "rotary_dim")
        how = f"rotary_dim = {rotary_dim}"
    else:
        rotary_dim = int(head_dim * partial)  # transformers truncates the same way
        how = f"int(head_dim * {name}) = int({head_dim} * {partial}) = {rotary_dim}"
    if rotary_dim % 2:
        raise ValueError(f"the rotary dimension {how} is odd; RoPE rotates pairs, so it must be even")
    if rotary_dim <= 0:
        raise ValueError(f"the rotary dimension {how} must be positive")

    name, max_pos = _first_key(get, "max_position_embeddings", "n_positions")
    if max_pos is not None:
        max_pos = _integer(max_pos, name)
    params = {k: rp[k] for k in _TYPE_KEYS[rope_type] if k in rp}
    if rope_type in ("yarn", "longrope", "llama3"):
        top = get("original_max_position_embeddings")
        if top is not None:  # Phi-3 keeps the pretraining length beside rope_scaling; it wins there too
            params["original_max_position_embeddings"] = _integer(top, "original_max_position_embeddings")
    if rope_type == "proportional":
        params["partial_rotary_factor"] = partial
    if style is None:
        style = "neox"
        if model_type in _INTERLEAVED_MODEL_TYPES:
            style = "interleaved"
            if model_type == "deepseek_v3" and get("rope_interleave") is False:
                style = "neox"
    freqs = _build(rope_type=rope_type, base=base, rotary_dim=rotary_dim, head_dim=head_dim, params=params,
                   max_pos=max_pos, style=style, rotary_at="front", freq_scale=freq_scale, freq_factors=freq_factors,
                   arithmetic="transformers")
    family = (model_type or "").removesuffix("_text")
    if rp.get("mrope_section") is not None or family in _MROPE_DEFAULTS:  # M-RoPE: positions [3, B, S]
        sections = rp.get("mrope_section", _MROPE_DEFAULTS.get(family))
        if not isinstance(sections, Sequence) or isinstance(sections, str) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sections):
            raise ValueError(f"{key}['mrope_section'] must be a list of ints >= 0, got {sections!r}")
        if sum(sections) != rotary_dim // 2:
            raise ValueError(f"{key}['mrope_section'] {list(sections)} must sum to the rotary pairs "
                             f"{rotary_dim // 2}")
        interleaved = bool(rp.get("mrope_interleaved")) or family.startswith("qwen3_vl")
        freqs = dataclasses.replace(freqs, sections=tuple(sections),
                                    section_layout="interleaved" if interleaved else "contiguous")
    return freqs


# --------------------------------------------------------------------------------------------------------------
# internals
# --------------------------------------------------------------------------------------------------------------

_PER_LAYER_SCALARS = {"rope_type", "type", "rope_theta", "factor", "partial_rotary_factor"}
_OMP = "original_max_position_embeddings"


def _is_per_layer(rp: Mapping[str, Any]) -> bool:
    return not (set(rp) & _PER_LAYER_SCALARS) and all(v is None or isinstance(v, Mapping) for v in rp.values())


def _read_config_json(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """``(the file read, its parsed JSON object)`` for the path of a model's config: a JSON file, or a folder
    holding ``config.json``. The one reader of config paths (:func:`from_hf_config`, ``ropekit plot --config``).

    Raises ``FileNotFoundError`` (naming the file looked for) or another ``OSError``, ``ValueError`` for a file
    that is not a JSON object, ``TypeError`` for a ``path`` that is neither a str nor an os.PathLike."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike (a config.json or its folder), got {type(path).__name__}")
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        what = "a model's config.json or the folder that holds it; nothing is downloaded"
        raise FileNotFoundError(2, f"no such config file ({what})", str(p))
    with open(p, encoding="utf-8") as fh:
        try:
            cfg = json.load(fh)
        except json.JSONDecodeError as err:
            raise ValueError(f"{p}: not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: expected a JSON object (a model's config), got a {type(cfg).__name__}")
    return p, cfg


def _getter(config: Any):
    if isinstance(config, Mapping):
        return config.get
    if hasattr(config, "to_dict") or hasattr(config, "__dict__"):
        return lambda key: getattr(config, key, None)
    raise TypeError(f"config must be a transformers PretrainedConfig or a Mapping (or the path of a config.json), "
                    f"got {type(config).__name__}")


def _first_key(get, *keys: str, falsy: bool = False) -> tuple[str, Any]:
    """``(key, value)`` of the first key that is set (not None; also not empty/zero when ``falsy``), else
    ``(keys[0], None)``."""
    for key in keys:
        value = get(key)
        if value is not None and not (falsy and isinstance(value, (Mapping, str, numbers.Number)) and not value):
            return key, value
    return keys[0], None


def _mapping(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a dict of rope parameters, got {value!r}")
    return dict(value)


def _real(value: Any, name: str, *, arg: bool = False, above: float = 0.0, closed: bool = False,
          at_most: float | None = None) -> float:
    """``value`` as a float, checked finite and ``> above`` (``>=`` when ``closed``; ``<= at_most``). Errors name
    ``name``; a wrong type is a TypeError for a Python argument (``arg``), a ValueError for a config entry."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise (TypeError if arg else ValueError)(f"{name} must be a number, got {value!r}")
    try:
        v = float(value)
    except OverflowError:  # an int beyond float range
        v = math.inf
    if not (math.isfinite(v) and (v >= above if closed else v > above) and (at_most is None or v <= at_most)):
        bound = f"{'>=' if closed else '>'} {above:g}" + ("" if at_most is None else f" and <= {at_most:g}")
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return v


def _integer(value: Any, name: str, *, arg: bool = False, minimum: int = 1) -> int:
    """``value`` as an int in ``[minimum, 2**53]`` (beyond, float math loses it; errors as for :func:`_real`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise (TypeError if arg else ValueError)(f"{name} must be an integer, got {value!r}")
    if not minimum <= value <= 2**53:
        raise ValueError(f"{name} must be an integer >= {minimum} (and <= 2**53), got {value!r}")
    return int(value)


def _length_arg(value: Any, name: str) -> int:
    """A sequence length: an int or a one-element integer tensor, >= 0."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an int or a one-element integer tensor, got a {value.dtype} tensor "
                            f"of shape {tuple(value.shape)}")
        value = int(value.item())
    return _integer(value, name, arg=True, minimum=0)


def _positions_arg(positions: Any) -> torch.Tensor:
    """Positions as an integer tensor."""
    if not isinstance(positions, torch.Tensor):
        if positions is None or isinstance(positions, (str, bytes, Mapping)):
            raise TypeError(f"positions must be an int, a sequence of ints or an integer tensor, got {positions!r}")
        try:
            positions = torch.as_tensor(positions)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError("positions must be an int, a sequence of ints or an integer tensor, got "
                            f"{type(positions).__name__}") from None
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"positions must be integers, got dtype {positions.dtype}")
    return positions


def _float_table(values: Any, name: str) -> torch.Tensor:
    """A flat float64 CPU copy of a sequence of numbers or a tensor."""
    if not isinstance(values, torch.Tensor):
        if isinstance(values, (str, bytes, Mapping, bool)) or values is None:
            raise TypeError(f"{name} must be a sequence of numbers or a tensor, got {values!r}")
        try:
            values = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{name} must be a sequence of numbers or a tensor, got {type(values).__name__}") from None
    if values.dtype == torch.bool or values.is_complex():
        raise TypeError(f"{name} must hold real numbers, got dtype {values.dtype}")
    return values.detach().to(device="cpu", dtype=torch.float64).reshape(-1).clone()


def _canonical_type(rope_type: Any, name: str, *, arg: bool = False) -> str:
    if not isinstance(rope_type, str):
        raise (TypeError if arg else ValueError)(f"{name} must be a str (one of {list(ROPE_TYPES)}), "
                                                 f"got {rope_type!r}")
    name = _TYPE_ALIASES.get(rope_type, rope_type)
    if name not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; expected one of {list(ROPE_TYPES)} "
                         f"(or the legacy names {sorted(_TYPE_ALIASES)})")
    return name


def _check_layout(rotary_dim: int, head_dim: int, style: str, rotary_at: str) -> None:
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if head_dim < rotary_dim:
        raise ValueError(f"head_dim ({head_dim}) must be at least rotary_dim ({rotary_dim})")
    if not isinstance(style, str) or style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if not isinstance(rotary_at, str) or rotary_at not in ("front", "back"):
        raise ValueError(f"rotary_at must be 'front' or 'back', got {rotary_at!r}")


def _as_factors(freq_factors: Any, half: int) -> torch.Tensor | None:
    if freq_factors is None:
        return None
    f = _float_table(freq_factors, "freq_factors")
    if f.numel() != half:
        raise ValueError(f"freq_factors must hold rotary_dim // 2 = {half} values, got {f.numel()}")
    if not (torch.isfinite(f).all() and (f > 0).all()):
        raise ValueError("freq_factors must be finite and positive")
    return f


def _apply_knobs(inv64: torch.Tensor, freq_scale: float, factors: torch.Tensor | None) -> torch.Tensor:
    if freq_scale != 1.0:
        inv64 = inv64 * freq_scale
    if factors is not None:
        inv64 = inv64 / factors
    return inv64


def _required(p: Mapping[str, Any], key: str, rope_type: str, what: str = "a number") -> Any:
    if p.get(key) is None:
        raise ValueError(f"rope_type {rope_type!r} needs rope_parameters[{key!r}] ({what}), but it is missing")
    return p[key]


def _check_params(rope_type: str, p: dict[str, Any], max_pos: int | None, dim: int) -> dict[str, Any]:
    """Check every key ``rope_type`` reads (ValueError naming it) and fill in transformers' defaults."""
    def key(k: str) -> str:
        return f"rope_parameters[{k!r}]"

    if rope_type in ("yarn", "longrope", "llama3"):
        if p.get(_OMP) is None:
            if max_pos is None:
                raise ValueError(f"rope_type {rope_type!r} needs {key(_OMP)} or max_position_embeddings, and "
                                 "neither is set")
            p[_OMP] = max_pos
        # longrope's attention factor divides by ln(original length)
        p[_OMP] = _integer(p[_OMP], key(_OMP), minimum=2 if rope_type == "longrope" else 1)
    if rope_type == "dynamic":
        if max_pos is None:
            raise ValueError("rope_type 'dynamic' needs max_position_embeddings (the length beyond which it rescales)")
        if dim <= 2:
            raise ValueError(f"rope_type 'dynamic' needs rotary_dim > 2 (its base grows with the power "
                             f"d / (d - 2)), got {dim}")
    if p.get("factor") is None:
        if rope_type in ("yarn", "longrope") and max_pos is not None:
            p["factor"] = max_pos / p[_OMP]  # transformers derives it the same way
        elif rope_type == "proportional":
            p["factor"] = 1.0
        elif rope_type != "default":
            hint = " or max_position_embeddings to derive it" if rope_type in ("yarn", "longrope") else ""
            _required(p, "factor", rope_type, "a number" + hint)
    if "factor" in p:
        p["factor"] = _real(p["factor"], key("factor"))
    if p.get("attention_factor") is not None:
        p["attention_factor"] = _real(p["attention_factor"], key("attention_factor"))
    for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if p.get(k) is not None:  # 0 is allowed: transformers then uses the default beta / ignores the mscales
            p[k] = _real(p[k], key(k), closed=True)
    if p.get("truncate") is not None and not isinstance(p["truncate"], bool):
        raise ValueError(f"{key('truncate')} must be True or False, got {p['truncate']!r}")
    if rope_type == "llama3":
        low = p["low_freq_factor"] = _real(_required(p, "low_freq_factor", rope_type), key("low_freq_factor"))
        high = p["high_freq_factor"] = _real(_required(p, "high_freq_factor", rope_type), key("high_freq_factor"))
        if not high > low:
            raise ValueError(f"{key('high_freq_factor')} ({high}) must exceed {key('low_freq_factor')} ({low})")
    if rope_type == "longrope":
        for k in ("short_factor", "long_factor"):
            values = _required(p, k, rope_type, f"a list of rotary_dim // 2 = {dim // 2} numbers")
            if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
                raise ValueError(f"{key(k)} must be a list of rotary_dim // 2 = {dim // 2} numbers, got {values!r}")
            if len(values) != dim // 2:
                raise ValueError(f"{key(k)} must hold rotary_dim // 2 = {dim // 2} numbers, got {len(values)}")
            p[k] = [_real(v, f"{key(k)}[{i}]") for i, v in enumerate(values)]
    if rope_type == "proportional":
        p["partial_rotary_factor"] = _real(p.get("partial_rotary_factor", 1.0), "partial_rotary_factor",
                                           closed=True, at_most=1.0)
    return p


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


def _evaluate(rope_type: str, base: float, dim: int, head_dim: int, p: Mapping[str, Any], max_pos: int | None,
              seq_len: int | torch.Tensor | None, arithmetic: str, freq_scale: float,
              factors: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(inv_freq float32, inv_freq float64, attention_scaling)`` of one set, knobs applied."""
    inv64 = _apply_knobs(_compute(rope_type, base, dim, head_dim, p, max_pos,
                                  None if seq_len is None else int(seq_len)), freq_scale, factors)
    if arithmetic == "transformers":
        inv = _hf_compute(rope_type, base, dim, head_dim, p, max_pos, seq_len)
        if freq_scale != 1.0 or factors is not None:  # not a transformers knob: applied in float64, rounded again
            inv = _apply_knobs(inv.double(), freq_scale, factors).float()
    else:
        inv = inv64.to(torch.float32)
    return inv, inv64, float(_attention_scaling(rope_type, p))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _attention_scaling(rope_type: str, p: Mapping[str, Any]) -> float:
    """transformers' ``attention_scaling`` (the same Python float arithmetic)."""
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    factor = p["factor"]
    if p.get("attention_factor") is not None:
        return p["attention_factor"]
    if rope_type == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(p[_OMP]))
    mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
    if mscale and mscale_all:  # DeepSeek-V2/V3
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    return _yarn_mscale(factor)


def _yarn_ramp(p: Mapping[str, Any], dim: int, base: float) -> tuple[float, float]:
    """The pair indices where YaRN's ramp from extrapolation to interpolation starts and ends."""
    orig = p[_OMP]

    def pair_at(key: str, default: float) -> float:  # fractional pair index whose wavelength fits `turns` in orig
        turns = p.get(key) or default  # transformers' fallback for 0 too
        ratio = orig / (turns * 2 * math.pi)
        if not 0 < ratio < math.inf:
            raise ValueError(f"rope_parameters[{key!r}] = {turns!r} is out of range for {_OMP} = {orig}")
        return dim * math.log(ratio) / (2 * math.log(base))

    low, high = pair_at("beta_fast", 32), pair_at("beta_slow", 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    return low, high


def _compute(rope_type: str, base: float, dim: int, head_dim: int, p: Mapping[str, Any], max_pos: int | None,
             seq_len: int | None) -> torch.Tensor:
    """float64 ``inv_freq [dim // 2]`` of one rope type, for length ``seq_len`` (None: the construction-time set)."""
    f64 = torch.float64
    expo = torch.arange(0, dim, 2, dtype=f64) / dim  # 2i / d
    if rope_type == "default":
        return base ** -expo
    if rope_type == "linear":
        return base ** -expo / p["factor"]
    if rope_type == "dynamic":
        factor = p["factor"]
        length = max_pos if seq_len is None else max(seq_len, max_pos)
        new_base = base * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return new_base ** -expo
    if rope_type == "proportional":
        angles = int(p["partial_rotary_factor"] * head_dim // 2)
        inv = torch.zeros(head_dim // 2, dtype=f64)
        inv[:angles] = base ** -(torch.arange(0, 2 * angles, 2, dtype=f64) / head_dim)
        return inv / p["factor"]
    if rope_type == "llama3":
        inv = base ** -expo
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_len = float(p[_OMP])
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > old_len / low, inv / factor, blended)
        return torch.where(wavelen < old_len / high, inv, out)
    if rope_type == "yarn":
        low, high = _yarn_ramp(p, dim, base)
        ramp = ((torch.arange(dim // 2, dtype=f64) - low) / (high - low)).clamp(0, 1)
        extrapolated = base ** -expo
        interpolated = extrapolated / p["factor"]
        # ramp 0 (fast pairs): keep the original frequency; ramp 1 (slow pairs): interpolate
        return interpolated * ramp + extrapolated * (1 - ramp)
    if rope_type == "longrope":
        use_long = seq_len is not None and seq_len > p[_OMP]
        return base ** -expo / torch.tensor(p["long_factor"] if use_long else p["short_factor"], dtype=f64)
    raise ValueError(f"rope_type {rope_type!r} is not supported; expected one of {list(ROPE_TYPES)}")


def _hf_compute(rope_type: str, base: float, dim: int, head_dim: int, p: Mapping[str, Any], max_pos: int | None,
                seq_len: int | torch.Tensor | None) -> torch.Tensor:
    """float32 ``inv_freq`` as transformers computes it on the CPU, bit for bit.

    Every float32 rounding must be transformers', so this performs the same torch operations on tensors of the
    same shapes in the same order (``scalar / t`` is ``t.reciprocal() * scalar`` in torch, ``1 - (1 - r)`` is not
    ``r``, a vectorised loop may round differently from its scalar tail): do not "simplify" the expressions.
    ``seq_len`` (dynamic): None, an int, or a 0-dim integer tensor -- transformers' module passes the latter, which
    turns the new base into a float32 tensor.
    """
    f32 = torch.float32
    if rope_type == "proportional":  # exponents over the whole head, zeros for the unrotated pairs
        angles = int(p["partial_rotary_factor"] * head_dim // 2)
        inv = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(f32) / head_dim))
        return torch.cat((inv, torch.zeros(head_dim // 2 - angles, dtype=f32))) / p["factor"]
    expo = torch.arange(0, dim, 2, dtype=torch.int64).to(f32) / dim
    if rope_type == "yarn":
        powers = base ** expo
        extrapolated, interpolated = 1.0 / powers, 1.0 / (p["factor"] * powers)
        low, high = _yarn_ramp(p, dim, base)
        keep = 1 - ((torch.arange(dim // 2, dtype=f32) - low) / (high - low)).clamp(0, 1)
        return interpolated * (1 - keep) + extrapolated * keep
    if rope_type == "longrope":
        long = seq_len is not None and seq_len > p[_OMP]
        ext = torch.tensor(p["long_factor"] if long else p["short_factor"], dtype=f32)
        return 1.0 / (ext * base ** expo)
    if rope_type == "dynamic":
        factor, length = p["factor"], max_pos if seq_len is None else seq_len
        if not isinstance(length, torch.Tensor):
            length = max(length, max_pos)
        base = base * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (base ** expo)
    if rope_type in ("linear", "dynamic", "default"):
        return inv / p["factor"] if rope_type == "linear" else inv
    if rope_type == "llama3":
        factor, low, high, old = p["factor"], p["low_freq_factor"], p["high_freq_factor"], p[_OMP]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"rope_type {rope_type!r} is not supported; expected one of {list(ROPE_TYPES)}")
