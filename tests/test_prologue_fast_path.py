"""The attention prologue's eager fast path against its full path, call after call with fresh data:
rope_kv_write's plans (``ropekit._fastpath.KvPlan``: the same q and the same cache bytes) and qk_norm_rope's
(``NormPlan``: the same outputs and gradients, bit for bit, with gradients arriving in several layouts), for every
kind of argument a plan refills; the calls a plan must hand back to the full path; and no call's tensors kept alive
after it returns."""

import contextlib
import gc
import weakref

import pytest
import torch

import ropekit
from helpers import INTERPRETED, KERNEL_ROUTES, route_context
from ropekit import _fastpath
from ropekit.testing import kernels_on_cpu

DEVICES = KERNEL_ROUTES
FP8 = torch.float8_e4m3fn
_context = route_context


def _case(name: str, dev: str):
    """(tensors factory, options factory, cache factory) for one kind of call."""
    T, HQ, HK, D = 3, 4, 2, 16

    def inputs():
        qkv = torch.randn(T, (HQ + 2 * HK) * D, device=dev)
        return qkv.view(T, HQ + 2 * HK, D).split([HQ, HK, HK], dim=1)

    w = torch.randn(D, device=dev)
    if name == "bhsd-tensor-positions-norm":
        return (inputs, lambda: dict(positions=torch.randint(0, 8, (T,), device=dev), cache_layout="bhsd",
                                     q_weight=w, k_weight=w * 2, style="interleaved"),
                lambda: [torch.full((T, HK, 8, D), float("nan"), device=dev) for _ in range(2)])
    if name == "bshd-int-offset":
        return (inputs, lambda: dict(positions=int(torch.randint(0, 6, ()).item()), rotary_dim=8, base=500.0),
                lambda: [torch.full((T, 8, HK, D), float("nan"), device=dev) for _ in range(2)])
    if name == "paged-fp8-tensor-scales":
        return (inputs, lambda: dict(positions=torch.randint(0, 99, (T,), device=dev),
                                     slot_mapping=torch.tensor([5, -1, 0], device=dev), cache_layout="paged",
                                     k_cache_scale=torch.tensor(0.5, device=dev), v_cache_scale=0.25,
                                     inv_freq=torch.rand(8, device=dev)),
                lambda: [torch.zeros((2, 4, HK, D), device=dev, dtype=FP8) for _ in range(2)])
    if name == "bshd-tables":
        cos, sin = torch.rand(16, 8, device=dev), torch.rand(16, 8, device=dev)
        return (inputs, lambda: dict(positions=torch.randint(0, 8, (T,), device=dev), cos=cos, sin=sin),
                lambda: [torch.full((T, 8, HK, D), float("nan"), device=dev) for _ in range(2)])
    raise ValueError(name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["bhsd-tensor-positions-norm", "bshd-int-offset", "paged-fp8-tensor-scales",
                                  "bshd-tables"])
def test_plans_equal_the_full_path(device, case):
    dev = "cuda" if device == "cuda" else "cpu"
    inputs, opts, caches = _case(case, dev)
    with _context(device), torch.no_grad():
        _fastpath.clear()
        for call in range(4):  # the plan is recorded on the second call and serves the third and fourth
            q, k, v = inputs()
            o = opts()
            fast = caches()
            full = [c.clone() for c in fast]
            out = ropekit.rope_kv_write(q, k, v, *fast, **o)
            ropekit.set_fast_path(False)
            try:
                ref = ropekit.rope_kv_write(q, k, v, *full, **o)
            finally:
                ropekit.set_fast_path(True)
            assert torch.equal(out.view(torch.uint8) if out.dtype == FP8 else out, ref), (case, call)
            for a, b in zip(fast, full):  # NaN poison or zeros elsewhere: compare the bytes
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (case, call)
        assert len(_fastpath._KV_PLANS) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_plan_hands_bad_offsets_back_to_the_full_path(device):
    dev = "cuda" if device == "cuda" else "cpu"
    q, k, v = (torch.randn(2, 1, h, 16, device=dev) for h in (4, 2, 2))
    caches = [torch.zeros(2, 8, 2, 16, device=dev) for _ in range(2)]
    with _context(device), torch.no_grad():
        _fastpath.clear()
        for p in (0, 3, 7):
            ropekit.rope_kv_write(q, k, v, *caches, positions=p)
        assert len(_fastpath._KV_PLANS) == 1
        before = [c.clone() for c in caches]
        with pytest.raises(IndexError, match="positions"):
            ropekit.rope_kv_write(q, k, v, *caches, positions=8)
        with pytest.raises(ValueError, match="positions"):
            ropekit.rope_kv_write(q, k, v, *caches, positions=-1)
        assert all(torch.equal(a, b) for a, b in zip(caches, before))


@pytest.mark.parametrize("device", DEVICES)
def test_a_plan_declares_its_cache_writes(device):
    dev = "cuda" if device == "cuda" else "cpu"
    q, k, v = (torch.randn(2, h, 16, device=dev) for h in (4, 2, 2))
    caches = [torch.zeros(2, 8, 2, 16, device=dev) for _ in range(2)]
    with _context(device), torch.no_grad():
        _fastpath.clear()
        for _ in range(3):
            versions = [c._version for c in caches]
            ropekit.rope_kv_write(q, k, v, *caches, positions=torch.tensor([1, 2], device=dev))
            assert all(c._version > n for c, n in zip(caches, versions))
        assert len(_fastpath._KV_PLANS) == 1


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_aliasing_differently_gets_its_own_plan():
    # positions and slot_mapping as one tensor, then as two: the key holds which arguments share memory.
    q, k, v = (torch.randn(2, h, 16) for h in (4, 2, 2))
    caches = [torch.zeros(2, 4, 2, 16) for _ in range(2)]
    with kernels_on_cpu(), torch.no_grad():
        _fastpath.clear()
        ids = torch.tensor([1, 6])
        for _ in range(2):
            ropekit.rope_kv_write(q, k, v, *caches, positions=ids, slot_mapping=ids, cache_layout="paged")
        for _ in range(2):
            ropekit.rope_kv_write(q, k, v, *caches, positions=ids.clone(), slot_mapping=ids, cache_layout="paged")
        assert len(_fastpath._KV_PLANS) == 2


def _small_qkv(T: int, HQ: int, HK: int, D: int):
    return torch.randn(T, HQ, D), torch.randn(T, HK, D), torch.randn(T, HK, D)


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_a_plan_refuses_int_offsets_past_a_position_table():
    """A replayed plan hands an int offset past the cos/sin table back to the full path, which raises, instead of
    writing NaN rows into the cache."""
    T, HQ, HK, D = 2, 2, 1, 8
    q, k, v = _small_qkv(T, HQ, HK, D)
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


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_the_last_launch_does_not_keep_a_call_s_tensors_alive():
    """Once rope_kv_write returns, nothing in ropekit holds its caches (the launch a plan is recorded from is
    dropped after use)."""
    T, HQ, HK, D = 2, 2, 1, 8
    q, k, v = _small_qkv(T, HQ, HK, D)
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


def _norm_case(name: str, dev: str):
    """(q/k shapes, options factory, whether the call needs gradients) of one kind of qk_norm_rope call."""
    B, S, HQ, HK, D = 2, 3, 4, 2, 16
    shapes = ((B, S, HQ, D), (B, S, HK, D))
    if name == "range-grad":
        return shapes, lambda: dict(base=500.0), True
    if name == "tensor-positions-partial-interleaved-grad":
        return shapes, lambda: dict(positions=torch.randint(0, 50, (B, S), device=dev), rotary_dim=8,
                                    rotary_at="back", style="interleaved", weight_offset=1.0), True
    if name == "int-offset-tables-grad":
        cos, sin = torch.rand(12, D // 2, device=dev), torch.rand(12, D // 2, device=dev)
        return shapes, lambda: dict(positions=int(torch.randint(0, 10, ()).item()), cos=cos, sin=sin), True
    if name == "bhsd-inv-freq-inference":
        inv = torch.rand(D // 2, device=dev)
        return ((B, HQ, S, D), (B, HK, S, D)), lambda: dict(layout="bhsd", inv_freq=inv, q_scale=0.5), False
    raise ValueError(name)


def _grad_layouts(shape, dev: str):
    """Output gradients as autograd may hand them over: dense, row-strided, expanded, last dim strided."""
    B, S, H, D = shape
    return [torch.randn(shape, device=dev), torch.randn(B, S, H, 2 * D, device=dev)[..., D:],
            torch.randn(1, S, H, D, device=dev).expand(shape), torch.randn(B, S, H, 2 * D, device=dev)[..., ::2]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["range-grad", "tensor-positions-partial-interleaved-grad", "int-offset-tables-grad",
                                  "bhsd-inv-freq-inference"])
def test_norm_plans_equal_the_full_path(device, case):
    dev = "cuda" if device == "cuda" else "cpu"
    (q_shape, k_shape), opts, grad = _norm_case(case, dev)
    D = q_shape[-1]
    with _context(device):
        _fastpath.clear()
        for call, (gq, gk) in enumerate(zip(_grad_layouts(q_shape, dev) * 2, _grad_layouts(k_shape, dev) * 2)):
            # the plan is recorded on the second call; each gradient layout's backward replay on its first use
            inputs = [torch.randn(q_shape, device=dev), torch.randn(k_shape, device=dev),
                      torch.rand(D, device=dev) + 0.5, torch.rand(D, device=dev) + 0.5]
            o = opts()
            results = []
            for fast in (True, False):
                leaves = [t.clone().requires_grad_(grad) for t in inputs]
                ropekit.set_fast_path(fast)
                try:
                    with torch.set_grad_enabled(grad):
                        outs = ropekit.qk_norm_rope(*leaves, **o)
                        grads = torch.autograd.grad(outs, leaves, (gq, gk)) if grad else ()
                finally:
                    ropekit.set_fast_path(True)
                results.append([*outs, *grads])
            for got, want in zip(*results):
                assert torch.equal(got, want), (case, call)
        plans = list(_fastpath._NORM_PLANS.values())
        assert len(plans) == 1 and plans[0].grad == grad
        assert len(plans[0].backwards) == (3 if grad else 0)  # the last layout is made contiguous first


@pytest.mark.parametrize("device", DEVICES)
def test_a_norm_plan_hands_bad_offsets_back_to_the_full_path(device):
    dev = "cuda" if device == "cuda" else "cpu"
    q, k = torch.randn(1, 4, 4, 16, device=dev), torch.randn(1, 4, 2, 16, device=dev)
    w = torch.rand(16, device=dev)
    cos, sin = torch.rand(10, 8, device=dev), torch.rand(10, 8, device=dev)
    with _context(device):
        _fastpath.clear()
        for p in (0, 3, 6):
            ropekit.qk_norm_rope(q, k, w, w, positions=p, cos=cos, sin=sin)
        assert len(_fastpath._NORM_PLANS) == 1
        with pytest.raises(IndexError, match="positions"):
            ropekit.qk_norm_rope(q, k, w, w, positions=7, cos=cos, sin=sin)  # rows 7..10 of a 10-row table
        with pytest.raises(ValueError, match="positions"):
            ropekit.qk_norm_rope(q, k, w, w, positions=-1, cos=cos, sin=sin)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fast", [True, False], ids=["planned", "full"])
def test_a_planned_norm_call_detects_inputs_modified_before_backward(device, fast):
    # As the full path: q, k and the weights are saved for the backward, so an in-place change in between raises.
    dev = "cuda" if device == "cuda" else "cpu"
    with _context(device):
        _fastpath.clear()
        ropekit.set_fast_path(fast)
        try:
            for _ in range(3):
                leaf = torch.randn(1, 2, 4, 16, device=dev, requires_grad=True)
                q = leaf * 1.0
                k, w = torch.randn(1, 2, 2, 16, device=dev), torch.rand(16, device=dev)
                q_out, _ = ropekit.qk_norm_rope(q, k, w, w)
            q.add_(1.0)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                q_out.sum().backward()
        finally:
            ropekit.set_fast_path(True)
        assert len(_fastpath._NORM_PLANS) == (1 if fast else 0)


def _served(monkeypatch) -> list:
    """Counts the qk_norm_rope calls a plan served (replayed forwards)."""
    served = []
    run = _fastpath.NormPlan.run

    def counting(self, tensors, offset):
        served.append(1)
        return run(self, tensors, offset)

    monkeypatch.setattr(_fastpath.NormPlan, "run", counting)
    return served


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad", [True, False], ids=["train", "inference"])
def test_norm_plans_serve_module_weights_in_bf16(device, grad, monkeypatch):
    # nn.Parameter weights (a model's q_norm/k_norm) and bf16 tensors get plans that serve, with the full path's bits.
    dev = "cuda" if device == "cuda" else "cpu"
    served = _served(monkeypatch)
    norm_q, norm_k = torch.nn.RMSNorm(16, device=dev), torch.nn.RMSNorm(16, device=dev)
    norm_q.to(torch.bfloat16), norm_k.to(torch.bfloat16)
    with _context(device):
        _fastpath.clear()
        for call in range(4):
            inputs = [torch.randn(2, 3, h, 16, device=dev, dtype=torch.bfloat16) for h in (4, 2)]
            results = []
            for fast in (True, False):
                leaves = [t.clone().requires_grad_(grad) for t in inputs]
                for p in (*norm_q.parameters(), *norm_k.parameters()):
                    p.grad = None
                ropekit.set_fast_path(fast)
                try:
                    with torch.set_grad_enabled(grad):
                        outs = ropekit.qk_norm_rope(*leaves, norm_q.weight, norm_k.weight, base=500.0)
                        if grad:
                            sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs)).backward()
                finally:
                    ropekit.set_fast_path(True)
                grads = [*(t.grad for t in leaves), norm_q.weight.grad, norm_k.weight.grad] if grad else []
                results.append([*outs, *grads])
            for got, want in zip(*results):
                assert torch.equal(got, want), call
        assert len(served) == 2 and len(_fastpath._NORM_PLANS) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_norm_plan_backward_follows_saved_tensor_hooks(device):
    # Saved-tensor hooks (offloading) may hand the backward a dense copy of a strided q: the backward replay must not
    # read it with the strides it was recorded with. Three calls without the hook, then with it, then without.
    dev = "cuda" if device == "cuda" else "cpu"
    B, S, HQ, HK, D = 2, 3, 4, 2, 16

    def offload():  # as save_on_cpu(pin_memory=True): a dense, contiguous copy of each saved tensor
        return torch.autograd.graph.saved_tensors_hooks(lambda t: torch.empty(t.shape, dtype=t.dtype,
                                                                                device=t.device).copy_(t),
                                                        lambda t: t)

    def step(seed: int, hooked: bool, fast: bool):
        gen = torch.Generator().manual_seed(seed)
        qkv = torch.randn(B, S, HQ + 2 * HK, D, generator=gen).to(dev).requires_grad_()
        w1, w2 = ((torch.rand(D, generator=gen) + 0.5).to(dev).requires_grad_() for _ in range(2))
        q, k = qkv[:, :, :HQ], qkv[:, :, HQ:HQ + HK]  # slices of a fused projection
        ropekit.set_fast_path(fast)
        try:
            with offload() if hooked else contextlib.nullcontext():
                outs = ropekit.qk_norm_rope(q, k, w1, w2)
            grads = [torch.randn(o.shape, generator=gen).to(dev) for o in outs]
            return torch.autograd.grad(outs, (qkv, w1, w2), grads)
        finally:
            ropekit.set_fast_path(True)

    with _context(device):
        _fastpath.clear()
        for seed, hooked in enumerate([False, False, False, True, True, False]):
            for got, want in zip(step(seed, hooked, True), step(seed, hooked, False)):
                assert torch.equal(got, want), (seed, hooked)
        assert len(_fastpath._NORM_PLANS) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_planned_norm_calls_free_checkpointed_activations(device):
    # Under non-reentrant activation checkpointing the forward's q must not outlive it (a planned call keeps no
    # tensor of the call outside autograd's saved tensors), and the gradients equal the full path's.
    import gc
    import weakref

    from torch.utils.checkpoint import checkpoint

    dev = "cuda" if device == "cuda" else "cpu"
    B, S, HQ, HK, D = 2, 3, 4, 2, 16
    refs = []

    def block(x, wq, wk, qw, kw):
        q, k = (x @ wq).view(B, S, HQ, D), (x @ wk).view(B, S, HK, D)
        refs.append(weakref.ref(q))
        q_out, k_out = ropekit.qk_norm_rope(q, k, qw, kw)
        return q_out.sum() + (k_out * k_out).sum()

    weights = [torch.randn(32, HQ * D, device=dev), torch.randn(32, HK * D, device=dev),
               torch.rand(D, device=dev), torch.rand(D, device=dev)]
    with _context(device):
        results = {}
        for fast in (True, False):
            _fastpath.clear()
            ropekit.set_fast_path(fast)
            try:
                leaves = [w.clone().requires_grad_() for w in weights]
                results[fast] = []
                for seed in range(4):
                    refs.clear()
                    x = torch.randn(B, S, 32, generator=torch.Generator().manual_seed(seed)).to(dev)
                    loss = checkpoint(block, x, *leaves, use_reentrant=False)
                    gc.collect()
                    if seed >= 2:  # planned calls (the first two compile and record; that is not under test)
                        assert refs[0]() is None, (fast, seed)
                    results[fast].append(torch.autograd.grad(loss, leaves))
            finally:
                ropekit.set_fast_path(True)
            assert len(_fastpath._NORM_PLANS) == (1 if fast else 0)
        for planned, full in zip(results[True], results[False]):
            assert all(torch.equal(a, b) for a, b in zip(planned, full))


@pytest.mark.parametrize("device", DEVICES)
def test_planned_norm_calls_save_what_the_full_path_saves(device):
    # Packed sequences with per-token positions: validation drops cu_seqlens, so changing it in place before the
    # backward is harmless on the full path, and must be on a planned call too; changing positions raises on both.
    dev = "cuda" if device == "cuda" else "cpu"
    with _context(device):
        _fastpath.clear()
        for fast in (True, False):
            ropekit.set_fast_path(fast)
            try:
                for _ in range(3):
                    q = torch.randn(5, 4, 16, device=dev, requires_grad=True)
                    k = torch.randn(5, 2, 16, device=dev)
                    w = torch.rand(16, device=dev)
                    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=dev)
                    pos = torch.tensor([0, 1, 0, 1, 2], device=dev)
                    q_out, _ = ropekit.qk_norm_rope(q, k, w, w, layout="thd", cu_seqlens=cu, positions=pos)
                cu.add_(0)
                q_out.sum().backward()
                q_out, _ = ropekit.qk_norm_rope(q, k, w, w, layout="thd", cu_seqlens=cu, positions=pos)
                pos.add_(0)
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    q_out.sum().backward()
            finally:
                ropekit.set_fast_path(True)
        assert len(_fastpath._NORM_PLANS) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_norm_plans_take_sections_as_a_list(device, monkeypatch):
    # transformers configs give mrope_section as a list: such calls get a plan like the tuple's, with the same bits.
    dev = "cuda" if device == "cuda" else "cpu"
    served = _served(monkeypatch)
    w = torch.rand(16, device=dev)
    with _context(device):
        _fastpath.clear()
        for _ in range(4):
            q, k = torch.randn(2, 3, 4, 16, device=dev), torch.randn(2, 3, 2, 16, device=dev)
            pos = torch.randint(0, 40, (3, 2, 3), device=dev)
            out = ropekit.qk_norm_rope(q, k, w, w, positions=pos, sections=[2, 3, 3])
            ropekit.set_fast_path(False)
            try:
                ref = ropekit.qk_norm_rope(q, k, w, w, positions=pos, sections=(2, 3, 3))
            finally:
                ropekit.set_fast_path(True)
            assert all(torch.equal(a, b) for a, b in zip(out, ref))
        assert len(served) == 2 and len(_fastpath._NORM_PLANS) == 1
