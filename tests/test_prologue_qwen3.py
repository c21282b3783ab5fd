"""A decode loop of a tiny random Qwen3 whose attention writes K/V through ``ropekit.rope_kv_write`` (the layer's
q_norm/k_norm weights, RoPE, the write into a StaticCache-layout cache [B, Hkv, max_len, D], ``cache_layout="bhsd"``)
and attends over the cache rows written so far: the same greedy tokens as ``model.generate``, the same logits, and
the cache holds what transformers' own StaticCache holds."""

from __future__ import annotations

import contextlib

import pytest
import torch

import ropekit
from helpers import ROUTES
from ropekit.testing import kernels_on_cpu

transformers = pytest.importorskip("transformers")

DEVICES = ROUTES
PROMPT_LEN, NEW_TOKENS = 5, 8
MAX_LEN = 16
# Model-level agreement between two float32 computations of the same logits (transformers' fp32 cos/sin tables
# and fp32 attention against ropekit's rotation and SDPA): not a rotation tolerance, the sum of many fp32 roundings
# through two layers; the greedy tokens are compared exactly, with every step's top-2 margin well above it.
LOGITS_TOL = dict(rtol=1e-4, atol=1e-4)
MIN_MARGIN = 1e-2


@contextlib.contextmanager
def on(device: str):
    with kernels_on_cpu() if device == "cpu-kernels" else contextlib.nullcontext():
        yield "cuda" if device == "cuda" else "cpu"


def _tiny_qwen3(device):
    """2 layers, hidden 64, 4 heads and 2 kv heads of 16, vocab 128, float32, random weights under a fixed seed
    (wider than the default init so that greedy decoding has clear margins; norm weights away from 1 so that
    q_norm/k_norm matter)."""
    config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64, initializer_range=0.2, rms_norm_eps=1e-6,
                                      tie_word_embeddings=False, attn_implementation="eager")
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(20240611)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Qwen3RMSNorm):
                module.weight.copy_(1.0 + 0.3 * torch.randn_like(module.weight))
    prompt = torch.randint(0, config.vocab_size, (1, PROMPT_LEN))
    torch.random.set_rng_state(generator_state)
    return model.to(device), prompt.to(device)


def _rope_theta(config) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _forward(model, ids, start: int, caches, decode: bool):
    """Logits [1, S, vocab] of tokens ``ids`` [1, S] at positions start..start+S-1; each layer's K/V written into its
    (k_cache, v_cache) [1, Hkv, MAX_LEN, D] by rope_kv_write, attention over rows 0..start+S-1 of the cache. Prefill:
    4-D [1, S, H, D] inputs with positions [1, S]; decode: 3-D [1, H, D] inputs (one token) with positions [1]."""
    config = model.config
    Hq, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    S = ids.shape[1]
    end = start + S
    positions = torch.arange(start, end, device=ids.device)
    h = model.model.embed_tokens(ids)
    for layer, (k_cache, v_cache) in zip(model.model.layers, caches):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        if decode:
            q, k, v = q.view(S, Hq, D), k.view(S, Hkv, D), v.view(S, Hkv, D)
            pos = positions
        else:
            q, k, v = q.view(1, S, Hq, D), k.view(1, S, Hkv, D), v.view(1, S, Hkv, D)
            pos = positions[None]
        assert attn.q_norm.variance_epsilon == attn.k_norm.variance_epsilon
        q_rot = ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=pos, cache_layout="bhsd",
                                      q_weight=attn.q_norm.weight, k_weight=attn.k_norm.weight,
                                      eps=attn.q_norm.variance_epsilon, base=_rope_theta(config))
        assert q_rot.shape == q.shape
        query = q_rot.reshape(1, S, Hq, D).transpose(1, 2)  # [1, Hq, S, D]
        keys = k_cache[:, :, :end].repeat_interleave(Hq // Hkv, dim=1)  # GQA: each kv head serves Hq/Hkv heads
        values = v_cache[:, :, :end].repeat_interleave(Hq // Hkv, dim=1)
        assert not torch.isnan(keys).any() and not torch.isnan(values).any(), "a row the attention reads is unwritten"
        # causal: the query at position start + i sees rows 0..start + i
        mask = torch.arange(end, device=ids.device)[None, :] <= positions[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                                               scale=attn.scaling)
        h = h + attn.o_proj(out.transpose(1, 2).reshape(1, S, Hq * D))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.model.norm(h))


def _decode(model, prompt):
    """Greedy decoding: the prompt's prefill through the op, then one token at a time. Returns the new tokens, the
    logits that chose each, and the caches."""
    config = model.config
    shape = (1, config.num_key_value_heads, MAX_LEN, config.head_dim)
    caches = [(torch.full(shape, float("nan"), device=prompt.device),
               torch.full(shape, float("nan"), device=prompt.device)) for _ in model.model.layers]
    logits = _forward(model, prompt, 0, caches, decode=False)[:, -1]
    tokens, step_logits = [], [logits]
    position = prompt.shape[1]
    for step in range(NEW_TOKENS):
        token = logits.argmax(-1, keepdim=True)  # [1, 1]
        tokens.append(token)
        if step == NEW_TOKENS - 1:
            break
        logits = _forward(model, token, position, caches, decode=True)[:, -1]
        step_logits.append(logits)
        position += 1
    return torch.cat(tokens, dim=1), torch.stack(step_logits, dim=1), caches


@pytest.mark.parametrize("device", DEVICES)
def test_qwen3_decode_loop_through_rope_kv_write_matches_generate(device):
    with on(device) as dev, torch.no_grad():
        model, prompt = _tiny_qwen3(dev)
        out = model.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        want_tokens = out.sequences[:, PROMPT_LEN:]
        want_logits = torch.stack(out.logits, dim=1)  # [1, NEW_TOKENS, vocab]
        assert want_tokens.shape == (1, NEW_TOKENS)
        top2 = want_logits.float().topk(2, dim=-1).values
        assert (top2[..., 0] - top2[..., 1]).min() > MIN_MARGIN, "the fixed model has a near-tie: pick another seed"
        assert len(set(want_tokens[0].tolist())) > 1, "the fixed model repeats one token: pick another seed"

        got_tokens, got_logits, caches = _decode(model, prompt)
        assert torch.equal(got_tokens, want_tokens)
        torch.testing.assert_close(got_logits, want_logits, **LOGITS_TOL)

        # The caches hold what transformers' StaticCache holds after the same tokens (rows 0..L-1: the prompt and
        # every generated token but the last, which was never fed back), and the rest is untouched.
        static = transformers.StaticCache(config=model.config, max_cache_len=MAX_LEN)
        sequence = torch.cat([prompt, want_tokens[:, :-1]], dim=1)
        model(sequence, past_key_values=static, use_cache=True)
        L = sequence.shape[1]
        for (k_cache, v_cache), layer in zip(caches, static.layers):
            assert k_cache.shape == layer.keys.shape and v_cache.shape == layer.values.shape
            torch.testing.assert_close(k_cache[:, :, :L], layer.keys[:, :, :L], **LOGITS_TOL)
            torch.testing.assert_close(v_cache[:, :, :L], layer.values[:, :, :L], **LOGITS_TOL)
            assert torch.isnan(k_cache[:, :, L:]).all() and torch.isnan(v_cache[:, :, L:]).all()
