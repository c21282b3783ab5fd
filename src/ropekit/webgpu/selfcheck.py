"""The WebGPU rows of ``ropekit check``: a few rotations on an adapter against the float64 reference.

Each case runs through :meth:`WebGPURunner.apply_rope`, so every angle path (``"shader"``, ``"host"``,
``"shader_base"``) and both pairing styles, fp32 and packed fp16, forward and conjugate are covered."""

from __future__ import annotations

import torch

from ropekit._spec import BACKWARD, FORWARD
from ropekit._validation import validate
from ropekit.frequencies import default_inv_freq
from ropekit.testing import max_relative_error, max_relative_tolerance
from ropekit.webgpu.runner import WebGPURunner, default_runner

__all__ = ["check_rows"]

# name, style, angles, pos_offset, seq_len, heads (q, k), head_dim, dtype, conjugate, base. The tolerances come
# from ropekit.testing.TOLERANCES ("webgpu"; "webgpu-shader-frequencies" for frequencies formed in the shader from
# f32 exp2/log2, an angle error that grows with position * freq, so that case keeps positions short).
_CHECK_CASES = (
    ("interleaved fp32 shader angles, GQA", "interleaved", "shader", 0, 64, (8, 2), 64, torch.float32, False,
     10000.0),
    ("neox fp32 shader angles, pos_offset 2^20", "neox", "shader", 2**20, 32, (4, 1), 128, torch.float32, False,
     500000.0),
    ("interleaved fp32 host table, pos_offset 2^20", "interleaved", "host", 2**20, 32, (4, 2), 64, torch.float32,
     False, 1e6),
    ("neox fp32 backward (conjugate)", "neox", "shader", 17, 48, (4, 4), 64, torch.float32, True, 10000.0),
    ("interleaved fp16 packed", "interleaved", "shader", 1000, 32, (4, 2), 64, torch.float16, False, 10000.0),
    ("neox fp16 packed", "neox", "shader", 5, 32, (4, 2), 128, torch.float16, False, 10000.0),
    ("interleaved fp32 rope_q/rope_k (frequencies in the shader)", "interleaved", "shader_base", 0, 64, (4, 2), 64,
     torch.float32, False, 10000.0),
)


def check_rows(runner: WebGPURunner | None = None) -> list[dict]:
    """Compare the WebGPU kernels with the float64 reference over a few cases, on ``runner`` (default: the shared
    runner).

    Returns rows ``{"backend": "webgpu", "device", "case", "max_error", "tolerance", "passed"}`` with the error
    relative to the largest reference value, as every row of ``ropekit check``; [] when wgpu or an adapter is
    missing."""
    if runner is None:
        try:
            runner = default_runner()
        except (ImportError, RuntimeError):
            return []
    from ropekit.reference import rope_reference  # the oracle, imported only to check (the kernels never use it)

    generator = torch.Generator().manual_seed(0)
    rows = []
    for name, style, angles, offset, S, (hq, hk), D, dtype, conjugate, base in _CHECK_CASES:
        q = torch.randn(1, S, hq, D, generator=generator).to(dtype)
        k = torch.randn(1, S, hk, D, generator=generator).to(dtype)
        q_out, k_out = runner.apply_rope(q, k, pos_offset=offset, base=base, style=style, conjugate=conjugate,
                                         angles=angles)
        if angles == "shader_base":  # the exact frequencies the shader approximates
            inv_freq = base ** -(torch.arange(0, D, 2, dtype=torch.float64) / D)
        else:
            inv_freq = default_inv_freq(base, D, torch.device("cpu"))
        spec = validate(q, k, positions=offset, inv_freq=inv_freq, style=style,
                        mode=BACKWARD if conjugate else FORWARD)._replace(out_dtype=torch.float64)
        refs = rope_reference(q, k, spec)
        error = max_relative_error((q_out, k_out), refs)  # NaN (an unwritten element) counts as infinite
        tolerance = max_relative_tolerance(dtype, "webgpu-shader-frequencies" if angles == "shader_base" else "webgpu")
        rows.append({"backend": "webgpu", "device": runner.description, "case": name, "max_error": error,
                     "tolerance": tolerance, "passed": error <= tolerance})
    return rows
