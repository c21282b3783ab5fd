"""Multi-axis positions (M-RoPE): ``positions`` [A, B, S] with ``sections`` pairs per axis, contiguous (Qwen2-VL,
Qwen2.5-VL) or interleaved (Qwen3-VL), on the float64 reference and on the kernels (the Triton interpreter on CPU),
fast path included, against transformers' own pair -> axis layouts."""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

import ropekit
from ropekit._spec import pair_axis_map
from ropekit.testing import assert_close_to_ref, kernels_on_cpu, make_qk, max_relative_error
from ropekit.triton.kernel import _mod_axes

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", id="cpu-kernels",
                 marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
LAYOUTS = {"contiguous": (16, 24, 24), "interleaved": (24, 20, 20)}  # Qwen2-VL's and Qwen3-VL's, D = 128


def _sections(device: str, section_layout: str) -> tuple[int, ...]:
    """The layout's model sections on a GPU, a quarter of each (D = 32) under the CPU interpreter."""
    return LAYOUTS[section_layout] if device == "cuda" else tuple(n // 4 for n in LAYOUTS[section_layout])


def _launch_constexprs(q: torch.Tensor, k: torch.Tensor, **kwargs) -> dict:
    """The constexprs ``launcher.rope_arguments`` gives the call ``apply_rope(q, k, **kwargs)``, by name."""
    from ropekit._validation import validate
    from ropekit.triton.launcher import rope_arguments

    spec = validate(q, k, **kwargs)
    return rope_arguments(q, k, torch.empty_like(q), torch.empty_like(k), spec)[2]


def _hf_merge(freqs: torch.Tensor, sections, section_layout: str) -> torch.Tensor:
    """Per-axis angles [A, B, S, R/2] merged into one [B, S, R/2] as transformers' rotary modules merge them (its
    own code where transformers is installed, the same formula written out otherwise)."""
    try:
        if section_layout == "contiguous":
            from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding as Rotary
        else:
            from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as Rotary
        full = Rotary.recomposition_frequencies(SimpleNamespace(mrope_section=list(sections)), freqs.clone())
        return full[..., : freqs.shape[-1]]  # it returns the duplicated halves
    except ImportError:
        if section_layout == "contiguous":
            return torch.cat([m[i % 3] for i, m in enumerate(freqs.split(list(sections), dim=-1))], dim=-1)
        merged = freqs[0].clone()
        for axis in (1, 2):
            merged[..., axis: 3 * sections[axis]: 3] = freqs[axis, ..., axis: 3 * sections[axis]: 3]
        return merged


def _oracle(x: torch.Tensor, positions: torch.Tensor, sections, section_layout: str, base: float = 10000.0):
    """transformers' M-RoPE in float64 for bshd ``x``: merged cos/sin tables, then ``x*cos + rotate_half(x)*sin``."""
    D = x.shape[-1]
    inv = (base ** -(torch.arange(0, D, 2, dtype=torch.float64) / D)).float().double()  # ropekit's fp32 inv_freq
    merged = _hf_merge(positions.double()[..., None] * inv, sections, section_layout)
    emb = torch.cat([merged, merged], dim=-1)[:, :, None]
    half = D // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * emb.cos() + rotated * emb.sin()


@pytest.mark.parametrize("section_layout", sorted(LAYOUTS))
def test_pair_axis_map_is_transformers_layout(section_layout):
    sections = LAYOUTS[section_layout]
    axes = torch.tensor(pair_axis_map(sections, section_layout))
    freqs = torch.arange(3.0)[:, None, None, None].expand(3, 1, 1, sum(sections))  # value = axis index
    assert torch.equal(_hf_merge(freqs, sections, section_layout)[0, 0].long(), axes)
    assert [int((axes == a).sum()) for a in range(3)] == list(sections)
    # sections whose strided slices pass the last pair: the same map as transformers', fewer pairs for that axis
    short = (4, 6, 6)
    freqs = torch.arange(3.0)[:, None, None, None].expand(3, 1, 1, 16)
    assert torch.equal(_hf_merge(freqs, short, section_layout)[0, 0].long(),
                       torch.tensor(pair_axis_map(short, section_layout)))


@pytest.mark.parametrize("section_layout", sorted(LAYOUTS))
def test_reference_equals_transformers_mrope(section_layout):
    sections = LAYOUTS[section_layout]
    q, k = make_qk(2, 9, 4, 2, 128, dtype=torch.float64)
    positions = torch.randint(0, 5000, (3, 2, 9))
    got_q, got_k = ropekit.apply_rope(q, k, positions=positions, sections=sections, section_layout=section_layout)
    torch.testing.assert_close(got_q, _oracle(q, positions, sections, section_layout), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_k, _oracle(k, positions, sections, section_layout), rtol=1e-12, atol=1e-12)


def test_one_axis_equals_plain_positions_and_equal_axes_equal_one_d():
    q, _ = make_qk(2, 6, 2, 1, 32, dtype=torch.float64)
    ids = torch.randint(0, 1000, (2, 6))
    plain = ropekit.apply_rope(q, positions=ids)
    torch.testing.assert_close(ropekit.apply_rope(q, positions=ids[None], sections=(16,)), plain, rtol=0, atol=0)
    same = ids[None].expand(3, 2, 6)
    for section_layout, sections in (("contiguous", (4, 6, 6)), ("interleaved", (6, 5, 5))):
        got = ropekit.apply_rope(q, positions=same, sections=sections, section_layout=section_layout)
        torch.testing.assert_close(got, plain, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("section_layout", sorted(LAYOUTS))
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "thd"])
def test_kernels_and_plans_equal_reference(device, section_layout, layout, plan_calls):
    """Every call of a signature -- the full path, the one that records a plan, two replays -- with fresh data,
    out of place, in place, the explicit backward and autograd, against the float64 reference; positions up to
    2**24 on every axis (exact in-kernel angles)."""
    sections = _sections(device, section_layout)
    D = 2 * sum(sections)
    B, S = (2, 64) if device == "cuda" else (2, 5)
    with kernels_on_cpu() if device == "cpu" else contextlib.nullcontext():
        for _call in range(4):
            q, k = make_qk(B, S, 4, 2, D, device=device, layout=layout)
            if layout == "thd":
                positions = torch.randint(0, 1 << 24, (3, B * S), device=device)
            else:
                positions = torch.randint(0, 1 << 24, (3, B, S), device=device)
            kw = dict(positions=positions, sections=sections, section_layout=section_layout, layout=layout)
            ref_kw = dict(kw, positions=positions.cpu())
            want_q, want_k = ropekit.apply_rope(q.cpu().double(), k.cpu().double(), **ref_kw)
            got_q, got_k = ropekit.apply_rope(q, k, **kw)
            assert_close_to_ref(got_q, want_q, q.dtype)
            assert_close_to_ref(got_k, want_k, k.dtype)
            back = ropekit.rope_backward(q, **kw)
            assert_close_to_ref(back, ropekit.rope_backward(q.cpu().double(), **ref_kw), q.dtype)
            qi, ki = q.clone(), k.clone()
            ropekit.apply_rope_(qi, ki, **kw)
            assert_close_to_ref(qi, want_q, q.dtype)
            leaf = q.clone().requires_grad_(True)
            g = torch.randn_like(q)
            (dq,) = torch.autograd.grad(ropekit.apply_rope(leaf, **kw), leaf, g)
            assert_close_to_ref(dq, ropekit.rope_backward(g.cpu().double(), **ref_kw), q.dtype)
    assert plan_calls["served"] >= 2 * 3  # calls 3 and 4 of the out-of-place, in-place and backward signatures


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("section_layout", sorted(LAYOUTS))
@pytest.mark.parametrize("B, S", [(2, 9), (12, 1)])
def test_one_position_on_every_axis_gives_the_one_d_bits(device, section_layout, B, S):
    """Text tokens (one position on every axis, what decode runs) give the 1-D call's bits; moving one token on one
    axis changes no other token's bits; a token invalid on every axis is NaN and leaves the rest alone."""
    from ropekit._validation import validate
    from ropekit.triton.launcher import launch_rope

    sections = _sections(device, section_layout)
    D = 2 * sum(sections)
    kw = dict(sections=sections, section_layout=section_layout)

    def launch(q, k, positions, mutate=None):
        spec = validate(q, k, positions=positions, **kw)  # values checked on the host here ...
        if mutate is not None:
            mutate(positions)  # ... and changed before the kernel reads them, as on a device
        q_out, k_out = torch.full_like(q, 12345.0), torch.full_like(k, 12345.0)
        launch_rope(q, k, q_out, k_out, spec)
        return q_out, k_out

    with kernels_on_cpu() if device == "cpu" else contextlib.nullcontext():
        for _call in range(2):
            q, k = make_qk(B, S, 4, 2, D, device=device)
            ids = torch.randint(0, 1 << 24, (B, S), device=device)
            same = ids[None].expand(3, B, S).contiguous()
            one_d = ropekit.apply_rope(q, k, positions=ids)
            text = launch(q, k, same.clone())
            for got, want in zip(text, one_d):
                assert torch.equal(got, want)
            # one token (the last) moves on axis 1: it matches the reference, every other token keeps its bits
            moved = same.clone()
            moved[1, -1, -1] += 1
            mixed = launch(q, k, moved)
            want = ropekit.apply_rope(q.cpu().double(), k.cpu().double(), positions=moved.cpu(), **kw)
            for got, exact, ref, x in zip(mixed, text, want, (q, k)):
                assert torch.equal(got[:-1], exact[:-1]) and torch.equal(got[-1, :-1], exact[-1, :-1])
                assert_close_to_ref(got[-1:, -1:], ref[-1:, -1:], x.dtype)
            # the first token invalid on every axis: NaN, the rest unchanged
            invalid = launch(q, k, same.clone(), mutate=lambda p: p[:, 0, 0].fill_(-1))
            for got, exact in zip(invalid, text):
                assert got[0, 0].isnan().all()
                assert torch.equal(got[1:], exact[1:]) and torch.equal(got[0, 1:], exact[0, 1:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("section_layout", sorted(LAYOUTS))
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_axes_expanded_from_one_row_run_as_one_d_positions(device, section_layout, layout, plan_calls):
    """Positions expanded to every axis from one row (axis stride 0, as transformers' Qwen2-VL text model builds
    them for a forward without position ids) launch as 1-D positions, with the 1-D call's bits out of place, in
    place and backward, plans included; a token invalid there is NaN. Materialised copies, and [A, 1, S] positions
    broadcast over the batch (stride 0 on B, not on the axes), keep the multi-axis launch."""
    from ropekit._validation import validate
    from ropekit.triton.launcher import launch_rope

    sections = _sections(device, section_layout)
    D, B, S = 2 * sum(sections), 2, 7
    kw = dict(sections=sections, section_layout=section_layout, layout=layout)
    row_shape = (B * S,) if layout == "thd" else (B, S)

    def num_axes(q, k, positions):
        return _launch_constexprs(q, k, positions=positions, **kw)["NUM_AXES"]

    with kernels_on_cpu() if device == "cpu" else contextlib.nullcontext():
        for _call in range(4):  # the second call of each signature records a plan, the later ones replay it
            q, k = make_qk(B, S, 4, 2, D, device=device, layout=layout)
            ids = torch.randint(0, 1 << 24, row_shape, device=device)
            expanded = ids[None].expand(3, *row_shape)
            assert num_axes(q, k, expanded) == 1 and num_axes(q, k, expanded.contiguous()) == 3
            one_d = dict(positions=ids, layout=layout)
            for got, want in zip(ropekit.apply_rope(q, k, positions=expanded, **kw), ropekit.apply_rope(q, k, **one_d)):
                assert torch.equal(got, want)
            qi, ki = q.clone(), k.clone()
            ropekit.apply_rope_(qi, ki, positions=expanded, **kw)
            for got, want in zip((qi, ki), ropekit.apply_rope(q, k, **one_d)):
                assert torch.equal(got, want)
            assert torch.equal(ropekit.rope_backward(q, positions=expanded, **kw), ropekit.rope_backward(q, **one_d))
        if layout == "bshd":  # one row of ids for the whole batch: [A, 1, S]
            row = torch.randint(0, 1 << 24, (1, 1, S), device=device)
            assert num_axes(q, k, row.expand(3, 1, S)) == 1
            assert num_axes(q, k, torch.randint(0, 1 << 24, (3, 1, S), device=device)) == 3
            assert torch.equal(ropekit.apply_rope(q, positions=row.expand(3, 1, S), **kw),
                               ropekit.apply_rope(q, positions=row[0].expand(B, S)))
        # a device-resident invalid position (changed after the host check): its token is NaN, the rest as 1-D
        source = torch.randint(0, 1 << 24, row_shape, device=device)
        spec = validate(q, k, positions=source[None].expand(3, *row_shape), **kw)
        source.view(-1)[1] = -1
        q_out, k_out = torch.full_like(q, 12345.0), torch.full_like(k, 12345.0)
        launch_rope(q, k, q_out, k_out, spec)
        want_q, want_k = ropekit.apply_rope(q, k, positions=source.clamp(min=0), layout=layout)
        rest = [0, *range(2, B * S)]
        for got, want in ((q_out, want_q), (k_out, want_k)):
            got, want = got.reshape(B * S, -1, D), want.reshape(B * S, -1, D)  # token-major in both layouts
            assert got[1].isnan().all() and torch.equal(got[rest], want[rest])
    assert plan_calls["served"] >= 3 * 2  # calls 3 and 4 of the out-of-place, in-place and backward signatures


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("section_layout", sorted(LAYOUTS))
def test_constant_axis_stride_equals_the_runtime_stride(device, section_layout, monkeypatch):
    """Multi-axis calls of at most ``heuristics.AXIS_STRIDE_CONSTANT_TOKENS`` tokens take the positions' axis stride
    as a compile-time constant (``POS_AXIS_STRIDE``); larger calls, 1-D positions and axes expanded from one row
    pass 0 (the runtime stride). The two give the same bits and match the float64 reference, for positions
    stored axis-major, token-major (axis stride 1) and as a slice of a wider buffer, fresh inputs on each call."""
    from ropekit._validation import validate
    from ropekit.triton import heuristics, launcher

    sections = _sections(device, section_layout)
    D, limit = 2 * sum(sections), heuristics.AXIS_STRIDE_CONSTANT_TOKENS
    kw = dict(sections=sections, section_layout=section_layout)

    def axis_stride(tokens, positions, **extra):
        q, k = make_qk(tokens, 1, 4, 2, D, device=device)
        return _launch_constexprs(q, k, positions=positions, **extra)["POS_AXIS_STRIDE"]

    ids = torch.randint(0, 1 << 24, (3, limit + 1, 1), device=device)
    assert axis_stride(limit, ids[:, :limit].contiguous(), **kw) == limit
    assert axis_stride(limit, ids[:, :limit], **kw) == limit + 1  # a slice keeps its buffer's stride
    assert axis_stride(limit + 1, ids, **kw) == 0
    assert axis_stride(limit, ids[0, :limit]) == 0  # 1-D positions
    assert axis_stride(limit, ids[:1, :limit].expand(3, limit, 1), **kw) == 0  # launches as 1-D

    with kernels_on_cpu() if device == "cpu" else contextlib.nullcontext():
        for tokens in (2, 5, 5):
            q, k = make_qk(tokens, 1, 4, 2, D, device=device)
            ids = torch.randint(0, 1 << 24, (3, tokens, 1), device=device)
            wide = torch.zeros(3, 64, 1, dtype=ids.dtype, device=device)
            wide[:, :tokens] = ids
            want = ropekit.apply_rope(q.cpu().double(), k.cpu().double(), positions=ids.cpu(), **kw)
            for positions in (ids, ids.permute(1, 2, 0).contiguous().permute(2, 0, 1), wide[:, :tokens]):
                spec = validate(q, k, positions=positions, **kw)
                outs = []
                for bound in (limit, 0):  # the constant stride, then the runtime one
                    monkeypatch.setattr(heuristics, "AXIS_STRIDE_CONSTANT_TOKENS", bound)
                    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
                    launcher.launch_rope(q, k, q_out, k_out, spec)
                    outs.append((q_out, k_out))
                monkeypatch.setattr(heuristics, "AXIS_STRIDE_CONSTANT_TOKENS", limit)
                for got, runtime, ref in zip(*outs, want):
                    assert torch.equal(got, runtime)
                    assert_close_to_ref(got, ref, q.dtype)


# Pair -> axis maps the kernel forms from its compile-time bounds: 1 to 4 axes, empty axes, interleaved strides
# that pass the last pair (that axis gets fewer pairs), unequal sections in both orders. 8 pairs (D 16).
AXIS_CASES = [
    ((8,), "contiguous"), ((8,), "interleaved"),
    ((3, 5), "contiguous"), ((5, 3), "contiguous"), ((5, 3), "interleaved"), ((2, 6), "interleaved"),
    ((2, 0, 6), "contiguous"), ((1, 4, 3), "interleaved"), ((6, 1, 1), "interleaved"),
    ((1, 2, 3, 2), "contiguous"), ((0, 3, 0, 5), "contiguous"), ((2, 2, 1, 3), "interleaved"),
    ((0, 3, 0, 5), "interleaved"), ((2, 2, 2, 2), "interleaved"), ((2, 3, 3), "interleaved"),
    ((2, 1, 1, 4), "interleaved"), ((4, 1, 3), "interleaved"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sections, section_layout", AXIS_CASES, ids=[f"{'-'.join(map(str, s))}-{lay}"
                                                                       for s, lay in AXIS_CASES])
def test_kernel_pair_axes_for_one_to_four_axes(device, sections, section_layout):
    """Every pair takes the position of the axis ``pair_axis_map`` gives it, for 1 to 4 axes in both layouts:
    per-axis positions far apart, so that a pair turned by another axis's position is far off the reference."""
    q, k = make_qk(2, 5, 3, 1, 16, device=device)
    positions = torch.randint(0, 1 << 20, (len(sections), 2, 5), device=device)
    kw = dict(positions=positions, sections=sections, section_layout=section_layout)
    with kernels_on_cpu() if device == "cpu" else contextlib.nullcontext():
        got_q, got_k = ropekit.apply_rope(q, k, **kw)
    want_q, want_k = ropekit.apply_rope(q.cpu().double(), k.cpu().double(), **dict(kw, positions=positions.cpu()))
    assert_close_to_ref(got_q, want_q, q.dtype)
    assert_close_to_ref(got_k, want_k, k.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 12, 16, 20, 32, 33, 40, 128, 256])
def test_interleaved_decode_block_shapes_equal_reference(tokens):
    """Qwen3-VL decode (32/8 heads, D 128, one token per sequence) at the grid sizes where the launcher gives the
    interleaved call other warps per program than the contiguous one: more (``PAIR_AXES_LATENCY_BYTES_PER_THREAD``)
    on grids below ``min_programs / PAIR_AXES_SM_FRACTION`` (``PAIR_AXES_CONSTANT_STRIDE_SM_FRACTION`` up to
    ``AXIS_STRIDE_CONSTANT_TOKENS`` tokens) that the small-grid shape does not take, fewer
    (``PAIR_AXES_BYTES_PER_THREAD``) from there to the end of the latency-bound range. Each shape against the
    float64 reference, so every shape is checked where it runs."""
    from ropekit._validation import validate
    from ropekit.triton import heuristics, launcher

    q, k = make_qk(tokens, 1, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    positions = torch.randint(0, 1 << 24, (3, tokens, 1), device="cuda")
    kw = dict(positions=positions, sections=(24, 20, 20), section_layout="interleaved", base=5e6)
    warps = {layout: launcher.kernel_launch(q, k, q, k, validate(q, k, **dict(kw, section_layout=layout)))[3]
             for layout in ("interleaved", "contiguous")}
    wanted = heuristics.num_programs_wanted(q.device)
    programs = tokens * 5  # 8 heads a program: 4 q + 1 k blocks a token
    small_grid = heuristics.SMALL_GRID_SM_FRACTION * tokens * 10 <= wanted  # half the heads: 8 q + 2 k blocks
    latency_bound = programs < heuristics.LATENCY_BOUND_FACTOR * wanted
    fraction = (heuristics.PAIR_AXES_CONSTANT_STRIDE_SM_FRACTION
                if tokens <= heuristics.AXIS_STRIDE_CONSTANT_TOKENS else heuristics.PAIR_AXES_SM_FRACTION)
    filled = fraction * programs >= wanted
    if not latency_bound or (small_grid and not filled):
        assert warps["interleaved"] == warps["contiguous"], warps
    elif filled:
        assert warps["interleaved"] < warps["contiguous"], warps
    else:
        assert warps["interleaved"] > warps["contiguous"], warps
    want_q, want_k = ropekit.apply_rope(q.cpu().double(), k.cpu().double(), **dict(kw, positions=positions.cpu()))
    for _call in range(2):
        got_q, got_k = ropekit.apply_rope(q, k, **kw)
        assert_close_to_ref(got_q, want_q, q.dtype)
        assert_close_to_ref(got_k, want_k, k.dtype)


# Sections where some axis has no pair (its positions are still checked: an empty first, middle or last axis, and
# interleaved axes whose index is past the last pair), and pair counts that are not a power of two (padded pairs
# read some axis's position too; a token needs every axis valid either way).
INVALID_AXIS_CASES = [
    ((16, 24, 24), "contiguous"), ((24, 20, 20), "interleaved"), ((2, 3), "contiguous"), ((1, 2, 2), "interleaved"),
    ((0, 8), "contiguous"), ((8, 0), "contiguous"), ((8, 0), "interleaved"), ((2, 0, 6), "contiguous"),
    ((0, 3, 0, 5), "contiguous"), ((0, 3, 0, 5), "interleaved"), ((1, 1, 0, 0), "interleaved"),
    ((0, 1), "interleaved"), ((1, 0, 1), "interleaved"), ((1, 0, 0, 1), "interleaved"), ((4, 4, 0), "contiguous"),
    ((2, 2, 4, 0), "contiguous"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sections, section_layout", INVALID_AXIS_CASES,
                         ids=[f"{'-'.join(map(str, s))}-{lay}" for s, lay in INVALID_AXIS_CASES])
def test_device_position_invalid_on_any_axis_makes_its_token_nan(device, sections, section_layout):
    """A device-resident position that is negative or past 2**31 - 1 on any axis -- one a pair reads or one no
    pair reads -- makes its whole token NaN in q and k (the reference's rule), and no other token changes. On CPU
    the API reads positions on the host and raises, so the launcher gets what the API passes on a GPU."""
    from ropekit._validation import validate
    from ropekit.triton.launcher import launch_rope

    A, D, S = len(sections), 2 * sum(sections), 4
    q, k = make_qk(1, S, 3, 1, D, device=device)
    good = torch.randint(0, 1 << 20, (A, 1, S), device=device)
    kw = dict(sections=sections, section_layout=section_layout)
    want_q, want_k = ropekit.apply_rope(q.cpu().double(), k.cpu().double(), positions=good.cpu(), **kw)
    with kernels_on_cpu() if device == "cpu" else contextlib.nullcontext():
        for axis in range(A):
            for token, bad in ((1, -1), (2, 2**31), (3, -(2**40))):
                positions = good.clone()
                spec = validate(q, k, positions=positions, **kw)  # the values are checked on the host here
                positions[axis, 0, token] = bad  # ... and change before the kernel reads them, as on a device
                q_out, k_out = torch.full_like(q, 12345.0), torch.full_like(k, 12345.0)
                launch_rope(q, k, q_out, k_out, spec)
                assert q_out[0, token].isnan().all() and k_out[0, token].isnan().all(), (axis, token)
                rest = [t for t in range(S) if t != token]
                assert_close_to_ref(q_out[:, rest], want_q[:, rest], q.dtype)
                assert_close_to_ref(k_out[:, rest], want_k[:, rest], k.dtype)


PER_AXIS_CASES = sorted({(s, lay) for s, lay in AXIS_CASES + INVALID_AXIS_CASES if len(s) > 1})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sections, section_layout", PER_AXIS_CASES,
                         ids=[f"{'-'.join(map(str, s))}-{lay}" for s, lay in PER_AXIS_CASES])
def test_positions_loaded_per_axis_equal_the_per_pair_loads(device, sections, section_layout, monkeypatch):
    """2-byte multi-axis calls on small decode grids read each axis's position once a token and select it per pair
    (``POS_PER_AXIS``, ``heuristics.block_plan``); elsewhere, and in fp32, each pair loads its own. The
    two give the same bits and match the float64 reference, and a position invalid on any axis -- one a pair reads
    or one no pair reads -- makes its token NaN in both; both layouts, fresh inputs for every axis."""
    from ropekit._validation import validate
    from ropekit.triton import heuristics, launcher
    from ropekit.triton.heuristics import block_plan

    A, D, S = len(sections), 2 * sum(sections), 4
    kw = dict(sections=sections, section_layout=section_layout)
    with kernels_on_cpu() if device == "cpu" else contextlib.nullcontext():
        for axis in range(A):
            q, k = make_qk(2, S, 3, 1, D, dtype=torch.bfloat16, device=device)
            good = torch.randint(0, 1 << 24, (A, 2, S), device=device)
            want = ropekit.apply_rope(q.cpu().double(), k.cpu().double(), positions=good.cpu(), **kw)
            positions = good.clone()
            spec = validate(q, k, positions=positions, **kw)  # the values are checked on the host here
            positions[axis, 1, 2] = -1  # ... and change before the kernel reads them, as on a device
            outs = {}
            for per_axis in (True, False):
                def plan(*args, _on=per_axis, **kwargs):
                    return block_plan(*args, **kwargs)[0], _on

                monkeypatch.setattr(heuristics, "block_plan", plan)
                assert _launch_constexprs(q, k, positions=good, **kw)["POS_PER_AXIS"] == per_axis
                assert not _launch_constexprs(q.float(), k.float(), positions=good, **kw)["POS_PER_AXIS"]
                q_out, k_out = torch.full_like(q, 12345.0), torch.full_like(k, 12345.0)
                launcher.launch_rope(q, k, q_out, k_out, spec)
                outs[per_axis] = (q_out, k_out)
            for got, per_pair, ref in zip(outs[True], outs[False], want):
                assert torch.equal(got.isnan(), per_pair.isnan())
                assert torch.equal(got.nan_to_num(), per_pair.nan_to_num())
                assert got[1, 2].isnan().all(), axis
                assert_close_to_ref(got[0], ref[0], q.dtype)
                assert_close_to_ref(got[1, [0, 1, 3]], ref[1, [0, 1, 3]], q.dtype)


@pytest.mark.parametrize("hq, hk", [(32, 8), (16, 16), (16, 8), (64, 8)])
def test_no_decode_grid_takes_two_heads_a_thread_with_per_axis_loads(monkeypatch, hq, hk):
    """On a 132-SM card, every interleaved bf16 decode call from 1 to 160 tokens loads positions once per axis
    exactly when its shape is not the two-heads-a-thread one (``PAIR_AXES_BYTES_PER_THREAD``): the two together
    measured 1.14x the 1-D call. That shape starts at 88 programs of 8 heads, or at 132 for calls of at most 32
    tokens (a constant axis stride). 16/16 heads reach the bounds at 88 programs in the small-grid shape (11 tokens,
    half the heads), at 88 programs of 8 heads (22 tokens, still below 132) and past 32 tokens (33 tokens, 132
    programs: two heads a thread). Contiguous sections load once per axis on grids below 88 programs up to 32
    tokens, 1-D positions and fp32 never."""
    from ropekit._validation import validate
    from ropekit.triton import heuristics, launcher

    monkeypatch.setattr(heuristics, "num_programs_wanted", lambda device: 4 * 132)
    D = 128
    seen = set()
    for tokens in range(1, 161):
        q, k = make_qk(tokens, 1, hq, hk, D, dtype=torch.bfloat16)
        positions = torch.randint(0, 100, (3, tokens, 1))
        spec = validate(q, k, positions=positions, sections=(24, 20, 20), section_layout="interleaved")
        grid, _, named, warps = launcher.rope_arguments(q, k, torch.empty_like(q), torch.empty_like(k), spec)
        per_thread = named["BLOCK_T"] * named["BLOCK_HQ"] * D * 2 // (32 * warps)
        programs = grid[0] * grid[1] * grid[2]
        decode = programs < heuristics.LATENCY_BOUND_FACTOR * 4 * 132
        two_heads = decode and per_thread == heuristics.PAIR_AXES_BYTES_PER_THREAD
        assert named["POS_PER_AXIS"] == (decode and not two_heads), (tokens, programs, per_thread)
        programs_of_8_heads = tokens * (-(-hq // 8) + -(-hk // 8))  # before the small-grid shape halves them
        two_heads_from = 4 * 132 // (4 if tokens <= 32 else 6)
        assert two_heads == (decode and programs_of_8_heads >= two_heads_from), (tokens, programs_of_8_heads)
        seen.add((two_heads, named["POS_PER_AXIS"]))
        contiguous = _launch_constexprs(q, k, positions=positions, sections=(24, 20, 20))
        assert contiguous["POS_PER_AXIS"] == (6 * programs_of_8_heads < 4 * 132 and tokens <= 32), tokens
        assert not _launch_constexprs(q, k, positions=positions[0].clone())["POS_PER_AXIS"]
        assert not _launch_constexprs(q.float(), k.float(), positions=positions, sections=(24, 20, 20))[
            "POS_PER_AXIS"]
        if (hq, hk) == (16, 16) and tokens in (11, 21, 22, 32, 33):
            assert (programs, two_heads, named["POS_PER_AXIS"]) == {
                11: (88, False, True), 21: (84, False, True), 22: (88, False, True), 32: (128, False, True),
                33: (132, True, False)}[tokens]
    assert seen >= {(True, False), (False, True)}


@triton.jit
def _mod_axes_kernel(out_ptr, NUM_AXES: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, _mod_axes(i, NUM_AXES))


@pytest.mark.parametrize("device", DEVICES)
def test_pair_index_modulo_is_exact_over_its_whole_range(device):
    """The kernel's multiply-shift ``i % 3`` (and ``i % 2``, ``i % 4``) equals Python's for every pair index it
    may see (below 2**15)."""
    n = 2**15
    for num_axes in (2, 3, 4):
        out = torch.full((n,), -1, dtype=torch.int32, device=device)
        _mod_axes_kernel[(1,)](out, num_axes, n)
        assert torch.equal(out.cpu(), torch.arange(n, dtype=torch.int32) % num_axes), num_axes


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(positions=torch.zeros(3, 2, 5, dtype=torch.long), sections=(4, 4, 4)), ValueError, "sum to rotary_dim/2"),
    (dict(positions=torch.zeros(2, 2, 5, dtype=torch.long), sections=(8, 4, 4)), ValueError, "positions must be"),
    (dict(positions=torch.zeros(3, 2, 4, dtype=torch.long), sections=(8, 4, 4)), ValueError, "positions must be"),
    (dict(positions=7, sections=(8, 4, 4)), TypeError, "sections need positions"),
    (dict(positions=torch.zeros(3, 2, 5), sections=(8, 4, 4)), TypeError, "positions must be an int32 or int64"),
    (dict(positions=torch.zeros(3, 2, 5, dtype=torch.long), sections=(8, 4, 4), cos=torch.rand(9, 16),
          sin=torch.rand(9, 16)), ValueError, "base or inv_freq"),
    (dict(positions=torch.zeros(3, 2, 5, dtype=torch.long), sections=(8, 4, 4), section_layout="blocks"),
     ValueError, "section_layout must be one of"),
    (dict(section_layout="interleaved"), ValueError, "give sections= too"),
    (dict(positions=torch.zeros(3, 2, 5, dtype=torch.long), sections="864"), TypeError, "sections must be"),
    (dict(positions=torch.zeros(3, 2, 5, dtype=torch.long), sections=(8.0, 4, 4)), ValueError, "ints >= 0"),
    (dict(positions=torch.tensor([[[0, 1, 2, 3, 4]] * 2, [[0, 1, 2, 3, -1]] * 2, [[0] * 5] * 2]), sections=(8, 4, 4)),
     IndexError, "must be >= 0"),
    (dict(positions=torch.zeros(5, 2, 5, dtype=torch.long), sections=(4, 3, 3, 3, 3)), ValueError,
     "sections may name at most 4 axes"),
])
def test_bad_multi_axis_arguments_name_themselves(kwargs, error, match):
    q = torch.randn(2, 5, 2, 32)
    before = q.clone()
    with pytest.raises(error, match=match):
        ropekit.apply_rope_(q, **kwargs)
    assert torch.equal(q, before)


def test_axis_rows_past_int32_offsets_are_refused():
    """The kernels offset an axis's row of positions in int32: rows 2**31 elements apart or more (a view of a huge
    buffer) are refused with the remedy, not read out of bounds; just under the limit is taken. Meta tensors:
    nothing is allocated."""
    from ropekit._validation import validate

    q = torch.empty(2, 5, 2, 32, device="meta")
    for A, sections in ((2, (8, 8)), (3, (8, 4, 4))):
        limit = -(-(2**31) // (A - 1))  # the smallest axis stride with (A - 1) * stride >= 2**31
        buffer = torch.empty(A * limit, dtype=torch.int32, device="meta")
        with pytest.raises(ValueError, match=r"positions: the rows .* positions\.contiguous\(\)"):
            validate(q, None, positions=buffer.as_strided((A, 2, 5), (limit, 5, 1)), sections=sections)
        assert validate(q, None, positions=buffer.as_strided((A, 2, 5), (limit - 1, 5, 1)), sections=sections)


def test_axial_frequencies_give_flux_rope():
    """Flux's 3-axis RoPE: each axis rotates its own slice of pairs by its own frequency set, interleaved pairs."""
    dims, base = (16, 56, 56), 10000.0
    inv = ropekit.axial_inv_freq(dims, base)
    assert inv.dtype == torch.float32 and inv.shape == (sum(dims) // 2,)
    q, _ = make_qk(2, 6, 3, 1, sum(dims), dtype=torch.float64)
    ids = torch.randint(0, 512, (3, 2, 6))
    got = ropekit.apply_rope(q, positions=ids, inv_freq=inv, sections=[d // 2 for d in dims], style="interleaved")
    angles = torch.cat([ids[a].double()[..., None] * inv[sum(dims[:a]) // 2: sum(dims[: a + 1]) // 2].double()
                        for a in range(3)], dim=-1)[:, :, None]  # [B, S, 1, D/2]
    x0, x1 = q[..., 0::2], q[..., 1::2]
    want = torch.stack((x0 * angles.cos() - x1 * angles.sin(), x0 * angles.sin() + x1 * angles.cos()), -1)
    torch.testing.assert_close(got, want.flatten(-2), rtol=1e-12, atol=1e-12)
    for bad, error in (((15, 8), ValueError), ((), TypeError), ("16", TypeError)):
        with pytest.raises(error, match="dims"):
            ropekit.axial_inv_freq(bad)


@pytest.mark.parametrize("device", DEVICES)
def test_axial_frequencies_give_the_vision_towers_2d_rope(device):
    """A ViT's 2-D grid RoPE, as Qwen2-VL's vision tower does it (transformers' rotary module and
    apply_rotary_pos_emb_vision as the oracle, evaluated in float64): the patches' (row, column) ids as two axes,
    axial_inv_freq((D/2, D/2)), sections (D/4, D/4), NeoX pairing, q and k [N, H, D] in thd layout."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl
    from transformers.vision_utils import get_vision_position_ids

    config = transformers.Qwen2VLVisionConfig(embed_dim=64, num_heads=2)  # head_dim D = 32
    D, base = 32, config.rope_parameters["rope_theta"]
    rotary = qwen2_vl.Qwen2VLVisionRotaryEmbedding(config)
    inv = ropekit.axial_inv_freq((D // 2, D // 2), base)
    # ropekit rounds base**(-2j/d) once; transformers' float32 power and division may differ by one ulp
    torch.testing.assert_close(inv, torch.cat([rotary.inv_freq, rotary.inv_freq]), rtol=2**-23, atol=0)
    hw = get_vision_position_ids(torch.tensor([[1, 6, 8], [2, 4, 4]]), 2)  # [N, 2], merge blocks of 2 x 2
    N = hw.shape[0]
    q, k = (torch.randn(N, 3, D, dtype=torch.float32) for _ in range(2))
    angles = rotary.recomposition_frequencies(hw[..., None].double() * rotary.inv_freq.double())  # [N, D]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    with kernels_on_cpu() if device == "cpu" else contextlib.nullcontext():
        got = ropekit.apply_rope(q.to(device), k.to(device), positions=hw.T.to(device), inv_freq=inv.to(device),
                                 sections=(D // 4, D // 4), layout="thd")
    for g, x in zip(got, (q, k)):
        want = x.double() * cos + qwen2_vl.rotate_half(x.double()) * sin
        assert_close_to_ref(g.cpu(), want, torch.float32)


@pytest.mark.parametrize("model_type, section_layout", [("qwen2_vl", "contiguous"), ("qwen3_vl", "interleaved")])
def test_vision_language_configs_give_sections_and_transformers_rotation(model_type, section_layout):
    transformers = pytest.importorskip("transformers")
    sections = [4, 6, 6]
    text = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections})
    config = transformers.AutoConfig.for_model(model_type, text_config=text)
    freqs = ropekit.from_hf_config(config)
    assert freqs.sections == tuple(sections) and freqs.section_layout == section_layout
    assert ropekit.from_hf_config(config.text_config).sections == tuple(sections)
    module = {"qwen2_vl": "transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VLRotaryEmbedding",
              "qwen3_vl": "transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding"}[model_type]
    mod_name, cls_name = module.rsplit(".", 1)
    rotary = getattr(__import__(mod_name, fromlist=[cls_name]), cls_name)(config.text_config)
    q, _ = make_qk(2, 8, 4, 2, 32, dtype=torch.float64)
    ids = torch.randint(0, 64, (3, 2, 8))  # short: transformers forms its angles in float32
    cos, sin = rotary(q.float(), ids)
    half = 16
    want = q * cos.double()[:, :, None] + torch.cat((-q[..., half:], q[..., :half]), -1) * sin.double()[:, :, None]
    got = ropekit.apply_rope(q, positions=ids, **freqs.apply_kwargs())
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    # the module takes the config too: the same rotation, and transformers' merged tables where code needs them
    rope = ropekit.RotaryEmbedding(config)
    torch.testing.assert_close(rope(q, positions=ids), got, rtol=0, atol=0)
    my_cos, my_sin = rope.cos_sin(ids)
    torch.testing.assert_close(my_cos, cos, rtol=0, atol=2e-5)
    torch.testing.assert_close(my_sin, sin, rtol=0, atol=2e-5)


def _qwen2_vl_formula(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Qwen2-VL's apply_multimodal_rotary_pos_emb (transformers 4.x), written out."""
    sections = mrope_section * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(sections, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(sections, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)

    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
def test_multimodal_drop_in_matches_qwen2_vl_function(table_dtype):
    from ropekit.integrations.transformers import apply_multimodal_rotary_pos_emb

    mrope_section = [4, 6, 6]
    B, S, D = 2, 7, 32
    q = torch.randn(B, 4, S, D, dtype=torch.bfloat16, requires_grad=True)  # [B, H, S, D], unsqueeze_dim=1
    k = torch.randn(B, 2, S, D, dtype=torch.bfloat16, requires_grad=True)
    inv = 10000.0 ** -(torch.arange(0, D, 2, dtype=torch.float64) / D)
    freqs = torch.randint(0, 100, (3, B, S)).double()[..., None] * inv
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(table_dtype), emb.sin().to(table_dtype)
    got_q, got_k = apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section)
    q64, k64 = q.detach().double().requires_grad_(True), k.detach().double().requires_grad_(True)
    want_q, want_k = _qwen2_vl_formula(q64, k64, cos.double(), sin.double(), mrope_section)
    out_dtype = torch.promote_types(torch.bfloat16, table_dtype)
    assert got_q.dtype == got_k.dtype == out_dtype  # transformers' type promotion
    assert_close_to_ref(got_q, want_q.detach(), out_dtype, backend="cpu")
    assert_close_to_ref(got_k, want_k.detach(), out_dtype, backend="cpu")
    gq, gk = torch.autograd.grad((got_q, got_k), (q, k), (torch.ones_like(got_q), torch.ones_like(got_k)))
    wq, wk = torch.autograd.grad((want_q, want_k), (q64, k64), (torch.ones_like(want_q), torch.ones_like(want_k)))
    assert_close_to_ref(gq, wq, torch.bfloat16, backend="cpu")  # the inputs' dtype, rounded once
    assert_close_to_ref(gk, wk, torch.bfloat16, backend="cpu")
    with pytest.raises(ValueError, match="mrope_section"):
        apply_multimodal_rotary_pos_emb(q, k, cos, sin, [4, 6, 5])


@pytest.mark.parametrize("device", DEVICES)
def test_angles_exact_to_two_to_the_24_on_every_axis(device):
    """The kernels' multi-axis angles are as exact as 1-D ones: within 2e-6 of the output scale (float32 outputs
    against the float64 reference) with every axis's positions near 2**24."""
    sections = (16, 24, 24) if device == "cuda" else (4, 6, 6)
    D = 2 * sum(sections)
    q, _ = make_qk(2, 16, 2, 1, D, device=device)
    positions = (1 << 24) - torch.randint(1, 1 << 12, (3, 2, 16), device=device)
    with kernels_on_cpu() if device == "cpu" else contextlib.nullcontext():
        for section_layout in ("contiguous", "interleaved"):
            got = ropekit.apply_rope(q, positions=positions, sections=sections, section_layout=section_layout)
            want = ropekit.apply_rope(q.cpu().double(), positions=positions.cpu(), sections=sections,
                                      section_layout=section_layout)
            assert max_relative_error(got, want) <= 2e-6, section_layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vision_drop_in_matches_the_vision_towers_function(dtype):
    """Qwen2-VL/2.5-VL/3-VL vision towers' apply_rotary_pos_emb_vision: float32 math, outputs in the inputs'
    dtypes; the drop-in gives the same values (within one rounding) and gradients, and the original formula on
    shapes it does not take."""
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision as original

    from ropekit.integrations.transformers import apply_rotary_pos_emb_vision

    N, H, D = 20, 4, 32
    inv = 10000.0 ** -(torch.arange(0, D // 2, 2, dtype=torch.float32) / (D // 2))
    hw = torch.randint(0, 16, (N, 2)).float()
    half = torch.cat([hw[:, :1] * inv, hw[:, 1:] * inv], dim=-1)  # the tower's 2-D axial angles [N, D/2]
    emb = torch.cat([half, half], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    q = torch.randn(N, H, D, dtype=dtype, requires_grad=True)
    k = torch.randn(N, H, D, dtype=dtype, requires_grad=True)
    got = apply_rotary_pos_emb_vision(q, k, cos, sin)
    q64, k64 = q.detach().double().requires_grad_(True), k.detach().double().requires_grad_(True)
    c64, s64 = cos.double()[:, None], sin.double()[:, None]
    want = [x * c64 + torch.cat((-x[..., D // 2:], x[..., : D // 2]), -1) * s64 for x in (q64, k64)]  # in float64
    for g, w in zip(got, want):
        assert g.dtype == dtype
        assert_close_to_ref(g, w.detach(), dtype, backend="cpu")  # one rounding of the exact result
    grads = torch.autograd.grad(got, (q, k), (torch.ones_like(got[0]), torch.ones_like(got[1])))
    want_grads = torch.autograd.grad(want, (q64, k64), (torch.ones_like(want[0]), torch.ones_like(want[1])))
    for g, w in zip(grads, want_grads):
        assert_close_to_ref(g, w, dtype, backend="cpu")
    odd = torch.randn(2, N, H, D, dtype=dtype)  # a shape the drop-in does not take: the original formula
    torch.testing.assert_close(apply_rotary_pos_emb_vision(odd, odd, cos, sin)[0], original(odd, odd, cos, sin)[0],
                               rtol=0, atol=0)
