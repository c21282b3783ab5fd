"""The transformers drop-in against transformers' own ``apply_rotary_pos_emb`` (on CPU, and on CUDA marked ``gpu``),
on the kernels with launch plans, and under torch.compile."""

import pytest
import torch

from helpers import KERNEL_ROUTES, on_route
from ropekit.integrations.transformers import apply_rotary_pos_emb
from ropekit.testing import assert_close_to_ref

modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
hf_apply = modeling_llama.apply_rotary_pos_emb

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _inputs(B, HQ, HK, S, D, dtype, table_dtype, unsqueeze_dim, device, table_batch=None):
    q = torch.randn(B, HQ, S, D, dtype=dtype, device=device)
    k = torch.randn(B, HK, S, D, dtype=dtype, device=device)
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, S, H, D] views, as many models produce them
    half = torch.rand(table_batch or B, S, D // 2, dtype=torch.float64, device=device) * 1000
    angles = torch.cat([half, half], dim=-1)
    return q, k, angles.cos().to(table_dtype), angles.sin().to(table_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,table_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_matches_transformers_in_fp32_and_is_at_least_as_accurate(device, dtype, table_dtype, unsqueeze_dim):
    q, k, cos, sin = _inputs(2, 8, 2, 12, 64, dtype, table_dtype, unsqueeze_dim, device)
    got_q, got_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    hf_q, hf_k = hf_apply(q, k, cos, sin, unsqueeze_dim)
    exact_q, exact_k = hf_apply(q.double(), k.double(), cos.double(), sin.double(), unsqueeze_dim)
    assert got_q.dtype == hf_q.dtype and got_k.dtype == hf_k.dtype
    assert got_q.shape == hf_q.shape and got_k.shape == hf_k.shape
    for got, hf, exact in ((got_q, hf_q, exact_q), (got_k, hf_k, exact_k)):
        err = (got.double() - exact).abs().max().item()
        hf_err = (hf.double() - exact).abs().max().item()
        if got.dtype == torch.float32:
            assert err <= 1e-5
        else:
            eps = torch.finfo(got.dtype).eps
            assert err <= eps * exact.abs().max().item()  # one rounding
            assert err <= hf_err + 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_match_transformers(device):
    q, k, cos, sin = _inputs(2, 4, 2, 7, 32, torch.float32, torch.float32, 1, device, table_batch=1)
    q1, k1 = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    q2, k2 = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    torch.autograd.backward(apply_rotary_pos_emb(q1, k1, cos, sin), (gq, gk))
    torch.autograd.backward(hf_apply(q2, k2, cos, sin), (gq, gk))
    torch.testing.assert_close(q1.grad, q2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k1.grad, k2.grad, rtol=1e-5, atol=1e-5)


def test_compiled_drop_in_equals_the_eager_call(monkeypatch):
    """torch.compile(fullgraph=True) of the drop-in, as a compiled model calls it, traced through ropekit's
    rotation (not the fallback formula): on CPU the compiled graph runs the registered op through the float64 path
    as eager calls do, so outputs and gradients equal the eager call's exactly, over two calls with fresh data
    through the same graph; and the outputs are transformers' formula in float64 within fp32 rounding."""
    from ropekit.integrations import transformers as dropin

    traced = []
    original = dropin.apply_rope
    monkeypatch.setattr(dropin, "apply_rope", lambda *args, **kwargs: traced.append(1) or original(*args, **kwargs))
    torch._dynamo.reset()
    compiled = torch.compile(apply_rotary_pos_emb, fullgraph=True)
    for _call in range(2):
        q, k, cos, sin = _inputs(2, 4, 2, 7, 32, torch.float32, torch.float32, 1, "cpu")
        q.requires_grad_(True)
        k.requires_grad_(True)
        out = compiled(q, k, cos, sin)
        grads = [torch.randn_like(o) for o in out]
        got = (*out, *torch.autograd.grad(out, (q, k), grads))
        eager = apply_rotary_pos_emb(q, k, cos, sin)
        want = (*eager, *torch.autograd.grad(eager, (q, k), grads))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        exact = hf_apply(q.detach().double(), k.detach().double(), cos.double(), sin.double())
        for g, w in zip(out, exact):
            assert (g.double() - w).abs().max().item() <= 1e-5
    assert traced


@pytest.mark.parametrize("route", KERNEL_ROUTES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_kernels_and_plans_equal_transformers_in_float64(route, unsqueeze_dim, plan_calls):
    """The drop-in on the kernels (the interpreter on CPU, CUDA), four calls with fresh q, k and tables: the first
    notes the signature, the second records a launch plan, which serves the last two. Outputs and gradients equal
    transformers' formula in float64 within the kernels' tolerance."""
    with on_route(route, clear_plans=True) as device:
        for _call in range(4):
            q, k, cos, sin = _inputs(2, 4, 2, 7, 32, torch.float32, torch.float32, unsqueeze_dim, device)
            q.requires_grad_(True)
            k.requires_grad_(True)
            out = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
            grads = [torch.randn_like(o) for o in out]
            got = (*out, *torch.autograd.grad(out, (q, k), grads))
            leaves = [x.detach().cpu().double().requires_grad_(True) for x in (q, k)]
            ref = hf_apply(*leaves, cos.cpu().double(), sin.cpu().double(), unsqueeze_dim)
            want = (*ref, *torch.autograd.grad(ref, leaves, [g.cpu().double() for g in grads]))
            for g, w in zip(got, want):
                assert_close_to_ref(g, w, torch.float32)
    assert plan_calls["served"] >= 2


def test_bf16_gradient_dtype_with_fp32_tables():
    q, k, cos, sin = _inputs(1, 4, 2, 5, 32, torch.bfloat16, torch.float32, 1, "cpu")
    q.requires_grad_(True)
    out_q, _ = apply_rotary_pos_emb(q, k, cos, sin)
    assert out_q.dtype == torch.float32
    out_q.sum().backward()
    assert q.grad.dtype == torch.bfloat16


def test_two_dim_tables_and_decode():
    # [S, D] tables with a single decode token broadcast over batch and heads.
    q, k, cos, sin = _inputs(3, 4, 2, 1, 16, torch.float32, torch.float32, 1, "cpu", table_batch=1)
    got = apply_rotary_pos_emb(q, k, cos[0], sin[0])
    want = hf_apply(q, k, cos[0], sin[0])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_tables_requiring_grad_fall_back_to_the_exact_formula():
    q, k, cos, sin = _inputs(1, 2, 1, 4, 8, torch.float64, torch.float64, 1, "cpu")
    cos.requires_grad_(True)
    got_q, _ = apply_rotary_pos_emb(q, k, cos, sin)
    got_q.sum().backward()
    cos2 = cos.detach().clone().requires_grad_(True)
    hf_apply(q, k, cos2, sin)[0].sum().backward()
    torch.testing.assert_close(cos.grad, cos2.grad)


def test_unequal_halves_follow_transformers_exactly():
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    k = torch.randn(1, 1, 3, 8, dtype=torch.float64)
    cos, sin = torch.randn(1, 3, 8, dtype=torch.float64), torch.randn(1, 3, 8, dtype=torch.float64)
    for got, want in zip(apply_rotary_pos_emb(q, k, cos, sin), hf_apply(q, k, cos, sin)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_multimodal_drop_in_names_a_bad_mrope_section():
    from ropekit.integrations.transformers import apply_multimodal_rotary_pos_emb

    q, k = torch.randn(1, 2, 3, 16), torch.randn(1, 1, 3, 16)
    cos, sin = torch.randn(3, 1, 3, 16), torch.randn(3, 1, 3, 16)
    with pytest.raises(ValueError, match=r"mrope_section \[2, 3, 4\] .* sum to 8 \(half the table width 16\), got 9"):
        apply_multimodal_rotary_pos_emb(q, k, cos, sin, [2, 3, 4])
    for bad in (None, 3, [2.0, 3, 3], [2, True, 5], "233"):
        with pytest.raises(TypeError, match="mrope_section"):
            apply_multimodal_rotary_pos_emb(q, k, cos, sin, bad)
