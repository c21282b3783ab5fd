"""``ropekit.integrations.engines``: the rotary entry points of vLLM, FlashInfer and SGLang with their signatures.

Each drop-in is checked against a float64 oracle written here from the engine's documented semantics (not by
calling ropekit): ``cos_sin_cache`` rows ``cat(cos, sin)`` indexed by position, the first rot_dim columns of each
head rotated (NeoX halves or GPT-J even/odd pairs), the tail untouched; vLLM's fused op a per-head RMSNorm with
weights first; SGLang's fused buffer write putting the rotated key and the unchanged value at row ``cache_loc[t]``.
Inputs are slices of a packed qkv projection (strided), [T, H*D] and [T, H, D], positions out of order, with and
without a key, on the CPU path and on the kernels under the Triton interpreter; tolerances from the repository's
table (helpers.ROUTE_BACKENDS). Bad input raises ValueError naming the argument and leaves every tensor as it was;
in-place writes move autograd's version counters.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from helpers import ROUTE_BACKENDS, ROUTES, assert_unchanged, on_route, same_bits, snapshot
from ropekit.integrations import engines
from ropekit.testing import assert_close_to_ref

FP8 = torch.float8_e4m3fn
T, HQ, HKV, D, P = 5, 2, 1, 8, 24  # tokens, query and key heads, head_size, rows of cos_sin_cache


# ------------------------------------------------------------------------------------------- the oracles

def cos_sin_cache(P: int, rot_dim: int, device, base: float = 10000.0) -> torch.Tensor:
    """[P, rot_dim] = cat(cos, sin) of the rot_dim/2 pairs at each position (float32, as the engines build it)."""
    inv = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    ang = torch.arange(P, dtype=torch.float64)[:, None] * inv
    return torch.cat([ang.cos(), ang.sin()], -1).float().to(device)


def rope_ref(positions, x, head_size, cache, is_neox):
    """The engines' documented rotation in float64, shape of ``x`` kept (differentiable in ``x``)."""
    shape, n = x.shape, positions.numel()
    x = x.cpu().double().reshape(n, -1, head_size)
    R = cache.shape[1]
    cos, sin = cache.detach().cpu().double()[positions.cpu().long().reshape(n)].chunk(2, -1)
    cos, sin = cos[:, None], sin[:, None]
    rot, tail = x[..., :R], x[..., R:]
    if is_neox:
        x1, x2 = rot[..., : R // 2], rot[..., R // 2:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    return torch.cat([out, tail], -1).reshape(shape)


def rms_ref(x, w, eps, head_size):
    shape = x.shape
    x = x.detach().cpu().double().reshape(*shape[:-1], -1, head_size) if x.shape[-1] != head_size else \
        x.detach().cpu().double()
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.detach().cpu().double()
    return out.reshape(shape)


# ------------------------------------------------------------------------------------------- the inputs

def packed(dtype, device, shape: str, heads=(HQ, HKV, HKV)):
    """A packed qkv [T, (Hq + 2 Hkv) D] and its query, key, value in ``shape``: "2d" [T, H*D] slices (strided),
    "3d" [T, H, D] slices, "contig" separate contiguous [T, H*D] tensors."""
    hq, hk, hv = heads
    qkv = torch.randn(T, (hq + hk + hv) * D, dtype=torch.float64).to(dtype=dtype, device=device)
    if shape == "contig":
        q, k, v = (t.contiguous() for t in qkv.split([hq * D, hk * D, hv * D], -1))
    elif shape == "2d":
        q, k, v = qkv.split([hq * D, hk * D, hv * D], -1)
    else:
        q, k, v = qkv.view(T, hq + hk + hv, D).split([hq, hk, hv], 1)
    return qkv, q, k, v


def shuffled_positions(device, n=T):
    return torch.randperm(P)[:n].to(device)


def check(out, ref, route):
    assert_close_to_ref(out, ref, out.dtype, ROUTE_BACKENDS[route])


# Every combination on the CPU path; under the interpreter a set that covers each value of each axis (and every
# pairing with partial rotary) in a few calls.
AXES = dict(is_neox=(True, False), rot_dim=(D, 4), key=("key", None), shape=("2d", "3d", "contig"),
            dtype=(torch.float32, torch.bfloat16))
ALL_CASES = list(itertools.product(*AXES.values()))
KERNEL_CASES = [
    (True, D, "key", "2d", torch.float32),
    (False, 4, "key", "3d", torch.bfloat16),
    (True, 4, None, "contig", torch.bfloat16),
    (False, D, None, "2d", torch.float32),
    (True, 4, "key", "2d", torch.bfloat16),
    (False, 4, "key", "contig", torch.float32),
]


def _cases():
    for route in ROUTES:
        name = route.values[0]
        for case in (ALL_CASES if name == "cpu" else KERNEL_CASES):
            neox, R, key, shape, dtype = case
            cid = f"{name}-{'neox' if neox else 'gptj'}-r{R}-{key or 'nokey'}-{shape}-{str(dtype)[6:]}"
            yield pytest.param(name, *case, id=cid, marks=route.marks)


CASES = list(_cases())
CASE_ARGS = "route,is_neox,rot_dim,key_kind,shape,dtype"


# -------------------------------------- in place: vLLM rotary_embedding, FlashInfer ..._with_cos_sin_cache_inplace

INPLACE_DROPINS = {
    "vllm": lambda pos, q, key, cache, neox: engines.rotary_embedding(pos, q, key, D, cache, neox),
    "flashinfer": lambda pos, q, key, cache, neox: engines.apply_rope_with_cos_sin_cache_inplace(
        pos, q, key, D, cache, is_neox=neox),
}


@pytest.mark.parametrize("engine", list(INPLACE_DROPINS))
@pytest.mark.parametrize(CASE_ARGS, CASES)
def test_inplace_dropins(engine, route, is_neox, rot_dim, key_kind, shape, dtype):
    """Query (and key) rotated in place, v and an absent key's buffer untouched, every write seen by autograd's
    version counters."""
    with on_route(route) as dev:
        qkv, q, k, v = packed(dtype, dev, shape)
        key = k if key_kind else None
        cache, pos = cos_sin_cache(P, rot_dim, dev), shuffled_positions(dev)
        q_ref, k_ref = rope_ref(pos, q, D, cache, is_neox), rope_ref(pos, k, D, cache, is_neox)
        k_before, v_before = k.clone(), v.clone()
        versions = q._version, k._version
        assert INPLACE_DROPINS[engine](pos, q, key, cache, is_neox) is None
    check(q, q_ref, route)
    if key is not None:
        check(k, k_ref, route)
        assert k._version > versions[1]
    else:
        assert same_bits(k, k_before)
    assert same_bits(v, v_before)
    assert q._version > versions[0]


# --------------------------------------------------------------- FlashInfer apply_rope_with_cos_sin_cache

@pytest.mark.parametrize(CASE_ARGS, CASES)
def test_flashinfer_apply_rope_with_cos_sin_cache(route, is_neox, rot_dim, key_kind, shape, dtype):
    with on_route(route) as dev:
        qkv, q, k, v = packed(dtype, dev, shape)
        key = k if key_kind else None
        cache, pos = cos_sin_cache(P, rot_dim, dev), shuffled_positions(dev)
        before = snapshot(qkv, q, k)
        q_out, k_out = engines.apply_rope_with_cos_sin_cache(pos, q, key, D, cache, is_neox=is_neox)
    assert_unchanged((qkv, q, k), before)
    assert q_out.shape == q.shape and q_out.dtype == dtype
    check(q_out, rope_ref(pos, q, D, cache, is_neox), route)
    if key is None:
        assert k_out is None
    else:
        assert k_out.shape == k.shape
        check(k_out, rope_ref(pos, k, D, cache, is_neox), route)


# --------------------------------------------------------------- SGLang: RoPE + set_kv_buffer, fused

def _poisoned(shape, dtype, device):
    if dtype == FP8:
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(FP8)  # e4m3fn NaN
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


SGL_CASES = [
    pytest.param(route.values[0], neox, R, shape, dtype, buf, id=f"{route.values[0]}-{'neox' if neox else 'gptj'}-"
                 f"r{R}-{shape}-{str(dtype)[6:]}-{buf}", marks=route.marks)
    for route in ROUTES
    for neox, R, shape, dtype, buf in [
        (True, D, "2d", torch.float32, "flat"), (False, 4, "3d", torch.bfloat16, "heads"),
        (True, 4, "contig", torch.bfloat16, "flat"), (False, D, "2d", torch.bfloat16, "fp8"),
    ]
]


@pytest.mark.parametrize("route,is_neox,rot_dim,shape,dtype,buf", SGL_CASES)
def test_sglang_fused_set_kv_buffer(route, is_neox, rot_dim, shape, dtype, buf):
    slots, scale = 16, 0.5
    with on_route(route) as dev:
        qkv, q, k, v = packed(dtype, dev, shape)
        cache, pos = cos_sin_cache(P, rot_dim, dev), shuffled_positions(dev)
        loc = torch.randperm(slots)[:T].to(dev)
        buf_dtype = FP8 if buf == "fp8" else dtype
        buf_shape = (slots, HKV, D) if buf == "heads" else (slots, HKV * D)
        k_buffer, v_buffer = _poisoned(buf_shape, buf_dtype, dev), _poisoned(buf_shape, buf_dtype, dev)
        q_ref, k_ref = rope_ref(pos, q, D, cache, is_neox), rope_ref(pos, k, D, cache, is_neox)
        v_before = v.clone()
        arg = engines.FusedSetKVBufferArg(value=v, k_buffer=k_buffer, v_buffer=v_buffer,
                                          k_scale=scale if buf == "fp8" else None,
                                          v_scale=scale if buf == "fp8" else None, cache_loc=loc)
        versions = q._version, k_buffer._version, v_buffer._version
        with torch.no_grad():
            engines.apply_rope_with_cos_sin_cache_inplace(pos, q, k, D, cache, is_neox=is_neox,
                                                          fused_set_kv_buffer_arg=arg)
    check(q, q_ref, route)
    check(k, k_ref, route)
    assert same_bits(v, v_before)
    assert q._version > versions[0] and k_buffer._version > versions[1] and v_buffer._version > versions[2]
    rows = loc.cpu().long()
    k_rows, v_rows = k_buffer.cpu()[rows].reshape(T, -1), v_buffer.cpu()[rows].reshape(T, -1)
    k_ref2, v_ref2 = k_ref.reshape(T, -1), v.cpu().double().reshape(T, -1)
    if buf == "fp8":
        assert_close_to_ref(k_rows, k_ref2 / scale, FP8, ROUTE_BACKENDS[route])
        assert_close_to_ref(v_rows, v_ref2 / scale, FP8, ROUTE_BACKENDS[route])
    else:
        check(k_rows, k_ref2, route)
        assert same_bits(v_rows, v.cpu().reshape(T, -1))  # the value is copied bit for bit
        if route == "cpu":  # the key kept in place and the one stored come from the same float64 math
            assert same_bits(k_rows, k.cpu().reshape(T, -1))
    others = torch.ones(slots, dtype=torch.bool)
    others[rows] = False
    for b in (k_buffer, v_buffer):
        untouched = b.cpu()[others]
        assert torch.isnan(untouched.float()).all(), "a row outside cache_loc was written"


# ------------------------------------------------------------------------- vLLM fused_qk_norm_rope

QKN_CASES = [
    pytest.param(route.values[0], neox, R, dtype, strided,
                 id=f"{route.values[0]}-{'neox' if neox else 'gptj'}-r{R}-{str(dtype)[6:]}-"
                    f"{'strided' if strided else 'contig'}", marks=route.marks)
    for route in ROUTES
    for neox, R, dtype, strided in (
        list(itertools.product((True, False), (D, 4), (torch.float32, torch.bfloat16), (False, True)))
        if route.values[0] == "cpu" else
        [(True, D, torch.float32, False), (False, 4, torch.bfloat16, True), (True, 4, torch.bfloat16, True)])
]


@pytest.mark.parametrize("route,is_neox,rot_dim,dtype,strided", QKN_CASES)
def test_vllm_fused_qk_norm_rope(route, is_neox, rot_dim, dtype, strided):
    hq, hk, hv, eps = 2, 1, 1, 1e-6
    W = (hq + hk + hv) * D
    with on_route(route) as dev:
        wide = torch.randn(T, W + (3 * D if strided else 0), dtype=torch.float64).to(dtype=dtype, device=dev)
        qkv = wide[:, :W]  # strided: the qkv columns of a wider projection
        qw = (1.0 + 0.3 * torch.randn(D, dtype=torch.float64)).to(dtype=dtype, device=dev)
        kw = (1.0 + 0.3 * torch.randn(D, dtype=torch.float64)).to(dtype=dtype, device=dev)
        cache, pos = cos_sin_cache(P, rot_dim, dev), shuffled_positions(dev)
        q, k, v = qkv.split([hq * D, hk * D, hv * D], -1)
        q_ref = rope_ref(pos, rms_ref(q, qw, eps, D), D, cache, is_neox)
        k_ref = rope_ref(pos, rms_ref(k, kw, eps, D), D, cache, is_neox)
        v_before, rest_before, version = v.clone(), wide[:, W:].clone(), wide._version
        assert engines.fused_qk_norm_rope(qkv, hq, hk, hv, D, eps, qw, kw, cache, is_neox, pos) is None
    check(q, q_ref, route)
    check(k, k_ref, route)
    assert same_bits(v, v_before) and same_bits(wide[:, W:], rest_before)
    assert wide._version > version


# ------------------------------------------------------------------------------------------- bad input

def _calls(dev, dtype=torch.float32):
    """(name, call(positions, head_size, cache), tensors that must stay as they were) for each drop-in, on fresh
    inputs."""
    qkv, q, k, v = packed(dtype, dev, "2d")
    slots = 8
    k_buffer, v_buffer = torch.zeros(slots, HKV * D, device=dev), torch.zeros(slots, HKV * D, device=dev)
    loc = torch.arange(T, device=dev)
    arg = engines.FusedSetKVBufferArg(v, k_buffer, v_buffer, None, None, loc)
    qw, kw = torch.ones(D, device=dev), torch.ones(D, device=dev)
    everything = (qkv, k_buffer, v_buffer)
    return everything, {
        "vllm_rotary_embedding": lambda pos, hs, cache, **o: engines.rotary_embedding(pos, q, k, hs, cache, True, **o),
        "flashinfer": lambda pos, hs, cache, **o: engines.apply_rope_with_cos_sin_cache(pos, q, k, hs, cache, **o),
        "flashinfer_inplace": lambda pos, hs, cache, **o: engines.apply_rope_with_cos_sin_cache_inplace(
            pos, q, k, hs, cache, **o),
        "sglang_fused": lambda pos, hs, cache, **o: engines.apply_rope_with_cos_sin_cache_inplace(
            pos, q, k, hs, cache, fused_set_kv_buffer_arg=arg, **o),
        "vllm_fused_qk_norm_rope": lambda pos, hs, cache, **o: engines.fused_qk_norm_rope(
            qkv, HQ, HKV, HKV, hs, 1e-6, qw, kw, cache, True, pos, **o),
    }


CALL_NAMES = ["vllm_rotary_embedding", "flashinfer", "flashinfer_inplace", "sglang_fused", "vllm_fused_qk_norm_rope"]
ROUTE_NAMES = [pytest.param(r.values[0], id=r.values[0], marks=r.marks) for r in ROUTES]


@pytest.mark.parametrize("route", ROUTE_NAMES)
@pytest.mark.parametrize("name", CALL_NAMES)
def test_bad_input_raises_naming_the_argument_and_writes_nothing(route, name):
    with on_route(route) as dev:
        everything, calls = _calls(dev)
        call = calls[name]
        good_cache, pos = cos_sin_cache(P, D, dev), shuffled_positions(dev)
        before = snapshot(*everything)
        bad = [
            ("positions|position_ids", (torch.tensor([0, 1, P, 2, 3], device=dev), D, good_cache)),  # past the cache
            ("positions|position_ids", (torch.tensor([0, -1, 2, 3, 4], device=dev), D, good_cache)),
            ("head_size|head_dim", (pos, 6, cos_sin_cache(P, 6, dev))),  # 6 does not divide the width
            ("cos_sin_cache", (pos, D, cos_sin_cache(P, D, dev)[:, :5])),  # odd rot_dim
            ("cos_sin_cache", (pos, D, cos_sin_cache(P, 2 * D, dev))),  # rot_dim > head_size
        ]
        for match, args in bad:
            # device positions are read on the host only when asked (one sync); CPU ones always
            with pytest.raises(ValueError, match=match):
                call(*args, **({"check_positions": True} if route == "cuda" else {}))
            assert_unchanged(everything, before)


def test_sglang_bad_cache_loc_and_buffers_write_nothing():
    _, q, k, v = packed(torch.float32, "cpu", "2d")
    cache, pos = cos_sin_cache(P, D, "cpu"), shuffled_positions("cpu")
    k_buffer, v_buffer = torch.zeros(8, HKV * D), torch.zeros(8, HKV * D)
    before = snapshot(q, k, k_buffer, v_buffer)
    for loc, match in ((torch.tensor([0, 1, 8, 2, 3]), "cache_loc"), (torch.arange(4), "cache_loc")):
        arg = engines.FusedSetKVBufferArg(v, k_buffer, v_buffer, cache_loc=loc)
        with pytest.raises(ValueError, match=match):
            engines.apply_rope_with_cos_sin_cache_inplace(pos, q, k, D, cache, fused_set_kv_buffer_arg=arg)
        assert_unchanged((q, k, k_buffer, v_buffer), before)
    arg = engines.FusedSetKVBufferArg(v, torch.zeros(8, 2 * D), v_buffer, cache_loc=torch.arange(T))
    with pytest.raises(ValueError, match="k_buffer"):
        engines.apply_rope_with_cos_sin_cache_inplace(pos, q, k, D, cache, fused_set_kv_buffer_arg=arg)
    with pytest.raises(ValueError, match="key"):
        engines.apply_rope_with_cos_sin_cache_inplace(
            pos, q, None, D, cache, fused_set_kv_buffer_arg=engines.FusedSetKVBufferArg(
                v, k_buffer, v_buffer, cache_loc=torch.arange(T)))
    assert_unchanged((q, k, k_buffer, v_buffer), before)


def test_fused_qk_norm_rope_head_counts_must_match_qkv():
    qkv, *_ = packed(torch.float32, "cpu", "2d")
    before = snapshot(qkv)
    with pytest.raises(ValueError, match="num_heads_q"):
        engines.fused_qk_norm_rope(qkv, HQ + 1, HKV, HKV, D, 1e-6, torch.ones(D), torch.ones(D),
                                   cos_sin_cache(P, D, "cpu"), True, shuffled_positions("cpu"))
    assert_unchanged((qkv,), before)


# ---------------------------------------------------------------------------------------------- autograd

def _saved_then_rotated(rotate):
    """A non-leaf qkv that another op saved for its backward, then rotated in place by ``rotate``: the backward
    must raise (the version counter moved) instead of using the rotated values."""
    leaf = torch.randn(T, (HQ + 2 * HKV) * D, requires_grad=True)
    qkv = leaf * 1.0
    saved = qkv.sin()  # sin saves its input
    rotate(qkv)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


def test_in_place_drop_ins_are_seen_by_autograd():
    cache, pos = cos_sin_cache(P, 4, "cpu"), shuffled_positions("cpu")

    def split(qkv):  # slices, not split(): torch refuses in-place writes into split()'s views under autograd
        return qkv[:, :HQ * D], qkv[:, HQ * D:(HQ + HKV) * D]

    _saved_then_rotated(lambda qkv: engines.rotary_embedding(pos, split(qkv)[0], split(qkv)[1], D, cache, True))
    _saved_then_rotated(lambda qkv: engines.apply_rope_with_cos_sin_cache_inplace(
        pos, split(qkv)[0], split(qkv)[1], D, cache, False))
    _saved_then_rotated(lambda qkv: engines.fused_qk_norm_rope(
        qkv, HQ, HKV, HKV, D, 1e-6, torch.ones(D), torch.ones(D), cache, True, pos))


def test_gradients_flow_through_the_drop_ins():
    """Where a drop-in runs under autograd (a non-leaf input), the gradient is the float64 oracle's."""
    cache, pos = cos_sin_cache(P, 4, "cpu"), shuffled_positions("cpu")
    leaf = torch.randn(T, (HQ + 2 * HKV) * D, dtype=torch.float64, requires_grad=True)
    g = torch.randn(T, HQ * D, dtype=torch.float64)

    def oracle(x):
        return rope_ref(pos, x, D, cache, False)

    ref_grad, = torch.autograd.grad((oracle(leaf[:, :HQ * D]) * g).sum(), leaf)
    for run in ("inplace", "out_of_place"):
        qkv = leaf.float() * 1.0
        q = qkv[:, :HQ * D]
        if run == "inplace":
            engines.rotary_embedding(pos, q, None, D, cache, False)
            out = q
        else:
            out, _ = engines.apply_rope_with_cos_sin_cache(pos, q, None, D, cache, is_neox=False)
        grad, = torch.autograd.grad((out * g.float()).sum(), leaf)
        assert_close_to_ref(grad.float(), ref_grad, torch.float32, "float32-path")


@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_batch_and_sequence_token_dims(route):
    """[B, S, H * D] inputs with [B, S] positions (vLLM's batched form), in place and out of place."""
    B, S = 2, 3
    with on_route(route) as dev:
        qkv = torch.randn(B, S, (HQ + 2 * HKV) * D, dtype=torch.float64).float().to(dev)
        q, k = qkv[..., :HQ * D], qkv[..., HQ * D:(HQ + HKV) * D]
        cache, pos = cos_sin_cache(P, 4, dev), torch.randperm(P)[:B * S].view(B, S).to(dev)
        q_ref, k_ref = rope_ref(pos, q, D, cache, True), rope_ref(pos, k, D, cache, True)
        q_out, k_out = engines.apply_rope_with_cos_sin_cache(pos, q, k, D, cache)
        engines.rotary_embedding(pos, q, k, D, cache, True)
    for out, ref in ((q_out, q_ref), (k_out, k_ref), (q, q_ref), (k, k_ref)):
        check(out, ref, route)


def test_readme_example_runs():
    """The README's example of this module, run as written on CPU tensors."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = readme.split("### Serving-engine signatures")[1].split("```python")[1].split("```")[0]
    qkv = torch.randn(T, (HQ + 2 * HKV) * D)
    positions, cache = shuffled_positions("cpu"), cos_sin_cache(P, D, "cpu")
    expected = rope_ref(positions, qkv[:, :HQ * D], D, cache, True)
    exec(code, {"qkv": qkv, "positions": positions, "cos_sin_cache": cache, "Hq": HQ, "Hkv": HKV, "D": D})
    check(qkv[:, :HQ * D], expected, "cpu")


def test_sglang_cache_loc_minus_one_skips_the_token():
    _, q, k, v = packed(torch.float32, "cpu", "2d")
    cache, pos = cos_sin_cache(P, D, "cpu"), shuffled_positions("cpu")
    k_buffer, v_buffer = torch.zeros(8, HKV * D), torch.zeros(8, HKV * D)
    k_ref = rope_ref(pos, k, D, cache, True)
    loc = torch.tensor([3, -1, 0, 7, 5])
    engines.apply_rope_with_cos_sin_cache_inplace(pos, q, k, D, cache, fused_set_kv_buffer_arg=engines.
                                                  FusedSetKVBufferArg(v, k_buffer, v_buffer, cache_loc=loc))
    check(k, k_ref, "cpu")  # the skipped token is rotated all the same
    written = (k_buffer != 0).any(-1)
    assert written.tolist() == [i in (3, 0, 7, 5) for i in range(8)]
    check(k_buffer[loc[loc >= 0]], k_ref.reshape(T, -1)[loc >= 0], "cpu")


# ------------------------------------------------------------------------------- FlashInfer's rope_quantize_fp8

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def quantized_ref(x, scale, dtype):
    """FlashInfer's documented quantization in float64: value * scale, saturated to the format's largest value (the
    one rounding is the tolerance's)."""
    return (x.detach().cpu().double() * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype])


ROUTE_MARKS = {r.values[0]: r.marks for r in ROUTES}
RQ_CASES = [pytest.param(route, kind, is_neox, dtype, outs, marks=ROUTE_MARKS[route],
                         id=f"{route}-{kind}-{'neox' if is_neox else 'gptj'}-{str(dtype)[-6:]}-{outs}")
            for route, kind, is_neox, dtype, outs in [
                ("cpu", "gqa", True, torch.float8_e4m3fn, "new"), ("cpu", "mla", False, torch.float8_e5m2, "outs"),
                ("cpu-kernels", "gqa", False, torch.float8_e4m3fn, "outs"),
                ("cpu-kernels", "mla", True, torch.float8_e5m2, "new"),
                ("cpu-kernels", "no-nope", True, torch.float8_e5m2, "new"),
                ("cuda", "gqa", True, torch.float8_e4m3fn, "outs"), ("cuda", "mla", False, torch.float8_e5m2, "new")]]


@pytest.mark.parametrize("route,kind,is_neox,dtype,outs", RQ_CASES)
def test_flashinfer_rope_quantize_fp8(route, kind, is_neox, dtype, outs):
    """rope_quantize_fp8: the rotary parts rotated by cos_sin_cache rows at pos_ids and both parts times their
    quant scale, one float8 rounding from the float64 oracle; GQA ([nnz, H, d] keys), MLA ([nnz, d] keys) and no
    nope parts; outputs written into the caller's views (the two parts of one q buffer) or new."""
    rope_dim, nope_dim, hk = 8, (0 if kind == "no-nope" else 6), (1 if kind == "mla" else 2)
    with on_route(route) as dev:
        positions = shuffled_positions(dev)
        cache = cos_sin_cache(P, rope_dim, dev)
        q = torch.randn(T, 3, rope_dim + nope_dim, dtype=torch.bfloat16, device=dev)
        k = torch.randn(T, *(() if kind == "mla" else (hk,)), rope_dim + nope_dim, dtype=torch.bfloat16, device=dev)
        q_rope, q_nope, k_rope, k_nope = q[..., :rope_dim], q[..., rope_dim:], k[..., :rope_dim], k[..., rope_dim:]
        nopes = (None, None) if kind == "no-nope" else (q_nope, k_nope)
        targets = {}
        if outs == "outs":  # one float8 buffer per tensor, its parts the outputs (as FlashInfer's tests pass them)
            q_out, k_out = torch.empty_like(q, dtype=dtype), torch.empty_like(k, dtype=dtype)
            targets = dict(q_rope_out=q_out[..., :rope_dim], q_nope_out=q_out[..., rope_dim:],
                           k_rope_out=k_out[..., :rope_dim], k_nope_out=k_out[..., rope_dim:])
        with torch.no_grad():
            got = engines.rope_quantize_fp8(q_rope, k_rope, *nopes, cache, positions, is_neox=is_neox,
                                            quantize_dtype=dtype, quant_scale_q=200.0, quant_scale_kv=0.5, **targets)
    k3 = (lambda x: x.unsqueeze(1)) if kind == "mla" else (lambda x: x)
    want = [quantized_ref(rope_ref(positions, q_rope, rope_dim, cache, is_neox), 200.0, dtype),
            quantized_ref(rope_ref(positions, k3(k_rope), rope_dim, cache, is_neox).view(k_rope.shape), 0.5, dtype),
            quantized_ref(q_nope[..., :nope_dim], 200.0, dtype), quantized_ref(k_nope[..., :nope_dim], 0.5, dtype)]
    for name, g, w in zip(("q_rope", "k_rope", "q_nope", "k_nope"), got, want):
        assert g.shape == w.shape, name
        assert_close_to_ref(g, w, dtype, ROUTE_BACKENDS[route])
    if targets:
        assert all(g.data_ptr() == t.data_ptr() for g, t in zip(got, (targets["q_rope_out"], targets["k_rope_out"],
                                                                      targets["q_nope_out"], targets["k_nope_out"])))
    if dtype == torch.float8_e4m3fn:  # q's values reach ~3 * 200: saturated at 448
        assert (got[0].float().abs() == 448.0).any()


@pytest.mark.parametrize("route", [pytest.param(r, marks=ROUTE_MARKS[r]) for r in ("cpu", "cpu-kernels")])
def test_flashinfer_rope_quantize_fp8_bad_input_writes_nothing(route):
    """Bad arguments raise naming the argument; the caller's output tensors keep their bytes."""
    with on_route(route) as dev:
        q, k = torch.randn(T, 2, 8, device=dev), torch.randn(T, 1, 8, device=dev)
        cache, positions = cos_sin_cache(P, 8, dev), shuffled_positions(dev)
        out = torch.full((T, 2, 8), 3.0, device=dev).to(FP8)
        cases = [
            (dict(quantize_dtype=torch.float16), TypeError, "quantize_dtype"),
            (dict(quant_scale_q=0.0), ValueError, "quant_scale_q"),
            (dict(q_rope_out=out[:, :1]), ValueError, "q_rope_out"),
            (dict(k_rope_out=out[:, :1].to(torch.float8_e5m2)), ValueError, "k_rope_out"),
            (dict(pos_ids=positions[:-1]), ValueError, "pos_ids"),
            (dict(cos_sin_cache=cos_sin_cache(P, 4, dev)), ValueError, "cos_sin_cache"),
            (dict(q_nope=torch.randn(T, 3, 4, device=dev)), ValueError, "q_nope"),
        ]
        for overrides, error, words in cases:
            kw = dict(q_rope=q, k_rope=k, q_nope=None, k_nope=None, cos_sin_cache=cache, pos_ids=positions,
                      q_rope_out=out)
            kw.update(overrides)
            before = snapshot(out)
            with torch.no_grad(), pytest.raises(error, match=words):
                engines.rope_quantize_fp8(**kw)
            assert_unchanged((out,), before)
