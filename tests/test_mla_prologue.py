"""``ropekit.mla_rope_kv_write``: the MLA prologue (DeepSeek V2/V3, Kimi, GLM) -- q's last D_rope columns and the
shared key ``k_pe`` rotated, each token's latent cache row ``[kv_c | R(k_pe)]`` written (one paged cache as vLLM
keeps it, or FlashInfer's separate ckv and kpe caches, or a [B, max_seq, ..] cache), q returned whole or split,
``k_pe`` returned (broadcast to q's heads where asked), gradients for training.

Everything is compared against a float64 oracle written from the definition (helpers' ``angles64``/``rotate64``:
the pairs of the back D_rope columns turned by ``position * inv_freq``, neox or interleaved pairing): the outputs,
the cache rows each token maps to, every other row still poisoned, no input modified. Routes: the CPU path (the
float64 reference), the kernel under the Triton interpreter (``kernels_on_cpu``) and CUDA (``gpu``). Each
signature is called three times with fresh data; caches and outputs start poisoned.
"""

from __future__ import annotations

import pytest
import torch

import ropekit
from helpers import ROUTE_BACKENDS, ROUTES, angles64, assert_unchanged, on_route, rotate64, same_bits, snapshot
from ropekit.testing import assert_close_to_ref, poisoned_like

FP8 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {FP8: 448.0, E5M2: 57344.0}
CALLS = 3
T, H, D_NOPE, R, L = 5, 3, 16, 8, 24  # tokens, heads, q's nope and rope columns, latent width
BLOCKS, BLOCK_SIZE = 4, 4


def mla(*args, **kwargs):
    return ropekit.mla_rope_kv_write(*args, **kwargs)  # looked up per call


def _poisoned(shape, dtype, device) -> torch.Tensor:
    """A tensor full of NaN (float8: the byte 0x7F, a NaN of both formats)."""
    if dtype in FP8_MAX:
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(dtype)
    return poisoned_like(torch.empty(shape, dtype=dtype, device=device))


def _inputs(lead, dtype, device, latent=L, heads=H, d_nope=D_NOPE, rope=R):
    q = torch.randn(*lead, heads, d_nope + rope, dtype=torch.float64).to(dtype=dtype, device=device)
    k_pe = torch.randn(*lead, 1, rope, dtype=torch.float64).to(dtype=dtype, device=device)
    kv_c = torch.randn(*lead, latent, dtype=torch.float64).to(dtype=dtype, device=device)
    return q, k_pe, kv_c


def _slots(n: int, rows: int, device, skip: bool = True) -> torch.Tensor:
    """Distinct random slots for n tokens, one of them -1 (skipped) when ``skip``."""
    slots = torch.randperm(rows)[:n]
    if skip:
        slots[torch.randint(0, n, ())] = -1
    return slots.to(device)


def oracle(q, k_pe, positions, *, style="neox", base=10000.0, inv_freq=None, q_scale=1.0, k_scale=1.0,
           rotary_scale=1.0, cos=None, sin=None, sections=None):
    """(q_rot, k_rot) in float64 on CPU: the back R columns of q and all of k_pe ([.., 1, R]) turned by the tokens'
    angles (``positions`` of q's leading shape; multi-axis: [A, ..] with ``sections``)."""
    rope = k_pe.shape[-1]
    pos = positions.cpu().long()
    if cos is not None:
        c, s = cos.cpu().double()[pos], sin.cpu().double()[pos]
    else:
        ang = angles64(pos, rope, base=base, inv_freq=inv_freq, sections=sections)
        c, s = ang.cos(), ang.sin()
    q_rot = rotate64(q.cpu().double(), c, s, style=style, rotary_dim=rope, rotary_at="back", scale=q_scale,
                     rotary_scale=rotary_scale)
    k_rot = rotate64(k_pe.cpu().double(), c, s, style=style, scale=k_scale, rotary_scale=rotary_scale)
    return q_rot, k_rot


def _check_cache_rows(rows_latent, rows_kpe, kv_c, k_rot, slots, dtype, backend, scale=1.0):
    """Written rows hold ``kv_c`` (bit for bit; float8: value / scale) and the rotated key; all others NaN.
    ``rows_*`` [rows, width] views of the caches, ``slots`` [tokens] (-1: not written)."""
    slots = slots.cpu().long().reshape(-1)
    kv_c = kv_c.reshape(-1, kv_c.shape[-1])
    k_rot = k_rot.reshape(-1, k_rot.shape[-1])
    written = slots[slots >= 0]
    untouched = torch.ones(rows_latent.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.isnan(rows_latent[untouched].float()).all() and torch.isnan(rows_kpe[untouched].float()).all()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        if dtype in FP8_MAX:
            top = FP8_MAX[dtype]
            want = (kv_c[t].cpu().double() / scale).clamp(-top, top)
            assert_close_to_ref(rows_latent[slot], want, dtype, backend)
            assert_close_to_ref(rows_kpe[slot], (k_rot[t] / scale).clamp(-top, top), dtype, backend)
        else:
            assert same_bits(rows_latent[slot], kv_c[t]), "the latent is copied bit for bit"
            assert_close_to_ref(rows_kpe[slot], k_rot[t], dtype, backend)


# ------------------------------------------------------------------------------------------ forward, caches

@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("caches", ["one", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_paged_cache_write(route, style, caches, dtype):
    backend = ROUTE_BACKENDS[route]
    with on_route(route) as device:
        for _ in range(CALLS):
            q, k_pe, kv_c = _inputs((T,), dtype, device)
            positions = torch.randint(0, 4000, (T,), device=device)
            slots = _slots(T, BLOCKS * BLOCK_SIZE, device)
            if caches == "one":
                cache = _poisoned((BLOCKS, BLOCK_SIZE, L + R), dtype, device)
                kv_cache = cache
            else:
                kv_cache = (_poisoned((BLOCKS, BLOCK_SIZE, L), dtype, device),
                            _poisoned((BLOCKS, BLOCK_SIZE, R), dtype, device))
            before = snapshot(q, k_pe, kv_c, positions, slots)
            q_out, k_out = mla(q, k_pe, kv_c, positions=positions, kv_cache=kv_cache, slot_mapping=slots,
                               style=style)
            assert_unchanged((q, k_pe, kv_c, positions, slots), before)
            q_rot, k_rot = oracle(q, k_pe, positions, style=style)
            assert q_out.shape == q.shape and k_out.shape == k_pe.shape
            assert_close_to_ref(q_out, q_rot, dtype, backend)
            assert_close_to_ref(k_out, k_rot, dtype, backend)
            if caches == "one":
                rows = cache.view(-1, L + R).cpu()
                latent, kpe = rows[:, :L], rows[:, L:]
            else:
                latent, kpe = (c.view(-1, c.shape[-1]).cpu() for c in kv_cache)
            _check_cache_rows(latent, kpe, kv_c, k_rot, slots, dtype, backend)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("split_q", [False, True], ids=["whole-q", "split-q"])
@pytest.mark.parametrize("broadcast_k", [False, True], ids=["shared-k", "broadcast-k"])
def test_outputs_split_and_broadcast(route, split_q, broadcast_k):
    """No cache: q whole or as (q_nope, q_pe), k_pe as given ([T, R] stays 2-D) or one copy per head, with every
    rotation option the call forwards (inv_freq, scales)."""
    backend = ROUTE_BACKENDS[route]
    with on_route(route) as device:
        for _ in range(CALLS):
            q, k_pe, _ = _inputs((T,), torch.float32, device)
            k_pe = k_pe[:, 0]  # [T, R]
            positions = torch.randint(0, 10**6, (T,), device=device)
            inv_freq = torch.rand(R // 2, device=device)
            opts = dict(style="interleaved", inv_freq=inv_freq, q_scale=0.375, k_scale=1.5, rotary_scale=1.25)
            outs = mla(q, k_pe, positions=positions, split_q=split_q, broadcast_k=broadcast_k, **opts)
            q_rot, k_rot = oracle(q, k_pe[:, None], positions, **opts)
            assert len(outs) == (3 if split_q else 2)
            if split_q:
                assert outs[0].shape == (T, H, D_NOPE) and outs[1].shape == (T, H, R)
                assert_close_to_ref(outs[0], q_rot[..., :D_NOPE], torch.float32, backend)
                assert_close_to_ref(outs[1], q_rot[..., D_NOPE:], torch.float32, backend)
            else:
                assert_close_to_ref(outs[0], q_rot, torch.float32, backend)
            if broadcast_k:
                assert outs[-1].shape == (T, H, R)
                assert_close_to_ref(outs[-1], k_rot.expand(T, H, R), torch.float32, backend)
            else:
                assert outs[-1].shape == (T, R)
                assert_close_to_ref(outs[-1], k_rot[:, 0], torch.float32, backend)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("source", ["table", "angles"])
def test_bshd_cache_and_batched_q(route, source):
    """4-D q [B, S, H, D] with per-token positions: token (b, s) at row [b, position] of a [B', max_seq, W] cache
    (its last sequence is not written); cos/sin tables or raw angles as the frequency source."""
    backend = ROUTE_BACKENDS[route]
    B, S, max_seq = 2, 3, 12
    with on_route(route) as device:
        for _ in range(CALLS):
            q, k_pe, kv_c = _inputs((B, S), torch.float16, device)
            positions = torch.stack([torch.randperm(max_seq)[:S] for _ in range(B)]).to(device)
            ang = (torch.rand(max_seq, R // 2) * 600).double()  # float32 angles, read exactly
            cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
            frequencies = dict(cos=cos, sin=sin) if source == "table" else dict(angles=ang.float().to(device))
            if source == "angles":
                cos, sin = ang.cos(), ang.sin()
            cache = _poisoned((B + 1, max_seq, L + R), torch.float16, device)
            q_out, k_out = mla(q, k_pe, kv_c, positions=positions, kv_cache=cache, cache_layout="bshd",
                               **frequencies)
            q_rot, k_rot = oracle(q, k_pe, positions, cos=cos, sin=sin)
            assert_close_to_ref(q_out, q_rot, torch.float16, backend)
            assert_close_to_ref(k_out, k_rot, torch.float16, backend)
            row_of = (torch.arange(B)[:, None] * max_seq + positions.cpu()).reshape(-1)
            rows = cache.view(-1, L + R).cpu()
            _check_cache_rows(rows[:, :L], rows[:, L:], kv_c, k_rot, row_of, torch.float16, backend)


@pytest.mark.parametrize("route", ROUTES)
def test_packed_sequences_paged(route):
    """3-D tokens of packed sequences (cu_seqlens, int offset): positions restart in each sequence."""
    backend = ROUTE_BACKENDS[route]
    with on_route(route) as device:
        for call in range(CALLS):
            q, k_pe, kv_c = _inputs((T,), torch.float32, device)
            cu = torch.tensor([0, 2, T], dtype=torch.int32, device=device)
            slots = _slots(T, BLOCKS * BLOCK_SIZE, device)
            cache = _poisoned((BLOCKS, BLOCK_SIZE, L + R), torch.float32, device)
            q_out, k_out = mla(q, k_pe, kv_c, positions=7 + call, cu_seqlens=cu, kv_cache=cache, slot_mapping=slots)
            positions = torch.tensor([0, 1, 0, 1, 2]) + 7 + call
            q_rot, k_rot = oracle(q, k_pe, positions)
            assert_close_to_ref(q_out, q_rot, torch.float32, backend)
            rows = cache.view(-1, L + R).cpu()
            _check_cache_rows(rows[:, :L], rows[:, L:], kv_c, k_rot, slots, torch.float32, backend)


@pytest.mark.parametrize("route", ROUTES)
def test_multi_axis_positions(route):
    """M-RoPE sections through the MLA call: positions [A, T], pair i turning with its axis (contiguous)."""
    backend = ROUTE_BACKENDS[route]
    with on_route(route) as device:
        for _ in range(CALLS):
            q, k_pe, kv_c = _inputs((T,), torch.float32, device)
            positions = torch.randint(0, 300, (2, T), device=device)
            slots = _slots(T, BLOCKS * BLOCK_SIZE, device)
            cache = _poisoned((BLOCKS, BLOCK_SIZE, L + R), torch.float32, device)
            q_out, k_out = mla(q, k_pe, kv_c, positions=positions, sections=(1, 3), kv_cache=cache,
                               slot_mapping=slots, style="interleaved")
            q_rot, k_rot = oracle(q, k_pe, positions, sections=(1, 3), style="interleaved")
            assert_close_to_ref(q_out, q_rot, torch.float32, backend)
            assert_close_to_ref(k_out, k_rot, torch.float32, backend)
            rows = cache.view(-1, L + R).cpu()
            _check_cache_rows(rows[:, :L], rows[:, L:], kv_c, k_rot, slots, torch.float32, backend)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
@pytest.mark.parametrize("fp8", [FP8, E5M2], ids=["e4m3fn", "e5m2"])
def test_fp8_cache(route, scale_kind, fp8):
    """float8 caches hold value / scale, rounded once and saturated to the format's largest finite value (large
    latents saturate)."""
    backend = ROUTE_BACKENDS[route]
    with on_route(route) as device:
        for call in range(CALLS):
            q, k_pe, kv_c = _inputs((T,), torch.bfloat16, device)
            kv_c[0, :3] = torch.tensor([1000.0, -5000.0, 300.0]) * (FP8_MAX[fp8] / 448)  # saturates
            scale = 0.5 + call
            slots = _slots(T, BLOCKS * BLOCK_SIZE, device)
            positions = torch.randint(0, 100, (T,), device=device)
            ckv, kpe = _poisoned((BLOCKS, BLOCK_SIZE, L), fp8, device), _poisoned((BLOCKS, BLOCK_SIZE, R), fp8, device)
            given = torch.tensor(scale, device=device) if scale_kind == "tensor" else scale
            mla(q, k_pe, kv_c, positions=positions, kv_cache=(ckv, kpe), slot_mapping=slots, kv_cache_scale=given)
            _, k_rot = oracle(q, k_pe, positions)
            _check_cache_rows(ckv.view(-1, L).cpu(), kpe.view(-1, R).cpu(), kv_c, k_rot, slots, fp8, backend,
                              scale=scale)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8, E5M2], ids=["bf16", "e4m3fn", "e5m2"])
@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_deepseek_shapes_on_gpu(cache_dtype, tokens):
    """DeepSeek V3's shapes (16 heads as in a tensor-parallel shard, 128 + 64 columns, latent 512, interleaved
    pairs, blocks of 64) on CUDA, decode and prefill sizes."""
    device = "cuda"
    q, k_pe, kv_c = _inputs((tokens,), torch.bfloat16, device, latent=512, heads=16, d_nope=128, rope=64)
    blocks = (tokens + 63) // 64 + 2
    slots = _slots(tokens, blocks * 64, device, skip=tokens > 1)
    positions = torch.randint(0, 160_000, (tokens,), device=device)
    cache = _poisoned((blocks, 64, 576), cache_dtype, device)
    scale = 0.75 if cache_dtype in FP8_MAX else None
    q_nope, q_pe, k_out = mla(q, k_pe, kv_c, positions=positions, kv_cache=cache, slot_mapping=slots,
                              kv_cache_scale=scale, split_q=True, style="interleaved", base=10000.0)
    torch.cuda.synchronize()
    q_rot, k_rot = oracle(q, k_pe, positions, style="interleaved")
    assert_close_to_ref(q_nope, q_rot[..., :128], torch.bfloat16, "kernels")
    assert_close_to_ref(q_pe, q_rot[..., 128:], torch.bfloat16, "kernels")
    assert_close_to_ref(k_out, k_rot, torch.bfloat16, "kernels")
    rows = cache.view(-1, 576).cpu()
    _check_cache_rows(rows[:, :512], rows[:, 512:], kv_c, k_rot, slots, cache_dtype, "kernels",
                      scale=scale or 1.0)


# ---------------------------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("split_q", [False, True], ids=["whole-q", "split-q"])
@pytest.mark.parametrize("broadcast_k", [False, True], ids=["shared-k", "broadcast-k"])
def test_gradcheck_float64(split_q, broadcast_k):
    q, k_pe, _ = _inputs((2,), torch.float64, "cpu", heads=2, d_nope=4, rope=4)
    positions = torch.tensor([3, 1000])
    q.requires_grad_(True)
    k_pe.requires_grad_(True)

    def f(q, k_pe):
        return mla(q, k_pe, positions=positions, split_q=split_q, broadcast_k=broadcast_k, style="interleaved",
                   q_scale=0.5, k_scale=2.0, rotary_scale=1.5)

    assert torch.autograd.gradcheck(f, (q, k_pe))
    assert torch.autograd.gradgradcheck(f, (q, k_pe))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("split_q", [False, True], ids=["whole-q", "split-q"])
def test_gradients_match_the_oracle(route, split_q):
    """Gradients of q and k_pe (k broadcast to the heads: its gradient sums over them) against autograd through the
    float64 oracle."""
    backend = ROUTE_BACKENDS[route]
    with on_route(route) as device:
        for _ in range(CALLS):
            q, k_pe, _ = _inputs((T,), torch.float32, device)
            positions = torch.randint(0, 5000, (T,), device=device)
            q.requires_grad_(True)
            k_pe.requires_grad_(True)
            outs = mla(q, k_pe, positions=positions, split_q=split_q, broadcast_k=True, style="interleaved",
                       q_scale=0.5)
            grads = [torch.randn(o.shape, dtype=torch.float64) for o in outs]
            torch.autograd.backward(outs, [g.to(device=device, dtype=torch.float32) for g in grads])
            q64 = q.detach().cpu().double().requires_grad_(True)
            k64 = k_pe.detach().cpu().double().requires_grad_(True)
            q_rot, k_rot = oracle(q64, k64, positions, style="interleaved", q_scale=0.5)
            want = [q_rot[..., :D_NOPE], q_rot[..., D_NOPE:]] if split_q else [q_rot]
            torch.autograd.backward([*want, k_rot.expand(T, H, R)], grads)
            assert_close_to_ref(q.grad, q64.grad, torch.float32, backend)
            assert_close_to_ref(k_pe.grad, k64.grad, torch.float32, backend)


@pytest.mark.parametrize("route", ROUTES)
def test_training_call_with_a_cache_writes_it_and_has_gradients(route):
    backend = ROUTE_BACKENDS[route]
    with on_route(route) as device:
        q, k_pe, kv_c = _inputs((T,), torch.float32, device)
        positions = torch.randint(0, 50, (T,), device=device)
        slots = _slots(T, BLOCKS * BLOCK_SIZE, device)
        cache = _poisoned((BLOCKS, BLOCK_SIZE, L + R), torch.float32, device)
        q.requires_grad_(True)
        q_out, k_out = mla(q, k_pe, kv_c, positions=positions, kv_cache=cache, slot_mapping=slots)
        q_out.sum().backward()
        q64 = q.detach().cpu().double().requires_grad_(True)
        q_rot, k_rot = oracle(q64, k_pe, positions)
        q_rot.sum().backward()
        assert_close_to_ref(q_out, q_rot, torch.float32, backend)
        assert_close_to_ref(k_out, k_rot, torch.float32, backend)
        assert_close_to_ref(q.grad, q64.grad, torch.float32, backend)
        rows = cache.view(-1, L + R).cpu()
        _check_cache_rows(rows[:, :L], rows[:, L:], kv_c, k_rot, slots, torch.float32, backend)


# ----------------------------------------------------------------------------------------------- compile

def test_compile_fullgraph_forward_backward_and_cache_write():
    """torch.compile(fullgraph=True) traces both ops (the differentiable one with its backward) and gives the eager
    results bit for bit."""
    torch._dynamo.reset()

    def train(q, k_pe, positions):
        q_out, k_out = mla(q, k_pe, positions=positions, style="interleaved", broadcast_k=True)
        return q_out.square().sum() + k_out.sum()

    def write(q, k_pe, kv_c, positions, cache, slots):
        return mla(q, k_pe, kv_c, positions=positions, kv_cache=cache, slot_mapping=slots, split_q=True)

    compiled_train = torch.compile(train, fullgraph=True)
    compiled_write = torch.compile(write, fullgraph=True)
    for _ in range(CALLS):
        q, k_pe, kv_c = _inputs((T,), torch.float32, "cpu")
        positions = torch.randint(0, 99, (T,))
        qs = [q.clone().requires_grad_(True) for _ in range(2)]
        ks = [k_pe.clone().requires_grad_(True) for _ in range(2)]
        compiled_train(qs[0], ks[0], positions).backward()
        train(qs[1], ks[1], positions).backward()
        assert same_bits(qs[0].grad, qs[1].grad) and same_bits(ks[0].grad, ks[1].grad)
        slots = _slots(T, BLOCKS * BLOCK_SIZE, "cpu")
        caches = [_poisoned((BLOCKS, BLOCK_SIZE, L + R), torch.float32, "cpu") for _ in range(2)]
        got = compiled_write(q, k_pe, kv_c, positions, caches[0], slots)
        want = write(q, k_pe, kv_c, positions, caches[1], slots)
        assert all(same_bits(g, w) for g, w in zip(got, want))
        assert same_bits(caches[0], caches[1])


# ---------------------------------------------------------------------------------------------- bad input

def _bad_cases():
    q, k_pe, kv_c = _inputs((T,), torch.float32, "cpu")
    cache = torch.zeros(BLOCKS, BLOCK_SIZE, L + R)
    slots = torch.arange(T)
    ok = dict(q=q, k_pe=k_pe, kv_c=kv_c, positions=torch.arange(T), kv_cache=cache, slot_mapping=slots)
    return [
        ("q-2d", dict(q=q[:, 0]), ValueError, "q must be"),
        ("q-int", dict(q=q.long()), TypeError, "q must be"),
        ("k-dtype", dict(k_pe=k_pe.half()), TypeError, "k_pe must have q's dtype"),
        ("k-heads", dict(k_pe=k_pe.expand(T, 2, R)), ValueError, "k_pe must be"),
        ("k-odd", dict(k_pe=k_pe[..., :R - 1]), ValueError, "D_rope must be even"),
        ("k-tokens", dict(k_pe=k_pe[:-1]), ValueError, "k_pe must be"),
        ("kv_c-width-vs-cache", dict(kv_c=kv_c[:, :-2]), ValueError, "kv_cache must be a 3-D"),
        ("kv_c-tokens", dict(kv_c=kv_c[:-1]), ValueError, "kv_c must be"),
        ("kv_c-missing", dict(kv_c=None), TypeError, "kv_c must be a torch.Tensor"),
        ("cache-dtype", dict(kv_cache=cache.half()), TypeError, "kv_cache must have q's dtype"),
        ("cache-2d", dict(kv_cache=cache.view(-1, L + R)), ValueError, "kv_cache must be a 3-D"),
        ("cache-pair-width", dict(kv_cache=(cache[..., :L], cache[..., L:L + R - 2].clone())), ValueError,
         r"kv_cache\[1\] \(kpe\) must be"),
        ("cache-pair-shared", dict(kv_cache=(cache[..., :L], cache[..., :R])), ValueError, "share memory"),
        ("cache-is-kv_c", dict(kv_c=cache.view(-1, L + R)[:T, :L]), ValueError, "kv_cache and kv_c share memory"),
        ("slots-missing", dict(slot_mapping=None), ValueError, "needs slot_mapping"),
        ("slots-range", dict(slot_mapping=torch.tensor([0, 1, 2, 3, BLOCKS * BLOCK_SIZE])), IndexError,
         "slot_mapping must hold slots"),
        ("slots-below", dict(slot_mapping=torch.tensor([0, 1, -2, 3, 4])), IndexError, "slot_mapping must hold"),
        ("slots-shape", dict(slot_mapping=slots[:-1]), ValueError, "slot_mapping must have shape"),
        ("slots-float", dict(slot_mapping=slots.float()), TypeError, "slot_mapping must be an int32"),
        ("layout", dict(cache_layout="bhsd"), ValueError, "cache_layout must be one of"),
        ("bshd-slots", dict(cache_layout="bshd"), ValueError, "slot_mapping applies"),
        ("bshd-rows", dict(cache_layout="bshd", slot_mapping=None, positions=torch.full((T,), BLOCK_SIZE),
                           kv_cache=torch.zeros(T, BLOCK_SIZE, L + R)), IndexError, "positions reach"),
        ("bshd-sequences", dict(cache_layout="bshd", slot_mapping=None), ValueError, "kv_cache holds 4 sequences"),
        ("scale-not-fp8", dict(kv_cache_scale=2.0), ValueError, "kv_cache_scale applies to float8"),
        ("style", dict(style="gptj"), ValueError, "style must be"),
        ("positions-shape", dict(positions=torch.arange(T + 1)), ValueError, "positions"),
        ("kv_c-without-cache", dict(kv_cache=None, slot_mapping=None), ValueError, "kv_c is written"),
    ], ok


@pytest.mark.parametrize("case", [c[0] for c in _bad_cases()[0]])
def test_bad_input_raises_naming_the_argument_and_writes_nothing(case):
    cases, ok = _bad_cases()
    _, change, error, match = next(c for c in cases if c[0] == case)
    call = {**ok, **change}
    caches = call["kv_cache"]
    caches = [] if caches is None else [caches] if isinstance(caches, torch.Tensor) else list(caches)
    before = snapshot(*caches)
    with pytest.raises(error, match=match):
        mla(call.pop("q"), call.pop("k_pe"), call.pop("kv_c"), **call)
    assert_unchanged(caches, before)


def test_fp8_scale_checks():
    q, k_pe, kv_c = _inputs((T,), torch.float32, "cpu")
    cache = _poisoned((BLOCKS, BLOCK_SIZE, L + R), FP8, "cpu")
    for scale, match in ((0.0, "finite float > 0"), (torch.tensor([1.0, 2.0]), "shape"),
                         (torch.tensor(-1.0), "finite and > 0")):
        with pytest.raises(ValueError, match=match):
            mla(q, k_pe, kv_c, positions=torch.arange(T), kv_cache=cache, slot_mapping=torch.arange(T),
                kv_cache_scale=scale)
        assert torch.isnan(cache.float()).all()


def test_readme_example_runs_and_writes_the_rows():
    """The README's MLA example, run as written on CPU tensors (float32)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = readme.split("### MLA:")[1].split("```python")[1].split("```")[0]
    code = code.replace('device="cuda"', 'device="cpu"').replace("torch.bfloat16", "torch.float32")
    scope: dict = {"torch": torch, "ropekit": ropekit}
    exec(code, scope)
    cache, slots, kv_c = scope["kv_cache"], scope["slot_mapping"], scope["kv_c"]
    rows = cache.view(-1, cache.shape[-1])
    assert torch.equal(rows[slots, :512], kv_c) and torch.equal(rows[slots, 512:], scope["k_pe_rot"][:, 0])
    assert int((rows != 0).any(-1).sum()) == slots.numel()
    assert scope["q_nope"].shape == (8, 16, 128) and scope["q_pe"].shape == (8, 16, 64)


@pytest.mark.parametrize("route", ROUTES[1:])
def test_kernel_routes_launch_the_mla_kernel_once(route, monkeypatch):
    """The kernel routes run one MLA kernel launch per call, never the reference."""
    from ropekit import reference
    from ropekit.triton import runtime

    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran on a kernel route")

    launched = []
    original = runtime.launch

    def counting(roles, *args, **kwargs):
        launched.append(roles.fn.__name__)
        return original(roles, *args, **kwargs)

    monkeypatch.setattr(reference, "mla_reference", refuse)
    monkeypatch.setattr(runtime, "launch", counting)
    with on_route(route) as device:
        q, k_pe, kv_c = _inputs((T,), torch.float32, device)
        cache = _poisoned((BLOCKS, BLOCK_SIZE, L + R), torch.float32, device)
        mla(q, k_pe, kv_c, positions=torch.arange(T, device=device), kv_cache=cache,
            slot_mapping=_slots(T, BLOCKS * BLOCK_SIZE, device))
    assert launched == ["mla_kernel"]


@pytest.mark.parametrize("route", ROUTES[1:])
def test_device_values_out_of_range_write_nothing(route):
    """Values not read on the host (device tensors; CPU tensors on the kernels stand in for them): a slot past the
    cache or below -1 writes nothing, and a token with an invalid position gets NaN rope columns and no cache row
    -- never an out-of-bounds write."""
    rows = BLOCKS * BLOCK_SIZE
    with on_route(route) as device:
        for _ in range(CALLS):
            q, k_pe, kv_c = _inputs((T,), torch.float32, device)
            # a larger buffer whose middle is the cache: a write past either end would show in the margins
            buffer = _poisoned((BLOCKS + 2, BLOCK_SIZE, L + R), torch.float32, device)
            cache = buffer[1:-1]
            slots = torch.tensor([rows, -7, 2, rows + BLOCK_SIZE, 5], device=device)
            positions = torch.tensor([1, 2, -3, 4, 5], device=device)
            q_out, k_out = mla(q, k_pe, kv_c, positions=positions, kv_cache=cache, slot_mapping=slots)
            assert torch.isnan(q_out[2, :, D_NOPE:]).all() and torch.isnan(k_out[2]).all()
            q_rot, _ = oracle(q[[0, 1, 3, 4]], k_pe[[0, 1, 3, 4]], positions[[0, 1, 3, 4]])
            assert_close_to_ref(q_out[[0, 1, 3, 4]], q_rot, torch.float32, ROUTE_BACKENDS[route])
            written = ~torch.isnan(buffer.view(-1, L + R).cpu()).all(-1)
            assert int(written.sum()) == 1 and written[BLOCK_SIZE + 5]  # slot 5 of the cache, token 4


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("split_q", [False, True], ids=["whole-q", "split-q"])
@pytest.mark.parametrize("with_cache", [False, True], ids=["no-cache", "cache"])
def test_q_out_written_in_place(route, split_q, with_cache):
    """Given q outputs -- a strided view of a wider buffer, as the q_pe columns of the attention's input -- are
    written and returned as given; the rest of the buffer stays poisoned."""
    backend = ROUTE_BACKENDS[route]
    with on_route(route) as device:
        for _ in range(CALLS):
            q, k_pe, kv_c = _inputs((T,), torch.float32, device)
            positions = torch.randint(0, 999, (T,), device=device)
            buffer = _poisoned((T, H, L + R + 2), torch.float32, device)  # [latent-absorbed q | q_pe | spare]
            if split_q:
                q_out = (None, buffer[..., L:L + R])
            else:
                q_out = buffer[..., L - D_NOPE:L + R]
            kw = {}
            if with_cache:
                cache = _poisoned((BLOCKS, BLOCK_SIZE, L + R), torch.float32, device)
                kw = dict(kv_c=kv_c, kv_cache=cache, slot_mapping=_slots(T, BLOCKS * BLOCK_SIZE, device))
            with torch.no_grad():
                outs = mla(q, k_pe, positions=positions, split_q=split_q, q_out=q_out, **kw)
            q_rot, k_rot = oracle(q, k_pe, positions)
            if split_q:
                assert outs[1] is q_out[1] and outs[0].shape == (T, H, D_NOPE)
                assert_close_to_ref(outs[0], q_rot[..., :D_NOPE], torch.float32, backend)
                assert_close_to_ref(buffer[..., L:L + R], q_rot[..., D_NOPE:], torch.float32, backend)
                assert torch.isnan(buffer[..., :L]).all() and torch.isnan(buffer[..., L + R:]).all()
            else:
                assert outs[0] is q_out
                assert_close_to_ref(buffer[..., L - D_NOPE:L + R], q_rot, torch.float32, backend)
                assert torch.isnan(buffer[..., :L - D_NOPE]).all() and torch.isnan(buffer[..., L + R:]).all()
            assert_close_to_ref(outs[-1], k_rot, torch.float32, backend)
            if with_cache:
                rows = cache.view(-1, L + R).cpu()
                _check_cache_rows(rows[:, :L], rows[:, L:], kv_c, k_rot, kw["slot_mapping"], torch.float32, backend)


def test_q_out_checks():
    q, k_pe, _ = _inputs((T,), torch.float32, "cpu")
    for q_out, split_q, error, match in (
            (torch.empty(T, H, D_NOPE), False, ValueError, r"q_out must have shape"),
            (torch.empty(T, H, D_NOPE + R, dtype=torch.float16), False, TypeError, "q_out must be a tensor of"),
            (q, False, ValueError, "q_out and q share memory"),
            (torch.empty(T, H, D_NOPE + R), True, TypeError, "must be a pair"),
            ((None, torch.empty(T, H, R + 2)), True, ValueError, r"q_out\[1\] must have shape"),
            (torch.empty(1, 1, D_NOPE + R).expand(T, H, D_NOPE + R), False, ValueError, "reaches an element twice")):
        with pytest.raises(error, match=match):
            mla(q, k_pe, positions=torch.arange(T), q_out=q_out, split_q=split_q)
    with pytest.raises(RuntimeError, match="q_out is written in place"):
        mla(q.requires_grad_(True), k_pe, positions=torch.arange(T), q_out=torch.empty(T, H, D_NOPE + R))


def test_a_kv_c_that_requires_grad_raises_with_everything_untouched():
    """kv_c is only copied into the cache, which autograd does not track: its gradient used to be dropped silently.
    Now the call raises before anything is written (q and k_pe stay differentiable with a cache)."""
    q, k_pe, kv_c = _inputs((T,), torch.float32, "cpu")
    kv_c.requires_grad_(True)
    cache = _poisoned((BLOCKS, BLOCK_SIZE, L + R), torch.float32, "cpu")
    kw = dict(positions=torch.arange(T), kv_cache=cache, slot_mapping=_slots(T, BLOCKS * BLOCK_SIZE, "cpu"))
    before = snapshot(cache, q, k_pe, kv_c)
    with pytest.raises(RuntimeError, match="kv_c requires grad"):
        mla(q, k_pe, kv_c, **kw)
    assert_unchanged([cache, q, k_pe, kv_c], before)
    mla(q, k_pe, kv_c.detach(), **kw)
    assert not same_bits(cache, before[0])


def test_an_expanded_cache_is_refused_untouched():
    q, k_pe, kv_c = _inputs((T,), torch.float32, "cpu")
    shared = torch.zeros(1, BLOCK_SIZE, L + R)
    with torch.no_grad(), pytest.raises(ValueError, match="kv_cache reaches an element twice"):
        mla(q, k_pe, kv_c, positions=torch.arange(T), kv_cache=shared.expand(BLOCKS, BLOCK_SIZE, L + R),
            slot_mapping=_slots(T, BLOCKS * BLOCK_SIZE, "cpu"))
    assert not shared.any()


def test_compile_fullgraph_with_q_out():
    torch._dynamo.reset()

    def write(q, k_pe, kv_c, positions, cache, slots, buffer):
        return mla(q, k_pe, kv_c, positions=positions, kv_cache=cache, slot_mapping=slots, split_q=True,
                   q_out=(None, buffer[..., L:L + R]), style="interleaved")

    compiled = torch.compile(write, fullgraph=True)
    for _ in range(CALLS):
        q, k_pe, kv_c = _inputs((T,), torch.float32, "cpu")
        positions = torch.randint(0, 99, (T,))
        slots = _slots(T, BLOCKS * BLOCK_SIZE, "cpu")
        caches = [_poisoned((BLOCKS, BLOCK_SIZE, L + R), torch.float32, "cpu") for _ in range(2)]
        buffers = [_poisoned((T, H, L + R), torch.float32, "cpu") for _ in range(2)]
        got = compiled(q, k_pe, kv_c, positions, caches[0], slots, buffers[0])
        want = write(q, k_pe, kv_c, positions, caches[1], slots, buffers[1])
        assert all(same_bits(g, w) for g, w in zip(got, want))
        assert same_bits(caches[0], caches[1]) and same_bits(buffers[0], buffers[1])
        assert not torch.isnan(buffers[0][..., L:]).any()


@pytest.mark.parametrize("route", ROUTES[1:])
@pytest.mark.parametrize("method", ["float64", "integer"])
def test_exact_angle_methods(route, method):
    """Both in-kernel angle reductions (float64, and the 64-bit integer turns of GPUs with slow float64) at large
    positions."""
    from ropekit.testing import exact_angles

    with on_route(route) as device, exact_angles(method):
        for _ in range(CALLS):
            q, k_pe, _ = _inputs((T,), torch.float32, device)
            positions = torch.randint(2**20, 2**31 - 1, (T,), device=device)
            q_out, k_out = mla(q, k_pe, positions=positions, base=500000.0)
            q_rot, k_rot = oracle(q, k_pe, positions, base=500000.0)
            assert_close_to_ref(q_out, q_rot, torch.float32, ROUTE_BACKENDS[route])
            assert_close_to_ref(k_out, k_rot, torch.float32, ROUTE_BACKENDS[route])


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("d_nope", [0, 12])
def test_widths_that_are_not_powers_of_two(route, d_nope):
    """D_rope 6 (3 pairs), latent 5, and q without nope columns: padded blocks are masked."""
    backend = ROUTE_BACKENDS[route]
    with on_route(route) as device:
        for _ in range(CALLS):
            q, k_pe, kv_c = _inputs((T,), torch.float32, device, latent=5, d_nope=d_nope, rope=6)
            positions = torch.randint(0, 999, (T,), device=device)
            slots = _slots(T, BLOCKS * BLOCK_SIZE, device)
            ckv, kpe = _poisoned((BLOCKS, BLOCK_SIZE, 5), torch.float32, device), _poisoned((BLOCKS, BLOCK_SIZE, 6),
                                                                                          torch.float32, device)
            q_nope, q_pe, k_out = mla(q, k_pe, kv_c, positions=positions, kv_cache=(ckv, kpe), slot_mapping=slots,
                                      split_q=True, style="interleaved")
            q_rot, k_rot = oracle(q, k_pe, positions, style="interleaved")
            assert q_nope.shape == (T, H, d_nope)
            assert_close_to_ref(q_nope, q_rot[..., :d_nope], torch.float32, backend)
            assert_close_to_ref(q_pe, q_rot[..., d_nope:], torch.float32, backend)
            _check_cache_rows(ckv.view(-1, 5).cpu(), kpe.view(-1, 6).cpu(), kv_c, k_rot, slots, torch.float32,
                              backend)


@pytest.mark.parametrize("route", ROUTES)
def test_inference_mode(route):
    """Serving calls run under torch.inference_mode(); a cache made there refuses writes outside it, as torch
    refuses in-place updates of inference tensors, before anything is written."""
    backend = ROUTE_BACKENDS[route]
    with on_route(route) as device:
        q, k_pe, kv_c = _inputs((T,), torch.bfloat16, device)
        positions, slots = torch.randint(0, 99, (T,), device=device), _slots(T, BLOCKS * BLOCK_SIZE, device)
        with torch.inference_mode():
            cache = _poisoned((BLOCKS, BLOCK_SIZE, L + R), torch.bfloat16, device)
            q_out, k_out = mla(q, k_pe, kv_c, positions=positions, kv_cache=cache, slot_mapping=slots)
        q_rot, k_rot = oracle(q, k_pe, positions)
        assert_close_to_ref(q_out, q_rot, torch.bfloat16, backend)
        rows = cache.view(-1, L + R).cpu()
        _check_cache_rows(rows[:, :L], rows[:, L:], kv_c, k_rot, slots, torch.bfloat16, backend)
        before = snapshot(cache)
        with pytest.raises(RuntimeError, match="inference tensor"):
            mla(q, k_pe, kv_c, positions=positions, kv_cache=cache, slot_mapping=slots)
        assert_unchanged([cache], before)


def test_float32_path_of_devices_without_float64():
    """The torch path other devices (MPS, XPU) take, run on CPU tensors: float32 math, host-exact angles."""
    from ropekit import mla as mla_module
    from ropekit._spec import RopeArgs
    from ropekit.reference import mla_reference

    q, k_pe, kv_c = _inputs((T,), torch.bfloat16, "cpu")
    positions, slots = torch.randint(0, 10**5, (T,)), _slots(T, BLOCKS * BLOCK_SIZE, "cpu")
    spec = mla_module._validate(q, k_pe, None, positions, None, None, "paged", None, None, False,
                                RopeArgs(style="interleaved"))[2]
    q4, k4 = q.unsqueeze(1), k_pe.unsqueeze(1)
    outs = [poisoned_like(q4), poisoned_like(k4)]
    ckv, kpe = _poisoned((BLOCKS, BLOCK_SIZE, L), FP8, "cpu"), _poisoned((BLOCKS, BLOCK_SIZE, R), FP8, "cpu")
    mla_reference(q4, k4, outs, spec, kv_c=kv_c.unsqueeze(1), ckv_cache=ckv, kpe_cache=kpe,
                  slots=slots.view(T, 1), cache_scale=0.5, math_dtype=torch.float32)
    q_rot, k_rot = oracle(q, k_pe, positions, style="interleaved")
    assert_close_to_ref(outs[0][:, 0], q_rot, torch.bfloat16, "float32-path")
    assert_close_to_ref(outs[1][:, 0], k_rot, torch.bfloat16, "float32-path")
    _check_cache_rows(ckv.view(-1, L), kpe.view(-1, R), kv_c, k_rot, slots, FP8, "float32-path", scale=0.5)


def test_opcheck():
    """torch.library.opcheck on both ops: schema (the caches and q outputs mutated, nothing else), fake tensors,
    autograd registration and AOT dispatch."""
    from ropekit import mla as mla_module
    from ropekit import ops
    from ropekit._spec import RopeArgs

    q, k_pe, kv_c = _inputs((T,), torch.float32, "cpu")
    spec = mla_module._validate(q, k_pe, None, torch.arange(T), None, None, "paged", None, None, False,
                                RopeArgs(style="interleaved"))[2]
    q4, k4 = q.unsqueeze(1), k_pe.unsqueeze(1).requires_grad_(True)
    torch.library.opcheck(ops.mla_rope, (q4.requires_grad_(True), k4, H, True, *spec))
    cache = torch.zeros(BLOCKS, BLOCK_SIZE, L + R)
    q_pe_out = torch.zeros(T, 1, H, R)
    torch.library.opcheck(ops.mla_rope_kv_write, (q4.detach(), k4.detach(), kv_c.unsqueeze(1), cache, None, None,
                                                  q_pe_out, torch.arange(T).view(T, 1), True, None, 1.0, None, None,
                                                  1.0, 1.0, 1, True, *spec))
