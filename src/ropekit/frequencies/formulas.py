"""The rope types and their formulas: inverse frequencies and attention scaling per type, each computed two ways.

* :func:`_compute` evaluates a type's formula in float64 (the correctly rounded reference of every set);
* :func:`_hf_compute` performs transformers' float32 torch operations in transformers' order, so that
  :func:`~ropekit.frequencies.from_hf_config` equals transformers bit for bit;

:func:`_evaluate` returns both, with ggml's ``freq_scale`` / ``freq_factors`` applied and the type's
``attention_scaling``. :func:`_check_params` checks every key a type reads and fills in transformers' defaults. The
formulas themselves are tabled in the docstring of :mod:`ropekit.frequencies`. Also here: :func:`default_inv_freq`
(the frequencies of ``apply_rope(..., base=...)``) and :func:`axial_inv_freq` (axial RoPE of vision and diffusion
models).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ropekit._device_cache import device_cache
from ropekit.frequencies._checks import _float_table, _integer, _real

__all__ = ["ROPE_TYPES", "axial_inv_freq", "default_inv_freq"]

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

# The key named most often: the context length a model was pretrained with.
_OMP = "original_max_position_embeddings"


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


def _canonical_type(rope_type: Any, name: str, *, arg: bool = False) -> str:
    if not isinstance(rope_type, str):
        raise (TypeError if arg else ValueError)(f"{name} must be a str (one of {list(ROPE_TYPES)}), "
                                                 f"got {rope_type!r}")
    name = _TYPE_ALIASES.get(rope_type, rope_type)
    if name not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; expected one of {list(ROPE_TYPES)} "
                         f"(or the legacy names {sorted(_TYPE_ALIASES)})")
    return name


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
