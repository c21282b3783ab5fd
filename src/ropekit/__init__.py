"""ropekit: rotary position embeddings for PyTorch.

Public entry points: :func:`apply_rope`, :func:`apply_rope_` (in place), :func:`rope_backward`,
:func:`from_hf_config` and :class:`RotaryEmbedding` (frequencies of any transformers model), and
:func:`ropekit.integrations.transformers.apply_rotary_pos_emb` (a drop-in for transformers' function).
"""

from ropekit._version import __version__
from ropekit.api import apply_rope, apply_rope_, rope_backward
from ropekit.frequencies import RopeFrequencies, from_hf_config, rope_frequencies
from ropekit.modules import RotaryEmbedding

__all__ = ["__version__", "apply_rope", "apply_rope_", "rope_backward", "RopeFrequencies", "from_hf_config",
           "rope_frequencies", "RotaryEmbedding"]
