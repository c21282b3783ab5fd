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

Every formula is evaluated in float64 and rounded to float32 once. The formulas follow the published methods, in
the form transformers implements them (``modeling_rope_utils``), so that the float32 frequencies agree with
transformers' own to about one float32 rounding:

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

After the rope type, ggml's knobs apply to every type: ``inv_freq[i] *= freq_scale / freq_factors[i]``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

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
_PARTIAL_DEFAULTS = {"gpt_neox": 0.25, "glm": 0.5, "glm4": 0.5}
STYLES = ("neox", "interleaved")


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
        The same before the single rounding to float32.
    attention_scaling : float
        Multiplies cos and sin of every rotated pair (transformers' ``attention_scaling``); pass it as
        ``rotary_scale`` to :func:`ropekit.apply_rope`.
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
    seq_len: int | None = None  # the length this set was computed for (dynamic / longrope), None = construction

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
        ``inv_freq``, ``style``, ``rotary_dim``, ``rotary_at`` and ``rotary_scale``."""
        return {
            "inv_freq": self.inv_freq,
            "style": self.style,
            "rotary_dim": self.rotary_dim,
            "rotary_at": self.rotary_at,
            "rotary_scale": float(self.attention_scaling),
        }

    def for_seq_len(self, seq_len: int) -> RopeFrequencies:
        """The frequencies transformers uses for a sequence whose largest position is ``seq_len - 1``.

        ``dynamic``: recomputed from ``max(seq_len, max_position_embeddings)`` (stateless; transformers' module
        additionally keeps the largest length seen until a short sequence resets it, which
        :class:`ropekit.RotaryEmbedding` mirrors). ``longrope``: the long factors when ``seq_len`` exceeds
        ``original_max_position_embeddings``, else the short ones. Other types return ``self``.
        """
        if not self.is_dynamic:
            return self
        seq_len = int(seq_len)
        if self.rope_type == "longrope":
            use_long = seq_len > self.original_max_position_embeddings
            key_len = self.original_max_position_embeddings + 1 if use_long else None
            if key_len == self.seq_len:
                return self
        else:
            key_len = max(seq_len, self.max_position_embeddings)
            if key_len == (self.seq_len or self.max_position_embeddings):
                return self
        inv64, scaling = _compute(self.rope_type, self.base, self.rotary_dim, self.head_dim, self.parameters,
                                  self.max_position_embeddings, key_len)
        inv64 = _apply_knobs(inv64, self.freq_scale, self.freq_factors)
        return dataclasses.replace(self, inv_freq=inv64.to(torch.float32), inv_freq_float64=inv64,
                                   attention_scaling=scaling, seq_len=key_len)

    def angles(self, positions: torch.Tensor | int | Sequence[int]) -> torch.Tensor:
        """float64 ``[*positions.shape, rotary_dim // 2]``: ``position * inv_freq`` with the float32 ``inv_freq``
        (the angles the kernels form), computed exactly in float64 and not reduced."""
        pos = torch.as_tensor(positions)
        if pos.is_floating_point():
            raise ValueError(f"positions must be integers, got dtype {pos.dtype}")
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
        pos = torch.as_tensor(positions, device=device)
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
            "softmax_scale": self.softmax_scale,
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
        inv64 = torch.as_tensor(inv_freq).detach().to(device="cpu", dtype=torch.float64).reshape(-1).clone()
        if inv64.numel() == 0:
            raise ValueError("inv_freq must hold at least one frequency, got an empty table")
        if not torch.isfinite(inv64).all():
            raise ValueError("inv_freq must be finite")
        rotary_dim = 2 * inv64.numel()
        head_dim = rotary_dim if head_dim is None else int(head_dim)
        _check_layout(rotary_dim, head_dim, style, rotary_at)
        factors = _as_factors(freq_factors, inv64.numel())
        inv64 = _apply_knobs(inv64, float(freq_scale), factors)
        return cls(inv_freq=inv64.to(torch.float32), inv_freq_float64=inv64, attention_scaling=float(attention_scaling),
                   rotary_dim=rotary_dim, head_dim=head_dim, rope_type="default", style=style, rotary_at=rotary_at,
                   base=None, freq_scale=float(freq_scale), freq_factors=factors)


# --------------------------------------------------------------------------------------------------------------
# explicit construction
# --------------------------------------------------------------------------------------------------------------


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
    """Frequencies from explicit parameters.

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
        For an unknown rope type, a key the type does not read, a missing required key or a bad value.
    """
    rope_type = _canonical_type(rope_type)
    allowed = set(_TYPE_KEYS[rope_type]) | ({"partial_rotary_factor"} if rope_type == "proportional" else set())
    unknown = sorted(set(scaling) - allowed)
    if unknown:
        raise ValueError(f"rope_type {rope_type!r} does not read {unknown}; its keys are {sorted(allowed) or 'none'}")
    head_dim = int(rotary_dim if head_dim is None else head_dim)
    params = dict(scaling)
    if rope_type == "proportional":
        params.setdefault("partial_rotary_factor", 1.0)
    return _build(rope_type=rope_type, base=float(base), rotary_dim=int(rotary_dim), head_dim=head_dim,
                  params=params, max_pos=max_position_embeddings, style=style, rotary_at=rotary_at,
                  freq_scale=freq_scale, freq_factors=freq_factors)


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
    """The frequencies a transformers model builds from ``config``.

    Parameters
    ----------
    config : PretrainedConfig or Mapping
        A transformers config object, or a plain dict such as a parsed ``config.json``. Both spellings are read:
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
        Unknown ``rope_type``, missing keys (``factor``, ``short_factor``, ...), factor lists of the wrong length,
        an odd rotary dimension, or a per-layer config without ``layer_type``.
    """
    get = _getter(config)
    model_type = get("model_type")
    rp = get("rope_parameters")
    if not rp:
        rp = get("rope_scaling")
    rp = dict(rp) if rp else {}
    if rp and _is_per_layer(rp):
        choices = sorted(k for k, v in rp.items() if v is not None)
        if layer_type is None:
            if len(choices) != 1:
                raise ValueError(f"this config has one rope parameter set per layer type {choices}; "
                                 "pass layer_type= to choose one")
            layer_type = choices[0]
        if rp.get(layer_type) is None:
            raise ValueError(f"layer_type {layer_type!r} has no rope parameters; the config has {choices}")
        rp = dict(rp[layer_type])
    # (a config with one parameter set uses it for every layer type, whatever layer_type says)

    raw_type = rp.get("rope_type") or rp.get("type") or "default"
    if raw_type == "yarn" and model_type in ("phi3", "phi4_multimodal"):
        raw_type = "longrope"  # transformers renames these configs' legacy "yarn" to longrope
    rope_type = _canonical_type(raw_type)

    base = _first(rp.get("rope_theta"), get("rope_theta"), get("rotary_emb_base"), 10000.0)
    hidden, heads = _first(get("hidden_size"), get("n_embd"), get("d_model")), _first(
        get("num_attention_heads"), get("n_head"))
    head_dim = _first(get("qk_rope_head_dim"), get("head_dim"))
    if not head_dim:
        if not hidden or not heads:
            raise ValueError("config needs head_dim, or hidden_size and num_attention_heads, to size the rotation")
        head_dim = int(hidden) // int(heads)
    head_dim = int(head_dim)
    partial = _first(rp.get("partial_rotary_factor"), get("partial_rotary_factor"), get("rotary_pct"),
                     _PARTIAL_DEFAULTS.get(model_type), 1.0)
    if rope_type == "proportional":
        rotary_dim = head_dim
    elif isinstance(get("rotary_dim"), int) and get("rotary_dim"):  # GPT-J / CodeGen: absolute width
        rotary_dim = int(get("rotary_dim"))
    else:
        rotary_dim = int(head_dim * float(partial))  # transformers truncates the same way
    if rotary_dim % 2:
        raise ValueError(f"the rotary dimension int(head_dim * partial_rotary_factor) = int({head_dim} * {partial}) "
                         f"= {rotary_dim} is odd; RoPE rotates pairs, so it must be even")

    max_pos = _first(get("max_position_embeddings"), get("n_positions"))
    params = {k: rp[k] for k in _TYPE_KEYS[rope_type] if k in rp}
    if rope_type in ("yarn", "longrope", "llama3"):
        top = get("original_max_position_embeddings")
        if top is not None:  # Phi-3 keeps the pretraining length beside rope_scaling; it wins there too
            params["original_max_position_embeddings"] = top
    if rope_type == "proportional":
        params["partial_rotary_factor"] = float(partial)
    if style is None:
        style = "neox"
        if model_type in _INTERLEAVED_MODEL_TYPES:
            style = "interleaved"
            if model_type == "deepseek_v3" and get("rope_interleave") is False:
                style = "neox"
    return _build(rope_type=rope_type, base=float(base), rotary_dim=rotary_dim, head_dim=head_dim, params=params,
                  max_pos=max_pos, style=style, rotary_at="front", freq_scale=freq_scale,
                  freq_factors=freq_factors)


# --------------------------------------------------------------------------------------------------------------
# internals
# --------------------------------------------------------------------------------------------------------------

_PER_LAYER_SCALARS = {"rope_type", "type", "rope_theta", "factor", "partial_rotary_factor"}


def _is_per_layer(rp: Mapping[str, Any]) -> bool:
    return not (set(rp) & _PER_LAYER_SCALARS) and all(v is None or isinstance(v, Mapping) for v in rp.values())


def _getter(config: Any):
    if isinstance(config, Mapping):
        return config.get
    if hasattr(config, "to_dict") or hasattr(config, "__dict__"):
        return lambda key: getattr(config, key, None)
    raise TypeError(f"config must be a transformers PretrainedConfig or a Mapping, got {type(config).__name__}")


def _first(*values: Any) -> Any:
    for v in values:
        if v is not None:
            return v
    return None


def _canonical_type(rope_type: str) -> str:
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
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if rotary_at not in ("front", "back"):
        raise ValueError(f"rotary_at must be 'front' or 'back', got {rotary_at!r}")


def _as_factors(freq_factors: Any, half: int) -> torch.Tensor | None:
    if freq_factors is None:
        return None
    f = torch.as_tensor(freq_factors).detach().to(device="cpu", dtype=torch.float64).reshape(-1).clone()
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


def _number(params: Mapping[str, Any], key: str, rope_type: str, *, positive: bool = True) -> float:
    value = params.get(key)
    if value is None:
        raise ValueError(f"rope_type {rope_type!r} needs rope_parameters[{key!r}] (a number), but it is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"rope_parameters[{key!r}] must be a number, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"rope_parameters[{key!r}] must be positive, got {value!r}")
    return float(value)


def _build(*, rope_type: str, base: float, rotary_dim: int, head_dim: int, params: dict[str, Any],
           max_pos: int | None, style: str, rotary_at: str, freq_scale: float,
           freq_factors: Any) -> RopeFrequencies:
    _check_layout(rotary_dim, head_dim, style, rotary_at)
    if not (math.isfinite(base) and base > 1.0):
        raise ValueError(f"rope_theta (base) must be a finite number > 1, got {base!r}")
    if rope_type == "proportional" and rotary_dim != head_dim:
        raise ValueError(f"rope_type 'proportional' rotates the whole head: rotary_dim ({rotary_dim}) must equal "
                         f"head_dim ({head_dim}); partial_rotary_factor sets the share of non-zero frequencies")
    params = dict(params)
    if max_pos is not None:
        max_pos = int(max_pos)
    # fill the defaults transformers fills, validating as we go
    if rope_type in ("yarn", "longrope", "llama3"):
        if params.get("original_max_position_embeddings") is None:
            if max_pos is None:
                raise ValueError(f"rope_type {rope_type!r} needs rope_parameters['original_max_position_embeddings'] "
                                 "or max_position_embeddings, and neither is set")
            params["original_max_position_embeddings"] = max_pos
        params["original_max_position_embeddings"] = int(
            _number(params, "original_max_position_embeddings", rope_type))
    if rope_type == "dynamic" and max_pos is None:
        raise ValueError("rope_type 'dynamic' needs max_position_embeddings (the length beyond which it rescales)")
    if rope_type in ("linear", "dynamic", "llama3"):
        _number(params, "factor", rope_type)
    if rope_type in ("yarn", "longrope") and params.get("factor") is None:
        if max_pos is None:
            raise ValueError(f"rope_type {rope_type!r} needs rope_parameters['factor'] (or max_position_embeddings "
                             "to derive it), but it is missing")
        params["factor"] = max_pos / params["original_max_position_embeddings"]
    if "factor" in params:
        _number(params, "factor", rope_type)
    if rope_type == "llama3":
        low = _number(params, "low_freq_factor", rope_type)
        high = _number(params, "high_freq_factor", rope_type)
        if not high > low:
            raise ValueError(f"rope_parameters['high_freq_factor'] ({high}) must exceed "
                             f"rope_parameters['low_freq_factor'] ({low})")
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            values = params.get(key)
            if values is None:
                raise ValueError(f"rope_type 'longrope' needs rope_parameters[{key!r}] (a list of rotary_dim // 2 = "
                                 f"{rotary_dim // 2} numbers), but it is missing")
            if len(values) != rotary_dim // 2:
                raise ValueError(f"rope_parameters[{key!r}] must hold rotary_dim // 2 = {rotary_dim // 2} numbers, "
                                 f"got {len(values)}")
            params[key] = [float(v) for v in values]
    if rope_type == "proportional":
        prf = float(params.get("partial_rotary_factor", 1.0))
        if not 0.0 <= prf <= 1.0:
            raise ValueError(f"partial_rotary_factor must lie in [0, 1], got {prf}")
        params.setdefault("factor", 1.0)
    inv64, scaling = _compute(rope_type, base, rotary_dim, head_dim, params, max_pos, None)
    factors = _as_factors(freq_factors, rotary_dim // 2)
    inv64 = _apply_knobs(inv64, float(freq_scale), factors)
    softmax_scale = 1.0
    if rope_type == "yarn" and params.get("mscale_all_dim"):
        softmax_scale = _yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return RopeFrequencies(
        inv_freq=inv64.to(torch.float32), inv_freq_float64=inv64, attention_scaling=float(scaling),
        rotary_dim=rotary_dim, head_dim=head_dim, rope_type=rope_type, style=style, rotary_at=rotary_at, base=base,
        max_position_embeddings=max_pos, original_max_position_embeddings=params.get("original_max_position_embeddings"),
        parameters=params, freq_scale=float(freq_scale), freq_factors=factors, softmax_scale=float(softmax_scale))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _compute(rope_type: str, base: float, dim: int, head_dim: int, p: Mapping[str, Any], max_pos: int | None,
             seq_len: int | None) -> tuple[torch.Tensor, float]:
    """``(inv_freq float64 [dim // 2], attention_scaling)`` of one rope type, for length ``seq_len`` (None: the
    construction-time set)."""
    f64 = torch.float64
    expo = torch.arange(0, dim, 2, dtype=f64) / dim  # 2i / d
    if rope_type == "default":
        return base ** -expo, 1.0
    if rope_type == "linear":
        return base ** -expo / float(p["factor"]), 1.0
    if rope_type == "dynamic":
        factor = float(p["factor"])
        length = max_pos if seq_len is None else max(int(seq_len), max_pos)
        new_base = base * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return new_base ** -expo, 1.0
    if rope_type == "proportional":
        angles = int(float(p["partial_rotary_factor"]) * head_dim // 2)
        inv = torch.zeros(head_dim // 2, dtype=f64)
        inv[:angles] = base ** -(torch.arange(0, 2 * angles, 2, dtype=f64) / head_dim)
        return inv / float(p["factor"]), 1.0
    if rope_type == "llama3":
        inv = base ** -expo
        factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_len = float(p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > old_len / low, inv / factor, blended)
        return torch.where(wavelen < old_len / high, inv, out), 1.0
    if rope_type == "yarn":
        factor = float(p["factor"])
        orig = float(p["original_max_position_embeddings"])
        attention = p.get("attention_factor")
        if attention is None:
            mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
            if mscale and mscale_all:  # DeepSeek-V2/V3
                attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
            else:
                attention = _yarn_mscale(factor)
        beta_fast = p.get("beta_fast") or 32
        beta_slow = p.get("beta_slow") or 1

        def pair_at(turns: float) -> float:  # fractional pair index whose wavelength fits `turns` in orig
            return dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(base))

        low, high = pair_at(beta_fast), pair_at(beta_slow)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=f64) - low) / (high - low)).clamp(0, 1)
        extrapolated = base ** -expo
        interpolated = extrapolated / factor
        # ramp 0 (fast pairs): keep the original frequency; ramp 1 (slow pairs): interpolate
        return interpolated * ramp + extrapolated * (1 - ramp), float(attention)
    if rope_type == "longrope":
        factor = float(p["factor"])
        orig = int(p["original_max_position_embeddings"])
        attention = p.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        use_long = seq_len is not None and seq_len > orig
        ext = torch.tensor(p["long_factor"] if use_long else p["short_factor"], dtype=f64)
        return base ** -expo / ext, float(attention)
    raise ValueError(f"rope_type {rope_type!r} is not supported; expected one of {list(ROPE_TYPES)}")
