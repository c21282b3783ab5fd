"""Helpers for testing code that uses ropekit, and ropekit itself, on machines without a GPU.

:func:`kernels_on_cpu` runs ropekit's CUDA dispatch -- the Triton kernels, their launcher and the eager fast
path of cached launch plans -- on CPU tensors through the Triton interpreter, so that a CPU-only CI checks the
same code a GPU runs (slowly: keep shapes small).

:data:`TOLERANCES` is the one table of how far an output may be from the float64 reference, per backend and
dtype. The tests (:func:`assert_close_to_ref`), ``ropekit check`` (:func:`max_relative_tolerance` against
:func:`max_relative_error`), the WebGPU self-check and the benchmark harness all read it.

Importing this module imports torch but not triton.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch


@contextlib.contextmanager
def kernels_on_cpu() -> Iterator[None]:
    """Within the block, CPU tensors (except float64, which keeps the float64 reference) are rotated by the
    Triton kernels under the interpreter, with launch plans from the second call of a signature on, and with
    the semantics of device tensors: position values are not read on the host, invalid positions give NaN.

    Needs ``TRITON_INTERPRET=1`` in the environment before triton is first imported."""
    from ropekit import _config, _fastpath

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("kernels_on_cpu needs TRITON_INTERPRET=1 set before triton is imported")
    previous = _config.kernels_on_cpu
    _config.kernels_on_cpu = True
    try:
        yield
    finally:
        _config.kernels_on_cpu = previous
        _fastpath.clear()


@contextlib.contextmanager
def float32_path_on_cpu() -> Iterator[None]:
    """Within the block, CPU tensors (except float64) take the float32 torch path -- angles exact in float64 on
    the host, the rotation in float32 -- even inside :func:`reference_on_cpu` (not inside :func:`kernels_on_cpu`). It is
    the CPU default for float16/bfloat16/float32 tensors, and the path of devices without Triton kernels or
    float64 (MPS, XPU, ...)."""
    from ropekit import _config

    previous = _config.float32_path_on_cpu
    _config.float32_path_on_cpu = True
    try:
        yield
    finally:
        _config.float32_path_on_cpu = previous


@contextlib.contextmanager
def reference_on_cpu() -> Iterator[None]:
    """Within the block, CPU tensors of every dtype are rotated by the float64 reference (float64 math, one
    rounding to the output dtype: the ``"cpu"`` rows of :data:`TOLERANCES`) instead of the float32 torch path."""
    from ropekit import _config

    previous = _config.reference_on_cpu
    _config.reference_on_cpu = True
    try:
        yield
    finally:
        _config.reference_on_cpu = previous


@contextlib.contextmanager
def exact_angles(method: str) -> Iterator[None]:
    """Within the block, the kernels reduce in-kernel angles by ``method``: ``"float64"`` or ``"integer"`` (64-bit
    integer turns, the path of GPUs without fast float64), whatever the device; see ``ropekit._config``."""
    from ropekit import _config, _fastpath

    if method not in ("float64", "integer"):
        raise ValueError(f"method must be 'float64' or 'integer', got {method!r}")
    previous = _config.exact_angles
    _config.exact_angles = method
    _fastpath.clear()  # plans hold launches bound to the other method
    try:
        yield
    finally:
        _config.exact_angles = previous
        _fastpath.clear()


class Tolerance(NamedTuple):
    """``|out - ref| <= atol + rtol * |ref|`` element by element, against the float64 reference, for inputs of
    unit scale (standard normal). ``rtol`` is the one rounding at the store, ``atol`` the error of the math
    before it. ``torch.testing.assert_close(out, ref, **tol._asdict())`` applies it."""

    rtol: float
    atol: float


# The largest |value| among the 10^4 to 10^6 standard-normal elements of a test or check tensor is about 4 to 5.
# ``atol`` is meant for such data, so relative to the largest |ref| it counts as atol / UNIT_MAX (by taking the
# upper end, the converted criterion is the stricter one).
UNIT_MAX = 5.0

# Backends, where the math differs:
#   "kernels": the Triton kernels on a GPU: fp32 math (the angle formed in float64 and reduced, ~1e-7 rad; fp32
#       sin/cos and products, a few fp32 ulp of values up to ~5: ~1e-6 absolute) and one rounding to the output
#       dtype, to nearest even (half an ulp: rtol 2**-11 for float16, 2**-8 for bfloat16). float32 outputs have
#       no separate rounding, so their rtol (1e-6, 8 ulp) holds the relative part of the fp32 math.
#   "triton-interpreter": the same kernels under TRITON_INTERPRET=1 (CPU CI). The interpreter converts fp32 to
#       bfloat16 by truncation (round toward zero, where compiled kernels round to nearest even): one bfloat16
#       ulp (2**-7) instead of half.
#   "cpu": the float64 reference path (float64 tensors everywhere, and CPU tensors under
#       ropekit.testing.reference_on_cpu): float64 math (~1e-15) and one rounding to nearest: half an ulp of the
#       output dtype (2**-24 for float32), atol 1e-6 for the rounding of values near zero and of float32 tables
#       the caller passes.
#   "float32-path": the torch path of float16/bfloat16/float32 CPU tensors and of devices without Triton kernels
#       or float64 (MPS, ...): angles exact in float64 on the host, cos/sin rounded to float32, products in
#       float32, one rounding: as "kernels".
#   "webgpu": the WGSL kernels with frequencies from the host (float64-formed table or inverse frequencies):
#       f32 math like "kernels" and f16 stores rounded to nearest; float32 and float16 only.
#   "webgpu-shader-frequencies": the WGSL kernels forming the frequencies themselves (f32 exp2/log2): an angle
#       error that grows with position * frequency, ~1e-4 absolute at positions < 64 (keep positions short).
# float64 outputs always come from float64 math (the reference path, whichever backend is asked for):
# rtol 5e-13 and atol 1e-12 leave two to three orders of magnitude over its ~1e-15 error for summation order.
_F64 = Tolerance(rtol=5e-13, atol=1e-12)
# float8_e4m3fn cache stores (rope_kv_write): one rounding to 3 mantissa bits, half an ulp (2**-4), and half the
# subnormal spacing (2**-10) near zero; the same on every backend (the interpreter rounds in software to match).
_FP8 = Tolerance(rtol=2.0**-4, atol=2.0**-10)
# float8_e5m2 stores (rope_kv_write caches, the prologue's float8 outputs): 2 mantissa bits, half an ulp (2**-3), and
# half the subnormal spacing (2**-16 / 2) near zero; saturated to +-57344 like e4m3 to +-448 (the reference clamps).
_FP8_E5M2 = Tolerance(rtol=2.0**-3, atol=2.0**-17)
_KERNELS = {
    torch.float64: _F64,
    torch.float32: Tolerance(rtol=1e-6, atol=5e-6),
    torch.float16: Tolerance(rtol=2.0**-11, atol=5e-6),
    torch.bfloat16: Tolerance(rtol=2.0**-8, atol=5e-6),
    torch.float8_e4m3fn: _FP8,
    torch.float8_e5m2: _FP8_E5M2,
}
TOLERANCES: dict[str, dict[torch.dtype, Tolerance]] = {
    "kernels": _KERNELS,
    "triton-interpreter": {**_KERNELS, torch.bfloat16: Tolerance(rtol=2.0**-7, atol=5e-6)},
    "cpu": {
        torch.float64: _F64,
        torch.float32: Tolerance(rtol=2.0**-24, atol=1e-6),
        torch.float16: Tolerance(rtol=2.0**-11, atol=1e-6),
        torch.bfloat16: Tolerance(rtol=2.0**-8, atol=1e-6),
        torch.float8_e4m3fn: _FP8,
        torch.float8_e5m2: _FP8_E5M2,
    },
    "float32-path": _KERNELS,
    "webgpu": {torch.float32: _KERNELS[torch.float32], torch.float16: _KERNELS[torch.float16]},
    "webgpu-shader-frequencies": {torch.float32: Tolerance(rtol=0.0, atol=1e-4)},
}


def kernel_backend() -> str:
    """The backend the Triton kernels run as in this process: ``"triton-interpreter"`` under
    ``TRITON_INTERPRET=1``, else ``"kernels"``."""
    return "triton-interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "kernels"


def tolerance(dtype: torch.dtype, backend: str | None = None) -> Tolerance:
    """The element-wise tolerance of an output of ``dtype`` computed by ``backend`` (a key of
    :data:`TOLERANCES`; default: the Triton kernels as they run here, see :func:`kernel_backend`). ``"cuda"``
    names the kernels on a GPU, as in ``ropekit check``."""
    backend = kernel_backend() if backend is None else "kernels" if backend == "cuda" else backend
    try:
        table = TOLERANCES[backend]
    except KeyError:
        raise ValueError(f"unknown backend {backend!r}; expected one of {sorted(TOLERANCES)}") from None
    try:
        return table[dtype]
    except KeyError:
        raise ValueError(f"backend {backend!r} has no tolerance for {dtype}") from None


def max_relative_tolerance(dtype: torch.dtype, backend: str | None = None) -> float:
    """The bound on :func:`max_relative_error` (``max |out - ref| / max |ref|``) that :func:`tolerance`
    implies for unit-scale inputs: ``rtol + atol / UNIT_MAX``."""
    tol = tolerance(dtype, backend)
    return tol.rtol + tol.atol / UNIT_MAX


def max_relative_error(outs: torch.Tensor | Sequence[torch.Tensor], refs: torch.Tensor | Sequence[torch.Tensor]
                       ) -> float:
    """``max |out - ref| / max |ref|`` in float64 on the reference's device, the worst over pairs of tensors; NaN
    in an output (an unwritten or poisoned element) counts as an infinite error."""
    if isinstance(outs, torch.Tensor):
        outs, refs = (outs,), (refs,)
    worst = 0.0
    for out, ref in zip(outs, refs, strict=True):
        ref = ref.detach().double()
        if ref.numel() == 0:
            continue
        diff = torch.nan_to_num((out.detach().to(ref.device).double() - ref).abs(), nan=float("inf"))
        worst = max(worst, (diff.max() / ref.abs().max().clamp_min(1e-30)).item())
    return worst


def assert_close_to_ref(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, backend: str | None = None, *,
                        tol: Tolerance | None = None) -> None:
    """``out`` has ``dtype``, no NaN, and is within ``tolerance(dtype, backend)`` (or ``tol``) of the float64
    ``ref``."""
    tol = tolerance(dtype, backend) if tol is None else tol
    assert out.dtype == dtype, (out.dtype, dtype)
    assert not torch.isnan(out).any(), "NaN in output (unwritten or invalid position)"
    torch.testing.assert_close(out.detach().cpu().to(torch.float64), ref.detach().cpu().to(torch.float64),
                               **tol._asdict())


def poisoned_like(x: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel fails to write shows up."""
    return torch.full_like(x, float("nan"))


def make_qk(B: int, S: int, HQ: int, HK: int, D: int, dtype: torch.dtype = torch.float32, device="cpu",
            layout: str = "bshd") -> tuple[torch.Tensor, torch.Tensor]:
    """Random standard-normal q ``[B, S, HQ, D]`` and k ``[B, S, HK, D]`` in ``layout`` (contiguous; ``thd``:
    ``B * S`` tokens), drawn in float64 and rounded once to ``dtype``."""
    def one(h: int) -> torch.Tensor:
        x = torch.randn(B, S, h, D, dtype=torch.float64)
        if layout == "thd":
            x = x.reshape(B * S, h, D)
        elif layout == "bhsd":
            x = x.permute(0, 2, 1, 3).contiguous()
        elif layout == "sbhd":
            x = x.permute(1, 0, 2, 3).contiguous()
        return x.to(dtype=dtype, device=device)
    return one(HQ), one(HK)
