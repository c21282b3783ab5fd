"""torch.compile(fullgraph=True) of every public entry point whose float and int options are arguments of the
compiled function -- traced as symbols with ``dynamic=True`` -- and vary between calls: each call equals the eager
call with the same values, and bad values still raise naming the argument.

On CPU the compiled graph runs the registered ops through the float64 path, as eager calls do, so results are
compared exactly (as in test_api's and test_prologue_ops' compile tests)."""

from __future__ import annotations

import pytest
import torch

import ropekit
from ropekit.testing import make_qk

DYNAMIC = [pytest.param(True, id="dynamic"), pytest.param(False, id="static")]
# (q_scale, base, rotary_scale, eps, weight_offset, int offset) per call
VALUES = [(0.125, 10000.0, 1.0, 1e-6, 0.0, 3), (0.5, 500000.0, 1.25, 1e-5, 1.0, 17), (1.5, 300.0, 0.75, 0.1, 0.5, 0)]


def _exact(got, want):
    got, want = (got, want) if isinstance(got, (tuple, list)) else ((got,), (want,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _compiled(fn, dynamic: bool):
    torch._dynamo.reset()  # each test's graphs count against the recompile limit on their own
    return torch.compile(fn, fullgraph=True, dynamic=dynamic)


@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_apply_rope_and_rope_backward(dynamic):
    apply_rope, rope_backward = ropekit.apply_rope, ropekit.rope_backward  # resolved before tracing

    def f(q, k, q_scale, base, rotary_scale, offset):
        q_rot, k_rot = apply_rope(q, k, positions=offset, q_scale=q_scale, k_scale=2.0 * q_scale, base=base,
                                  rotary_scale=rotary_scale, rotary_dim=8)
        dq, dk = rope_backward(q_rot, k_rot, positions=offset, q_scale=q_scale, base=base,
                               rotary_scale=rotary_scale, rotary_dim=8)
        return q_rot, k_rot, dq, dk

    compiled = _compiled(f, dynamic)
    for q_scale, base, rotary_scale, _, _, offset in VALUES:
        q, k = make_qk(2, 5, 4, 2, 16)
        _exact(compiled(q, k, q_scale, base, rotary_scale, offset), f(q, k, q_scale, base, rotary_scale, offset))


@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_apply_rope_in_place(dynamic):
    apply_rope_ = ropekit.apply_rope_

    def f(q, k, q_scale, base, offset):
        apply_rope_(q, k, positions=offset, q_scale=q_scale, k_scale=q_scale, base=base, style="interleaved")
        return q, k

    compiled = _compiled(f, dynamic)
    for q_scale, base, _, _, _, offset in VALUES:
        q, k = make_qk(2, 5, 4, 2, 16)
        q2, k2 = q.clone(), k.clone()
        _exact(compiled(q, k, q_scale, base, offset), f(q2, k2, q_scale, base, offset))
        _exact((q, k), (q2, k2))  # written in place by both


@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_qk_norm_rope(dynamic):
    qk_norm_rope = ropekit.qk_norm_rope
    positions = torch.randint(0, 1000, (2, 5))

    def f(q, k, wq, wk, eps, weight_offset, q_scale, base):
        return qk_norm_rope(q, k, wq, wk, eps=eps, weight_offset=weight_offset, positions=positions,
                            q_scale=q_scale, base=base)

    compiled = _compiled(f, dynamic)
    for q_scale, base, _, eps, weight_offset, _ in VALUES:
        q, k = make_qk(2, 5, 4, 2, 16)
        wq, wk = torch.rand(16) + 0.5, torch.rand(16) + 0.5
        _exact(compiled(q, k, wq, wk, eps, weight_offset, q_scale, base),
               f(q, k, wq, wk, eps, weight_offset, q_scale, base))


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn], ids=["float32", "float8"])
def test_rope_kv_write(dynamic, cache_dtype):
    rope_kv_write = ropekit.rope_kv_write
    fp8 = cache_dtype == torch.float8_e4m3fn

    def f(q, k, v, k_cache, v_cache, wq, wk, eps, weight_offset, q_scale, base, offset, cache_scale):
        scales = dict(k_cache_scale=cache_scale, v_cache_scale=2.0 * cache_scale) if fp8 else {}
        return rope_kv_write(q, k, v, k_cache, v_cache, positions=offset, q_weight=wq, k_weight=wk, eps=eps,
                             weight_offset=weight_offset, q_scale=q_scale, base=base, **scales)

    compiled = _compiled(f, dynamic)
    for call, (q_scale, base, _, eps, weight_offset, offset) in enumerate(VALUES):
        q, k, v = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)
        wq, wk = torch.rand(16) + 0.5, torch.rand(16) + 0.5
        caches = [torch.zeros(2, 24, 2, 16).to(cache_dtype) for _ in range(2)]
        eager_caches = [c.clone() for c in caches]
        args = (wq, wk, eps, weight_offset, q_scale, base, offset, 0.5 + call)
        with torch.no_grad():
            got = compiled(q, k, v, *caches, *args)
            want = f(q, k, v, *eager_caches, *args)
        _exact(got, want)
        _exact([c.float() for c in caches], [c.float() for c in eager_caches])
        assert caches[1].float().abs().sum() > 0


@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_bad_values_still_raise_naming_the_argument(dynamic):
    """Values checked while tracing: a NaN scale, a base <= 1, eps <= 0 raise (torch.compile reports the error
    it observed, which names the argument)."""
    apply_rope, qk_norm_rope = ropekit.apply_rope, ropekit.qk_norm_rope
    q, k = make_qk(1, 3, 2, 1, 16)
    w = torch.ones(16)

    def rope(q, k, q_scale, base):
        return apply_rope(q, k, positions=1, q_scale=q_scale, base=base)

    def norm(q, k, eps):
        return qk_norm_rope(q, k, w, w, eps=eps, positions=1)

    compiled = _compiled(rope, dynamic)
    compiled(q, k, 0.5, 100.0)
    for args, name in (((float("nan"), 100.0), "q_scale"), ((0.5, 1.0), "base"), ((float("inf"), 100.0), "q_scale")):
        with pytest.raises(Exception, match=name):
            compiled(q, k, *args)
    compiled = _compiled(norm, dynamic)
    compiled(q, k, 1e-6)
    with pytest.raises(Exception, match="eps"):
        compiled(q, k, 0.0)
