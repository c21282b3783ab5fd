"""patch()/unpatch() on every family of the one table (ropekit.frequencies.families) beyond the original nine: a tiny
random model of each (built from a config, no downloads) gives the unpatched model's logits and gradients (fp32,
1e-5), every call of the family's rotation went through ropekit (the call count of the original function in the
unpatched run), greedy ``generate`` gives the same tokens, and unpatch restores the model bit for bit. The
families' own quirks ride along in their configs: NoPE layers (SmolLM3, Llama 4), Llama 4's attention temperature
on its NoPE layers, Gemma 3's local and global theta by ``layer_types``, partial rotary (Phi, StableLM, Qwen3-Next,
GLM-4.5 MoE), Qwen3-Next's gated ``[q | gate]`` heads, OLMo-2's QK-norm over all heads, GPT-OSS's YaRN, Cohere's
interleaved pairs and Llama 4's complex ``freqs_cis``. Also: the two drop-ins for the families whose rotation is
not ``rotate_half`` against transformers' own functions."""

from __future__ import annotations

import importlib

import pytest
import torch

import ropekit

transformers = pytest.importorskip("transformers")

from helpers import no_patch_leaks, rel_err  # noqa: E402, F401  (autouse: no module-level function left patched)
from ropekit.frequencies.families import MODEL_FAMILIES  # noqa: E402
from ropekit.integrations import patching  # noqa: E402
from ropekit.integrations.patching import SUPPORTED_MODEL_TYPES, is_patched, patch, unpatch  # noqa: E402
from ropekit.integrations.transformers import apply_rotary_emb_complex, apply_rotary_pos_emb_interleaved  # noqa: E402

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=1)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}

# model_type -> the config overrides of its tiny model (sequences of 24 tokens pass the YaRN lengths of 16)
TINY = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    # gated [q | gate] heads, a quarter of each head rotated, one linear-attention and one full-attention layer
    "qwen3_next": dict(head_dim=16, partial_rotary_factor=0.25, layer_types=["linear_attention", "full_attention"],
                       linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                       linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32),
    "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    # local theta 10k on sliding layers, global theta 1M with linear x8 on full ones
    "gemma3_text": dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                            "factor": 8.0}}),
    # layer 0 rotates, layer 1 is NoPE with the attention temperature (floor_scale 4: it changes within 24 tokens)
    "llama4_text": dict(head_dim=16, intermediate_size_mlp=128, num_local_experts=2, num_experts_per_tok=1,
                        no_rope_layers=[1, 0], attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 16}),
    "olmo": dict(),
    "olmo2": dict(),
    "olmo3": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    # every token uses all 4 experts: bf16 rounding cannot flip the routing between patched and unpatched runs
    "gpt_oss": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=4, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"], rope_parameters=_YARN),
    "cohere": dict(),
    "cohere2": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, rope_theta=10000.0, alibi=False,
                   ffn_hidden_size=128),
    "stablelm": dict(partial_rotary_factor=0.25),
    "phi": dict(partial_rotary_factor=0.5),
    # layer 1 is NoPE
    "smollm3": dict(no_rope_layers=[1, 0]),
    "glm4_moe": dict(head_dim=16, partial_rotary_factor=0.5, n_routed_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1),
    "ernie4_5": dict(head_dim=16),
    "ernie4_5_moe": dict(head_dim=16, moe_num_experts=4, moe_k=2, moe_intermediate_size=32),
    "exaone4": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "exaone_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    "afmoe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  num_dense_layers=1),
    "apertus": dict(),
    "arcee": dict(),
    "bitnet": dict(),
    "cwm": dict(head_dim=16),
    "granite": dict(),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32),
    "jetmoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "lfm2": dict(),
    "ministral3": dict(),
    "nemotron": dict(partial_rotary_factor=0.5),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "persimmon": dict(partial_rotary_factor=0.5),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "seed_oss": dict(attention_dropout=0.0, residual_dropout=0.0),  # its defaults are 0.1: runs would differ
    "starcoder2": dict(),
    "vaultgemma": dict(head_dim=16),
}


def _config(model_type: str):
    try:
        return transformers.AutoConfig.for_model(model_type, **BASE, **TINY[model_type])
    except ValueError as exc:  # an older transformers than the one that added the family
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r} model: {exc}")


def _tiny(model_type: str):
    config = _config(model_type)
    config._attn_implementation = "eager"
    torch.manual_seed(1234)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def _family(model):
    model_type = model.config.model_type
    return model_type if model_type in MODEL_FAMILIES else model_type.removesuffix("_text")


def _forward_backward(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def _generate(model, ids):
    return model.generate(ids, max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(ids),
                          pad_token_id=0)


class _Counted:
    """The family's modeling functions wrapped to count their calls (in the unpatched run)."""

    def __init__(self, modeling, names):
        self.modeling, self.names, self.calls = modeling, names, 0

    def __enter__(self):
        self.originals = {n: getattr(self.modeling, n) for n in self.names}
        for name, fn in self.originals.items():
            def counted(*args, _fn=fn, **kwargs):
                self.calls += 1
                return _fn(*args, **kwargs)
            setattr(self.modeling, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self.originals.items():
            setattr(self.modeling, name, fn)


def test_the_issue_families_are_supported():
    named = {"mixtral", "qwen3_moe", "qwen3_next", "gemma2", "gemma3", "llama4", "olmo2", "gpt_oss", "cohere",
             "falcon", "stablelm", "phi", "smollm3", "glm4_moe"}
    assert named <= set(SUPPORTED_MODEL_TYPES)
    assert {t.removesuffix("_text") for t in TINY} <= set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_family_matches_unpatched(model_type, rope_calls):
    model = _tiny(model_type)
    family = _family(model)
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    names = [n for n in MODEL_FAMILIES[family].patched_functions if hasattr(modeling, n)]
    originals = {n: getattr(modeling, n) for n in names}
    rotary = patching._rotary_modules(model, modeling.__name__)
    ids = torch.randint(2, 128, (2, 24))
    with _Counted(modeling, names) as counted:
        ref_logits, ref_grads = _forward_backward(model, ids)
    ref_tokens = _generate(model, ids[:, :8])
    assert counted.calls > 0, "the family's rotation never ran: the test would prove nothing"

    patch(model, prologue=False)  # the rotation alone: test_patching_fused.py has the fused QK-norm families
    try:
        assert is_patched(model)
        logits, grads = _forward_backward(model, ids)
        assert len(rope_calls) == counted.calls  # every rotation of the forward went through ropekit
        tokens = _generate(model, ids[:, :8])
    finally:
        unpatch(model)

    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < 1e-5, name
    assert torch.equal(tokens, ref_tokens)
    # unpatch restores the functions, the rotary modules and the logits bit for bit
    assert all(getattr(modeling, n) is fn for n, fn in originals.items())
    assert not is_patched(model) and all("forward" not in m.__dict__ for m in rotary)
    again, _ = _forward_backward(model, ids)
    assert torch.equal(again, ref_logits)


@pytest.mark.parametrize("model_type", [t for t in SUPPORTED_MODEL_TYPES if MODEL_FAMILIES[t].mrope_section is None])
def test_partial_rotary_factor_as_each_family_reads_it(model_type):
    """A config's partial_rotary_factor with the default rope: from_hf_config gives the frequencies the family's own
    rotary module holds, bit for bit -- most families rotate the whole head whatever the factor says (Llama's rotary
    used to be patched with half of them), a few rotate the fraction (Phi, GPT-NeoX, GLM, ...)."""
    name = f"{model_type}_text" if f"{model_type}_text" in TINY else model_type
    overrides = {k: v for k, v in TINY.get(name, {}).items() if k not in ("rope_parameters", "partial_rotary_factor")}
    config = transformers.AutoConfig.for_model(name, **BASE, **overrides, partial_rotary_factor=0.5)
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    rotary_classes = [c for n, c in vars(modeling).items() if isinstance(c, type) and n.endswith("RotaryEmbedding")
                      and "Vision" not in n and c.__module__ == modeling.__name__]
    rotary = rotary_classes[0](config)
    held = {n: b for n, b in rotary.named_buffers() if n.endswith("inv_freq") and "original" not in n}
    assert held, "the rotary module holds no inv_freq: the test would prove nothing"
    for buffer_name, theirs in held.items():
        layer_type = buffer_name.removesuffix("_inv_freq") if buffer_name != "inv_freq" else None
        ours = ropekit.from_hf_config(config, layer_type=layer_type).inv_freq
        assert ours.shape == theirs.shape and torch.equal(ours, theirs.float()), (buffer_name, ours, theirs)


def test_llama_with_a_partial_rotary_factor_matches_unpatched():
    """transformers' Llama rotates the whole head whatever partial_rotary_factor says; so does the patched model."""
    config = transformers.AutoConfig.for_model("llama", **BASE, partial_rotary_factor=0.5)
    config._attn_implementation = "eager"
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    ids = torch.randint(2, 128, (2, 24))
    ref, _ = _forward_backward(model, ids)
    patch(model)
    try:
        got, _ = _forward_backward(model, ids)
    finally:
        unpatch(model)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_gemma3_layers_rotate_with_their_own_theta():
    """Gemma 3's sliding layers rotate with the local theta and its full layers with the global one (and its
    linear factor): the patched rotary module holds one ropekit frequency set per layer type, each equal to the
    original module's buffers."""
    model = _tiny("gemma3_text")
    rotary = model.model.rotary_emb
    patch(model)
    try:
        per_layer = rotary.__dict__[patching._STATE_ATTR].per_layer
        assert set(per_layer) == {"sliding_attention", "full_attention"}
        for layer_type, rope in per_layer.items():
            assert torch.equal(rope.inv_freq, getattr(rotary, f"{layer_type}_inv_freq"))
        assert not torch.equal(per_layer["sliding_attention"].inv_freq, per_layer["full_attention"].inv_freq)
        with pytest.raises(ValueError, match="layer_type 'chunked' has no rope parameters"):
            rotary(torch.zeros(1, 3, 64), torch.arange(3)[None], "chunked")
    finally:
        unpatch(model)


def test_readme_lists_the_supported_types():
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    listed = re.search(r"raises `ValueError` listing them for\nany other: (.*?)\. ", readme, re.S)
    assert listed is not None
    assert [t.strip() for t in listed.group(1).replace("\n", " ").split(",")] == list(SUPPORTED_MODEL_TYPES)


def test_unsupported_family_error_lists_the_supported_types():
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    with pytest.raises(ValueError, match=r"cannot patch model_type 'gpt2': patch\(model\) supports the model types "
                                         r"\[.*'cohere'.*'llama4'.*\]"):
        patch(transformers.GPT2LMHeadModel(config))


# ------------------------------------------------------------------------------- the drop-ins, against transformers


def _assert_same_rotation(got: tuple, want: tuple, inputs: tuple, dtype: torch.dtype) -> None:
    """A drop-in's (q, k) against transformers' function's: same dtypes, values and input gradients (fp32 within
    1e-5, bf16 within its rounding)."""
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)
    weights = [torch.randn_like(w) for w in want]
    want_grads = torch.autograd.grad(sum((w * x).sum() for w, x in zip(want, weights)), inputs)
    got_grads = torch.autograd.grad(sum((g * x).sum() for g, x in zip(got, weights)), inputs)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_interleaved_dropin_matches_cohere(dtype, unsqueeze_dim):
    from transformers.models.cohere.modeling_cohere import CohereRotaryEmbedding, apply_rotary_pos_emb

    config = _config("cohere")
    rotary = CohereRotaryEmbedding(config)
    B, S, D = 2, 7, config.hidden_size // config.num_attention_heads
    shape_q, shape_k = ((B, 4, S, D), (B, 2, S, D)) if unsqueeze_dim == 1 else ((B, S, 4, D), (B, S, 2, D))
    q = torch.randn(shape_q, dtype=dtype, requires_grad=True)
    k = torch.randn(shape_k, dtype=dtype, requires_grad=True)
    cos, sin = rotary(torch.zeros(1, dtype=dtype), torch.randint(0, 60, (B, S)))
    want = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    got = apply_rotary_pos_emb_interleaved(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    _assert_same_rotation(got, want, (q, k), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_complex_dropin_matches_llama4(dtype):
    from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding, apply_rotary_emb

    config = _config("llama4_text")
    rotary = Llama4TextRotaryEmbedding(config)
    B, S, D = 2, 24, config.head_dim
    xq = torch.randn(B, S, 4, D, dtype=dtype, requires_grad=True)
    xk = torch.randn(B, S, 2, D, dtype=dtype, requires_grad=True)
    freqs_cis = rotary(torch.zeros(1, dtype=dtype), torch.randint(0, 60, (B, S)))
    want = apply_rotary_emb(xq, xk, freqs_cis)
    got = apply_rotary_emb_complex(xq, xk, freqs_cis)
    assert got[0].dtype == dtype
    _assert_same_rotation(got, want, (xq, xk), dtype)


@pytest.mark.parametrize("model_type", ["olmo2", "cohere", "llama4_text", "gpt_oss", "gemma3_text", "ernie4_5"])
def test_bf16_family_keeps_dtypes_and_accuracy(model_type, rope_calls):
    """In bf16 the families whose functions cast back to q's dtype (OLMo, Cohere, Llama 4, ERNIE) or take float32
    or half-width tables give logits of the unpatched dtype, as close to the fp32 model as transformers' own."""
    ids = torch.randint(2, 128, (2, 24))
    with torch.no_grad():
        exact = _tiny(model_type)(ids).logits
        model = _tiny(model_type).to(torch.bfloat16)
        ref = model(ids).logits
        patch(model, prologue=False)
        try:
            out = model(ids).logits
        finally:
            unpatch(model)
    assert rope_calls and out.dtype == ref.dtype == torch.bfloat16
    assert rel_err(out.float(), ref.float()) < 2e-2
    assert rel_err(out.float(), exact) <= 1.5 * rel_err(ref.float(), exact) + 2e-3
