"""RotaryEmbedding: rotations equal transformers' own apply functions (each family's pairing, partial rotary,
attention scaling), dynamic/longrope switching with transformers' state, layouts, gradients, dtypes."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from ropekit.frequencies import from_hf_config, rope_frequencies
from ropekit.modules import RotaryEmbedding
from test_frequencies import MODEL_CONFIGS, hf_config, hf_rotary


def hf_apply(config, interleave_fn: bool = False):
    module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    return module.apply_rotary_pos_emb_interleave if interleave_fn else module.apply_rotary_pos_emb


def deinterleave(y: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved apply returns the rotated pairs as [evens, odds]."""
    return torch.cat((y[..., 0::2], y[..., 1::2]), dim=-1)


FAMILIES = ["llama-3.1-8b", "qwen2.5-7b-instruct-yarn", "qwen3-8b", "mistral-nemo-2407", "phi-3.5-mini-instruct",
            "deepseek-v3", "gpt-neox-20b", "glm-4-9b-0414", "gpt-oss-20b", "llama-2-7b-dynamic"]


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_matches_transformers_apply(name):
    config = hf_config(MODEL_CONFIGS[name])
    rotary = hf_rotary(config)
    f = from_hf_config(config)
    rope = RotaryEmbedding(config)
    B, S, D = 2, 9, f.head_dim
    q = torch.randn(B, 3, S, D, dtype=torch.float64)  # transformers' [B, H, S, D]
    k = torch.randn(B, 1, S, D, dtype=torch.float64)
    pos = torch.randint(0, 3000, (B, S))
    interleave_fn = name == "deepseek-v3"
    apply_fn = hf_apply(config, interleave_fn)
    hf_cos, _ = rotary(torch.randn(1, 1, 4), pos)
    # transformers' formula in float64 on exact float64 tables: the oracle
    cos, sin = f.cos_sin(pos, torch.float64, full=hf_cos.shape[-1] == f.rotary_dim)
    ref_q, ref_k = apply_fn(q, k, cos, sin)
    out_q, out_k = rope(q.float(), k.float(), positions=pos, layout="bhsd")
    assert out_q.dtype == torch.float32 and out_q.shape == q.shape
    if interleave_fn:
        out_q, out_k = deinterleave(out_q), deinterleave(out_k)
    torch.testing.assert_close(out_q.double(), ref_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_k.double(), ref_k, rtol=1e-6, atol=1e-6)
    # and transformers end to end in fp32 (its fp32 angles err by up to ~4 * 3000 * 2**-24 rad)
    hf_q, hf_k = apply_fn(q.float(), k.float(), *rotary(torch.randn(1, 1, 4), pos))
    torch.testing.assert_close(out_q, hf_q, rtol=0, atol=5e-3)
    torch.testing.assert_close(out_k, hf_k, rtol=0, atol=5e-3)


def test_attention_scaling_touches_rotated_columns_only():
    f = rope_frequencies(8, rope_type="yarn", factor=16.0, original_max_position_embeddings=64, head_dim=12)
    assert f.attention_scaling > 1.2
    rope = RotaryEmbedding(f)
    q = torch.randn(1, 1, 2, 12)
    out = rope(q, positions=torch.zeros(1, 1, dtype=torch.int64))  # position 0: only the scale acts
    torch.testing.assert_close(out[..., :8], q[..., :8] * f.attention_scaling)
    assert torch.equal(out[..., 8:], q[..., 8:])


def test_dynamic_ntk_follows_transformers_state():
    d = MODEL_CONFIGS["llama-2-7b-dynamic"]
    config = hf_config(d)
    rotary = hf_rotary(config)
    apply_fn = hf_apply(config)
    rope = RotaryEmbedding(d)
    # grow; a length between keeps the grown set; below the original length resets; equal to it does not
    steps = [(100, None), (5000, 5000), (4500, 5000), (100, None), (9000, 9000), (4096, 9000), (6000, 9000),
             (4095, None)]
    for length, grown_to in steps:
        pos = torch.tensor([[length - 1]])
        q = torch.randn(1, 2, 1, 128)
        cos, sin = rotary(torch.randn(1, 1, 4), pos)
        hf_q, _ = apply_fn(q, q, cos, sin)
        out = rope(q, positions=pos, layout="bhsd")
        assert rope.frequencies.seq_len == grown_to, length
        torch.testing.assert_close(rope.inv_freq, rotary.inv_freq, rtol=1e-6, atol=0)
        torch.testing.assert_close(out, hf_q, rtol=0, atol=5e-3)
    assert torch.equal(rope.inv_freq, from_hf_config(d).inv_freq)


def test_longrope_switches_on_length():
    d = MODEL_CONFIGS["phi-3.5-mini-instruct"]
    config = hf_config(d)
    rotary = hf_rotary(config)
    apply_fn = hf_apply(config)
    rope = RotaryEmbedding(config)
    for first in (10, 4096, 4100, 50000, 0):
        pos = torch.arange(first, first + 3)[None]
        q = torch.randn(1, 2, 3, 96)
        hf_q, _ = apply_fn(q, q, *rotary(torch.randn(1, 1, 4), pos))
        out = rope(q, positions=first, layout="bhsd")
        torch.testing.assert_close(rope.inv_freq, rotary.inv_freq, rtol=1e-6, atol=0)
        torch.testing.assert_close(out, hf_q, rtol=0, atol=2e-2 if first > 4096 else 1e-3)
    assert rope.attention_scaling == pytest.approx(rotary.attention_scaling)


def test_seq_len_from_positions_forms():
    q = torch.randn(2, 6, 1, 8)
    s = RotaryEmbedding.seq_len_of
    assert s(q, None, "bshd") == 6
    assert s(q, 10, "bshd") == 16
    assert s(q, torch.tensor([3, 40]), "bshd") == 46
    assert s(q, torch.tensor([[0, 1, 2, 3, 4, 99]] * 2), "bshd") == 100
    t = torch.randn(10, 1, 8)
    cu = torch.tensor([0, 3, 10])
    assert s(t, None, "thd", cu) == 7
    assert s(t, torch.tensor([5, 1]), "thd", cu) == 8
    assert s(t, torch.arange(10), "thd") == 10
    assert s(q.transpose(0, 1), torch.tensor([3, 40]), "sbhd") == 46  # [S, B, H, D]: offsets are per batch
    assert s(q.transpose(1, 2), 2, "bhsd") == 8


@pytest.mark.parametrize("layout", ["bhsd", "sbhd", "thd"])
def test_layouts_agree(layout):
    rope = RotaryEmbedding(from_hf_config(MODEL_CONFIGS["glm-4-9b-0414"]))
    q = torch.randn(2, 7, 3, 128)
    k = torch.randn(2, 7, 2, 128)
    pos = torch.randint(0, 10_000, (2, 7))
    ref_q, ref_k = rope(q, k, positions=pos)
    if layout == "thd":
        out_q, out_k = rope(q.flatten(0, 1), k.flatten(0, 1), positions=pos.flatten(), layout="thd")
        out_q, out_k = out_q.view_as(q), out_k.view_as(k)
    else:
        perm = (0, 2, 1, 3) if layout == "bhsd" else (1, 0, 2, 3)
        out_q, out_k = rope(q.permute(perm).contiguous(), k.permute(perm).contiguous(), positions=pos,
                            layout=layout)
        out_q, out_k = out_q.permute(perm), out_k.permute(perm)
    torch.testing.assert_close(out_q, ref_q, rtol=0, atol=0)
    torch.testing.assert_close(out_k, ref_k, rtol=0, atol=0)


def test_gradients():
    rope = RotaryEmbedding(from_hf_config(MODEL_CONFIGS["phi-3.5-mini-instruct"]))
    rope.update(5000)  # long factors and attention scaling != 1
    q = torch.randn(1, 3, 2, 96, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 1, 96, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([[4999, 2, 70000]])
    assert torch.autograd.gradcheck(lambda a, b: rope(a, b, positions=pos), (q, k), fast_mode=True)
    # the gradient is the transposed rotation: <R x, g> = <x, R^T g>
    g = torch.randn(1, 3, 2, 96, dtype=torch.float64)
    (rope(q, positions=pos) * g).sum().backward()
    x = torch.randn_like(q)
    lhs = (rope(x, positions=pos) * g).sum()
    rhs = (x * q.grad).sum()
    torch.testing.assert_close(lhs, rhs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_single_rounding(dtype):
    config = MODEL_CONFIGS["llama-3.1-8b"]
    rope = RotaryEmbedding(config).to(dtype)  # casting the module must not cast the frequencies it uses
    f = from_hf_config(config)
    q = torch.randn(2, 5, 4, 128).to(dtype)
    pos = torch.randint(0, 131072, (2, 5))
    out = rope(q, positions=pos)
    assert out.dtype == dtype
    cos, sin = f.cos_sin(pos, torch.float64, full=False)
    lo, hi = q.double()[..., :64], q.double()[..., 64:]
    c, s = cos[:, :, None], sin[:, :, None]
    ref = torch.cat((lo * c - hi * s, hi * c + lo * s), dim=-1)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), ref, rtol=eps / 2, atol=1e-6)
    assert rope.inv_freq.dtype == torch.float32


def test_cos_sin_tables():
    config = hf_config(MODEL_CONFIGS["qwen2.5-7b-instruct-yarn"])
    rotary = hf_rotary(config)
    rope = RotaryEmbedding(config)
    pos = torch.randint(0, 200, (2, 6))
    hf_cos, hf_sin = rotary(torch.randn(1, 1, 4), pos)
    cos, sin = rope.cos_sin(pos)
    assert cos.dtype == torch.float32 and cos.shape == hf_cos.shape == (2, 6, 128)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=5e-5)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=5e-5)
    assert rope.cos_sin(pos, torch.bfloat16, full=False)[0].shape == (2, 6, 64)
    # the tables and the module rotate the same way
    q = torch.randn(2, 2, 6, 128)
    ref, _ = hf_apply(config)(q, q, cos, sin)
    torch.testing.assert_close(rope(q, positions=pos, layout="bhsd"), ref, rtol=1e-5, atol=1e-5)


def test_construction_forms_and_state_dict():
    a = RotaryEmbedding(64, base=5e5, rope_type="linear", factor=2.0)
    b = RotaryEmbedding(rope_frequencies(64, 5e5, rope_type="linear", factor=2.0))
    assert torch.equal(a.inv_freq, b.inv_freq)
    c = RotaryEmbedding.from_hf_config(MODEL_CONFIGS["glm-4-9b-0414"])
    assert c.style == "interleaved" and c.rotary_dim == 64 and c.head_dim == 128
    assert RotaryEmbedding(MODEL_CONFIGS["glm-4-9b-0414"], style="neox").style == "neox"
    assert "inv_freq" not in a.state_dict()
    assert "rope_type='linear'" in repr(a)
    with pytest.raises(ValueError, match="not to a RopeFrequencies"):
        RotaryEmbedding(b.frequencies, style="neox")
    with pytest.raises(ValueError, match=r"unexpected keywords \['factor'\]"):
        RotaryEmbedding(MODEL_CONFIGS["qwen3-8b"], factor=2.0)
    with pytest.raises(ValueError, match="smaller than this embedding's rotary_dim 64"):
        a(torch.randn(1, 2, 1, 32))


def test_static_types_keep_their_frequencies():
    rope = RotaryEmbedding(MODEL_CONFIGS["llama-3.1-8b"])
    before = rope.frequencies
    assert not before.is_dynamic
    rope(torch.randn(1, 3, 1, 128), positions=10**6)
    assert rope.frequencies is before and rope.update(10**7) is before


def test_seq_len_override():
    d = copy.deepcopy(MODEL_CONFIGS["llama-2-7b-dynamic"])
    rope = RotaryEmbedding(d)
    rope(torch.randn(1, 2, 1, 128), seq_len=8192)
    assert rope.frequencies.seq_len == 8192
    assert torch.equal(rope.inv_freq, from_hf_config(d).for_seq_len(8192).inv_freq)
