"""ropekit: rotary position embeddings for PyTorch.

Public entry points: :func:`apply_rope`, :func:`apply_rope_` (in place), :func:`rope_backward`,
:func:`from_hf_config` and :class:`RotaryEmbedding` (frequencies of any transformers model), and
:func:`ropekit.integrations.transformers.apply_rotary_pos_emb` (a drop-in for transformers' function);
:func:`set_fast_path` turns the eager launch plans off (debugging).
"""

from ropekit._config import set_fast_path
from ropekit._version import __version__
from ropekit.api import apply_rope, apply_rope_, rope_backward
from ropekit.frequencies import RopeFrequencies, from_hf_config, rope_frequencies
from ropekit.modules import RotaryEmbedding

__all__ = ["__version__", "apply_rope", "apply_rope_", "rope_backward", "RopeFrequencies", "from_hf_config",
           "rope_frequencies", "RotaryEmbedding", "set_fast_path"]
