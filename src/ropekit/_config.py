"""Process-wide switches, read at call time by the dispatch layers (no imports from the rest of ropekit).

* ``fast_path``: eager launch plans (:mod:`ropekit._fastpath`) and the float32 path's kept tables
  (:data:`ropekit.float32_path.RECENT_TABLES`). On by default; ``ROPEKIT_DISABLE_FAST_PATH=1`` in the
  environment when ropekit is imported, or :func:`ropekit.set_fast_path`, turns them off to rule them out when
  debugging -- every call then takes the validated full path.
* ``kernels_on_cpu``: CPU tensors run the Triton kernels under the Triton interpreter (``TRITON_INTERPRET=1``)
  instead of the float32 torch path, plans included, with device-resident semantics (position values are not
  read on the host). It exists so that CPU-only CI exercises the CUDA dispatch and the fast path; see
  :func:`ropekit.testing.kernels_on_cpu`.
* ``float32_path_on_cpu``: CPU tensors take the float32 torch path -- the CPU default for float16/bfloat16/float32,
  and the path of devices without Triton kernels or float64 (MPS, XPU, ...) -- even where ``reference_on_cpu`` is
  set (``kernels_on_cpu`` wins over both); see :func:`ropekit.testing.float32_path_on_cpu`.
* ``reference_on_cpu``: CPU tensors of every dtype take the float64 reference (float64 math, one rounding to the
  output dtype) instead of the float32 torch path; see :func:`ropekit.testing.reference_on_cpu`.
* ``exact_angles``: how the kernels reduce in-kernel angles exactly: None (by device: float64 on GPUs with fast
  float64, 64-bit integer turns on the others; float64 under the interpreter -- see
  ``ropekit.triton.heuristics.integer_angles``), ``"float64"`` or ``"integer"``. ``ROPEKIT_EXACT_ANGLES`` sets it at
  import; :func:`ropekit.testing.exact_angles` for a block.
* ``pdl_launches`` (experimental, off): the attention prologue's forward kernel (``rope_kv_write``,
  ``qk_norm_rope``) is launched as a programmatic dependent launch on GPUs that have it (compute capability 9.0+,
  Triton with ``launch_pdl``): its grid may start while the previous kernel on the stream (the QKV projection)
  finishes, and waits for that kernel's memory before its first load. Results are the same bits either way; the
  eager fast path's plans are not used while it is on. Ignored on CPU and under the Triton interpreter.
"""

from __future__ import annotations

import os

fast_path: bool = os.environ.get("ROPEKIT_DISABLE_FAST_PATH", "0").strip().lower() in ("", "0", "false", "no")
kernels_on_cpu: bool = False
float32_path_on_cpu: bool = False
reference_on_cpu: bool = False
exact_angles: str | None = os.environ.get("ROPEKIT_EXACT_ANGLES") or None
pdl_launches: bool = False


def set_fast_path(enabled: bool) -> bool:
    """Turn the eager fast path (cached launch plans) on or off; returns the previous setting.

    With it off, every call is validated and launched through the full path (a few microseconds more host time
    per call). Results are the same either way; turn it off to rule it out when debugging."""
    global fast_path
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    previous, fast_path = fast_path, enabled
    return previous
