"""The rope kernel forms addresses in int32 where every element offset of every tensor it reads or writes fits in
31 bits, and in int64 otherwise (``INDEX_64``). The two are the same arithmetic on the data, so every kind of call
must give bit-identical results both ways; the launcher must pick int64 for any tensor that needs it."""

from __future__ import annotations

import pytest
import torch

import ropekit
from helpers import KERNEL_ROUTES, route_context, route_device
from ropekit._spec import validate
from ropekit.reference import rope_reference
from ropekit.testing import assert_close_to_ref, int64_offsets
from ropekit.triton import launcher
from ropekit.triton.launcher import needs_int64_offsets


def _meta(shape, stride, dtype=torch.float32):
    return torch.empty_strided(shape, stride, device="meta", dtype=dtype)


def test_int64_exactly_from_an_offset_of_2_to_the_31():
    assert not needs_int64_offsets(_meta((2, 8, 4, 64), (2048, 256, 64, 1)))
    assert not needs_int64_offsets(_meta((2,), (2**31 - 1,)))  # largest offset 2**31 - 1
    assert needs_int64_offsets(_meta((2,), (2**31,)))
    assert needs_int64_offsets(None, _meta((1, 3), (5, 1)), _meta((3, 2**30), (2**30, 1)))
    assert not needs_int64_offsets(_meta((0, 3), (2**40, 1)))  # empty: no offset is ever formed
    assert not needs_int64_offsets(_meta((2**20, 4), (0, 1)))  # broadcast (stride 0) views stay small
    with int64_offsets():
        assert needs_int64_offsets(_meta((2, 2), (2, 1)))
    assert not needs_int64_offsets(_meta((2, 2), (2, 1)))


@pytest.mark.parametrize("which", ["q", "k", "q_out", "positions", "table"])
def test_the_launch_is_int64_when_any_tensor_needs_it(which):
    # Shapes and strides only (meta tensors): the launch's INDEX_64 follows the one tensor past 2**31.
    big = {"q": (2**31, 8 * 64, 64, 1), "k": (2**31, 64, 64, 1), "q_out": (2**31, 8 * 64, 64, 1)}
    q = _meta((2, 8, 1, 64), big["q"] if which == "q" else (8 * 64, 64, 64, 1))
    k = _meta((2, 8, 1, 64), big["k"] if which == "k" else (8 * 64, 64, 64, 1))
    q_out = _meta((2, 8, 1, 64), big["q_out"] if which == "q_out" else (8 * 64, 64, 64, 1))
    options = {}
    if which == "positions":
        options["positions"] = _meta((2, 8), (2**31, 1), torch.int64)
    if which == "table":
        # position-indexed [rows, R/2] tables whose last row starts 2**32 elements in
        options.update(cos=_meta((2**22, 32), (2**10, 1)), sin=_meta((2**22, 32), (2**10, 1)),
                       positions=_meta((2, 8), (8, 1), torch.int64))
    spec = validate(q, k, check_positions=False, **options)
    constexprs = launcher.kernel_launch(q, k, q_out, torch.empty_like(k), spec)[2]
    assert dict(zip(launcher._CONSTEXPR_NAMES, constexprs))["INDEX_64"]
    small = launcher.kernel_launch(q[:, :1], k[:, :1], q[:, :1], k[:, :1], validate(q[:, :1], k[:, :1]))
    assert not dict(zip(launcher._CONSTEXPR_NAMES, small[2]))["INDEX_64"] or which in ("q", "k")


def _calls(device):
    """(name, fn) of calls that span the kernel's addressing: each position mode, layouts and views, tables,
    multi-axis positions, partial rotary with pass-through columns, in place, and the backward."""
    B, S, HQ, HK, D = 2, 5, 3, 2, 32
    q = torch.randn(B, S, HQ, D, device=device)
    k = torch.randn(B, S, HK, D, device=device)
    qkv = torch.randn(B, S, HQ + 2 * HK, D, device=device)  # packed projections: strided views
    pos = torch.randint(0, 4000, (B, S), device=device)
    ang = torch.outer(torch.arange(64, device=device, dtype=torch.float64), torch.rand(D // 2, device=device,
                                                                                          dtype=torch.float64))
    cos, sin = ang.cos().float(), ang.sin().float()
    full_cos, full_sin = torch.cat([cos, cos], -1)[None, :S], torch.cat([sin, sin], -1)[None, :S]
    cu = torch.tensor([0, 3, 7, 10], device=device, dtype=torch.int32)
    mrope = torch.randint(0, 500, (3, B, S), device=device)

    def backward():
        ql, kl = q.clone().requires_grad_(), k.clone().requires_grad_()
        out = ropekit.apply_rope(ql, kl, positions=pos)
        torch.autograd.backward(out, (torch.ones_like(out[0]), torch.ones_like(out[1])))
        return ql.grad, kl.grad

    def in_place():
        qc, kc = q.clone(), k.clone()
        return ropekit.apply_rope_(qc, kc, positions=7, style="interleaved")

    return {
        "int offset": lambda: ropekit.apply_rope(q, k, positions=11),
        "per-sequence offsets": lambda: ropekit.apply_rope(q, k, positions=torch.tensor([3, 900], device=device)),
        "per-token positions": lambda: ropekit.apply_rope(q, k, positions=pos),
        "bhsd views": lambda: ropekit.apply_rope(q.transpose(1, 2), k.transpose(1, 2), positions=pos, layout="bhsd"),
        "packed qkv": lambda: ropekit.apply_rope(qkv[:, :, :HQ], qkv[:, :, HQ:HQ + HK], positions=pos),
        "varlen": lambda: ropekit.apply_rope(q[0, :, :, :].repeat(2, 1, 1), k[0].repeat(2, 1, 1), layout="thd",
                                             cu_seqlens=cu),
        "position table": lambda: ropekit.apply_rope(q, k, positions=pos % 64, cos=cos, sin=sin),
        "transformers tables": lambda: ropekit.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos=full_cos,
                                                          sin=full_sin, layout="bhsd"),
        "M-RoPE": lambda: ropekit.apply_rope(q, k, positions=mrope, sections=(4, 6, 6)),
        "M-RoPE interleaved": lambda: ropekit.apply_rope(q, k, positions=mrope, sections=(4, 6, 6),
                                                         section_layout="interleaved"),
        "partial rotary": lambda: ropekit.apply_rope(q, k, positions=pos, rotary_dim=12, rotary_at="back",
                                                     q_scale=0.5),
        "in place": in_place,
        "backward": backward,
    }


@pytest.mark.parametrize("route", KERNEL_ROUTES)
def test_int32_and_int64_addresses_give_identical_results(route):
    with route_context(route):
        calls = _calls(route_device(route))
        for name, fn in calls.items():
            torch.manual_seed(0)
            narrow = [fn(), fn()]  # the second call replays a launch plan
            with int64_offsets():
                wide = [fn(), fn()]
            for got, want in zip(narrow, wide):
                for a, b in zip(got, want):
                    assert torch.equal(a, b), name


@pytest.mark.gpu
def test_offsets_past_2_to_the_31_on_cuda():
    # q's second sequence starts 2**31 elements into a 4.3 GB buffer: int32 addresses would wrap.
    big = torch.empty(2**31 + 1024, dtype=torch.bfloat16, device="cuda")
    q = big.as_strided((2, 4, 2, 64), (2**31, 128, 64, 1))
    q.copy_(torch.randn(q.shape, device="cuda", dtype=torch.bfloat16))
    k = torch.randn(2, 4, 1, 64, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 5000, (2, 4), device="cuda")
    assert needs_int64_offsets(q)
    q_ref, k_ref = q.clone(), k.clone()
    spec = validate(q_ref.double().cpu(), k_ref.double().cpu(), positions=pos.cpu())
    want_q, want_k = rope_reference(q_ref.double().cpu(), k_ref.double().cpu(), spec)
    for out_q, out_k in (ropekit.apply_rope(q, k, positions=pos), ropekit.apply_rope(q, k, positions=pos),
                         ropekit.apply_rope_(q, k.clone(), positions=pos)):
        assert_close_to_ref(out_q, want_q, torch.bfloat16, "kernels")
        assert_close_to_ref(out_k, want_k, torch.bfloat16, "kernels")
    del big
