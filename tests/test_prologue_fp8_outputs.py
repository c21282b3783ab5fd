"""float8 outputs of the attention prologue (``out_dtype=torch.float8_e4m3fn`` / ``float8_e5m2``): qk_norm_rope's q
and k, rope_kv_write's q, with static scales (float, 0-d or [1] tensor) or dynamic per-(token, head) scales; float8_e5m2
caches and per-head cache scales. Each route (float32 CPU path, the kernels under the interpreter, CUDA) against a
float64 oracle written here from the definition: stored = value / scale, one rounding to the format (the
TOLERANCES row of the float8 dtype: half an ulp of its mantissa), saturated to its largest finite value."""

from __future__ import annotations

import pytest
import torch

import ropekit
from helpers import (
    KERNEL_ROUTES,
    ROUTES,
    assert_unchanged,
    cos_sin64,
    on_route,
    rms64,
    rotate64,
    same_bits,
    snapshot,
)
from ropekit import _fastpath
from ropekit.testing import assert_close_to_ref

FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
T, HQ, HK, D, EPS = 5, 3, 2, 16, 1e-6
BACKEND = {"cpu": "float32-path", "cpu-kernels": "triton-interpreter", "cuda": "kernels"}


def _inputs(device, dtype=torch.float32):
    q, k, v = (torch.randn(T, h, D, dtype=torch.float64).to(dtype=dtype, device=device) for h in (HQ, HK, HK))
    wq, wk = (1.0 + 0.3 * torch.randn(D, dtype=torch.float64)).to(device), (0.8 + 0.3 * torch.rand(D)).to(device)
    positions = torch.randint(0, 50, (T,)).to(device)
    return q, k, v, wq, wk, positions


def _rotated64(x, w, positions):
    """The float64 oracle: per-head RMSNorm (w given) then RoPE (base 10000, neox) of [T, H, D] ``x``."""
    x = rms64(x, w, EPS, 0.0) if w is not None else x.cpu().double()
    cos, sin = cos_sin64(positions.cpu(), D, {})
    return rotate64(x, cos, sin)


def _clamped(y, dtype):
    return y.clamp(-FP8_MAX[dtype], FP8_MAX[dtype])


def _scale_arg(kind, value, device):
    return {"float": value, "0-d": torch.tensor(value, device=device),
            "[1]": torch.tensor([value], device=device)}[kind]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scales", [("float", "0-d"), ("[1]", "float")], ids=["float-0d", "1-float"])
def test_qk_norm_rope_float8_static(route, dtype, scales):
    """q_out = rope(norm(q)) / q_out_scale and k_out likewise, each one rounding from the float64 oracle; a small
    scale saturates (e4m3: +-448)."""
    with on_route(route) as dev:
        q, k, _, wq, wk, positions = _inputs(dev)
        sq, sk = 0.004, 0.5  # q's values reach ~3 / 0.004 = 750: e4m3 saturates them
        with torch.no_grad():
            q_out, k_out = ropekit.qk_norm_rope(q, k, wq, wk, eps=EPS, positions=positions, layout="thd",
                                                out_dtype=dtype, q_out_scale=_scale_arg(scales[0], sq, dev),
                                                k_out_scale=_scale_arg(scales[1], sk, dev))
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert_close_to_ref(q_out, _clamped(_rotated64(q, wq, positions) / sq, dtype), dtype, BACKEND[route])
    assert_close_to_ref(k_out, _clamped(_rotated64(k, wk, positions) / sk, dtype), dtype, BACKEND[route])
    if dtype == torch.float8_e4m3fn:
        assert (q_out.float().abs() == 448.0).any()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", FP8)
def test_qk_norm_rope_float8_dynamic(route, dtype):
    """Dynamic scales: per (token, head) ``max |row| / fp8 max`` (float32, q's and k's shape without D), and each
    row stored divided by its scale (one rounding; the row's largest element lands on the format's max)."""
    with on_route(route) as dev:
        q, k, _, wq, wk, positions = _inputs(dev, torch.bfloat16)
        q4, k4 = q.view(1, T, HQ, D), k.view(1, T, HK, D)  # [B, S, H, D]
        with torch.no_grad():
            q_out, k_out, q_scales, k_scales = ropekit.qk_norm_rope(
                q4, k4, wq, wk, eps=EPS, positions=positions.view(1, T), out_dtype=dtype, q_out_scale="dynamic")
    for x, w, out, scales in ((q, wq, q_out, q_scales), (k, wk, k_out, k_scales)):
        y = _rotated64(x, w, positions).view(out.shape)
        assert scales.dtype == torch.float32 and scales.shape == out.shape[:-1]
        assert_close_to_ref(scales, y.abs().amax(-1) / FP8_MAX[dtype], torch.float32, BACKEND[route])
        assert_close_to_ref(out, y / scales.cpu().double()[..., None], dtype, BACKEND[route])
        assert torch.equal(out.float().abs().amax(-1).cpu(), torch.full(out.shape[:-1], FP8_MAX[dtype]))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_rope_kv_write_float8_q_and_caches(route, dtype, dynamic):
    """rope_kv_write's float8 q (static or dynamic scale) beside float8 caches of the same kind with per-head
    ([Hkv]) k scales and a [1] v scale, into a paged cache: q, the k rows and the v rows each within one
    rounding of the float64 oracle; unwritten slots keep their bytes."""
    with on_route(route) as dev:
        q, k, v, wq, wk, positions = _inputs(dev, torch.float16)
        slots = torch.tensor([3, 17, -1, 8, 30], device=dev)
        k_cache = torch.zeros(4, 8, HK, D, dtype=dtype, device=dev)
        v_cache = torch.zeros_like(k_cache)
        k_scales, v_scale = torch.tensor([0.5, 2.0], device=dev), torch.tensor([0.25], device=dev)
        with torch.no_grad():
            got = ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=positions, slot_mapping=slots,
                                        cache_layout="paged", q_weight=wq, k_weight=wk, eps=EPS,
                                        k_cache_scale=k_scales, v_cache_scale=v_scale, out_dtype=dtype,
                                        q_out_scale="dynamic" if dynamic else 0.75)
    y = _rotated64(q, wq, positions)
    if dynamic:
        q_out, q_scales = got
        assert q_scales.shape == (T, HQ)
        assert_close_to_ref(q_scales, y.abs().amax(-1) / FP8_MAX[dtype], torch.float32, BACKEND[route])
        assert_close_to_ref(q_out, y / q_scales.cpu().double()[..., None], dtype, BACKEND[route])
    else:
        assert_close_to_ref(got, _clamped(y / 0.75, dtype), dtype, BACKEND[route])
    written = slots.cpu() >= 0
    kc, vc = k_cache.view(-1, HK, D).cpu(), v_cache.view(-1, HK, D).cpu()
    ky = _rotated64(k, wk, positions) / k_scales.cpu().double()[:, None]
    assert_close_to_ref(kc[slots.cpu()[written]], _clamped(ky[written], dtype), dtype, BACKEND[route])
    assert_close_to_ref(vc[slots.cpu()[written]], _clamped(v.cpu().double()[written] / 0.25, dtype), dtype,
                        BACKEND[route])
    untouched = torch.ones(kc.shape[0], dtype=torch.bool)
    untouched[slots.cpu()[written]] = False
    assert not kc[untouched].float().any() and not vc[untouched].float().any()


@pytest.mark.parametrize("route", KERNEL_ROUTES)
def test_float8_e5m2_caches_store_nan_and_saturate(route):
    """A float8_e5m2 cache stores NaN as NaN and saturates at +-57344 (not inf), as the reference does."""
    with on_route(route) as dev:
        q, k, v, _, _, positions = _inputs(dev)
        v[0, 0, 3] = float("nan")
        v[1, 1, 2], v[2, 0, 0] = 1e6, -1e6
        caches = [torch.zeros(T, 64, HK, D, dtype=torch.float8_e5m2, device=dev) for _ in range(2)]
        with torch.no_grad():
            ropekit.rope_kv_write(q, k, v, *caches, positions=positions)
    rows = caches[1].float().cpu()[torch.arange(T), positions.cpu()]
    assert torch.isnan(rows[0, 0, 3]) and torch.isnan(rows).sum() == 1
    assert rows[1, 1, 2] == 57344.0 and rows[2, 0, 0] == -57344.0


def _bad_cases():
    """(id, keyword overrides, error, words the message names)."""
    return [
        ("q_out_scale shape [2]", dict(q_out_scale=lambda d: torch.tensor([1.0, 2.0], device=d)), ValueError,
         "q_out_scale"),
        ("q_out_scale int tensor", dict(q_out_scale=lambda d: torch.tensor([2], device=d)), ValueError,
         "q_out_scale"),
        ("q_out_scale <= 0", dict(q_out_scale=-1.0), ValueError, "q_out_scale"),
        ("q_out_scale word", dict(q_out_scale="dyn"), ValueError, "q_out_scale"),
        ("q_out_scale without float8", dict(out_dtype=None, q_out_scale=2.0), ValueError, "q_out_scale"),
        ("out_dtype int8", dict(out_dtype=torch.int8), TypeError, "out_dtype"),
        ("k_cache_scale shape [3]", dict(k_cache_scale=lambda d: torch.ones(3, device=d)), ValueError,
         "k_cache_scale"),
    ]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_float8_bad_input_writes_nothing(route, case):
    """Bad float8 arguments raise an error naming the argument before anything is written (caches unchanged)."""
    _, overrides, error, words = case
    with on_route(route) as dev:
        q, k, v, wq, wk, positions = _inputs(dev)
        caches = [torch.full((T, 64, HK, D), 7.0, device=dev).to(torch.float8_e4m3fn) for _ in range(2)]
        kw = dict(out_dtype=torch.float8_e4m3fn, q_out_scale=1.0, k_cache_scale=1.0)
        kw.update({name: value(dev) if callable(value) else value for name, value in overrides.items()})
        before = snapshot(*caches)
        with torch.no_grad(), pytest.raises(error, match=words):
            ropekit.rope_kv_write(q, k, v, *caches, positions=positions, **kw)
    assert_unchanged(caches, before)


@pytest.mark.parametrize("route", ROUTES)
def test_float8_outputs_refuse_grad_and_mixed_dynamic(route):
    """float8 outputs are inference only: q requiring grad raises (RuntimeError naming float8); a dynamic k scale
    needs a dynamic q scale."""
    with on_route(route) as dev:
        q, k, _, wq, wk, positions = _inputs(dev)
        with pytest.raises(RuntimeError, match="float8"):
            ropekit.qk_norm_rope(q.requires_grad_(), k, wq, wk, positions=positions, layout="thd",
                                 out_dtype=torch.float8_e4m3fn)
        with torch.no_grad(), pytest.raises(ValueError, match="k_out_scale"):
            ropekit.qk_norm_rope(q, k, wq, wk, positions=positions, layout="thd", out_dtype=torch.float8_e5m2,
                                 q_out_scale=1.0, k_out_scale="dynamic")


@pytest.mark.parametrize("route", KERNEL_ROUTES)
def test_float8_q_matches_the_unquantized_call(route):
    """The float8 q of rope_kv_write is the float32 q the same call returns without out_dtype, rounded once: with
    scale 1 and e4m3, the unquantized output converted by torch (saturating) gives the same bytes, where no value
    lies within the math's error of a rounding tie (checked: the float32 values themselves)."""
    with on_route(route) as dev:
        q, k, v, wq, wk, positions = _inputs(dev)
        caches = [torch.zeros(T, 64, HK, D, device=dev) for _ in range(2)]
        with torch.no_grad():
            plain = ropekit.rope_kv_write(q, k, v, *caches, positions=positions, q_weight=wq, k_weight=wk)
            fp8 = ropekit.rope_kv_write(q, k, v, *caches, positions=positions, q_weight=wq, k_weight=wk,
                                        out_dtype=torch.float8_e4m3fn)
    want = plain.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert same_bits(fp8, want)


# ------------------------------------------------------------------------------------ apply_rope's float8 outputs

@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", FP8)
def test_apply_rope_float8(route, dtype):
    """apply_rope(out_dtype=float8): the rotation times q_scale / k_scale (FlashInfer's quant scales multiply),
    rounded once, saturated; a partial rotary's pass-through columns too."""
    with on_route(route) as dev:
        q, k, _, _, _, positions = _inputs(dev, torch.bfloat16)
        with torch.no_grad():
            q_out, k_out = ropekit.apply_rope(q, k, positions=positions, layout="thd", rotary_dim=8, out_dtype=dtype,
                                              q_scale=200.0, k_scale=0.5)
    cos, sin = cos_sin64(positions.cpu(), D, {"rotary_dim": 8})
    for x, out, scale in ((q, q_out, 200.0), (k, k_out, 0.5)):
        want = rotate64(x.cpu().double(), cos, sin, rotary_dim=8, scale=scale)
        assert_close_to_ref(out, _clamped(want, dtype), dtype, BACKEND[route])


@pytest.mark.parametrize("route", KERNEL_ROUTES)
@pytest.mark.parametrize("dtype", FP8)
def test_apply_rope_float8_replayed_plan_matches_the_full_path(route, dtype):
    """A float8 apply_rope call replayed from its launch plan (third call of a signature) gives the full path's
    bytes, for an int offset that changes between calls."""
    with on_route(route, clear_plans=True) as dev:
        q, k, _, _, _, _ = _inputs(dev)
        q, k = q.view(1, T, HQ, D), k.view(1, T, HK, D)
        outs = [ropekit.apply_rope(q, k, positions=p, out_dtype=dtype, q_scale=30.0) for p in (3, 4, 7)]
        assert len(_fastpath._PLANS) == 1  # the third call was replayed
        ropekit.set_fast_path(False)
        try:
            full = ropekit.apply_rope(q, k, positions=7, out_dtype=dtype, q_scale=30.0)
        finally:
            ropekit.set_fast_path(True)
    assert same_bits(outs[2][0], full[0]) and same_bits(outs[2][1], full[1])


@pytest.mark.parametrize("route", ROUTES)
def test_apply_rope_float8_refused_where_it_cannot_hold(route):
    """float8 outputs are forward, out of place and without autograd: apply_rope_ (ValueError), rope_backward and
    inputs that require grad (RuntimeError) raise, naming out_dtype."""
    with on_route(route) as dev:
        q, k, _, _, _, positions = _inputs(dev)
        kw = dict(positions=positions, layout="thd", out_dtype=torch.float8_e4m3fn)
        before = snapshot(q, k)
        with pytest.raises(ValueError, match="out_dtype"):
            ropekit.apply_rope_(q, k, **kw)
        assert_unchanged((q, k), before)
        with pytest.raises(RuntimeError, match="out_dtype"):
            ropekit.rope_backward(q, k, **kw)
        with pytest.raises(RuntimeError, match="out_dtype"):
            ropekit.apply_rope(q.requires_grad_(), k, **kw)


def test_readme_float8_example_runs():
    """The README's float8 example, run as written on CPU tensors, gives what the float8 calls document."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = readme.split("**float8 outputs for FP8 attention.**")[1].split("```python")[1].split("```")[0]
    q, k, v, wq, wk, positions = _inputs("cpu")
    k_cache = torch.zeros(4, 8, HK, D, dtype=torch.float8_e4m3fn)
    scope = dict(torch=torch, ropekit=ropekit, q=q, k=k, v=v, q_norm_w=wq, k_norm_w=wk, pos=positions,
                 k_cache=k_cache, v_cache=torch.zeros_like(k_cache), slots=torch.tensor([0, 5, 9, 17, 30]),
                 q_scale=torch.tensor([0.5]), k_scale=torch.tensor(0.25), v_scale=2.0)
    with torch.no_grad():
        exec(code, scope)
    assert scope["q8"].dtype == torch.float8_e4m3fn and scope["q8"].shape == q.shape
    assert scope["q_scales"].shape == (T, HQ) and scope["k_scales"].shape == (T, HK)
    assert k_cache.view(-1, HK, D)[[0, 5, 9, 17, 30]].float().abs().amax() > 0


@pytest.mark.parametrize("route", KERNEL_ROUTES)
@pytest.mark.parametrize("q_scale", ["dynamic", "tensor", "float"])
def test_rope_kv_write_float8_replayed_plan_matches_the_full_path(route, q_scale):
    """rope_kv_write with a float8 q (dynamic, device-tensor or float scale), float8 caches with per-head scales and
    the rotated k returned: the third call of a signature, replayed from its launch plan, gives the full path's
    bytes in every output and cache."""
    with on_route(route, clear_plans=True) as dev:
        q, k, v, wq, wk, positions = _inputs(dev, torch.bfloat16)
        scale = {"dynamic": "dynamic", "tensor": torch.tensor([0.5], device=dev), "float": 0.25}[q_scale]
        kw = dict(positions=positions, slot_mapping=torch.tensor([3, 17, 8], device=dev), cache_layout="paged",
                  q_weight=wq, k_weight=wk, k_cache_scale=torch.tensor([0.5, 2.0], device=dev), v_cache_scale=0.25,
                  out_dtype=torch.float8_e5m2, q_out_scale=scale, return_k=True)

        def call():
            caches = [torch.zeros(4, 8, HK, D, dtype=torch.float8_e4m3fn, device=dev) for _ in range(2)]
            with torch.no_grad():
                return ropekit.rope_kv_write(q, k, v, *caches, **kw), caches

        for _ in range(3):
            planned, planned_caches = call()
        assert len(_fastpath._KV_PLANS) == 1
        previous = ropekit.set_fast_path(False)
        try:
            full, full_caches = call()
        finally:
            ropekit.set_fast_path(previous)
    assert len(planned) == len(full) == (3 if q_scale == "dynamic" else 2)
    for a, b in zip((*planned, *planned_caches), (*full, *full_caches)):
        assert same_bits(a, b)
