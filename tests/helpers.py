"""The test helpers live in :mod:`ropekit.testing`; this keeps ``from helpers import assert_close_to_ref`` working
for the tests that still import it with a ``{dtype: dict(rtol, atol)}`` table of their own."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ropekit import testing


def assert_close_to_ref(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
                        backend: str | Mapping | None = None) -> None:
    """:func:`ropekit.testing.assert_close_to_ref`; ``backend`` may also be a ``{dtype: dict(rtol, atol)}`` table."""
    if isinstance(backend, Mapping):
        testing.assert_close_to_ref(out, ref, dtype, tol=testing.Tolerance(**backend[dtype]))
    else:
        testing.assert_close_to_ref(out, ref, dtype, backend)
