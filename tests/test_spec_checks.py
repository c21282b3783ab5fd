"""Validation of apply_rope's arguments (ropekit._spec): position checks that cannot be fooled by int64
wrap-around.

Routes: "cpu" (the float64 path; CPU tensors are host values) and "cpu-kernels" (the kernels under the Triton
interpreter, launch plans included, with the semantics of device tensors)."""

from __future__ import annotations

import pytest
import torch

import ropekit
from helpers import ROUTES, route_context, route_device

ROUTES2 = ROUTES[:2]  # cpu, cpu-kernels (CUDA: see ROUTES)


# --- wrap-around ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("route", ROUTES2)
@pytest.mark.parametrize("offset", [2**63 - 2, 2**63 - 1, 2**62 + 5])
@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd-cu_seqlens"])
def test_offsets_near_int64_max_raise(route, offset, packed):
    """Per-sequence offsets whose offset + S - 1 passes 2**63 - 1 (and wraps around in int64) raise ValueError
    naming positions where the values are read (CPU tensors; check_positions=True on the kernel route)."""
    device = route_device(route)
    check = dict(check_positions=True) if route == "cpu-kernels" else {}
    if packed:
        q = torch.randn(7, 2, 16, device=device)
        kw = dict(layout="thd", cu_seqlens=torch.tensor([0, 3, 7], device=device))
    else:
        q, kw = torch.randn(2, 4, 2, 16, device=device), {}
    with route_context(route), pytest.raises(ValueError, match="positions"):
        ropekit.apply_rope(q, positions=torch.tensor([0, offset], device=device), **kw, **check)
