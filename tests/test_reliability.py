"""Regression tests for the ways ropekit broke in real loops: training steps past the first, in-place calls and
autograd, overlapping memory, silent precision loss, and caches that grow without bound.

Most run three ways: the CPU float64 path, the CUDA dispatch on CPU under the Triton interpreter
(``kernels_on_cpu``: kernels and launch plans), and CUDA itself.
"""

from __future__ import annotations

import contextlib
import functools
import math

import pytest
import torch

import ropekit
from helpers import ROUTES, route_context, route_device
from ropekit import _fastpath

MODES = ROUTES


@contextlib.contextmanager
def mode_context(mode: str):
    _fastpath.clear()
    with route_context(mode):
        yield route_device(mode)


def _rope64(x, positions, base=10000.0):
    """Independent float64 RoPE on [B, S, H, D] (rotate_half form) for gradient oracles."""
    D = x.shape[-1]
    inv = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = positions.to(torch.float64)[..., None] * inv  # [B, S, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, :, None], torch.cat([ang.sin()] * 2, -1)[:, :, None]
    half = D // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


# ------------------------------------------------------------------------------------------- training loops

LOSSES = {
    "qk-transposed": lambda q, k: (q @ k.transpose(-2, -1)).sum(),
    "sum": lambda q, k: q.sum() + k.sum(),  # gradients expanded with stride 0
    "sliced": lambda q, k: q[:, ::2].pow(2).mean() + k[..., 1:3].sum(),
    "softmax-attention": lambda q, k: torch.softmax(q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2), -1)
    .pow(2).sum(),
}


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("mode", MODES)
def test_training_steps_past_the_first(mode, loss):
    with mode_context(mode) as device:
        B, S, H, D = 2, 6, 2, 16
        positions = torch.randint(0, 1000, (B, S))
        for _step in range(4):  # plans engage from the second call; the bug was at step 2
            q = torch.randn(B, S, H, D, dtype=torch.float64)
            k = torch.randn(B, S, H, D, dtype=torch.float64)
            q_d = q.to(device, torch.float32).requires_grad_(True)
            k_d = k.to(device, torch.float32).requires_grad_(True)
            qr, kr = ropekit.apply_rope(q_d, k_d, positions=positions.to(device))
            LOSSES[loss](qr, kr).backward()
            q64, k64 = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
            LOSSES[loss](_rope64(q64, positions), _rope64(k64, positions)).backward()
            torch.testing.assert_close(q_d.grad.cpu().double(), q64.grad, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(k_d.grad.cpu().double(), k64.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_transformers_drop_in_then_eager_attention_for_several_steps(mode):
    from ropekit.integrations.transformers import apply_rotary_pos_emb

    with mode_context(mode) as device:
        B, H, S, D = 2, 2, 5, 16
        positions = torch.arange(S).expand(B, S)
        inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        emb = torch.cat([positions[..., None] * inv] * 2, -1)
        cos, sin = emb.cos().float().to(device), emb.sin().float().to(device)
        for _step in range(3):
            qkv = torch.randn(B, S, 3, H, D, dtype=torch.float64)
            x = qkv.to(device, torch.float32).requires_grad_(True)
            q, k = x[:, :, 0].transpose(1, 2), x[:, :, 1].transpose(1, 2)  # HF's [B, H, S, D] views
            qr, kr = apply_rotary_pos_emb(q, k, cos, sin)
            torch.softmax(qr @ kr.transpose(-1, -2) / math.sqrt(D), -1).sum(-1).pow(2).sum().backward()
            x64 = qkv.clone().requires_grad_(True)
            q64, k64 = _rope64(x64[:, :, 0], positions), _rope64(x64[:, :, 1], positions)
            q64, k64 = q64.transpose(1, 2), k64.transpose(1, 2)
            torch.softmax(q64 @ k64.transpose(-1, -2) / math.sqrt(D), -1).sum(-1).pow(2).sum().backward()
            torch.testing.assert_close(x.grad.cpu().double(), x64.grad, rtol=1e-5, atol=1e-5)


def _norm_rope64(x, weight, positions, eps=1e-6, weight_offset=0.0):
    """Independent float64 per-head RMSNorm then RoPE, from the definitions."""
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight + weight_offset)
    return _rope64(xn, positions)


def _gradient_penalty(rope, q, k, wq, wk, vq, vk):
    """Backward of the squared gradients of <rope(q, k), (vq, vk)> w.r.t. q, k and the weights (a double backward)."""
    q_out, k_out = rope(q, k, wq, wk)
    loss = (q_out * vq.to(q_out)).sum() + (k_out * vk.to(k_out)).sum()
    grads = torch.autograd.grad(loss, (q, k, wq, wk), create_graph=True)
    sum(g.pow(2).sum() for g in grads).backward()


@pytest.mark.parametrize("mode", MODES)
def test_qk_norm_rope_double_backward(mode):
    """Gradient of a gradient (a gradient penalty's pattern, ``create_graph=True``): qk_norm_rope's backward is
    differentiable in the incoming gradients, the inputs and the weights, as apply_rope's is; compared with the
    float64 definition, on every route, called three times with fresh data (the fast path records a plan)."""
    with mode_context(mode) as device:
        for _call in range(3):
            B, S, D = 2, 4, 8
            q64, k64 = torch.randn(B, S, 2, D, dtype=torch.float64), torch.randn(B, S, 1, D, dtype=torch.float64)
            wq64, wk64 = torch.rand(D, dtype=torch.float64) + 0.5, torch.rand(D, dtype=torch.float64) + 0.5
            vq, vk = torch.randn_like(q64), torch.randn_like(k64)
            positions = torch.randint(0, 100, (B, S))
            want = [t.clone().requires_grad_(True) for t in (q64, k64, wq64, wk64)]
            _gradient_penalty(functools.partial(_norm_rope_pair64, positions=positions), *want, vq, vk)
            got = [t.float().to(device).requires_grad_(True) for t in (q64, k64, wq64, wk64)]
            _gradient_penalty(functools.partial(ropekit.qk_norm_rope, positions=positions.to(device)), *got, vq, vk)
            for g, w in zip(got, want):
                torch.testing.assert_close(g.grad.cpu().double(), w.grad, rtol=1e-4, atol=1e-4)


def _norm_rope_pair64(q, k, wq, wk, positions):
    return _norm_rope64(q, wq, positions), _norm_rope64(k, wk, positions)


def test_qk_norm_rope_gradgradcheck_float64():
    q = torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 1, 8, dtype=torch.float64, requires_grad=True)
    wq = torch.rand(8, dtype=torch.float64, requires_grad=True)
    wk = torch.rand(8, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([[1, 5, 9]])

    def f(q, k, wq, wk):
        return ropekit.qk_norm_rope(q, k, wq, wk, positions=positions, q_scale=0.5, weight_offset=1.0)

    assert torch.autograd.gradgradcheck(f, (q, k, wq, wk))


# ------------------------------------------------------------------------------------------- in place

@pytest.mark.parametrize("mode", MODES)
def test_in_place_rotation_is_visible_to_autograd(mode):
    with mode_context(mode) as device:
        for _call in range(3):  # the full path, then plans
            q = torch.randn(1, 4, 2, 8, device=device)
            w = torch.randn(1, 4, 2, 8, device=device, requires_grad=True)
            z = (q * w).sum()  # saves q for w's gradient
            version = q._version
            ropekit.apply_rope_(q, positions=3)
            assert q._version > version
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                z.backward()


def _packed(device, B=2, S=4, H=2, D=8):
    return torch.randn(B, S, 3, H, D, device=device)


IN_PLACE_REFUSALS = {
    "k expanded": (lambda d: (torch.randn(1, 4, 2, 8, device=d), torch.randn(1, 1, 1, 8, device=d).expand(1, 4, 2, 8)),
                   ValueError, "k cannot be rotated in place"),
    "k as_strided onto itself": (lambda d: (torch.randn(1, 4, 2, 8, device=d),
                                            torch.randn(64, device=d).as_strided((1, 4, 2, 8), (0, 8, 4, 1))),
                                 ValueError, "k cannot be rotated in place"),
    "q is k": (lambda d: (lambda x: (x, x))(torch.randn(1, 4, 2, 8, device=d)), ValueError, "share memory"),
    "overlapping views": (lambda d: (lambda p: (p[:, :, 0:2].reshape(2, 4, 4, 8)[:, :, :2],
                                                p[:, :, 0:2].reshape(2, 4, 4, 8)[:, :, 1:3]))(_packed(d)),
                          ValueError, "share memory"),
}


@pytest.mark.parametrize("case", IN_PLACE_REFUSALS)
@pytest.mark.parametrize("mode", MODES)
def test_in_place_refuses_overlap_before_writing(mode, case):
    make, exc, match = IN_PLACE_REFUSALS[case]
    with mode_context(mode) as device:
        for _call in range(2):
            q, k = make(device)
            q_before, k_before = q.clone(), k.clone()
            with pytest.raises(exc, match=match):
                ropekit.apply_rope_(q, k, positions=5)
            assert torch.equal(q, q_before) and torch.equal(k, k_before)


@pytest.mark.parametrize("mode", MODES)
def test_in_place_refuses_inference_tensor_outside_inference_mode(mode):
    with mode_context(mode) as device:
        q = torch.randn(1, 4, 2, 8, device=device)
        with torch.inference_mode():
            k = torch.randn(1, 4, 2, 8, device=device)
        q_before = q.clone()
        with pytest.raises(RuntimeError, match="inference tensor"):
            ropekit.apply_rope_(q, k)
        assert torch.equal(q, q_before)
        with torch.inference_mode():  # inside inference mode it is allowed
            ropekit.apply_rope_(q, k)


@pytest.mark.parametrize("mode", MODES)
def test_in_place_on_packed_qkv_views_repeatedly(mode):
    """flash-attention's pattern: q and k interleaved in one buffer; no copies, every call right."""
    with mode_context(mode) as device:
        for call in range(3):
            qkv = _packed(device)
            want_q, want_k = ropekit.apply_rope(qkv[:, :, 0], qkv[:, :, 1], positions=call)
            v_before = qkv[:, :, 2].clone()
            q, k = ropekit.apply_rope_(qkv[:, :, 0], qkv[:, :, 1], positions=call)
            assert q.data_ptr() == qkv[:, :, 0].data_ptr()
            torch.testing.assert_close(qkv[:, :, 0], want_q, rtol=0, atol=0)
            torch.testing.assert_close(qkv[:, :, 1], want_k, rtol=0, atol=0)
            assert torch.equal(qkv[:, :, 2], v_before)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", MODES)
def test_in_place_with_autograd_on_packed_views(mode, compiled):
    if compiled and mode == "cpu-kernels":
        pytest.skip("torch.compile traces Triton calls on CUDA only (the CPU interpreter cannot be traced)")

    def step(qkv_leaf, positions):
        qkv = qkv_leaf * 1.0  # non-leaf, as a projection's output
        ropekit.apply_rope_(qkv[:, :, 0], qkv[:, :, 1], positions=positions)
        return (qkv[:, :, 0] * qkv[:, :, 1]).sum() + qkv[:, :, 0].pow(2).sum()

    with mode_context(mode) as device:
        fn = torch.compile(step, backend="aot_eager", fullgraph=True) if compiled else step
        for _call in range(3):
            base = _packed(device)
            positions = torch.randint(0, 100, (2, 4), device=device)
            leaf = base.clone().requires_grad_(True)
            fn(leaf, positions).backward()
            x64 = base.cpu().double().requires_grad_(True)
            p = positions.cpu()
            q64, k64 = _rope64(x64[:, :, 0], p), _rope64(x64[:, :, 1], p)
            ((q64 * k64).sum() + q64.pow(2).sum()).backward()
            torch.testing.assert_close(leaf.grad.cpu().double(), x64.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("mode", MODES[:1] + MODES[2:])
def test_compiled_in_place_rotation_of_a_packed_qkv_input(mode, dynamic):
    """flash-attention's ``test_rotary_emb_qkv`` pattern under inductor: a non-leaf packed QKV buffer that requires
    grad is passed into the compiled function, which rotates its q and k views in place and returns the buffer
    (an input mutation); static and dynamic shapes (symbolic strides reach the in-place overlap check), called
    with fresh data and a new sequence length. The gradient is the float64 rotation's."""
    def f(qkv, positions):
        ropekit.apply_rope_(qkv[:, :, 0], qkv[:, :, 1], positions=positions)
        return qkv

    with mode_context(mode) as device:
        torch._dynamo.reset()
        fn = torch.compile(f, fullgraph=True, dynamic=dynamic)
        for S in (4, 4, 6):
            base = _packed(device, S=S)
            positions = torch.randint(0, 100, (2, S), device=device)
            leaf = base.clone().requires_grad_(True)
            weight = torch.randn_like(base)
            (fn(leaf * 1.0, positions) * weight).sum().backward()
            x64 = base.cpu().double().requires_grad_(True)
            p = positions.cpu()
            out64 = torch.stack([_rope64(x64[:, :, 0], p), _rope64(x64[:, :, 1], p), x64[:, :, 2]], dim=2)
            (out64 * weight.cpu().double()).sum().backward()
            torch.testing.assert_close(leaf.grad.cpu().double(), x64.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES[:1] + MODES[2:])
def test_compiled_in_place_rotation_of_an_input_keeps_its_gradient(mode):
    """A compiled function that rotates its input in place: the backward must include the rotation."""
    with mode_context(mode) as device:
        def f(x):
            ropekit.apply_rope_(x, positions=7)
            return x

        leaf = torch.randn(1, 3, 2, 8, device=device, requires_grad=True)
        for backend in ("aot_eager", "inductor"):
            leaf.grad = None
            torch._dynamo.reset()
            torch.compile(f, backend=backend, fullgraph=True)(leaf * 2.0).pow(2).sum().backward()
            x64 = leaf.detach().cpu().double().requires_grad_(True)
            _rope64(x64 * 2.0, torch.arange(7, 10).expand(1, 3)).pow(2).sum().backward()
            torch.testing.assert_close(leaf.grad.cpu().double(), x64.grad, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- inputs

@pytest.mark.gpu
def test_float64_on_cuda_is_computed_in_float64():
    q, k = torch.randn(2, 5, 3, 16, dtype=torch.float64), torch.randn(2, 5, 1, 16, dtype=torch.float64)
    ids = torch.randint(0, 1 << 20, (2, 5))
    want = ropekit.apply_rope(q, k, positions=ids)
    for _ in range(2):
        got = ropekit.apply_rope(q.cuda(), k.cuda(), positions=ids.cuda())
        for g, w in zip(got, want):
            assert g.dtype == torch.float64
            torch.testing.assert_close(g.cpu(), w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_empty_packed_sequence_may_have_any_offset(mode):
    with mode_context(mode) as device:
        q = torch.randn(1, 2, 8, device=device)
        table = torch.randn(6, 4, device=device)
        cu = torch.tensor([0, 1, 1], device=device)
        out = ropekit.apply_rope(q, positions=torch.tensor([2, 100], device=device), cos=table, sin=table,
                                 layout="thd", cu_seqlens=cu)
        want = ropekit.apply_rope(q.cpu(), positions=2, cos=table.cpu(), sin=table.cpu(), layout="thd")
        torch.testing.assert_close(out.cpu(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_device_positions_past_the_largest_become_nan(mode):
    """Values the host cannot read without a sync: the kernel marks the tokens NaN (never a wrong number)."""
    if mode == "cpu":
        pytest.skip("CPU position tensors are read on the host and raise (tests/test_api.py)")
    with mode_context(mode) as device:
        q = torch.randn(1, 4, 2, 8, device=device)
        ids = torch.tensor([[0, 2**31 - 1, 2**31, 2**62]], device=device)
        out = ropekit.apply_rope(q, positions=ids)
        assert not out[0, :2].isnan().any() and out[0, 2:].isnan().all()


@pytest.mark.parametrize("mode", MODES)
def test_unhashable_argument_gets_the_validation_error_on_every_call(mode):
    with mode_context(mode) as device:
        q = torch.randn(1, 4, 2, 8, device=device)
        for _ in range(3):
            with pytest.raises(ValueError, match="layout must be one of"):
                ropekit.apply_rope(q, layout=["bshd"])


# ------------------------------------------------------------------------------------------- caches

def test_device_caches_are_bounded():
    """The default frequencies of base= and the pair-to-axis maps of multi-axis positions: one bounded cache each,
    a repeated key served from it."""
    from ropekit._spec import pair_axis_tensor
    from ropekit.frequencies import default_inv_freq

    q = torch.randn(1, 2, 1, 8)
    for i in range(200):
        ropekit.apply_rope(q, base=1000.0 + i)
    assert 0 < default_inv_freq.cache_len() <= default_inv_freq.maxsize
    assert default_inv_freq(1000.0, 8, q.device) is default_inv_freq(1000.0, 8, q.device)
    for i in range(1, 100):
        pair_axis_tensor((i, 1), "contiguous", q.device)
    assert 0 < pair_axis_tensor.cache_len() <= pair_axis_tensor.maxsize
    assert pair_axis_tensor((2, 2), "interleaved", q.device) is pair_axis_tensor((2, 2), "interleaved", q.device)


@pytest.mark.parametrize("mode", MODES[1:])
def test_plan_cache_is_bounded_and_recent_plans_survive(mode, monkeypatch):
    from ropekit._fastpath import plans

    monkeypatch.setattr(plans, "_MAX_PLANS", 8)
    with mode_context(mode) as device:
        hot = torch.randn(1, 2, 1, 8, device=device)
        for S in range(1, 30):
            ropekit.apply_rope(hot)  # used again and again: stays
            for _ in range(2):  # a signature's second call records its plan
                ropekit.apply_rope(torch.randn(1, S + 2, 1, 8, device=device))
            assert len(_fastpath._PLANS) <= 8
        assert len(_fastpath._PLANS) == 8
        served = []
        original = _fastpath.Plan.__call__
        monkeypatch.setattr(_fastpath.Plan, "__call__", lambda self, *a: served.append(1) or original(self, *a))
        ropekit.apply_rope(hot)
        assert served


@pytest.mark.gpu
def test_launch_cache_holds_one_entry_per_variant_on_cuda():
    from ropekit.triton import runtime

    ropekit.apply_rope(torch.randn(1, 17, 4, 64, device="cuda"), positions=torch.randint(0, 9, (1, 17),
                                                                                          device="cuda"))
    before = len(runtime.compiled_kernels())
    for S in range(19, 400, 2):  # packed training with varying lengths: odd counts share one variant
        ids = torch.randint(0, 9, (1, S), device="cuda")
        ropekit.apply_rope(torch.randn(1, S, 4, 64, device="cuda"), positions=ids)
    assert len(runtime.compiled_kernels()) <= before + 2
