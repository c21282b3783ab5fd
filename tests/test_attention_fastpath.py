"""rope_attention's eager fast path (``ropekit._fastpath.attention``) against its full path, call after call with
fresh data: o, lse, dq, dk, dv bit for bit, for every kind of argument a plan refills and gradients arriving in
several layouts; that a planned call really skips the full path (forward and backward); the calls a plan hands
back to the full path (a changed int offset out of range, host boundaries the full path refuses, a bad argument);
and activation checkpointing's recomputation through a plan."""

import contextlib
import gc
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import ropekit
import ropekit.attention
from helpers import INTERPRETED, fast_path, same_bits, snapshot
from ropekit import _fastpath, ops
from ropekit._fastpath.plans import _ATTENTION_PLANS
from ropekit.testing import kernels_on_cpu

interpreted = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")


@pytest.fixture
def poisoned(monkeypatch):
    """Every float tensor torch.empty / torch.empty_like allocates starts as NaN, so an element no launch wrote
    shows (outputs, gradients, and the buffers a replay allocates for its launches)."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))


@pytest.fixture
def full_calls(monkeypatch):
    """Counts the full path's forward calls and the attention backward's op-body calls (the ones a plan's
    backward replay skips)."""
    counter = {"forward": 0, "backward": 0}
    forward, backward = ropekit.attention._rope_attention_full, ops.attention_backward

    def counting_forward(*args, **kwargs):
        counter["forward"] += 1
        return forward(*args, **kwargs)

    def counting_backward(*args, **kwargs):
        counter["backward"] += 1
        return backward(*args, **kwargs)

    monkeypatch.setattr(ropekit.attention, "_rope_attention_full", counting_forward)
    monkeypatch.setattr(ops, "attention_backward", counting_backward)
    return counter


def _qkv(layout, B, S, HQ, HK, D, DV, g, dtype, device, packed=False, last_strided=False):
    """q, k, v in ``layout`` (thd: B * S tokens); ``packed``: views of one fused qkv buffer (strided heads);
    ``last_strided``: q with a non-contiguous last dim (the full path copies it)."""
    def shape(H, d):
        return {"bshd": (B, S, H, d), "bhsd": (B, H, S, d), "sbhd": (S, B, H, d), "thd": (B * S, H, d)}[layout]

    def randn(*size):
        return torch.randn(*size, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)

    if packed:
        assert layout in ("bshd", "sbhd", "thd") and DV == D
        buf = randn(*shape(HQ + 2 * HK, D))
        q, k, v = buf.split([HQ, HK, HK], dim=-2)
    else:
        q, k, v = randn(*shape(HQ, D)), randn(*shape(HK, D)), randn(*shape(HK, DV))
    if last_strided:
        q = randn(*shape(HQ, D)[:-1], D, 2)[..., 0]
    return q, k, v


def _grad_like(o: torch.Tensor, kind: str, g) -> torch.Tensor:
    """The gradient of o in a layout autograd can produce: dense, transposed, expanded over the batch, or with a
    non-contiguous last dim."""
    def randn(*size):
        return torch.randn(*size, generator=g, dtype=torch.float32).to(device=o.device, dtype=o.dtype)

    if kind == "dense":
        return randn(*o.shape)
    if kind == "transposed":
        return randn(*o.shape[:-3], o.shape[-2], o.shape[-3], o.shape[-1]).transpose(-3, -2)
    if kind == "expanded":
        return randn(1, *o.shape[1:]).expand(o.shape)
    if kind == "last-strided":
        return randn(*o.shape, 2)[..., 1]
    raise ValueError(kind)


def _boundaries(tokens: int, device) -> dict:
    """Three packed sequences of ``tokens``, the second empty, with the longest length."""
    cut = tokens * 2 // 5
    return dict(cu_seqlens=torch.tensor([0, cut, cut, tokens], dtype=torch.int32, device=device),
                max_seqlen=tokens - cut)


# name: (layout, B, S, HQ, HK, D, DV, keywords (a function of the call index), extras)
CASES = {
    "bshd-causal-gqa-int-offset": ("bshd", 2, 20, 4, 2, 16, 16,
                                   lambda i, dev, B, S, D: dict(is_causal=True, positions=(3, 11, 0, 5)[i]), {}),
    "bhsd-interleaved-tensor-positions": ("bhsd", 1, 17, 2, 1, 32, 32,
                                          lambda i, dev, B, S, D: dict(style="interleaved", positions=torch.randint(
                                              0, 50, (B, S), device=dev)), {"do": "transposed"}),
    "partial-front-fold-q": ("bshd", 2, 9, 4, 2, 16, 16,
                             lambda i, dev, B, S, D: dict(rotary_dim=8, fold="q", is_causal=True, return_lse=True),
                             {"dlse": True}),
    "partial-back-vdim-fold-q_log2": ("bshd", 1, 24, 4, 2, 32, 16,
                                      lambda i, dev, B, S, D: dict(rotary_dim=16, rotary_at="back", fold="q_log2",
                                                          base=500.0), {"do": "expanded"}),
    "thd-cu_seqlens-symmetric": ("thd", 1, 30, 2, 1, 16, 16,
                                 lambda i, dev, B, S, D: dict(**_boundaries(B * S, dev), is_causal=True,
                                                           fold="symmetric", return_lse=True), {"dlse": True}),
    "sbhd-packed-qkv-return-rotated": ("sbhd", 2, 7, 2, 1, 16, 16,
                                       lambda i, dev, B, S, D: dict(fold="symmetric_log2", return_rotated=True,
                                                           positions=torch.randint(0, 9, (B,), device=dev)),
                                       {"packed": True, "do": "last-strided"}),
    "q-last-dim-strided-tables": ("bshd", 1, 12, 2, 1, 16, 16,
                                  lambda i, dev, B, S, D: dict(cos=torch.rand(S + 8, D // 2, device=dev),
                                                      sin=torch.rand(S + 8, D // 2, device=dev), positions=i + 2,
                                                      scale=0.3), {"last_strided": True}),
    "inv_freq-log2-softmax": ("bshd", 2, 5, 4, 2, 16, 16,
                              lambda i, dev, B, S, D: dict(inv_freq=torch.rand(D // 2, device=dev), log2_softmax=True,
                                                  is_causal=True, return_lse=True), {}),
}


def _calls(case: str, fast: bool, seed: int, device: str, dtype=torch.float32, n: int = 4, grad: bool = True,
           shape=None) -> list:
    """n calls of one signature with fresh data each, with the fast path on or off (plans cleared first): per call
    the outputs and the gradients of q, k and v."""
    layout, B, S, HQ, HK, D, DV, keywords, extras = CASES[case]
    if shape is not None:
        B, S, HQ, HK, D, DV = shape
    results = []
    context = kernels_on_cpu() if device == "cpu" else contextlib.nullcontext()
    with fast_path(fast), context:
        _fastpath.clear()
        for i in range(n):
            g = torch.Generator().manual_seed(seed + i)
            torch.manual_seed(seed + i)  # the keywords' tensors
            q, k, v = _qkv(layout, B, S, HQ, HK, D, DV, g, dtype, device, extras.get("packed", False),
                           extras.get("last_strided", False))
            leaves = [t for t in (q, k, v)]
            if grad:
                if extras.get("packed"):  # one leaf behind the three views
                    base = q._base.detach().requires_grad_()
                    leaves = [base]
                    q, k, v = base.split([HQ, HK, HK], dim=-2)
                else:
                    leaves = [t.requires_grad_() for t in (q, k, v)]
            outs = ropekit.rope_attention(q, k, v, layout=layout, **keywords(i, device, B, S, D))
            outs = outs if isinstance(outs, tuple) else (outs,)
            if grad:
                tensors, grads = [outs[0]], [_grad_like(outs[0], extras.get("do", "dense"), g)]
                if extras.get("dlse"):
                    tensors.append(outs[1])
                    grads.append(torch.randn(outs[1].shape, generator=g).to(device))
                torch.autograd.backward(tensors, grads)
            results.append([t.detach() for t in outs] + [t.grad for t in leaves if grad])
    return results


def _assert_same(full: list, fast: list) -> None:
    for i, (a, b) in enumerate(zip(full, fast)):
        assert len(a) == len(b)
        for j, (x, y) in enumerate(zip(a, b)):
            assert not x.isnan().any(), f"call {i}, output {j}: unwritten elements"
            assert same_bits(x, y), f"call {i}, output {j} differs from the full path"


@interpreted
@pytest.mark.parametrize("case", list(CASES))
def test_plans_equal_the_full_path(case, poisoned, full_calls):
    seed = int(torch.randint(0, 2**30, ()))
    full = _calls(case, False, seed, "cpu")
    assert full_calls == {"forward": 4, "backward": 4}
    full_calls.update(forward=0, backward=0)
    fast = _calls(case, True, seed, "cpu")
    # calls 1 and 2 take the full path (the second records the plan); call 3's backward records its replay; call
    # 4 is replayed forward and backward
    assert full_calls == {"forward": 2, "backward": 3}
    _assert_same(full, fast)


@interpreted
@pytest.mark.parametrize("case", ["bshd-causal-gqa-int-offset", "thd-cu_seqlens-symmetric"])
def test_plans_without_autograd(case, poisoned, full_calls):
    seed = int(torch.randint(0, 2**30, ()))
    with torch.no_grad():
        full = _calls(case, False, seed, "cpu", n=3, grad=False)
        fast = _calls(case, True, seed, "cpu", n=3, grad=False)
    assert full_calls["forward"] == 3 + 2
    _assert_same(full, fast)


@interpreted
def test_a_planned_call_skips_validation(monkeypatch):
    from ropekit import attention

    counter = {"validate": 0}
    validate = attention.validate_args

    def counting(*args, **kwargs):
        counter["validate"] += 1
        return validate(*args, **kwargs)

    monkeypatch.setattr(attention, "validate_args", counting)
    _fastpath.clear()
    q, k, v = torch.randn(1, 6, 2, 16), torch.randn(1, 6, 1, 16), torch.randn(1, 6, 1, 16)
    with kernels_on_cpu(), torch.no_grad():
        for expected in (1, 2, 2, 2):
            ropekit.rope_attention(q, k, v, positions=4, is_causal=True)
            assert counter["validate"] == expected
        assert len(_ATTENTION_PLANS) == 1
        with fast_path(False):  # off: every call validates, no plan is looked up or made
            _fastpath.clear()
            for expected in (3, 4, 5):
                ropekit.rope_attention(q, k, v, positions=4, is_causal=True)
                assert counter["validate"] == expected
            assert len(_ATTENTION_PLANS) == 0


def _planned_bshd(**kw):
    """A planned signature's inputs (two no-grad calls made)."""
    _fastpath.clear()
    q, k, v = torch.randn(1, 6, 2, 16), torch.randn(1, 6, 1, 16), torch.randn(1, 6, 1, 16)
    for _ in range(2):
        ropekit.rope_attention(q, k, v, **kw)
    assert len(_ATTENTION_PLANS) == 1
    return q, k, v


@interpreted
def test_a_changed_int_offset_is_refilled_and_bounds_checked(full_calls):
    with kernels_on_cpu(), torch.no_grad():
        q, k, v = _planned_bshd(positions=1)
        for offset in (0, 9, 1):
            fast = ropekit.rope_attention(q, k, v, positions=offset)
            with fast_path(False):
                assert same_bits(fast, ropekit.rope_attention(q, k, v, positions=offset))
        calls = full_calls["forward"]
        with pytest.raises(ValueError, match="position"):  # the full path's error, for the offset past the bound
            ropekit.rope_attention(q, k, v, positions=2**31)
        with pytest.raises(ValueError, match="position"):
            ropekit.rope_attention(q, k, v, positions=-1)
        assert full_calls["forward"] == calls + 2


@interpreted
def test_bad_arguments_after_a_plan_raise_as_without_one():
    with kernels_on_cpu(), torch.no_grad():
        q, k, v = _planned_bshd(is_causal=True)
        before = snapshot(q, k, v)
        bad = [dict(k=k.double()), dict(v=v[:, :5]), dict(scale=float("nan")), dict(scale=True), dict(q_scale=True),
               dict(fold="sideways"), dict(is_causal=True, max_seqlen=3)]
        for change in bad:
            call = dict(q=q, k=k, v=v, is_causal=True)
            call.update(change)
            errors = []
            for enabled in (False, True):
                with fast_path(enabled), pytest.raises((TypeError, ValueError)) as info:
                    ropekit.rope_attention(**call)
                errors.append((type(info.value), str(info.value)))
            assert errors[0] == errors[1], change
        for t, b in zip((q, k, v), before):
            assert same_bits(t, b)


@interpreted
def test_host_boundaries_are_checked_on_every_planned_call(full_calls):
    q, k, v = torch.randn(10, 2, 16), torch.randn(10, 1, 16), torch.randn(10, 1, 16)
    good = torch.tensor([0, 4, 10], dtype=torch.int32)
    with kernels_on_cpu(), torch.no_grad():
        _fastpath.clear()
        for _ in range(3):
            ropekit.rope_attention(q, k, v, layout="thd", cu_seqlens=good, max_seqlen=6)
        assert full_calls["forward"] == 2
        for bad, match in ((torch.tensor([0, 4, 9], dtype=torch.int32), "cu_seqlens"),
                           (torch.tensor([0, 1, 10], dtype=torch.int32), "max_seqlen")):
            with pytest.raises(ValueError, match=match):
                ropekit.rope_attention(q, k, v, layout="thd", cu_seqlens=bad, max_seqlen=6)


@interpreted
def test_checkpointing_recomputes_through_the_plan(full_calls):
    seed = int(torch.randint(0, 2**30, ()))

    def attention(q, k, v):
        return ropekit.rope_attention(q, k, v, positions=2, is_causal=True, fold="q")

    results = []
    with kernels_on_cpu():
        _fastpath.clear()
        for use_checkpoint in (False, True, True, True):
            g = torch.Generator().manual_seed(seed)
            q, k, v = (torch.randn(s, generator=g).requires_grad_() for s in ((1, 9, 4, 16), (1, 9, 2, 16),
                                                                             (1, 9, 2, 16)))
            o = checkpoint(attention, q, k, v, use_reentrant=False) if use_checkpoint else attention(q, k, v)
            o.backward(torch.randn(o.shape, generator=g))
            results.append([o.detach(), q.grad, k.grad, v.grad])
        assert len(_ATTENTION_PLANS) == 1
    assert full_calls["forward"] == 2  # the other calls and every recomputation went through the plan
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert same_bits(a, b)


@interpreted
def test_plans_keep_no_call_tensors_alive():
    refs = []
    with kernels_on_cpu():
        _fastpath.clear()
        for _ in range(4):
            q, k, v = (torch.randn(1, 6, h, 16).requires_grad_() for h in (2, 1, 1))
            positions = torch.randint(0, 9, (1, 6))
            o = ropekit.rope_attention(q, k, v, positions=positions, return_rotated=True)[0]
            o.backward(torch.randn(o.shape))
            refs += [weakref.ref(t) for t in (q, k, v, positions, o)]
            del q, k, v, positions, o
        gc.collect()
        assert len(_ATTENTION_PLANS) == 1 and next(iter(_ATTENTION_PLANS.values())).backwards
    assert all(r() is None for r in refs)


@interpreted
def test_compiled_calls_neither_look_up_nor_make_plans():
    from ropekit._fastpath.plans import _ATTENTION_SEEN

    torch._dynamo.reset()
    q, k, v = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 1, 16), torch.randn(1, 8, 1, 16)

    def f(a, b, c):
        return ropekit.rope_attention(a, b, c, positions=3, is_causal=True, fold="q")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with kernels_on_cpu(), torch.no_grad():
        _fastpath.clear()
        outs = [compiled(q, k, v) for _ in range(3)]
        assert not _ATTENTION_PLANS and not _ATTENTION_SEEN
        with fast_path(False):
            eager = f(q, k, v)
    for o in outs:
        assert same_bits(o, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_plans_equal_the_full_path_on_cuda(case, full_calls):
    seed = int(torch.randint(0, 2**30, ()))
    shape = (2, 300, 8, 2, 64, 64)
    kw = dict(dtype=torch.bfloat16, shape=shape)
    full = _calls(case, False, seed, "cuda", **kw)
    full_calls.update(forward=0, backward=0)
    fast = _calls(case, True, seed, "cuda", **kw)
    assert full_calls == {"forward": 2, "backward": 3}
    _assert_same(full, fast)
