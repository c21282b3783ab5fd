"""The prologue's batch-invariance guarantee: for the same token (its q, k, v, position and norm weights),
``qk_norm_rope``'s outputs equal ``rope_kv_write``'s q and cache k bit for bit, and neither depends on the batch
size, the token's index in the batch, the token count, the launch shape the launcher picks (BLOCK_T, head blocks,
warps), CUDA graphs or the eager fast path. What makes it hold: every value a token's output depends on is computed
from that token's row alone, elementwise or by reductions of a fixed order (the norm's sum of squares is a fixed
tree of adjacent pairs, never a ``tl.sum`` whose order follows the tile's layout).

CPU CI runs the kernels under the Triton interpreter; the GPU tests cover decode (1..256 tokens) and prefill
(4096) sizes, graph and eager."""

from __future__ import annotations

import pytest
import torch

import ropekit
from helpers import KERNEL_ROUTES, ROUTES, bits, on_route
from ropekit._spec import RopeArgs
from ropekit._validation import validate_args
from ropekit.triton.prologue_launcher import launch_prologue

EPS = 1e-6
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _tokens(n, hq, hk, d, dtype, device):
    q, k, v = (torch.randn(n, h, d, dtype=torch.float64).to(dtype=dtype, device=device) for h in (hq, hk, hk))
    wq, wk = (1.0 + 0.3 * torch.randn(d)).to(device), (1.0 + 0.3 * torch.randn(d)).to(device)
    positions = torch.randint(0, 4000, (n,)).to(device)
    return q, k, v, wq, wk, positions


def _norm_rope(q, k, wq, wk, positions, **kw):
    """qk_norm_rope of [T, H, D] tokens at their own positions (packed layout)."""
    with torch.no_grad():
        return ropekit.qk_norm_rope(q, k, wq, wk, eps=EPS, positions=positions, layout="thd", base=1e6, **kw)


def _kv_write(q, k, v, wq, wk, positions):
    """rope_kv_write of [T, H, D] tokens into a paged cache (token t at slot t): (q_out, the cache's k rows)."""
    T, hk, d = k.shape
    k_cache = torch.full((T + 3, 1, hk, d), float("nan"), dtype=k.dtype, device=k.device)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.arange(T, device=k.device)
    with torch.no_grad():
        q_out = ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=positions, slot_mapping=slots,
                                      cache_layout="paged", q_weight=wq, k_weight=wk, eps=EPS, base=1e6)
    return q_out, k_cache[:T, 0]


def _assert_same_rows(got, want, rows):
    """``got``'s rows are ``want``'s rows ``rows``, bit for bit."""
    assert torch.equal(bits(got), bits(want[rows])), "a token's output changed with its batch"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_same_bits_whatever_the_batch_the_op_and_the_fast_path(route, dtype):
    """Six tokens through qk_norm_rope and rope_kv_write: each token alone, in the whole batch, in reverse order,
    as a [2, 3] batch, and replayed by the fast path, gives the same bits; qk_norm_rope's q and k equal
    rope_kv_write's q and cached k."""
    with on_route(route, clear_plans=True) as dev:
        q, k, v, wq, wk, positions = _tokens(6, 3, 1, 32, dtype, dev)
        q_ref, k_ref = _norm_rope(q, k, wq, wk, positions)
        q_kv, k_kv = _kv_write(q, k, v, wq, wk, positions)
        _assert_same_rows(q_kv, q_ref, slice(None))
        _assert_same_rows(k_kv, k_ref, slice(None))
        for i in (0, 3, 5):  # one token alone (decode)
            one = slice(i, i + 1)
            q1, k1 = _norm_rope(q[one], k[one], wq, wk, positions[one])
            _assert_same_rows(q1, q_ref, one)
            _assert_same_rows(k1, k_ref, one)
            q1, k1 = _kv_write(q[one], k[one], v[one], wq, wk, positions[one])
            _assert_same_rows(q1, q_ref, one)
            _assert_same_rows(k1, k_ref, one)
        rev = torch.arange(5, -1, -1, device=dev)  # every token at another index
        q_r, k_r = _norm_rope(q[rev], k[rev], wq, wk, positions[rev])
        _assert_same_rows(q_r, q_ref, rev)
        _assert_same_rows(k_r, k_ref, rev)
        with torch.no_grad():  # a [B, S] batch of the same tokens
            q_b, k_b = ropekit.qk_norm_rope(q.view(2, 3, 3, 32), k.view(2, 3, 1, 32), wq, wk, eps=EPS,
                                            positions=positions.view(2, 3), base=1e6)
        _assert_same_rows(q_b.reshape(6, 3, 32), q_ref, slice(None))
        _assert_same_rows(k_b.reshape(6, 1, 32), k_ref, slice(None))
        for _ in range(3):  # recorded on the second call, replayed on the third
            q_p, k_p = _norm_rope(q, k, wq, wk, positions)
            q_pk, k_pk = _kv_write(q, k, v, wq, wk, positions)
        for got, want in ((q_p, q_ref), (k_p, k_ref), (q_pk, q_ref), (k_pk, k_ref)):
            _assert_same_rows(got, want, slice(None))


@pytest.mark.parametrize("route", KERNEL_ROUTES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [32, 16], ids=["full", "partial"])
def test_same_bits_whatever_the_launch_shape(route, dtype, rotary_dim):
    """The prologue kernel's output does not depend on the block shape (tokens and heads per program, warps):
    every shape gives the bits of the launcher's own choice, with and without a cache."""
    with on_route(route) as dev:
        q, k, v, wq, wk, positions = _tokens(7, 4, 2, 32, dtype, dev)
        q4, k4 = q.view(1, 7, 4, 32), k.view(1, 7, 2, 32)
        spec = validate_args(q4, k4, RopeArgs(positions=positions.view(1, 7), base=1e6, rotary_dim=rotary_dim))
        outs = {}
        for config in (None, (1, 1, 1, 1), (1, 4, 2, 1), (2, 2, 1, 2), (4, 4, 2, 4), (8, 4, 2, 8)):
            q_out, k_out = torch.empty_like(q4), torch.empty_like(k4)
            launch_prologue(q4, k4, q_out, k_out, spec, q_weight=wq, k_weight=wk, eps=EPS, config=config)
            outs[config] = (q_out, k_out)
        base = outs[None]
        for config, (q_out, k_out) in outs.items():
            assert torch.equal(bits(q_out), bits(base[0])) and torch.equal(bits(k_out), bits(base[1])), config


# ------------------------------------------------------------------------------------------------------ GPU

GPU_SIZES = [1, 2, 3, 7, 16, 64, 255, 256]  # decode batches; the whole set of 4096 tokens is the prefill


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_decode_and_prefill_sizes_give_the_same_bits(dtype):
    """On the GPU, with the launcher's own block shapes (which change with the token count and differ between the
    two ops): the first n tokens of a 4096-token prefill, run as a batch of n, give the prefill's bits, through
    qk_norm_rope and rope_kv_write alike; the fast path on or off."""
    q, k, v, wq, wk, positions = _tokens(4096, 16, 4, 128, dtype, "cuda")
    q_ref, k_ref = _norm_rope(q, k, wq, wk, positions)
    q_kv, k_kv = _kv_write(q, k, v, wq, wk, positions)
    _assert_same_rows(q_kv, q_ref, slice(None))
    _assert_same_rows(k_kv, k_ref, slice(None))
    for fast in (True, False):
        previous = ropekit.set_fast_path(fast)
        try:
            for n in GPU_SIZES:
                rows = slice(4096 - n, 4096)  # the last tokens: another index than in the prefill batch
                for _ in range(3):
                    q_n, k_n = _norm_rope(q[rows], k[rows], wq, wk, positions[rows])
                    q_nk, k_nk = _kv_write(q[rows], k[rows], v[rows], wq, wk, positions[rows])
                for got, want in ((q_n, q_ref), (k_n, k_ref), (q_nk, q_ref), (k_nk, k_ref)):
                    _assert_same_rows(got, want, rows)
        finally:
            ropekit.set_fast_path(previous)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_launch_shapes_give_the_same_bits(dtype):
    """Every block shape the launcher could pick gives the bits of its own choice, at decode and prefill sizes."""
    for n in (1, 8, 4096):
        q, k, _, wq, wk, positions = _tokens(n, 16, 4, 128, dtype, "cuda")
        q4, k4 = q.view(1, n, 16, 128), k.view(1, n, 4, 128)
        spec = validate_args(q4, k4, RopeArgs(positions=positions.view(1, n), base=1e6))
        outs = []
        for config in (None, (1, 1, 1, 1), (1, 16, 4, 4), (2, 4, 2, 2), (4, 8, 4, 4), (16, 4, 4, 8), (32, 2, 2, 4)):
            q_out, k_out = torch.empty_like(q4), torch.empty_like(k4)
            launch_prologue(q4, k4, q_out, k_out, spec, q_weight=wq, k_weight=wk, eps=EPS, config=config)
            outs.append((config, q_out, k_out))
        for config, q_out, k_out in outs[1:]:
            assert torch.equal(bits(q_out), bits(outs[0][1])), (n, config)
            assert torch.equal(bits(k_out), bits(outs[0][2])), (n, config)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 32, 4096], ids=["decode-1", "decode-32", "prefill-4096"])
def test_gpu_graph_replay_gives_the_eager_bits(n):
    """qk_norm_rope and rope_kv_write captured in a CUDA graph and replayed on fresh inputs give the eager calls'
    bits."""
    q, k, v, wq, wk, positions = _tokens(n, 16, 4, 128, torch.bfloat16, "cuda")
    static = [t.clone() for t in (q, k, v, positions)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs' docs require
        for _ in range(3):
            _norm_rope(static[0], static[1], wq, wk, static[3])
            _kv_write(*static[:3], wq, wk, static[3])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_q, g_k = _norm_rope(static[0], static[1], wq, wk, static[3])
        g_qk, g_kk = _kv_write(*static[:3], wq, wk, static[3])
    fresh = _tokens(n, 16, 4, 128, torch.bfloat16, "cuda")
    for s, f in zip(static, (fresh[0], fresh[1], fresh[2], fresh[5])):
        s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    e_q, e_k = _norm_rope(fresh[0], fresh[1], wq, wk, fresh[5])
    e_qk, e_kk = _kv_write(fresh[0], fresh[1], fresh[2], wq, wk, fresh[5])
    for got, want in ((g_q, e_q), (g_k, e_k), (g_qk, e_qk), (g_kk, e_kk), (e_qk, e_q), (e_kk, e_k)):
        assert torch.equal(bits(got), bits(want))
