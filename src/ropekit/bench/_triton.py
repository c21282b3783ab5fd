"""Triton, when importable: optional on CPU-only installs; on CUDA it ships with torch."""

try:
    import triton
    import triton.language as tl
    import triton.testing as triton_testing
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = triton_testing = None

__all__ = ["triton", "tl", "triton_testing"]
