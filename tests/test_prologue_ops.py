"""The prologue's registered ops and its eager routes: opcheck of ``ropekit::qk_norm_rope``,
``ropekit::qk_norm_rope_backward`` and ``ropekit::rope_kv_write``, and the differential checks that the eager
routes (no dispatcher: ``autograd.EagerNormRope``, ``ops.write_kv``) give exactly what the registered ops give."""


import pytest
import torch
from torch.library import opcheck

import ropekit
from helpers import KERNEL_ROUTES, ROUTES, route_context, route_device
from ropekit import autograd, ops
from ropekit._cache_validation import validate_kv_write
from ropekit._spec import CacheArgs, RopeArgs
from ropekit._validation import validate, validate_args
from ropekit.testing import max_relative_error, max_relative_tolerance

ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
DEVICES = ROUTES
_context = route_context
_dev = route_device


def _norm_inputs(device, dtype=torch.float32):
    B, S, HQ, HK, D = 2, 3, 4, 2, 16
    dev = _dev(device)
    q = torch.randn(B, S, HQ, D, device=dev, dtype=dtype)
    k = torch.randn(B, S, HK, D, device=dev, dtype=dtype)
    qw, kw = torch.randn(D, device=dev, dtype=dtype), torch.randn(D, device=dev, dtype=dtype)
    pos = torch.randint(0, 100, (B, S), device=dev)
    return q, k, qw, kw, pos


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_qk_norm_rope(device):
    with _context(device):
        q, k, qw, kw, pos = _norm_inputs(device)
        spec = validate(q, k, positions=pos, rotary_dim=8, style="interleaved")
        args = (q.requires_grad_(), k.requires_grad_(), qw.requires_grad_(), kw, 0.5, 1e-6, *spec)
        # the AOT-dispatch checks trace with fake tensors, which the interpreter cannot run
        tests = ("test_schema", "test_autograd_registration", "test_faketensor") if device == "cpu-kernels" else None
        opcheck(torch.ops.ropekit.qk_norm_rope.default, args, test_utils=tests or ALL_CHECKS)
        g = (torch.randn_like(q), torch.randn_like(k))
        opcheck(torch.ops.ropekit.qk_norm_rope_backward.default,
                (*g, q.detach(), k.detach(), qw.detach(), kw, 0.5, 1e-6, *spec),
                test_utils=tests or ALL_CHECKS)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_rope_kv_write(device):
    with _context(device):
        dev = _dev(device)
        q, k, v = (torch.randn(3, h, 16, device=dev) for h in (4, 2, 2))
        k_cache, v_cache = torch.zeros(2, 4, 2, 16, device=dev), torch.zeros(2, 4, 2, 16, device=dev)
        slots = torch.tensor([5, -1, 0], device=dev)
        q4, k4, v4, rope_args, cache = validate_kv_write(
            q, k, CacheArgs(v, k_cache, v_cache, slot_mapping=slots, cache_layout="paged"),
            RopeArgs(positions=torch.tensor([1, 2, 3]).to(dev)))
        spec = validate_args(q4, k4, rope_args)
        tests = ("test_schema", "test_faketensor") if device == "cpu-kernels" else None
        opcheck(torch.ops.ropekit.rope_kv_write.default,
                (q4, k4, v4, k_cache, v_cache, None, None, 0.0, 1e-6, *ops.cache_op_args(cache), *spec),
                test_utils=tests or ALL_CHECKS)


@pytest.mark.parametrize("device", DEVICES)
def test_eager_norm_rope_route_equals_the_registered_op(device):
    # EagerNormRope (no dispatcher) and ropekit::qk_norm_rope with its registered backward: the same kernels,
    # so the same bits, forward and backward, over several calls with fresh data.
    with _context(device):
        for _ in range(3):
            q, k, qw, kw, pos = _norm_inputs(device, torch.bfloat16 if device != "cpu" else torch.float32)
            spec = validate(q, k, positions=pos)
            leaves = [t.clone().requires_grad_() for t in (q, k, qw, kw)]
            eager = autograd.EagerNormRope.apply(*leaves, 1.0, 1e-5, spec)
            assert type(eager) is tuple
            leaves_op = [t.clone().requires_grad_() for t in (q, k, qw, kw)]
            op = ops.qk_norm_rope(*leaves_op, 1.0, 1e-5, *spec)
            gq, gk = torch.randn_like(eager[0]), torch.randn_like(eager[1]).transpose(1, 2).contiguous().transpose(1, 2)
            for a, b in zip(eager, op):
                assert torch.equal(a, b)
            ga = torch.autograd.grad(eager, leaves, (gq, gk))
            gb = torch.autograd.grad(op, leaves_op, (gq, gk))
            for a, b in zip(ga, gb):
                assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_rope_kv_write_refuses_gradients(device):
    with _context(device):
        dev = _dev(device)
        q, k, v = (torch.randn(3, h, 16, device=dev) for h in (4, 2, 2))
        caches = torch.zeros(3, 4, 2, 16, device=dev), torch.zeros(3, 4, 2, 16, device=dev)
        before = [c.clone() for c in caches]
        with pytest.raises(RuntimeError, match="not differentiable"):
            ropekit.rope_kv_write(q.requires_grad_(), k, v, *caches, positions=torch.tensor([0, 1, 2]).to(dev))
        assert all(torch.equal(a, b) for a, b in zip(caches, before))
        with torch.no_grad():
            ropekit.rope_kv_write(q, k, v, *caches, positions=torch.tensor([0, 1, 2]).to(dev))


def test_rope_kv_write_declares_its_cache_writes():
    # The kernel's writes go through views of the caches: their version counters move, so a tensor saved for
    # backward from a cache is refused instead of giving wrong gradients.
    q, k, v = (torch.randn(3, h, 16) for h in (4, 2, 2))
    k_cache, v_cache = torch.zeros(3, 2, 4, 16), torch.zeros(3, 2, 4, 16)
    versions = k_cache._version, v_cache._version
    with torch.no_grad():
        ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=torch.tensor([0, 1, 2]), cache_layout="bhsd")
    assert k_cache._version > versions[0] and v_cache._version > versions[1]


def test_qk_norm_rope_compiled_backward_equals_eager():
    # torch.compile traces ropekit::qk_norm_rope and its registered backward (the CPU path here).
    q, k, qw, kw, pos = _norm_inputs("cpu", torch.float64)

    def f(q, k, qw, kw):
        a, b = ropekit.qk_norm_rope(q, k, qw, kw, positions=pos, eps=1e-6)
        return (a * a).sum() + (b * 3).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, qw, kw)]
    eager = torch.autograd.grad(f(*leaves), leaves)
    leaves_c = [t.clone().requires_grad_() for t in (q, k, qw, kw)]
    compiled = torch.autograd.grad(torch.compile(f, fullgraph=True)(*leaves_c), leaves_c)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_rope_kv_write_compiled_equals_eager():
    # Under torch.compile the call is the mutating op ropekit::rope_kv_write: same q, same cache rows.
    q, k, v = (torch.randn(3, h, 16) for h in (4, 2, 2))
    pos = torch.tensor([5, 0, 2])

    def f(q, k, v, k_cache, v_cache):
        return ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=pos, cache_layout="bhsd", base=500.0)

    caches = torch.zeros(3, 2, 8, 16), torch.zeros(3, 2, 8, 16)
    caches_c = tuple(c.clone() for c in caches)
    with torch.no_grad():
        eager = f(q, k, v, *caches)
        compiled = torch.compile(f, fullgraph=True)(q, k, v, *caches_c)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for a, b in zip(caches_c, caches):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert caches[0].abs().sum() > 0


@pytest.mark.parametrize("device", KERNEL_ROUTES)
def test_backward_weight_gradient_is_the_same_split_over_any_number_of_programs(device, monkeypatch):
    # The backward's programs loop over token blocks and write one weight-gradient row each; one program or many
    # (every token block its own) must give the same gradients up to the order of an fp32 sum.
    from ropekit.triton import heuristics, prologue_launcher

    with _context(device):
        B, S, HQ, HK, D = 3, 5, 4, 2, 16
        dev = _dev(device)
        q, k = torch.randn(B, S, HQ, D, device=dev), torch.randn(B, S, HK, D, device=dev)
        qw, kw = torch.randn(D, device=dev), torch.randn(D, device=dev)
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        spec = validate(q, k, positions=torch.randint(0, 9, (B, S), device=dev), rotary_dim=8)
        outs = {}
        for per_sm in (0, 1000):
            monkeypatch.setattr(heuristics, "BWD_PROGRAMS_PER_SM", per_sm)
            outs[per_sm] = prologue_launcher.launch_norm_rope_bwd(gq, q, gk, k, spec, qw, kw, 0.0, 1e-6)
        for a, b in zip(outs[0], outs[1000]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(outs[0][0], outs[1000][0])  # dq is per element: the same bits


def test_sum_tree_holds_every_level_below_the_root_and_a_counter_per_node():
    from ropekit.triton.heuristics import SumTree, sum_tree

    assert sum_tree(1, 16) == SumTree(levels=1, rows=1, counters=1)
    assert sum_tree(16, 16) == SumTree(1, 16, 1)
    assert sum_tree(17, 16) == SumTree(2, 17 + 2, 2 + 1)
    assert sum_tree(8448, 16) == SumTree(4, 8448 + 528 + 33 + 3, 528 + 33 + 3 + 1)
    for rows, fan_in in ((0, 16), (5, 1)):  # no rows never reaches a root: refused, not looped on
        with pytest.raises(ValueError, match="sum tree"):
            sum_tree(rows, fan_in)


@pytest.mark.parametrize("device", ROUTES)
@pytest.mark.parametrize("empty", ["q", "k"])
def test_qk_norm_rope_with_no_heads_on_one_side_differentiates(device, empty):
    # q or k with zero heads: that side's weight gradient is zeros, the other side's as the float64 definition's,
    # twice (the second call through the fast path where there is one)
    from ropekit.reference import rms_norm_reference

    with _context(device):
        dev = _dev(device)
        heads = {"q": 0 if empty == "q" else 4, "k": 0 if empty == "k" else 2}
        for _call in range(2):
            q, k = (torch.randn(2, 3, heads[n], 16, device=dev, requires_grad=True) for n in ("q", "k"))
            qw, kw = (torch.rand(16, device=dev, requires_grad=True) for _ in range(2))
            pos = torch.randint(0, 50, (2, 3), device=dev)
            outs = ropekit.qk_norm_rope(q, k, qw, kw, positions=pos)
            ups = [torch.randn_like(o) for o in outs]
            got = torch.autograd.grad(outs, (q, k, qw, kw), ups)
            leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, qw, kw)]
            ref = ropekit.apply_rope(rms_norm_reference(leaves[0], leaves[2], 0.0, 1e-6),
                                     rms_norm_reference(leaves[1], leaves[3], 0.0, 1e-6), positions=pos.cpu())
            want = torch.autograd.grad(ref, leaves, [u.double().cpu() for u in ups], allow_unused=True)
            for g, w in zip(got, want):
                w = torch.zeros_like(g, dtype=torch.float64, device="cpu") if w is None else w
                torch.testing.assert_close(g.cpu().double(), w, rtol=1e-5, atol=1e-5)
            assert torch.equal(got[2 if empty == "q" else 3].cpu(), torch.zeros(16))


@pytest.mark.parametrize("device", KERNEL_ROUTES)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_backward_weight_gradient_tree_of_several_levels_matches_float64(device, weight_dtype, monkeypatch):
    # One program per token block and head (9 partial rows for q's weight, 3 for k's), added up by the kernel's
    # programs in trees of 2 rows a node: four levels for q with partial nodes on the way, two for k, the root
    # rounding once to the weight's dtype. Against the float64 gradients, and the same bits on a second launch
    # (the sums' order is fixed, whichever program does them).
    from ropekit.reference import rms_norm_reference
    from ropekit.triton import heuristics, prologue_launcher

    monkeypatch.setattr(heuristics, "BWD_PROGRAMS_PER_SM", 10**6)
    monkeypatch.setattr(heuristics, "WEIGHT_SUM_FAN_IN", 2)
    with _context(device):
        dev = _dev(device)
        B, S, HQ, HK, D = 1, 3, 3, 1, 16
        assert [heuristics.sum_tree(S * h, 2).levels for h in (HQ, HK)] == [4, 2]
        q, k = torch.randn(B, S, HQ, D, device=dev), torch.randn(B, S, HK, D, device=dev)
        qw, kw = ((torch.rand(D, device=dev) + 0.5).to(weight_dtype) for _ in range(2))
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, qw, kw)]
        ref = ropekit.apply_rope(rms_norm_reference(leaves[0], leaves[2], 0.0, 1e-6),
                                 rms_norm_reference(leaves[1], leaves[3], 0.0, 1e-6), positions=5)
        want = torch.autograd.grad(ref, leaves, (gq.double().cpu(), gk.double().cpu()))
        spec = validate(q, k, positions=5)
        got = prologue_launcher.launch_norm_rope_bwd(gq, q, gk, k, spec, qw, kw, 0.0, 1e-6, config=(1, 1, 1, 1))
        assert got[2].dtype == got[3].dtype == weight_dtype and got[2].shape == (D,)
        tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[weight_dtype]
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu().double(), w, rtol=tol, atol=tol)
        again = prologue_launcher.launch_norm_rope_bwd(gq, q, gk, k, spec, qw, kw, 0.0, 1e-6, config=(1, 1, 1, 1))
        assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.parametrize("device", KERNEL_ROUTES)
def test_backward_leaves_its_workspace_counters_at_zero_for_the_next_launch(device, monkeypatch):
    # The sum trees' rows and arrival counters live in the stream's workspace, kept between launches and never
    # cleared by the launcher: each launch must set every counter it used back to zero (else the next launch's
    # nodes never fill and its weight gradients are garbage), and must not read the rows a launch before left.
    from ropekit.reference import rms_norm_reference
    from ropekit.triton import heuristics, prologue_launcher, runtime

    monkeypatch.setattr(heuristics, "BWD_PROGRAMS_PER_SM", 10**6)
    monkeypatch.setattr(heuristics, "WEIGHT_SUM_FAN_IN", 2)
    with _context(device):
        dev = _dev(device)
        B, S, HQ, HK, D = 1, 3, 3, 1, 16
        q_tree, k_tree = (heuristics.sum_tree(S * h, 2) for h in (HQ, HK))
        counters = q_tree.counters + k_tree.counters
        q, k = torch.randn(B, S, HQ, D, device=dev), torch.randn(B, S, HK, D, device=dev)
        qw, kw = (torch.rand(D, device=dev) + 0.5 for _ in range(2))
        spec = validate(q, k, positions=7)
        for call in range(3):
            gq, gk = torch.randn_like(q), torch.randn_like(k)  # fresh gradients: stale rows would show
            buffer = runtime.workspace(q.device, 0)
            if call == 2:  # rows poisoned: every row a launch reads, it wrote first
                buffer[-(-4 * counters // 16) * 16:].view(torch.float32).fill_(float("nan"))
            got = prologue_launcher.launch_norm_rope_bwd(gq, q, gk, k, spec, qw, kw, 0.0, 1e-6, config=(1, 1, 1, 1))
            buffer = runtime.workspace(q.device, 0)
            assert torch.count_nonzero(buffer[:4 * counters].view(torch.int32)) == 0
            leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, qw, kw)]
            ref = ropekit.apply_rope(rms_norm_reference(leaves[0], leaves[2], 0.0, 1e-6),
                                     rms_norm_reference(leaves[1], leaves[3], 0.0, 1e-6), positions=7)
            want = torch.autograd.grad(ref, leaves, (gq.double().cpu(), gk.double().cpu()))
            for g, w in zip(got, want):
                torch.testing.assert_close(g.cpu().double(), w, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_training_step_in_a_cuda_graph_and_on_two_streams_matches_eager():
    # A captured backward takes fresh zeroed scratch from the graph's pool (a replay may run on another stream);
    # eager launches on two streams each take their own workspace. Every route gives the eager step's bits.
    B, S, HQ, HK, D = 2, 64, 8, 2, 64
    q = torch.randn(B, S, HQ, D, device="cuda", requires_grad=True)
    k = torch.randn(B, S, HK, D, device="cuda", requires_grad=True)
    qw = (torch.rand(D, device="cuda") + 0.5).requires_grad_(True)
    kw = (torch.rand(D, device="cuda") + 0.5).requires_grad_(True)
    pos = torch.arange(S, device="cuda")[None].expand(B, S)
    gq, gk = torch.randn(B, S, HQ, D, device="cuda"), torch.randn(B, S, HK, D, device="cuda")

    def step():
        outs = ropekit.qk_norm_rope(q, k, qw, kw, positions=pos)
        return torch.autograd.grad(outs, (q, k, qw, kw), (gq, gk))

    want = [t.clone() for t in step()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs' docs require
        for _ in range(3):
            assert all(torch.equal(a, b) for a, b in zip(step(), want))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, want))
        assert all(torch.equal(a, b) for a, b in zip(step(), want))  # eager after a replay: counters still zero


@pytest.mark.gpu
def test_backward_weight_gradients_are_the_same_bits_on_every_launch_of_a_full_grid():
    # Thousands of programs arriving in the weight-gradient sum tree at once, on the GPU, at the shape and block
    # config a training step takes: a race (a node summed before a child's row is seen) would show as launches
    # that differ, or as a sum off the float64 one.
    from ropekit.triton import prologue_launcher

    B, S, HQ, HK, D = 2, 4096, 32, 8, 128
    q, k = torch.randn(B, S, HQ, D, device="cuda"), torch.randn(B, S, HK, D, device="cuda")
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    qw, kw = torch.rand(D, device="cuda") + 0.5, torch.rand(D, device="cuda") + 0.5
    spec = validate(q, k, positions=torch.arange(S, device="cuda")[None].expand(B, S))
    first = prologue_launcher.launch_norm_rope_bwd(gq, q, gk, k, spec, qw, kw, 0.0, 1e-6)
    for _ in range(20):
        again = prologue_launcher.launch_norm_rope_bwd(gq, q, gk, k, spec, qw, kw, 0.0, 1e-6)
        assert torch.equal(again[2], first[2]) and torch.equal(again[3], first[3])
    # the float64 weight gradient: the sum over tokens and heads of g' * x * r, g' the conjugate-rotated gradient
    leaves = [t.double().requires_grad_() for t in (q, k, qw, kw)]
    outs = ropekit.qk_norm_rope(*leaves, positions=torch.arange(S, device="cuda")[None].expand(B, S))
    want = torch.autograd.grad(outs, leaves[2:], (gq.double(), gk.double()))
    for got, ref in zip(first[2:], want):  # the table's bound, as the smaller gradient tests hold them to
        assert max_relative_error(got, ref) <= max_relative_tolerance(torch.float32, "cuda")


def test_readme_decode_example_runs_and_writes_each_sequences_row():
    # The README's rope_kv_write example, run on CPU tensors (float32): it must keep working as written.
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = readme.split("## Attention prologue")[1].split("```python")[1].split("```")[0]
    code = code.replace('device="cuda"', 'device="cpu"').replace("torch.bfloat16", "torch.float32")
    scope: dict = {}
    exec(code, scope)
    k_cache, lengths, k, q_rot = scope["k_cache"], scope["lengths"], scope["k"], scope["q_rot"]
    written = (k_cache != 0).any(-1)  # [B, Hkv, max_len]
    for b in range(k_cache.shape[0]):
        assert written[b, :, lengths[b]].all() and int(written[b].sum()) == k_cache.shape[1]
    assert q_rot.shape == scope["q"].shape and k.shape[0] == k_cache.shape[0]


@pytest.mark.parametrize("device", KERNEL_ROUTES)
@pytest.mark.parametrize("config", [(1, 8, 8, 1), (2, 16, 8, 4), (1, 16, 8, 2), (4, 8, 8, 4), (1, 8, 8, 2)])
@pytest.mark.parametrize("rotary", [{}, {"rotary_dim": 16, "rotary_at": "back"}], ids=["full", "partial"])
def test_norm_kernels_at_large_grid_block_shapes_match_float64(device, config, rotary, monkeypatch):
    # The shapes heuristics.norm_block_config picks on a GPU for large grids (and one more), forced on small inputs
    # with a partial head block (12 query heads, 4 key heads): the forward with and without a cache row write, and
    # the backward, each against the float64 path. One backward program per head block, so each loops over every
    # token block and its weight-gradient accumulators carry across iterations.
    from ropekit.reference import rms_norm_reference
    from ropekit.triton import heuristics, prologue_launcher

    monkeypatch.setattr(heuristics, "BWD_PROGRAMS_PER_SM", 0)
    with _context(device):
        dev = _dev(device)
        B, S, HQ, HK, D = 2, 5, 12, 4, 32
        q, k, v = (torch.randn(B, S, h, D, device=dev) for h in (HQ, HK, HK))
        qw, kw = torch.rand(D, device=dev) + 0.5, torch.rand(D, device=dev) + 0.5
        pos = torch.stack([torch.randperm(64)[:S] for _ in range(B)]).to(dev)  # distinct rows per sequence
        leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, qw, kw)]
        ref_q, ref_k = ropekit.apply_rope(rms_norm_reference(leaves[0], leaves[2], 0.0, 1e-6),
                                          rms_norm_reference(leaves[1], leaves[3], 0.0, 1e-6), positions=pos.cpu(),
                                          **rotary)
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        ref_grads = torch.autograd.grad((ref_q, ref_k), leaves, (gq.double().cpu(), gk.double().cpu()))
        spec = validate(q, k, positions=pos, **rotary)
        q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
        prologue_launcher.launch_prologue(q, k, q_out, k_out, spec, q_weight=qw, k_weight=kw, config=config)
        torch.testing.assert_close(q_out.cpu().double(), ref_q.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k_out.cpu().double(), ref_k.detach(), rtol=1e-5, atol=1e-5)

        caches = [torch.full((B, 64, HK, D), float("nan"), device=dev) for _ in range(2)]
        q4, k4, v4, rope_args, cache = validate_kv_write(q, k, CacheArgs(v, *caches), RopeArgs(positions=pos))
        q_out.fill_(float("nan"))
        prologue_launcher.launch_prologue(q4, k4, q_out, None, validate_args(q4, k4, rope_args._replace(**rotary)),
                                 v=v4, cache=cache, q_weight=qw, k_weight=kw, config=config)
        rows = caches[0][torch.arange(B, device=dev)[:, None], pos]  # [B, S, HK, D]
        torch.testing.assert_close(q_out.cpu().double(), ref_q.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rows.cpu().double(), ref_k.detach(), rtol=1e-5, atol=1e-5)

        grads = prologue_launcher.launch_norm_rope_bwd(gq, q, gk, k, spec, qw, kw, 0.0, 1e-6, config=config)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-4)
