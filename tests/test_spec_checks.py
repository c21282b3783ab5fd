"""Validation of apply_rope's arguments (ropekit._spec): errors that name the argument at fault and say what was
expected (on every call, plans or not), 0-d integer tensors as position offsets, per-sequence offsets and cu_seqlens
given as strided views, position checks that cannot be fooled by int64 wrap-around, device positions past the largest
supported one turning their tokens NaN, and ``check_positions=True`` on CUDA.

Routes: "cpu" (the float64 path; CPU tensors are host values), "cpu-kernels" (the kernels under the Triton
interpreter, launch plans included, with the semantics of device tensors) and "cuda"."""

from __future__ import annotations

import pytest
import torch

import ropekit
from helpers import ROUTES, on_route, route_context, route_device
from ropekit.testing import assert_close_to_ref, kernel_backend, make_qk


def _backend(route: str) -> str:
    return "cpu" if route == "cpu" else kernel_backend()


def _reference(q, k, **kw):
    """The float64 path on float64 copies: the values every route must give."""
    kw = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    return ropekit.apply_rope(q.cpu().double(), k.cpu().double(), **kw)


# --- errors that name the argument ----------------------------------------------------------------------------

WIDTH_ERRORS = [
    # (id, keywords for q [.., D=16], argument named, expected widths quoted)
    ("cos too wide", dict(cos=torch.rand(8, 10), sin=torch.rand(8, 10)), "cos", "head_dim/2 = 8.*head_dim = 16"),
    ("cos empty", dict(cos=torch.rand(8, 0), sin=torch.rand(8, 0)), "cos", "head_dim/2 = 8"),
    ("cos per-token too wide", dict(cos=torch.rand(1, 3, 12), sin=torch.rand(1, 3, 12)), "cos", "head_dim = 16"),
    ("angles too wide", dict(angles=torch.rand(8, 9)), "angles", "head_dim/2 = 8"),
    ("inv_freq too long", dict(inv_freq=torch.rand(10)), "inv_freq", "head_dim/2 = 8"),
    ("inv_freq empty", dict(inv_freq=torch.rand(0)), "inv_freq", "head_dim/2 = 8"),
    ("sin of another width", dict(cos=torch.rand(8, 8), sin=torch.rand(8, 4)), "sin", "rotary_dim/2 = 8"),
    ("inv_freq against rotary_dim", dict(inv_freq=torch.rand(4), rotary_dim=4), "inv_freq", "rotary_dim/2 = 2"),
]


@pytest.mark.parametrize("kw, name, expected", [c[1:] for c in WIDTH_ERRORS], ids=[c[0] for c in WIDTH_ERRORS])
def test_frequency_sources_of_the_wrong_width_are_named(kw, name, expected):
    """A cos/sin/angles table or inv_freq of a width no rotary_dim fits: the error names it (not rotary_dim, which
    the caller did not give) and says which widths fit."""
    q, k = torch.randn(1, 3, 2, 16), torch.randn(1, 3, 1, 16)
    with pytest.raises(ValueError, match=rf"^{name}\b.*{expected}") as err:
        ropekit.apply_rope(q, k, **kw)
    assert "rotary_dim must be" not in str(err.value)


@pytest.mark.parametrize("layout, shape", [("bshd", (3, 2, 5)), ("bshd", (2, 1, 5)), ("thd", (3, 5))])
def test_multi_axis_positions_without_sections_say_sections_are_needed(layout, shape):
    q = torch.randn(5, 2, 16) if layout == "thd" else torch.randn(2, 5, 2, 16)
    with pytest.raises(ValueError, match="positions.*sections="):
        ropekit.apply_rope(q, positions=torch.randint(0, 9, shape), layout=layout)


# --- 0-d integer tensors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", ["bshd-B2", "bshd-B1", "thd-cu_seqlens", "thd"])
def test_zero_dim_positions_are_an_offset(route, case):
    """``positions=torch.tensor(p)`` rotates as ``positions=p``: on the host it is read as the int; a device scalar
    (the kernel route) is every sequence's offset, read by the kernel -- a new value on every call, so that a
    launch plan recorded for one value replays the next."""
    device = route_device(route)
    kw = {}
    if case.startswith("thd"):
        q, k = torch.randn(7, 2, 16, device=device), torch.randn(7, 1, 16, device=device)
        kw["layout"] = "thd"
        if case == "thd-cu_seqlens":
            kw["cu_seqlens"] = torch.tensor([0, 3, 7], device=device)
    else:
        B = int(case[-1])
        q, k = torch.randn(B, 3, 2, 16, device=device), torch.randn(B, 3, 1, 16, device=device)
    with route_context(route):
        for p in (5, 900, 3, 70000):
            got = ropekit.apply_rope(q, k, positions=torch.tensor(p, device=device), **kw)
            for g, w in zip(got, _reference(q, k, positions=p, **kw)):
                assert_close_to_ref(g, w, torch.float32, _backend(route))


@pytest.mark.parametrize("route", ROUTES)
def test_zero_dim_positions_are_checked_like_an_offset(route):
    device = route_device(route)
    q = torch.randn(2, 3, 2, 16, device=device)
    with route_context(route):
        with pytest.raises(TypeError, match="positions"):
            ropekit.apply_rope(q, positions=torch.tensor(5.0, device=device))
        with pytest.raises(ValueError, match="positions.*int\\(positions\\)"):
            ropekit.apply_rope(q, positions=torch.empty((), dtype=torch.int64, device="meta"))
        check = dict(check_positions=True) if route != "cpu" else {}
        with pytest.raises((ValueError, IndexError), match="positions"):
            ropekit.apply_rope(q, positions=torch.tensor(-1, device=device), **check)
        table = dict(cos=torch.rand(8, 8, device=device), sin=torch.rand(8, 8, device=device))
        with pytest.raises(IndexError, match="positions"):  # positions 6, 7, 8 of a table of 8 rows
            ropekit.apply_rope(q, positions=torch.tensor(6, device=device), **table, **check)


# --- strided per-sequence offsets and cu_seqlens ----------------------------------------------------------------

@pytest.mark.parametrize("route", ROUTES)
def test_strided_per_sequence_offsets_and_cu_seqlens(route):
    """Per-sequence offsets and cu_seqlens given as strided or expanded views mean what their values say (the
    kernels index both densely, so they read dense copies)."""
    device = route_device(route)
    with route_context(route):
        for _ in range(3):  # plans from the second call on
            q, k = torch.randn(3, 4, 2, 16, device=device), torch.randn(3, 4, 1, 16, device=device)
            for offsets in (torch.tensor([0, 100, 5, 200, 9, 7], device=device)[::2],
                            torch.tensor([7], device=device).expand(3)):
                got = ropekit.apply_rope(q, k, positions=offsets)
                for g, w in zip(got, _reference(q, k, positions=offsets.contiguous())):
                    assert_close_to_ref(g, w, torch.float32, _backend(route))
            q, k = torch.randn(9, 2, 16, device=device), torch.randn(9, 1, 16, device=device)
            cu = torch.tensor([0, -1, 3, -1, 7, -1, 9], device=device)[::2]
            offsets = torch.tensor([10, 0, 20, 0, 30, 0], device=device)[::2]
            for positions in (offsets, 4):
                got = ropekit.apply_rope(q, k, positions=positions, cu_seqlens=cu, layout="thd")
                want = _reference(q, k, positions=positions if isinstance(positions, int) else positions.contiguous(),
                                  cu_seqlens=cu.contiguous(), layout="thd")
                for g, w in zip(got, want):
                    assert_close_to_ref(g, w, torch.float32, _backend(route))


# --- wrap-around ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("offset", [2**63 - 2, 2**63 - 1, 2**62 + 5])
@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd-cu_seqlens"])
def test_offsets_near_int64_max_raise(route, offset, packed):
    """Per-sequence offsets whose offset + S - 1 passes 2**63 - 1 (and wraps around in int64) raise ValueError
    naming positions where the values are read (CPU tensors; check_positions=True on the kernel routes)."""
    device = route_device(route)
    check = dict(check_positions=True) if route != "cpu" else {}
    if packed:
        q = torch.randn(7, 2, 16, device=device)
        kw = dict(layout="thd", cu_seqlens=torch.tensor([0, 3, 7], device=device))
    else:
        q, kw = torch.randn(2, 4, 2, 16, device=device), {}
    with route_context(route), pytest.raises(ValueError, match="positions"):
        ropekit.apply_rope(q, positions=torch.tensor([0, offset], device=device), **kw, **check)


@pytest.mark.parametrize("mode", ROUTES)
def test_device_positions_past_the_largest_become_nan(mode):
    """Values the host cannot read without a sync: the kernel marks the tokens NaN (never a wrong number)."""
    if mode == "cpu":
        pytest.skip("CPU position tensors are read on the host and raise (tests/test_api.py)")
    with on_route(mode, clear_plans=True) as device:
        q = torch.randn(1, 4, 2, 8, device=device)
        ids = torch.tensor([[0, 2**31 - 1, 2**31, 2**62]], device=device)
        out = ropekit.apply_rope(q, positions=ids)
        assert not out[0, :2].isnan().any() and out[0, 2:].isnan().all()


@pytest.mark.parametrize("mode", ROUTES)
def test_unhashable_argument_gets_the_validation_error_on_every_call(mode):
    with on_route(mode, clear_plans=True) as device:
        q = torch.randn(1, 4, 2, 8, device=device)
        for _ in range(3):
            with pytest.raises(ValueError, match="layout must be one of"):
                ropekit.apply_rope(q, layout=["bshd"])


@pytest.mark.gpu
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
