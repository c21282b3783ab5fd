"""ropekit.rope_attention (RoPE fused into scaled dot-product attention) against its definition, written in
tests/attention_definition.py (the float64 oracle, the low-precision baseline and the one tolerance rule).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import ropekit
from attention_definition import (
    DTYPES,
    F64,
    LN2,
    LOW,
    assert_accurate,
    canon,
    check_against_definition,
    cos_sin64,
    definition,
    effective_scales,
    grad_like,
    low_precision,
    magnitude,
    make_qkv,
    max_err,
    randn,
    rotate,
    route_context,
    route_device,
)
from helpers import INTERPRETED, KERNEL_ROUTES, ROUTES
from ropekit.testing import kernels_on_cpu

# --- 1, 2: forward and gradients --------------------------------------------------------------------------------

# (id, B, S, HQ, HK, D, DV, layout, causal, storage)
SHAPES = [
    ("s1-d16", 1, 1, 2, 2, 16, 16, "bshd", True, "contiguous"),
    ("gqa-s17-d32-causal", 2, 17, 4, 2, 32, 32, "bshd", True, "contiguous"),
    ("mqa-s37-d64", 1, 37, 4, 1, 64, 64, "bshd", False, "contiguous"),
    ("gqa-s37-bhsd-causal", 2, 37, 4, 2, 16, 16, "bhsd", True, "contiguous"),
    ("gqa-s23-sbhd", 2, 23, 4, 2, 32, 32, "sbhd", False, "contiguous"),
    ("packed-qkv-causal", 2, 19, 4, 2, 32, 32, "bshd", True, "packed"),
    ("packed-qkv-sbhd-dv16", 1, 21, 4, 2, 32, 16, "sbhd", False, "packed"),
    ("transposed-views-bhsd-causal", 1, 29, 2, 1, 16, 16, "bhsd", True, "transposed"),
    ("transposed-views-bshd", 1, 20, 2, 2, 16, 16, "bshd", False, "transposed"),
    ("padded-heads-s70", 1, 70, 2, 1, 16, 16, "bshd", True, "padded"),
    ("strided-last-dim-s16", 1, 16, 2, 1, 16, 16, "bshd", True, "strided"),
    ("group3-d48-s33", 1, 33, 6, 2, 48, 48, "bshd", True, "contiguous"),
    ("dv48-over-d16", 2, 18, 2, 2, 16, 48, "bhsd", False, "contiguous"),
]
SHAPE_IDS = [s[0] for s in SHAPES]
# the cases the gradient tests take (fewer: the backward is three kernels)
GRAD_SHAPES = ["s1-d16", "gqa-s17-d32-causal", "mqa-s37-d64", "gqa-s37-bhsd-causal", "packed-qkv-sbhd-dv16",
               "transposed-views-bhsd-causal", "strided-last-dim-s16", "group3-d48-s33", "dv48-over-d16"]


def _shape(name):
    return next(s for s in SHAPES if s[0] == name)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPE_IDS)
def test_forward_matches_definition(route, dtype, shape):
    _, B, S, HQ, HK, D, DV, layout, causal, storage = _shape(shape)
    q, k, v = make_qkv(B, S, HQ, HK, D, DV, dtype=dtype, device=route_device(route), layout=layout, storage=storage)
    check_against_definition(route, q, k, v, grads=False, layout=layout, is_causal=causal)


def _grad_params():
    """Every gradient shape in float32 and bfloat16 on every route; float16 on two shapes under the interpreter
    (CPU time), on all on the others."""
    out = []
    for route in ROUTES:
        for shape in GRAD_SHAPES:
            for dtype in DTYPES:
                if route.values[0] == "cpu-kernels" and dtype.values[0] == torch.float16 and shape not in (
                        "gqa-s17-d32-causal", "group3-d48-s33"):
                    continue
                out.append(pytest.param(route.values[0], dtype.values[0], shape, marks=route.marks,
                                        id=f"{shape}-{dtype.id}-{route.id}"))
    return out


@pytest.mark.parametrize("route, dtype, shape", _grad_params())
def test_gradients_match_definition(route, dtype, shape):
    _, B, S, HQ, HK, D, DV, layout, causal, storage = _shape(shape)
    q, k, v = make_qkv(B, S, HQ, HK, D, DV, dtype=dtype, device=route_device(route), layout=layout, storage=storage)
    go_kind = "strided" if shape == "mqa-s37-d64" else "transposed"
    check_against_definition(route, q, k, v, layout=layout, is_causal=causal, go_kind=go_kind)


@pytest.mark.parametrize("shape", ["gqa-s17-d32-causal", "gqa-s37-bhsd-causal", "packed-qkv-sbhd-dv16"])
def test_float64_forward_and_gradients(shape):
    _, B, S, HQ, HK, D, DV, layout, causal, storage = _shape(shape)
    q, k, v = make_qkv(B, S, HQ, HK, D, DV, dtype=F64, layout=layout, storage=storage)
    check_against_definition("cpu", q, k, v, layout=layout, is_causal=causal, with_lse=True)
    with kernels_on_cpu() if INTERPRETED else contextlib.nullcontext():  # float64 keeps the float64 path
        check_against_definition("cpu", q, k, v, layout=layout, is_causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64(causal):
    q, k, v = make_qkv(1, 5, 2, 1, 8, dtype=F64)
    f = lambda a, b, c: ropekit.rope_attention(a, b, c, is_causal=causal, positions=3)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v))


def test_gradcheck_float64_through_lse():
    """lse is float64 for float64 inputs, so gradcheck holds it to gradcheck's own float64 tolerances."""
    q, k, v = make_qkv(1, 5, 2, 2, 8, dtype=F64)
    f = lambda a, b, c: ropekit.rope_attention(a, b, c, is_causal=True, return_lse=True)  # noqa: E731
    assert f(q, k, v)[1].dtype == F64
    assert torch.autograd.gradcheck(f, (q, k, v))


def _launch(q, k, v, do, dlse, *, fwd_blocks, bwd_blocks, causal, prerotate=True, **rope):
    """o, lse, dq, dk, dv from the attention launcher with the given block shapes (canonical bshd inputs), every
    output poisoned with NaN first so that an unwritten element shows."""
    from ropekit._spec import RopeArgs
    from ropekit.attention import _unit_rows
    from ropekit.triton.attention_launcher import Rotation, launch_backward, launch_forward

    D = q.shape[3]
    table, (start, R, neox) = _unit_rows(q, RopeArgs(**rope))
    rot = Rotation(start, R, neox)
    qk_mult = (1.0 / math.sqrt(D)) / LN2  # base-e softmax with the default scale, in base-2 units
    o = torch.full((*q.shape[:3], v.shape[3]), math.nan, dtype=q.dtype)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), math.nan)
    launch_forward(q, k, v, table, o, lse, rot, 1.0, 1.0, qk_mult, causal, blocks=fwd_blocks, prerotate=prerotate)
    dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))
    launch_backward(do, dlse, q, k, v, table, o, lse, dq, dk, dv, rot, 1.0, 1.0, qk_mult, causal,
                    blocks=bwd_blocks, prerotate=prerotate)
    return o, lse, dq, dk, dv


# (forward BLOCK_M, BLOCK_N), (backward BLOCK_M, BLOCK_N) -- or the dk/dv and the dq kernel's own: the GPU's shapes
# are neither square nor one for both backward kernels (dk/dv 64 x 128 and dq 64 x 64 at D 128, dk/dv 32 x 64 and
# dq 128 x 64 for MLA); these run the same tile logic at interpreter sizes.
LAUNCH_BLOCKS = [((32, 16), (16, 32)), ((64, 16), (16, 64)), ((32, 32), (32, 16)), ((32, 16), ((16, 32), (32, 16)))]


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("blocks", LAUNCH_BLOCKS,
                         ids=["f32x16-b16x32", "f64x16-b16x64", "f32x32-b32x16", "f32x16-dkdv16x32-dq32x16"])
@pytest.mark.parametrize("prerotate", [True, False], ids=["streamed-from-copy", "streamed-rotated-on-load"])
def test_launcher_block_shapes_under_interpreter(blocks, causal, prerotate):
    """The kernels with block shapes other than the interpreter's default 16 x 16 (as on the GPU), S across
    several tiles and one partial tile, partial rotary (pass-through columns), GQA and Dv != D; o, lse and the
    gradients (through o and lse) against the definition; the streamed operand (k, or q in the dk/dv kernel) read
    from a rotated copy or rotated as it loads."""
    from ropekit.triton.attention_launcher import BackwardBlocks, Blocks

    (fm, fn), bwd = blocks
    if isinstance(bwd[0], tuple):  # the dk/dv kernel's and the dq kernel's
        bwd_blocks = BackwardBlocks(Blocks(*bwd[0], 4, 1), Blocks(*bwd[1], 4, 1))
    else:
        bwd_blocks = Blocks(*bwd, 4, 1)
    B, S, HQ, HK, D, DV = 1, 70, 2, 1, 32, 16
    rope = dict(positions=torch.tensor([5]), rotary_dim=16)
    q, k, v = (t.detach() for t in make_qkv(B, S, HQ, HK, D, DV, dtype=torch.float32))
    do = randn(B, S, HQ, DV, dtype=torch.float32, device="cpu")
    dlse = randn(B, HQ, S, dtype=torch.float32, device="cpu")
    o, lse, dq, dk, dv = _launch(q, k, v, do, dlse, fwd_blocks=Blocks(fm, fn, 4, 1), bwd_blocks=bwd_blocks,
                                 causal=causal, prerotate=prerotate, **rope)
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    o_ref, lse_ref = definition(q64, k64, v64, is_causal=causal, **rope)
    want = torch.autograd.grad((o_ref, lse_ref), (q64, k64, v64), (do.double(), dlse.double()))
    for name, got, ref in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv), (o_ref, lse_ref, *want)):
        assert_accurate(name, got, ref)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("B, S", [(1, 0), (0, 5)], ids=["no-tokens", "no-sequences"])
def test_empty_inputs(route, B, S):
    """No tokens: empty o and lse, and empty gradients."""
    device = route_device(route)
    q, k, v = make_qkv(max(B, 1), max(S, 1), 4, 2, 16, 8, device=device)
    q, k, v = (t.detach()[:B, :S].requires_grad_(True) for t in (q, k, v))
    with route_context(route):
        o, lse = ropekit.rope_attention(q, k, v, return_lse=True, is_causal=True)
        assert o.shape == (B, S, 4, 8) and lse.shape == (B, 4, S)
        dq, dk, dv = torch.autograd.grad((o.sum() + lse.sum(),), (q, k, v), allow_unused=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


# --- 3: fold presets and the base-2 softmax ---------------------------------------------------------------------

FOLDS = ["q", "q_log2", "symmetric", "symmetric_log2"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES[:2])
def test_fold_presets_equal_none(route, dtype):
    """Every preset gives standard attention: each one's o, dq, dk, dv meet the rule against the definition (with
    the preset's own low-precision baseline), and float32 presets agree with "none" to 1e-5."""
    device = route_device(route)
    q, k, v = make_qkv(1, 19, 4, 2, 32, dtype=dtype, device=device)
    kw = dict(is_causal=True, positions=11, scale=0.3, q_scale=1.25, k_scale=0.8)
    do = grad_like(q.detach())  # o has q's shape (Dv = D): one gradient for every preset
    results = {}
    for fold in ["none", *FOLDS]:
        results[fold] = check_against_definition(route, q, k, v, fold=fold, do=do, **kw)
    if dtype == torch.float32:
        _, _, (dq0, dk0, dv0) = results["none"]
        for fold in FOLDS:
            o, _, (dq, dk, dv) = results[fold]
            for name, a, b in (("o", o, results["none"][0]), ("dq", dq, dq0), ("dk", dk, dk0), ("dv", dv, dv0)):
                assert max_err(a, b) <= 1e-5 * magnitude(b), (fold, name)


def test_fold_presets_equal_none_float64():
    q, k, v = make_qkv(2, 13, 4, 1, 16, dtype=F64)
    kw = dict(is_causal=False, positions=torch.tensor([2, 9]), q_scale=0.9)
    outs = {}
    for fold in ["none", *FOLDS]:
        o, lse = ropekit.rope_attention(q, k, v, fold=fold, return_lse=True, **kw)
        outs[fold] = (o, lse, *torch.autograd.grad((o * o).sum() + lse.sum(), (q, k, v)))
    for fold in FOLDS:
        for i, name in enumerate(("o", "lse", "dq", "dk", "dv")):
            tol = 1e-10
            assert max_err(outs[fold][i], outs["none"][i]) <= tol * magnitude(outs["none"][i]), (fold, name)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES[:2])
def test_log2_softmax_with_folded_scale_is_standard_attention(route, dtype):
    """log2_softmax=True, scale=1 and q_scale = a / ln 2 computes softmax(a (Rq)(Rk)^T) v (and its natural lse)."""
    device = route_device(route)
    q, k, v = make_qkv(1, 23, 4, 2, 32, dtype=dtype, device=device)
    a = 1.0 / math.sqrt(32)
    with route_context(route):
        o, lse = ropekit.rope_attention(q, k, v, scale=1.0, log2_softmax=True, q_scale=a / LN2, is_causal=True,
                                        return_lse=True)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o_ref, lse_ref = definition(q64, k64, v64, scale=a, is_causal=True)  # standard base-e attention
    do = grad_like(o)
    base = low_precision(q, k, v, do, None, truncate=route == "cpu-kernels", fold="q_log2", is_causal=True)
    low = dtype in LOW
    assert_accurate("o", o, o_ref, base[0] if low else None)
    assert_accurate("lse", lse, lse_ref, base[1] if low else None, dtype=dtype)
    with route_context(route):
        got = torch.autograd.grad(o, (q, k, v), do)
    want = torch.autograd.grad(o_ref, (q64, k64, v64), do.double())
    for i, name in enumerate(("dq", "dk", "dv")):
        assert_accurate(name, got[i], want[i], base[2 + i] if low else None)


# --- 4: position and frequency options ----------------------------------------------------------------------------

B_POS, S_POS = 2, 13


def _rope_options(name: str, device) -> tuple[int, int, dict]:
    """(D, DV, keywords) of a position/frequency case."""
    B, S = B_POS, S_POS
    P = 64

    def table_angles(R):
        inv = 500000.0 ** (-torch.arange(0, R, 2, dtype=F64) / R)
        return torch.outer(torch.arange(P, dtype=F64), inv)

    if name == "int-offset":
        return 32, 32, dict(positions=1000)
    if name == "tensor-offset":  # a 0-d tensor: an offset like an int
        return 16, 16, dict(positions=torch.tensor(77, device=device))
    if name == "broadcast-ids":  # [1, S] ids for every sequence
        return 16, 16, dict(positions=torch.randint(0, 900, (1, S), device=device))
    if name == "batch-offsets":
        return 16, 16, dict(positions=torch.tensor([0, 321], device=device))
    if name == "position-ids":
        return 32, 32, dict(positions=torch.randint(0, 4096, (B, S), device=device), base=500000.0)
    if name == "sections-contiguous":  # 3 axes, 4 + 2 + 2 pairs = R/2
        return 16, 16, dict(positions=torch.randint(0, 50, (3, B, S), device=device), sections=(4, 2, 2))
    if name == "sections-interleaved-partial":  # R = 8 of D = 16: pairs (2, 1, 1)
        return 16, 16, dict(positions=torch.randint(0, 50, (3, B, S), device=device), sections=(2, 1, 1),
                            section_layout="interleaved", rotary_dim=8)
    if name == "sections-broadcast":  # [A, 1, S]: one set of ids for every sequence
        return 16, 16, dict(positions=torch.randint(0, 50, (3, 1, S), device=device), sections=(2, 3, 3))
    if name == "inv-freq":
        inv = (0.5 + torch.rand(8, dtype=F64)) * 10000.0 ** (-torch.arange(0, 16, 2, dtype=F64) / 16)
        return 16, 16, dict(inv_freq=inv.float().to(device), positions=torch.randint(0, 300, (B, S), device=device))
    if name == "cos-sin-tables":
        ang = table_angles(32)
        return 32, 32, dict(cos=ang.cos().float().to(device), sin=ang.sin().float().to(device),
                            positions=torch.randint(0, P, (B, S), device=device))
    if name == "gathered-tables":  # [B, S, R/2] per token
        ang = torch.rand(B, S, 8, dtype=F64) * 100.0
        return 16, 16, dict(cos=ang.cos().float().to(device), sin=ang.sin().float().to(device))
    if name == "angles-table":
        return 16, 16, dict(angles=table_angles(16).float().to(device), positions=5)
    if name == "interleaved":
        return 32, 32, dict(style="interleaved", positions=torch.randint(0, 100, (B, S), device=device))
    if name == "partial-front":  # the scales multiply the pass-through columns too
        return 32, 32, dict(rotary_dim=16, positions=7, q_scale=0.6, k_scale=1.4)
    if name == "partial-front-interleaved":
        return 32, 32, dict(rotary_dim=8, style="interleaved", positions=torch.tensor([3, 60], device=device))
    if name == "mla-back":  # rotated columns last, v with its own head dim
        return 48, 32, dict(rotary_dim=16, rotary_at="back", positions=torch.randint(0, 200, (B, S), device=device))
    if name == "mla-back-fold":
        return 48, 32, dict(rotary_dim=16, rotary_at="back", style="interleaved", fold="symmetric_log2",
                            q_scale=1.2, positions=torch.tensor([0, 99], device=device))
    if name == "rotary-scale":
        return 16, 16, dict(rotary_scale=1.3, positions=40)
    if name == "q-k-scales":
        return 16, 16, dict(q_scale=0.7, k_scale=1.6, positions=torch.tensor([5, 0], device=device))
    raise AssertionError(name)


POSITION_CASES = ["int-offset", "tensor-offset", "broadcast-ids", "batch-offsets", "position-ids",
                  "sections-contiguous", "sections-interleaved-partial", "sections-broadcast", "inv-freq",
                  "cos-sin-tables", "gathered-tables", "angles-table", "interleaved", "partial-front",
                  "partial-front-interleaved", "mla-back", "mla-back-fold", "rotary-scale", "q-k-scales"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", POSITION_CASES)
def test_position_and_frequency_options(route, case):
    device = route_device(route)
    D, DV, rope = _rope_options(case, device)
    causal = case in ("position-ids", "mla-back", "sections-contiguous", "q-k-scales")
    q, k, v = make_qkv(B_POS, S_POS, 2, 1, D, DV, dtype=torch.float32, device=device)
    check_against_definition(route, q, k, v, is_causal=causal, **rope)
    if route == "cpu":
        q, k, v = make_qkv(B_POS, S_POS, 2, 1, D, DV, dtype=F64)
        check_against_definition(route, q, k, v, is_causal=causal, **rope)


@pytest.mark.parametrize("route", KERNEL_ROUTES)
@pytest.mark.parametrize("case", ["mla-back", "mla-back-fold", "sections-interleaved-partial",
                                  "partial-front-interleaved"])
def test_position_options_bfloat16(route, case):
    device = route_device(route)
    D, DV, rope = _rope_options(case, device)
    q, k, v = make_qkv(B_POS, S_POS, 2, 1, D, DV, dtype=torch.bfloat16, device=device, layout="bhsd")
    check_against_definition(route, q, k, v, is_causal=True, layout="bhsd", **rope)


# --- 5: lse and the rotated outputs -------------------------------------------------------------------------------

@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES[:2])
@pytest.mark.parametrize("log2", [False, True])
def test_lse_and_log2_softmax(route, dtype, log2):
    """lse (natural log of the row sums, ln sum 2^s for the base-2 softmax) and its gradient."""
    device = route_device(route)
    q, k, v = make_qkv(2, 21, 4, 2, 16, dtype=dtype, device=device, layout="sbhd")
    check_against_definition(route, q, k, v, with_lse=True, layout="sbhd", is_causal=True, log2_softmax=log2,
                             scale=0.4, positions=torch.tensor([4, 17], device=device))
    if route == "cpu" and dtype == torch.float32:
        q, k, v = make_qkv(2, 21, 4, 2, 16, dtype=F64, layout="sbhd")
        check_against_definition(route, q, k, v, with_lse=True, layout="sbhd", is_causal=False, log2_softmax=log2)


@pytest.mark.parametrize("route", ROUTES)
def test_lse_only_gradient(route):
    """A loss of lse alone (o unused): the gradient flows through lse only."""
    device = route_device(route)
    q, k, v = make_qkv(1, 18, 2, 1, 16, dtype=torch.float32, device=device)
    with route_context(route):
        _, lse = ropekit.rope_attention(q, k, v, return_lse=True, is_causal=True)
        w = torch.randn_like(lse)
        got = torch.autograd.grad((lse * w).sum(), (q, k), allow_unused=True)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    _, lse_ref = definition(q64, k64, v64, is_causal=True)
    want = torch.autograd.grad((lse_ref * w.double()).sum(), (q64, k64))
    for name, a, b in zip(("dq", "dk"), got, want):
        assert_accurate(name, a, b)


@pytest.mark.parametrize("route", ROUTES)
def test_no_grad_inference_mode_and_partial_requires_grad(route):
    """Without autograd (no_grad, inference_mode) the forward is the same; with only v (or only q) requiring grad,
    its gradient is right."""
    device = route_device(route)
    q, k, v = make_qkv(1, 20, 4, 2, 16, dtype=torch.float32, device=device)
    with route_context(route):
        o = ropekit.rope_attention(q, k, v, is_causal=True)
        with torch.no_grad():
            o_ng = ropekit.rope_attention(q, k, v, is_causal=True)
        with torch.inference_mode():
            o_im = ropekit.rope_attention(q.detach(), k.detach(), v.detach(), is_causal=True)
    assert not o_ng.requires_grad and torch.equal(o_ng, o.detach()) and torch.equal(o_im, o.detach())
    do = grad_like(o)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o_ref, _ = definition(q64, k64, v64, is_causal=True)
    want = torch.autograd.grad(o_ref, (q64, k64, v64), do.double())
    for i, name in ((2, "dv"), (0, "dq")):
        leaves = [t.detach() for t in (q, k, v)]
        leaves[i].requires_grad_(True)
        with route_context(route):
            got, = torch.autograd.grad(ropekit.rope_attention(*leaves, is_causal=True), leaves[i], do)
        assert_accurate(name, got, want[i])


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("fold", ["none", "q_log2", "symmetric"])
def test_return_rotated(route, fold):
    """q_rot, k_rot equal apply_rope with the effective scales (bit for bit: the same rotation), and the
    definition's rotation; o is the same as without them."""
    device = route_device(route)
    D = 32
    pos = torch.randint(0, 1000, (2, 11), device=device)
    rope = dict(positions=pos, rotary_dim=16, style="interleaved", q_scale=1.5, k_scale=0.5)
    q, k, v = make_qkv(2, 11, 4, 2, D, dtype=torch.bfloat16, device=device, layout="bhsd")
    with route_context(route):
        o, lse, q_rot, k_rot = ropekit.rope_attention(q, k, v, fold=fold, return_lse=True, return_rotated=True,
                                                      layout="bhsd", **rope)
        o_plain = ropekit.rope_attention(q, k, v, fold=fold, layout="bhsd", **rope)
        q_eff, k_eff, _, _ = effective_scales(D, fold=fold, q_scale=1.5, k_scale=0.5)
        want_q, want_k = ropekit.apply_rope(q, k, layout="bhsd", positions=pos, rotary_dim=16, style="interleaved",
                                            q_scale=q_eff, k_scale=k_eff)
    assert torch.equal(o, o_plain)
    assert q_rot.dtype == torch.bfloat16 and q_rot.shape == q.shape and k_rot.shape == k.shape
    assert torch.equal(q_rot, want_q) and torch.equal(k_rot, want_k)
    cos, sin = cos_sin64(2, 11, D, rope, device)
    for name, got, x, sc in (("q_rot", q_rot, q, q_eff), ("k_rot", k_rot, k, k_eff)):
        ref = canon(rotate(canon(x.detach().double(), "bhsd"), cos, sin, R=16, start=0, style="interleaved",
                           scale=sc), "bhsd")
        # one rounding of a fp32 (float64 on the cpu route) value to bfloat16: half an ulp, one ulp when the
        # interpreter truncates
        ulp = 2.0 ** -7 if route == "cpu-kernels" else 2.0 ** -8
        assert ((got.double() - ref).abs() <= ulp * ref.abs() + 1e-6).all(), name


@pytest.mark.parametrize("name", ["is_causal", "log2_softmax", "return_lse", "return_rotated"])
def test_flags_must_be_bools(name):
    """None or 0 for a flag would silently pick one behaviour: refused, naming the flag."""
    q, k, v = make_qkv(1, 4, 2, 2, 8, dtype=torch.float32)
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        ropekit.rope_attention(q, k, v, **{name: None})


def test_return_variants_and_types():
    q, k, v = make_qkv(1, 6, 2, 2, 16, dtype=torch.float32)
    o = ropekit.rope_attention(q, k, v)
    assert isinstance(o, torch.Tensor) and o.shape == (1, 6, 2, 16)
    o2, lse = ropekit.rope_attention(q, k, v, return_lse=True)
    assert lse.shape == (1, 2, 6) and lse.dtype == torch.float32 and torch.equal(o, o2)
    assert ropekit.rope_attention(q.double(), k.double(), v.double(), return_lse=True)[1].dtype == torch.float64
    o3, qr, kr = ropekit.rope_attention(q, k, v, return_rotated=True)
    assert torch.equal(o, o3) and qr.shape == q.shape and kr.shape == k.shape
    outs = ropekit.rope_attention(q, k, v, return_lse=True, return_rotated=True)
    assert len(outs) == 4 and torch.equal(outs[1], lse)
    # o in q's layout with v's head dim
    q, k, v = make_qkv(2, 6, 4, 2, 16, 8, dtype=torch.float32, layout="sbhd")
    assert ropekit.rope_attention(q, k, v, layout="sbhd").shape == (6, 2, 4, 8)
    q, k, v = make_qkv(2, 6, 4, 2, 16, 8, dtype=torch.float32, layout="bhsd")
    assert ropekit.rope_attention(q, k, v, layout="bhsd").shape == (2, 4, 6, 8)


# --- 6: bad input -------------------------------------------------------------------------------------------------

def _good(**over):
    B, S, HQ, HK, D = 1, 4, 4, 2, 16
    t = dict(q=torch.randn(B, S, HQ, D), k=torch.randn(B, S, HK, D), v=torch.randn(B, S, HK, D))
    t.update(over)
    return t


@pytest.mark.parametrize("make, kwargs, exc, match", [
    (lambda: _good(), dict(layout="thd"), ValueError, r"\bq\b.*3-D"),
    (lambda: _good(), dict(layout="bsd"), ValueError, "layout"),
    (lambda: _good(q=torch.randn(4, 4, 16)), {}, ValueError, r"\bq\b.*4-D"),
    (lambda: _good(v=torch.randn(1, 4, 32)), {}, ValueError, r"\bv\b.*4-D"),
    (lambda: _good(k=torch.randn(1, 4, 2, 16, dtype=torch.float16)), {}, TypeError, "dtype"),
    (lambda: _good(q=torch.randint(0, 3, (1, 4, 4, 16))), {}, TypeError, r"\bq\b"),
    (lambda: _good(k=torch.randn(1, 4, 3, 16), v=torch.randn(1, 4, 3, 16)), {}, ValueError, "multiple"),
    (lambda: _good(v=torch.randn(1, 4, 1, 16)), {}, ValueError, r"\bv\b.*heads"),
    (lambda: _good(k=torch.randn(1, 4, 2, 32)), {}, ValueError, "head_dim"),
    (lambda: _good(k=torch.randn(1, 5, 2, 16)), {}, ValueError, "sequence length"),
    (lambda: _good(k=torch.randn(1, 4, 2, 16, device="meta")), {}, ValueError, "device"),
    (lambda: _good(), dict(fold="both"), ValueError, "fold"),
    (lambda: _good(), dict(fold="q_log2", log2_softmax=True), ValueError, "log2_softmax"),
    (lambda: _good(), dict(fold="q", log2_softmax=True), ValueError, "log2_softmax"),
    (lambda: _good(), dict(scale=0.0), ValueError, "scale"),
    (lambda: _good(), dict(scale=-0.5), ValueError, "scale"),
    (lambda: _good(), dict(scale=float("nan")), ValueError, "scale"),
    (lambda: _good(), dict(scale=float("inf")), ValueError, "scale"),
    (lambda: _good(), dict(q_scale=float("nan")), ValueError, "q_scale"),
    (lambda: _good(), dict(k_scale=float("inf")), ValueError, "k_scale"),
    (lambda: _good(), dict(style="gptj"), ValueError, "style"),
    (lambda: _good(), dict(rotary_dim=7), ValueError, "rotary_dim"),
    (lambda: _good(), dict(positions=-1), (ValueError, IndexError), "position"),
], ids=["thd", "unknown-layout", "q-3d", "v-3d", "dtype-mismatch", "int-dtype", "heads-not-multiple",
        "v-heads", "head-dim", "seq-len", "device", "unknown-fold", "fold-q_log2-with-log2", "fold-q-with-log2",
        "scale-zero", "scale-negative", "scale-nan", "scale-inf", "q_scale-nan", "k_scale-inf", "style",
        "rotary-dim-odd", "negative-offset"])
def test_bad_input_raises_naming_the_argument(make, kwargs, exc, match):
    t = make()
    with pytest.raises(exc, match=match):
        ropekit.rope_attention(t["q"], t["k"], t["v"], **kwargs)


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_bad_input_raises_under_the_interpreter_too():
    t = _good()
    with kernels_on_cpu():
        with pytest.raises(ValueError, match="head_dim"):
            ropekit.rope_attention(t["q"], torch.randn(1, 4, 2, 32), t["v"])
        with pytest.raises(ValueError, match="fold"):
            ropekit.rope_attention(t["q"], t["k"], t["v"], fold="symmetric_log2", log2_softmax=True)


# --- 7: torch.compile and opcheck -------------------------------------------------------------------------------

def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    q, k, v = make_qkv(2, 9, 4, 2, 16, dtype=torch.float32)
    pos = torch.randint(0, 100, (2, 9))

    def f(a, b, c, p):
        o, lse = ropekit.rope_attention(a, b, c, positions=p, is_causal=True, fold="q_log2", return_lse=True)
        return o, lse

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    o_c, lse_c = compiled(q, k, v, pos)
    o_e, lse_e = f(q, k, v, pos)
    torch.testing.assert_close(o_c, o_e, rtol=0, atol=0)
    torch.testing.assert_close(lse_c, lse_e, rtol=0, atol=0)
    w = torch.randn_like(o_e)
    g_c = torch.autograd.grad((o_c * w).sum() + lse_c.sum(), (q, k, v))
    g_e = torch.autograd.grad((o_e * w).sum() + lse_e.sum(), (q, k, v))
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and right, not only equal to eager
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o_ref, _ = definition(q64, k64, v64, positions=pos, is_causal=True)
    assert_accurate("o", o_c, o_ref)


def _op_args(q, k, v, layout="bshd", causal=True, **rope):
    """The arguments rope_attention hands its op (see ropekit.attention.rope_attention)."""
    from ropekit._spec import RopeArgs, to_canonical
    from ropekit.attention import _unit_rows

    D = to_canonical(q, layout).shape[3]
    a = 1.0 / math.sqrt(D)
    table, (start, R, neox) = _unit_rows(q, RopeArgs(layout=layout, **rope))
    return (q, k, v, table, None, layout, start, R, neox, 1.0, 1.0, a / LN2, causal, 0)


@pytest.mark.parametrize("layout, rope", [("bshd", dict(positions=3)),
                                          ("bhsd", dict(rotary_dim=8, rotary_at="back", style="interleaved"))])
def test_opcheck_rope_attention(layout, rope):
    q, k, v = make_qkv(2, 5, 4, 2, 16, 8, dtype=torch.float32, layout=layout)
    args = _op_args(q, k, v, layout=layout, **rope)
    torch.library.opcheck(torch.ops.ropekit.rope_attention.default, args)
    # the op's result is the definition's
    o, lse = torch.ops.ropekit.rope_attention(*args)
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    o_ref, lse_ref = definition(q64, k64, v64, layout=layout, is_causal=True, **rope)
    assert_accurate("o", o, o_ref)
    assert_accurate("lse", lse, lse_ref)


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_opcheck_rope_attention_under_the_interpreter():
    q, k, v = make_qkv(1, 5, 2, 1, 16, dtype=torch.float32)
    with kernels_on_cpu():
        args = _op_args(q, k, v, positions=torch.tensor([9]))
        torch.library.opcheck(torch.ops.ropekit.rope_attention.default, args,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_opcheck_rope_attention_backward():
    q, k, v = make_qkv(1, 6, 4, 2, 16, dtype=torch.float32)
    args = _op_args(q, k, v)
    o, lse = torch.ops.ropekit.rope_attention(*args)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    bargs = (do, dlse, q.detach(), k.detach(), v.detach(), args[3], args[4], o, lse, *args[5:])
    torch.library.opcheck(torch.ops.ropekit.rope_attention_backward.default, bargs,
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.ropekit.rope_attention_backward.default, (do, None, *bargs[2:]),
                          test_utils=("test_schema", "test_faketensor"))


# --- 8: repeated calls ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("route", ROUTES)
def test_repeated_calls_with_fresh_data(route):
    """Each op three times or more with fresh inputs (cached launches and plans must read the new tensors); the
    third call changes the sequence length and the fourth returns to the first shape."""
    device = route_device(route)
    for S in (17, 17, 33, 17):
        q, k, v = make_qkv(1, S, 2, 1, 32, dtype=torch.bfloat16, device=device)
        check_against_definition(route, q, k, v, with_lse=True, is_causal=True, positions=S)


# --- 9: CUDA, realistic shapes ----------------------------------------------------------------------------------

# (id, B, S, HQ, HK, D, DV, rope keywords)
GPU_SHAPES = [
    ("d128-gqa", 2, 1000, 8, 2, 128, 128, dict(base=500000.0)),
    ("d64-gqa", 2, 1000, 8, 2, 64, 64, dict(positions=128)),
    ("mla-d192-back64-v128", 2, 1000, 8, 2, 192, 128, dict(rotary_dim=64, rotary_at="back", style="interleaved")),
    ("d256-gqa", 2, 1000, 8, 2, 256, 256, dict()),
]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", [c[0] for c in GPU_SHAPES])
def test_cuda_bfloat16_realistic_shapes(case, causal):
    _, B, S, HQ, HK, D, DV, rope = next(c for c in GPU_SHAPES if c[0] == case)
    q, k, v = make_qkv(B, S, HQ, HK, D, DV, dtype=torch.bfloat16, device="cuda")
    rope = dict(rope)
    if case == "d128-gqa":
        rope["positions"] = torch.randint(0, 100000, (B, S), device="cuda")
    check_against_definition("cuda", q, k, v, with_lse=True, is_causal=causal, **rope)


@pytest.mark.gpu
@pytest.mark.parametrize("fold", ["none", *FOLDS])
def test_cuda_fold_presets_realistic(fold):
    q, k, v = make_qkv(2, 1000, 8, 2, 128, dtype=torch.bfloat16, device="cuda", storage="packed")
    check_against_definition("cuda", q, k, v, fold=fold, is_causal=True, positions=torch.tensor([0, 4000],
                                                                                                 device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "sbhd"])
def test_cuda_layouts_realistic(layout):
    q, k, v = make_qkv(2, 777, 8, 2, 128, dtype=torch.bfloat16, device="cuda", layout=layout, storage="transposed")
    check_against_definition("cuda", q, k, v, layout=layout, is_causal=True, log2_softmax=True, scale=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed-thd"])
def test_cuda_graph_capture_and_replay(packed):
    """Forward and backward captured in one CUDA graph (positions and, packed, a device cu_seqlens with
    max_seqlen: nothing syncs) and replayed on fresh data: o, lse and the gradients equal eager calls bit for bit."""
    B, S, HQ, HK, D = 2, 300, 8, 2, 64
    q, k, v = make_qkv(B, S, HQ, HK, D, dtype=torch.bfloat16, device="cuda")
    if packed:
        q, k, v = (t.detach().flatten(0, 1).requires_grad_(True) for t in (q, k, v))
        cu = torch.tensor([0, 17, 17, 300, 600], dtype=torch.int32, device="cuda")
        pos = torch.randint(0, 1000, (4,), device="cuda")
        kw = dict(layout="thd", cu_seqlens=cu, max_seqlen=300)
    else:
        pos = torch.randint(0, 1000, (B, S), device="cuda")
        kw = {}
    do = torch.randn(*q.shape[:-1], D, dtype=q.dtype, device="cuda")
    dlse = torch.randn(HQ, B * S, device="cuda") if packed else torch.randn(B, HQ, S, device="cuda")

    def step():
        o, lse = ropekit.rope_attention(q, k, v, positions=pos, is_causal=True, fold="q_log2", return_lse=True, **kw)
        return (o, lse, *torch.autograd.grad((o, lse), (q, k, v), (do, dlse)))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        with torch.no_grad():
            for t in (q, k, v, do, dlse):
                t.copy_(torch.randn_like(t))
            pos.copy_(torch.randint_like(pos, 0, 1000))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, step()):
            assert torch.equal(got, want)


@pytest.mark.gpu
def test_cuda_float16_and_float32():
    for dtype in (torch.float16, torch.float32):
        q, k, v = make_qkv(2, 513, 8, 2, 64, dtype=dtype, device="cuda")
        check_against_definition("cuda", q, k, v, is_causal=True, with_lse=True)


@pytest.mark.gpu
def test_cuda_torch_compile_fullgraph():
    torch._dynamo.reset()
    q, k, v = make_qkv(2, 300, 8, 2, 128, dtype=torch.bfloat16, device="cuda")
    pos = torch.randint(0, 4096, (2, 300), device="cuda")

    def f(a, b, c, p):
        return ropekit.rope_attention(a, b, c, positions=p, is_causal=True, fold="q_log2")

    o_c = torch.compile(f, fullgraph=True)(q, k, v, pos)
    o_e = f(q, k, v, pos)
    torch.testing.assert_close(o_c, o_e, rtol=0, atol=0)
    w = torch.randn_like(o_e)
    g_c = torch.autograd.grad((o_c.float() * w.float()).sum(), (q, k, v))
    g_e = torch.autograd.grad((o_e.float() * w.float()).sum(), (q, k, v))
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_opcheck():
    q, k, v = make_qkv(2, 40, 4, 2, 64, 32, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(torch.ops.ropekit.rope_attention.default,
                          _op_args(q, k, v, positions=torch.tensor([3, 70], device="cuda")))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "no-grad"])
def test_eager_route_equals_the_registered_op(route, grad):
    """Eager calls skip the dispatcher (``ropekit.autograd.EagerRopeAttention``); compiled ones run
    ``ropekit::rope_attention`` and its registered backward. Both run the same bodies: o, lse and every gradient
    (through o and lse, three calls with fresh data) agree bit for bit, and without autograd nothing records."""
    from ropekit import ops
    from ropekit._spec import RopeArgs
    from ropekit.attention import _unit_rows

    device = route_device(route)
    for call in range(3):
        q, k, v = make_qkv(1, 19 + call, 4, 2, 16, 8, device=device)
        q, k, v = (t.detach().requires_grad_(grad) for t in (q, k, v))
        do = torch.randn(1, 19 + call, 4, 8, device=device)
        dlse = torch.randn(1, 4, 19 + call, device=device)
        with route_context(route), torch.set_grad_enabled(grad):
            offset = torch.tensor([3], device=device)
            o, lse = ropekit.rope_attention(q, k, v, is_causal=True, return_lse=True, positions=offset, q_scale=0.5)
            table, (start, rot_dim, neox) = _unit_rows(q, RopeArgs(positions=offset, q_scale=0.5))
            o_op, lse_op = ops.rope_attention(q, k, v, table, None, "bshd", start, rot_dim, neox, 0.5, 1.0,
                                              (1 / math.sqrt(16)) / LN2, True, 0)
            assert torch.equal(o, o_op) and torch.equal(lse, lse_op)
            if not grad:
                assert o.grad_fn is None and lse.grad_fn is None
                continue
            assert type(o.grad_fn).__name__.startswith("EagerRopeAttention")
            got = torch.autograd.grad((o, lse), (q, k, v), (do, dlse))
            want = torch.autograd.grad((o_op, lse_op), (q, k, v), (do, dlse))
        for g, w in zip(got, want):
            assert torch.equal(g, w)
