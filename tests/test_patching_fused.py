"""patch(): the fused attention forwards (ropekit.integrations.attention_forward) on tiny random models.

* The prologue (default on): Qwen3, Qwen3-MoE, Qwen3-Next (gated heads, partial rotary, Gemma-style norm) and
  Gemma 3 (sliding and full layers, ``(1 + w)`` norm) normalise and rotate q and k in one ``qk_norm_rope``, and
  with a ``StaticCache`` also write the cache in one ``rope_kv_write``: logits and gradients as unpatched (fp32,
  1e-5), the same greedy tokens with the dynamic and the static cache (left padding included: the cache row and the
  rotation's position then differ), unpatch restores the model bit for bit. Each test counts the fused calls, so a
  patch that silently fell back fails.
* ``attention=True``: Llama and Qwen3 (sdpa) run rotation and attention in one ``rope_attention`` in training and
  prefill (with and without a cache to fill), the same logits, gradients, cache contents and tokens; a padding mask
  or a sliding window takes the usual path.
* The guards: attention forwards are recognised by their code (a changed forward is not patched), QK-norm modules
  by their behaviour.
* torch.compile(fullgraph=True) traces the fused forwards through the fused ops (training, and a static-cache
  decode step); on a GPU, generate's own compiled static-cache decode.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import (  # noqa: E402
    ROUTES,
    no_patch_leaks,  # noqa: F401  (autouse: no test leaves a module-level function patched)
    rel_err,
    route_context,
    route_device,
)
from ropekit.integrations import attention_forward, patching  # noqa: E402
from ropekit.integrations.patching import is_patched, patch, unpatch  # noqa: E402

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=1)
TINY = {
    "llama": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen3_next": dict(head_dim=16, partial_rotary_factor=0.25, layer_types=["linear_attention", "full_attention"],
                       linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                       linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32),
    "gemma3_text": dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                            "factor": 8.0}}),
}
TINY.update({
    # per-head QK-norm after the transpose, as Gemma 3's, with Llama's RMSNorm
    "apertus": dict(),
    # QK-norm behind use_qk_norm, half of each head rotated
    "glm4_moe": dict(head_dim=16, partial_rotary_factor=0.5, n_routed_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1, use_qk_norm=True),
    # the families that share Llama's, Mistral's, Qwen2's or Qwen3's attention code
    "arcee": dict(), "granite": dict(), "mistral": dict(sliding_window=None), "qwen2": dict(),
    "cwm": dict(head_dim=16, layer_types=["full_attention", "full_attention"]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "gemma": dict(head_dim=16), "nemotron": dict(partial_rotary_factor=0.5),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    # Llama's attention code with interleaved pairs (GLM: half of each head; ERNIE: float32 tables, fp32 here)
    "glm": dict(head_dim=16, partial_rotary_factor=0.5), "glm4": dict(head_dim=16, partial_rotary_factor=0.5),
    "ernie4_5": dict(head_dim=16),
    # GLM-4.5 MoE's attention code, Cohere's repeated-pairs tables and LayerNorm QK-norm: not fused
    "cohere": dict(use_qk_norm=True),
})
PROLOGUE_FAMILIES = ["qwen3", "qwen3_moe", "qwen3_next", "gemma3_text", "apertus", "glm4_moe"]
ATTENTION_FAMILIES = ["llama", "qwen3"]


def _tiny(model_type: str, attn: str = "eager", **overrides):
    config = transformers.AutoConfig.for_model(model_type, **BASE, **{**TINY[model_type], **overrides})
    config._attn_implementation = attn
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # norm weights away from their init (ones, or zeros for (1 + w)): a wrong offset shows
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.add_(0.3 * torch.randn_like(p))
    return model


def _attention_layers(model) -> int:
    return sum(1 for m in model.modules() if type(m).__name__.endswith("Attention")
               and type(m).__module__.startswith("transformers.models") and hasattr(m, "q_proj"))


@pytest.fixture
def fused_calls(monkeypatch):
    """How often the fused forwards called each fused op."""
    calls = {"qk_norm_rope": 0, "rope_kv_write": 0, "rope_attention": 0}
    for name in calls:
        original = getattr(attention_forward, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(attention_forward, name, spy)
    return calls


def _forward_backward(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def _assert_same(logits, grads, ref_logits, ref_grads):
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < 1e-5, name


def _cache(model, cache) -> dict:
    """The model keyword that hands it ``cache``: ``cache`` (transformers 5.24) or ``past_key_values`` (5.17, where
    a ``cache=`` keyword would pass silently into ``**kwargs``, and no cache be used at all)."""
    parameters = inspect.signature(type(model).forward).parameters
    name = "cache" if "cache" in parameters else "past_key_values"
    assert name in parameters
    return {name: cache}


def _generate(model, ids, mask=None, **kwargs):
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, **kwargs)


@contextlib.contextmanager
def _patched(model, **switches):
    patch(model, **switches)
    try:
        yield model
    finally:
        unpatch(model)


# ------------------------------------------------------------------------------------------------ the prologue


@pytest.fixture
def table_builds(monkeypatch):
    """Counts the builds of the patched rotary module's lazy cos/sin tables (the fused forwards read none)."""
    calls = []
    original = patching.hf_tables

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(patching, "hf_tables", spy)
    return calls


@pytest.mark.parametrize("model_type", PROLOGUE_FAMILIES)
def test_prologue_matches_unpatched(model_type, fused_calls, table_builds):
    model = _tiny(model_type)
    layers = _attention_layers(model)
    ids = torch.randint(2, 128, (2, 20))
    ref_logits, ref_grads = _forward_backward(model, ids)
    ref_tokens = _generate(model, ids[:, :8])
    table_builds.clear()
    with _patched(model):
        assert len(attention_forward.fused_modules(model)) == layers > 0
        logits, grads = _forward_backward(model, ids)
        assert fused_calls["qk_norm_rope"] == layers  # every attention layer normalised and rotated in one op
        tokens = _generate(model, ids[:, :8])
        assert fused_calls["qk_norm_rope"] == layers * 6  # prefill and 4 decode steps with the dynamic cache
    assert table_builds == []
    _assert_same(logits, grads, ref_logits, ref_grads)
    assert torch.equal(tokens, ref_tokens)
    # unpatch restores the attention modules and the logits bit for bit
    assert not is_patched(model) and not attention_forward.fused_modules(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    again, _ = _forward_backward(model, ids)
    assert torch.equal(again, ref_logits)


def test_prologue_under_gradient_checkpointing(fused_calls):
    model = _tiny("qwen3")
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(2, 128, (2, 12))
    ref_logits, ref_grads = _forward_backward(model, ids)
    with _patched(model):
        logits, grads = _forward_backward(model, ids)
    assert fused_calls["qk_norm_rope"] == 2 * 2  # the forward, then the recomputation, each layer
    _assert_same(logits, grads, ref_logits, ref_grads)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("model_type, switches", [("qwen3", {}), ("gemma3_text", {}), ("llama", {"attention": True}),
                                                  ("qwen3", {"attention": True})], ids=str)
def test_bf16_keeps_dtypes_and_accuracy(model_type, switches, device, fused_calls):
    """bf16: the fused norm and rotation round once (transformers rounds the normalised q and k, then the rotated
    ones, with bf16 tables), rope_attention accumulates in fp32, so the logits are bf16 and at least about as close
    to the fp32 model's as transformers' own."""
    ids = torch.randint(2, 128, (2, 16), device=device)
    with torch.no_grad():
        exact = _tiny(model_type, attn="sdpa").to(device)(ids).logits
        model = _tiny(model_type, attn="sdpa").to(device, torch.bfloat16)
        ref = model(ids).logits
        with _patched(model, **switches):
            out = model(ids).logits
    op = "rope_attention" if switches else "qk_norm_rope"
    assert fused_calls[op] == 2 and out.dtype == ref.dtype == torch.bfloat16
    assert rel_err(out.float(), ref.float()) < 2e-2
    assert rel_err(out.float(), exact) <= 1.5 * rel_err(ref.float(), exact) + 2e-3


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "qwen3_next", "gemma3_text", "apertus", "glm4_moe"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_static_cache_writes_through_rope_kv_write(model_type, padded, fused_calls):
    """cache_implementation="static": each full-attention layer's norm, rotation and K/V write is one
    rope_kv_write (Qwen3-Next's through its hybrid cache layer; Gemma 3's sliding layers, whose cache layer is a
    sliding one, keep qk_norm_rope and the cache's update); the same tokens as unpatched, with left padding too
    (position ids then lag the cache rows)."""
    model = _tiny(model_type)
    ids = torch.randint(2, 128, (2, 8))
    mask = torch.ones_like(ids)
    if padded:
        ids[0, :3], mask[0, :3] = 0, 0
    ref = _generate(model, ids, mask, cache_implementation="static")
    with _patched(model):
        tokens = _generate(model, ids, mask, cache_implementation="static")
    assert torch.equal(tokens, ref)
    layer_types = getattr(model.config, "layer_types", None) or ["full_attention"] * 2
    assert fused_calls["rope_kv_write"] == 5 * layer_types.count("full_attention")  # prefill and 4 decode steps
    assert fused_calls["qk_norm_rope"] == 5 * layer_types.count("sliding_attention")  # (Qwen3-Next: 1 linear)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_static_cache_contents_match(padded, route, fused_calls):
    """The static cache a patched prefill and decode step write holds what StaticLayer.update writes (rows, values,
    the filled length), and nothing past the written rows. With left padding the keys are rotated by the position
    ids, not by the cache rows (generated tokens could not tell: shifting every position of a sequence leaves its
    attention unchanged, but the stored keys differ). On every route: the paged write into the transposed view of
    the layer's tensors runs the kernels too."""
    device = route_device(route)
    model = _tiny("qwen3").to(device)
    ids = torch.randint(2, 128, (2, 7), device=device)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    caches = []
    for patched in (False, True):
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad(), (_patched(model) if patched else contextlib.nullcontext()), route_context(route):
            model(ids[:, :6], position_ids=positions[:, :6], **_cache(model, cache), use_cache=True)
            model(ids[:, 6:], position_ids=positions[:, 6:], **_cache(model, cache), use_cache=True)
        caches.append(cache)
    assert fused_calls["rope_kv_write"] == 4
    for i, (want, got) in enumerate(zip(*(c.layers for c in caches))):
        assert int(got.cumulative_length) == int(want.cumulative_length) == 7
        torch.testing.assert_close(got.keys, want.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-5)
        assert i > 0 or torch.equal(got.values, want.values)  # v is copied bit for bit (later layers' inputs differ)
        assert not got.keys[:, :, 7:].any() and not got.values[:, :, 7:].any()


def test_static_cache_overflow_raises_and_writes_nothing(fused_calls):
    """Writing past a static cache's end raises IndexError (StaticLayer.update's index_copy_ raises too) before
    any row or the filled length changes."""
    model = _tiny("qwen3")
    ids = torch.randint(2, 128, (1, 6))
    cache = transformers.StaticCache(config=model.config, max_cache_len=6)
    with torch.no_grad(), _patched(model):
        model(ids[:, :5], **_cache(model, cache), use_cache=True)
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        with pytest.raises(IndexError, match="static cache holds 6 tokens per sequence"):
            model(ids[:, 4:], position_ids=torch.arange(5, 7)[None], **_cache(model, cache), use_cache=True)
    assert fused_calls["rope_kv_write"] == 2
    assert int(cache.layers[0].cumulative_length) == 5
    for layer, (keys, values) in zip(cache.layers, before):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_static_cache_keeps_update_where_gradients_are_needed(fused_calls):
    """rope_kv_write is inference only: a static cache filled with autograd on takes qk_norm_rope and the cache's
    own update, with the unpatched logits."""
    model = _tiny("qwen3")
    ids = torch.randint(2, 128, (1, 6))
    caches = [transformers.StaticCache(config=model.config, max_cache_len=8) for _ in range(2)]
    ref = model(ids, **_cache(model, caches[0]), use_cache=True).logits
    with _patched(model):
        out = model(ids, **_cache(model, caches[1]), use_cache=True).logits
    assert fused_calls["rope_kv_write"] == 0 and fused_calls["qk_norm_rope"] == 2
    assert [int(layer.cumulative_length) for layer in caches[1].layers] == [6, 6]  # the cache was used
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_prologue_off_keeps_the_rotation_only_patch(fused_calls, rope_calls):
    model = _tiny("qwen3")
    ids = torch.randint(2, 128, (2, 10))
    ref = model(ids).logits
    with _patched(model, prologue=False):
        assert not attention_forward.fused_modules(model)
        out = model(ids).logits
    assert fused_calls["qk_norm_rope"] == 0 and rope_calls == ["neox", "neox"]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_repatching_applies_new_switches(fused_calls):
    model = _tiny("qwen3")
    ids = torch.randint(2, 128, (1, 6))
    with _patched(model, prologue=False):
        assert not attention_forward.fused_modules(model)
        patch(model)
        assert len(attention_forward.fused_modules(model)) == 2
        model(ids)
    assert fused_calls["qk_norm_rope"] == 2


@pytest.mark.parametrize("bad", [{"prologue": 1}, {"attention": "yes"}])
def test_switches_must_be_bools(bad):
    model = _tiny("qwen3")
    with pytest.raises(TypeError, match=f"patch: {next(iter(bad))} must be a bool"):
        patch(model, **bad)
    assert not is_patched(model)


# ------------------------------------------------------------------------------------------ rope_attention


@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("model_type", ATTENTION_FAMILIES)
@pytest.mark.parametrize("route", ROUTES)
def test_attention_route_matches_unpatched(model_type, use_cache, route, fused_calls):
    """Training steps through rope_attention (sdpa, causal, no padding): the same logits and gradients; with a
    cache to fill (use_cache=True), the cache holds the rotated keys and the values as unpatched. On every route
    (cpu-kernels: rope_attention's kernels under the interpreter)."""
    device = route_device(route)
    model = _tiny(model_type, attn="sdpa").to(device)
    ids = torch.randint(2, 128, (2, 12), device=device)
    ref_logits, ref_grads = _forward_backward(model, ids, use_cache=use_cache)
    ref_cache = model(ids, use_cache=True).past_key_values if use_cache else None
    with _patched(model, attention=True), route_context(route):
        logits, grads = _forward_backward(model, ids, use_cache=use_cache)
        assert fused_calls["rope_attention"] == 2
        cache = model(ids, use_cache=True).past_key_values if use_cache else None
    _assert_same(logits, grads, ref_logits, ref_grads)
    if use_cache:
        for want, got in zip(ref_cache.layers, cache.layers):
            torch.testing.assert_close(got.keys, want.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-5)
    assert fused_calls["qk_norm_rope"] == 0  # Qwen3's norms ran as modules, before rope_attention
    assert all("forward" not in m.__dict__ for m in model.modules())
    again, _ = _forward_backward(model, ids, use_cache=use_cache)
    assert torch.equal(again, ref_logits)  # unpatch restores the model bit for bit


@pytest.mark.parametrize("model_type", ["arcee", "cwm", "ernie4_5", "gemma", "glm", "glm4", "granite", "granitemoe",
                                        "mistral", "mixtral", "nemotron", "qwen2", "qwen2_moe", "qwen3_moe"])
def test_attention_route_covers_the_same_code(model_type, fused_calls):
    """Every family whose attention code is Llama's, Mistral's, Qwen2's or Qwen3's takes the rope_attention route
    with its own pairing (GLM's and ERNIE's interleaved pairs) and partial rotary."""
    model = _tiny(model_type, attn="sdpa")
    ids = torch.randint(2, 128, (2, 10))
    ref_logits, ref_grads = _forward_backward(model, ids)
    with _patched(model, attention=True):
        logits, grads = _forward_backward(model, ids)
    assert fused_calls["rope_attention"] == 2
    _assert_same(logits, grads, ref_logits, ref_grads)


@pytest.mark.parametrize("model_type", ATTENTION_FAMILIES)
def test_attention_route_generate(model_type, fused_calls):
    """generate: the prefill (an empty cache) goes through rope_attention, decode steps the usual path; the same
    tokens as unpatched."""
    model = _tiny(model_type, attn="sdpa")
    ids = torch.randint(2, 128, (1, 8))
    ref = _generate(model, ids)
    with _patched(model, attention=True):
        tokens = _generate(model, ids)
    assert torch.equal(tokens, ref)
    assert fused_calls["rope_attention"] == 2  # the prefill, each layer


def test_attention_route_with_packed_position_ids(fused_calls):
    """Position ids that restart inside a row (packed sequences) with no mask: transformers' sdpa call attends
    causally over the whole row, and so does the route (the same logits and gradients); a block mask, where the
    caller gives one, takes the usual path."""
    model = _tiny("llama", attn="sdpa")
    ids = torch.randint(2, 128, (1, 10))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
    ref_logits, ref_grads = _forward_backward(model, ids, position_ids=positions)
    with _patched(model, attention=True):
        logits, grads = _forward_backward(model, ids, position_ids=positions)
    assert fused_calls["rope_attention"] == 2
    _assert_same(logits, grads, ref_logits, ref_grads)


@pytest.mark.parametrize("case", ["padding", "eager", "sliding"])
def test_attention_route_falls_back(case, fused_calls):
    """A padding mask, another attention implementation or a sliding window is not rope_attention's causal
    attention: the usual path runs, with the unpatched logits."""
    if case == "sliding":
        model = _tiny("qwen3", attn="sdpa", use_sliding_window=True, sliding_window=4, max_window_layers=0,
                      layer_types=["sliding_attention", "sliding_attention"])
    else:
        model = _tiny("qwen3", attn="eager" if case == "eager" else "sdpa")
    ids = torch.randint(2, 128, (2, 10))
    mask = torch.ones_like(ids)
    if case == "padding":
        mask[0, :3] = 0
    ref = model(ids, attention_mask=mask).logits
    with _patched(model, attention=True):
        out = model(ids, attention_mask=mask).logits
    assert fused_calls["rope_attention"] == 0 and fused_calls["qk_norm_rope"] == 2
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ the guards


CHECKED = {"llama": "_LLAMA", "arcee": "_LLAMA", "granite": "_LLAMA", "qwen2_moe": "_LLAMA", "mistral": "_MISTRAL",
           "mixtral": "_MISTRAL", "qwen2": "_QWEN2", "cwm": "_QWEN2", "qwen3": "_QWEN3", "qwen3_moe": "_QWEN3",
           "qwen3_next": "_QWEN3_NEXT", "gemma3": "_GEMMA3", "apertus": "_APERTUS", "glm4_moe": "_GLM4_MOE"}


@pytest.mark.parametrize("model_type", sorted(CHECKED))
def test_checked_forwards_are_recognised(model_type):
    """The installed transformers' attention forwards are the checked ones (a release that changes one fails here,
    loudly, instead of quietly losing the fused path)."""
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    classes = [c for n, c in vars(modeling).items() if n.endswith("Attention") and isinstance(c, type)
               and c.__module__ == modeling.__name__]
    codes = {shape.code for shape in map(attention_forward._shape_of, classes) if shape is not None}
    assert codes == {getattr(attention_forward, CHECKED[model_type])}


def test_other_rotations_keep_the_rotation_only_patch(fused_calls, rope_calls):
    """Cohere's attention code is GLM-4.5 MoE's, but its tables are repeated pairs (and its QK-norm a LayerNorm):
    no fused forward, the rotation patch as before."""
    model = _tiny("cohere", attn="sdpa")
    ids = torch.randint(2, 128, (2, 8))
    ref = model(ids).logits
    with _patched(model, attention=True):
        assert not attention_forward.fused_modules(model)
        out = model(ids).logits
    assert not any(fused_calls.values()) and rope_calls == ["interleaved"] * 2
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_changed_forward_is_not_patched():
    def forward(self, hidden_states):
        return hidden_states

    def changed(self, hidden_states):
        return hidden_states + 0

    assert attention_forward._fingerprint(forward) != attention_forward._fingerprint(changed)
    assert attention_forward._fingerprint(changed) not in attention_forward._SHAPES
    model = _tiny("qwen3")
    attn = model.model.layers[0].self_attn
    cls = type(attn)
    attention_forward._SHAPE_OF_CLASS[cls] = None  # as if transformers had changed the class's forward
    try:
        with _patched(model):
            assert not attention_forward.fused_modules(model)
            assert is_patched(model)  # the rotation is patched all the same
    finally:
        del attention_forward._SHAPE_OF_CLASS[cls]


def test_forwards_set_by_others_are_kept(fused_calls):
    """An attention module whose forward someone else replaced on the instance (as accelerate's device hooks do)
    keeps it through patch and unpatch; the other layers are fused."""
    model = _tiny("qwen3")
    ids = torch.randint(2, 128, (1, 6))
    attn = model.model.layers[0].self_attn
    seen = []

    def wrapper(*args, _forward=attn.forward, **kwargs):
        seen.append(1)
        return _forward(*args, **kwargs)

    attn.forward = wrapper
    ref = model(ids).logits
    with _patched(model):
        assert attention_forward.fused_modules(model) == [model.model.layers[1].self_attn]
        out = model(ids).logits
    assert attn.forward is wrapper and len(seen) == 2
    assert fused_calls["qk_norm_rope"] == 1
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_norm_modules_are_recognised_by_behaviour():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    qwen, gemma = Qwen3RMSNorm(16, eps=1e-5), Gemma3RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        qwen.weight.normal_()
        gemma.weight.normal_()
    assert attention_forward._norm_form(qwen, 16) == (0.0, 1e-5)
    assert attention_forward._norm_form(gemma, 16) == (1.0, 1e-6)
    assert attention_forward._norm_form(torch.nn.LayerNorm(16), 16) is None
    assert attention_forward._norm_form(qwen, 32) is None  # not over the head dim
    state = torch.get_rng_state()
    attention_forward._norm_form(qwen, 16)
    assert torch.equal(torch.get_rng_state(), state)  # the probe leaves the global RNG alone


# ------------------------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("case", ["prologue", "attention-llama", "attention-qwen3"])
def test_compiled_fused_forwards_trace_the_fused_ops(case, fused_calls):
    """torch.compile(fullgraph=True) of a patched model: the fused forwards trace (no graph break) through the
    fused ops, with the unpatched logits and gradients. rope_attention needs the mask-free call: transformers 5.17
    (and 5.24 before torch 2.14) builds the causal mask as a tensor while compiling, which takes the usual path
    (a mask's values cannot be read in a traced graph), so the test records which mask the attention modules got."""
    model_type = "qwen3" if case != "attention-llama" else "llama"
    model = _tiny(model_type, attn="sdpa")
    ids = torch.randint(2, 128, (2, 12))
    ref_logits, ref_grads = _forward_backward(model, ids)
    masks = []
    hooks = [m.register_forward_pre_hook(lambda _, args, kwargs: masks.append(kwargs.get("attention_mask")),
                                         with_kwargs=True) for m in model.modules() if type(m).__name__.endswith(
                                             "Attention") and hasattr(m, "q_proj")]
    torch._dynamo.reset()
    try:
        with _patched(model, attention=case.startswith("attention")):
            compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
            for _ in range(2):  # the second call runs the compiled graph
                logits, grads = _forward_backward(compiled, ids)
                _assert_same(logits, {n.removeprefix("_orig_mod."): g for n, g in grads.items()}, ref_logits,
                             ref_grads)
    finally:
        torch._dynamo.reset()
        for hook in hooks:
            hook.remove()
    assert len(masks) >= 2
    if case == "prologue" or (model_type == "qwen3" and any(mask is not None for mask in masks)):
        assert fused_calls["qk_norm_rope"] >= 2  # traced once per layer, not bypassed
    if case != "prologue":
        mask_free = all(mask is None for mask in masks)
        assert (fused_calls["rope_attention"] >= 2) == mask_free
        if not mask_free:
            _assert_compiled_attention_layer(model, ids)
            assert fused_calls["rope_attention"] >= 1


def _assert_compiled_attention_layer(model, ids):
    """One attention layer called as transformers calls it without a mask (sdpa's is_causal), compiled with
    fullgraph=True around the patched rotary module and attention forward: the output and gradients of the
    unpatched layer."""
    inner, layer = model.model, model.model.layers[0].self_attn
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    hidden = torch.randn(*ids.shape, model.config.hidden_size)
    weight = torch.randn(*ids.shape, model.config.hidden_size)

    def attention(hidden):
        embeddings = inner.rotary_emb(hidden, positions)
        return layer(hidden, position_embeddings=embeddings, attention_mask=None, position_ids=positions)[0]

    def run(function):
        x = hidden.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        out = function(x)
        (out * weight).sum().backward()
        return out.detach(), [x.grad, *(p.grad for p in layer.parameters())]

    ref, ref_grads = run(attention)
    torch._dynamo.reset()
    try:
        with _patched(model, attention=True):
            out, grads = run(torch.compile(attention, fullgraph=True, backend="aot_eager"))
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < 1e-5


def test_compiled_static_decode_traces_rope_kv_write(fused_calls):
    """A decode step with a StaticCache compiled with fullgraph=True (as generate compiles it on GPUs): the cache
    write traces through rope_kv_write, with the unpatched logits and cache."""
    model = _tiny("qwen3")
    ids = torch.randint(2, 128, (2, 6))
    results = []
    torch._dynamo.reset()
    try:
        for patched in (False, True):
            cache = transformers.StaticCache(config=model.config, max_cache_len=12)
            with torch.no_grad(), (_patched(model) if patched else contextlib.nullcontext()):
                model(ids[:, :5], **_cache(model, cache), use_cache=True)  # prefill, eager
                step = torch.compile(model, fullgraph=True, backend="aot_eager")
                logits = step(ids[:, 5:], **_cache(model, cache), use_cache=True,
                              position_ids=torch.full((2, 1), 5)).logits
            results.append((logits, cache))
            torch._dynamo.reset()
    finally:
        torch._dynamo.reset()
    (ref, ref_cache), (out, cache) = results
    assert fused_calls["rope_kv_write"] >= 2 * 2  # the eager prefill, then traced in the decode step
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for want, got in zip(ref_cache.layers, cache.layers):
        assert int(got.cumulative_length) == int(want.cumulative_length) == 6
        torch.testing.assert_close(got.keys, want.keys, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_static_cache_generate_on_cuda(padded, fused_calls):
    """On a GPU, generate compiles the decode step of a static cache (reduce-overhead: CUDA graphs) around the
    patched forward: the same tokens as unpatched, and the cache written by rope_kv_write."""
    model = _tiny("qwen3").cuda()
    ids = torch.randint(2, 128, (2, 8), device="cuda")
    mask = torch.ones_like(ids)
    if padded:
        ids[0, :3], mask[0, :3] = 0, 0
    torch._dynamo.reset()
    try:
        ref = _generate(model, ids, mask, cache_implementation="static")
        torch._dynamo.reset()
        with _patched(model):
            tokens = _generate(model, ids, mask, cache_implementation="static")
    finally:
        torch._dynamo.reset()
    assert torch.equal(tokens, ref)
    assert fused_calls["rope_kv_write"] >= 2 * 2  # the eager prefill and the traced decode step, each layer
