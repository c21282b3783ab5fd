"""Helpers for testing code that uses ropekit, and ropekit itself, on machines without a GPU.

:func:`kernels_on_cpu` runs ropekit's CUDA dispatch -- the Triton kernels, their launcher and the eager fast
path of cached launch plans -- on CPU tensors through the Triton interpreter, so that a CPU-only CI checks the
same code a GPU runs (slowly: keep shapes small).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from ropekit import _config, _fastpath


@contextlib.contextmanager
def kernels_on_cpu() -> Iterator[None]:
    """Within the block, CPU tensors (except float64, which keeps the float64 reference) are rotated by the
    Triton kernels under the interpreter, with launch plans from the second call of a signature on, and with
    the semantics of device tensors: position values are not read on the host, invalid positions give NaN.

    Needs ``TRITON_INTERPRET=1`` in the environment before triton is first imported."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("kernels_on_cpu needs TRITON_INTERPRET=1 set before triton is imported")
    previous = _config.kernels_on_cpu
    _config.kernels_on_cpu = True
    try:
        yield
    finally:
        _config.kernels_on_cpu = previous
        _fastpath.clear()
