"""The public rotation (``apply_rope``, ``apply_rope_``, ``rope_backward``) against the float64 reference: dtypes,
autograd, in-place semantics (also on every route: the CPU path, the kernels under the interpreter, CUDA),
torch.library/compile, empty inputs, bounded device caches and the bad-input table; then the API on CUDA (marked
``gpu``), with CUDA graphs and no host syncs."""

import math
import re

import pytest
import torch
from torch.library import opcheck

import ropekit
from helpers import ROUTES, on_route, reference_rope, rope64
from ropekit._validation import validate
from ropekit.testing import assert_close_to_ref, make_qk, tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_output_dtype_and_single_rounding(dtype):
    q, k = make_qk(2, 9, 4, 2, 32, dtype=dtype)
    q_rot, k_rot = ropekit.apply_rope(q, k, positions=7, q_scale=0.3)
    ref_q, ref_k = reference_rope(q, k, positions=7, q_scale=0.3)
    assert_close_to_ref(q_rot, ref_q, dtype, backend="cpu")
    assert_close_to_ref(k_rot, ref_k, dtype, backend="cpu")


def test_q_only_returns_a_tensor():
    q, _ = make_qk(1, 3, 2, 1, 8)
    out = ropekit.apply_rope(q)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("rotary_at", ["front", "back"])
def test_gradcheck_float64(style, rotary_at):
    q, k = make_qk(2, 2, 2, 1, 12, dtype=torch.float64)
    q.requires_grad_(True)
    k.requires_grad_(True)

    def f(a, b):
        return ropekit.apply_rope(a, b, positions=torch.tensor([3, 50]), style=style, rotary_dim=8,
                                  rotary_at=rotary_at, q_scale=0.7, k_scale=1.3, rotary_scale=1.1)

    assert torch.autograd.gradcheck(f, (q, k))
    if style == "neox" and rotary_at == "front":
        assert torch.autograd.gradgradcheck(f, (q, k))


def test_gradcheck_hf_style_tables_with_unequal_halves():
    # Full-width tables whose halves differ are not a rotation; the backward must still be the exact transpose.
    q = torch.randn(1, 5, 2, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = torch.randn(1, 5, 8, dtype=torch.float64), torch.randn(1, 5, 8, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a: ropekit.apply_rope(a, cos=cos, sin=sin), (q,))


def test_rope_backward_equals_autograd():
    q, k = make_qk(2, 6, 4, 2, 16, dtype=torch.float64)
    q.requires_grad_(True)
    k.requires_grad_(True)
    kw = dict(positions=5, rotary_dim=8, q_scale=0.25, style="interleaved")
    q_rot, k_rot = ropekit.apply_rope(q, k, **kw)
    gq, gk = torch.randn_like(q_rot), torch.randn_like(k_rot)
    dq, dk = torch.autograd.grad((q_rot, k_rot), (q, k), (gq, gk))
    eq, ek = ropekit.rope_backward(gq, gk, **kw)
    torch.testing.assert_close(dq, eq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dk, ek, rtol=1e-12, atol=1e-12)


def test_grad_of_only_k_uses_k_scale():
    q, k = make_qk(1, 3, 2, 2, 8, dtype=torch.float64)
    q.requires_grad_(True)
    k.requires_grad_(True)
    _, k_rot = ropekit.apply_rope(q, k, q_scale=2.0, k_scale=0.5)
    g = torch.randn_like(k_rot)
    (dk,) = torch.autograd.grad(k_rot, (k,), g)
    torch.testing.assert_close(dk, ropekit.rope_backward(g, k_scale=0.5, q_scale=0.5), rtol=1e-12, atol=1e-12)


def test_in_place_returns_inputs_and_matches_out_of_place():
    q, k = make_qk(2, 5, 4, 2, 16)
    want_q, want_k = ropekit.apply_rope(q, k, positions=3)
    q_ptr, k_ptr = q.data_ptr(), k.data_ptr()
    got_q, got_k = ropekit.apply_rope_(q, k, positions=3)
    assert got_q is q and got_k is k and q.data_ptr() == q_ptr and k.data_ptr() == k_ptr
    torch.testing.assert_close(q, want_q, rtol=0, atol=0)
    torch.testing.assert_close(k, want_k, rtol=0, atol=0)


def test_in_place_on_leaf_requiring_grad_raises_and_writes_nothing():
    q = torch.randn(1, 3, 2, 8, requires_grad=True)
    before = q.detach().clone()
    with pytest.raises(RuntimeError, match="leaf"):
        ropekit.apply_rope_(q)
    torch.testing.assert_close(q.detach(), before, rtol=0, atol=0)


def test_in_place_autograd_on_non_leaf():
    x = torch.randn(1, 4, 2, 8, dtype=torch.float64, requires_grad=True)
    y = x * 2
    ropekit.apply_rope_(y, positions=2)
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    torch.testing.assert_close(dx, 2 * ropekit.rope_backward(g, positions=2), rtol=1e-12, atol=1e-12)


def test_in_place_on_tensor_saved_by_another_op_raises():
    x = torch.randn(1, 4, 2, 8, requires_grad=True)
    y = x * 1.0
    z = y.sin()  # sin saves y for its backward
    ropekit.apply_rope_(y)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


# The same on every route (the CPU path, the kernels under the interpreter, CUDA), launch plans cleared first and
# each call repeated so that plans serve the later ones.

@pytest.mark.parametrize("mode", ROUTES)
def test_in_place_rotation_is_visible_to_autograd(mode):
    with on_route(mode, clear_plans=True) as device:
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
@pytest.mark.parametrize("mode", ROUTES)
def test_in_place_refuses_overlap_before_writing(mode, case):
    make, exc, match = IN_PLACE_REFUSALS[case]
    with on_route(mode, clear_plans=True) as device:
        for _call in range(2):
            q, k = make(device)
            q_before, k_before = q.clone(), k.clone()
            with pytest.raises(exc, match=match):
                ropekit.apply_rope_(q, k, positions=5)
            assert torch.equal(q, q_before) and torch.equal(k, k_before)


@pytest.mark.parametrize("mode", ROUTES)
def test_in_place_refuses_inference_tensor_outside_inference_mode(mode):
    with on_route(mode, clear_plans=True) as device:
        q = torch.randn(1, 4, 2, 8, device=device)
        with torch.inference_mode():
            k = torch.randn(1, 4, 2, 8, device=device)
        q_before = q.clone()
        with pytest.raises(RuntimeError, match="inference tensor"):
            ropekit.apply_rope_(q, k)
        assert torch.equal(q, q_before)
        with torch.inference_mode():  # inside inference mode it is allowed
            ropekit.apply_rope_(q, k)


@pytest.mark.parametrize("mode", ROUTES)
def test_in_place_on_packed_qkv_views_repeatedly(mode):
    """flash-attention's pattern: q and k interleaved in one buffer; no copies, every call right."""
    with on_route(mode, clear_plans=True) as device:
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
@pytest.mark.parametrize("mode", ROUTES)
def test_in_place_with_autograd_on_packed_views(mode, compiled):
    if compiled and mode == "cpu-kernels":
        pytest.skip("torch.compile traces Triton calls on CUDA only (the CPU interpreter cannot be traced)")

    def step(qkv_leaf, positions):
        qkv = qkv_leaf * 1.0  # non-leaf, as a projection's output
        ropekit.apply_rope_(qkv[:, :, 0], qkv[:, :, 1], positions=positions)
        return (qkv[:, :, 0] * qkv[:, :, 1]).sum() + qkv[:, :, 0].pow(2).sum()

    with on_route(mode, clear_plans=True) as device:
        fn = torch.compile(step, backend="aot_eager", fullgraph=True) if compiled else step
        for _call in range(3):
            base = _packed(device)
            positions = torch.randint(0, 100, (2, 4), device=device)
            leaf = base.clone().requires_grad_(True)
            fn(leaf, positions).backward()
            x64 = base.cpu().double().requires_grad_(True)
            p = positions.cpu()
            q64, k64 = rope64(x64[:, :, 0], p), rope64(x64[:, :, 1], p)
            ((q64 * k64).sum() + q64.pow(2).sum()).backward()
            torch.testing.assert_close(leaf.grad.cpu().double(), x64.grad, rtol=1e-5, atol=1e-5)


def _op_args(q, k, **kwargs):
    return (q, k, *validate(q, k, **kwargs))


@pytest.mark.parametrize("kwargs", [dict(positions=3), dict(positions=torch.tensor([1, 4]), rotary_dim=8),
                                    dict(style="interleaved", q_scale=0.5)])
def test_opcheck_out_of_place_and_in_place(kwargs):
    q, k = make_qk(2, 5, 4, 2, 16)
    q.requires_grad_(True)
    opcheck(torch.ops.ropekit.rope.default, _op_args(q, k, **kwargs))
    q2, k2 = make_qk(2, 5, 4, 2, 16)
    opcheck(torch.ops.ropekit.rope_.default, _op_args(q2, k2, **kwargs))


def test_torch_compile_fullgraph_cpu():
    q, k = make_qk(2, 6, 4, 2, 16)
    pos = torch.randint(0, 100, (2, 6))

    @torch.compile(fullgraph=True)
    def f(a, b, p):
        return ropekit.apply_rope(a, b, positions=p, q_scale=0.125)

    got = f(q, k, pos)
    want = ropekit.apply_rope(q, k, positions=pos, q_scale=0.125)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("mode", ROUTES[:1] + ROUTES[2:])
def test_compiled_in_place_rotation_of_a_packed_qkv_input(mode, dynamic):
    """flash-attention's ``test_rotary_emb_qkv`` pattern under inductor: a non-leaf packed QKV buffer that requires
    grad is passed into the compiled function, which rotates its q and k views in place and returns the buffer
    (an input mutation); static and dynamic shapes (symbolic strides reach the in-place overlap check), called
    with fresh data and a new sequence length. The gradient is the float64 rotation's."""
    def f(qkv, positions):
        ropekit.apply_rope_(qkv[:, :, 0], qkv[:, :, 1], positions=positions)
        return qkv

    with on_route(mode, clear_plans=True) as device:
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
            out64 = torch.stack([rope64(x64[:, :, 0], p), rope64(x64[:, :, 1], p), x64[:, :, 2]], dim=2)
            (out64 * weight.cpu().double()).sum().backward()
            torch.testing.assert_close(leaf.grad.cpu().double(), x64.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ROUTES[:1] + ROUTES[2:])
def test_compiled_in_place_rotation_of_an_input_keeps_its_gradient(mode):
    """A compiled function that rotates its input in place: the backward must include the rotation."""
    with on_route(mode, clear_plans=True) as device:
        def f(x):
            ropekit.apply_rope_(x, positions=7)
            return x

        leaf = torch.randn(1, 3, 2, 8, device=device, requires_grad=True)
        for backend in ("aot_eager", "inductor"):
            leaf.grad = None
            torch._dynamo.reset()
            torch.compile(f, backend=backend, fullgraph=True)(leaf * 2.0).pow(2).sum().backward()
            x64 = leaf.detach().cpu().double().requires_grad_(True)
            rope64(x64 * 2.0, torch.arange(7, 10).expand(1, 3)).pow(2).sum().backward()
            torch.testing.assert_close(leaf.grad.cpu().double(), x64.grad, rtol=1e-5, atol=1e-5)


def test_empty_inputs():
    q = torch.randn(0, 5, 2, 8)
    assert ropekit.apply_rope(q).shape == q.shape
    q = torch.randn(2, 0, 2, 8)
    assert ropekit.apply_rope(q, positions=torch.tensor([1, 2])).shape == q.shape


@pytest.mark.parametrize("mode", ROUTES)
def test_empty_packed_sequence_may_have_any_offset(mode):
    with on_route(mode, clear_plans=True) as device:
        q = torch.randn(1, 2, 8, device=device)
        table = torch.randn(6, 4, device=device)
        cu = torch.tensor([0, 1, 1], device=device)
        out = ropekit.apply_rope(q, positions=torch.tensor([2, 100], device=device), cos=table, sin=table,
                                 layout="thd", cu_seqlens=cu)
        want = ropekit.apply_rope(q.cpu(), positions=2, cos=table.cpu(), sin=table.cpu(), layout="thd")
        torch.testing.assert_close(out.cpu(), want, rtol=1e-6, atol=1e-6)


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


# ------------------------------------------------------------------------------------------------ bad input table

def _q(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype) if shape else torch.randn(2, 4, 3, 8, dtype=dtype)


_table = torch.randn(6, 4)
BAD_INPUTS = [
    # (id, args, kwargs, exception, message fragment)
    ("integer q", (torch.ones(2, 4, 3, 8, dtype=torch.int64),), {}, TypeError, "q must be a floating"),
    ("q not tensor", ([1.0, 2.0],), {}, TypeError, "q must be a torch.Tensor"),
    ("odd head_dim", (_q(2, 4, 3, 7),), {}, ValueError, "head_dim must be even"),
    ("odd rotary_dim", (_q(),), dict(rotary_dim=5), ValueError, "rotary_dim must be even"),
    ("rotary_dim > head_dim", (_q(),), dict(rotary_dim=10), ValueError, "rotary_dim must be even and in"),
    ("head_dim mismatch", (_q(), _q(2, 4, 1, 6)), {}, ValueError, "k head_dim 6 must equal q head_dim 8"),
    ("batch mismatch", (_q(), _q(3, 4, 1, 8)), {}, ValueError, "k must have q's batch and sequence"),
    ("dtype mismatch", (_q(), _q(2, 4, 1, 8, dtype=torch.float16)), {}, TypeError, "k must be of q's dtype"),
    ("wrong ndim", (_q(4, 3, 8),), {}, ValueError, "q must have 4 dims for layout 'bshd'"),
    ("bad layout", (_q(),), dict(layout="bsdh"), ValueError, "layout must be one of"),
    ("bad style", (_q(),), dict(style="gptj"), ValueError, "style must be one of"),
    ("bad rotary_at", (_q(),), dict(rotary_at="middle"), ValueError, "rotary_at must be"),
    ("non-contiguous last dim", (_q(2, 4, 3, 16)[..., ::2],), {}, ValueError, "contiguous last dimension"),
    ("negative offset", (_q(),), dict(positions=-1), ValueError, "positions .an offset. must be >= 0"),
    ("negative position ids", (_q(),), dict(positions=torch.tensor([[0, 1, -2, 3]] * 2)), IndexError,
     "positions must be >= 0"),
    ("float positions", (_q(),), dict(positions=torch.zeros(2, 4)), TypeError, "positions must be an int32"),
    ("positions wrong shape", (_q(),), dict(positions=torch.zeros(3, 4, dtype=torch.int64)), ValueError,
     "positions must be"),
    ("positions past table", (_q(),), dict(positions=torch.tensor([[0, 1, 2, 6]] * 2), cos=_table, sin=_table),
     IndexError, "table has 6 rows"),
    ("offset past table", (_q(),), dict(positions=3, cos=_table, sin=_table), IndexError, "table has 6 rows"),
    ("per-seq offsets past table", (_q(),), dict(positions=torch.tensor([0, 3]), cos=_table, sin=_table),
     IndexError, "table has 6 rows"),
    ("cos without sin", (_q(),), dict(cos=_table), ValueError, "cos and sin must be given together"),
    ("two sources", (_q(),), dict(cos=_table, sin=_table, inv_freq=torch.ones(4)), ValueError,
     "one frequency source"),
    ("table width", (_q(),), dict(cos=torch.randn(6, 3), sin=torch.randn(6, 3), rotary_dim=8), ValueError,
     "cos last dim must be"),
    ("inv_freq length", (_q(),), dict(inv_freq=torch.ones(3), rotary_dim=8), ValueError,
     "inv_freq must have rotary_dim/2 = 4"),
    ("inv_freq dtype", (_q(),), dict(inv_freq=torch.ones(4, dtype=torch.float16)), TypeError,
     "inv_freq must be a float32"),
    ("bad base", (_q(),), dict(base=0.5), ValueError, "base must be a finite real number > 1"),
    ("infinite base", (_q(),), dict(base=math.inf), ValueError, "base must be a finite real number > 1"),
    ("nan base", (_q(),), dict(base=math.nan), ValueError, "base must be a finite real number > 1"),
    ("unhashable layout", (_q(),), dict(layout=["bshd"]), ValueError, "layout must be one of"),
    ("offset past the largest position", (_q(),), dict(positions=2**31 - 3), ValueError,
     "past the largest supported position"),
    ("offset 2**62", (_q(),), dict(positions=2**62), ValueError, "past the largest supported position"),
    ("position ids 2**40", (_q(),), dict(positions=torch.tensor([[0, 1, 2, 2**40]] * 2)), ValueError,
     "past the largest supported position"),
    ("position ids 2**63 - 1", (_q(),), dict(positions=torch.tensor([[0, 1, 2, 2**63 - 1]] * 2)), ValueError,
     "past the largest supported position"),
    ("per-seq offsets past the largest position", (_q(),), dict(positions=torch.tensor([0, 2**31 - 2])),
     ValueError, "past the largest supported position"),
    ("int offset with per-token table", (_q(),), dict(cos=torch.randn(2, 4, 4), sin=torch.randn(2, 4, 4),
                                                      positions=2), ValueError, "cannot be combined with per-token"),
    ("int offset with per-token angles", (_q(),), dict(angles=torch.randn(1, 4, 4), positions=0), ValueError,
     "cannot be combined with per-token"),
    ("cu_seqlens needs thd", (_q(),), dict(cu_seqlens=torch.tensor([0, 4])), ValueError,
     "cu_seqlens needs layout='thd'"),
    ("cu_seqlens wrong end", (_q(8, 3, 8),), dict(layout="thd", cu_seqlens=torch.tensor([0, 3, 7])), ValueError,
     "end at the token count 8"),
    ("cu_seqlens decreasing", (_q(8, 3, 8),), dict(layout="thd", cu_seqlens=torch.tensor([0, 5, 3, 8])),
     ValueError, "never decrease"),
    ("cu_seqlens float", (_q(8, 3, 8),), dict(layout="thd", cu_seqlens=torch.tensor([0.0, 8.0])), TypeError,
     "cu_seqlens must be an int32"),
    ("scale not a number", (_q(),), dict(q_scale="2"), TypeError, "q_scale must be a finite real"),
    ("3-D table wrong S", (_q(),), dict(cos=torch.randn(2, 5, 4), sin=torch.randn(2, 5, 4)), ValueError,
     "one row per token"),
    ("positions with per-token table", (_q(),), dict(cos=torch.randn(2, 4, 4), sin=torch.randn(2, 4, 4),
                                                     positions=torch.zeros(2, 4, dtype=torch.int64)),
     ValueError, "cannot be combined with per-token"),
]


@pytest.mark.parametrize("fn", ["apply_rope", "apply_rope_", "rope_backward"])
@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_and_writes_nothing(case, fn):
    _, args, kwargs, exc, match = case
    if fn == "rope_backward":  # its errors name its own arguments
        match = re.sub(r"\bq\b", "dq_rot", re.sub(r"\bk\b", "dk_rot", match))
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(exc, match=match):
        getattr(ropekit, fn)(*args, **kwargs)
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan()))


def test_eager_plans_only_for_plain_tensors_of_the_kernels_or_the_cpu_float32_path():
    """The fast path of repeated eager calls (ropekit._fastpath) engages for plain CUDA tensors and, without
    autograd, for CPU tensors of the float32 path; never for float64 (the reference), tensor subclasses, CPU calls
    that need autograd, or under tracing -- those calls always take the validated path. (Its behaviour:
    tests/test_fast_path.py, tests/test_float32_plans.py.)"""
    from ropekit import _fastpath
    from ropekit._spec import FORWARD, RopeArgs

    q, k = make_qk(1, 3, 2, 2, 8)
    assert _fastpath.signature(q, k, FORWARD, RopeArgs()) is not None
    assert _fastpath.signature(q.double(), k.double(), FORWARD, RopeArgs()) is None
    assert _fastpath.signature(torch.nn.Parameter(q), None, FORWARD, RopeArgs()) is None
    assert _fastpath.signature(q.requires_grad_(), k, FORWARD, RopeArgs()) is None
    _fastpath.clear()
    for _ in range(2):
        ropekit.apply_rope(q.double(), k.double(), positions=3)
        ropekit.apply_rope(q, k, positions=3)
    assert len(_fastpath._PLANS) == 0
    for _ in range(2):
        ropekit.apply_rope(q.detach(), k, positions=3)
    assert len(_fastpath._PLANS) == 1


@pytest.mark.parametrize("name", ["apply_rope", "apply_rope_", "rope_backward"])
def test_public_functions_forward_every_option(name, monkeypatch):
    """Each public function's keywords are RopeArgs' fields, in order and with its defaults, and it hands every
    keyword, as given, to the layer below (a forgotten one would silently take the default)."""
    import inspect

    from ropekit import _fastpath
    from ropekit._spec import RopeArgs

    fn = getattr(ropekit, name)
    options = [p for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert [(p.name, p.default) for p in options] == list(RopeArgs._field_defaults.items())
    sentinels = {p.name: object() for p in options}
    seen = {}
    monkeypatch.setattr(_fastpath, "rotate", lambda q, k, mode, args: seen.update(args._asdict()))
    # q_out_scale (float8 outputs with dynamic scales) takes its own route (ropekit._rope_float8) when given
    fn(torch.zeros(1, 1, 1, 2), None, **dict(sentinels, backend="auto", q_out_scale=None))
    assert seen == dict(sentinels, backend="auto", q_out_scale=None)


def test_prologue_functions_forward_every_option(monkeypatch):
    """qk_norm_rope and rope_kv_write hand every argument, as given, to the fast path in their bundles (RopeArgs,
    NormSpec, CacheArgs); their rotation keywords are RopeArgs' fields but the output dtype and the backend, with
    RopeArgs' defaults, and the bundles' defaults are the public ones."""
    import inspect

    from ropekit import _fastpath
    from ropekit._spec import CacheArgs, NormSpec, RopeArgs

    rope_fields = [f for f in RopeArgs._fields if f != "backend"]
    for fn, bundled, name in ((ropekit.qk_norm_rope, ("q", "k", "norm", "args", "scales"), "norm_rotate"),
                              (ropekit.rope_kv_write, ("q", "k", "cache", "norm", "args", "scales"), "write_kv")):
        params = inspect.signature(fn).parameters
        # qk_norm_rope's norm_over and v choose another route at their non-defaults (the whole-hidden norm and the
        # v copy: tests/test_prologue_hidden_norm.py); every other argument reaches the fast path
        routes = {"norm_over": "head", "v": None}
        sentinels = {p: object() for p in params if p not in routes}
        seen = {}
        monkeypatch.setattr(_fastpath, name, lambda *call: seen.update(zip(bundled, call)))  # noqa: B023
        fn(**sentinels, **{n: v for n, v in routes.items() if n in params})
        got = {"q": seen["q"], "k": seen["k"], **seen["norm"]._asdict(), **seen["args"]._asdict(),
               **seen["scales"]._asdict()}
        if "cache" in seen:
            got.update(seen["cache"]._asdict())
        assert {n: v for n, v in got.items() if n in sentinels} == sentinels
        assert {n for n in params if n in RopeArgs._fields} == set(rope_fields)
        for n, p in params.items():
            for bundle in (RopeArgs, NormSpec, CacheArgs):
                if n in bundle._field_defaults and p.default is not inspect.Parameter.empty:
                    assert p.default == bundle._field_defaults[n], (fn.__name__, n)


def test_out_dtype_rounds_once_and_in_place_refuses_another_dtype():
    q, k = make_qk(2, 5, 4, 2, 16, dtype=torch.bfloat16)
    q_rot, k_rot = ropekit.apply_rope(q, k, positions=5, out_dtype=torch.float32)
    ref_q, ref_k = reference_rope(q, k, positions=5)
    assert q_rot.dtype == k_rot.dtype == torch.float32
    assert_close_to_ref(q_rot, ref_q, torch.float32, backend="cpu")
    assert_close_to_ref(k_rot, ref_k, torch.float32, backend="cpu")
    assert ropekit.apply_rope(q, out_dtype=torch.bfloat16).dtype == torch.bfloat16
    before = q.clone()
    with pytest.raises(ValueError, match="in-place rotation writes q's own dtype"):
        ropekit.apply_rope_(q, k, out_dtype=torch.float32)
    assert torch.equal(q, before)
    ropekit.apply_rope_(q, k, out_dtype=torch.bfloat16)  # its own dtype: fine
    for bad in (torch.int32, "float32", 4):
        with pytest.raises(TypeError, match="out_dtype"):
            ropekit.apply_rope(q, out_dtype=bad)


# ------------------------------------------------------------------------------------------------ on CUDA

API_CASES = [
    ("bshd-neox-bf16", "bshd", torch.bfloat16, dict(positions=17)),
    ("bhsd-interleaved-fp16", "bhsd", torch.float16, dict(style="interleaved", positions=3)),
    ("sbhd-fp32-partial", "sbhd", torch.float32, dict(rotary_dim=32, q_scale=0.125)),
    ("thd-varlen", "thd", torch.bfloat16, dict(cu_seqlens="cu", positions="offsets")),
    ("per-token", "bshd", torch.float32, dict(positions="ids")),
    ("mla-back", "bshd", torch.bfloat16, dict(rotary_dim=16, rotary_at="back")),
]


def _resolve(kwargs, B, S):
    special = {
        "cu": lambda: torch.tensor([0, 5, 5, B * S], device="cuda", dtype=torch.int32),
        "offsets": lambda: torch.tensor([0, 100, 7], device="cuda"),
        "ids": lambda: torch.randint(0, 1 << 20, (B, S), device="cuda"),
    }
    return {k: (special[v]() if isinstance(v, str) and v in special else v) for k, v in kwargs.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("case", API_CASES, ids=[c[0] for c in API_CASES])
def test_api_on_cuda_matches_reference(case):
    _, layout, dtype, kwargs = case
    B, S = 2, 33
    kwargs = _resolve(kwargs, B, S)
    for _ in range(3):  # the first call compiles, later ones reuse the cached kernel handle: fresh data each time
        q, k = make_qk(B, S, 8, 2, 64, dtype=dtype, device="cuda", layout=layout)
        q_rot, k_rot = ropekit.apply_rope(q, k, layout=layout, **kwargs)
        cpu_kwargs = {key: (v.cpu() if isinstance(v, torch.Tensor) else v) for key, v in kwargs.items()}
        ref_q, ref_k = reference_rope(q.cpu(), k.cpu(), layout=layout, **cpu_kwargs)
        assert q_rot.is_cuda and q_rot.shape == q.shape and q_rot.is_contiguous()
        assert_close_to_ref(q_rot, ref_q, dtype)
        assert_close_to_ref(k_rot, ref_k, dtype)


@pytest.mark.gpu
def test_autograd_on_cuda():
    q, k = make_qk(2, 16, 8, 2, 64, device="cuda")
    q.requires_grad_(True)
    k.requires_grad_(True)
    q_rot, k_rot = ropekit.apply_rope(q, k, positions=9, q_scale=0.5, style="interleaved")
    gq, gk = torch.randn_like(q_rot), torch.randn_like(k_rot)
    dq, dk = torch.autograd.grad((q_rot, k_rot), (q, k), (gq, gk))
    want_q, want_k = reference_rope(gq.cpu(), gk.cpu(), positions=9, q_scale=0.5, style="interleaved", conjugate=True)
    assert_close_to_ref(dq, want_q, torch.float32)
    assert_close_to_ref(dk, want_k, torch.float32)


@pytest.mark.gpu
def test_opcheck_on_cuda():
    q, k = make_qk(2, 8, 4, 2, 32, device="cuda")
    spec = validate(q, k, positions=torch.tensor([3, 4], device="cuda"))
    opcheck(torch.ops.ropekit.rope.default, (q.requires_grad_(True), k, *spec))
    q2, k2 = make_qk(2, 8, 4, 2, 32, device="cuda")
    opcheck(torch.ops.ropekit.rope_.default, (q2, k2, *spec))


@pytest.mark.gpu
def test_compile_fullgraph_on_cuda_no_graph_break():
    q, k = make_qk(2, 16, 8, 2, 64, dtype=torch.bfloat16, device="cuda")
    pos = torch.randint(0, 4096, (2, 16), device="cuda")
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def f(a, b, p):
        a2, b2 = ropekit.apply_rope(a * 2, b, positions=p, q_scale=0.125)
        return a2, a2.float() + 1, b2

    got = f(q, k, pos)
    want = ropekit.apply_rope(q * 2, k, positions=pos, q_scale=0.125)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[0].float() + 1)
    torch.testing.assert_close(got[2], want[1], rtol=0, atol=0)


@pytest.mark.gpu
def test_compile_backward_on_cuda():
    q, k = make_qk(2, 16, 8, 2, 64, device="cuda")
    q.requires_grad_(True)
    k.requires_grad_(True)
    torch._dynamo.reset()
    f = torch.compile(lambda a, b: [t.sum() for t in ropekit.apply_rope(a, b, positions=5)], fullgraph=True)
    sq, sk = f(q, k)
    (sq + 2 * sk).backward()
    want_q = ropekit.rope_backward(torch.ones_like(q), positions=5)
    torch.testing.assert_close(q.grad, want_q, **tolerance(torch.float32)._asdict())


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    q, k = make_qk(4, 1, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    pos = torch.tensor([5, 100, 7, 2**20], device="cuda")
    for _ in range(2):  # warm up: compile the kernel, fill caches
        ropekit.apply_rope_(q.clone(), k.clone(), positions=pos)
    static_q, static_k = q.clone(), k.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_q, out_k = ropekit.apply_rope(static_q, static_k, positions=pos)
    for _ in range(3):
        new_q, new_k = make_qk(4, 1, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
        static_q.copy_(new_q)
        static_k.copy_(new_k)
        pos.copy_(torch.randint(0, 1 << 22, (4,), device="cuda"))
        graph.replay()
        want_q, want_k = ropekit.apply_rope(new_q, new_k, positions=pos)
        torch.testing.assert_close(out_q, want_q, rtol=0, atol=0)
        torch.testing.assert_close(out_k, want_k, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [
    dict(positions="ids"), dict(positions="offsets3"), dict(layout="thd", cu_seqlens="cu"),
    dict(positions="ids", cos="table", sin="table"),
])
def test_no_host_sync_and_no_extra_allocation(kwargs):
    B, S = 3, 8
    layout = kwargs.get("layout", "bshd")
    q, k = make_qk(B, S, 8, 2, 64, device="cuda", layout=layout)
    table = torch.randn(64, 32, device="cuda")
    special = {"ids": torch.randint(0, 64, (B, S), device="cuda"), "offsets3": torch.tensor([1, 2, 3], device="cuda"),
               "cu": torch.tensor([0, 10, B * S], device="cuda"), "table": table}
    kwargs = {key: special.get(v, v) if isinstance(v, str) else v for key, v in kwargs.items()}
    ropekit.apply_rope_(q, k, **kwargs)  # warm up
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ropekit.apply_rope_(q, k, **kwargs)
        q_rot, k_rot = ropekit.apply_rope(q, k, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    allocated = torch.cuda.memory_allocated() - before
    assert allocated <= q_rot.untyped_storage().nbytes() + k_rot.untyped_storage().nbytes() + 1024


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


def test_meta_tensors_give_shapes():
    """A model built on the meta device (shapes only, no data) runs through ropekit's calls as through torch's ops:
    outputs and gradients of the right shape, dtype and device (the torch paths used to read the data and fail)."""
    meta = torch.device("meta")
    q = torch.empty(2, 5, 4, 64, device=meta, dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(2, 5, 2, 64, device=meta, dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(64, device=meta, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.empty(2, 5, device=meta, dtype=torch.int64)
    outs = [*ropekit.apply_rope(q, k, positions=3), *ropekit.apply_rope(q, k, positions=ids),
            *ropekit.qk_norm_rope(q, k, w, w), ropekit.rope_attention(q, k, k, is_causal=True)]
    for out, like in zip(outs, (q, k, q, k, q, k, q)):
        assert out.shape == like.shape and out.dtype == like.dtype and out.device == meta
    sum(o.float().sum() for o in outs).backward()
    for t in (q, k, w):
        assert t.grad.shape == t.shape and t.grad.device == meta
    x = torch.empty(2, 5, 4, 64, device=meta)
    assert ropekit.apply_rope_(x, positions=1) is x
