"""``ropekit.rope_kv_write``: q and k (optionally normed) rotated, k and v written into a KV cache -- "bshd", "bhsd"
(transformers' StaticCache) or "paged" -- in the inputs' dtype or float8_e4m3fn.

Everything is compared against a float64 reference written from the definitions (the RMSNorm formula, the rotation
by ``position * inv_freq``; helpers.py holds the pieces both prologue ops share): the returned q, the cache rows each
token maps to, every other row untouched, no input modified; fp8 rounding and saturation; bad input. Devices as in
the rest of the suite: the CPU path, the kernels under the Triton interpreter on CPU (``kernels_on_cpu``, with
``TRITON_INTERPRET=1``) and CUDA. Caches start poisoned; every call uses fresh random inputs, three calls per
signature (launch caches engage from the second).
"""

from __future__ import annotations

import math

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
    rope_opts64,
    rotate64,
    same_bits,
    shares_memory,
    snapshot,
)
from ropekit.testing import assert_close_to_ref, poisoned_like

DEVICES = ROUTES
CALLS = 3  # the full path, the call that records a launch plan, a replay
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def rope_kv_write(*args, **kwargs):
    return ropekit.rope_kv_write(*args, **kwargs)  # looked up per call: the tests collect before the op exists


# ------------------------------------------------------------------------------------- checking one call

def _poisoned_cache(shape, dtype, device) -> torch.Tensor:
    """A cache full of NaN (float8: the byte 0x7F, e4m3fn's NaN)."""
    if dtype == FP8:
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(FP8)
    return poisoned_like(torch.empty(shape, dtype=dtype, device=device))


def _cache_shape(layout: str, rows: tuple[int, int], Hkv: int, D: int) -> tuple[int, ...]:
    R0, R1 = rows
    return (R0, Hkv, R1, D) if layout == "bhsd" else (R0, R1, Hkv, D)


def _row_view(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """The cache as [R0, R1, Hkv, D] rows: (batch, position) for bshd/bhsd, (block, offset) for paged."""
    return cache.transpose(1, 2) if layout == "bhsd" else cache


def _destinations(layout: str, lead, positions, slot_mapping, cu_seqlens, block_size):
    """For every token (flattened), its cache row (r0, r1) and whether it is written."""
    n = math.prod(lead)
    if layout == "paged":
        slots = slot_mapping.cpu().long().reshape(n)
        valid = slots >= 0
        return slots.clamp(min=0) // block_size, slots.clamp(min=0) % block_size, valid
    pos = positions.cpu().long().reshape(n)
    if len(lead) == 2:
        b = torch.arange(lead[0]).repeat_interleave(lead[1])
    elif cu_seqlens is not None:
        b = torch.searchsorted(cu_seqlens.cpu().long(), torch.arange(n), right=True) - 1
    else:
        b = torch.arange(n)
    return b, pos, torch.ones(n, dtype=torch.bool)


def _fp8_quantized64(ref: torch.Tensor, scale: float) -> torch.Tensor:
    """What an e4m3 cache must hold, before its rounding: the value over the scale, saturated to +-448."""
    return (ref / scale).clamp(-FP8_MAX, FP8_MAX)


def _check_fp8_rows(got: torch.Tensor, ref: torch.Tensor, scale: float, exact: bool):
    """``got`` (float8_e4m3fn rows) holds round-to-nearest-even of ``ref / scale`` saturated to +-448: never NaN;
    past 448 exactly +-448; else within half an e4m3 ulp (2**-4 relative; 2**-10 absolute among subnormals),
    which also holds when the kernel's fp32 value and the float64 one round to different neighbours near a
    midpoint. ``exact``: ``ref / scale`` is exactly the fp32 value the kernel divides (v with a power-of-two scale),
    so the stored values must be torch's own round-to-nearest-even conversion."""
    stored = got.cpu().float().double()
    assert torch.isfinite(stored).all(), "NaN in an fp8 cache row"
    quantized = _fp8_quantized64(ref, scale)
    if exact:
        want = quantized.float().to(FP8).double()
        assert torch.equal(stored, want), (stored - want).abs().max()
        return
    saturated = (ref / scale).abs() > FP8_MAX * (1 + 1e-5)
    assert torch.equal(stored[saturated], FP8_MAX * quantized[saturated].sign())
    torch.testing.assert_close(stored, quantized, rtol=2.0**-4, atol=2.0**-10)


def _check_cache(cache, before, layout, r0, r1, want_rows, *, dtype, backend, exact, scale):
    """Rows (r0, r1) of ``cache`` hold ``want_rows`` [N, Hkv, D] (float64); every other row is bit-identical to
    ``before``."""
    rows, rows_before = _row_view(cache, layout), _row_view(before, layout)
    written = torch.zeros(rows.shape[:2], dtype=torch.bool)
    written[r0, r1] = True
    written = written.to(cache.device)
    assert same_bits(rows[~written], rows_before[~written]), "a row that no token maps to changed"
    got = rows[r0.to(cache.device), r1.to(cache.device)]
    if cache.dtype == FP8:
        _check_fp8_rows(got, want_rows, scale, exact and math.frexp(scale)[0] == 0.5)
    elif exact:
        assert same_bits(got, want_rows.to(cache.dtype)), "v must be written bit for bit"
    else:
        assert_close_to_ref(got, want_rows, dtype, backend)


def _kv_reference(q, k, positions, rope: dict, *, q_weight, k_weight, eps, weight_offset):
    """q and k (normed when weights are given, then) rotated, float64, token-major as given ([T, H, D] or
    [B, S, H, D]); positions per token ([T] / [B, S], multi-axis [A, ...])."""
    D = q.shape[-1]
    cos, sin = cos_sin64(positions.cpu().long(), D, rope)
    outs = []
    for x, w, scale in ((q, q_weight, rope.get("q_scale", 1.0)), (k, k_weight, rope.get("k_scale", 1.0))):
        x = rms64(x, w, eps, weight_offset) if w is not None else x.cpu().double()
        outs.append(rotate64(x, cos, sin, **rope_opts64(rope, scale)))
    return outs


def check_kv_call(device: str, *, q, k, v, k_cache, v_cache, positions, cache_layout, slot_mapping=None,
                  q_weight=None, k_weight=None, eps=1e-6, weight_offset=0.0, k_cache_scale=None, v_cache_scale=None,
                  **rope):
    """One ``rope_kv_write`` call checked completely: the returned q (shape, dtype, a new tensor, values), the rows
    of both caches its tokens map to, every other row of both caches untouched, and no input modified."""
    backend = ROUTE_BACKENDS[device]
    dtype = q.dtype
    inputs = (q, k, v, positions, slot_mapping, q_weight, k_weight, rope.get("cu_seqlens"), rope.get("inv_freq"))
    before = snapshot(*inputs)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    extra = {name: value for name, value in dict(slot_mapping=slot_mapping, q_weight=q_weight, k_weight=k_weight,
                                                 k_cache_scale=k_cache_scale, v_cache_scale=v_cache_scale).items()
             if value is not None}
    if q_weight is not None:
        extra.update(eps=eps, weight_offset=weight_offset)
    q_out = rope_kv_write(q, k, v, k_cache, v_cache, positions=positions, cache_layout=cache_layout, **extra, **rope)
    assert_unchanged(inputs, before)
    assert isinstance(q_out, torch.Tensor) and q_out.shape == q.shape and q_out.device == q.device
    assert not shares_memory(q_out, q) and not shares_memory(q_out, k_cache) and not shares_memory(q_out,
                                                                                                       v_cache)

    want_q, want_k = _kv_reference(q, k, positions, rope, q_weight=q_weight, k_weight=k_weight, eps=eps,
                                   weight_offset=weight_offset)
    assert_close_to_ref(q_out, want_q, dtype, backend)

    lead = tuple(k.shape[:-2])
    block_size = k_cache.shape[1] if cache_layout == "paged" else None
    r0, r1, valid = _destinations(cache_layout, lead, positions, slot_mapping, rope.get("cu_seqlens"), block_size)
    Hkv, D = k.shape[-2:]
    k_rows = want_k.reshape(-1, Hkv, D)[valid]
    v_rows = v.detach().cpu().reshape(-1, Hkv, D)[valid]
    r0, r1 = r0[valid], r1[valid]
    assert len(set(zip(r0.tolist(), r1.tolist()))) == len(r0), "test bug: two tokens of one call share a row"
    k_scale = float(k_cache_scale) if k_cache_scale is not None else 1.0  # None means 1.0
    v_scale = float(v_cache_scale) if v_cache_scale is not None else 1.0
    _check_cache(k_cache, k_before, cache_layout, r0, r1, k_rows, dtype=dtype, backend=backend, exact=False,
                 scale=k_scale)
    _check_cache(v_cache, v_before, cache_layout, r0, r1, v_rows.double(), dtype=dtype, backend=backend, exact=True,
                 scale=v_scale)
    return q_out


# tokens: (T,) 3-D inputs or (B, S) 4-D; rows: (batch, max_seq) for bshd/bhsd, (num_blocks, block_size) for paged.
KV_CASES = {
    "decode-3d-bshd-gqa": dict(tokens=(4,), heads=(4, 2), D=64, cache="bshd", rows=(5, 24)),
    "decode-3d-bhsd-norm-interleaved": dict(tokens=(3,), heads=(2, 2), D=16, cache="bhsd", rows=(3, 16), norm=True,
                                            opts=dict(style="interleaved")),
    "prefill-4d-bhsd-packed-gemma": dict(tokens=(2, 5), heads=(4, 2), D=16, cache="bhsd", rows=(2, 12), norm=True,
                                         weight_offset=1.0, eps=1e-5, packed=True),
    "prefill-4d-bshd-partial-scales": dict(tokens=(2, 3), heads=(4, 4), D=64, cache="bshd", rows=(3, 8),
                                           opts=dict(rotary_dim=32, q_scale=0.125, k_scale=1.5)),
    "varlen-3d-cu_seqlens-bshd-back": dict(tokens=(7,), seqlens=(3, 4), heads=(4, 2), D=16, cache="bshd",
                                           rows=(2, 16), norm=True, w_dtype=torch.float32,
                                           opts=dict(rotary_dim=8, rotary_at="back")),
    "varlen-3d-cu_seqlens-bhsd-packed": dict(tokens=(5,), seqlens=(1, 4), heads=(2, 2), D=16, cache="bhsd",
                                             rows=(3, 8), packed=True),
    "paged-3d-skip-packed-inv_freq": dict(tokens=(6,), heads=(4, 2), D=16, cache="paged", rows=(4, 4), skip=2,
                                          norm=True, packed=True, opts=dict(inv_freq="random", rotary_dim=8)),
    "paged-4d-skip-base-interleaved": dict(tokens=(2, 3), heads=(2, 2), D=64, cache="paged", rows=(3, 4), skip=1,
                                           opts=dict(base=500000.0, style="interleaved")),
    "paged-3d-multi-axis": dict(tokens=(5,), heads=(4, 2), D=16, cache="paged", rows=(2, 8), skip=1,
                                opts=dict(sections=(2, 3, 3))),
}
KV_PARAMS = [pytest.param(name, dtype, pos_dtype, id=f"{name}-{str(dtype)[6:]}-{str(pos_dtype)[6:]}")
             for name in KV_CASES for dtype in (torch.float32, torch.bfloat16)
             for pos_dtype in (torch.int32, torch.int64)]
KV_PARAMS.append(pytest.param("paged-4d-skip-base-interleaved", torch.float16, torch.int64,
                              id="paged-4d-skip-base-interleaved-float16-int64"))


def _kv_fixed(case: dict, device) -> dict:
    opts = dict(case.get("opts", {}))
    if opts.get("inv_freq") == "random":
        R = opts.get("rotary_dim") or case["D"]
        inv = inv_freq64(R) * (1.0 + 0.1 * torch.rand(R // 2, dtype=torch.float64))
        opts["inv_freq"] = inv.float().to(device)
    return opts


def _kv_inputs(case: dict, dtype, pos_dtype, device, *, scale_inputs=None):
    """Fresh q, k, v (views of one packed buffer or separate tensors) and fresh positions / slots for one call;
    every token of the call maps to a different cache row. ``scale_inputs``: {"k" or "v": function} applied to
    the standard-normal float64 values before the rounding to ``dtype`` (q stays of unit scale, as the tolerance
    table assumes)."""
    scale_inputs = scale_inputs or {}
    Hq, Hkv = case["heads"]
    D, lead, layout = case["D"], case["tokens"], case["cache"]
    R0, R1 = case["rows"]
    if case.get("packed"):
        qkv = torch.randn(*lead, (Hq + 2 * Hkv) * D, dtype=torch.float64)
        for name, cols in (("k", slice(Hq * D, (Hq + Hkv) * D)), ("v", slice((Hq + Hkv) * D, None))):
            if name in scale_inputs:
                qkv[..., cols] = scale_inputs[name](qkv[..., cols])
        qkv = qkv.to(dtype=dtype, device=device)
        q = qkv[..., : Hq * D].view(*lead, Hq, D)
        k = qkv[..., Hq * D: (Hq + Hkv) * D].view(*lead, Hkv, D)
        v = qkv[..., (Hq + Hkv) * D:].view(*lead, Hkv, D)
    else:
        q, k, v = (torch.randn(*lead, h, D, dtype=torch.float64) for h in (Hq, Hkv, Hkv))
        k, v = (scale_inputs.get(name, lambda x: x)(x) for name, x in (("k", k), ("v", v)))
        q, k, v = (t.to(dtype=dtype, device=device) for t in (q, k, v))
    n = math.prod(lead)
    kw = {}
    sections = case.get("opts", {}).get("sections")
    if layout == "paged":
        slots = torch.randperm(R0 * R1)[:n]
        slots[torch.randperm(n)[: case.get("skip", 0)]] = -1
        kw["slot_mapping"] = slots.reshape(lead).to(dtype=pos_dtype, device=device)
        positions = torch.randint(0, 5000, ((len(sections),) if sections else ()) + lead)
    elif len(lead) == 2:  # [B, S]: each batch row writes S distinct positions of its own cache row
        positions = torch.stack([torch.randperm(R1)[: lead[1]] for _ in range(lead[0])])
    elif case.get("seqlens"):  # packed sequences: each writes distinct positions of its own cache row
        positions = torch.cat([torch.randperm(R1)[:n_seq] for n_seq in case["seqlens"]])
        cu = torch.tensor([0, *torch.tensor(case["seqlens"]).cumsum(0).tolist()])
        kw["cu_seqlens"] = cu.to(dtype=torch.int32, device=device)
    else:  # decode: token t is the one new token of sequence t
        positions = torch.randint(0, R1, (n,))
    kw["positions"] = positions.to(dtype=pos_dtype, device=device)
    if case.get("norm"):
        w_dtype = case.get("w_dtype", dtype)
        offset = case.get("weight_offset", 0.0)
        kw.update(q_weight=norm_weight(D, w_dtype, device, offset), k_weight=norm_weight(D, w_dtype, device, offset),
                  eps=case.get("eps", 1e-6), weight_offset=offset)
    return q, k, v, kw


def _run_kv_case(case: dict, dtype, pos_dtype, device: str, *, k_cache_dtype=None, v_cache_dtype=None,
                 k_cache_scale=None, v_cache_scale=None, scale_inputs=None):
    """CALLS calls with fresh data: the first two write into the same caches (later rows overwrite, the rest keep
    what the first call wrote), the last into new caches of the same shape."""
    Hq, Hkv = case["heads"]
    shape = _cache_shape(case["cache"], case["rows"], Hkv, case["D"])
    with on_route(device) as dev:
        fixed = _kv_fixed(case, dev)

        def scale_arg(scale):
            if isinstance(scale, str):  # "tensor:<value>": a 0-d float32 tensor on the device
                return torch.tensor(float(scale.split(":")[1]), dtype=torch.float32, device=dev)
            return scale

        for call in range(CALLS):
            if call != 1:
                k_cache = _poisoned_cache(shape, k_cache_dtype or dtype, dev)
                v_cache = _poisoned_cache(shape, v_cache_dtype or dtype, dev)
            q, k, v, kw = _kv_inputs(case, dtype, pos_dtype, dev, scale_inputs=scale_inputs)
            check_kv_call(device, q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, cache_layout=case["cache"],
                          k_cache_scale=scale_arg(k_cache_scale), v_cache_scale=scale_arg(v_cache_scale),
                          **kw, **fixed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, dtype, pos_dtype", KV_PARAMS)
def test_rope_kv_write_equals_reference(device, name, dtype, pos_dtype):
    """Decode, prefill and varlen tokens, 3-D and 4-D inputs, separate or packed-QKV views, GQA and equal heads,
    with and without the norm, each pairing, partial rotary, every cache layout, skipped slots: q returned
    rotated, k rotated into its rows, v bit for bit into its rows, nothing else of either cache touched."""
    _run_kv_case(KV_CASES[name], dtype, pos_dtype, device)


FP8_CASES = {
    # name: (inputs' dtype, k cache, v cache, k_cache_scale, v_cache_scale, case)
    "both-fp8-float-scales": (torch.bfloat16, FP8, FP8, 0.37, 0.25, "paged-3d-skip-packed-inv_freq"),
    "both-fp8-tensor-scales": (torch.float32, FP8, FP8, "tensor:1.7", "tensor:0.5", "decode-3d-bhsd-norm-interleaved"),
    "k-fp8-only-default-scale": (torch.bfloat16, FP8, None, None, None, "prefill-4d-bshd-partial-scales"),
    "v-fp8-only": (torch.float32, None, FP8, None, 2.0, "varlen-3d-cu_seqlens-bshd-back"),
}


def _spread(x: torch.Tensor) -> torch.Tensor:
    """Values over e4m3's whole range: subnormals (below 2**-6), normals, and past 448."""
    return x * torch.pow(2.0, torch.randint(-9, 10, x.shape, dtype=torch.float64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FP8_CASES)
def test_rope_kv_write_fp8_caches(device, name):
    """float8_e4m3fn caches, each independently: stored = round-to-nearest-even(saturate(value / scale)); v with a
    power-of-two scale exactly as torch converts it; scales as Python floats, 0-d float32 tensors, or None (1.0);
    v spread over e4m3's whole range (subnormals to saturation)."""
    dtype, k_dtype, v_dtype, k_scale, v_scale, case = FP8_CASES[name]
    _run_kv_case(KV_CASES[case], dtype, torch.int64, device, k_cache_dtype=k_dtype, v_cache_dtype=v_dtype,
                 k_cache_scale=k_scale, v_cache_scale=v_scale, scale_inputs={"v": _spread})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rope_kv_write_fp8_saturates(device, dtype):
    """k and v far past 448 * scale store +-448 (never NaN or inf), in both caches, with the sign of the value."""
    case = dict(KV_CASES["decode-3d-bshd-gqa"])
    with on_route(device) as dev:
        for call in range(CALLS):
            huge = dict(k=lambda x: x * 1e4, v=lambda x: x * 1e4)
            q, k, v, kw = _kv_inputs(case, dtype, torch.int64, dev, scale_inputs=huge)
            shape = _cache_shape("bshd", case["rows"], 2, case["D"])
            k_cache, v_cache = _poisoned_cache(shape, FP8, dev), _poisoned_cache(shape, FP8, dev)
            scale = 2.0 if call % 2 else torch.tensor(0.5, device=dev)
            check_kv_call(device, q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, cache_layout="bshd",
                          k_cache_scale=scale, v_cache_scale=scale, **kw)
            b = torch.arange(4, device=dev)
            stored = _row_view(v_cache, "bshd")[b, kw["positions"].long()].float()
            want = (v.float() / float(scale)).sign() * FP8_MAX
            big = (v.float() / float(scale)).abs() > FP8_MAX
            assert big.float().mean() > 0.9  # the test does saturate
            assert torch.equal(stored[big], want[big])


# --------------------------------------------- the calls an attention layer makes: decode, prefill, normed decode

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rope_kv_write_decode_steps_from_packed_qkv_into_head_major_cache(device, dtype):
    """(a) One decode token from one packed QKV buffer [1, (Hq + 2 Hkv) D] into a head-major [1, Hkv, max_seq, D]
    cache at position p, interleaved pairs; successive steps p, p + 1, p + 2 into the same cache."""
    Hq, Hkv, D, M = 4, 2, 64, 32
    with on_route(device) as dev:
        k_cache, v_cache = _poisoned_cache((1, Hkv, M, D), dtype, dev), _poisoned_cache((1, Hkv, M, D), dtype, dev)
        p = int(torch.randint(0, M - CALLS, ()))
        for step in range(CALLS):
            qkv = torch.randn(1, (Hq + 2 * Hkv) * D, dtype=torch.float64).to(dtype=dtype, device=dev)
            q = qkv[:, : Hq * D].view(1, Hq, D)
            k = qkv[:, Hq * D: (Hq + Hkv) * D].view(1, Hkv, D)
            v = qkv[:, (Hq + Hkv) * D:].view(1, Hkv, D)
            check_kv_call(device, q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, cache_layout="bhsd",
                          positions=torch.tensor([p + step], device=dev), style="interleaved")
        # the rows written by the steps are all still there
        assert not torch.isnan(k_cache[:, :, p: p + CALLS].float()).any()
        assert torch.isnan(k_cache[:, :, : p].float()).all() and torch.isnan(k_cache[:, :, p + CALLS:].float()).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rope_kv_write_prefill_separate_qkv_at_offset(device, style, dtype):
    """(b) A batch prefill from separate Q, K, V [S, H, D] of one sequence at offset p0 (positions p0..p0+S-1),
    both pairings, into a [1, max_seq, Hkv, D] cache."""
    S, Hq, Hkv, D, M = 8, 4, 2, 16, 40
    with on_route(device) as dev:
        for _call in range(CALLS):
            q, k, v = (torch.randn(S, h, D, dtype=torch.float64).to(dtype=dtype, device=dev) for h in (Hq, Hkv, Hkv))
            p0 = int(torch.randint(0, M - S + 1, ()))
            k_cache, v_cache = _poisoned_cache((1, M, Hkv, D), dtype, dev), _poisoned_cache((1, M, Hkv, D), dtype, dev)
            check_kv_call(device, q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, cache_layout="bshd",
                          positions=torch.arange(p0, p0 + S, device=dev),
                          cu_seqlens=torch.tensor([0, S], dtype=torch.int32, device=dev), style=style)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rope_kv_write_norm_neox_one_token(device, dtype):
    """(c) Per-head RMSNorm (q_weight, k_weight) + NeoX rotation + KV write of one token [1, H, D]."""
    Hq, Hkv, D, M = 4, 2, 64, 16
    with on_route(device) as dev:
        for _call in range(CALLS):
            q, k, v = (torch.randn(1, h, D, dtype=torch.float64).to(dtype=dtype, device=dev) for h in (Hq, Hkv, Hkv))
            k_cache, v_cache = _poisoned_cache((1, M, Hkv, D), dtype, dev), _poisoned_cache((1, M, Hkv, D), dtype, dev)
            check_kv_call(device, q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, cache_layout="bshd",
                          positions=torch.randint(0, M, (1,), device=dev), q_weight=norm_weight(D, dtype, dev),
                          k_weight=norm_weight(D, dtype, dev), eps=1e-6, style="neox")


# ------------------------------------------------------------------------------------------------- errors

def _kv_good(device):
    """A valid 3-D decode call into a bshd cache: (q, k, v, k_cache, v_cache), keyword arguments."""
    T, Hq, Hkv, D, M = 4, 4, 2, 16, 8
    q, k, v = (torch.randn(T, h, D, device=device) for h in (Hq, Hkv, Hkv))
    caches = [_poisoned_cache((T, M, Hkv, D), torch.float32, device) for _ in range(2)]
    return [q, k, v, *caches], dict(positions=torch.randint(0, M, (T,), device=device), cache_layout="bshd")


def _set(index=None, **kwargs):
    """A change to the good call: argument ``index`` (0..4: q, k, v, k_cache, v_cache) replaced by the result of a
    function of the device, and keywords replaced (values that are functions are called with the device)."""
    def change(args, kw, device):
        if index is not None:
            i, make = index
            args[i] = make(device)
        for name, value in kwargs.items():
            kw[name] = value(device) if callable(value) else value
    return change


def _nan(*shape, dtype=torch.float32):
    return lambda d: _poisoned_cache(shape, dtype, d)


def _paged(**extra):
    """Paged caches [num_blocks=2, block_size=4, Hkv, D] and the given keywords."""
    def change(args, kw, device):
        args[3], args[4] = _nan(2, 4, 2, 16)(device), _nan(2, 4, 2, 16)(device)
        kw["cache_layout"] = "paged"
        for name, value in extra.items():
            kw[name] = value(device) if callable(value) else value
    return change


def _tensor(values, dtype=torch.int64):
    return lambda d: torch.tensor(values, dtype=dtype, device=d)


KV_BAD = [
    # (id, change, exception(s), message fragment, host-checked values: CPU tensors only)
    ("k_cache head_dim", _set(index=(3, _nan(4, 8, 2, 18))), ValueError, "k_cache", False),
    ("v_cache head_dim", _set(index=(4, _nan(4, 8, 2, 8))), ValueError, "v_cache", False),
    ("k_cache Hkv", _set(index=(3, _nan(4, 8, 3, 16))), ValueError, "k_cache", False),
    ("v_cache Hkv", _set(index=(4, _nan(4, 8, 1, 16))), ValueError, "v_cache", False),
    ("k_cache 3-D", _set(index=(3, _nan(4, 8, 32))), ValueError, "k_cache", False),
    ("k_cache dtype", _set(index=(3, _nan(4, 8, 2, 16, dtype=torch.float16))), (TypeError, ValueError), "k_cache",
     False),
    ("v_cache float8_e4m3fnuz", _set(index=(4, lambda d: torch.zeros(4, 8, 2, 16, device=d).to(
        torch.float8_e4m3fnuz))), (TypeError, ValueError), "v_cache", False),
    ("cache batch smaller than the tokens", _set(index=(3, _nan(2, 8, 2, 16))), (ValueError, IndexError),
     "k_cache", False),
    ("k head_dim", _set(index=(1, lambda d: torch.randn(4, 2, 32, device=d))), ValueError, r"\bk\b|head_dim|k_cache",
     False),
    ("v Hkv differs from k", _set(index=(2, lambda d: torch.randn(4, 1, 16, device=d))), ValueError,
     r"\bv\b|v_cache", False),
    ("positions wrong shape", _set(positions=_tensor([1, 2, 3, 4, 5])), ValueError, "positions", False),
    ("positions 2-D for 3-D inputs", _set(positions=_tensor([[1, 2, 3, 4]] * 2)), ValueError, "positions", False),
    ("positions float", _set(positions=_tensor([1.0, 2.0, 3.0, 4.0], torch.float32)), (TypeError, ValueError),
     "positions", False),
    ("positions >= max_seq", _set(positions=_tensor([0, 1, 8, 2])), (IndexError, ValueError), "positions", True),
    ("negative position", _set(positions=_tensor([0, -1, 3, 2])), (IndexError, ValueError), "positions", True),
    ("multi-axis positions with a bshd cache", _set(positions=_tensor([[0, 1, 2, 3]] * 3), sections=(2, 3, 3)),
     ValueError, "positions|sections", False),
    ("paged without slot_mapping", _paged(), (ValueError, TypeError), "slot_mapping", False),
    ("slot_mapping longer than the tokens", _paged(slot_mapping=_tensor([0, 1, 2, 3, 4])), ValueError, "slot_mapping",
     False),
    ("slot_mapping 2-D for tokens", _paged(slot_mapping=_tensor([[0, 1], [2, 3]])), ValueError, "slot_mapping", False),
    ("slot_mapping float", _paged(slot_mapping=_tensor([0, 1, 2, 3], torch.float32)), (TypeError, ValueError),
     "slot_mapping", False),
    ("slot past the blocks", _paged(slot_mapping=_tensor([0, 1, 8, 2])), (IndexError, ValueError), "slot_mapping",
     True),
    ("slot below -1", _paged(slot_mapping=_tensor([0, -2, 3, 2])), (IndexError, ValueError), "slot_mapping", True),
    ("only q_weight", _set(q_weight=lambda d: torch.ones(16, device=d)), (ValueError, TypeError),
     "q_weight|k_weight", False),
    ("only k_weight", _set(k_weight=lambda d: torch.ones(16, device=d)), (ValueError, TypeError),
     "q_weight|k_weight", False),
    ("q_weight D+1", _set(q_weight=lambda d: torch.ones(17, device=d), k_weight=lambda d: torch.ones(16, device=d)),
     ValueError, "q_weight", False),
    ("negative eps", _set(q_weight=lambda d: torch.ones(16, device=d), k_weight=lambda d: torch.ones(16, device=d),
                          eps=-1.0), ValueError, "eps", False),
    ("unknown cache_layout", _set(cache_layout="bsdh"), ValueError, "cache_layout", False),
    ("k_cache_scale for a float32 cache", _set(k_cache_scale=0.5), ValueError, "k_cache_scale", False),
    ("v_cache_scale for a float32 cache", _set(v_cache_scale=lambda d: torch.tensor(0.5, device=d)), ValueError,
     "v_cache_scale", False),
    ("bad style", _set(style="gptj"), ValueError, "style", False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change, exc, match, host_checked", [c[1:] for c in KV_BAD], ids=[c[0] for c in KV_BAD])
def test_rope_kv_write_bad_input_names_the_argument_and_writes_nothing(device, change, exc, match, host_checked):
    """Bad input raises an error naming the argument, and neither cache nor any input changes. Values that are
    only checked on the host (positions past max_seq, slots out of range) are checked on the CPU path only."""
    if host_checked and device != "cpu":
        pytest.skip("position and slot values are checked on the host for CPU tensors only")
    with on_route(device) as dev:
        args, kw = _kv_good(dev)
        change(args, kw, dev)
        tensors = [t for t in (*args, *kw.values()) if isinstance(t, torch.Tensor)]
        before = snapshot(*tensors)
        with pytest.raises(exc, match=match):
            rope_kv_write(*args, **kw)
        assert_unchanged(tensors, before)


# ----------------------------------------------------------------------- slot_mapping shorter than the tokens

@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("packed", [False, True], ids=["decode", "packed"])
def test_slot_mapping_shorter_than_the_tokens_pads(route, packed):
    """vLLM's CUDA-graph padding: a slot_mapping of T' < T slots covers the first T' tokens and the rest are
    padding -- rotated into q, never written. The same bytes as the call whose slot_mapping lists -1 for the padding
    tokens (q and both caches), replayed from a launch plan too (third call, decode)."""
    with on_route(route, clear_plans=True) as dev:
        q, k, v = (torch.randn(5, h, 16, device=dev) for h in (3, 1, 1))
        positions = torch.tensor([4, 9, 0, 2, 7], device=dev)
        extra = dict(cu_seqlens=torch.tensor([0, 2, 5], device=dev)) if packed else {}
        slots = torch.tensor([6, 0, 13], device=dev)
        results = []
        for mapping in (slots, torch.cat([slots, slots.new_full((2,), -1)])):
            for _ in range(3 if mapping is slots and not packed else 1):
                caches = [torch.full((4, 4, 1, 16), float("nan"), device=dev) for _ in range(2)]
                with torch.no_grad():
                    q_out = ropekit.rope_kv_write(q, k, v, *caches, positions=positions, slot_mapping=mapping,
                                                  cache_layout="paged", **extra)
            results.append((q_out, *caches))
            if route == "cpu-kernels" and not packed and mapping is slots:
                assert len(ropekit._fastpath._KV_PLANS) == 1  # the third call was replayed
    (q_short, k_short, v_short), (q_pad, k_pad, v_pad) = results
    assert same_bits(q_short, q_pad) and same_bits(k_short, k_pad) and same_bits(v_short, v_pad)
    assert not torch.isnan(q_short).any()
    written = ~torch.isnan(k_short.view(-1, 16)).all(-1)
    assert written.nonzero().flatten().tolist() == sorted(slots.tolist())


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_return_k_is_qk_norm_ropes_k_and_the_cached_k(route, dtype):
    """return_k=True also returns the rotated k (vLLM's fused op leaves it in ``key``): the bytes qk_norm_rope
    returns for it and the cache holds, padding tokens of a short slot_mapping included; beside a float8 q with
    dynamic scales the tuple is (q_out, q_scales, k_out)."""
    with on_route(route, clear_plans=True) as dev:
        q, k, v = (torch.randn(5, h, 16, device=dev).to(dtype) for h in (4, 2, 2))
        wq, wk = norm_weight(16, dtype, dev), norm_weight(16, dtype, dev)
        positions, slots = torch.tensor([4, 9, 0, 2, 7], device=dev), torch.tensor([6, 0, 13], device=dev)
        caches = [torch.full((4, 4, 2, 16), float("nan"), device=dev, dtype=dtype) for _ in range(2)]
        kw = dict(positions=positions, slot_mapping=slots, cache_layout="paged", q_weight=wq, k_weight=wk)
        with torch.no_grad():
            q_out, k_out = ropekit.rope_kv_write(q, k, v, *caches, return_k=True, **kw)
            q8, q_scales, k_out8 = ropekit.rope_kv_write(q, k, v, *caches, return_k=True, **kw,
                                                         out_dtype=torch.float8_e4m3fn, q_out_scale="dynamic")
            q_ref, k_ref = ropekit.qk_norm_rope(q, k, wq, wk, positions=positions, layout="thd")
    assert k_out.shape == k.shape and k_out.dtype == dtype
    assert same_bits(k_out, k_ref) and same_bits(q_out, q_ref) and same_bits(k_out8, k_ref)
    assert q8.dtype == torch.float8_e4m3fn and q_scales.shape == (5, 4)
    assert same_bits(caches[0].view(-1, 2, 16)[slots.cpu()], k_out[:3])
    before = snapshot(*caches)
    with torch.no_grad(), pytest.raises(TypeError, match="return_k"):
        ropekit.rope_kv_write(q, k, v, *caches, return_k=1, **kw)
    assert_unchanged(caches, before)
