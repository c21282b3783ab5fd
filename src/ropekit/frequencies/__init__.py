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

The package, bottom to top (each module imports only those listed before it):

* :mod:`~ropekit.frequencies._checks` -- the value checks every part shares (errors name the argument or key);
* :mod:`~ropekit.frequencies.families` -- :data:`~ropekit.frequencies.families.MODEL_FAMILIES`, what ropekit
  knows per ``model_type`` (pairing, partial-rotary and M-RoPE defaults, the functions ``patch`` replaces), read
  by config parsing and by :mod:`ropekit.integrations.patching`;
* :mod:`~ropekit.frequencies.formulas` -- the rope types: their keys, their formulas in float64 and in
  transformers' float32 order, attention scaling, ggml's knobs; :func:`default_inv_freq`, :func:`axial_inv_freq`;
* :mod:`~ropekit.frequencies.frequency_set` -- :class:`RopeFrequencies`, :func:`rope_frequencies`, ``STYLES``;
* :mod:`~ropekit.frequencies.hf_config` -- :func:`from_hf_config` and the reader of ``config.json`` paths.
"""

# Besides the public names, ``as`` re-exports what other modules import from here: the pairing styles and the
# default and axial frequencies (the validation layer, the WebGPU backend, ``ropekit``'s top level), the checks
# ``modules.py`` shares and the config reader of ``plot.py``.
from ropekit.frequencies._checks import _integer as _integer
from ropekit.frequencies._checks import _length_arg as _length_arg
from ropekit.frequencies._checks import _positions_arg as _positions_arg
from ropekit.frequencies.formulas import ROPE_TYPES
from ropekit.frequencies.formulas import axial_inv_freq as axial_inv_freq
from ropekit.frequencies.formulas import default_inv_freq as default_inv_freq
from ropekit.frequencies.frequency_set import STYLES as STYLES
from ropekit.frequencies.frequency_set import RopeFrequencies, rope_frequencies
from ropekit.frequencies.hf_config import _read_config_json as _read_config_json
from ropekit.frequencies.hf_config import from_hf_config

__all__ = [
    "ROPE_TYPES",
    "RopeFrequencies",
    "from_hf_config",
    "rope_frequencies",
]
