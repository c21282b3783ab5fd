"""What several test files share: the routes a test runs on, float64 oracles, and ``assert_close_to_ref`` taking a
``{dtype: dict(rtol, atol)}`` table (the general helpers live in :mod:`ropekit.testing`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

import pytest
import torch

from ropekit import testing
from ropekit._spec import BACKWARD, FORWARD
from ropekit._validation import validate
from ropekit.reference import rope_reference


def assert_close_to_ref(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
                        backend: str | Mapping | None = None) -> None:
    """:func:`ropekit.testing.assert_close_to_ref`; ``backend`` may also be a ``{dtype: dict(rtol, atol)}`` table."""
    if isinstance(backend, Mapping):
        testing.assert_close_to_ref(out, ref, dtype, tol=testing.Tolerance(**backend[dtype]))
    else:
        testing.assert_close_to_ref(out, ref, dtype, backend)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The three routes a prologue test runs on: plain CPU tensors (the float64 torch path), CPU tensors through the
# Triton kernels under the interpreter (ropekit.testing.kernels_on_cpu), and CUDA.
ROUTES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cpu-kernels", id="cpu-kernels",
                 marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
KERNEL_ROUTES = ROUTES[1:]


def route_context(route: str):
    """The context a route runs in: ``kernels_on_cpu()`` for "cpu-kernels", else nothing."""
    return testing.kernels_on_cpu() if route == "cpu-kernels" else contextlib.nullcontext()


def route_device(route: str) -> str:
    return "cuda" if route == "cuda" else "cpu"


def reference_rope(q, k, conjugate=False, **kwargs):
    """The float64 reference of ``apply_rope(q, k, **kwargs)`` (of ``rope_backward`` with ``conjugate``)."""
    spec = validate(q, k, **kwargs, mode=BACKWARD if conjugate else FORWARD)
    return rope_reference(q, k, spec._replace(out_dtype=torch.float64))
