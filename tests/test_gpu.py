"""CUDA-only checks: the public API on the GPU, torch.library/compile, CUDA graphs, no host syncs."""

import pytest
import torch
from torch.library import opcheck

import ropekit
from ropekit._validation import validate
from ropekit.testing import assert_close_to_ref, make_qk, tolerance
from test_api import _ref

pytestmark = pytest.mark.gpu

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


@pytest.mark.parametrize("case", API_CASES, ids=[c[0] for c in API_CASES])
def test_api_on_cuda_matches_reference(case):
    _, layout, dtype, kwargs = case
    B, S = 2, 33
    kwargs = _resolve(kwargs, B, S)
    for _ in range(3):  # the first call compiles, later ones reuse the cached kernel handle: fresh data each time
        q, k = make_qk(B, S, 8, 2, 64, dtype=dtype, device="cuda", layout=layout)
        q_rot, k_rot = ropekit.apply_rope(q, k, layout=layout, **kwargs)
        cpu_kwargs = {key: (v.cpu() if isinstance(v, torch.Tensor) else v) for key, v in kwargs.items()}
        ref_q, ref_k = _ref(q.cpu(), k.cpu(), layout=layout, **cpu_kwargs)
        assert q_rot.is_cuda and q_rot.shape == q.shape and q_rot.is_contiguous()
        assert_close_to_ref(q_rot, ref_q, dtype)
        assert_close_to_ref(k_rot, ref_k, dtype)


def test_autograd_on_cuda():
    q, k = make_qk(2, 16, 8, 2, 64, device="cuda")
    q.requires_grad_(True)
    k.requires_grad_(True)
    q_rot, k_rot = ropekit.apply_rope(q, k, positions=9, q_scale=0.5, style="interleaved")
    gq, gk = torch.randn_like(q_rot), torch.randn_like(k_rot)
    dq, dk = torch.autograd.grad((q_rot, k_rot), (q, k), (gq, gk))
    want_q, want_k = _ref(gq.cpu(), gk.cpu(), positions=9, q_scale=0.5, style="interleaved", conjugate=True)
    assert_close_to_ref(dq, want_q, torch.float32)
    assert_close_to_ref(dk, want_k, torch.float32)


def test_opcheck_on_cuda():
    q, k = make_qk(2, 8, 4, 2, 32, device="cuda")
    spec = validate(q, k, positions=torch.tensor([3, 4], device="cuda"))
    opcheck(torch.ops.ropekit.rope.default, (q.requires_grad_(True), k, *spec))
    q2, k2 = make_qk(2, 8, 4, 2, 32, device="cuda")
    opcheck(torch.ops.ropekit.rope_.default, (q2, k2, *spec))


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


def test_check_positions_on_cuda_raises():
    q, k = make_qk(2, 4, 4, 2, 32, device="cuda")
    table = torch.randn(6, 16, device="cuda")
    bad = torch.tensor([[0, 1, 2, 6], [0, 1, 2, 3]], device="cuda")
    before = q.clone()
    with pytest.raises(IndexError, match="table has 6 rows"):
        ropekit.apply_rope_(q, k, positions=bad, cos=table, sin=table, check_positions=True)
    assert torch.equal(q, before)
    with pytest.raises(IndexError, match=">= 0"):
        ropekit.apply_rope(q, k, positions=-bad, check_positions=True)
    q_thd = torch.randn(8, 4, 32, device="cuda")
    with pytest.raises(ValueError, match="cu_seqlens"):
        ropekit.apply_rope(q_thd, layout="thd", cu_seqlens=torch.tensor([0, 9], device="cuda"),
                           check_positions=True)
    out = ropekit.apply_rope(q, k, positions=bad, cos=table, sin=table)[0]  # default: the bad token is NaN
    assert torch.isnan(out[0, 3]).all() and not torch.isnan(out[1]).any()


def test_token_blocks_over_two_grid_axes_on_cuda():
    # One token per program and more tokens than grid axis 1 holds: programs on axis 2 rotate the right tokens,
    # and the ones past the end write nothing.
    from ropekit.reference import rope_reference
    from ropekit.triton.launcher import launch_rope

    T = 3 * 65535 + 7
    q = torch.randn(T, 1, 1, 8, device="cuda")
    pos = torch.randint(0, 1 << 16, (T, 1), device="cuda")
    spec = validate(q, None, positions=pos)
    out = torch.full((T + 64, 1, 1, 8), float("nan"), device="cuda")
    launch_rope(q, None, out[:T], None, spec, config=(1, 1, 1, 1))
    ref = rope_reference(q.cpu(), None, validate(q.cpu(), None, positions=pos.cpu())._replace(
        out_dtype=torch.float64))[0]
    assert_close_to_ref(out[:T], ref, torch.float32)
    assert torch.isnan(out[T:]).all()
