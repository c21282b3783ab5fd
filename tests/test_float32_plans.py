"""Differential test of the CPU float32 path's fast path: plans (``ropekit._fastpath.rope.Float32Plan``, which
skip validation for a repeated call signature) and kept tables (``ropekit.float32_path.RECENT_TABLES`` and a
plan's own last tables, which skip forming angles when positions and frequencies hold the same values).

A seeded grid over layouts, pairings, position modes (none, int offset, 0-d tensor, ids, one row of ids,
per-sequence offsets, multi-axis), frequency sources, partial rotary, scales, dtypes, packed-QKV views, and out of
place / in place / the explicit backward. Every case is called with fresh values, then with the same values, then
with its positions changed in place behind autograd's back (through numpy), and each result must equal bit for
bit what the full path (fast path off: validation, no kept tables) gives for the same call. Calls the full path
refuses are refused the same way after a plan exists, and leave in-place inputs untouched.
"""

from __future__ import annotations

import random

import pytest
import torch

import ropekit
from helpers import fast_path
from ropekit import _fastpath, float32_path
from ropekit._fastpath.rope import Float32Plan

SHAPE = (2, 5, 4, 2, 16)  # B, S, HQ, HK, D
ROWS = 128  # cos/sin/angle table rows: past every position the grid draws
NUM_CASES = 60


@pytest.fixture
def served(monkeypatch):
    """Counts calls a Float32Plan served (returned outputs); plans and kept tables start empty."""
    counter = {"served": 0}
    original = Float32Plan.__call__

    def counting(self, *args):
        out = original(self, *args)
        counter["served"] += out is not None
        return out

    monkeypatch.setattr(Float32Plan, "__call__", counting)
    _fastpath.clear()
    float32_path.RECENT_TABLES.clear()
    return counter


def random_case(rng: random.Random) -> dict:
    layout = rng.choice(["bshd", "bhsd", "sbhd", "thd"])
    pos = rng.choice(["none", "offset", "offset-tensor", "ids"] +
                     ([] if layout == "thd" else ["ids-row", "seqoff", "multi-axis"]))
    freqs = ["base", "inv_freq"] + ([] if pos == "multi-axis" else ["table", "angles"])
    return dict(layout=layout, style=rng.choice(["neox", "interleaved"]), pos=pos, freq=rng.choice(freqs),
                partial=rng.choice(["full", "full", "front", "back"]),
                scales=rng.choice([(1.0, 1.0, 1.0), (0.125, 2.0, 1.0), (0.5, 0.75, 0.9)]),
                dtype=rng.choice([torch.float32, torch.bfloat16, torch.float16]),
                with_k=rng.random() < 0.85, packed=rng.random() < 0.4,
                mode=rng.choice(["out", "out", "inplace", "backward"]))


def make_inputs(case: dict, g: torch.Generator) -> tuple:
    """q and k in the case's layout: separate tensors, or strided views of one packed QKV buffer."""
    B, S, HQ, HK, D = SHAPE
    dims = {"bshd": (B, S, None, D), "bhsd": (B, None, S, D), "sbhd": (S, B, None, D), "thd": (B * S, None, D)}
    head_axis = dims[case["layout"]].index(None)

    def sized(h):
        return tuple(h if d is None else d for d in dims[case["layout"]])

    def draw(h):
        return torch.randn(sized(h), generator=g, dtype=torch.float64).to(case["dtype"])

    hk = HK if case["with_k"] else 0
    if case["packed"]:
        buf = draw(HQ + 2 * hk)
        return buf.narrow(head_axis, 0, HQ), (buf.narrow(head_axis, HQ, hk) if hk else None)
    return draw(HQ), (draw(HK) if hk else None)


def make_kwargs(case: dict, g: torch.Generator) -> dict:
    """The call's keyword arguments: fresh tensors with fresh values."""
    B, S, HQ, HK, D = SHAPE
    R = D if case["partial"] == "full" else D // 2
    q_scale, k_scale, rotary_scale = case["scales"]
    kw: dict = dict(style=case["style"], layout=case["layout"], q_scale=q_scale, k_scale=k_scale,
                    rotary_scale=rotary_scale)
    if case["partial"] != "full":
        kw.update(rotary_dim=R, rotary_at=case["partial"])
    thd, pos = case["layout"] == "thd", case["pos"]
    if pos == "offset":
        kw["positions"] = int(torch.randint(0, 60, (), generator=g))
    elif pos == "offset-tensor":
        kw["positions"] = torch.randint(0, 60, (), generator=g)
    elif pos == "seqoff":
        kw["positions"] = torch.randint(0, 60, (B,), generator=g)
    elif pos in ("ids", "ids-row"):
        ids = torch.randint(0, 100, (1 if pos == "ids-row" or thd else B, B * S if thd else S), generator=g)
        kw["positions"] = ids[0] if thd else ids
    elif pos == "multi-axis":
        kw["positions"] = torch.randint(0, 100, (3, B, S), generator=g)
        kw["sections"] = (2, 3, 3) if R == D else (1, 1, 2)
    if case["freq"] == "base":
        kw["base"] = 500000.0
    elif case["freq"] == "inv_freq":
        kw["inv_freq"] = torch.rand(R // 2, generator=g)
    elif case["freq"] == "table":
        kw["cos"], kw["sin"] = torch.randn(ROWS, R // 2, generator=g), torch.randn(ROWS, R // 2, generator=g)
    else:
        kw["angles"] = torch.rand(ROWS, R // 2, generator=g) * 100
    return kw


def call(case: dict, q, k, kw: dict):
    """The case's public call; returns its outputs (q itself and k for in place) as a tuple."""
    if case["mode"] == "backward":
        outs = ropekit.rope_backward(q, k, **kw)
    elif case["mode"] == "inplace":
        outs = ropekit.apply_rope_(q, k, **kw)
    else:
        outs = ropekit.apply_rope(q, k, **kw)
    return (outs,) if k is None else tuple(outs)


def copies(q, k, kw: dict) -> tuple:
    """Independent copies of a call's tensors (the packed buffer's views stay views of one new buffer)."""
    if k is not None and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr():
        base = q._base if q._base is not None else q
        twin = base.clone()
        view = lambda t: twin.as_strided(t.shape, t.stride(), t.storage_offset())  # noqa: E731
        q2, k2 = view(q), view(k)
    else:
        q2, k2 = q.clone(), (None if k is None else k.clone())
    return q2, k2, {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in kw.items()}


def full_path(case: dict, q, k, kw: dict) -> tuple:
    with fast_path(False):
        return call(case, *copies(q, k, kw))


def assert_same(got: tuple, want: tuple, what: str) -> None:
    for name, g, w in zip("qk", got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride(), (what, name)
        assert torch.equal(g, w), f"{what}: {name} differs from the full path"


def test_plans_and_kept_tables_equal_the_full_path(served):
    rng = random.Random(20261129)
    failures, planned = [], 0
    for index in range(NUM_CASES):
        case = random_case(rng)
        g = torch.Generator().manual_seed(index)
        _fastpath.clear()
        served["served"] = 0
        try:
            for step in range(4):  # the full path notes, then records, then two replays; fresh values each
                q, k = make_inputs(case, g)
                kw = make_kwargs(case, g)
                want = full_path(case, q, k, kw)
                assert_same(call(case, q, k, kw), want, f"call {step}")
            # the same values again (kept tables), then positions changed in place without autograd seeing it
            q, k = make_inputs(case, g)
            want = full_path(case, q, k, kw)
            assert_same(call(case, q, k, kw), want, "same values")
            positions = kw.get("positions")
            if isinstance(positions, torch.Tensor):
                positions.numpy()[...] = (positions.numpy() + 7) % 100  # no version bump: compared by value
                q, k = make_inputs(case, g)
                want = full_path(case, q, k, kw)
                assert_same(call(case, q, k, kw), want, "positions changed through numpy")
        except AssertionError as e:
            failures.append(f"case {index} {case}: {e}")
            continue
        if served["served"] < 3:
            failures.append(f"case {index} {case}: plans served only {served['served']} calls")
        planned += served["served"]
    assert not failures, "\n".join(failures[:5]) + f"\n({len(failures)} failing cases)"
    assert planned >= 3 * NUM_CASES


@pytest.fixture
def no_position_tables(monkeypatch):
    """The kept tables of the plans and of RECENT_TABLES alone: decode calls with 1-D positions otherwise take
    rows of the per-position tables (tests/test_float32_position_tables.py), and would form no angles at all."""
    monkeypatch.setattr(float32_path.POSITION_TABLES, "max_elements", 0)


def test_a_model_forms_its_angles_once_per_step(served, monkeypatch, no_position_tables):
    """Layers of one forward share a positions tensor: the angles are formed once per step, for the first
    layer, and every later layer reuses the tables -- with or without a plan."""
    built = []
    original = float32_path._tables_of
    monkeypatch.setattr(float32_path, "_tables_of", lambda *a: built.append(1) or original(*a))
    layers, steps = 3, 4
    for step in range(steps):
        positions = torch.full((2, 1), 30 + step)  # a new tensor every decode step, as generate() makes
        for _ in range(layers):
            q, k = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16), torch.randn(2, 1, 2, 16, dtype=torch.bfloat16)
            ropekit.apply_rope(q, k, positions=positions)
    assert len(built) == steps
    assert served["served"] > 0


def test_kept_tables_are_bounded_and_off_with_the_fast_path(monkeypatch, no_position_tables):
    built = []
    original = float32_path._tables_of
    monkeypatch.setattr(float32_path, "_tables_of", lambda *a: built.append(1) or original(*a))
    q = torch.randn(1, 3, 2, 8)
    kept = float32_path.RECENT_TABLES
    for offset in range(kept.size + 3):
        ropekit.apply_rope(q, positions=offset)
    assert len(kept._entries) == kept.size
    with fast_path(False):
        built.clear()
        for _ in range(3):
            ropekit.apply_rope(q, positions=1)
        assert len(built) == 3


@pytest.mark.parametrize("bad", ["negative", "past-table", "past-offset-table"])
@pytest.mark.parametrize("inplace", [False, True])
def test_replayed_calls_refuse_what_the_full_path_refuses(served, bad, inplace):
    """After a plan exists, a call with a position the full path refuses raises its error and writes nothing."""
    cos, sin = torch.rand(16, 4), torch.rand(16, 4)
    good = dict(positions=torch.tensor([[1, 2, 3]]), cos=cos, sin=sin)
    if bad == "past-offset-table":
        good = dict(positions=3, cos=cos, sin=sin)
    rotate = ropekit.apply_rope_ if inplace else ropekit.apply_rope
    for _ in range(3):
        rotate(torch.randn(1, 3, 2, 8, dtype=torch.bfloat16), positions=good["positions"], cos=cos, sin=sin)
    assert served["served"] >= 1
    wrong = {"negative": torch.tensor([[1, -2, 3]]), "past-table": torch.tensor([[1, 2, 16]]),
             "past-offset-table": 14}[bad]
    q = torch.randn(1, 3, 2, 8, dtype=torch.bfloat16)
    before = q.clone()
    with fast_path(False), pytest.raises((IndexError, ValueError)) as want:
        rotate(q.clone(), positions=wrong, cos=cos, sin=sin)
    with pytest.raises(type(want.value), match=str(want.value).split(",")[0]):
        rotate(q, positions=wrong, cos=cos, sin=sin)
    assert torch.equal(q, before)


@pytest.mark.parametrize("positions", ["ids", "offset"])
@pytest.mark.parametrize("tokens", [1, 300])  # kept by the plan, and only by RECENT_TABLES (too many for a plan)
def test_positions_taking_turns_keep_their_tables(served, monkeypatch, no_position_tables, positions, tokens):
    """Calls of one signature whose positions take turns (a forward's later layers between next steps' first
    layers) each find their own tables again: the angles of each set are formed once."""
    built = []
    original = float32_path._tables_of
    monkeypatch.setattr(float32_path, "_tables_of", lambda *a: built.append(1) or original(*a))
    q, k = torch.randn(tokens, 1, 4, 16, dtype=torch.bfloat16), torch.randn(tokens, 1, 2, 16, dtype=torch.bfloat16)
    sets = [torch.full((tokens, 1), 30), torch.full((tokens, 1), 31)] if positions == "ids" else [30, 31]
    wants = [full_path(dict(mode="out"), q, k, dict(positions=p)) for p in sets]
    built.clear()
    for _ in range(4):
        for p, want in zip(sets, wants):
            assert_same(call(dict(mode="out"), q, k, dict(positions=p)), want, "turns")
    assert len(built) == 2
    assert served["served"] > 0


@pytest.mark.parametrize("positions", ["ids", "offset"])
def test_positions_used_again_outlive_positions_seen_once(served, monkeypatch, no_position_tables, positions):
    """A forward's later layers (the same positions every call) between first layers whose positions are new
    every call (the bench's turn-taking, or two models decoding in turn): the shared set's tables are looked up
    once, since a plan keeps its most recently used tables, not its most recently formed."""
    q, k = torch.randn(1, 1, 4, 16, dtype=torch.bfloat16), torch.randn(1, 1, 2, 16, dtype=torch.bfloat16)
    shared = torch.full((1, 1), 30) if positions == "ids" else 30
    new_sets = [torch.full((1, 1), 100 + i) if positions == "ids" else 100 + i for i in range(8)]
    want = full_path(dict(mode="out"), q, k, dict(positions=shared))
    built = []  # calls that looked their tables up (and formed them, or found them in RECENT_TABLES)
    original = float32_path.float32_tables
    monkeypatch.setattr(float32_path, "float32_tables", lambda *a: built.append(1) or original(*a))
    for new in new_sets:
        call(dict(mode="out"), q, k, dict(positions=new))
        assert_same(call(dict(mode="out"), q, k, dict(positions=shared)), want, "shared")
    assert len(built) - len(new_sets) <= 2  # the shared set's: at most its first two calls (note, record)
    assert served["served"] > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("batch", [1, 3])  # one token: one product and sum for q and k; more: one each
@pytest.mark.parametrize("k_scale", [1.0, 0.5])  # one table for both, or one each
def test_q_and_k_side_by_side_equal_the_full_path(served, monkeypatch, dtype, style, batch, k_scale):
    """Replayed 16-bit decode calls rotate q and k side by side in one float32 workspace copy
    (``float32_path.rotated_copies``): bit for bit the full path's outputs, in contiguous new tensors."""
    joint = []
    original = float32_path.rotated_copies
    monkeypatch.setattr(float32_path, "rotated_copies", lambda *a: joint.append(1) or original(*a))
    g = torch.Generator().manual_seed(batch)
    for step in range(4):
        q = torch.randn(batch, 1, 4, 16, generator=g).to(dtype)
        k = torch.randn(batch, 1, 2, 16, generator=g).to(dtype)
        kw = dict(positions=torch.randint(0, 1000, (batch, 1), generator=g), style=style, k_scale=k_scale)
        assert_same(call(dict(mode="out"), q, k, kw), full_path(dict(mode="out"), q, k, kw), f"call {step}")
    assert len(joint) == 2  # the two replays
