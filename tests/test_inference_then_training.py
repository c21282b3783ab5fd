"""Calls under ``torch.inference_mode()`` followed by training calls with the same arguments, as a reinforcement
learning loop runs them (generate rollouts, then train on them): what the first calls cache (the frequencies of
``base=``, multi-axis maps, attention's unit rows) must not be inference tensors, which autograd refuses to save.
Each training call's gradients are compared with the same call's after the caches are emptied."""

from __future__ import annotations

import pytest
import torch

import ropekit
from helpers import ROUTES, on_route
from ropekit import _spec, attention, float32_path
from ropekit.frequencies import formulas

# bases no other test uses, so that the first call to build their frequencies is the one under inference_mode
BASE = 4321.0
MLA_BASE = 4567.0


def _clear_caches():
    for cached in (formulas.default_inv_freq, _spec.pair_axis_tensor, attention._zeros, attention._unit):
        cached.cache_clear()
    float32_path.RECENT_TABLES.clear()
    float32_path._WORKSPACE.clear()  # this thread's float32 memory for 16-bit inputs on the CPU


def _grads(step, leaves):
    for leaf in leaves:
        leaf.grad = None
    sum(o.float().square().sum() for o in step()).backward()
    return [leaf.grad.clone() for leaf in leaves]


def _first_inference_then_training(step, leaves):
    """``step()`` under inference_mode (its outputs unused), then with autograd: the gradients, which must equal
    those of the same step with every cache built afresh outside inference mode."""
    _clear_caches()
    with torch.inference_mode():
        step()
    got = _grads(step, leaves)
    _clear_caches()
    want = _grads(step, leaves)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


CASES = {
    "apply_rope": dict(),
    "apply_rope-multi-axis": dict(sections=(2, 3, 3)),
    "apply_rope-partial-interleaved": dict(rotary_dim=8, style="interleaved"),
    # 16-bit inputs of a prefill's size: the CPU path's float32 workspace
    "bfloat16-prefill": dict(dtype=torch.bfloat16, shape=(2, 64)),
    "bfloat16-decode": dict(dtype=torch.bfloat16, shape=(4, 1)),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", CASES)
def test_apply_rope_and_qk_norm_rope_train_after_inference_calls(route, name):
    opts = dict(CASES[name], base=BASE)
    dtype, (B, S) = opts.pop("dtype", torch.float32), opts.pop("shape", (1, 3))
    with on_route(route) as dev:
        q = torch.randn(B, S, 4, 16, device=dev, dtype=dtype).requires_grad_(True)
        k = torch.randn(B, S, 2, 16, device=dev, dtype=dtype).requires_grad_(True)
        w = torch.rand(16, device=dev, dtype=dtype).add_(0.5).requires_grad_(True)
        ids = torch.arange(S, device=dev)[None].expand(B, S)
        positions = ids.expand(3, B, S) if "sections" in opts else ids
        _first_inference_then_training(lambda: ropekit.apply_rope(q, k, positions=positions, **opts), [q, k])
        _first_inference_then_training(
            lambda: ropekit.qk_norm_rope(q, k, w, w, positions=positions, **opts), [q, k, w])


@pytest.mark.parametrize("route", ROUTES)
def test_mla_trains_after_inference_calls(route):
    with on_route(route) as dev:
        q = torch.randn(3, 4, 24, device=dev).requires_grad_(True)
        k_pe = torch.randn(3, 1, 8, device=dev).requires_grad_(True)
        positions = torch.arange(3, device=dev)
        _first_inference_then_training(
            lambda: ropekit.mla_rope_kv_write(q, k_pe, positions=positions, base=MLA_BASE, style="interleaved"),
            [q, k_pe])


@pytest.mark.parametrize("route", ROUTES)
def test_rope_attention_trains_after_inference_calls(route):
    with on_route(route) as dev:
        q = torch.randn(1, 5, 4, 16, device=dev).requires_grad_(True)
        k = torch.randn(1, 5, 2, 16, device=dev).requires_grad_(True)
        v = torch.randn(1, 5, 2, 16, device=dev).requires_grad_(True)
        positions = torch.arange(5, device=dev)[None]
        _first_inference_then_training(
            lambda: (ropekit.rope_attention(q, k, v, positions=positions, base=BASE, is_causal=True),), [q, k, v])
