"""The float32 torch path of CPU float16/bfloat16/float32 tensors and of devices without Triton kernels or float64
(MPS, XPU, ...), forced on CPU tensors:
every option, in and out of place, forward, backward and autograd, equal to the float64 reference within the
kernels' precision (angles exact on the host, fp32 math, one rounding)."""

from __future__ import annotations

import pytest
import torch

import ropekit
from ropekit import ops
from ropekit.testing import assert_close_to_ref, float32_path_on_cpu, make_qk, reference_on_cpu

B, S, HQ, HK, D = 2, 7, 4, 2, 32
CASES = {
    "range-neox": dict(),
    "offset-interleaved": dict(positions=1 << 20, style="interleaved"),
    "per-seq-offsets": dict(positions=torch.tensor([3, 90_000])),
    "per-token-ids": dict(positions=torch.randint(0, 1 << 24, (B, S))),
    "inv-freq-partial-back": dict(inv_freq=torch.rand(8) + 0.01, rotary_at="back", q_scale=0.5, k_scale=2.0),
    "tables-full-width": dict(positions=5, cos=torch.rand(64, D), sin=torch.rand(64, D), rotary_scale=1.5),
    "angles-per-token": dict(angles=torch.rand(1, S, D // 2) * 1000),
    "bhsd-base": dict(layout="bhsd", base=500000.0),
}


def _qk(kwargs, dtype):
    q, k = make_qk(B, S, HQ, HK, D, dtype=dtype)
    if kwargs.get("layout") == "bhsd":
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    return q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_path_matches_reference(case, dtype):
    kwargs = CASES[case]
    q, k = _qk(kwargs, dtype)
    want_q, want_k = ropekit.apply_rope(q.double(), k.double(), **kwargs)
    want_bq = ropekit.rope_backward(q.double(), **kwargs)
    with float32_path_on_cpu():
        assert ops.uses_float32_path(q) and not ops.uses_float32_path(q.double())
        got_q, got_k = ropekit.apply_rope(q, k, **kwargs)
        assert_close_to_ref(got_q, want_q, dtype, backend="float32-path")
        assert_close_to_ref(got_k, want_k, dtype, backend="float32-path")
        assert_close_to_ref(ropekit.rope_backward(q, **kwargs), want_bq, dtype, backend="float32-path")
        qi, ki = q.clone(), k.clone()
        ropekit.apply_rope_(qi, ki, **kwargs)
        assert_close_to_ref(qi, want_q, dtype, backend="float32-path")
        leaf = q.clone().requires_grad_(True)
        g = torch.randn_like(q)
        (dq,) = torch.autograd.grad(ropekit.apply_rope(leaf, **kwargs), leaf, g)
        assert_close_to_ref(dq, ropekit.rope_backward(g.double(), **kwargs), dtype, backend="float32-path")


def test_float32_path_is_float32_math_not_float64():
    """The switches really change the path: float32 math differs from the float64 reference in the last bits;
    float32_path_on_cpu wins over reference_on_cpu."""
    q, _ = make_qk(B, 64, HQ, HK, D)
    with reference_on_cpu():
        want = ropekit.apply_rope(q, positions=12345)
        with float32_path_on_cpu():
            got = ropekit.apply_rope(q, positions=12345)
    assert not torch.equal(got, want)
    assert torch.equal(ropekit.apply_rope(q, positions=12345), got)  # the CPU default
    assert_close_to_ref(got, ropekit.apply_rope(q.double(), positions=12345), torch.float32, backend="float32-path")


def test_invalid_device_positions_give_nan_tokens():
    """As on the kernels: a position past a table marks its token NaN (values are not read on the host here)."""
    q, _ = make_qk(1, 4, 2, 1, 16)
    with float32_path_on_cpu():
        from ropekit._validation import validate
        from ropekit.float32_path import rope_float32

        spec = validate(q, None, positions=torch.tensor([[0, 1, 2, 3]]), cos=torch.rand(8, 8), sin=torch.rand(8, 8))
        spec.positions[0, 2] = 100
        (out,) = rope_float32(q, None, spec)
    assert torch.isnan(out[0, 2]).all() and not torch.isnan(out[0, [0, 1, 3]]).any()
