"""ropekit.rope_attention on packed sequences (``layout="thd"`` with ``cu_seqlens``) against its definition.

The oracle is the float64 definition of tests/attention_definition.py applied to each sequence on its own (positions
restarting at 0 there, plus the sequence's offset where given) and concatenated: a packed call must equal
attention run sequence by sequence. The tolerance rule and the low-precision baseline are that module's too.
"""

from __future__ import annotations

import math

import pytest
import torch

import ropekit
from attention_definition import (
    LN2,
    assert_accurate,
    definition,
    low_precision,
    randn,
    route_context,
    route_device,
)
from helpers import INTERPRETED, ROUTES
from ropekit.testing import kernels_on_cpu

DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")]


def packed(lengths, HQ, HK, D, DV=None, *, dtype=torch.float32, device="cpu", storage="contiguous"):
    """q [T, HQ, D], k [T, HK, D], v [T, HK, DV] leaves that require grad, and cu_seqlens (int32, CPU).
    ``storage="packed"``: views of one QKV projection buffer (not contiguous)."""
    DV = D if DV is None else DV
    T = sum(lengths)
    if storage == "packed":
        buf = randn(T, HQ * D + HK * D + HK * DV, dtype=dtype, device=device)
        qf, kf, vf = buf.split([HQ * D, HK * D, HK * DV], dim=-1)
        q, k, v = qf.unflatten(-1, (HQ, D)), kf.unflatten(-1, (HK, D)), vf.unflatten(-1, (HK, DV))
    else:
        q, k, v = (randn(T, h, d, dtype=dtype, device=device) for h, d in ((HQ, D), (HK, D), (HK, DV)))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return (*(t.detach().requires_grad_(True) for t in (q, k, v)), cu)


def _per_sequence(fn, q, k, v, cu, offsets=None, **kw):
    """``fn`` (the definition or the low-precision baseline) on each sequence as a batch of one, its outputs
    concatenated back to packed form: o [T, HQ, DV] and lse [HQ, T]."""
    outs, lses = [], []
    bounds = cu.tolist()
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if a == b:
            continue
        extra = {} if offsets is None else dict(positions=int(offsets[i]))
        o, lse = fn(q[a:b][None], k[a:b][None], v[a:b][None], **kw, **extra)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


def check_packed(route, q, k, v, cu, *, offsets=None, max_seqlen=None, **kw):
    """rope_attention on the packed tensors (forward, and backward through o and lse) against the per-sequence
    definition; o, lse, dq, dk, dv by the module's rule."""
    dtype = q.dtype
    positions = None if offsets is None else offsets.to(q.device)
    with route_context(route):
        o, lse = ropekit.rope_attention(q, k, v, layout="thd", cu_seqlens=cu.to(q.device), max_seqlen=max_seqlen,
                                        positions=positions, return_lse=True, **kw)
    assert o.shape == (*q.shape[:2], v.shape[2]) and lse.shape == (q.shape[1], q.shape[0])
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o_ref, lse_ref = _per_sequence(definition, q64, k64, v64, cu, offsets, **kw)
    do = randn(o.shape[1], o.shape[0], o.shape[2], dtype=dtype, device=q.device).transpose(0, 1)  # not contiguous
    dlse = randn(*lse.shape, dtype=torch.float32, device=q.device)
    base = None
    if dtype != torch.float32:
        truncate = route == "cpu-kernels"
        parts, bounds = [], cu.tolist()
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            if a == b:
                continue
            extra = {} if offsets is None else dict(positions=int(offsets[i]))
            parts.append(low_precision(q[a:b][None], k[a:b][None], v[a:b][None], do[a:b][None],
                                       dlse[None, :, a:b], truncate=truncate, **kw, **extra))
        base = [torch.cat([p[0][0] for p in parts]), torch.cat([p[1][0] for p in parts], -1)]
        # each sequence's dk, dv come from its own tokens only: concatenating the per-sequence gradients is exact
        base += [torch.cat([p[i][0] for p in parts]) for i in (2, 3, 4)]
    assert_accurate("o", o, o_ref, None if base is None else base[0])
    assert_accurate("lse", lse, lse_ref, None if base is None else base[1],
                    dtype=dtype if dtype != torch.float32 else torch.float32)
    with route_context(route):
        got = torch.autograd.grad((o, lse), (q, k, v), (do, dlse))
    want = torch.autograd.grad((o_ref, lse_ref), (q64, k64, v64), (do.double(), dlse.double()))
    for i, name in enumerate(("dq", "dk", "dv")):
        assert got[i].dtype == dtype and got[i].shape == (q, k, v)[i].shape
        assert_accurate(name, got[i], want[i], None if base is None else base[2 + i])


# lengths with an empty sequence, one token, one crossing several interpreter tiles (16) and a partial tile
LENGTHS = [5, 0, 1, 37, 18]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_sequences_match_each_sequence_alone(route, dtype, causal):
    q, k, v, cu = packed(LENGTHS, 4, 2, 16, dtype=dtype, device=route_device(route))
    check_packed(route, q, k, v, cu, is_causal=causal)


@pytest.mark.parametrize("route", ROUTES)
def test_packed_mla_shapes_offsets_and_folds(route):
    """MLA-like heads (rope at the back of a wider q/k head, v of its own width), per-sequence position offsets,
    interleaved pairs, a fold preset, q/k/v views of one projection buffer."""
    q, k, v, cu = packed([9, 21, 3], 4, 1, 24, 16, dtype=torch.float32, device=route_device(route),
                         storage="packed")
    offsets = torch.tensor([7, 0, 300])
    check_packed(route, q, k, v, cu, offsets=offsets, is_causal=True, rotary_dim=8, rotary_at="back",
                 style="interleaved", fold="q_log2", base=500000.0)


def test_thd_without_cu_seqlens_is_one_sequence():
    q, k, v, _ = packed([13], 2, 1, 16)
    with kernels_on_cpu() if INTERPRETED else torch.no_grad():
        o = ropekit.rope_attention(q, k, v, layout="thd", is_causal=True, positions=4)
        o_b = ropekit.rope_attention(q[None], k[None], v[None], is_causal=True, positions=4)
    assert torch.equal(o, o_b[0])


def test_max_seqlen_given_and_lse_only_gradient():
    """``max_seqlen`` above the longest sequence changes nothing; a gradient through lse alone reaches q and k."""
    q, k, v, cu = packed([4, 11], 2, 2, 16, dtype=torch.float64)
    o, lse = ropekit.rope_attention(q, k, v, layout="thd", cu_seqlens=cu, return_lse=True, is_causal=True)
    o2, lse2 = ropekit.rope_attention(q, k, v, layout="thd", cu_seqlens=cu, max_seqlen=40, return_lse=True,
                                      is_causal=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    dq, dk, dv = torch.autograd.grad(lse.sum(), (q, k, v), allow_unused=True)
    assert dq.abs().sum() > 0 and dk.abs().sum() > 0 and (dv is None or dv.abs().sum() == 0)


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
@pytest.mark.parametrize("blocks", [((32, 16), (16, 32)), ((64, 32), (32, 16))], ids=["f32x16-b16x32",
                                                                                   "f64x32-b32x16"])
def test_launcher_block_shapes_and_bad_boundaries(blocks):
    """The kernels at GPU-like block shapes on packed sequences (against the per-sequence definition), and
    boundaries past the tokens (as a device ``cu_seqlens`` with ``max_seqlen`` goes unchecked): clamped into the
    tensors, nothing read or written outside them -- the rows around the outputs stay poisoned."""
    from ropekit._spec import RopeArgs
    from ropekit.attention import _unit_rows
    from ropekit.triton.attention_launcher import Blocks, Rotation, launch_backward, launch_forward

    (fm, fn), (bm, bn) = blocks
    lengths = [70, 3, 33]
    q, k, v, cu = (t.detach() if t.is_floating_point() else t for t in packed(lengths, 2, 1, 32, 16))
    T = q.shape[0]
    qc, kc, vc = q[None], k[None], v[None]
    table, (start, R, neox) = _unit_rows(q, RopeArgs(layout="thd", cu_seqlens=cu, rotary_dim=16))
    rot = Rotation(start, R, neox)
    mult = (1.0 / math.sqrt(32)) / LN2
    # outputs inside guard rows: T + 8 rows, the tensors' T in the middle
    o_buf = torch.full((T + 8, 2, 16), math.nan)
    lse = torch.full((1, 2, T), math.nan)
    o = o_buf[4:4 + T][None]
    launch_forward(qc, kc, vc, table, o, lse, rot, 1.0, 1.0, mult, True, blocks=Blocks(fm, fn, 4, 1),
                   cu_seqlens=cu, max_seqlen=max(lengths))
    do = randn(1, T, 2, 16, dtype=torch.float32, device="cpu")
    grads = [torch.full((T + 8, *t.shape[1:]), math.nan) for t in (q, k, v)]
    dq, dk, dv = (g[4:4 + T][None] for g in grads)
    launch_backward(do, None, qc, kc, vc, table, o, lse, dq, dk, dv, rot, 1.0, 1.0, mult, True,
                    blocks=Blocks(bm, bn, 4, 1), cu_seqlens=cu, max_seqlen=max(lengths))
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    o_ref, lse_ref = _per_sequence(definition, q64, k64, v64, cu, is_causal=True, rotary_dim=16)
    want = torch.autograd.grad(o_ref, (q64, k64, v64), do[0].double())
    for name, got, ref in zip(("o", "lse", "dq", "dk", "dv"), (o[0], lse[0], dq[0], dk[0], dv[0]),
                              (o_ref, lse_ref, *want)):
        assert_accurate(name, got, ref)
    for buf in (o_buf, *grads):
        assert torch.isnan(buf[:4]).all() and torch.isnan(buf[4 + T:]).all()

    # boundaries past the tokens and falling: clamped, nothing outside the tensors written
    bad = torch.tensor([0, 5, T + 7, 2, T + 100], dtype=torch.int32)
    o_buf.fill_(math.nan)
    launch_forward(qc, kc, vc, table, o, lse, rot, 1.0, 1.0, mult, True, blocks=Blocks(fm, fn, 4, 1),
                   cu_seqlens=bad, max_seqlen=T + 100)
    for g in grads:
        g.fill_(math.nan)
    launch_backward(do, None, qc, kc, vc, table, o, lse, dq, dk, dv, rot, 1.0, 1.0, mult, True,
                    blocks=Blocks(bm, bn, 4, 1), cu_seqlens=bad, max_seqlen=T + 100)
    for buf in (o_buf, *grads):
        assert torch.isnan(buf[:4]).all() and torch.isnan(buf[4 + T:]).all()


def _bad_cases():
    q, k, v, cu = packed([3, 5], 2, 1, 16)
    q, k, v = q.detach(), k.detach(), v.detach()
    return [
        ("cu-needs-thd", (q[None], k[None], v[None]), dict(cu_seqlens=cu), ValueError, "cu_seqlens.*thd"),
        ("cu-2d", (q, k, v), dict(layout="thd", cu_seqlens=cu[None]), ValueError, "cu_seqlens"),
        ("cu-float", (q, k, v), dict(layout="thd", cu_seqlens=cu.float()), TypeError, "cu_seqlens"),
        ("cu-wrong-end", (q, k, v), dict(layout="thd", cu_seqlens=torch.tensor([0, 3, 7])), ValueError,
         "cu_seqlens"),
        ("cu-not-from-0", (q, k, v), dict(layout="thd", cu_seqlens=torch.tensor([1, 3, 8])), ValueError,
         "cu_seqlens"),
        ("cu-falling", (q, k, v), dict(layout="thd", cu_seqlens=torch.tensor([0, 6, 3, 8])), ValueError,
         "cu_seqlens"),
        ("max-seqlen-short", (q, k, v), dict(layout="thd", cu_seqlens=cu, max_seqlen=4), ValueError, "max_seqlen"),
        ("max-seqlen-negative", (q, k, v), dict(layout="thd", cu_seqlens=cu, max_seqlen=-1), ValueError,
         "max_seqlen"),
        ("max-seqlen-alone", (q, k, v), dict(layout="thd", max_seqlen=8), ValueError, "max_seqlen"),
        ("thd-4d", (q[None], k[None], v[None]), dict(layout="thd", cu_seqlens=cu), ValueError, r"\bq\b.*3-D"),
        ("thd-tokens-differ", (q, k[:7], v[:7]), dict(layout="thd", cu_seqlens=cu), ValueError, "sequence length"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_packed_input_raises_naming_the_argument(case):
    _, args, kwargs, exc, match = case
    with pytest.raises(exc, match=match):
        ropekit.rope_attention(*args, **kwargs)


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
@pytest.mark.parametrize("bounds", [[0, 3, 7], [1, 3, 8], [0, 6, 3, 8]], ids=["wrong-end", "not-from-0", "falling"])
@pytest.mark.parametrize("max_seqlen, check", [(None, False), (8, True)], ids=["read-for-longest", "checked"])
def test_bad_device_boundaries_raise_where_they_are_read(bounds, max_seqlen, check):
    """Under kernels_on_cpu a CPU cu_seqlens stands for a device one, which validation reads only when asked
    (check_positions); rope_attention also reads it for the longest sequence when max_seqlen is not given. Either
    read checks the values."""
    q, k, v, _ = (t.detach() if t.is_floating_point() else t for t in packed([3, 5], 2, 1, 16))
    with kernels_on_cpu(), pytest.raises(ValueError, match="cu_seqlens"):
        ropekit.rope_attention(q, k, v, layout="thd", cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
                               max_seqlen=max_seqlen, check_positions=check)


def test_compile_fullgraph_with_packed_sequences():
    """``torch.compile(fullgraph=True)`` with ``cu_seqlens`` and ``max_seqlen`` given (no host read of the
    boundaries in the graph): equal to eager, forward and gradients."""
    torch._dynamo.reset()
    q, k, v, cu = packed([6, 10, 1], 4, 2, 16)

    def f(a, b, c, cu_seqlens):
        return ropekit.rope_attention(a, b, c, layout="thd", cu_seqlens=cu_seqlens, max_seqlen=10, is_causal=True,
                                      return_lse=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for _ in range(2):
        o_c, lse_c = compiled(q, k, v, cu)
        o_e, lse_e = f(q, k, v, cu)
        torch.testing.assert_close(o_c, o_e, rtol=0, atol=0)
        torch.testing.assert_close(lse_c, lse_e, rtol=0, atol=0)
        g_c = torch.autograd.grad(o_c.sum() + lse_c.sum(), (q, k, v))
        g_e = torch.autograd.grad(o_e.sum() + lse_e.sum(), (q, k, v))
        for a, b in zip(g_c, g_e):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("route", ROUTES)
def test_repeated_calls_with_fresh_boundaries(route):
    """Three calls and more with fresh data and new boundaries (cached launches must read the new ones)."""
    for lengths in ([4, 9], [4, 9], [13], [1, 1, 11]):
        q, k, v, cu = packed(lengths, 2, 1, 16, dtype=torch.bfloat16, device=route_device(route))
        check_packed(route, q, k, v, cu, is_causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D, DV, rope", [(128, 128, {}), (64, 64, dict(positions="offsets")),
                                         (192, 128, dict(rotary_dim=64, rotary_at="back", style="interleaved"))],
                         ids=["d128", "d64-offsets", "mla"])
def test_packed_sequences_on_the_gpu(dtype, D, DV, rope):
    """Realistic packed batches on CUDA (32/8 heads; 16 heads for MLA): lengths across the GPU's 128-row tiles,
    an empty sequence, a device cu_seqlens with and without max_seqlen."""
    lengths = [1000, 0, 3, 1537, 128]
    HQ, HK = (16, 16) if D == 192 else (32, 8)
    q, k, v, cu = packed(lengths, HQ, HK, D, DV, dtype=dtype, device="cuda")
    offsets = torch.tensor([5, 0, 70, 1000, 3]) if rope.pop("positions", None) else None
    check_packed("cuda", q, k, v, cu, offsets=offsets, is_causal=True, **rope)
    check_packed("cuda", q, k, v, cu, offsets=offsets, max_seqlen=max(lengths), is_causal=False, **rope)
