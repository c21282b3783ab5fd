"""Shared test helpers: tolerances per dtype, random inputs, poisoned outputs, reference comparison."""

from __future__ import annotations

import os

import torch

from ropekit._spec import to_canonical

# |out - ref| <= atol + rtol * |ref| against a float64 reference. rtol is half an ulp of the output dtype (one
# rounding at the store); atol covers fp32 math and fp32 sin/cos (~1e-6 of the output scale).
TOLERANCES = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-6, atol=1e-5),
    torch.float16: dict(rtol=2.0**-11, atol=1e-5),
    torch.bfloat16: dict(rtol=2.0**-8, atol=1e-5),
}
# The Triton CPU interpreter converts fp32 -> bf16 by truncation (round toward zero; compiled kernels round to
# nearest even), so kernel outputs under the interpreter are allowed one bf16 ulp instead of half.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    TOLERANCES[torch.bfloat16] = dict(rtol=2.0**-7, atol=1e-5)

# The float64 CPU path rounds float64 math once: reference-level agreement.
CPU_TOLERANCES = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-6, atol=1e-6),
    torch.float16: dict(rtol=2.0**-11, atol=1e-6),
    torch.bfloat16: dict(rtol=2.0**-8, atol=1e-6),
}

LAYOUT_DIMS = {"bshd": "bshd", "bhsd": "bhsd", "sbhd": "sbhd"}


def make_qk(B: int, S: int, HQ: int, HK: int, D: int, dtype=torch.float32, device="cpu", layout="bshd"):
    """Random q, k in ``layout`` (thd: B*S tokens)."""
    def one(h):
        x = torch.randn(B, S, h, D, dtype=torch.float64)
        if layout == "thd":
            x = x.reshape(B * S, h, D)
        elif layout == "bhsd":
            x = x.permute(0, 2, 1, 3).contiguous()
        elif layout == "sbhd":
            x = x.permute(1, 0, 2, 3).contiguous()
        return x.to(dtype=dtype, device=device)
    return one(HQ), one(HK)


def poisoned_like(x: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel fails to write shows up."""
    return torch.full_like(x, float("nan"))


def assert_close_to_ref(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, tol=None) -> None:
    tol = (tol or TOLERANCES)[dtype]
    assert out.dtype == dtype, (out.dtype, dtype)
    assert not torch.isnan(out).any(), "NaN in output (unwritten or invalid position)"
    torch.testing.assert_close(out.detach().cpu().to(torch.float64), ref.cpu().to(torch.float64), **tol)


def canonical(x, layout):
    return to_canonical(x, layout)
