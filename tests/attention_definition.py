"""The definition of RoPE attention that tests/test_attention.py and tests/test_attention_varlen.py hold
ropekit.rope_attention to: inputs, the float64 oracle, the low-precision baseline and the tolerance rule.

The reference is written here from the definition, in float64 with torch ops, and differentiated by autograd:
angles ``pos * inv_freq`` (``inv_freq[i] = base ** (-2i / R)``, formed in float64 and rounded once to float32 as
apply_rope documents for ``base``) or the given tables, each pair of columns turned
by its angle, ``o = softmax_b(scale * (q_scale R q)(k_scale R k)^T + causal mask) v`` per head (q head h reads kv
head ``h // (Hq / Hk)``), ``lse`` the natural log of each row's sum. Nothing of ropekit's rotation or
``ropekit.reference`` is used for it.

Each comparison runs on three routes: ``cpu`` (CPU tensors: ropekit's float64 reference path), ``interp`` (CPU
tensors through the Triton kernels under the interpreter, ``kernels_on_cpu()``) and ``cuda`` (marked ``gpu``).

One tolerance rule, by dtype (``err`` = max |out - ref|, ``mag`` = max(max |ref|, 1): the inputs are unit
normal, so 1 is the scale of the data):
  float64: err <= 1e-10 mag; float32: err <= 1e-5 mag.
  float16 / bfloat16: err <= 2 * err_base + 1e-5 mag, where err_base is the error of the same computation done in
  low precision by torch (:func:`low_precision`: the rotation rounded to the dtype, fp32 scores and softmax,
  probabilities and output rounded to the dtype, gradients by autograd, rounded where the tensor they belong to
  is low precision and for the score gradient dS, a product operand) -- flash-attention's rule. Under the
  interpreter, conversions of fp32 to bfloat16 truncate (round toward zero) where compiled kernels round to
  nearest; the baseline then truncates too (the same computation on that backend). lse is float32 whatever the
  inputs: float64 inputs hold it to the float32 rule.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import ropekit
from ropekit.testing import kernels_on_cpu

HAS_CUDA = torch.cuda.is_available()
LN2 = math.log(2.0)
F64 = torch.float64

DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float16, id="f16")]
LOW = (torch.bfloat16, torch.float16)


def route_context(route: str):
    return kernels_on_cpu() if route == "cpu-kernels" else contextlib.nullcontext()


def route_device(route: str) -> str:
    return "cuda" if route == "cuda" else "cpu"


# --- layouts and inputs ----------------------------------------------------------------------------------------

def canon(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The [B, S, H, D] view of a tensor in ``layout`` (and back: each is its own inverse)."""
    return {"bshd": x, "bhsd": x.transpose(1, 2), "sbhd": x.transpose(0, 1)}[layout]


def randn(*shape, dtype, device) -> torch.Tensor:
    """Standard normal, drawn in float64 and rounded once to ``dtype``."""
    return torch.randn(*shape, dtype=F64).to(dtype=dtype, device=device)


def make_qkv(B, S, HQ, HK, D, DV=None, *, dtype=torch.float32, device="cpu", layout="bshd", storage="contiguous"):
    """Leaf tensors q [.., HQ, D], k [.., HK, D], v [.., HK, DV] in ``layout`` that require grad.

    storage: ``contiguous``; ``packed`` -- views of one packed QKV projection buffer (the heads of q, k, v side by
    side in each token's row; bshd and sbhd); ``strided`` -- every other column of a wider tensor (the last dim not
    contiguous); ``transposed`` -- views of tensors stored in another layout (bshd
    and sbhd: of a [B, H, S, D] tensor; bhsd: of a [B, S, H, D] one); ``padded`` -- every tensor a view whose rows
    have room for more heads than it uses."""
    DV = D if DV is None else DV
    if storage == "contiguous":
        q, k, v = (canon(randn(B, S, h, d, dtype=dtype, device=device), layout).contiguous()
                   for h, d in ((HQ, D), (HK, D), (HK, DV)))
    elif storage == "packed":
        assert layout in ("bshd", "sbhd"), layout
        lead = (B, S) if layout == "bshd" else (S, B)
        buf = randn(*lead, HQ * D + HK * D + HK * DV, dtype=dtype, device=device)
        qf, kf, vf = buf.split([HQ * D, HK * D, HK * DV], dim=-1)
        q, k, v = qf.unflatten(-1, (HQ, D)), kf.unflatten(-1, (HK, D)), vf.unflatten(-1, (HK, DV))
        assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    elif storage == "transposed":
        def one(h, d):
            if layout == "bhsd":
                return randn(B, S, h, d, dtype=dtype, device=device).transpose(1, 2)
            x = randn(B, h, S, d, dtype=dtype, device=device).transpose(1, 2)  # bshd view
            return x if layout == "bshd" else x.transpose(0, 1)
        q, k, v = one(HQ, D), one(HK, D), one(HK, DV)
        assert not q.is_contiguous()
    elif storage == "strided":  # every other column: the last dim is not contiguous (copied by the op)
        q, k, v = (canon(randn(B, S, h, 2 * d, dtype=dtype, device=device), layout)[..., ::2]
                   for h, d in ((HQ, D), (HK, D), (HK, DV)))
    elif storage == "padded":
        def one(h, d):
            x = canon(randn(B, S, h + 3, d, dtype=dtype, device=device), layout).contiguous()
            return x.narrow(2 if layout != "bhsd" else 1, 1, h)
        q, k, v = one(HQ, D), one(HK, D), one(HK, DV)
        assert not q.is_contiguous()
    else:
        raise AssertionError(storage)
    return q.detach().requires_grad_(True), k.detach().requires_grad_(True), v.detach().requires_grad_(True)


def grad_like(o: torch.Tensor, kind: str = "transposed") -> torch.Tensor:
    """A random gradient for ``o``, not contiguous: ``transposed`` -- a view of a tensor stored with o's first two
    dims swapped (contiguous last dim); ``strided`` -- every other column of a wider tensor (last-dim stride 2)."""
    shape = list(o.shape)
    if kind == "transposed":
        g = randn(shape[1], shape[0], *shape[2:], dtype=o.dtype, device=o.device).transpose(0, 1)
        if g.is_contiguous():  # dims of size 1: no other order
            kind = "strided"
    if kind == "strided":
        g = randn(*shape[:-1], 2 * shape[-1], dtype=o.dtype, device=o.device)[..., ::2]
    elif kind == "contiguous":
        g = randn(*shape, dtype=o.dtype, device=o.device)
    assert kind == "contiguous" or not g.is_contiguous()
    return g


# --- the definition in float64 ---------------------------------------------------------------------------------

def position_ids(B: int, S: int, positions, device) -> torch.Tensor:
    """Each token's position, float64 [B or 1, S]."""
    ar = torch.arange(S, dtype=F64, device=device)
    if positions is None:
        return ar[None]
    if isinstance(positions, int):
        return (ar + positions)[None]
    positions = positions.to(device=device, dtype=F64)
    if positions.dim() == 0:  # an offset
        return (ar + positions)[None]
    if positions.dim() == 1:  # per-sequence offsets
        return positions[:, None] + ar
    return positions  # [B, S] or [1, S] ids


def section_axes(sections, section_layout: str) -> list[int]:
    """Which axis of multi-axis positions each pair takes."""
    A, half = len(sections), sum(sections)
    if section_layout == "contiguous":
        return [a for a, n in enumerate(sections) for _ in range(n)]
    # interleaved: pair i takes axis a = i % A (a >= 1) while i < A * n_a, else axis 0
    return [i % A if (i % A >= 1 and i < A * sections[i % A]) else 0 for i in range(half)]


def rotary_geometry(D: int, rope: dict) -> tuple[int, int]:
    """(R, first rotated column)."""
    R = rope.get("rotary_dim")
    if R is None:
        if rope.get("inv_freq") is not None:
            R = 2 * rope["inv_freq"].numel()
        elif rope.get("cos") is not None:
            R = 2 * rope["cos"].shape[-1]
        elif rope.get("angles") is not None:
            R = 2 * rope["angles"].shape[-1]
        else:
            R = D
    return R, (0 if rope.get("rotary_at", "front") == "front" else D - R)


def cos_sin64(B: int, S: int, D: int, rope: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each token's pair angles, float64 [B or 1, S, R/2], times ``rotary_scale``."""
    R, _ = rotary_geometry(D, rope)
    positions = rope.get("positions")
    if rope.get("cos") is not None or rope.get("angles") is not None:
        tables = [rope["cos"], rope["sin"]] if rope.get("cos") is not None else [rope["angles"]]
        tables = [t.to(device=device, dtype=F64) for t in tables]
        if tables[0].dim() == 3:  # already gathered per token
            picked = tables
        else:  # [P, R/2] indexed by position
            idx = position_ids(B, S, positions, device).long()
            picked = [t[idx] for t in tables]
        cos, sin = picked if len(picked) == 2 else (picked[0].cos(), picked[0].sin())
    else:
        if rope.get("inv_freq") is not None:
            inv = rope["inv_freq"].to(device=device, dtype=F64)
        else:
            # apply_rope's frequencies of ``base``: base ** (-2i / R) formed in float64 and rounded once to
            # float32 (ropekit.frequencies.formulas.default_inv_freq; transformers' frequencies are float32 too)
            inv = (rope.get("base", 10000.0) ** (-torch.arange(0, R, 2, dtype=F64, device=device) / R)).float().double()
        if rope.get("sections") is not None:
            axes = torch.tensor(section_axes(rope["sections"], rope.get("section_layout", "contiguous")),
                                device=device)
            pos = positions.to(device=device, dtype=F64)[axes]  # [R/2, B, S]
            theta = pos.permute(1, 2, 0) * inv
        else:
            theta = position_ids(B, S, positions, device)[..., None] * inv
        cos, sin = theta.cos(), theta.sin()
    r = rope.get("rotary_scale", 1.0)
    return cos * r, sin * r


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, R: int, start: int, style: str,
           scale: float) -> torch.Tensor:
    """``scale * R(theta) x`` for canonical x [B, S, H, D] (cos, sin [B or 1, S, R/2], x's dtype), torch ops only:
    pairs (i, i + R/2) (neox) or (2i, 2i + 1) (interleaved) of the R columns from ``start``; others pass."""
    rot = x[..., start:start + R]
    if style == "neox":
        x1, x2 = rot[..., :R // 2], rot[..., R // 2:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
    r = torch.cat([y1, y2], -1) if style == "neox" else torch.stack([y1, y2], -1).flatten(-2)
    return torch.cat([x[..., :start], r, x[..., start + R:]], -1) * scale


def attention64(qr, kr, v, *, scale: float, causal: bool, log2: bool):
    """o [B, S, HQ, DV] and natural-log lse [B, HQ, S] of canonical rotated q, k and v (float64)."""
    g = qr.shape[2] // kr.shape[2]
    q = qr.transpose(1, 2)
    k = kr.transpose(1, 2).repeat_interleave(g, dim=1)
    vv = v.transpose(1, 2).repeat_interleave(g, dim=1)
    s = scale * (q @ k.transpose(-1, -2))
    if causal:
        S = s.shape[-1]
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    m = s.amax(-1, keepdim=True).detach()
    e = torch.exp2(s - m) if log2 else torch.exp(s - m)  # base 2: p = 2^(s - max) / sum 2^(s - max)
    total = e.sum(-1, keepdim=True)
    o = (e / total) @ vv
    lse = (m + total.log2()) * LN2 if log2 else m + total.log()  # ln sum b^s
    return o.transpose(1, 2), lse.squeeze(-1)


def definition(q, k, v, *, layout="bshd", scale=None, is_causal=False, log2_softmax=False, q_scale=1.0,
               k_scale=1.0, style="neox", **rope):
    """float64 (o in ``layout``, lse), differentiable in the float64 leaves q, k, v."""
    qc, kc, vc = canon(q, layout), canon(k, layout), canon(v, layout)
    B, S, _, D = qc.shape
    R, start = rotary_geometry(D, rope)
    cos, sin = cos_sin64(B, S, D, rope, q.device)
    qr = rotate(qc, cos, sin, R=R, start=start, style=style, scale=q_scale)
    kr = rotate(kc, cos, sin, R=R, start=start, style=style, scale=k_scale)
    a = 1.0 / math.sqrt(D) if scale is None else scale
    o, lse = attention64(qr, kr, vc, scale=a, causal=is_causal, log2=log2_softmax)
    return canon(o, layout), lse


# --- the low-precision baseline --------------------------------------------------------------------------------

def round_to(x: torch.Tensor, dtype: torch.dtype, truncate: bool) -> torch.Tensor:
    """fp32 ``x`` rounded to ``dtype`` (to nearest, or toward zero for bfloat16 with ``truncate``), as fp32."""
    if truncate and dtype == torch.bfloat16:
        return (x.float().contiguous().view(torch.int32) & -65536).view(torch.float32)
    return x.to(dtype).float()


class _Round(torch.autograd.Function):
    """A tensor held in low precision: its value rounded forward and its gradient backward (what autograd does
    with ``x.to(dtype)``)."""

    @staticmethod
    def forward(ctx, x, dtype, truncate):
        ctx.dtype, ctx.truncate = dtype, truncate
        return round_to(x, dtype, truncate)

    @staticmethod
    def backward(ctx, g):
        return round_to(g, ctx.dtype, ctx.truncate), None, None


class _RoundGrad(torch.autograd.Function):
    """The value passed on, its gradient rounded: the score gradient dS, an operand of the backward's products."""

    @staticmethod
    def forward(ctx, x, dtype, truncate):
        ctx.dtype, ctx.truncate = dtype, truncate
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return round_to(g, ctx.dtype, ctx.truncate), None, None


FOLD_SCALES = {  # (q factor, k factor, attention scale, base 2) of each preset, from the attention scale a
    "none": lambda a: (1.0, 1.0, a, None),
    "q": lambda a: (a, 1.0, 1.0, False),
    "q_log2": lambda a: (a / LN2, 1.0, 1.0, True),
    "symmetric": lambda a: (math.sqrt(a), math.sqrt(a), 1.0, False),
    "symmetric_log2": lambda a: (math.sqrt(a) / LN2, math.sqrt(a), 1.0, True),
}


def effective_scales(D, *, fold="none", scale=None, log2_softmax=False, q_scale=1.0, k_scale=1.0):
    """(q's and k's rotation scales, attention scale, base 2) that ``fold`` leaves."""
    a = 1.0 / math.sqrt(D) if scale is None else scale
    fq, fk, attn, log2 = FOLD_SCALES[fold](a)
    return q_scale * fq, k_scale * fk, attn, log2_softmax if log2 is None else log2


def low_precision(q, k, v, do, dlse, *, truncate, layout="bshd", scale=None, is_causal=False, log2_softmax=False,
                  fold="none", q_scale=1.0, k_scale=1.0, style="neox", **rope):
    """The same attention done in low precision by torch: the tensors a flash-attention kernel holds in q's dtype
    -- the rotated q and k (fp32 rotation with the fold's scales, rounded), the probabilities (fp32 softmax of fp32
    scores, rounded), o -- are rounded, and so are their gradients and the score gradient dS (the backward's
    product operand); products sum in fp32; gradients by autograd, rounded once more when stored. lse stays fp32.
    Returns (o, lse, dq, dk, dv)."""
    dtype = q.dtype
    rnd = lambda x: _Round.apply(x, dtype, truncate)  # noqa: E731
    rnd_grad = lambda x: _RoundGrad.apply(x, dtype, truncate)  # noqa: E731
    qf, kf, vf = (canon(t, layout).detach().float().requires_grad_(True) for t in (q, k, v))
    B, S, _, D = qf.shape
    R, start = rotary_geometry(D, rope)
    cos, sin = (t.float() for t in cos_sin64(B, S, D, rope, q.device))
    q_eff, k_eff, a, log2 = effective_scales(D, fold=fold, scale=scale, log2_softmax=log2_softmax, q_scale=q_scale,
                                             k_scale=k_scale)
    qr = rnd(rotate(qf, cos, sin, R=R, start=start, style=style, scale=q_eff)).transpose(1, 2)
    g = qf.shape[2] // kf.shape[2]
    kr = rnd(rotate(kf, cos, sin, R=R, start=start, style=style, scale=k_eff)).transpose(1, 2)
    kr = kr.repeat_interleave(g, dim=1)
    vv = vf.transpose(1, 2).repeat_interleave(g, dim=1)
    s = rnd_grad((qr @ kr.transpose(-1, -2)) * a)
    if is_causal:
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    m = s.amax(-1, keepdim=True).detach()
    e = torch.exp2(s - m) if log2 else torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    o = rnd(rnd(e / total) @ vv).transpose(1, 2)
    lse = ((m + total.log2()) * LN2 if log2 else m + total.log()).squeeze(-1)
    outs, grads = [o], [canon(do, layout).float()]
    if dlse is not None:
        outs.append(lse)
        grads.append(dlse.float())
    dq, dk, dv = torch.autograd.grad(outs, (qf, kf, vf), grads)
    dq, dk, dv = (canon(round_to(t, dtype, truncate), layout) for t in (dq, dk, dv))
    return canon(round_to(o.detach(), dtype, truncate), layout), lse.detach(), dq, dk, dv


# --- comparisons -----------------------------------------------------------------------------------------------

def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    d = (out.detach().double() - ref.detach().double().to(out.device)).abs()
    return torch.nan_to_num(d, nan=math.inf).max().item() if d.numel() else 0.0


def magnitude(ref: torch.Tensor) -> float:
    return max(ref.detach().abs().max().item() if ref.numel() else 0.0, 1.0)


def assert_accurate(name: str, out: torch.Tensor, ref: torch.Tensor, base: torch.Tensor | None = None, *,
                    dtype: torch.dtype | None = None) -> None:
    """The module's tolerance rule for ``out`` (of ``dtype``, default its own) against the float64 ``ref``; ``base``
    is the low-precision baseline's value for float16 / bfloat16."""
    dtype = out.dtype if dtype is None else dtype
    assert out.shape == ref.shape, (name, out.shape, ref.shape)
    assert not torch.isnan(out).any(), f"{name}: NaN"
    err, mag = max_err(out, ref), magnitude(ref)
    if dtype == F64:
        bound = 1e-10 * mag
    elif dtype == torch.float32:
        bound = 1e-5 * mag
    else:
        assert base is not None, name
        bound = 2.0 * max_err(base, ref) + 1e-5 * mag
    assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g} ({dtype}, max |ref| {mag:.3g})"


def check_against_definition(route, q, k, v, *, grads=True, with_lse=False, go_kind="transposed", do=None,
                             dlse=None, **kw):
    """Run rope_attention on ``route`` (forward, and backward through o -- and lse with ``with_lse``) and compare
    o, lse, dq, dk, dv with the definition. ``do``, ``dlse``: the gradients of o and lse (default: fresh random,
    ``do`` not contiguous). Returns the outputs."""
    dtype = q.dtype
    with route_context(route):
        res = ropekit.rope_attention(q, k, v, return_lse=with_lse, **kw)
    o, lse = res if with_lse else (res, None)
    assert o.dtype == dtype and o.device == q.device
    ref_kw = {key: val for key, val in kw.items() if key != "fold"}
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o_ref, lse_ref = definition(q64, k64, v64, **ref_kw)
    assert o.shape == o_ref.shape
    do = grad_like(o, go_kind) if do is None else do
    if with_lse and dlse is None:
        dlse = randn(*lse.shape, dtype=lse.dtype, device=q.device)
    base = None
    if dtype in LOW:
        base = low_precision(q, k, v, do, dlse, truncate=route == "cpu-kernels", **kw)
    assert_accurate("o", o, o_ref, None if base is None else base[0])
    if with_lse:
        assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert lse.shape == lse_ref.shape
        assert_accurate("lse", lse, lse_ref, None if base is None else base[1],
                        dtype=dtype if dtype in LOW else lse.dtype)
    if not grads:
        return o, lse
    outs, gouts = [o], [do]
    ref_outs, ref_gouts = [o_ref], [do.double()]
    if with_lse:
        outs.append(lse)
        gouts.append(dlse)
        ref_outs.append(lse_ref)
        ref_gouts.append(dlse.double())
    with route_context(route):
        got = torch.autograd.grad(outs, (q, k, v), gouts)
    want = torch.autograd.grad(ref_outs, (q64, k64, v64), ref_gouts)
    for i, name in enumerate(("dq", "dk", "dv")):
        assert got[i].dtype == dtype and got[i].shape == (q, k, v)[i].shape
        assert_accurate(name, got[i], want[i], None if base is None else base[2 + i])
    return o, lse, got
