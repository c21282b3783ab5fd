"""rope_kv_write refuses what it cannot write, before anything is written: positions past the caches' rows however
they are given (per-token, per-sequence offsets, an int offset, with or without packed sequences), v on another
device, float8 cache scales that are not finite and positive -- wherever the values are on the host (ints, CPU
tensors, or ``check_positions=True``). A token whose device-resident position is invalid writes nothing (its rows
keep their bytes); caches that share memory with each other or with an input, and inference tensors outside
inference mode, are refused.

Routes: "cpu" (the float64 path; CPU tensors are host values), "cpu-kernels" (the kernels under the Triton
interpreter, with the semantics of device tensors: their values are read only with ``check_positions=True``) and
"cuda"."""

from __future__ import annotations

import contextlib

import pytest
import torch

import ropekit
from helpers import INTERPRETED, ROUTES, route_context, route_device
from ropekit import _fastpath
from ropekit.testing import kernels_on_cpu

FP8 = torch.float8_e4m3fn
HQ, HK, D, ROWS = 2, 1, 8, 8


def _poisoned(shape, dtype=torch.float32, device="cpu"):
    if dtype == FP8:
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(FP8)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _bits(x: torch.Tensor) -> torch.Tensor:
    sizes = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return x.detach().cpu().contiguous().view(sizes[x.element_size()])


def _assert_refused(exc, match, args: list, kw: dict) -> None:
    """``rope_kv_write(*args, **kw)`` raises ``exc`` matching ``match``, and no tensor it was given changed."""
    tensors = [t for t in (*args, *kw.values()) if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    before = [_bits(t).clone() for t in tensors]
    with torch.no_grad(), pytest.raises(exc, match=match):
        ropekit.rope_kv_write(*args, **kw)
    for t, b in zip(tensors, before):
        assert torch.equal(_bits(t), b), "a tensor changed although the call raised"


def _inputs4(B, S, device, dtype=torch.float32):
    return [torch.randn(B, S, h, D, dtype=dtype, device=device) for h in (HQ, HK, HK)]


def _inputs3(T, device, dtype=torch.float32):
    return [torch.randn(T, h, D, dtype=dtype, device=device) for h in (HQ, HK, HK)]


def _rows_caches(n, device, dtype=torch.float32, layout="bshd"):
    shape = (n, HK, ROWS, D) if layout == "bhsd" else (n, ROWS, HK, D)
    return [_poisoned(shape, dtype, device) for _ in range(2)]


def _check_kw(route: str) -> dict:
    """On the kernel routes, device semantics: values are read only when asked (check_positions=True)."""
    return dict(check_positions=True) if route != "cpu" else {}


# (id, inputs: 4-D [B, S] or packed 3-D with cu_seqlens, positions, cu_seqlens)
PAST_THE_ROWS = [
    ("per-sequence offsets [B]", (2, 3), [0, 6], None),
    ("per-sequence offsets [B], one past", (2, 3), [6, 5], None),
    ("int offset", (2, 3), 6, None),
    ("per-token positions", (2, 3), [[0, 1, 2], [5, 6, 8]], None),
    ("packed, per-sequence offsets", 5, [0, 6], [0, 2, 5]),
    ("packed, int offset", 5, 6, [0, 2, 5]),
    ("packed, int offset, empty sequence", 5, 6, [0, 0, 2, 5]),
    ("packed, per-token positions", 5, [0, 1, 6, 7, 8], [0, 2, 5]),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("shape, positions, cu_seqlens", [c[1:] for c in PAST_THE_ROWS],
                         ids=[c[0] for c in PAST_THE_ROWS])
def test_positions_past_the_rows_raise_before_writing(route, layout, shape, positions, cu_seqlens):
    """Every token whose position is a row past the caches' ``max_seq`` raises IndexError naming positions -- also
    for per-sequence offsets (the last token of a sequence is at offset + length - 1) and for packed sequences."""
    device = route_device(route)
    with route_context(route):
        if cu_seqlens is None:
            B, S = shape
            q, k, v = _inputs4(B, S, device)
            if layout == "bhsd":
                q, k, v = (x.transpose(1, 2) for x in (q, k, v))
            n = B
        else:
            q, k, v = _inputs3(shape, device)
            n = len(cu_seqlens) - 1
        kw = dict(positions=torch.tensor(positions, device=device) if isinstance(positions, list) else positions,
                  cache_layout=layout, **_check_kw(route))
        if layout == "bhsd" and cu_seqlens is None:
            kw["layout"] = "bhsd"
        if cu_seqlens is not None:
            kw["cu_seqlens"] = torch.tensor(cu_seqlens, device=device)
        _assert_refused(IndexError, "positions", [q, k, v, *_rows_caches(n, device, layout=layout)], kw)


@pytest.mark.parametrize("route", ROUTES)
def test_packed_sequences_that_fit_are_written(route):
    """Packed sequences whose tokens together outnumber the rows but each fit (int offset and per-sequence
    offsets): written, not refused."""
    device = route_device(route)
    with route_context(route), torch.no_grad():
        q, k, v = _inputs3(10, device)
        cu = torch.tensor([0, 5, 10], device=device)
        for positions in (3, torch.tensor([3, 0], device=device)):
            k_cache, v_cache = _rows_caches(2, device)
            ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=positions, cu_seqlens=cu,
                                  **_check_kw(route))
            first = 3 if isinstance(positions, int) else 0
            assert torch.equal(v_cache[0, 3:8], v[:5]) and torch.equal(v_cache[1, first:first + 5], v[5:])


@pytest.mark.parametrize("route", ROUTES)
def test_int_offset_replays_refuse_offsets_past_the_rows(route):
    """Calls of one signature with an int offset (the third replays a plan on the kernel route): an offset whose
    last token passes the rows raises on every call, with nothing written."""
    device = route_device(route)
    with route_context(route), torch.no_grad():
        q, k, v = _inputs4(2, 3, device)
        caches = _rows_caches(2, device)
        for offset in (0, 4, 5):
            ropekit.rope_kv_write(q, k, v, *caches, positions=offset)
        for _ in range(2):
            _assert_refused(IndexError, "positions", [q, k, v, *caches], dict(positions=6))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("cache_layout", ["bshd", "paged"])
def test_v_on_another_device_is_refused(route, cache_layout):
    """v on another device than q raises ValueError naming v before k is written (a meta tensor stands for another
    device on a CPU-only machine)."""
    device = route_device(route)
    with route_context(route):
        q, k, _ = _inputs3(2, device)
        v = torch.empty(2, HK, D, device="meta")
        kw = dict(positions=torch.tensor([1, 2], device=device), cache_layout=cache_layout)
        caches = _rows_caches(2, device)
        if cache_layout == "paged":
            kw["slot_mapping"] = torch.tensor([3, 9], device=device)
        _assert_refused(ValueError, r"\bv\b.*device", [q, k, v, *caches], kw)
        # and k likewise
        _assert_refused(ValueError, r"\bk\b.*device", [q, torch.empty(2, HK, D, device="meta"), q[:, :HK], *caches],
                        kw)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("which", ["k_cache_scale", "v_cache_scale"])
@pytest.mark.parametrize("value", [0.0, -0.5, float("nan"), float("inf")], ids=["zero", "negative", "nan", "inf"])
def test_host_tensor_cache_scales_must_be_finite_and_positive(route, which, value):
    """A 0-d tensor scale whose value is on the host (a CPU tensor, or check_positions=True) is checked like a
    float: 0, negative, NaN or inf raises ValueError naming it, before anything is written."""
    device = route_device(route)
    with route_context(route):
        q, k, v = _inputs3(2, device)
        caches = [_poisoned((2, ROWS, HK, D), FP8, device) for _ in range(2)]
        kw = {"positions": torch.tensor([1, 2], device=device), which: torch.tensor(value, device=device),
              **_check_kw(route)}
        _assert_refused(ValueError, which, [q, k, v, *caches], kw)


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_device_tensor_cache_scales_are_not_read_without_check_positions():
    """On the kernel route a 0-d tensor scale is a device value: not read (no sync) unless check_positions=True."""
    with route_context("cpu-kernels"), torch.no_grad():
        q, k, v = _inputs3(2, "cpu")
        caches = [_poisoned((2, ROWS, HK, D), FP8) for _ in range(2)]
        ropekit.rope_kv_write(q, k, v, *caches, positions=torch.tensor([1, 2]), v_cache_scale=torch.tensor(1.0))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("cache_layout", ["bshd", "paged"])
def test_offsets_near_int64_max_raise(route, cache_layout):
    """Per-sequence offsets whose offset + S - 1 wraps around in int64 still raise naming positions (IndexError past
    the rows of a "bshd" cache, ValueError past the largest position for "paged" slots)."""
    device = route_device(route)
    with route_context(route):
        q, k, v = _inputs4(2, 3, device)
        kw = dict(positions=torch.tensor([0, 2**63 - 2], device=device), cache_layout=cache_layout,
                  **_check_kw(route))
        caches = _rows_caches(2, device)
        if cache_layout == "paged":
            kw["slot_mapping"] = torch.tensor([[0, 1, 2], [3, 4, 5]], device=device)
        _assert_refused(IndexError if cache_layout == "bshd" else ValueError, "positions", [q, k, v, *caches], kw)


@pytest.mark.parametrize("route", ROUTES)
def test_zero_dim_positions_are_one_offset_for_every_sequence(route):
    """A 0-d integer tensor is an offset, as an int is: on the host it is read; on the kernel route (a device
    scalar) the kernel reads it for every sequence. Same rows, same values."""
    device = route_device(route)
    with route_context(route), torch.no_grad():
        q, k, v = _inputs4(2, 3, device)
        want_caches, got_caches = _rows_caches(2, device), _rows_caches(2, device)
        want = ropekit.rope_kv_write(q, k, v, *want_caches, positions=4)
        for _ in range(3):
            got = ropekit.rope_kv_write(q, k, v, *got_caches, positions=torch.tensor(4, device=device))
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            for g, w in zip(got_caches, want_caches):
                assert torch.equal(_bits(g), _bits(w))
        _assert_refused(IndexError, "positions", [q, k, v, *got_caches],
                        dict(positions=torch.tensor(6, device=device), **_check_kw(route)))


@pytest.mark.parametrize("route", ROUTES)
def test_multi_axis_token_positions_without_sections_say_so(route):
    """[A, T] positions for 3-D tokens without sections: the error names positions and says sections are needed."""
    device = route_device(route)
    with route_context(route):
        q, k, v = _inputs3(4, device)
        kw = dict(positions=torch.randint(0, 8, (3, 4), device=device), cache_layout="paged",
                  slot_mapping=torch.arange(4, device=device))
        _assert_refused(ValueError, "positions.*sections", [q, k, v, *_rows_caches(2, device)], kw)


# --- tokens whose device-resident position is invalid write nothing; caches that overlap are refused ----------

@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_paged_cache_skips_tokens_with_invalid_positions():
    """A token whose (device-resident) position is invalid writes nothing, in paged caches too: its slot keeps its
    old bytes instead of receiving a NaN k row and its v row."""
    T = 2
    q, k, v = _inputs3(T, "cpu")
    kc, vc = torch.zeros(2, 4, HK, D), torch.zeros(2, 4, HK, D)
    with kernels_on_cpu(), torch.no_grad():
        ropekit.rope_kv_write(q, k, v, kc, vc, positions=torch.tensor([-1, 3]), cache_layout="paged",
                              slot_mapping=torch.tensor([1, 2]))
    assert torch.equal(kc.view(-1, HK, D)[1], torch.zeros(HK, D))  # token 0: invalid position
    assert torch.equal(vc.view(-1, HK, D)[1], torch.zeros(HK, D))
    assert torch.equal(vc.view(-1, HK, D)[2], v[1])  # token 1 written


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_rows_cache_skips_tokens_past_a_position_table():
    """A position past a cos/sin table is invalid (its rotation is NaN): its cache row is not written."""
    T = 2
    q, k, v = _inputs3(T, "cpu")
    cos, sin = torch.rand(4, D // 2), torch.rand(4, D // 2)
    kc, vc = torch.zeros(T, 8, HK, D), torch.zeros(T, 8, HK, D)
    with kernels_on_cpu(), torch.no_grad():
        ropekit.rope_kv_write(q, k, v, kc, vc, positions=torch.tensor([6, 1]), cos=cos, sin=sin)
    assert torch.equal(kc[0, 6], torch.zeros(HK, D))
    assert torch.equal(vc[0, 6], torch.zeros(HK, D))
    assert not kc[1, 1].isnan().any()


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_multi_axis_paged_skips_tokens_invalid_on_a_later_axis():
    T = 2
    q, k, v = _inputs3(T, "cpu")
    kc, vc = torch.zeros(2, 4, HK, D), torch.zeros(2, 4, HK, D)
    pos = torch.tensor([[1, 2], [-3, 2]])  # [A, T]: token 0 invalid on axis 1
    with kernels_on_cpu(), torch.no_grad():
        ropekit.rope_kv_write(q, k, v, kc, vc, positions=pos, sections=(2, 2), cache_layout="paged",
                              slot_mapping=torch.tensor([1, 2]))
    assert torch.equal(kc.view(-1, HK, D)[1], torch.zeros(HK, D))
    assert torch.equal(vc.view(-1, HK, D)[1], torch.zeros(HK, D))
    assert torch.equal(vc.view(-1, HK, D)[2], v[1])


@pytest.mark.parametrize("route", ["host", "kernels"])
@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
def test_an_expanded_cache_is_refused_untouched(route, which):
    """An expand()ed cache maps every sequence's rows onto one: a ValueError naming it (it used to be written, the
    last sequence's row winning), with nothing written."""
    if route == "kernels" and not INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1 (CPU-only runs)")
    q, k, v = _inputs3(3, "cpu")
    shared = torch.zeros(1, 8, HK, D)
    caches = {"k_cache": torch.zeros(3, 8, HK, D), "v_cache": torch.zeros(3, 8, HK, D)}
    caches[which] = shared.expand(3, 8, HK, D)
    with kernels_on_cpu() if route == "kernels" else contextlib.nullcontext(), torch.no_grad():
        with pytest.raises(ValueError, match=f"{which} reaches an element twice"):
            ropekit.rope_kv_write(q, k, v, caches["k_cache"], caches["v_cache"], positions=torch.tensor([1, 1, 1]))
    assert not shared.any() and not any(c.any() for c in caches.values())


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_caches_that_share_memory_are_refused():
    """k_cache and v_cache sharing memory would overwrite each other's rows: a ValueError naming them, before
    anything is written -- also when a replayed plan meets caches that overlap at another relative offset."""
    T = 2
    q, k, v = _inputs3(T, "cpu")
    c = torch.zeros(T, 8, HK, D)
    with torch.no_grad(), pytest.raises(ValueError, match="k_cache and v_cache"):
        ropekit.rope_kv_write(q, k, v, c, c, positions=0)
    assert not c.any()
    n = T * 8 * HK * D
    buf = torch.zeros(2 * n + 4)
    with kernels_on_cpu(), torch.no_grad():
        _fastpath.clear()
        for _ in range(3):  # disjoint halves of one buffer: recorded on the second call, replayed on the third
            ropekit.rope_kv_write(q, k, v, buf[:n].view(T, 8, HK, D), buf[n: 2 * n].view(T, 8, HK, D), positions=0)
        assert len(_fastpath._KV_PLANS) == 1
        buf.zero_()
        with pytest.raises(ValueError, match="k_cache and v_cache"):  # same signature, overlapping caches
            ropekit.rope_kv_write(q, k, v, buf[:n].view(T, 8, HK, D), buf[4: n + 4].view(T, 8, HK, D), positions=0)
    assert not buf.any()


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_caches_overlapping_an_input_are_refused_on_every_route():
    # A cache that holds q, k or v would change an input while the kernel reads it: refused by name before
    # anything is written, on the full path and when a plan exists for the signature.
    with kernels_on_cpu(), torch.no_grad():
        _fastpath.clear()
        buf = torch.randn(2 * 2 * 8 * 2 * 16 + 2 * 4 * 16)
        k_cache = buf[: 2 * 8 * 2 * 16].view(2, 8, 2, 16)
        v_cache = buf[2 * 8 * 2 * 16: 2 * 2 * 8 * 2 * 16].view(2, 8, 2, 16)
        q = torch.randn(2, 4, 16)
        k, v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
        for _ in range(3):  # a plan for inputs outside the caches
            ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=torch.tensor([1, 2]))
        assert len(_fastpath._KV_PLANS) == 1
        inside = k_cache[1, 6:8].clone()  # same shape and strides as k: a view into the cache itself
        inside_view = k_cache[1, 6:8]
        assert inside_view.shape == k.shape and inside_view.stride() == k.stride()
        before = (k_cache.clone(), v_cache.clone())
        with pytest.raises(ValueError, match="k_cache and k share memory"):
            ropekit.rope_kv_write(q, inside_view, v, k_cache, v_cache, positions=torch.tensor([1, 2]))
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
        assert torch.equal(inside_view, inside)


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_inference_caches_outside_inference_mode_are_refused():
    q, k, v = (torch.randn(2, h, 16) for h in (4, 2, 2))
    with torch.inference_mode():
        caches = [torch.zeros(2, 8, 2, 16) for _ in range(2)]
    with torch.no_grad(), pytest.raises(RuntimeError, match="inference tensor"):
        ropekit.rope_kv_write(q, k, v, *caches, positions=torch.tensor([0, 1]))
    with torch.inference_mode():
        for _ in range(3):  # and work inside it, plans included
            ropekit.rope_kv_write(q, k, v, *caches, positions=torch.tensor([0, 1]))
    assert caches[0].abs().sum() > 0
