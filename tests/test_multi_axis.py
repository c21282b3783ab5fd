"""Multi-axis positions (M-RoPE): ``positions`` [A, B, S] with ``sections`` pairs per axis, contiguous (Qwen2-VL,
Qwen2.5-VL) or interleaved (Qwen3-VL), on the float64 reference and on the kernels (the Triton interpreter on CPU),
fast path included, against transformers' own pair -> axis layouts."""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import pytest
import torch

import ropekit
from ropekit._spec import pair_axis_map
from ropekit.testing import assert_close_to_ref, kernels_on_cpu, make_qk

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", id="cpu-kernels",
                 marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
LAYOUTS = {"contiguous": (16, 24, 24), "interleaved": (24, 20, 20)}  # Qwen2-VL's and Qwen3-VL's, D = 128


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
    sections = LAYOUTS[section_layout] if device == "cuda" else tuple(n // 4 for n in LAYOUTS[section_layout])
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
    (dict(positions=torch.zeros(3, 2, 5, dtype=torch.long), sections=(2, 8, 6), section_layout="interleaved"),
     ValueError, "do not fit"),
    (dict(section_layout="interleaved"), ValueError, "give sections= too"),
    (dict(positions=torch.zeros(3, 2, 5, dtype=torch.long), sections="864"), TypeError, "sections must be"),
    (dict(positions=torch.zeros(3, 2, 5, dtype=torch.long), sections=(8.0, 4, 4)), ValueError, "ints >= 0"),
    (dict(positions=torch.tensor([[[0, 1, 2, 3, 4]] * 2, [[0, 1, 2, 3, -1]] * 2, [[0] * 5] * 2]), sections=(8, 4, 4)),
     IndexError, "must be >= 0"),
])
def test_bad_multi_axis_arguments_name_themselves(kwargs, error, match):
    q = torch.randn(2, 5, 2, 32)
    before = q.clone()
    with pytest.raises(error, match=match):
        ropekit.apply_rope_(q, **kwargs)
    assert torch.equal(q, before)
