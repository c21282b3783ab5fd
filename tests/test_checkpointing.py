"""Activation checkpointing: a recomputed forward saves exactly what the original forward saved, whichever route
(full path or a replayed launch plan) each of them takes.

Non-reentrant checkpointing (torch's default, and transformers' ``gradient_checkpointing_enable``) recomputes each
checkpointed region in the backward and compares the number and metadata of the tensors it saves with the
original forward's. With plans, the first calls of a signature take the full path and later ones a plan, so the
recomputation of an early layer takes a different route from its original forward. Three checkpointed layers of
one signature cover both orders; clearing the plans between forward and backward covers the reverse. Gradients
are compared with the same layers run without checkpointing.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import ropekit
from helpers import INTERPRETED
from ropekit import _fastpath
from ropekit.float32_path import POSITION_TABLES, RECENT_TABLES
from ropekit.testing import kernels_on_cpu, tolerance

# Routes: "cpu" runs the kernels under the interpreter, "cpu-float32" the CPU float32 path (its kept tables
# included), "cuda" the kernels on a GPU.
DEVICES = [
    pytest.param("cpu", id="cpu-kernels",
                 marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")),
    pytest.param("cpu-float32", id="cpu-float32"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
SHAPES = {"cpu": (2, 6, 4, 2, 16), "cpu-float32": (2, 6, 4, 2, 16), "cuda": (2, 256, 32, 8, 128)}  # B, S, Hq, Hk, D
LAYERS = 3


def _context(device: str):
    return kernels_on_cpu() if device == "cpu" else contextlib.nullcontext()


def _device(route: str) -> str:
    return "cuda" if route == "cuda" else "cpu"


def _rope_options(case: str, device: str, B: int, S: int, D: int) -> dict:
    """The keyword arguments of one call signature: each spec tensor a view of an option, a copy-free table,
    the cached default frequencies, or multi-axis ids."""
    if case == "ids":
        return dict(positions=torch.randint(0, 1000, (B, S), device=device))
    if case == "ids-row":  # [1, S]: the spec holds it broadcast over the batch
        return dict(positions=torch.randint(0, 1000, (1, S), device=device))
    if case == "base":
        return dict(base=500000.0)
    if case == "offset":
        return dict(positions=7, inv_freq=1.0 / (10000.0 ** (torch.arange(0, D, 2, device=device) / D)))
    if case == "seq-offsets":
        return dict(positions=torch.tensor([3, 11], device=device)[:B])
    if case == "table":
        angles = torch.arange(64, device=device, dtype=torch.float64)[:, None] * torch.rand(D // 2, device=device)
        return dict(positions=torch.randint(0, 64, (B, S), device=device), cos=angles.cos().float(),
                    sin=angles.sin().float())
    if case == "varlen":
        return dict(layout="thd", cu_seqlens=torch.tensor([0, 2, B * S], device=device, dtype=torch.int32),
                    positions=torch.tensor([5, 0], device=device))
    if case == "multi-axis":
        return dict(positions=torch.randint(0, 100, (3, B, S), device=device), sections=(D // 8, D // 8, D // 4))
    raise AssertionError(case)


ROPE_CASES = ["ids", "ids-row", "base", "offset", "seq-offsets", "table", "varlen", "multi-axis"]


def _inputs(case: str, route: str, dtype=torch.float32):
    B, S, HQ, HK, D = SHAPES[route]
    device = _device(route)
    lead = (B * S,) if case == "varlen" else (B, S)
    q = torch.randn(*lead, HQ, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(*lead, HK, D, device=device, dtype=dtype, requires_grad=True)
    return q, k, _rope_options(case, device, B, S, D)


def _layers(layer, q, k, checkpointed: bool, reset_between: bool = False):
    """``LAYERS`` applications of ``layer`` (each checkpointed, or not), then the gradients of a fixed weighting
    of the outputs; ``reset_between`` forgets every plan before the backward (its recomputations then take the
    full path where the forward took plans)."""
    a, b = q * 1, k * 1
    for _ in range(LAYERS):
        if checkpointed:
            a, b = checkpoint(layer, a, b, use_reentrant=False)
        else:
            a, b = layer(a, b)
    weight_a, weight_b = torch.linspace(-1, 1, a.numel()).view_as(a), torch.linspace(1, 2, b.numel()).view_as(b)
    loss = (a.float() * weight_a.to(a.device)).sum() + (b.float() * weight_b.to(b.device)).sum()
    if reset_between:
        _fastpath.clear()
        POSITION_TABLES.clear()
        RECENT_TABLES.clear()
    return torch.autograd.grad(loss, (q, k))


def _check_grads(got, want, dtype):
    tol = tolerance(dtype)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tol.rtol, atol=tol.atol * LAYERS)


def _checkpointed_equals_plain(layer, q, k, reset: bool) -> None:
    """The checkpointed layers' gradients equal the plain layers', with fresh plans and then with the plans the
    first round recorded."""
    _fastpath.clear()
    want = _layers(layer, q, k, checkpointed=False)
    _fastpath.clear()
    for _round in range(2):
        got = _layers(layer, q, k, checkpointed=True, reset_between=reset)
        _check_grads(got, want, q.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reset", [False, True], ids=["plans-then-recompute", "plans-forgotten-before-backward"])
@pytest.mark.parametrize("case", ROPE_CASES)
def test_apply_rope_under_non_reentrant_checkpointing(case, reset, device):
    with _context(device):
        q, k, options = _inputs(case, device)

        def layer(a, b):
            return ropekit.apply_rope(a, b, **options)

        _checkpointed_equals_plain(layer, q, k, reset)


NORM_CASES = ["base", "ids", "offset", "multi-axis", "varlen"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reset", [False, True], ids=["plans-then-recompute", "plans-forgotten-before-backward"])
@pytest.mark.parametrize("case", NORM_CASES)
def test_qk_norm_rope_under_non_reentrant_checkpointing(case, reset, device):
    with _context(device):
        q, k, options = _inputs(case, device)
        D = q.shape[-1]
        q_weight = torch.rand(D, device=_device(device), requires_grad=True)
        k_weight = torch.rand(D, device=_device(device), requires_grad=True)

        def layer(a, b):
            return ropekit.qk_norm_rope(a, b, q_weight, k_weight, **options)

        _checkpointed_equals_plain(layer, q, k, reset)


@pytest.mark.parametrize("device", DEVICES)
def test_checkpointed_bf16_layers_keep_the_saved_metadata(device):
    """bf16 inputs with per-token ids (a training step's usual call): torch's default determinism check compares
    the shape, dtype and device of every saved tensor; the recomputation must match them exactly."""
    with _context(device):
        q, k, options = _inputs("ids", device, dtype=torch.bfloat16)

        def layer(a, b):
            return ropekit.apply_rope(a, b, **options)

        _fastpath.clear()
        want = _layers(layer, q, k, checkpointed=False)
        got = _layers(layer, q, k, checkpointed=True)
        _check_grads(got, want, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_patched_model_with_gradient_checkpointing(device):
    """transformers' ``gradient_checkpointing_enable`` (non-reentrant) on a patched tiny Qwen3 of three layers
    whose rotations run the kernels: logits and gradients as unpatched."""
    transformers = pytest.importorskip("transformers")
    from ropekit.integrations.patching import patch, unpatch

    config = transformers.AutoConfig.for_model(
        "qwen3", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config).to(_device(device))
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, 128, (2, 12), device=_device(device))

    def forward_backward():
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                     if p.grad is not None}

    want_logits, want_grads = forward_backward()
    patch(model)
    try:
        with _context(device):
            _fastpath.clear()
            for _ in range(2):  # fresh plans, then plans recorded by the first step
                logits, grads = forward_backward()
                torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
                assert grads.keys() == want_grads.keys()
                for name, g in grads.items():
                    torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    finally:
        unpatch(model)
