"""apply_rope's float8 outputs with dynamic scales (``out_dtype=float8``, ``q_out_scale="dynamic"``): each (token,
head) row of the rotated q and k divided by its own float32 scale ``max |row| / fp8 max`` (pass-through columns and
``q_scale``/``k_scale`` included), computed in the rope kernel's launch and returned beside the outputs. Each route
(float32 CPU path, the kernel under the interpreter, CUDA) against a float64 oracle written here from the
definition: rotation in float64, then the scale and one rounding to the format (the float8 TOLERANCES rows)."""

from __future__ import annotations

import pytest
import torch

import ropekit
from helpers import ROUTES, assert_unchanged, cos_sin64, on_route, rotate64, same_bits, snapshot
from ropekit.testing import assert_close_to_ref

FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
IN_DTYPES = [pytest.param(t, id=str(t).split(".")[1]) for t in (torch.bfloat16, torch.float16, torch.float32)]
B, S, HQ, HK, D = 2, 3, 3, 2, 16
BACKEND = {"cpu": "float32-path", "cpu-kernels": "triton-interpreter", "cuda": "kernels"}


def _oracle(x, positions, rotary_dim, scale):
    """float64 rotation of [B, S, H, D] ``x`` (neox, base 10000, positions [B, S]), then times ``scale``."""
    cos, sin = cos_sin64(positions.cpu(), D, {"rotary_dim": rotary_dim})
    return rotate64(x.cpu().double(), cos, sin, rotary_dim=rotary_dim, scale=scale)


def _check(out, scales, y, dtype, route):
    """``out``/``scales`` against the float64 rotation ``y``: scales within float32 rounding of the definition, each
    row within one float8 rounding of ``y / scale``, the row's largest element on the format's max (zero rows: 0)."""
    assert scales.dtype == torch.float32 and scales.shape == out.shape[:-1] and out.dtype == dtype
    assert_close_to_ref(scales, y.abs().amax(-1) / FP8_MAX[dtype], torch.float32, BACKEND[route])
    s = scales.cpu().double()
    assert_close_to_ref(out, y / torch.where(s > 0, s, 1.0)[..., None], dtype, BACKEND[route])
    row_max = out.float().abs().amax(-1).cpu()
    assert torch.equal(row_max, torch.where(s > 0, FP8_MAX[dtype], 0.0).float())


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("rotary_dim", [16, 8], ids=["full", "partial"])
def test_apply_rope_float8_dynamic(route, dtype, in_dtype, rotary_dim):
    """GQA q and k, per-token positions, q_scale/k_scale folded in before the row max; a zero row gets scale 0 and
    stores zeros (no NaN); a row whose largest value is in a pass-through column is scaled by that value."""
    with on_route(route) as dev:
        q = torch.randn(B, S, HQ, D, dtype=torch.float64).to(in_dtype).to(dev)
        k = torch.randn(B, S, HK, D, dtype=torch.float64).to(in_dtype).to(dev)
        q[0, 1, 2] = 0.0
        q[1, 0, 1, -1] = 9.0  # the largest |value| of its row, in a pass-through column when partial
        positions = torch.randint(0, 60, (B, S)).to(dev)
        before = snapshot(q, k, positions)
        with torch.no_grad():
            q_out, k_out, q_scales, k_scales = ropekit.apply_rope(
                q, k, positions=positions, rotary_dim=rotary_dim, q_scale=0.5, k_scale=2.0, out_dtype=dtype,
                q_out_scale="dynamic")
        assert_unchanged((q, k, positions), before)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_scales.shape == (B, S, HQ)
    _check(q_out, q_scales, _oracle(q, positions, rotary_dim, 0.5), dtype, route)
    _check(k_out, k_scales, _oracle(k, positions, rotary_dim, 2.0), dtype, route)
    assert q_scales[0, 1, 2].item() == 0.0 and not q_out[0, 1, 2].float().any()
    if rotary_dim < D:
        assert q_scales[1, 0, 1].item() == pytest.approx(4.5 / FP8_MAX[dtype], rel=1e-6)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("layout", ["bhsd", "thd"])
def test_apply_rope_float8_dynamic_layouts_without_k(route, layout):
    """q alone returns ``(q_out, q_scales)``; the scales are shaped like q without its last dim in q's layout
    ([B, H, S] for bhsd, [T, H] for thd), each entry the scale of its own row."""
    dtype = torch.float8_e4m3fn
    with on_route(route) as dev:
        q = torch.randn(B, S, HQ, D, dtype=torch.bfloat16, device=dev)
        x = q.transpose(1, 2) if layout == "bhsd" else q.reshape(B * S, HQ, D)
        with torch.no_grad():
            out, scales = ropekit.apply_rope(x, positions=5, layout=layout, out_dtype=dtype, q_out_scale="dynamic")
    assert out.shape == x.shape and scales.shape == x.shape[:-1]
    if layout == "bhsd":  # an int offset: each sequence from 5; thd's tokens are one sequence
        y = _oracle(q, torch.arange(5, 5 + S).expand(B, S), D, 1.0).transpose(1, 2)
    else:
        y = _oracle(q.reshape(1, B * S, HQ, D), torch.arange(5, 5 + B * S)[None], D, 1.0).reshape(B * S, HQ, D)
    _check(out, scales, y, dtype, route)


@pytest.mark.parametrize("route", ROUTES)
def test_apply_rope_float8_dynamic_bad_arguments(route):
    """Clear errors, nothing written: dynamic without a float8 out_dtype, another q_out_scale value, in place or
    backward, inputs that require grad."""
    with on_route(route) as dev:
        q = torch.randn(1, 2, 2, 8, device=dev)
        k = torch.randn(1, 2, 1, 8, device=dev)
        before = snapshot(q, k)
        with pytest.raises(ValueError, match="q_out_scale.*out_dtype"):
            ropekit.apply_rope(q, k, q_out_scale="dynamic")
        with pytest.raises(ValueError, match="q_out_scale.*out_dtype"):
            ropekit.apply_rope(q, k, q_out_scale="dynamic", out_dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="q_out_scale"):
            ropekit.apply_rope(q, k, q_out_scale=0.5, out_dtype=torch.float8_e4m3fn)
        with pytest.raises(ValueError, match="q_out_scale"):
            ropekit.apply_rope_(q, k, q_out_scale="dynamic", out_dtype=torch.float8_e4m3fn)
        with pytest.raises(ValueError, match="q_out_scale"):
            ropekit.rope_backward(q, k, q_out_scale="dynamic", out_dtype=torch.float8_e4m3fn)
        with pytest.raises(ValueError, match="positions"):
            ropekit.apply_rope(q, k, positions=-1, q_out_scale="dynamic", out_dtype=torch.float8_e4m3fn)
        assert_unchanged((q, k), before)
        with pytest.raises(RuntimeError, match="inference"):
            ropekit.apply_rope(q.requires_grad_(), k, q_out_scale="dynamic", out_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic-shapes", "static-shapes"])
def test_apply_rope_float8_dynamic_compiles(route, dynamic):
    """torch.compile(fullgraph=True) traces the call (``ropekit::rope_fp8_dynamic``, with fake float8 outputs and
    float32 scales) and equals the eager call bit for bit, over two sequence lengths."""
    apply_rope = ropekit.apply_rope

    def f(q, k, offset):
        return apply_rope(q, k, positions=offset, rotary_dim=8, out_dtype=torch.float8_e4m3fn, q_out_scale="dynamic")

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    with on_route(route) as dev, torch.no_grad():
        for seq, offset in ((3, 2), (5, 7)):
            q = torch.randn(1, seq, HQ, D, dtype=torch.bfloat16, device=dev)
            k = torch.randn(1, seq, HK, D, dtype=torch.bfloat16, device=dev)
            got, want = compiled(q, k, offset), f(q, k, offset)
            assert len(got) == len(want) == 4
            for g, w in zip(got, want):
                assert same_bits(g, w)


def _same_as_eager(f, args_per_call, dynamic, route):
    """torch.compile(fullgraph=True, dynamic=...) of ``f`` equals eager ``f`` bit for bit on each call's args."""
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    with torch.no_grad():
        for args in args_per_call:
            got, want = compiled(*args), f(*args)
            got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert same_bits(g, w)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic-shapes", "static-shapes"])
@pytest.mark.parametrize("dtype", FP8)
def test_float8_outputs_compile(route, dynamic, dtype):
    """apply_rope's static float8 outputs and qk_norm_rope's (float scale, 0-d tensor scale, dynamic scales) trace
    without graph breaks and equal their eager calls, over two sequence lengths and scales."""
    apply_rope, qk_norm_rope = ropekit.apply_rope, ropekit.qk_norm_rope

    def f(q, k, w, scale, offset):
        static = apply_rope(q, k, positions=offset, q_scale=scale, out_dtype=dtype, rotary_dim=8)
        normed = qk_norm_rope(q, k, w, w, positions=offset, out_dtype=dtype, q_out_scale=scale,
                              k_out_scale=torch.full((), 2.0, device=q.device))
        dyn = qk_norm_rope(q, k, w, w, positions=offset, out_dtype=dtype, q_out_scale="dynamic")
        return (*static, *normed, *dyn)

    with on_route(route) as dev:
        calls = []
        for seq, scale, offset in ((3, 0.5, 2), (5, 0.25, 7)):
            q = torch.randn(1, seq, HQ, D, dtype=torch.bfloat16, device=dev)
            k = torch.randn(1, seq, HK, D, dtype=torch.bfloat16, device=dev)
            calls.append((q, k, 1.0 + 0.1 * torch.randn(D, device=dev), scale, offset))
        _same_as_eager(f, calls, dynamic, route)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic-shapes", "static-shapes"])
@pytest.mark.parametrize("q_out_scale", ["float", "0-d", "dynamic"])
def test_rope_kv_write_float8_compiles(route, dynamic, q_out_scale):
    """rope_kv_write's float8 q (float, 0-d tensor or dynamic scale) with the rotated k returned, into float8
    paged caches: traced without graph breaks, its outputs and the caches' bytes equal the eager call's."""
    rope_kv_write = ropekit.rope_kv_write
    dtype = torch.float8_e4m3fn

    def f(q, k, v, k_cache, v_cache, slots, scale):
        return rope_kv_write(q, k, v, k_cache, v_cache, positions=slots, slot_mapping=slots, cache_layout="paged",
                             k_cache_scale=0.5, out_dtype=dtype, q_out_scale=scale, return_k=True)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    with on_route(route) as dev, torch.no_grad():
        for tokens in (3, 5):
            q = torch.randn(tokens, HQ, D, dtype=torch.bfloat16, device=dev)
            k, v = (torch.randn(tokens, HK, D, dtype=torch.bfloat16, device=dev) for _ in range(2))
            slots = torch.randperm(16)[:tokens].to(dev)
            scale = {"float": 0.25, "0-d": torch.tensor(0.25, device=dev), "dynamic": "dynamic"}[q_out_scale]
            caches = [torch.zeros(2, 8, HK, D, dtype=dtype, device=dev) for _ in range(4)]
            got = compiled(q, k, v, caches[0], caches[1], slots, scale)
            want = f(q, k, v, caches[2], caches[3], slots, scale)
            assert len(got) == len(want) == (3 if q_out_scale == "dynamic" else 2)
            for g, w in zip((*got, caches[0], caches[1]), (*want, caches[2], caches[3])):
                assert same_bits(g, w)
            assert caches[0].float().any()


@pytest.mark.parametrize("route", ROUTES)
def test_opcheck_float8_ops(route):
    """opcheck of the float8 ops: schema, fake outputs (float8 dtype, float32 scales and their shapes) and, where
    the route can trace with fake tensors (not the interpreter), AOT dispatch with dynamic shapes."""
    from torch.library import opcheck

    from ropekit import ops
    from ropekit._cache_validation import validate_kv_write
    from ropekit._spec import CacheArgs, OutQuant, RopeArgs
    from ropekit._validation import validate_args

    checks = ("test_schema", "test_faketensor") + (() if route == "cpu-kernels" else ("test_aot_dispatch_dynamic",))
    dtype = torch.float8_e4m3fn
    with on_route(route) as dev:
        q = torch.randn(1, 3, HQ, D, dtype=torch.bfloat16, device=dev)
        k = torch.randn(1, 3, HK, D, dtype=torch.bfloat16, device=dev)
        w = torch.ones(D, device=dev)
        spec = validate_args(q, k, RopeArgs(positions=4, rotary_dim=8, out_dtype=dtype))
        opcheck(torch.ops.ropekit.rope_fp8_dynamic.default, (q, k, *spec), test_utils=checks)
        spec = spec._replace(out_dtype=None)
        for quant in (OutQuant(dtype, 0.5, torch.tensor(2.0, device=dev)), OutQuant(dtype, None, None, True)):
            opcheck(torch.ops.ropekit.qk_norm_rope_fp8.default,
                    (q, k, w, w, 0.0, 1e-6, *ops.qk_norm_rope_fp8_args(quant), *spec), test_utils=checks)
        qt, kt, vt = (torch.randn(3, h, D, device=dev) for h in (HQ, HK, HK))
        # float32 caches: the schema check compares mutated arguments by arithmetic float8 lacks on the CPU
        k_cache, v_cache = (torch.zeros(2, 4, HK, D, device=dev) for _ in range(2))
        q4, k4, v4, rope_args, cache = validate_kv_write(
            qt, kt, CacheArgs(vt, k_cache, v_cache, slot_mapping=torch.tensor([5, -1, 0], device=dev),
                              cache_layout="paged"), RopeArgs(positions=torch.tensor([1, 2, 3], device=dev)))
        spec = validate_args(q4, k4, rope_args)
        for quant in (OutQuant(dtype, 0.25), OutQuant(dtype, None, None, True), None):
            opcheck(torch.ops.ropekit.rope_kv_write_outputs.default,
                    (q4, k4, v4, k_cache, v_cache, None, None, 0.0, 1e-6, *ops.cache_op_args(cache),
                     *ops.kv_quant_args(quant), True, *spec), test_utils=checks)
