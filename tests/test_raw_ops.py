"""The registered ops called directly (``torch.ops.ropekit.*``), without the public functions' validation, with a
tensor whose last dim is strided: stride 0 (an ``expand()``ed view) or 2 (every other column of a wider buffer).

The kernels step through a row's columns one element apart. An op reads such an input as a contiguous copy: its
outputs are the float64 reference's of the same values, within the tolerance table, and the input is untouched.
An op refuses such a tensor where it writes it (``rope_``'s q and k, ``rope_kv_write``'s caches) with a
``ValueError`` naming it, before anything is written: every tensor keeps its bits, the strided one's whole buffer
included.

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
