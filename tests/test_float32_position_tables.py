"""The CPU float32 path's per-position tables (``ropekit.float32_path.POSITION_TABLES``): decode-sized calls with
1-D positions take their float32 tables as rows of a window kept per rotation. Every result must equal the full
path's bit for bit (fast path off: tables formed from the call's positions), and the float64 reference within the
tolerance table; calls the windows cannot serve form their own tables as before.
"""

from __future__ import annotations

import pytest
import torch

import ropekit
from helpers import fast_path
from ropekit import _fastpath, float32_path
from ropekit._fastpath.rope import Float32Plan
from ropekit.float32_path import POSITION_TABLES
from ropekit.testing import assert_close_to_ref


@pytest.fixture
def formed(monkeypatch):
    """Counts the calls that formed their own angles (``_tables_of``), and the kept tables' builds and the
    positions they built."""
    counts = {"own": 0, "grown": 0, "rows": 0}
    own, built = float32_path._tables_of, float32_path.PositionTables._built

    def counting_own(*args):
        counts["own"] += 1
        return own(*args)

    def counting_built(spec, scale, D, inv_freq, start, stop):
        counts["grown"] += 1
        counts["rows"] += stop - start
        return built(spec, scale, D, inv_freq, start, stop)

    monkeypatch.setattr(float32_path, "_tables_of", counting_own)
    monkeypatch.setattr(float32_path.PositionTables, "_built", staticmethod(counting_built))
    _fastpath.clear()
    return counts


def window() -> tuple[int, int]:
    """(first position, rows) of the one kept rotation."""
    (start, C, T, *_), = POSITION_TABLES._tables.values()
    assert C.shape[1] == T.shape[1]
    return start, C.shape[1]


def full_path(q, k, **kw):
    with fast_path(False):
        return ropekit.apply_rope(q.clone(), k.clone(), **{n: v.clone() if isinstance(v, torch.Tensor) else v
                                                          for n, v in kw.items()})


def assert_same(got, want, what: str) -> None:
    for name, g, w in zip("qk", got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (what, name)
        assert torch.equal(g, w), f"{what}: {name} differs from the full path"


def decode_positions(kind: str, step: int, batch: int, seqlen: int):
    """Step ``step``'s positions of kind ``kind`` for ``batch`` sequences of ``seqlen`` new tokens."""
    start = 40 + 7 * step
    if kind == "offset":
        return start
    if kind == "shared-ids":  # one row of ids for every sequence
        return (torch.arange(seqlen) + start)[None]
    if kind == "ids":  # each sequence at its own position: rows gathered, not a run
        return torch.arange(batch)[:, None] * 13 + torch.arange(seqlen) + start
    if kind == "seq-offsets":  # [B] per-sequence offsets (the positions, at one token per sequence)
        return torch.arange(batch) * 13 + start
    if kind == "int32-ids":
        return (torch.arange(batch)[:, None] * 5 + torch.arange(seqlen) + start).to(torch.int32)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["offset", "shared-ids", "ids", "seq-offsets", "int32-ids"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("rotary", ["full", "front", "back"])
def test_decode_steps_take_rows_of_the_kept_tables(formed, kind, dtype, style, rotary):
    """Decode steps (new positions every step, several calls a step as a model's layers make) form no angles of
    their own, build the kept tables once, and give the full path's results bit for bit."""
    batch, seqlen = 3, 1 if kind == "seq-offsets" else 2
    D = 16
    kw = dict(base=10000.0, style=style, q_scale=0.5, k_scale=2.0)
    if rotary != "full":
        kw.update(rotary_dim=8, rotary_at=rotary)
    for step in range(6):
        positions = decode_positions(kind, step, batch, seqlen)
        for layer in range(3):
            q = torch.randn(batch, seqlen, 4, D, dtype=torch.float64).to(dtype)
            k = torch.randn(batch, seqlen, 2, D, dtype=torch.float64).to(dtype)
            want = full_path(q, k, positions=positions, **kw)
            formed_before = formed["own"]
            assert_same(ropekit.apply_rope(q, k, positions=positions, **kw), want, f"step {step} layer {layer}")
            assert formed["own"] == formed_before, "a call the kept tables serve formed its own angles"
    assert 1 <= formed["grown"] <= 2  # q's and k's scales: one window each, wide enough for every step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_of_the_kept_tables_match_the_float64_reference(dtype):
    """Against the definition: positions across the tables' growth (a run, gathered ids, one position far out)."""
    g = torch.Generator().manual_seed(5)
    for positions in (3, torch.tensor([[0], [1000], [17]]), torch.tensor([[70000]]), 255, 256):
        batch = positions.shape[0] if isinstance(positions, torch.Tensor) else 2
        q = torch.randn(batch, 1, 4, 64, generator=g, dtype=torch.float64).to(dtype)
        k = torch.randn(batch, 1, 2, 64, generator=g, dtype=torch.float64).to(dtype)
        outs = ropekit.apply_rope(q, k, positions=positions, base=500000.0)
        refs = ropekit.apply_rope(q.double(), k.double(), positions=positions, base=500000.0)
        for out, ref in zip(outs, refs):
            assert_close_to_ref(out, ref, dtype, backend="float32-path")
    assert POSITION_TABLES._tables, "the calls were not served by the kept tables"


def rotate_counted(formed, q, k, **kw) -> tuple[tuple, int]:
    """(apply_rope's outputs, whether the call formed its own angles), checked against the full path's."""
    want = full_path(q, k, **kw)
    before = formed["own"]
    got = ropekit.apply_rope(q, k, **kw)
    assert_same(got, want, str({n: v for n, v in kw.items() if not isinstance(v, torch.Tensor)}))
    return got, formed["own"] - before


def test_windows_grow_by_doubling_and_stay_bounded(formed, monkeypatch):
    """A rotation's window starts at the first call's positions, grows at least twofold towards later calls'
    (up or down), and never past ``max_elements``: a call beyond that forms its own tables, and after
    ``RESTART_MISSES`` such calls in a row the window starts afresh. Positions spanning more than half a window,
    and more than ``max_tokens`` positions, form their own; at most ``max_rotations`` rotations are kept."""
    monkeypatch.setattr(POSITION_TABLES, "max_elements", 4096 * 32)  # 4096 positions of head_dim 16, full rotary
    q, k = torch.randn(1, 1, 2, 16, dtype=torch.bfloat16), torch.randn(1, 1, 1, 16, dtype=torch.bfloat16)
    for position, want in ((5, (5, 256)), (260, (5, 256)), (300, (5, 512)), (2, (0, 517)), (4000, (0, 4001))):
        assert rotate_counted(formed, q, k, positions=position, base=10000.0)[1] == 0
        assert window() == want, position
    for miss in range(POSITION_TABLES.RESTART_MISSES - 1):  # past the bound: the call's own tables, window kept
        assert rotate_counted(formed, q, k, positions=5000 + miss, base=10000.0)[1] == 1
        assert window() == (0, 4001)
    assert rotate_counted(formed, q, k, positions=3000, base=10000.0)[1] == 0  # a hit: the misses start again
    for miss in range(POSITION_TABLES.RESTART_MISSES - 1):
        assert rotate_counted(formed, q, k, positions=5000 + miss, base=10000.0)[1] == 1
    assert rotate_counted(formed, q, k, positions=5010, base=10000.0)[1] == 0
    assert window() == (5010, 256)
    ids = torch.tensor([[10], [2500]])  # a new rotation's positions span more than half a window: its own tables
    assert rotate_counted(formed, torch.randn(2, 1, 2, 16), torch.randn(2, 1, 1, 16), positions=ids,
                          base=20000.0)[1] == 1
    assert len(POSITION_TABLES._tables) == 1
    many = torch.randn(1, POSITION_TABLES.max_tokens + 1, 2, 16, dtype=torch.bfloat16)
    assert rotate_counted(formed, many, many, positions=0, base=10000.0)[1] == 1
    for base in range(1, 12):
        ropekit.apply_rope(q, k, positions=1, base=1e4 * base)
    assert len(POSITION_TABLES._tables) == POSITION_TABLES.max_rotations


def test_more_rotations_taking_turns_than_kept_do_not_rebuild(formed):
    """Rotations taking turns, more than ``max_rotations``: the windows in use stay, the others form their own
    tables; once a set of rotations is no longer used, new ones take their places."""
    q, k = torch.randn(1, 1, 2, 16, dtype=torch.bfloat16), torch.randn(1, 1, 1, 16, dtype=torch.bfloat16)
    kept = POSITION_TABLES.max_rotations
    own = sum(rotate_counted(formed, q, k, positions=100 + step, base=1e4 * (base + 1))[1]
              for step in range(20) for base in range(kept + 2))
    assert formed["grown"] == kept and own == 2 * 20
    old = set(POSITION_TABLES._tables)
    for step in range(2 * kept + 1):  # the first rotations no longer used: new ones replace them
        ropekit.apply_rope(q, k, positions=100 + step, base=5e5 + step % 2)
    assert len(old - set(POSITION_TABLES._tables)) == 2


def test_two_streams_far_apart_taking_turns_do_not_rebuild(formed, monkeypatch):
    """Two decode streams farther apart than a window (two requests sharing a model, taking turns): one keeps the
    window, the other forms its own tables, and no window is rebuilt on every call."""
    monkeypatch.setattr(POSITION_TABLES, "max_elements", 4096 * 32)
    q, k = torch.randn(1, 1, 2, 16, dtype=torch.bfloat16), torch.randn(1, 1, 1, 16, dtype=torch.bfloat16)
    for step in range(50):
        for start in (100, 20000):
            rotate_counted(formed, q, k, positions=start + step, base=10000.0)
    assert formed["grown"] <= 2 and window()[0] == 100


def test_the_windows_together_stay_within_four_windows(monkeypatch):
    monkeypatch.setattr(POSITION_TABLES, "max_elements", 4096 * 32)
    q = torch.randn(2, 1, 2, 16)
    for base in range(1, 8):  # seven rotations, each a full window (4096 positions, twice the span)
        ropekit.apply_rope(q, positions=torch.tensor([[0], [1500]]), base=1e4 * base)
    total = sum(C.numel() + T.numel() for _, C, T, *_ in POSITION_TABLES._tables.values())
    assert total == 4 * POSITION_TABLES.max_elements and len(POSITION_TABLES._tables) == 4


def test_a_plan_keeps_its_rows_not_the_window(monkeypatch):
    """A plan's kept tables are the call's rows, not views holding a whole window alive after it moved on."""
    _fastpath.clear()  # this call's plan alone (earlier tests' plans may remain)
    q, k = torch.randn(1, 1, 2, 16, dtype=torch.bfloat16), torch.randn(1, 1, 1, 16, dtype=torch.bfloat16)
    for position in range(5):
        ropekit.apply_rope(q, k, positions=position, base=10000.0)
    (plan,) = [p for p in _fastpath.plans._PLANS.values() if isinstance(p, Float32Plan)]
    for _, _, made in plan.last:
        for t in (t for tables in made.values() for t in tables):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_decode_after_a_long_prompt_builds_rows_in_proportion_to_its_steps(formed):
    """Decode from position 4096 on, one position a step: the window starts at the prompt's end, not at 0, and
    the rows built stay within twice the steps (at least the first window's 256)."""
    q, k = torch.randn(1, 1, 2, 16, dtype=torch.bfloat16), torch.randn(1, 1, 1, 16, dtype=torch.bfloat16)
    for step in range(600):
        ropekit.apply_rope(q, k, positions=4096 + step, base=10000.0)
    assert formed["own"] == 0 and window()[0] == 4096
    assert formed["rows"] <= max(2 * 600, 256) and formed["grown"] <= 3


def test_refused_positions_and_other_frequencies(formed):
    """A negative position raises as before and leaves the tables as they were; cos/sin tables and multi-axis
    positions are not the kept tables' calls (they form their own)."""
    q, k = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 1, 16)
    ropekit.apply_rope(q, k, positions=torch.tensor([[3], [4]]), base=10000.0)
    kept = {key: (start, C.clone(), T.clone()) for key, (start, C, T, *_) in POSITION_TABLES._tables.items()}
    with pytest.raises(IndexError, match="positions must be >= 0"):
        ropekit.apply_rope(q, k, positions=torch.tensor([[3], [-1]]), base=10000.0)
    assert kept.keys() == POSITION_TABLES._tables.keys()
    for key, (start, C, T) in kept.items():
        now = POSITION_TABLES._tables[key]
        assert start == now[0] and torch.equal(C, now[1]) and torch.equal(T, now[2])
    POSITION_TABLES.clear()
    cos, sin = torch.rand(32, 8), torch.rand(32, 8)
    assert rotate_counted(formed, q, k, positions=torch.tensor([[3], [4]]), cos=cos, sin=sin)[1] == 1
    assert rotate_counted(formed, q, k, positions=torch.randint(0, 9, (3, 2, 1)), base=10000.0,
                          sections=(2, 3, 3))[1] == 1
    assert not POSITION_TABLES._tables


def test_frequencies_are_compared_by_value_and_off_with_the_fast_path(formed):
    """inv_freq changed in place (through numpy: no new tensor, no version) gets its own window; with the fast
    path off no window is kept."""
    inv_freq = torch.rand(8)
    q, k = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 1, 16)
    for _ in range(3):
        assert rotate_counted(formed, q, k, positions=9, inv_freq=inv_freq)[1] == 0
    inv_freq.numpy()[0] += 0.5
    assert rotate_counted(formed, q, k, positions=9, inv_freq=inv_freq)[1] == 0
    assert len(POSITION_TABLES._tables) == 2
    POSITION_TABLES.clear()
    with fast_path(False):
        for position in range(3):
            ropekit.apply_rope(q, positions=position, base=10000.0)
    assert not POSITION_TABLES._tables


def test_tables_built_under_inference_mode_serve_later_calls():
    """Built under torch.inference_mode, the kept tables are normal tensors: later calls outside it read them, in
    place, out of place and with autograd."""
    q = torch.randn(1, 1, 2, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        ropekit.apply_rope(q, positions=7, base=10000.0)
    assert not any(t.is_inference() for _, C, T, *_ in POSITION_TABLES._tables.values() for t in (C, T))
    x = q.clone()
    ropekit.apply_rope_(x, positions=7, base=10000.0)
    assert torch.equal(x, ropekit.apply_rope(q, positions=7, base=10000.0))
    leaf = q.clone().requires_grad_()
    out = ropekit.apply_rope(leaf, positions=7, base=10000.0)
    assert torch.equal(out.detach(), x)
    (grad,) = torch.autograd.grad(out, leaf, torch.ones_like(out))
    assert torch.equal(grad, ropekit.rope_backward(torch.ones_like(q), positions=7, base=10000.0))
