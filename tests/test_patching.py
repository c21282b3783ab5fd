"""Model patching: tiny random transformers models give the same logits and gradients (and greedy generations)
with and without ropekit, in fp32 and bf16; unpatch restores everything."""

from __future__ import annotations

import contextlib
import importlib
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import (  # noqa: E402
    COMMON,
    FAMILIES,
    INTERPRETED,
    VL_SECTIONS,
    forward_backward,
    no_patch_leaks,  # noqa: F401  (autouse: no test leaves a module-level function patched)
    rel_err,
    tiny_model,
    tiny_vl_model,
)
from ropekit.integrations import patching  # noqa: E402
from ropekit.integrations.patching import SUPPORTED_MODEL_TYPES, is_patched, patch, unpatch  # noqa: E402
from ropekit.testing import kernels_on_cpu  # noqa: E402


def test_supported_families_cover_the_issue():
    assert {"llama", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox", "glm", "deepseek_v3"} <= \
        set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_fp32_logits_and_gradients_match(model_type, rope_calls):
    model = tiny_model(model_type)
    ids = torch.randint(0, 128, (2, 24))
    ref_logits, ref_grads = forward_backward(model, ids)
    patch(model, prologue=False)  # the rotation alone (test_patching_fused.py has Qwen3's fused QK-norm)
    try:
        logits, grads = forward_backward(model, ids)
    finally:
        unpatch(model)
    expected_style = {"glm": "interleaved", "deepseek_v3": "interleaved"}.get(model_type, "neox")
    assert rope_calls == [expected_style] * COMMON["num_hidden_layers"]
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < 1e-5, name


@pytest.mark.parametrize("model_type", FAMILIES)
def test_bf16_within_bf16_tolerance(model_type):
    ids = torch.randint(0, 128, (2, 24))
    exact_logits, exact_grads = forward_backward(tiny_model(model_type), ids)
    model = tiny_model(model_type, torch.bfloat16)
    hf_logits, hf_grads = forward_backward(model, ids)
    patch(model)
    try:
        logits, grads = forward_backward(model, ids)
    finally:
        unpatch(model)
    # patched and unpatched bf16 agree to bf16 accuracy, and ropekit is no further from fp32 than transformers
    assert rel_err(logits, hf_logits) < 1.5e-2
    assert rel_err(logits, exact_logits) <= 1.5 * rel_err(hf_logits, exact_logits) + 2e-3
    for name, g in grads.items():
        assert rel_err(g.float(), hf_grads[name].float()) < 4e-2, name
        assert rel_err(g.float(), exact_grads[name]) <= 1.5 * rel_err(hf_grads[name].float(), exact_grads[name]) \
            + 1e-2, name


@pytest.mark.parametrize("model_type", ["llama", "phi3", "deepseek_v3", "gpt_neox"])
def test_greedy_generate_matches(model_type, rope_calls):
    model = tiny_model(model_type)
    ids = torch.randint(2, 128, (2, 12))  # 12 prompt tokens + 8 new ones cross the original length 16
    kwargs = dict(max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    ref = model.generate(ids, **kwargs)
    patch(model)
    try:
        out = model.generate(ids, **kwargs)
    finally:
        unpatch(model)
    assert len(rope_calls) == 8 * COMMON["num_hidden_layers"]  # prefill + 7 decode steps, every layer
    assert torch.equal(out, ref)


def test_dynamic_ntk_model():
    overrides = dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=16)
    model = tiny_model("llama", **overrides)
    rotary = model.model.rotary_emb
    logits = {}
    for n in (24, 10, 40):  # grow, reset, grow again: transformers' state machine on both sides
        ids = torch.randint(0, 128, (1, n))
        logits[n] = model(ids).logits
        patch(model)
        try:
            out = model(ids).logits
            rope = patching._ropekit_module(model)
            assert torch.equal(rope.inv_freq, rotary.inv_freq)  # bit for bit, grown sets included
        finally:
            unpatch(model)
        torch.testing.assert_close(out, logits[n], rtol=1e-5, atol=1e-5)


def test_gradient_checkpointing(rope_calls):
    model = tiny_model("qwen3")
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, 128, (2, 20))
    ref_logits, ref_grads = forward_backward(model, ids)
    patch(model, prologue=False)  # the rotation alone (test_patching_fused.py: the same with the fused QK-norm)
    try:
        logits, grads = forward_backward(model, ids)
    finally:
        unpatch(model)
    assert len(rope_calls) == 2 * COMMON["num_hidden_layers"]  # forward, then the recomputation
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < 1e-5, name


def test_unpatch_restores_and_unpatched_models_are_untouched(rope_calls):
    modeling = __import__("transformers.models.llama.modeling_llama", fromlist=["x"])
    original_fn = modeling.apply_rotary_pos_emb
    a, b = tiny_model("llama"), tiny_model("llama")
    ids = torch.randint(0, 128, (2, 10))
    ref_a, ref_b = a(ids).logits, b(ids).logits
    keys = set(a.state_dict())
    assert patch(a) is a and is_patched(a) and not is_patched(b)
    assert patch(a) is a  # idempotent
    assert set(a.state_dict()) == keys
    assert modeling.apply_rotary_pos_emb is not original_fn
    assert torch.equal(b(ids).logits, ref_b)  # same family, not patched: the original function ran
    assert rope_calls == []
    patch(b)
    unpatch(a)
    assert modeling.apply_rotary_pos_emb is not original_fn  # b still needs the dispatcher
    unpatch(b)
    assert modeling.apply_rotary_pos_emb is original_fn
    assert not is_patched(a) and "forward" not in a.model.rotary_emb.__dict__
    assert torch.equal(a(ids).logits, ref_a)
    assert unpatch(a) is a  # unpatching twice is harmless


def test_model_moved_after_patching_and_dtype_cast():
    model = tiny_model("mistral")
    patch(model)
    try:
        model.to(torch.float64)  # casts buffers; ropekit keeps float32 frequencies
        ids = torch.randint(0, 128, (1, 8))
        out = model(ids).logits
        assert out.dtype == torch.float64
        assert patching._ropekit_module(model).inv_freq.dtype == torch.float32
    finally:
        unpatch(model)


def test_errors():
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    with pytest.raises(ValueError, match=r"cannot patch model_type 'gpt2': patch\(model\) supports the model types \["):
        patch(transformers.GPT2LMHeadModel(config))
    with pytest.raises(TypeError, match="expects a transformers PreTrainedModel"):
        patch(torch.nn.Linear(2, 2))


_NOT_MODELS = {"None": None, "str": "llama", "int": 3, "list": [torch.nn.Linear(2, 2)],
               "config-only": types.SimpleNamespace(config=types.SimpleNamespace(model_type="llama"))}


@pytest.mark.parametrize("fn", [patch, unpatch, is_patched, patching._ropekit_module], ids=lambda f: f.__name__)
@pytest.mark.parametrize("name", sorted(_NOT_MODELS))
def test_non_models_raise_type_error_naming_the_argument(fn, name):
    with pytest.raises(TypeError, match=rf"{fn.__name__}: model must be a torch.nn.Module"):
        fn(_NOT_MODELS[name])


@pytest.mark.parametrize("model_type", ["llama", "glm"])
def test_compiled_patched_model_matches_and_traces_ropekit(model_type, rope_calls):
    """torch.compile(fullgraph=True) of a patched model: the patched attention's rotation (which finds its plan on
    the cos tensor the patched rotary module returned) is traced through ropekit, with the logits and gradients
    of the unpatched model."""
    model = tiny_model(model_type)
    ids = torch.randint(0, 128, (2, 24))
    ref_logits, ref_grads = forward_backward(model, ids)
    patch(model)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        for _ in range(2):  # the second call runs the compiled graph
            model.zero_grad(set_to_none=True)
            out = compiled(ids, labels=ids)
            out.loss.backward()
            torch.testing.assert_close(out.logits.detach().float(), ref_logits, rtol=1e-5, atol=1e-5)
            for name, p in model.named_parameters():
                if name in ref_grads:
                    assert rel_err(p.grad, ref_grads[name]) < 1e-5, name
    finally:
        unpatch(model)
        torch._dynamo.reset()
    assert len(rope_calls) >= COMMON["num_hidden_layers"]  # traced (once per layer), not bypassed


@pytest.mark.parametrize("model_type", sorted(VL_SECTIONS))
def test_vision_language_models_rotate_with_mrope(model_type, monkeypatch):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL: with time/height/width position ids that differ per axis, the patched
    language model gives the unpatched logits and gradients, and every layer's rotation ran through ropekit with
    the model's sections (contiguous for Qwen2/2.5-VL, interleaved for Qwen3-VL)."""
    model = tiny_vl_model(model_type)
    ids = torch.randint(0, 128, (2, 12))
    positions = torch.stack([torch.arange(12).expand(2, 12), torch.randint(0, 40, (2, 12)),
                             torch.randint(0, 40, (2, 12))])

    def forward_backward_vl():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, position_ids=positions, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.logits.detach(), grads

    ref_logits, ref_grads = forward_backward_vl()
    seen = []
    original = patching.apply_rope

    def spy(*args, **kwargs):
        seen.append((kwargs.get("sections"), kwargs.get("section_layout")))
        return original(*args, **kwargs)

    monkeypatch.setattr(patching, "apply_rope", spy)
    patch(model)
    try:
        logits, grads = forward_backward_vl()
    finally:
        unpatch(model)
    layout = "interleaved" if model_type == "qwen3_vl" else "contiguous"
    assert seen == [(tuple(VL_SECTIONS[model_type]), layout)] * 2
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < 1e-5, name


@pytest.mark.parametrize("model_type", sorted(VL_SECTIONS))
def test_vision_language_greedy_generate_matches(model_type, rope_calls):
    """Greedy generation of a patched Qwen2-VL, Qwen2.5-VL or Qwen3-VL from a text prompt: the tokens of the
    unpatched model, with the prefill and every decode step's rotation sent through ropekit's multi-axis call and
    run by its Triton kernels (the interpreter, in CPU-only runs). transformers passes materialised [3, B, S]
    positions, one position on every axis for the decode steps."""
    model = tiny_vl_model(model_type)
    ids = torch.randint(2, 128, (2, 6))
    kwargs = dict(max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    ref = model.generate(ids, **kwargs)
    patch(model)
    try:
        with kernels_on_cpu() if INTERPRETED else contextlib.nullcontext():
            out = model.generate(ids, **kwargs)
    finally:
        unpatch(model)
    assert len(rope_calls) == 4 * 2  # prefill + 3 decode steps, both layers
    assert torch.equal(out, ref)


def _one_image(model, device="cpu", requires_grad=False):
    """Pixels of one image of 4 x 6 patches for ``model``'s vision tower, and its grid_thw."""
    vision = model.model.visual.config
    pixels = torch.randn(24, vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2,
                         device=device, requires_grad=requires_grad)
    return pixels, torch.tensor([[1, 4, 6]], device=device)


def _vision_forward_backward(model, pixels, grid):
    """The vision tower's output for one image and the gradients of a weighted sum of it (pixels and weights)."""
    model.zero_grad(set_to_none=True)
    pixels.grad = None
    out = model.model.visual(pixels, grid_thw=grid).last_hidden_state
    (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), pixels.grad.clone(), grads


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("model_type", sorted(VL_SECTIONS))
def test_vision_towers_rotate_by_their_patch_ids(model_type, device, monkeypatch):
    """Qwen2-VL's and Qwen3-VL's vision towers (transformers 5.x: (h, w) ids [N, 2] -> [N, D] tables): the patched
    tower gives the unpatched output and gradients, each layer's rotation ran through ropekit as two contiguous
    sections over the (h, w) ids of a 4 x 6 patch grid, and an unpatched model of the family still runs
    transformers' function. Qwen2.5-VL reorders its tables for window attention: its tower is left alone."""
    model, other = tiny_vl_model(model_type).to(device), tiny_vl_model(model_type).to(device)
    vision = model.model.visual.config
    torch.manual_seed(0)
    pixels, grid = _one_image(model, device, requires_grad=True)
    ref_out, ref_pixel_grad, ref_grads = _vision_forward_backward(model, pixels, grid)
    calls = []
    original = patching.apply_rope

    def spy(*args, **kwargs):
        calls.append((kwargs.get("layout"), kwargs.get("sections"), tuple(kwargs["positions"].shape)))
        return original(*args, **kwargs)

    monkeypatch.setattr(patching, "apply_rope", spy)
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    original_function = modeling.apply_rotary_pos_emb_vision
    patch(model)
    try:
        with kernels_on_cpu() if INTERPRETED and device == "cpu" else contextlib.nullcontext():
            out, pixel_grad, grads = _vision_forward_backward(model, pixels, grid)
        seen = len(calls)
        other_out = _vision_forward_backward(other, pixels, grid)[0]  # same weights, not patched
        assert len(calls) == seen and torch.equal(other_out, ref_out)
    finally:
        unpatch(model)
    assert modeling.apply_rotary_pos_emb_vision is original_function
    pairs_per_axis = model.model.visual.rotary_pos_emb.inv_freq.numel()  # head_dim / 4
    expected = [] if model_type == "qwen2_5_vl" else [("thd", (pairs_per_axis,) * 2, (2, 24))] * vision.depth
    assert calls == expected
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    assert rel_err(pixel_grad, ref_pixel_grad) < 1e-5
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < 1e-5, name


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl"])
def test_compiled_patched_vision_tower_matches(model_type, rope_calls):
    """torch.compile of a patched vision tower (with graph breaks: transformers' own position-id code reads
    grid_thw on the host, so even the unpatched tower has no full graph) gives the unpatched output, with the
    rotation traced through ropekit."""
    model = tiny_vl_model(model_type)
    vision = model.model.visual
    pixels, grid = _one_image(model)
    with torch.no_grad():
        ref = vision(pixels, grid_thw=grid).last_hidden_state
    patch(model)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(vision, backend="aot_eager")
        with torch.no_grad():
            for _ in range(2):  # the second call runs the compiled code
                out = compiled(pixels, grid_thw=grid).last_hidden_state
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    finally:
        unpatch(model)
        torch._dynamo.reset()
    assert rope_calls  # traced through ropekit, not bypassed
