"""ropekit: rotary position embeddings for PyTorch.

Public entry points: :func:`apply_rope`, :func:`apply_rope_` (in place), :func:`rope_backward`, and
:func:`ropekit.integrations.transformers.apply_rotary_pos_emb` (a drop-in for transformers' function).
"""

from ropekit._version import __version__
from ropekit.api import apply_rope, apply_rope_, rope_backward

__all__ = ["__version__", "apply_rope", "apply_rope_", "rope_backward"]
