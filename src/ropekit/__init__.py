"""ropekit: rotary position embeddings for PyTorch.

Public entry points: :func:`apply_rope`, :func:`apply_rope_` (in place), :func:`rope_backward`, the attention
prologue :func:`qk_norm_rope` (per-head RMSNorm + RoPE) and :func:`rope_kv_write` (+ the KV-cache write), RoPE
fused into attention :func:`rope_attention`, :func:`from_hf_config` and :class:`RotaryEmbedding` (frequencies of
any transformers model), and :func:`ropekit.integrations.transformers.apply_rotary_pos_emb` (a drop-in for
transformers' function);
:func:`set_fast_path` turns the eager launch plans off (debugging).

The names are imported on first use, so that ``import ropekit.<submodule>`` (and the ``ropekit`` command's
``--help``) loads only what that submodule needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ropekit._version import __version__

# public name -> module that defines it
_EXPORTS = {
    "apply_rope": "ropekit.api",
    "apply_rope_": "ropekit.api",
    "rope_backward": "ropekit.api",
    "qk_norm_rope": "ropekit.api",
    "rope_kv_write": "ropekit.api",
    "mla_rope_kv_write": "ropekit.mla",
    "rope_attention": "ropekit.attention",
    "RopeFrequencies": "ropekit.frequencies",
    "from_hf_config": "ropekit.frequencies",
    "rope_frequencies": "ropekit.frequencies",
    "axial_inv_freq": "ropekit.frequencies",
    "RotaryEmbedding": "ropekit.modules",
    "set_fast_path": "ropekit._config",
}

__all__ = ["__version__", "apply_rope", "apply_rope_", "rope_backward", "qk_norm_rope", "rope_kv_write",
           "rope_attention", "mla_rope_kv_write",
           "RopeFrequencies", "from_hf_config",
           "rope_frequencies", "axial_inv_freq", "RotaryEmbedding", "set_fast_path"]

if TYPE_CHECKING:
    from ropekit._config import set_fast_path
    from ropekit.api import apply_rope, apply_rope_, qk_norm_rope, rope_backward, rope_kv_write
    from ropekit.attention import rope_attention
    from ropekit.frequencies import RopeFrequencies, axial_inv_freq, from_hf_config, rope_frequencies
    from ropekit.mla import mla_rope_kv_write
    from ropekit.modules import RotaryEmbedding


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ropekit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
