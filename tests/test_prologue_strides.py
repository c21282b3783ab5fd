"""rope_kv_write into caches whose strides differ: every stride combination the cache layouts allow, k and v each
with their own (padded views, head-major views, halves of one buffer, float8 caches), written by the kernels as by
the float64 reference -- and nothing else of the caches' buffers, padding included, touched.

The kernels run under the Triton interpreter on CPU (``kernels_on_cpu``) and on CUDA. The oracle is the float64 CPU
path on float64 copies of the inputs, writing into float64 buffers of the same geometry; every buffer starts
poisoned (NaN; float8: e4m3fn's NaN byte), so a row written where it should not be, or not written, shows.

Strided norm weights and frequencies too: the kernels index them densely, so they are read as contiguous copies.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import ropekit
from helpers import INTERPRETED, KERNEL_ROUTES, route_context, route_device
from ropekit import _fastpath
from ropekit.testing import kernels_on_cpu, tolerance

FP8 = torch.float8_e4m3fn
FP8_NAN_BYTE = 0x7F
HQ, HK, D = 2, 2, 16
# cache_layout -> (rows grid [R0, R1] of the caches, how each call draws its tokens)
LAYOUTS = {
    "bshd": (2, 8),  # 4-D prefill [B=2, S=3] at per-sequence offsets
    "bhsd": (3, 6),  # 3-D decode, one token per sequence at its position
    "paged": (4, 8),  # 3-D tokens into slots, one skipped (-1)
}
# How a cache's [R0, R1, H, D] (bhsd: [R0, H, R1, D]) view sits in its buffer.
VARIANTS = ("contiguous", "padded-head-dim", "padded-rows", "padded-heads", "transposed", "half-of-kv",
            "fp8", "fp8-transposed")


def _logical_shape(layout: str, rows: tuple[int, int]) -> tuple[int, int, int, int]:
    r0, r1 = rows
    return (r0, HK, r1, D) if layout == "bhsd" else (r0, r1, HK, D)


def _geometry(variant: str, layout: str, rows: tuple[int, int]):
    """(buffer shape, view of a buffer as the cache): the cache's view ``[R0, R1, H, D]`` (bhsd: ``[R0, H, R1, D]``)
    of a buffer laid out as ``variant`` says."""
    shape = _logical_shape(layout, rows)
    r0, a, b, d = shape  # a, b: the two middle dims in the layout's order
    if variant in ("contiguous", "fp8"):
        return shape, lambda buf: buf
    if variant == "padded-head-dim":  # rows wider than D: [..., :D] of a wider buffer
        return (r0, a, b, 2 * d), lambda buf: buf[..., :d]
    if variant == "padded-rows":  # more rows per entry than the view shows
        return (r0, a + 3, b, d) if layout != "bhsd" else (r0, a, b + 3, d), (
            (lambda buf: buf[:, :a]) if layout != "bhsd" else (lambda buf: buf[:, :, :b]))
    if variant == "padded-heads":  # a slice of the heads of a wider buffer (its row stride is not H * D)
        return (r0, a, b + 1, d) if layout != "bhsd" else (r0, a + 1, b, d), (
            (lambda buf: buf[:, :, :b]) if layout != "bhsd" else (lambda buf: buf[:, :a]))
    if variant in ("transposed", "fp8-transposed"):  # the other of HND / NHD in memory
        return (r0, b, a, d), lambda buf: buf.transpose(1, 2)
    if variant == "half-of-kv":  # one half of a [R0, 2, ...] buffer (vLLM's key/value blocks)
        return (r0, 2, a, b, d), lambda buf: buf[:, 1]
    raise AssertionError(variant)


def _dtype(variant: str, dtype: torch.dtype) -> torch.dtype:
    return FP8 if variant.startswith("fp8") else dtype


def _poisoned(shape, dtype, device) -> torch.Tensor:
    if dtype == FP8:
        return torch.full(shape, FP8_NAN_BYTE, dtype=torch.uint8, device=device).view(FP8)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _caches(k_variant: str, v_variant: str, layout: str, dtype, device):
    """(buffers, k_cache, v_cache) poisoned on ``device``, and the same geometry in float64 for the reference.
    Both "half-of-kv": the two halves of one buffer."""
    rows = LAYOUTS[layout]
    shared = k_variant == v_variant == "half-of-kv"
    out = []
    for variant in (k_variant, v_variant):
        shape, view = _geometry(variant, layout, rows)
        out.append((shape, view, _dtype(variant, dtype)))
    if shared:
        (shape, _, dt), _ = out
        buf, buf64 = _poisoned(shape, dt, device), _poisoned(shape, torch.float64, "cpu")
        return ([buf], buf[:, 0], buf[:, 1]), ([buf64], buf64[:, 0], buf64[:, 1])
    bufs = [_poisoned(shape, dt, device) for shape, _, dt in out]
    bufs64 = [_poisoned(shape, torch.float64, "cpu") for shape, _, _ in out]
    (_, k_view, _), (_, v_view, _) = out
    return (bufs, k_view(bufs[0]), v_view(bufs[1])), (bufs64, k_view(bufs64[0]), v_view(bufs64[1]))


def _call(layout: str, dtype, device) -> tuple:
    """Fresh inputs of one call: (q, k, v, keywords)."""
    def draw(*shape):
        return torch.randn(*shape, dtype=torch.float64).to(dtype=dtype, device=device)

    r0, r1 = LAYOUTS[layout]
    if layout == "bshd":
        B, S = r0, 3
        q, k, v = draw(B, S, HQ, D), draw(B, S, HK, D), draw(B, S, HK, D)
        offsets = torch.randint(0, r1 - S + 1, (B,), device=device)
        return q, k, v, dict(positions=offsets)
    if layout == "bhsd":
        T = r0
        q, k, v = draw(T, HQ, D), draw(T, HK, D), draw(T, HK, D)
        return q, k, v, dict(positions=torch.randint(0, r1, (T,), device=device))
    slots = torch.randperm(r0 * r1)[:5]
    slots[2] = -1
    q, k, v = draw(5, HQ, D), draw(5, HK, D), draw(5, HK, D)
    return q, k, v, dict(positions=torch.randint(0, 1000, (5,), device=device), slot_mapping=slots.to(device))


def _scales(k_cache, v_cache) -> dict:
    """float8 caches' scales: k's any float, v's a power of two (v's stores are then exact)."""
    scales = {}
    if k_cache.dtype == FP8:
        scales["k_cache_scale"] = 0.37
    if v_cache.dtype == FP8:
        scales["v_cache_scale"] = 2.0
    return scales


def _bits(x: torch.Tensor) -> torch.Tensor:
    sizes = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return x.detach().cpu().contiguous().view(sizes[x.element_size()])


def _check_view(got: torch.Tensor, want64: torch.Tensor, scale: float, exact: bool, backend: str) -> None:
    """The rows the reference wrote (not NaN in ``want64``) hold its values: within the kernels' tolerance, or
    (``exact``: v) exactly as a cast of the input stores them."""
    written = ~torch.isnan(want64)
    got = got.detach().cpu()
    want = want64[written]
    if got.dtype == FP8:
        quantized = (want / scale).clamp(-448.0, 448.0)
        stored = got[written].float().double()
        if exact:
            assert torch.equal(stored, quantized.float().to(FP8).double())
        else:
            tol = tolerance(FP8, backend)
            torch.testing.assert_close(stored, quantized, rtol=tol.rtol, atol=tol.atol)
        return
    if exact:
        assert torch.equal(got[written].double(), want), "v must be stored bit for bit"
        return
    tol = tolerance(got.dtype, backend)
    torch.testing.assert_close(got[written].double(), want, rtol=tol.rtol, atol=tol.atol)


def _check_buffers(bufs, bufs64) -> None:
    """Every element of each buffer that the reference left poisoned (padding, other rows, skipped tokens) keeps its
    poison bits."""
    for buf, buf64 in zip(bufs, bufs64):
        untouched = torch.isnan(buf64)
        poison = _poisoned(buf.shape, buf.dtype, "cpu")
        assert torch.equal(_bits(buf)[untouched], _bits(poison)[untouched]), "an element no token maps to changed"


def _run_and_check(route: str, layout: str, k_variant: str, v_variant: str, dtype, calls: int = 1) -> None:
    """``calls`` calls with fresh caches and inputs, each checked against the reference; inside the route's context
    (the reference's float64 inputs take the float64 path there too)."""
    device = route_device(route)
    backend = "triton-interpreter" if route == "cpu-kernels" else "kernels"
    for _ in range(calls):
        (bufs, k_cache, v_cache), (bufs64, k64, v64) = _caches(k_variant, v_variant, layout, dtype, device)
        assert k_cache.shape == v_cache.shape == k64.shape
        assert k_cache.stride() == k64.stride() and v_cache.stride() == v64.stride()
        q, k, v, kw = _call(layout, dtype, device)
        scales = _scales(k_cache, v_cache)
        with torch.no_grad():
            want_q = ropekit.rope_kv_write(*(x.cpu().double() for x in (q, k, v)), k64, v64, cache_layout=layout,
                                           **{n: t.cpu() for n, t in kw.items()})
            got_q = ropekit.rope_kv_write(q, k, v, k_cache, v_cache, cache_layout=layout, **kw, **scales)
        tol = tolerance(dtype, backend)
        torch.testing.assert_close(got_q.cpu().double(), want_q, rtol=tol.rtol, atol=tol.atol)
        _check_view(k_cache, k64, scales.get("k_cache_scale", 1.0), False, backend)
        _check_view(v_cache, v64, scales.get("v_cache_scale", 1.0), True, backend)
        _check_buffers(bufs, bufs64)


PAIRS = [(kv, "contiguous") for kv in VARIANTS[1:]] + [("contiguous", kv) for kv in VARIANTS[1:]] + [
    ("padded-head-dim", "transposed"), ("transposed", "padded-head-dim"), ("half-of-kv", "half-of-kv"),
    ("padded-rows", "padded-heads"), ("fp8-transposed", "fp8"), ("fp8", "padded-head-dim"),
    ("padded-heads", "fp8-transposed"),
]


@pytest.mark.parametrize("route", KERNEL_ROUTES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("k_variant, v_variant", PAIRS, ids=[f"k-{a}-v-{b}" for a, b in PAIRS])
def test_caches_with_their_own_strides_are_written_right(route, layout, k_variant, v_variant):
    """k and v caches of one shape whose strides differ get each token's k and v at its own row of each cache --
    never v at k's row offset, never past the end of the narrower buffer."""
    with route_context(route):
        _run_and_check(route, layout, k_variant, v_variant, torch.float16)


@pytest.mark.parametrize("route", KERNEL_ROUTES)
def test_padded_k_cache_and_dense_v_cache_paged(route):
    """The paged repro: k_cache a [..., :64] view of rows of 128, v_cache dense, four tokens at slots 0, 9, 17, 30
    (v went to k's row offsets, past the end of v_cache)."""
    device = route_device(route)
    k_buf = torch.full((4, 8, 2, 128), float("nan"), dtype=torch.float16, device=device)
    k_cache = k_buf[..., :64]
    v_cache = torch.full((4, 8, 2, 64), float("nan"), dtype=torch.float16, device=device)
    q, k, v = (torch.randn(4, h, 64, dtype=torch.float64).half().to(device) for h in (4, 2, 2))
    slots = torch.tensor([0, 9, 17, 30], device=device)
    with torch.no_grad(), route_context(route):
        ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=torch.arange(4, device=device),
                              cache_layout="paged", slot_mapping=slots)
    rows = v_cache.view(-1, 2, 64)
    assert torch.equal(_bits(rows[slots.cpu()]), _bits(v))
    others = torch.ones(32, dtype=torch.bool)
    others[slots.cpu()] = False
    assert torch.isnan(rows[others.to(device)].float()).all()
    assert torch.isnan(k_buf[..., 64:].float()).all()


@pytest.mark.parametrize("route", KERNEL_ROUTES)
@pytest.mark.parametrize("layout", ["bshd", "paged"])
def test_plans_are_per_v_cache_strides(route, layout):
    """A launch plan recorded for one v_cache stride set is not replayed for another: three calls with dense caches
    (the second records a plan, the third replays it), then three with a head-major v_cache of the same shape --
    each checked against the reference; two plans at the end."""
    with route_context(route):
        _fastpath.clear()
        _run_and_check(route, layout, "contiguous", "contiguous", torch.float16, calls=3)
        _run_and_check(route, layout, "contiguous", "transposed", torch.float16, calls=3)
        _run_and_check(route, layout, "contiguous", "padded-heads", torch.float16, calls=3)
        assert len(_fastpath._KV_PLANS) == 3
        _fastpath.clear()


def _strided(n):
    return torch.randn(2 * n)[::2]  # a [n] view with stride 2


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_strided_norm_weights_and_frequencies():
    """Norm weights and inv_freq that are strided views: the kernels index them densely, so they are read as
    contiguous copies (forward, backward and rope_kv_write agree with the torch path)."""
    torch.manual_seed(0)
    T, HQ, HK, D = 2, 2, 1, 8
    q, k, v = (torch.randn(T, h, D).unsqueeze(1) for h in (HQ, HK, HK))
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
