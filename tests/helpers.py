"""The test helpers live in :mod:`ropekit.testing`; this keeps ``from helpers import assert_close_to_ref`` working
for the tests that still import it with a ``{dtype: dict(rtol, atol)}`` table of their own."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

import pytest
import torch

from ropekit import testing


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
