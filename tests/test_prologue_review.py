"""Review findings on the attention prologue (prologue kernels, rope_kv_write plans): each test demonstrates a
bug that was fixed, under the Triton interpreter on CPU (``kernels_on_cpu``: device-resident semantics)."""

import contextlib
import gc
import weakref

import pytest
import torch

import ropekit
from helpers import INTERPRETED
from ropekit import _fastpath
from ropekit.testing import kernels_on_cpu

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
T, HQ, HK, D = 2, 2, 1, 8


def _qkv():
    return torch.randn(T, HQ, D), torch.randn(T, HK, D), torch.randn(T, HK, D)


def test_paged_cache_skips_tokens_with_invalid_positions():
    """A token whose (device-resident) position is invalid writes nothing, in paged caches too: its slot keeps its
    old bytes instead of receiving a NaN k row and its v row."""
    q, k, v = _qkv()
    kc, vc = torch.zeros(2, 4, HK, D), torch.zeros(2, 4, HK, D)
    with kernels_on_cpu(), torch.no_grad():
        ropekit.rope_kv_write(q, k, v, kc, vc, positions=torch.tensor([-1, 3]), cache_layout="paged",
                              slot_mapping=torch.tensor([1, 2]))
    assert torch.equal(kc.view(-1, HK, D)[1], torch.zeros(HK, D))  # token 0: invalid position
    assert torch.equal(vc.view(-1, HK, D)[1], torch.zeros(HK, D))
    assert torch.equal(vc.view(-1, HK, D)[2], v[1])  # token 1 written


def test_rows_cache_skips_tokens_past_a_position_table():
    """A position past a cos/sin table is invalid (its rotation is NaN): its cache row is not written."""
    q, k, v = _qkv()
    cos, sin = torch.rand(4, D // 2), torch.rand(4, D // 2)
    kc, vc = torch.zeros(T, 8, HK, D), torch.zeros(T, 8, HK, D)
    with kernels_on_cpu(), torch.no_grad():
        ropekit.rope_kv_write(q, k, v, kc, vc, positions=torch.tensor([6, 1]), cos=cos, sin=sin)
    assert torch.equal(kc[0, 6], torch.zeros(HK, D))
    assert torch.equal(vc[0, 6], torch.zeros(HK, D))
    assert not kc[1, 1].isnan().any()


def test_multi_axis_paged_skips_tokens_invalid_on_a_later_axis():
    q, k, v = _qkv()
    kc, vc = torch.zeros(2, 4, HK, D), torch.zeros(2, 4, HK, D)
    pos = torch.tensor([[1, 2], [-3, 2]])  # [A, T]: token 0 invalid on axis 1
    with kernels_on_cpu(), torch.no_grad():
        ropekit.rope_kv_write(q, k, v, kc, vc, positions=pos, sections=(2, 2), cache_layout="paged",
                              slot_mapping=torch.tensor([1, 2]))
    assert torch.equal(kc.view(-1, HK, D)[1], torch.zeros(HK, D))
    assert torch.equal(vc.view(-1, HK, D)[1], torch.zeros(HK, D))
    assert torch.equal(vc.view(-1, HK, D)[2], v[1])


def test_a_plan_refuses_int_offsets_past_a_position_table():
    """A replayed plan hands an int offset past the cos/sin table back to the full path, which raises, instead of
    writing NaN rows into the cache."""
    q, k, v = _qkv()
    cos, sin = torch.rand(4, D // 2), torch.rand(4, D // 2)
    kc, vc = torch.zeros(T, 16, HK, D), torch.zeros(T, 16, HK, D)
    with kernels_on_cpu(), torch.no_grad():
        _fastpath.clear()
        for p in (0, 1, 2):
            ropekit.rope_kv_write(q, k, v, kc, vc, positions=p, cos=cos, sin=sin)
        assert len(_fastpath._KV_PLANS) == 1
        with pytest.raises(IndexError):
            ropekit.rope_kv_write(q, k, v, kc, vc, positions=9, cos=cos, sin=sin)
    assert torch.equal(kc[:, 9], torch.zeros(T, HK, D))


def test_the_last_launch_does_not_keep_a_call_s_tensors_alive():
    """Once rope_kv_write returns, nothing in ropekit holds its caches (the launch a plan is recorded from is
    dropped after use)."""
    q, k, v = _qkv()
    kc, vc = torch.zeros(T, 8, HK, D), torch.zeros(T, 8, HK, D)
    with kernels_on_cpu(), torch.no_grad():
        _fastpath.clear()
        ropekit.rope_kv_write(q, k, v, kc, vc, positions=0)
        ref = weakref.ref(kc)
        del kc
        q4, k4 = q.unsqueeze(1), k.unsqueeze(1)
        outs = ropekit.qk_norm_rope(q4, k4, torch.ones(D), torch.ones(D), positions=0)
        refs = [weakref.ref(t) for t in (q4, k4, *outs)]
        del q4, k4, outs
        gc.collect()
        assert ref() is None
        assert all(r() is None for r in refs)


def _strided(n):
    return torch.randn(2 * n)[::2]  # a [n] view with stride 2


def test_strided_norm_weights_and_frequencies():
    """Norm weights and inv_freq that are strided views: the kernels index them densely, so they are read as
    contiguous copies (forward, backward and rope_kv_write agree with the torch path)."""
    torch.manual_seed(0)
    q, k, v = (x.unsqueeze(1) for x in _qkv())
    qw, kw, inv = _strided(D).requires_grad_(), _strided(D).requires_grad_(), _strided(D // 2).abs()
    outs = {}
    for route in ("torch", "kernels"):
        ctx = kernels_on_cpu() if route == "kernels" else contextlib.nullcontext()
        with ctx:
            qn, kn = ropekit.qk_norm_rope(q, k, qw, kw, positions=3)
            grads = torch.autograd.grad((qn * 1.5).sum() + (kn * 0.5).sum(), (qw, kw))
            with torch.no_grad():
                kc, vc = torch.zeros(T, 8, HK, D), torch.zeros(T, 8, HK, D)
                qr = ropekit.rope_kv_write(q, k, v, kc, vc, positions=2, q_weight=qw, k_weight=kw)
                qf = ropekit.apply_rope(q, k, inv_freq=inv, positions=5)[0]
        outs[route] = (qn, kn, *grads, qr, kc, qf)
    for a, b in zip(outs["kernels"], outs["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_caches_that_share_memory_are_refused():
    """k_cache and v_cache sharing memory would overwrite each other's rows: a ValueError naming them, before
    anything is written -- also when a replayed plan meets caches that overlap at another relative offset."""
    q, k, v = _qkv()
    c = torch.zeros(T, 8, HK, D)
    with torch.no_grad(), pytest.raises(ValueError, match="k_cache and v_cache"):
        ropekit.rope_kv_write(q, k, v, c, c, positions=0)
    assert not c.any()
    n = T * 8 * HK * D
    buf = torch.zeros(2 * n + 4)
    with kernels_on_cpu(), torch.no_grad():
        _fastpath.clear()
        for _ in range(3):  # disjoint halves of one buffer: recorded on the second call, replayed on the third
            ropekit.rope_kv_write(q, k, v, buf[:n].view(T, 8, HK, D), buf[n: 2 * n].view(T, 8, HK, D), positions=0)
        assert len(_fastpath._KV_PLANS) == 1
        buf.zero_()
        with pytest.raises(ValueError, match="k_cache and v_cache"):  # same signature, overlapping caches
            ropekit.rope_kv_write(q, k, v, buf[:n].view(T, 8, HK, D), buf[4: n + 4].view(T, 8, HK, D), positions=0)
    assert not buf.any()


def test_caches_overlapping_an_input_are_refused_on_every_route():
    # A cache that holds q, k or v would change an input while the kernel reads it: refused by name before
    # anything is written, on the full path and when a plan exists for the signature.
    from ropekit import _fastpath
    from ropekit.testing import kernels_on_cpu

    with kernels_on_cpu(), torch.no_grad():
        _fastpath.clear()
        buf = torch.randn(2 * 2 * 8 * 2 * 16 + 2 * 4 * 16)
        k_cache = buf[: 2 * 8 * 2 * 16].view(2, 8, 2, 16)
        v_cache = buf[2 * 8 * 2 * 16: 2 * 2 * 8 * 2 * 16].view(2, 8, 2, 16)
        q = torch.randn(2, 4, 16)
        k, v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
        for _ in range(3):  # a plan for inputs outside the caches
            ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=torch.tensor([1, 2]))
        assert len(_fastpath._KV_PLANS) == 1
        inside = k_cache[1, 6:8].clone()  # same shape and strides as k: a view into the cache itself
        inside_view = k_cache[1, 6:8]
        assert inside_view.shape == k.shape and inside_view.stride() == k.stride()
        before = (k_cache.clone(), v_cache.clone())
        with pytest.raises(ValueError, match="k_cache and k share memory"):
            ropekit.rope_kv_write(q, inside_view, v, k_cache, v_cache, positions=torch.tensor([1, 2]))
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
        assert torch.equal(inside_view, inside)


def test_inference_caches_outside_inference_mode_are_refused():
    q, k, v = (torch.randn(2, h, 16) for h in (4, 2, 2))
    with torch.inference_mode():
        caches = [torch.zeros(2, 8, 2, 16) for _ in range(2)]
    with torch.no_grad(), pytest.raises(RuntimeError, match="inference tensor"):
        ropekit.rope_kv_write(q, k, v, *caches, positions=torch.tensor([0, 1]))
    with torch.inference_mode():
        for _ in range(3):  # and work inside it, plans included
            ropekit.rope_kv_write(q, k, v, *caches, positions=torch.tensor([0, 1]))
    assert caches[0].abs().sum() > 0
