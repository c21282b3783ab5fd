"""The registered ops called directly (``torch.ops.ropekit.*``), without the public functions' validation, with a
tensor whose last dim is strided: stride 0 (an ``expand()``ed view) or 2 (every other column of a wider buffer).

The kernels step through a row's columns one element apart. An op reads such an input as a contiguous copy: its
outputs are the float64 reference's of the same values, within the tolerance table, and the input is untouched.
An op refuses such a tensor where it writes it (``rope_``'s q and k, ``rope_kv_write``'s and
``mla_rope_kv_write``'s caches, the latter's given q outputs) with a ``ValueError`` naming it, before anything is
written: every tensor keeps its bits, the strided one's whole buffer included. Sums (attention, its gradients) are
held to the table's bound on the error relative to their largest value. The spec's 1-D tensors (``inv_freq``,
``seq_offsets``, ``cu_seqlens``) are read by value when strided too.

Routes: plain CPU tensors (the float32 torch path), the Triton kernels under the interpreter (``kernels_on_cpu``)
and CUDA.
"""

from __future__ import annotations

import pytest
import torch

from helpers import ROUTE_BACKENDS, ROUTES, assert_unchanged, norm_weight, on_route, snapshot
from ropekit import ops
from ropekit._cache_validation import validate_kv_write
from ropekit._spec import CacheArgs, RopeArgs
from ropekit._validation import validate, validate_args
from ropekit.reference import rms_norm_reference, rope_reference
from ropekit.testing import assert_close_to_ref, make_qk, max_relative_error, max_relative_tolerance

B, S, HQ, HK, D = 2, 3, 4, 2, 16
KINDS = ("stride0", "stride2")
F64 = torch.float64
REFUSED = "must have a contiguous last dimension"


def _strided(x: torch.Tensor, kind: str) -> torch.Tensor:
    """A view of ``x``'s shape whose last dim has stride 0 (each row repeats x's first column) or 2 (x's values, at
    the even columns of a NaN-filled buffer twice as wide)."""
    if kind == "stride0":
        view = x[..., :1].clone().expand(x.shape)
    else:
        buffer = x.new_full((*x.shape[:-1], 2 * x.shape[-1]), float("nan"))
        buffer[..., ::2] = x
        view = buffer[..., ::2]
    assert view.stride(-1) == (0 if kind == "stride0" else 2)
    return view


def _buffer(x: torch.Tensor) -> torch.Tensor:
    """The whole buffer a view looks into (a refused write must not touch its hidden elements either)."""
    return x._base if x._base is not None else x


def _with_strided(tensors: dict, name: str, kind: str) -> dict:
    return {**tensors, name: _strided(tensors[name], kind)}


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.to(F64).contiguous()


def _positions(dev) -> torch.Tensor:
    return torch.randint(0, 4000, (B, S), device=dev)


# ------------------------------------------------------------------------------------------- ropekit::rope(_)

@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ("q", "k"))
def test_rope_reads_a_strided_input(route, kind, name):
    with on_route(route, clear_plans=True) as dev:
        for _call in range(2):  # fresh data each call
            q, k = make_qk(B, S, HQ, HK, D, device=dev)
            spec = validate(q, k, positions=_positions(dev), q_scale=0.5)
            x = _with_strided({"q": q, "k": k}, name, kind)
            before = snapshot(_buffer(x["q"]), _buffer(x["k"]))
            outs = torch.ops.ropekit.rope.default(x["q"], x["k"], *spec)
            want = rope_reference(_f64(x["q"]), _f64(x["k"]), spec._replace(out_dtype=F64))
            for out, ref in zip(outs, want, strict=True):
                assert_close_to_ref(out, ref, torch.float32, ROUTE_BACKENDS[route])
            assert_unchanged((_buffer(x["q"]), _buffer(x["k"])), before)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ("q", "k"))
def test_rope_in_place_refuses_a_strided_target(route, kind, name):
    with on_route(route, clear_plans=True) as dev:
        q, k = make_qk(B, S, HQ, HK, D, device=dev)
        spec = validate(q, k, positions=_positions(dev))
        x = _with_strided({"q": q, "k": k}, name, kind)
        buffers = (_buffer(x["q"]), _buffer(x["k"]))
        before = snapshot(*buffers)
        with pytest.raises(ValueError, match=f"^{name} {REFUSED}"):
            torch.ops.ropekit.rope_.default(x["q"], x["k"], *spec)
        assert_unchanged(buffers, before)


def _every_other(t: torch.Tensor, poison) -> torch.Tensor:
    """A stride-2 view of the 1-D ``t``'s values, every other element of a buffer whose others hold ``poison``."""
    view = torch.stack([t, torch.full_like(t, poison)], -1)[:, 0]
    assert view.stride(0) == 2 and torch.equal(view, t)
    return view


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", ("inv_freq", "seq_offsets", "cu_seqlens"))
def test_rope_reads_strided_spec_vectors(route, name):
    """The spec's 1-D tensors, which the kernels index densely, as stride-2 views (NaN frequencies, far offsets and
    lengths between their elements): the op reads their values."""
    with on_route(route, clear_plans=True) as dev:
        q, k = make_qk(B, S, HQ, HK, D, device=dev)
        inv_freq = torch.rand(D // 2, device=dev)
        kwargs = dict(inv_freq=inv_freq, positions=torch.tensor([3, 700], device=dev))
        if name == "cu_seqlens":  # B * S packed tokens in two sequences of 2 and 4
            q, k = q.reshape(B * S, HQ, D), k.reshape(B * S, HK, D)
            kwargs = dict(inv_freq=inv_freq, layout="thd", cu_seqlens=torch.tensor([0, 2, B * S], device=dev))
        spec = validate(q, k, **kwargs)
        poison = {"inv_freq": float("nan"), "seq_offsets": 10**6, "cu_seqlens": 1}[name]
        strided = spec._replace(**{name: _every_other(getattr(spec, name), poison)})
        outs = torch.ops.ropekit.rope.default(q, k, *strided)
        want = rope_reference(_f64(q), _f64(k), spec._replace(out_dtype=F64))
        for out, ref in zip(outs, want, strict=True):
            assert_close_to_ref(out, ref, torch.float32, ROUTE_BACKENDS[route])


# ------------------------------------------------------------------------ ropekit::qk_norm_rope (+ backward)

def _norm_case(dev):
    q, k = make_qk(B, S, HQ, HK, D, device=dev)
    weights = norm_weight(D, torch.float32, dev, 0.5), norm_weight(D, torch.float32, dev, 0.5)
    return q, k, weights, validate(q, k, positions=_positions(dev), rotary_dim=8)


def _norm_rope64(q, k, q_weight, k_weight, spec):
    """The float64 reference of qk_norm_rope (weight_offset 0.5, eps 1e-6): [q_out, k_out]."""
    qn = rms_norm_reference(q, q_weight, 0.5, 1e-6, F64)
    kn = rms_norm_reference(k, k_weight, 0.5, 1e-6, F64)
    return rope_reference(qn, kn, spec._replace(out_dtype=F64))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ("q", "k"))
def test_qk_norm_rope_reads_a_strided_input(route, kind, name):
    with on_route(route, clear_plans=True) as dev:
        for _call in range(2):
            q, k, (qw, kw), spec = _norm_case(dev)
            x = _with_strided({"q": q, "k": k}, name, kind)
            before = snapshot(_buffer(x["q"]), _buffer(x["k"]))
            outs = torch.ops.ropekit.qk_norm_rope.default(x["q"], x["k"], qw, kw, 0.5, 1e-6, *spec)
            want = _norm_rope64(_f64(x["q"]), _f64(x["k"]), _f64(qw), _f64(kw), spec)
            for out, ref in zip(outs, want, strict=True):
                assert_close_to_ref(out, ref, torch.float32, ROUTE_BACKENDS[route])
            assert_unchanged((_buffer(x["q"]), _buffer(x["k"])), before)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ("q", "k"))
def test_qk_norm_rope_backward_reads_a_strided_input(route, kind, name):
    """The gradients of q, k and the weights for a strided q or k (the saved inputs): torch.autograd of the float64
    reference, within the table's bound on the error relative to each gradient's largest value. Not element-wise:
    a stride-0 row is one value repeated, so the norm's backward ``r * (dh - xh * mean(dh * xh))`` subtracts
    nearly equal terms wherever ``dh`` is near its row's mean, and those elements' own relative error says nothing
    about which memory was read (a wrong read is wrong by the row's whole size)."""
    with on_route(route, clear_plans=True) as dev:
        for _call in range(2):
            q, k, (qw, kw), spec = _norm_case(dev)
            x = _with_strided({"q": q, "k": k}, name, kind)
            grads = torch.randn_like(q), torch.randn_like(k)
            got = torch.ops.ropekit.qk_norm_rope_backward.default(*grads, x["q"], x["k"], qw, kw, 0.5, 1e-6, *spec)
            leaves = [_f64(t).requires_grad_(True) for t in (x["q"], x["k"], qw, kw)]
            want = torch.autograd.grad(_norm_rope64(*leaves, spec), leaves, [g.to(F64) for g in grads])
            for g, w in zip(got, want):
                assert g.dtype == torch.float32 and g.shape == w.shape
                assert max_relative_error(g, w) <= max_relative_tolerance(torch.float32, ROUTE_BACKENDS[route])


# --------------------------------------------------------------------------------------- ropekit::rope_kv_write

SLOTS = (5, 2, 0)  # the paged caches' rows [2 blocks x 4] the 3 tokens go to; the other rows stay NaN


def _kv_case(dev):
    """3 decode tokens of 3-D q, k, v into poisoned paged caches [2, 4, HK, D]: (tensors by the op's argument
    names, 4-D; the cache's op arguments; the rotation's spec)."""
    q, k, v = (torch.randn(len(SLOTS), h, D, dtype=F64).float().to(dev) for h in (HQ, HK, HK))
    caches = [torch.full((2, 4, HK, D), float("nan"), device=dev) for _ in range(2)]
    slots = torch.tensor(SLOTS, device=dev)
    q4, k4, v4, rope_args, cache = validate_kv_write(
        q, k, CacheArgs(v, *caches, slot_mapping=slots, cache_layout="paged"),
        RopeArgs(positions=torch.randint(0, 4000, (len(SLOTS),), device=dev)))
    tensors = dict(q=q4, k=k4, v=v4, k_cache=caches[0], v_cache=caches[1])
    return tensors, ops.cache_op_args(cache), validate_args(q4, k4, rope_args)


def _kv_write(x: dict, cache_args: tuple, spec) -> torch.Tensor:
    return torch.ops.ropekit.rope_kv_write.default(x["q"], x["k"], x["v"], x["k_cache"], x["v_cache"], None, None,
                                                   0.0, 1e-6, *cache_args, *spec)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ("q", "k", "v"))
def test_rope_kv_write_reads_a_strided_input(route, kind, name):
    with on_route(route, clear_plans=True) as dev:
        for _call in range(2):
            tensors, cache_args, spec = _kv_case(dev)
            x = _with_strided(tensors, name, kind)
            inputs = [_buffer(x[n]) for n in ("q", "k", "v")]
            before = snapshot(*inputs)
            q_out = _kv_write(x, cache_args, spec)
            want_q, want_k = rope_reference(_f64(x["q"]), _f64(x["k"]), spec._replace(out_dtype=F64))
            assert_close_to_ref(q_out, want_q, torch.float32, ROUTE_BACKENDS[route])
            rows = list(SLOTS)
            k_rows, v_rows = (x[n].view(-1, HK, D) for n in ("k_cache", "v_cache"))
            assert_close_to_ref(k_rows[rows], want_k.view(-1, HK, D), torch.float32, ROUTE_BACKENDS[route])
            assert torch.equal(v_rows[rows], x["v"].reshape(-1, HK, D))  # v is copied as it is
            others = [r for r in range(k_rows.shape[0]) if r not in rows]
            assert k_rows[others].isnan().all() and v_rows[others].isnan().all()
            assert_unchanged(inputs, before)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ("k_cache", "v_cache"))
def test_rope_kv_write_refuses_a_strided_cache(route, kind, name):
    with on_route(route, clear_plans=True) as dev:
        tensors, cache_args, spec = _kv_case(dev)
        x = _with_strided(tensors, name, kind)
        buffers = [_buffer(x[n]) for n in ("q", "k", "v", "k_cache", "v_cache")]
        before = snapshot(*buffers)
        with pytest.raises(ValueError, match=f"^{name} {REFUSED}"):
            _kv_write(x, cache_args, spec)
        assert_unchanged(buffers, before)


# ------------------------------------------------------------------- ropekit::mla_rope, ropekit::mla_rope_kv_write

MLA_H, D_NOPE, D_ROPE, LATENT = 2, 8, 8, 8  # q [3 tokens, 1, MLA_H, D_NOPE + D_ROPE], k_pe [.., 1, D_ROPE]


def _mla_case(dev):
    """3 decode tokens for two paged latent caches, ckv [2, 4, LATENT] and kpe [2, 4, D_ROPE], poisoned, and
    poisoned split q outputs: (tensors by the op's argument names, slots, spec, k_heads)."""
    from ropekit import mla

    q, k_pe, kv_c = (torch.randn(len(SLOTS), *shape, dtype=F64).float().to(dev)
                     for shape in ((MLA_H, D_NOPE + D_ROPE), (1, D_ROPE), (LATENT,)))
    caches = tuple(torch.full((2, 4, width), float("nan"), device=dev) for width in (LATENT, D_ROPE))
    q4, k4, spec, cache, k_heads, _ = mla._validate(
        q, k_pe, kv_c, torch.randint(0, 4000, (len(SLOTS),), device=dev), caches, torch.tensor(SLOTS, device=dev),
        "paged", None, None, False, RopeArgs())
    outs = {name: torch.full((*q4.shape[:-1], width), float("nan"), device=dev)
            for name, width in (("q_nope_out", D_NOPE), ("q_pe_out", D_ROPE))}
    tensors = dict(q=q4, k_pe=k4, kv_c=cache["kv_c"], ckv_cache=caches[0], kpe_cache=caches[1], **outs)
    return tensors, cache["slots"], spec, k_heads


def _mla64(x: dict, slots, spec, caches: bool):
    """The float64 reference of the same values: [q_nope, q_pe, k_out] and, with ``caches``, (ckv, kpe)."""
    from ropekit.reference import mla_reference

    q, k_pe = _f64(x["q"]), _f64(x["k_pe"])
    outs = [q.new_empty((*q.shape[:-1], w)) for w in (D_NOPE, D_ROPE)] + [k_pe.new_empty(k_pe.shape)]
    kw = {}
    if caches:
        kw = dict(kv_c=_f64(x["kv_c"]), ckv_cache=torch.full_like(_f64(x["ckv_cache"]), float("nan")),
                  kpe_cache=torch.full_like(_f64(x["kpe_cache"]), float("nan")), slots=slots, paged=True)
    mla_reference(q, k_pe, outs, spec, **kw)
    return outs, (kw["ckv_cache"], kw["kpe_cache"]) if caches else None


def _mla_kv_write(x: dict, slots, spec, k_heads):
    return torch.ops.ropekit.mla_rope_kv_write.default(
        x["q"], x["k_pe"], x["kv_c"], x["ckv_cache"], x["kpe_cache"], x["q_nope_out"], x["q_pe_out"], slots, True,
        None, 1.0, None, None, 1.0, 1.0, k_heads, True, *spec)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ("q", "k_pe"))
def test_mla_rope_reads_a_strided_input(route, kind, name):
    with on_route(route, clear_plans=True) as dev:
        for _call in range(2):
            tensors, _, spec, k_heads = _mla_case(dev)
            x = _with_strided(tensors, name, kind)
            before = snapshot(_buffer(x["q"]), _buffer(x["k_pe"]))
            outs = torch.ops.ropekit.mla_rope.default(x["q"], x["k_pe"], k_heads, True, *spec)
            want, _ = _mla64(x, None, spec, caches=False)
            for out, ref in zip(outs, want, strict=True):
                assert_close_to_ref(out, ref, torch.float32, ROUTE_BACKENDS[route])
            assert_unchanged((_buffer(x["q"]), _buffer(x["k_pe"])), before)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ("q", "k_pe", "kv_c"))
def test_mla_rope_kv_write_reads_a_strided_input(route, kind, name):
    """The given q outputs and each token's cache rows hold the reference's values, every other row stays NaN."""
    with on_route(route, clear_plans=True) as dev:
        for _call in range(2):
            tensors, slots, spec, k_heads = _mla_case(dev)
            x = _with_strided(tensors, name, kind)
            inputs = [_buffer(x[n]) for n in ("q", "k_pe", "kv_c")]
            before = snapshot(*inputs)
            q_nope, q_pe, k_out = _mla_kv_write(x, slots, spec, k_heads)
            assert q_nope.numel() == 0 and q_pe.numel() == 0  # given: written in place
            (want_nope, want_pe, want_k), (_, want_kpe) = _mla64(x, slots, spec, caches=True)
            for out, ref in ((x["q_nope_out"], want_nope), (x["q_pe_out"], want_pe), (k_out, want_k)):
                assert_close_to_ref(out, ref, torch.float32, ROUTE_BACKENDS[route])
            rows = list(SLOTS)
            ckv, kpe = (x[n].view(-1, x[n].shape[-1]) for n in ("ckv_cache", "kpe_cache"))
            assert torch.equal(ckv[rows], x["kv_c"].reshape(len(SLOTS), LATENT))  # copied as it is
            assert_close_to_ref(kpe[rows], want_kpe.view(-1, D_ROPE)[rows], torch.float32, ROUTE_BACKENDS[route])
            others = [r for r in range(ckv.shape[0]) if r not in rows]
            assert ckv[others].isnan().all() and kpe[others].isnan().all()
            assert_unchanged(inputs, before)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ("ckv_cache", "kpe_cache", "q_nope_out", "q_pe_out"))
def test_mla_rope_kv_write_refuses_a_strided_target(route, kind, name):
    with on_route(route, clear_plans=True) as dev:
        tensors, slots, spec, k_heads = _mla_case(dev)
        x = _with_strided(tensors, name, kind)
        buffers = [_buffer(t) for t in x.values()]
        before = snapshot(*buffers)
        with pytest.raises(ValueError, match=f"^{name} {REFUSED}"):
            _mla_kv_write(x, slots, spec, k_heads)
        assert_unchanged(buffers, before)


# ---------------------------------------------------------------------------------- ropekit::qk_hidden_norm_rope

@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ("q", "k", "v"))
def test_qk_hidden_norm_rope_reads_a_strided_input(route, kind, name):
    """The whole-hidden norm then the rotation of q and k, and v's copy (bit for bit: float32 to float32)."""
    from ropekit._hidden_norm import hidden_rms_norm

    with on_route(route, clear_plans=True) as dev:
        for _call in range(2):
            q, k = make_qk(B, S, HQ, HK, D, device=dev)
            v = torch.randn_like(k)
            qw, kw = norm_weight(HQ * D, torch.float32, dev, 0.5), norm_weight(HK * D, torch.float32, dev, 0.5)
            spec = validate(q, k, positions=_positions(dev), rotary_dim=8)
            x = _with_strided({"q": q, "k": k, "v": v}, name, kind)
            before = snapshot(*(_buffer(t) for t in x.values()))
            outs = torch.ops.ropekit.qk_hidden_norm_rope.default(x["q"], x["k"], qw, kw, x["v"], 0.5, 1e-6, *spec)
            qn, kn = (hidden_rms_norm(_f64(x[n]), _f64(w), 1e-6, 0.5, "bshd", F64) for n, w in (("q", qw), ("k", kw)))
            for out, ref in zip(outs[:2], rope_reference(qn, kn, spec._replace(out_dtype=F64)), strict=True):
                assert_close_to_ref(out, ref, torch.float32, ROUTE_BACKENDS[route])
            assert torch.equal(outs[2], x["v"])
            assert_unchanged([_buffer(t) for t in x.values()], before)


# ------------------------------------------------------------ ropekit::rope_attention (+ rope_attention_backward)

ATTN_S, ATTN_D = 3, 8  # one sequence of 3 tokens, HQ = 4 query heads on HK = 2 key heads, causal


def _attention_case(dev):
    """q, k, v [1, ATTN_S, H, ATTN_D], the angle rows and the ops' scalar arguments (q_scale 0.5, log2 softmax)."""
    import math

    from ropekit.attention import _unit_rows

    q, k, v = (torch.randn(1, ATTN_S, h, ATTN_D, dtype=F64).float().to(dev) for h in (HQ, HK, HK))
    angles, (start, rot_dim, neox) = _unit_rows(q, RopeArgs(positions=torch.tensor([5], device=dev), q_scale=0.5))
    params = ("bshd", start, rot_dim, neox, 0.5, 1.0, (1 / math.sqrt(ATTN_D)) / math.log(2), True, 0)
    return dict(q=q, k=k, v=v, angles=angles), params


def _attention64(x: dict, params):
    from ropekit.reference import rope_attention_reference

    _, start, rot_dim, neox, q_scale, k_scale, qk_mult, causal, _ = params
    return rope_attention_reference(*(_f64(x[n]) for n in ("q", "k", "v", "angles")), start, rot_dim, neox,
                                    q_scale, k_scale, qk_mult, causal, None)


ATTN_TOL = {route: max_relative_tolerance(torch.float32, backend) for route, backend in ROUTE_BACKENDS.items()}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ("q", "k", "v", "angles"))
def test_rope_attention_reads_a_strided_input(route, kind, name):
    """o and lse within the table's bound on the error relative to their largest value (sums over keys)."""
    with on_route(route, clear_plans=True) as dev:
        for _call in range(2):
            tensors, params = _attention_case(dev)
            x = _with_strided(tensors, name, kind)
            before = snapshot(*(_buffer(t) for t in x.values()))
            o, lse = torch.ops.ropekit.rope_attention.default(x["q"], x["k"], x["v"], x["angles"], None, *params)
            for got, want in zip((o, lse), _attention64(x, params), strict=True):
                assert max_relative_error(got, want) <= ATTN_TOL[route]
            assert_unchanged([_buffer(t) for t in x.values()], before)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ("q", "k", "v", "angles", "o", "lse"))
def test_rope_attention_backward_reads_a_strided_input(route, kind, name):
    """dq, dk, dv for a strided saved input: torch.autograd of the float64 reference of the same values, within the
    table's bound on the error relative to each gradient's largest value. o and lse are the forward's of those
    values; a stride-0 o or lse (other values than the forward's) must give the gradients of its contiguous copy."""
    with on_route(route, clear_plans=True) as dev:
        for _call in range(2):
            tensors, params = _attention_case(dev)
            if name in ("q", "k", "v", "angles"):
                tensors = _with_strided(tensors, name, kind)
            o, lse = torch.ops.ropekit.rope_attention.default(*(tensors[n].contiguous() for n in tensors), None,
                                                              *params)
            x = {**tensors, "o": o, "lse": lse}
            if name in ("o", "lse"):
                x = _with_strided(x, name, kind)
            do, dlse = torch.randn_like(o), torch.randn_like(lse)
            before = snapshot(*(_buffer(t) for t in x.values()))
            got = torch.ops.ropekit.rope_attention_backward.default(
                do, dlse, *(x[n] for n in ("q", "k", "v", "angles")), None, x["o"], x["lse"], *params)
            if name in ("o", "lse") and kind == "stride0":
                want = torch.ops.ropekit.rope_attention_backward.default(
                    do, dlse, *(x[n] for n in ("q", "k", "v", "angles")), None, x["o"].contiguous(),
                    x["lse"].contiguous(), *params)
                assert all(torch.equal(g, w) for g, w in zip(got, want))
            else:
                leaves = [_f64(x[n]).requires_grad_(True) for n in ("q", "k", "v")]
                outs = _attention64({**x, **dict(zip(("q", "k", "v"), leaves))}, params)
                want = torch.autograd.grad(outs, leaves, (do.to(F64), dlse.to(F64)))
                for g, w in zip(got, want, strict=True):
                    assert g.shape == w.shape and max_relative_error(g, w) <= ATTN_TOL[route]
            assert_unchanged([_buffer(t) for t in x.values()], before)


@pytest.mark.parametrize("route", ROUTES)
def test_rope_attention_reads_strided_cu_seqlens(route):
    """Packed sequences (``layout="thd"``, 2 + 3 tokens) whose ``cu_seqlens`` is every other element of a wider
    buffer (stride 2; a stride of 0 would be no sequence boundaries at all): o, lse and the gradients of q, k, v
    are the float64 reference's of the same boundaries, forward and backward."""
    import math

    from ropekit._spec import to_canonical
    from ropekit.attention import _unit_rows
    from ropekit.reference import rope_attention_backward_reference, rope_attention_reference

    with on_route(route, clear_plans=True) as dev:
        q, k, v = (torch.randn(5, h, ATTN_D, dtype=F64).float().to(dev) for h in (HQ, HK, HK))
        cu = torch.tensor([0, -7, 2, -7, 5], dtype=torch.int32, device=dev)[::2]
        angles, (start, rot_dim, neox) = _unit_rows(q, RopeArgs(layout="thd", cu_seqlens=cu.contiguous()))
        params = ("thd", start, rot_dim, neox, 0.5, 1.0, (1 / math.sqrt(ATTN_D)) / math.log(2), True, 3)
        o, lse = torch.ops.ropekit.rope_attention.default(q, k, v, angles, cu, *params)
        do, dlse = torch.randn_like(o), torch.randn_like(lse)
        grads = torch.ops.ropekit.rope_attention_backward.default(do, dlse, q, k, v, angles, cu, o, lse, *params)
        c64 = [to_canonical(_f64(t), "thd") for t in (q, k, v)]
        args64 = (_f64(angles), start, rot_dim, neox, 0.5, 1.0, params[6], True, cu.contiguous())
        o64, lse64 = rope_attention_reference(*c64, *args64)
        assert max_relative_error(to_canonical(o, "thd"), o64) <= ATTN_TOL[route]
        assert max_relative_error(lse, lse64) <= ATTN_TOL[route]
        want = rope_attention_backward_reference(to_canonical(_f64(do), "thd"), _f64(dlse), *c64, *args64)
        for g, w in zip(grads, want, strict=True):
            assert max_relative_error(to_canonical(g, "thd"), w) <= ATTN_TOL[route]
