"""The CPU path: float16/bfloat16/float32 CPU tensors are rotated by the float32 torch path (angles exact in float64
on the host, float32 math, one rounding) by default -- not the float64 reference, which float64 tensors, ``ropekit
check``'s oracle and :func:`ropekit.testing.reference_on_cpu` keep -- and it stays within the float32 path's
tolerance of the float64 reference over position modes, strides, in and out of place, and autograd."""

from __future__ import annotations

import math

import pytest
import torch

import ropekit
from helpers import INTERPRETED
from ropekit import float32_path, reference
from ropekit.testing import assert_close_to_ref, kernels_on_cpu, make_qk, reference_on_cpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
B, S, HQ, HK, D = 2, 9, 4, 2, 32


@pytest.fixture
def routes(monkeypatch):
    """Which torch path rotated each call: the names of the functions that ran, in order."""
    seen: list[str] = []
    for module, name in ((float32_path, "rope_float32_into"), (float32_path, "rope_float32"),
                         (reference, "rope_reference")):
        original = getattr(module, name)

        def recording(*args, _name=name, _original=original, **kwargs):
            seen.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, recording)
    return seen


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_cpu_route_is_float32_path(routes, dtype):
    q, k = make_qk(1, 5, 2, 1, 16, dtype=dtype)
    ropekit.apply_rope(q, k, positions=7)
    ropekit.apply_rope_(q, k, positions=7)
    ropekit.RotaryEmbedding(16)(q, k)
    assert routes == ["rope_float32_into"] * 3


def test_float64_and_reference_on_cpu_keep_the_float64_reference(routes):
    q, k = make_qk(1, 5, 2, 1, 16, dtype=torch.float64)
    ropekit.apply_rope(q, k, positions=7)
    assert routes == ["rope_reference"]
    routes.clear()
    with reference_on_cpu():
        ropekit.apply_rope(q.bfloat16(), k.bfloat16(), positions=7)
    assert routes == ["rope_reference"]


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_kernels_on_cpu_still_runs_the_kernels(routes):
    q, k = make_qk(1, 5, 2, 1, 16, dtype=torch.bfloat16)
    with kernels_on_cpu():
        got = ropekit.apply_rope(q, k, positions=7)
    assert routes == []
    want = ropekit.apply_rope(q.double(), k.double(), positions=7)
    for g, w in zip(got, want):
        assert_close_to_ref(g, w, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prologue_ops_take_the_float32_path(routes, dtype):
    q, k = make_qk(1, 5, 4, 2, 16, dtype=dtype)
    qw, kw = torch.rand(16, dtype=dtype) + 0.5, torch.rand(16, dtype=dtype) + 0.5
    q_out, k_out = ropekit.qk_norm_rope(q, k, qw, kw, positions=3)
    assert routes and "rope_reference" not in routes and set(routes) <= {"rope_float32", "rope_float32_into"}
    norm = lambda x, w: reference.rms_norm_reference(x, w, 0.0, 1e-6)  # noqa: E731
    want_q, want_k = ropekit.apply_rope(norm(q, qw), norm(k, kw), positions=3)
    # inputs and weights are exact in float64; the float32 norm adds its few-ulp error before the rounding
    assert_close_to_ref(q_out, want_q, dtype, backend="float32-path")
    assert_close_to_ref(k_out, want_k, dtype, backend="float32-path")


def _ids(b, s):
    return torch.randint(0, 1 << 24, (b, s))


# (kwargs factory, layout); every case is run with contiguous and non-contiguous q/k
CASES = {
    "range": lambda: dict(),
    "int-offset-interleaved": lambda: dict(positions=(1 << 20) + 3, style="interleaved"),
    "per-seq-offsets": lambda: dict(positions=torch.tensor([3, 90_000])),
    "per-token-ids": lambda: dict(positions=_ids(B, S)),
    "expanded-ids": lambda: dict(positions=_ids(1, S).expand(B, S)),
    "inv-freq-partial-back-scales": lambda: dict(inv_freq=torch.rand(8) + 0.01, rotary_at="back", q_scale=0.5,
                                                 k_scale=2.0, positions=_ids(B, S)),
    "partial-front-interleaved": lambda: dict(rotary_dim=16, style="interleaved", q_scale=0.25),
    "tables-full-width": lambda: dict(positions=torch.randint(0, 64, (B, S)), cos=torch.rand(64, D),
                                      sin=torch.rand(64, D), rotary_scale=1.5),
    "tables-per-sequence": lambda: dict(cos=torch.rand(B, S, D // 2), sin=torch.rand(B, S, D // 2)),
    "angles": lambda: dict(angles=torch.rand(1, S, D // 2) * 1000),
    "multi-axis": lambda: dict(positions=torch.randint(0, 1 << 20, (3, B, S)), sections=(4, 6, 6)),
    "multi-axis-interleaved": lambda: dict(positions=torch.randint(0, 1 << 20, (3, B, S)), sections=(6, 5, 5),
                                           section_layout="interleaved"),
    "bhsd-base": lambda: dict(layout="bhsd", base=500000.0, positions=11),
    "sbhd": lambda: dict(layout="sbhd", positions=torch.tensor([5, 70_000])),
    "thd-varlen": lambda: dict(layout="thd", cu_seqlens=torch.tensor([0, 3, 2 * S - 4, 2 * S]), positions=2),
}


def _inputs(layout: str, dtype: torch.dtype, strided: bool):
    """q, k in ``layout``; ``strided``: views into one packed q|k|v projection (non-contiguous, last dim dense)."""
    shape = {"bshd": (B, S), "bhsd": (B, S), "sbhd": (S, B), "thd": (B * S,)}[layout]
    if strided:
        qkv = torch.randn(*shape, HQ + 2 * HK, D, dtype=torch.float64).to(dtype)
        q, k, _ = qkv.split([HQ, HK, HK], dim=-2)
    else:
        q, k = (torch.randn(*shape, h, D, dtype=torch.float64).to(dtype) for h in (HQ, HK))
    if layout == "bhsd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, S, D] views
    return q, k


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_path_matches_float64_reference(case, dtype, strided):
    kwargs = CASES[case]()
    q, k = _inputs(kwargs.get("layout", "bshd"), dtype, strided)
    want_q, want_k = ropekit.apply_rope(q.double(), k.double(), **kwargs)
    got_q, got_k = ropekit.apply_rope(q, k, **kwargs)
    assert_close_to_ref(got_q, want_q, dtype, backend="float32-path")
    assert_close_to_ref(got_k, want_k, dtype, backend="float32-path")
    # in place: the views are written where they are, the rest of the packed buffer untouched
    qi, ki = q.clone(), k.clone()
    if strided:
        base = q._base
        before = base.clone()
        qi, ki = q, k
    ropekit.apply_rope_(qi, ki, **kwargs)
    assert_close_to_ref(qi, want_q, dtype, backend="float32-path")
    assert_close_to_ref(ki, want_k, dtype, backend="float32-path")
    if strided:
        v_cols = slice(HQ + HK, None)
        assert torch.equal(base[..., v_cols, :], before[..., v_cols, :])
    # autograd: the gradient is the conjugate rotation of the upstream gradient
    q, k = _inputs(kwargs.get("layout", "bshd"), dtype, strided)
    leaves = [q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()]
    grads = [torch.randn(x.shape, dtype=torch.float64).to(dtype) for x in leaves]
    got = torch.autograd.grad(ropekit.apply_rope(*leaves, **kwargs), leaves, grads)
    want = ropekit.rope_backward(grads[0].double(), grads[1].double(), **kwargs)
    for g, w in zip(got, want):
        assert_close_to_ref(g, w, dtype, backend="float32-path")


@pytest.mark.parametrize("inplace", [False, True])
def test_blocks_of_tokens_cover_every_token(monkeypatch, inplace):
    """Long inputs are rotated a block of tokens at a time: blocks of one and of several tokens, a last short one."""
    monkeypatch.setattr(float32_path, "_block_elements", lambda x: 3 * B * HQ * D)
    q, k = make_qk(B, 3 * 4 + 2, HQ, HK, D, dtype=torch.bfloat16)
    ids = _ids(B, q.shape[1])
    want = ropekit.apply_rope(q.double(), k.double(), positions=ids, rotary_dim=24)
    got = (q, k) if inplace else None
    if inplace:
        ropekit.apply_rope_(q, k, positions=ids, rotary_dim=24)
    else:
        got = ropekit.apply_rope(q, k, positions=ids, rotary_dim=24)
    for g, w in zip(got, want):
        assert_close_to_ref(g, w, torch.bfloat16, backend="float32-path")


# (kwargs factory, tokens per sequence) for calls cut into blocks of a few whole sequences (decode sizes too large
# for one block): one token, or a few, per sequence; tables per sequence make the blocks narrow them too
BLOCKED = {
    "decode-ids-neox": (lambda b, s: dict(positions=_ids(b, s)), 1),
    "decode-offset-interleaved-partial": (lambda b, s: dict(positions=70_000, style="interleaved", rotary_dim=16,
                                                            q_scale=0.5), 1),
    "tables-per-sequence-back": (lambda b, s: dict(cos=torch.rand(b, s, 8), sin=torch.rand(b, s, 8),
                                                   rotary_at="back", k_scale=2.0), 2),
    "conjugate-offsets": (lambda b, s: dict(positions=torch.tensor([3, 90_000, 5, 1 << 20, 7])), 2),
}


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(BLOCKED))
def test_blocks_of_sequences_cover_every_sequence(monkeypatch, case, dtype, inplace):
    """A call whose single token per sequence already exceeds a block over all sequences is cut into blocks of
    whole sequences (two, two, then one; k's: four, then one), each within the float32 path's tolerance."""
    monkeypatch.setattr(float32_path, "_block_elements", lambda x: 2 * HQ * D)
    factory, tokens = BLOCKED[case]
    q, k = make_qk(5, tokens, HQ, HK, D, dtype=dtype)
    kwargs = factory(5, tokens)
    rotate = ropekit.rope_backward if case.startswith("conjugate") else ropekit.apply_rope
    want = rotate(q.double(), k.double(), **kwargs)
    if inplace and rotate is ropekit.apply_rope:
        got = ropekit.apply_rope_(q, k, **kwargs)
    else:
        got = rotate(q, k, **kwargs)
    for g, w in zip(got, want):
        assert_close_to_ref(g, w, dtype, backend="float32-path")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invalid_positions_make_whole_tokens_nan(dtype):
    """A per-token id past a table, with the tensors' values not read on the host: the token's rotated and
    pass-through columns are NaN, the others exact."""
    from ropekit._validation import validate

    q, k = make_qk(1, 4, 2, 1, 16, dtype=dtype)
    spec = validate(q, k, positions=torch.tensor([[0, 1, 2, 3]]), cos=torch.rand(8, 4), sin=torch.rand(8, 4),
                    rotary_dim=8, q_scale=0.5)
    spec.positions[0, 2] = 100
    q_out, k_out = float32_path.rope_float32(q, k, spec)
    for out in (q_out, k_out):
        assert torch.isnan(out[0, 2]).all() and not torch.isnan(out[0, [0, 1, 3]]).any()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_out_dtype(out_dtype):
    q, k = make_qk(B, S, HQ, HK, D, dtype=torch.float32 if out_dtype == torch.bfloat16 else torch.bfloat16)
    ids = _ids(B, S)
    want = ropekit.apply_rope(q.double(), k.double(), positions=ids)
    got = ropekit.apply_rope(q, k, positions=ids, out_dtype=out_dtype)
    for g, w in zip(got, want):
        assert_close_to_ref(g, w, out_dtype, backend="float32-path")


def test_decode_size_one_token_per_sequence():
    q, k = make_qk(32, 1, HQ, HK, 128, dtype=torch.bfloat16)
    pos = torch.randint(0, 1 << 20, (32, 1))
    want = ropekit.apply_rope(q.double(), k.double(), positions=pos)
    for g, w in zip(ropekit.apply_rope(q, k, positions=pos), want):
        assert_close_to_ref(g, w, torch.bfloat16, backend="float32-path")


@pytest.mark.parametrize("inplace", [False, True])
def test_no_tokens(inplace):
    q, k = make_qk(2, 0, HQ, HK, D, dtype=torch.bfloat16)
    outs = ropekit.apply_rope_(q, k) if inplace else ropekit.apply_rope(q, k)
    assert [o.shape for o in outs] == [q.shape, k.shape]


@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_cos_and_sin_are_rounded_once_from_the_float64_angle_at_any_position(style):
    """A unit q picks one pair's cos and sin out of the float32 tables: each is the float64 angle's cos/sin (the C
    library's, exact to an ulp at any argument) rounded once to float32, up to the largest position, where an
    angle reduced by fmod with the float64 2*pi would be off by up to 2e-7 (about 3 float32 ulps)."""
    positions = torch.tensor([[(1 << 31) - 1, (1 << 30) + 12345, 987_654_321, 7]])
    inv_freq = torch.tensor([1.0, 0.7312, 0.0123, 1e-4], dtype=torch.float64)
    pair = 1  # q is 1 at this pair's lo column and 0 elsewhere
    lo, hi = (pair, pair + 4) if style == "neox" else (2 * pair, 2 * pair + 1)
    q = torch.zeros(1, 4, 1, 8)
    q[..., lo] = 1.0
    out = ropekit.apply_rope(q, positions=positions, inv_freq=inv_freq, style=style)
    angles = [float(p) * float(inv_freq[pair]) for p in positions[0].tolist()]
    want_cos = torch.tensor([math.cos(a) for a in angles], dtype=torch.float64).float()
    want_sin = torch.tensor([math.sin(a) for a in angles], dtype=torch.float64).float()
    assert torch.equal(out[0, :, 0, lo], want_cos) and torch.equal(out[0, :, 0, hi], want_sin)


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("rotate", [ropekit.apply_rope, ropekit.rope_backward], ids=["forward", "conjugate"])
def test_tables_of_many_tokens_match_the_one_product_tables(monkeypatch, style, rotate):
    """Calls of many tokens build the float32 tables by copies and a half-size product instead of the one product
    of decode sizes: both within the float32 path's tolerance of the reference (scales folded in)."""
    q, k = make_qk(B, S, HQ, HK, D, dtype=torch.bfloat16)
    kwargs = dict(positions=_ids(B, S), style=style, q_scale=0.5, rotary_scale=1.25)
    want = rotate(q.double(), k.double(), **kwargs)
    for rows in (1 << 20, 0):  # every call in one product, then none
        monkeypatch.setattr(float32_path, "_ONE_PRODUCT_ROWS", rows)
        for g, w in zip(rotate(q, k, **kwargs), want):
            assert_close_to_ref(g, w, torch.bfloat16, backend="float32-path")


def test_steps_grow_with_threads_except_for_small_16_bit_tensors():
    """Large tensors are rotated in steps that grow with torch's threads; a 16-bit CPU tensor whose float32 copy and
    swapped copy fit the thread's workspace goes in one step; other 16-bit tensors below four such steps keep the
    1 MiB step (whose buffers the workspace holds; on other devices their working copies are fresh memory)."""
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(8)
        step, scaled = float32_path._CHUNK_ELEMENTS, 4 * float32_path._CHUNK_ELEMENTS
        assert float32_path._block_elements(torch.empty(0)) == scaled
        assert float32_path._block_elements(torch.empty(16 * scaled, dtype=torch.bfloat16)) == scaled
        assert float32_path._block_elements(torch.empty(4 * scaled, dtype=torch.bfloat16)) == step
        torch.set_num_threads(1)
        assert float32_path._block_elements(torch.empty(0)) == step
        torch.set_num_threads(2)
        fits = float32_path.WORKSPACE_ELEMENTS // 2
        assert fits > 2 * step  # one step where 1 MiB steps would take several
        assert float32_path._block_elements(torch.empty(fits, dtype=torch.bfloat16)) == fits
        assert float32_path._block_elements(torch.empty(fits, dtype=torch.bfloat16, device="meta")) == step
        assert float32_path._block_elements(torch.empty(fits + 1, dtype=torch.float16)) == step
        assert float32_path._block_elements(torch.empty(fits, dtype=torch.float32)) == step
    finally:
        torch.set_num_threads(previous)


# Calls whose float32 temporaries the workspace holds (ropekit.float32_path._Workspace), by the route they take once a
# plan replays them: (q and k shapes as (B, S, HQ, HK, D), dtype, apply_rope keywords, block elements or None)
WORKSPACE_CALLS = {
    "q-and-k-side-by-side": ((3, 1, 4, 2, 32), torch.bfloat16, dict(), None),
    "q-alone": ((2, 3, 4, 0, 32), torch.float16, dict(style="interleaved"), None),
    "one-step-partial": ((2, 3, 4, 2, 32), torch.bfloat16, dict(rotary_dim=16, q_scale=0.5), None),
    "one-step-to-float32": ((2, 3, 4, 2, 32), torch.float16, dict(rotary_dim=16, rotary_at="back",
                                                                   out_dtype=torch.float32), None),
    "blocks": ((5, 2, 4, 2, 32), torch.bfloat16, dict(style="interleaved"), 2 * 4 * 32),
}


def _workspace_inputs(case: str, seed: int):
    (b, s, hq, hk, d), dtype, kwargs, _ = WORKSPACE_CALLS[case]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=g).to(dtype)
    k = torch.randn(b, s, hk, d, generator=g).to(dtype) if hk else None
    return q, k, dict(kwargs, positions=_ids(b, s) + seed)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("case", sorted(WORKSPACE_CALLS))
def test_outputs_never_alias_the_workspace(monkeypatch, case):
    """A call's outputs are new memory, never the thread's reused float32 workspace: after a second call of the
    same signature on other values (replayed by its plan) the first call's outputs hold what they held, and every
    output lies outside the workspace."""
    monkeypatch.setattr(float32_path, "_WORKSPACE", float32_path._Workspace())  # empty: filled by these calls
    block = WORKSPACE_CALLS[case][3]
    if block is not None:
        monkeypatch.setattr(float32_path, "_block_elements", lambda x: block)
    from helpers import fast_path

    with fast_path(True):
        q, k, kwargs = _workspace_inputs(case, 0)
        for _ in range(3):  # the second call records the plan, the third replays it
            first = _as_tuple(ropekit.apply_rope(q, k, **kwargs))
        kept = [t.clone() for t in first]
        q2, k2, kwargs2 = _workspace_inputs(case, 1)
        second = _as_tuple(ropekit.apply_rope(q2, k2, **kwargs2))
    for got, want in zip(first, kept):
        assert torch.equal(got, want)
    buffer = float32_path._WORKSPACE.buffer
    assert buffer is not None  # the calls used it
    lo, hi = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
    for t in (*first, *second):
        start = t.data_ptr()
        assert start + t.numel() * t.element_size() <= lo or start >= hi
    want = _as_tuple(ropekit.apply_rope(q2.double(), None if k2 is None else k2.double(), **kwargs2))
    for got, expected in zip(second, want):
        assert_close_to_ref(got, expected, got.dtype, backend="float32-path")


def test_workspace_is_per_thread():
    """Two threads rotating tensors of one shape at once, each its own values many times, each get exactly the
    single-threaded result every time: each thread has a workspace of its own."""
    import threading

    from helpers import fast_path

    shapes = [(1, 1, 4, 2, 32), (4, 1, 4, 2, 32), (2, 3, 4, 2, 32)]  # side by side, one by one, interleaved style
    inputs = []
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        inputs.append([(torch.randn(b, s, hq, d, generator=g).to(torch.bfloat16),
                        torch.randn(b, s, hk, d, generator=g).to(torch.bfloat16), _ids(b, s) + 100 * seed)
                       for b, s, hq, hk, d in shapes])
    with fast_path(True):
        want = [[ropekit.apply_rope(q, k, positions=ids) for q, k, ids in calls] for calls in inputs]
        start, failures, buffers = threading.Barrier(2), [], {}

        def work(seed):
            start.wait()
            for _ in range(50):
                for (q, k, ids), expected in zip(inputs[seed], want[seed]):
                    got = ropekit.apply_rope(q, k, positions=ids)
                    if not all(torch.equal(a, b) for a, b in zip(got, expected)):
                        failures.append(seed)
            buffers[seed] = float32_path._WORKSPACE.buffer

        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not failures
    assert buffers[0] is not None and buffers[1] is not None and buffers[0].data_ptr() != buffers[1].data_ptr()


def test_workspace_stays_bounded(monkeypatch):
    """The workspace grows to the largest call that fits its bound and no further: a larger call allocates its own
    temporaries (and still rotates correctly), and the views it keeps are few whatever the number of shapes."""
    # q [3, 1, 4, 32]'s float32 copy and its 16 rotary columns swapped
    monkeypatch.setattr(float32_path, "WORKSPACE_ELEMENTS", 3 * 4 * (32 + 16))
    monkeypatch.setattr(float32_path, "_WORKSPACE", float32_path._Workspace())
    workspace = float32_path._WORKSPACE
    for b in (1, 3, 6, 12, 2):  # q of 6 and 12 tokens exceed the bound
        q, k = make_qk(b, 1, 4, 2, 32, dtype=torch.bfloat16)
        ids = _ids(b, 1)
        got = ropekit.apply_rope(q, k, positions=ids, rotary_dim=16)
        want = ropekit.apply_rope(q.double(), k.double(), positions=ids, rotary_dim=16)
        for g, w in zip(got, want):
            assert_close_to_ref(g, w, torch.bfloat16, backend="float32-path")
        assert workspace.buffer.numel() <= float32_path.WORKSPACE_ELEMENTS
    assert workspace.buffer.numel() == float32_path.WORKSPACE_ELEMENTS  # grown to the largest call that fits
    for d in range(2, 2 * (float32_path._WORKSPACE_VIEWS + 2), 2):  # more shapes than views kept
        ropekit.apply_rope(torch.randn(1, 1, 2, d).to(torch.bfloat16), None, positions=3)
        assert len(workspace.views) <= float32_path._WORKSPACE_VIEWS
