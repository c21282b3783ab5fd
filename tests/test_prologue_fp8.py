"""float8_e4m3fn caches on the kernel routes (the Triton interpreter on CPU, CUDA): NaN in k or v is stored as NaN,
as torch's conversion stores it, never as a number (the interpreter's own conversion turns NaN into 384)."""

from __future__ import annotations

import pytest
import torch

import ropekit
from helpers import KERNEL_ROUTES, route_context, route_device

FP8 = torch.float8_e4m3fn
HQ, HK, D, ROWS = 2, 1, 8, 8


def _poisoned(shape, device="cpu"):
    """A float8 cache full of e4m3fn's NaN byte."""
    return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(FP8)


@pytest.mark.parametrize("route", KERNEL_ROUTES)
@pytest.mark.parametrize("cache_layout", ["bshd", "paged"])
def test_fp8_caches_store_nan_as_nan(route, cache_layout):
    """NaN in k or v goes into a float8_e4m3fn cache as NaN, as torch's conversion stores it (not as a number); the
    other values as the float64 path stores them (within one e4m3 rounding)."""
    device = route_device(route)
    q, k, v = (torch.randn(3, h, D, device=device) for h in (HQ, HK, HK))
    k[0, 0, 3] = v[1, 0, 5] = v[2, 0, 0] = float("nan")
    positions, slots = torch.tensor([1, 2, 3]), torch.tensor([2, 9, 30])
    extra = dict(cache_layout="paged") if cache_layout == "paged" else {}

    def rows(cache):
        if cache_layout == "paged":
            return cache.view(-1, HK, D)[slots.to(cache.device)].float().cpu()
        return cache[torch.arange(3), positions].float().cpu()

    got = [_poisoned((4, ROWS, HK, D), device) for _ in range(2)]
    want = [_poisoned((4, ROWS, HK, D)) for _ in range(2)]
    with torch.no_grad():
        with route_context(route):
            ropekit.rope_kv_write(q, k, v, *got, positions=positions.to(device), **extra,
                                  **({"slot_mapping": slots.to(device)} if extra else {}))
        ropekit.rope_kv_write(q.cpu(), k.cpu(), v.cpu(), *want, positions=positions, **extra,
                              **({"slot_mapping": slots} if extra else {}))
    for g, w in zip(got, want):
        g, w = rows(g), rows(w)
        assert torch.equal(torch.isnan(g), torch.isnan(w))
        torch.testing.assert_close(g, w, rtol=2.0**-3, atol=2.0**-9, equal_nan=True)
    k_rows, v_rows = rows(got[0]), rows(got[1])
    assert torch.isnan(k_rows[0, 0, 3]) and torch.isnan(k_rows).sum() == 2  # k's NaN and its pair's rotation
    assert torch.isnan(v_rows[1, 0, 5]) and torch.isnan(v_rows[2, 0, 0]) and torch.isnan(v_rows).sum() == 2
