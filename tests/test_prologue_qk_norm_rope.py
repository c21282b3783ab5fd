"""``ropekit.qk_norm_rope``: per-head RMSNorm of q and k over the whole head_dim, then the rotation of
``apply_rope``.

Everything is compared against a float64 reference written from the definitions (the RMSNorm formula, the rotation
by ``position * inv_freq``; helpers.py holds the pieces both prologue ops share), with apply_rope's float64 path and
``torch.nn.functional.rms_norm`` as second opinions: forward, gradients (double backward included), torch.compile
and bad input. Devices as in the rest of the suite: the CPU path, the kernels under the Triton interpreter on CPU
(``kernels_on_cpu``, with ``TRITON_INTERPRET=1``) and CUDA. Every call uses fresh random inputs, three calls per
signature (launch caches engage from the second).
"""

from __future__ import annotations

import functools

import pytest
import torch

import ropekit
from helpers import (
    ROUTE_BACKENDS,
    ROUTES,
    assert_unchanged,
    cos_sin64,
    inv_freq64,
    norm_weight,
    on_route,
    rms64,
    rope64,
    rope_opts64,
    rotate64,
    shares_memory,
    snapshot,
)
from ropekit.testing import assert_close_to_ref, make_qk, max_relative_error, max_relative_tolerance, tolerance

DEVICES = ROUTES
CALLS = 3  # the full path, the call that records a launch plan, a replay


def qk_norm_rope(*args, **kwargs):
    return ropekit.qk_norm_rope(*args, **kwargs)  # looked up per call: the tests collect before the op exists


# ------------------------------------------------------------------------------------- float64 reference

def _positions64(layout: str, shape, positions=None, cu_seqlens=None) -> torch.Tensor:
    """int64 positions of every token of a q of ``shape`` in ``layout``: [B, S] (``thd``: [T]); multi-axis
    [A, B, S] / [A, T]. ``positions`` as apply_rope takes it: None, an int offset, per-sequence offsets [B] (``thd``
    with ``cu_seqlens``: [num_seqs]) or per-token ids."""
    if layout == "thd":
        T = shape[0]
        if isinstance(positions, torch.Tensor) and positions.shape[-1] == T:
            return positions.cpu().long()
        index = torch.arange(T)
        offset = 0
        if cu_seqlens is not None:
            cu = cu_seqlens.cpu().long()
            seq = torch.searchsorted(cu, index, right=True) - 1
            index = index - cu[seq]
            if isinstance(positions, torch.Tensor):
                offset = positions.cpu().long()[seq]
        if isinstance(positions, int):
            offset = positions
        return index + offset
    B, S = (shape[0], shape[1]) if layout == "bshd" else (shape[0], shape[2])
    if isinstance(positions, torch.Tensor):
        p = positions.cpu().long()
        if p.dim() == 1:  # per-sequence offsets
            return p[:, None] + torch.arange(S)
        return p.expand(*p.shape[:-2], B, S)
    return (torch.arange(S) + (positions or 0)).expand(B, S)


def qk_norm_rope64(q, k, q_weight, k_weight, *, eps=1e-6, weight_offset=0.0, **opts):
    """The float64 definition of ``qk_norm_rope`` (differentiable): RMSNorm of every head of q and k over D, then
    RoPE with apply_rope's options (layouts bshd/bhsd/thd)."""
    layout = opts.get("layout", "bshd")
    pos = _positions64(layout, q.shape, opts.get("positions"), opts.get("cu_seqlens"))
    cos, sin = cos_sin64(pos, q.shape[-1], opts)
    outs = []
    for x, w, scale in ((q, q_weight, opts.get("q_scale", 1.0)), (k, k_weight, opts.get("k_scale", 1.0))):
        xn = rms64(x, w, eps, weight_offset)
        if layout == "bhsd":
            xn = xn.transpose(1, 2)  # token-major [B, S, H, D]
        y = rotate64(xn, cos, sin, **rope_opts64(opts, scale))
        outs.append(y.transpose(1, 2) if layout == "bhsd" else y)
    return tuple(outs)


def _on_cpu(opts: dict) -> dict:
    return {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in opts.items()}


def _second_opinion(want, q, k, q_weight, k_weight, eps, weight_offset, opts):
    """The float64 reference equals apply_rope's float64 path on the float64-normed inputs (a check of the
    reference itself, not of an output: the two differ by float64 rounding of angles up to ~5000 rad, ~1e-12)."""
    qn, kn = rms64(q, q_weight, eps, weight_offset), rms64(k, k_weight, eps, weight_offset)
    got = ropekit.apply_rope(qn, kn, **_on_cpu(opts))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------------------ forward

# (B, S, Hq, Hkv, D); thd: B = 1, S = T. "positions": how each call draws them.
QK_CASES = {
    "bshd-gqa-offset": dict(shape=(2, 5, 4, 2, 64), layout="bshd", positions="offset"),
    "bshd-ids-interleaved-gemma": dict(shape=(2, 4, 2, 2, 16), layout="bshd", positions="ids", weight_offset=1.0,
                                       eps=1e-5, opts=dict(style="interleaved"), pos_dtype=torch.int32),
    "bshd-packed-views": dict(shape=(1, 5, 4, 2, 16), layout="bshd", positions="ids", packed=True),
    "bhsd-partial-scales": dict(shape=(1, 6, 4, 2, 64), layout="bhsd", positions="ids",
                                opts=dict(rotary_dim=32, q_scale=0.125, k_scale=1.5)),
    "thd-cu_seqlens-offsets": dict(shape=(1, 9, 4, 2, 16), layout="thd", positions="seq-offsets",
                                   cu_seqlens=(0, 4, 9), w_dtype=torch.float32),
    "thd-token-ids": dict(shape=(1, 7, 2, 2, 16), layout="thd", positions="ids", pos_dtype=torch.int32),
    "inv_freq-back-rotary_scale": dict(shape=(1, 4, 2, 2, 16), layout="bshd", positions="ids",
                                       opts=dict(inv_freq="random", rotary_dim=8, rotary_at="back",
                                                 rotary_scale=1.1)),
    "tables": dict(shape=(2, 3, 4, 2, 16), layout="bshd", positions="table-ids", opts=dict(cos="table")),
    "multi-axis": dict(shape=(2, 3, 2, 1, 16), layout="bshd", positions="multi", opts=dict(sections=(2, 3, 3))),
    "base": dict(shape=(1, 4, 4, 4, 16), layout="bhsd", positions="ids", opts=dict(base=500000.0)),
}
QK_PARAMS = [pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}") for name in QK_CASES
             for dtype in (torch.float32, torch.bfloat16)]
QK_PARAMS.append(pytest.param("bshd-gqa-offset", torch.float16, id="bshd-gqa-offset-float16"))
TABLE_ROWS = 48


def _fixed_opts(case: dict, device) -> dict:
    """The case's rope options that stay the same over its calls (tensors drawn once)."""
    opts = dict(case.get("opts", {}))
    D = case["shape"][-1]
    R = opts.get("rotary_dim") or D
    if opts.get("inv_freq") == "random":
        inv = inv_freq64(R) * (1.0 + 0.1 * torch.rand(R // 2, dtype=torch.float64))
        opts["inv_freq"] = inv.float().to(device)
    if opts.get("cos") == "table":
        ang = 6.3 * torch.rand(TABLE_ROWS, R // 2, dtype=torch.float64)
        opts["cos"], opts["sin"] = ang.cos().float().to(device), ang.sin().float().to(device)
    if case["layout"] != "bshd":
        opts["layout"] = case["layout"]
    if case.get("cu_seqlens"):
        opts["cu_seqlens"] = torch.tensor(case["cu_seqlens"], dtype=torch.int32, device=device)
    return opts


def _qk_call(case: dict, dtype, device, opts: dict):
    """Fresh q, k (and positions) for one call of a case."""
    B, S, Hq, Hkv, D = case["shape"]
    layout = case["layout"]
    if case.get("packed"):
        qkv = torch.randn(B, S, (Hq + 2 * Hkv) * D, dtype=torch.float64).to(dtype=dtype, device=device)
        q = qkv[..., : Hq * D].view(B, S, Hq, D)
        k = qkv[..., Hq * D: (Hq + Hkv) * D].view(B, S, Hkv, D)
    else:
        q, k = make_qk(B, S, Hq, Hkv, D, dtype=dtype, device=device, layout=layout)
    pos_dtype = case.get("pos_dtype", torch.int64)
    kind = case["positions"]
    lead = (S,) if layout == "thd" else (B, S)
    if kind == "offset":
        positions = int(torch.randint(0, 5000, ()))
    elif kind == "ids":
        positions = torch.randint(0, 5000, lead)
    elif kind == "table-ids":
        positions = torch.randint(0, TABLE_ROWS, lead)
    elif kind == "seq-offsets":
        positions = torch.randint(0, 5000, (len(case["cu_seqlens"]) - 1,))
    elif kind == "multi":
        positions = torch.randint(0, 5000, (len(opts["sections"]), *lead))
    else:
        raise AssertionError(kind)
    if isinstance(positions, torch.Tensor):
        positions = positions.to(dtype=pos_dtype, device=device)
    weight_offset = case.get("weight_offset", 0.0)
    w_dtype = case.get("w_dtype", dtype)
    q_weight, k_weight = (norm_weight(D, w_dtype, device, weight_offset) for _ in range(2))
    return q, k, q_weight, k_weight, dict(opts, positions=positions)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, dtype", QK_PARAMS)
def test_qk_norm_rope_equals_reference(device, name, dtype):
    """Every rope option apply_rope takes, after the per-head RMSNorm: outputs in the inputs' dtypes, shapes and
    layouts, new tensors, inputs untouched, within the table's tolerance of the float64 definition."""
    case = QK_CASES[name]
    eps, weight_offset = case.get("eps", 1e-6), case.get("weight_offset", 0.0)
    backend = ROUTE_BACKENDS[device]
    with on_route(device) as dev:
        fixed = _fixed_opts(case, dev)
        for _call in range(CALLS):
            q, k, q_weight, k_weight, opts = _qk_call(case, dtype, dev, fixed)
            before = snapshot(q, k, q_weight, k_weight, opts["positions"])
            q_out, k_out = qk_norm_rope(q, k, q_weight, k_weight, eps=eps, weight_offset=weight_offset, **opts)
            assert_unchanged((q, k, q_weight, k_weight, opts["positions"]), before)
            assert q_out.shape == q.shape and k_out.shape == k.shape
            assert q_out.device == q.device and k_out.device == k.device
            assert not shares_memory(q_out, q) and not shares_memory(k_out, k)
            assert not shares_memory(q_out, k) and not shares_memory(k_out, q)
            want = qk_norm_rope64(q, k, q_weight, k_weight, eps=eps, weight_offset=weight_offset, **opts)
            _second_opinion(want, q, k, q_weight, k_weight, eps, weight_offset, opts)
            assert_close_to_ref(q_out, want[0], dtype, backend)
            assert_close_to_ref(k_out, want[1], dtype, backend)


@pytest.mark.parametrize("device", DEVICES)
def test_qk_norm_rope_equals_torch_rms_norm_then_apply_rope(device):
    """torch's own rms_norm (float64) then apply_rope's float64 path, as an oracle independent of the reference
    written here; Gemma's (1 + w) weights, partial rotary."""
    eps, weight_offset = 1e-5, 1.0
    with on_route(device) as dev:
        for _call in range(CALLS):
            q, k = make_qk(2, 5, 4, 2, 64, dtype=torch.float32, device=dev)
            q_weight = norm_weight(64, torch.float32, dev, weight_offset)
            k_weight = norm_weight(64, torch.float32, dev, weight_offset)
            positions = torch.randint(0, 3000, (2, 5), device=dev)
            opts = dict(positions=positions, rotary_dim=32, style="interleaved")
            q_out, k_out = qk_norm_rope(q, k, q_weight, k_weight, eps=eps, weight_offset=weight_offset, **opts)

            def normed(x, w):
                return torch.nn.functional.rms_norm(x.cpu().double(), (64,), w.cpu().double() + weight_offset, eps)

            want_q, want_k = ropekit.apply_rope(normed(q, q_weight), normed(k, k_weight), **_on_cpu(opts))
            assert_close_to_ref(q_out, want_q, torch.float32, ROUTE_BACKENDS[device])
            assert_close_to_ref(k_out, want_k, torch.float32, ROUTE_BACKENDS[device])


def _upstream(x: torch.Tensor, kind: str) -> torch.Tensor:
    """A random gradient of x's shape and dtype arriving contiguous, transposed (every dim reversed: not even the
    last dim is contiguous), with two middle dims swapped, or expanded (stride 0)."""
    shape = tuple(x.shape)

    def draw(*dims):
        return torch.randn(*dims, dtype=torch.float64).to(dtype=x.dtype, device=x.device)

    if kind == "contiguous":
        g = draw(*shape)
    elif kind == "reversed":
        g = draw(*shape[::-1]).permute(*reversed(range(len(shape))))
    elif kind == "swapped":
        g = draw(shape[0], shape[2], shape[1], *shape[3:]).transpose(1, 2)
    elif kind == "expanded":
        g = draw(*([1] * (len(shape) - 2)), shape[-2], shape[-1]).expand(shape)
    else:
        raise AssertionError(kind)
    assert g.shape == x.shape and (kind == "contiguous") == g.is_contiguous()
    return g


GRAD_CASES = {
    "bshd-float32-partial": dict(dtype=torch.float32, shape=(2, 5, 4, 2, 16), layout="bshd", grads=("reversed",
                                 "expanded"), opts=dict(rotary_dim=8, q_scale=0.5)),
    "bhsd-bfloat16-gemma-interleaved": dict(dtype=torch.bfloat16, shape=(1, 4, 4, 2, 64), layout="bhsd",
                                            weight_offset=1.0, grads=("swapped", "contiguous"),
                                            opts=dict(style="interleaved")),
    "thd-float32-cu_seqlens": dict(dtype=torch.float32, shape=(1, 7, 2, 2, 16), layout="thd",
                                   cu_seqlens=(0, 3, 7), grads=("contiguous", "reversed"), opts=dict(k_scale=1.5)),
    # rows of size 1e-13 with a tiny eps: 1/rms is 1e13, so any step that forms its cube overflows float32
    "bshd-float32-tiny-rows": dict(dtype=torch.float32, shape=(1, 3, 2, 2, 16), layout="bshd", input_scale=1e-13,
                                   eps=1e-30, grads=("contiguous", "contiguous"), opts={}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", GRAD_CASES)
def test_qk_norm_rope_gradients(device, name):
    """Gradients for q, k, q_weight and k_weight equal torch.autograd of the float64 definition, for random
    upstream gradients that arrive contiguous, transposed or expanded. q and k gradients element-wise within the
    table; the weights' gradients sum over every token and head, so they are held to the table's bound on the
    error relative to their largest value (the criterion of ``ropekit check``)."""
    case = GRAD_CASES[name]
    dtype, (B, S, Hq, Hkv, D), layout = case["dtype"], case["shape"], case["layout"]
    weight_offset, eps = case.get("weight_offset", 0.0), case.get("eps", 1e-6)
    backend = ROUTE_BACKENDS[device]
    with on_route(device) as dev:
        opts = dict(case["opts"])
        if layout != "bshd":
            opts["layout"] = layout
        if case.get("cu_seqlens"):
            opts["cu_seqlens"] = torch.tensor(case["cu_seqlens"], device=dev)
        for _call in range(CALLS):
            q, k = (x * case.get("input_scale", 1.0) for x in make_qk(B, S, Hq, Hkv, D, dtype=dtype, device=dev,
                                                                       layout=layout))
            q_weight, k_weight = norm_weight(D, dtype, dev, weight_offset), norm_weight(D, dtype, dev, weight_offset)
            lead = (S,) if layout == "thd" else (B, S)
            opts["positions"] = torch.randint(0, 4000, lead, device=dev)
            leaves = [t.clone().requires_grad_(True) for t in (q, k, q_weight, k_weight)]
            outs = qk_norm_rope(*leaves, eps=eps, weight_offset=weight_offset, **opts)
            grads = (_upstream(outs[0], case["grads"][0]), _upstream(outs[1], case["grads"][1]))
            got = torch.autograd.grad(outs, leaves, grads)

            leaves64 = [t.detach().cpu().double().requires_grad_(True) for t in (q, k, q_weight, k_weight)]
            outs64 = qk_norm_rope64(*leaves64, eps=eps, weight_offset=weight_offset, **_on_cpu(opts))
            want = torch.autograd.grad(outs64, leaves64, [g.cpu().double() for g in grads])

            for g, w, leaf in zip(got[:2], want[:2], leaves[:2]):
                assert g.shape == leaf.shape
                # a norm's input gradient scales as 1 / |x|: compared in units of that scale
                assert_close_to_ref(g * case.get("input_scale", 1.0), w * case.get("input_scale", 1.0), dtype,
                                    backend)
            for g, w, leaf in zip(got[2:], want[2:], leaves[2:]):
                assert g.shape == leaf.shape and g.dtype == leaf.dtype and not torch.isnan(g).any()
                assert max_relative_error(g, w) <= max_relative_tolerance(leaf.dtype, backend), (g, w)


@pytest.mark.parametrize("kwargs", [
    dict(positions=torch.tensor([[3, 50, 7]]), style="neox", weight_offset=0.0),
    dict(positions=torch.tensor([[3, 50, 7]]), style="interleaved", rotary_dim=4, weight_offset=1.0, q_scale=0.7,
         k_scale=1.3),
    dict(positions=11, layout="bhsd", rotary_dim=4, rotary_at="back", eps=0.1),
], ids=["neox", "interleaved-partial-gemma-scales", "bhsd-back-large-eps"])
def test_qk_norm_rope_gradcheck_float64(kwargs):
    kwargs = dict(kwargs)
    layout = kwargs.get("layout", "bshd")
    q, k = make_qk(1, 3, 2, 1, 8, dtype=torch.float64, layout=layout)
    offset = kwargs.get("weight_offset", 0.0)
    inputs = [t.requires_grad_(True) for t in (q, k, norm_weight(8, torch.float64, "cpu", offset),
                                                norm_weight(8, torch.float64, "cpu", offset))]

    def f(a, b, wa, wb):
        return qk_norm_rope(a, b, wa, wb, **kwargs)

    assert torch.autograd.gradcheck(f, inputs)
    # and the float64 CPU path is the definition itself
    got = f(*inputs)
    want = qk_norm_rope64(*inputs, **kwargs)
    for a, b in zip(got, want):
        assert_close_to_ref(a, b, torch.float64, "cpu")


def _norm_rope64(x, weight, positions, eps=1e-6, weight_offset=0.0):
    """Independent float64 per-head RMSNorm then RoPE, from the definitions."""
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight + weight_offset)
    return rope64(xn, positions)


def _gradient_penalty(rope, q, k, wq, wk, vq, vk):
    """Backward of the squared gradients of <rope(q, k), (vq, vk)> w.r.t. q, k and the weights (a double backward)."""
    q_out, k_out = rope(q, k, wq, wk)
    loss = (q_out * vq.to(q_out)).sum() + (k_out * vk.to(k_out)).sum()
    grads = torch.autograd.grad(loss, (q, k, wq, wk), create_graph=True)
    sum(g.pow(2).sum() for g in grads).backward()


@pytest.mark.parametrize("mode", ROUTES)
def test_qk_norm_rope_double_backward(mode):
    """Gradient of a gradient (a gradient penalty's pattern, ``create_graph=True``): qk_norm_rope's backward is
    differentiable in the incoming gradients, the inputs and the weights, as apply_rope's is; compared with the
    float64 definition, on every route, called three times with fresh data (the fast path records a plan)."""
    with on_route(mode, clear_plans=True) as device:
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


def test_qk_norm_rope_torch_compile_fullgraph():
    q, k = make_qk(2, 6, 4, 2, 16)
    q_weight, k_weight = norm_weight(16, torch.float32, "cpu", 1.0), norm_weight(16, torch.float32, "cpu", 1.0)
    pos = torch.randint(0, 1000, (2, 6))
    kw = dict(eps=1e-5, weight_offset=1.0, q_scale=0.125, rotary_dim=8)
    op = ropekit.qk_norm_rope  # resolved eagerly: the package imports its names on first use

    @torch.compile(fullgraph=True)
    def f(a, b, wa, wb, p):
        return op(a, b, wa, wb, positions=p, **kw)

    got = f(q, k, q_weight, k_weight, pos)
    eager = qk_norm_rope(q, k, q_weight, k_weight, positions=pos, **kw)
    want = qk_norm_rope64(q, k, q_weight, k_weight, positions=pos, **kw)
    for g, e, w in zip(got, eager, want):
        assert_close_to_ref(g, w, torch.float32, ROUTE_BACKENDS["cpu"])
        torch.testing.assert_close(g, e, **tolerance(torch.float32, ROUTE_BACKENDS["cpu"])._asdict())
    # a second call with fresh data through the same compiled graph
    q2, k2 = make_qk(2, 6, 4, 2, 16)
    pos2 = torch.randint(0, 1000, (2, 6))
    got = f(q2, k2, q_weight, k_weight, pos2)
    want = qk_norm_rope64(q2, k2, q_weight, k_weight, positions=pos2, **kw)
    for g, w in zip(got, want):
        assert_close_to_ref(g, w, torch.float32, ROUTE_BACKENDS["cpu"])


QK_BAD = [
    # (id, change to the good call, exception(s), message fragment)
    ("q_weight D+1", dict(q_weight=torch.ones(17)), ValueError, "q_weight"),
    ("k_weight D-2", dict(k_weight=torch.ones(14)), ValueError, "k_weight"),
    ("q_weight 2-D", dict(q_weight=torch.ones(1, 16)), ValueError, "q_weight"),
    ("k_weight integer", dict(k_weight=torch.ones(16, dtype=torch.int64)), (TypeError, ValueError), "k_weight"),
    ("q_weight not a tensor", dict(q_weight=[1.0] * 16), (TypeError, ValueError), "q_weight"),
    ("negative eps", dict(eps=-1e-6), ValueError, "eps"),
    ("bad style", dict(style="gptj"), ValueError, "style"),
    ("odd rotary_dim", dict(rotary_dim=5), ValueError, "rotary_dim"),
    ("positions wrong shape", dict(positions=torch.zeros(3, 4, dtype=torch.int64)), ValueError, "positions"),
]


@pytest.mark.parametrize("change, exc, match", [c[1:] for c in QK_BAD], ids=[c[0] for c in QK_BAD])
def test_qk_norm_rope_bad_input_names_the_argument(change, exc, match):
    q, k = make_qk(2, 4, 4, 2, 16)
    args = dict(q=q, k=k, q_weight=norm_weight(16, torch.float32, "cpu"),
                k_weight=norm_weight(16, torch.float32, "cpu"))
    kwargs = dict(positions=torch.randint(0, 100, (2, 4)))
    for name, value in change.items():
        (args if name in args else kwargs)[name] = value
    tensors = [v for v in (*args.values(), *kwargs.values()) if isinstance(v, torch.Tensor)]
    before = snapshot(*tensors)
    with pytest.raises(exc, match=match):
        qk_norm_rope(args["q"], args["k"], args["q_weight"], args["k_weight"], **kwargs)
    assert_unchanged(tensors, before)
