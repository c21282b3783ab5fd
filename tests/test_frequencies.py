"""Frequencies: every rope type against transformers over real model configs (bit for bit), plus ggml's knobs,
tables, exactness at long positions and the errors for bad configs.

transformers is read through its public surface only, so that a new release cannot break these tests by renaming
a helper: a model's rotary-embedding module (built from a config; its ``inv_freq``, ``attention_scaling`` and the
cos/sin its ``forward`` returns, which recomputes the frequencies of the length-dependent types), the table of rope
type functions it exports at the top level (``transformers.ROPE_INIT_FUNCTIONS``, called as its rotary modules call
them) and an attention module's softmax ``scaling``.

The model configs (``helpers.MODEL_CONFIGS``) are the RoPE-relevant fields of the published ``config.json`` files (no
downloads).
"""

from __future__ import annotations

import copy
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from helpers import MODEL_CONFIGS, PHI35_LONG, PHI35_SHORT, hf_config, hf_rotary
from ropekit.frequencies import ROPE_TYPES, RopeFrequencies, from_hf_config, rope_frequencies

EXPECTED = {  # (rope_type, rotary_dim, style) per config: the parsing itself
    "llama-3.1-8b": ("llama3", 128, "neox"), "llama-3.2-1b": ("llama3", 64, "neox"),
    "vicuna-7b-v1.5-16k": ("linear", 128, "neox"), "llama-2-7b-dynamic": ("dynamic", 128, "neox"),
    "qwen2.5-7b-instruct": ("default", 128, "neox"), "qwen2.5-7b-instruct-yarn": ("yarn", 128, "neox"),
    "qwen3-8b": ("default", 128, "neox"), "qwen3-8b-yarn": ("yarn", 128, "neox"),
    "mistral-7b-v0.1": ("default", 128, "neox"), "mistral-nemo-2407": ("default", 128, "neox"),
    "phi-3.5-mini-instruct": ("longrope", 96, "neox"), "deepseek-v3": ("yarn", 64, "interleaved"),
    "gpt-oss-20b": ("yarn", 64, "neox"), "gpt-neox-20b": ("default", 24, "neox"),
    "pythia-1.4b": ("default", 32, "neox"), "glm-4-9b-0414": ("default", 64, "interleaved"),
}


def assert_equal_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-for-bit float32 equality, reporting how many values differ."""
    assert actual.dtype == expected.dtype == torch.float32 and actual.shape == expected.shape
    assert torch.equal(actual, expected), f"{int((actual != expected).sum())} of {actual.numel()} values differ"


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-6) -> None:
    actual, expected = actual.to(torch.float64), expected.to(torch.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    rel = ((actual - expected).abs() / expected.abs().clamp_min(1e-300)).max().item()
    assert rel <= rtol, f"max relative difference {rel:.3e} > {rtol:.1e}"


# ---- transformers side -------------------------------------------------------------------------------------------


def hf_init_functions() -> dict:
    """transformers' public table of rope type -> function (``transformers.ROPE_INIT_FUNCTIONS``). "default" is not
    in it: each model's rotary module computes that type itself."""
    return pytest.importorskip("transformers").ROPE_INIT_FUNCTIONS


def hf_parameters(config, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """transformers' ``(inv_freq, attention_scaling)`` for ``config``: the model's rotary module as built, or, at an
    int length ``seq_len``, the rope type's function called as transformers' rotary modules call it
    (``fn(config, device, seq_len=...)``). The default type does not depend on the length."""
    rope_type = config.rope_parameters["rope_type"]
    if seq_len is None or rope_type == "default":
        rotary = hf_rotary(config)
        return rotary.inv_freq, rotary.attention_scaling
    return hf_init_functions()[rope_type](config, None, seq_len=seq_len)


# ---- parsing -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODEL_CONFIGS))
def test_parse_without_transformers_objects(name):
    f = from_hf_config(MODEL_CONFIGS[name])
    assert (f.rope_type, f.rotary_dim, f.style) == EXPECTED[name]
    assert f.inv_freq.dtype == torch.float32 and f.inv_freq.shape == (f.rotary_dim // 2,)
    assert isinstance(f.attention_scaling, float)
    assert torch.isfinite(f.inv_freq).all() and (f.inv_freq > 0).all()


def test_config_dicts_are_not_mutated():
    d = copy.deepcopy(MODEL_CONFIGS["phi-3.5-mini-instruct"])
    snapshot = copy.deepcopy(d)
    from_hf_config(d)
    assert d == snapshot


def test_works_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from ropekit.frequencies import from_hf_config\n"
        "f = from_hf_config({'model_type': 'llama', 'hidden_size': 256, 'num_attention_heads': 4,"
        " 'max_position_embeddings': 4096, 'rope_theta': 5e5, 'rope_scaling': {'rope_type': 'llama3',"
        " 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, 'original_max_position_embeddings': 512}})\n"
        "assert f.inv_freq.shape == (32,)\n"
        "assert 'transformers' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    import ropekit

    src = os.path.dirname(os.path.dirname(ropekit.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ---- agreement with transformers -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODEL_CONFIGS))
@pytest.mark.parametrize("as_object", [False, True], ids=["dict", "config"])
def test_matches_transformers_at_construction(name, as_object):
    config = hf_config(MODEL_CONFIGS[name])
    rotary = hf_rotary(config)
    f = from_hf_config(config if as_object else MODEL_CONFIGS[name])
    assert f.arithmetic == "transformers"
    assert_equal_bits(f.inv_freq, rotary.inv_freq)
    assert f.attention_scaling == rotary.attention_scaling
    assert_rel_close(f.inv_freq, f.inv_freq_float64, 2e-6)  # a few float32 ulps from the float64 values


@pytest.mark.parametrize("name", ["qwen3-8b", "phi-3.5-mini-instruct", "deepseek-v3", "gpt-neox-20b",
                                  "glm-4-9b-0414"])
def test_cos_sin_match_transformers_tables(name):
    config = hf_config(MODEL_CONFIGS[name])
    rotary = hf_rotary(config)
    f = from_hf_config(config)
    pos = torch.randint(0, 300, (2, 17))
    x = torch.randn(2, 17, 8)
    hf_cos, hf_sin = rotary(x, pos)
    cos, sin = f.cos_sin(pos, torch.float32)
    # transformers forms the angle in fp32: a few roundings of |angle| < 300 rad, each <= 300 * 2**-24
    atol = 4 * 300 * 2.0**-24
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=atol)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=atol)


@pytest.mark.parametrize("seq_len", [4096, 5000, 9000, 40000])
def test_dynamic_ntk_recomputed_like_transformers(seq_len):
    d = MODEL_CONFIGS["llama-2-7b-dynamic"]
    rotary = hf_rotary(hf_config(d))
    rotary(torch.randn(1, 1, 8), torch.tensor([[seq_len - 1]]))  # only the largest position matters
    f = from_hf_config(d)
    g = f.for_seq_len(torch.tensor(seq_len))  # the module's update passes a tensor length
    assert f.is_dynamic
    assert_equal_bits(g.inv_freq, rotary.inv_freq)
    if seq_len <= 4096:
        assert g is f
    else:
        assert g.inv_freq[-1] < f.inv_freq[-1]  # the base grew: slow pairs slower
        assert g.inv_freq[0] == f.inv_freq[0]


def test_dynamic_ntk_matches_init_function_with_partial_rotary():
    d = {**MODEL_CONFIGS["pythia-1.4b"], "rope_scaling": {"rope_type": "dynamic", "factor": 3.0}}
    config = hf_config(d)
    for seq_len in (100, 2048, 3000, 12345):
        inv, scaling = hf_parameters(config, seq_len)
        g = from_hf_config(d).for_seq_len(seq_len)
        assert g.rotary_dim == 32
        assert_equal_bits(g.inv_freq, inv)
        assert g.attention_scaling == scaling == 1.0


@pytest.mark.parametrize("seq_len", [4096, 4097, 100000])
def test_longrope_switches_factors_like_transformers(seq_len):
    d = MODEL_CONFIGS["phi-3.5-mini-instruct"]
    rotary = hf_rotary(hf_config(d))
    rotary(torch.randn(1, 1, 8), torch.tensor([[seq_len - 1]]))
    f = from_hf_config(d)
    g = f.for_seq_len(seq_len)
    assert_equal_bits(g.inv_freq, rotary.inv_freq)
    assert g.attention_scaling == rotary.attention_scaling
    expected_scale = math.sqrt(1 + math.log(131072 / 4096) / math.log(4096))
    assert g.attention_scaling == pytest.approx(expected_scale, rel=1e-12)
    uses_long = seq_len > 4096
    ext = torch.tensor(PHI35_LONG if uses_long else PHI35_SHORT, dtype=torch.float64)
    assert_rel_close(g.inv_freq_float64, 10000.0 ** -(torch.arange(0, 96, 2, dtype=torch.float64) / 96) / ext, 1e-15)


def test_longrope_explicit_attention_factor_and_factor():
    base = MODEL_CONFIGS["phi-3.5-mini-instruct"]
    for extra in ({"attention_factor": 1.25}, {"factor": 16.0}, {"factor": 1.0}):
        d = copy.deepcopy(base)
        d["rope_scaling"].update(extra)
        config = hf_config(d)
        for seq_len in (None, 5000):
            inv, scaling = hf_parameters(config, seq_len)
            f = from_hf_config(d)
            g = f if seq_len is None else f.for_seq_len(seq_len)
            assert_equal_bits(g.inv_freq, inv)
            assert g.attention_scaling == scaling


@pytest.mark.parametrize("extra", [
    {},
    {"truncate": False},
    {"attention_factor": 0.8},
    {"mscale": 0.707, "mscale_all_dim": 1.0},
    {"mscale": 1.0, "mscale_all_dim": 0.0},  # one of them falsy: plain 0.1 ln f + 1
    {"beta_fast": 16, "beta_slow": 2},
    {"beta_fast": 0, "beta_slow": 0},  # falsy betas fall back to 32 / 1
    {"factor": None},  # derived from max_position_embeddings / original
    {"factor": 1.0},
    {"beta_fast": 4000.0, "beta_slow": 4000.0},  # an empty ramp (low == high)
])
def test_yarn_edge_cases_match_transformers(extra):
    d = copy.deepcopy(MODEL_CONFIGS["qwen3-8b-yarn"])
    d["rope_parameters"].update(extra)
    config = hf_config(d)
    inv, scaling = hf_parameters(config)
    f = from_hf_config(d)
    assert_equal_bits(f.inv_freq, inv)
    assert f.attention_scaling == scaling


def test_yarn_deepseek_attention_and_softmax_scale():
    d = copy.deepcopy(MODEL_CONFIGS["deepseek-v3"])
    d["rope_scaling"]["mscale"] = 0.707  # DeepSeek-V2-Lite's values: attention factor != 1
    config = hf_config(d)
    rotary = hf_rotary(config)
    f = from_hf_config(d)
    assert_equal_bits(f.inv_freq, rotary.inv_freq)
    assert f.attention_scaling == rotary.attention_scaling
    assert f.attention_scaling != pytest.approx(1.0)
    # the softmax scale DeepSeek's attention module uses, over the plain 1/sqrt(qk_head_dim) (weights on the meta
    # device: only the scale is read)
    attention_class = type(rotary).__name__.replace("RotaryEmbedding", "Attention")
    with torch.device("meta"):
        attention = getattr(sys.modules[type(rotary).__module__], attention_class)(config, layer_idx=0)
    plain = (d["qk_nope_head_dim"] + d["qk_rope_head_dim"]) ** -0.5
    assert f.softmax_scale != pytest.approx(1.0)
    assert f.softmax_scale == pytest.approx(attention.scaling / plain, rel=1e-12)
    assert from_hf_config(MODEL_CONFIGS["qwen3-8b"]).softmax_scale == 1.0
    # the vLLM name of the same method parses the same way
    d["rope_scaling"]["type"] = "deepseek_yarn"
    assert torch.equal(from_hf_config(d).inv_freq, f.inv_freq)


def test_llama3_bands():
    f = from_hf_config(MODEL_CONFIGS["llama-3.1-8b"])
    base = 500000.0 ** -(torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    wavelen = 2 * math.pi / base
    high = wavelen < 8192 / 4  # untouched
    low = wavelen > 8192 / 1  # divided by the factor
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    assert_rel_close(f.inv_freq[high], base[high], 1e-7)
    assert_rel_close(f.inv_freq[low], base[low] / 8, 1e-7)
    ratio = f.inv_freq_float64[mid] / base[mid]
    assert ((ratio > 1 / 8) & (ratio < 1)).all()
    assert (ratio[1:] <= ratio[:-1]).all()  # monotone blend from 1 down to 1/8


def test_proportional_matches_transformers():
    if "proportional" not in hf_init_functions():
        pytest.skip("this transformers has no 'proportional' rope type")
    for prf, factor in ((0.25, 1.0), (0.5, 8.0), (1.0, 2.0)):
        d = {"model_type": "llama", "hidden_size": 1024, "num_attention_heads": 4, "head_dim": 256,
             "max_position_embeddings": 8192,
             "rope_parameters": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": prf,
                                 "factor": factor}}
        inv, scaling = hf_parameters(hf_config(d))
        f = from_hf_config(d)
        assert f.rotary_dim == f.head_dim == 256
        nonzero = inv != 0
        assert torch.equal(f.inv_freq != 0, nonzero)
        assert_equal_bits(f.inv_freq, inv)
        assert f.attention_scaling == scaling


def test_every_type_transformers_has_is_supported():
    assert set(hf_init_functions()) <= set(ROPE_TYPES)


def test_per_layer_type_configs():
    transformers = pytest.importorskip("transformers")
    rope_parameters = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    config = transformers.Gemma3TextConfig(head_dim=256, rope_parameters=copy.deepcopy(rope_parameters))
    rotary = hf_rotary(config)
    for layer_type in ("full_attention", "sliding_attention"):
        for cfg in (config, {"model_type": "gemma3_text", "head_dim": 256, "rope_parameters": rope_parameters}):
            f = from_hf_config(cfg, layer_type=layer_type)
            assert_equal_bits(f.inv_freq, getattr(rotary, f"{layer_type}_inv_freq"))
            assert f.attention_scaling == getattr(rotary, f"{layer_type}_attention_scaling")
    with pytest.raises(ValueError, match="layer_type="):
        from_hf_config(config)
    with pytest.raises(ValueError, match="'chunked' has no rope parameters"):
        from_hf_config(config, layer_type="chunked")


def test_legacy_and_alias_spellings():
    base = {"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8, "max_position_embeddings": 2048}
    a = from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    b = from_hf_config({**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    assert torch.equal(a.inv_freq, b.inv_freq) and a.rope_type == b.rope_type == "linear"
    su = copy.deepcopy(MODEL_CONFIGS["phi-3.5-mini-instruct"])
    su["rope_scaling"]["type"] = "su"
    assert from_hf_config(su).rope_type == "longrope"
    mrope = from_hf_config({**base, "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}})
    assert mrope.rope_type == "default" and mrope.sections == (8, 12, 12) and mrope.section_layout == "contiguous"
    with pytest.raises(ValueError, match="mrope_section"):  # sections must cover the rotary pairs exactly
        from_hf_config({**base, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}})
    assert from_hf_config(base).base == 10000.0  # no theta anywhere: the transformers default



def test_one_table_of_model_families_feeds_config_parsing_and_patching():
    from ropekit.frequencies import STYLES
    from ropekit.frequencies.families import MODEL_FAMILIES, family_of
    from ropekit.integrations.patching import SUPPORTED_MODEL_TYPES

    assert set(SUPPORTED_MODEL_TYPES) == {t for t, fam in MODEL_FAMILIES.items() if fam.patched_functions}
    head = {"hidden_size": 256, "num_attention_heads": 2}  # head_dim 128
    for model_type, fam in MODEL_FAMILIES.items():
        # What the config leaves out comes from the family's row ...
        f = from_hf_config({**head, "model_type": model_type})
        assert (f.style, f.rotary_dim, f.sections) == (fam.pairing, int(128 * fam.partial_rotary_factor),
                                                      fam.mrope_section), model_type
        assert f.section_layout == ("interleaved" if fam.mrope_interleaved else "contiguous"), model_type
        assert family_of(f"{model_type}_text") is fam  # a vision-language model's text config: its model's family
        # ... and so do the functions patch replaces, whose text rotation (apply_rotary_pos_emb; Llama 4's
        # apply_rotary_emb) pairs as the family's attention does unless a config key switches the pairing
        # (DeepSeek-V3's rope_interleave picks between two functions).
        assert fam.pairing in STYLES
        kinds = dict(fam.patched_functions)
        assert set(kinds.values()) <= {"neox", "interleaved", "interleaved_to_halves", "vision"}, model_type
        if kinds and fam.interleave_key is None:
            text_rotation = kinds.get("apply_rotary_pos_emb", kinds.get("apply_rotary_emb"))
            assert text_rotation == fam.pairing, model_type
    assert from_hf_config({**head, "model_type": "deepseek_v3", "rope_interleave": False}).style == "neox"
    assert family_of("mamba") is None and from_hf_config({**head, "model_type": "mamba"}).style == "neox"

# ---- bit for bit against the installed transformers ------------------------------------------------------------

_L = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 8192}
_PHI = {"model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32, "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096}
_YARN_QWEN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768}
_YARN_DS = {"rope_type": "yarn", "rope_theta": 10000, "factor": 40, "mscale": 0.707, "mscale_all_dim": 1.0,
            "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096}
_LLAMA31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": PHI35_SHORT, "long_factor": PHI35_LONG}
EXACT_CONFIGS = {
    "default-theta500k": {**_L, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "default-theta10k": {**_L, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "linear": {**_L, "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    "linear-partial0.5": {**_L, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 3.0,
                                                    "partial_rotary_factor": 0.5}},
    "dynamic": {**_L, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
    "dynamic-partial0.25": {**_L, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 3.0,
                                                      "partial_rotary_factor": 0.25}},
    "llama3-8b": {**_L, "max_position_embeddings": 131072, "rope_parameters": _LLAMA31},
    "llama3-partial0.5": {**_L, "max_position_embeddings": 131072,
                          "rope_parameters": {**_LLAMA31, "partial_rotary_factor": 0.5}},
    "yarn-qwen": {**_L, "head_dim": 128, "max_position_embeddings": 131072, "rope_parameters": _YARN_QWEN},
    "yarn-no-truncate": {**_L, "head_dim": 64, "max_position_embeddings": 131072, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 150000, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "truncate": False}},
    "yarn-attention-factor": {**_L, "max_position_embeddings": 131072,
                              "rope_parameters": {**_YARN_QWEN, "attention_factor": 0.8}},
    "yarn-partial0.25": {**_L, "max_position_embeddings": 131072,
                         "rope_parameters": {**_YARN_QWEN, "partial_rotary_factor": 0.25}},
    "yarn-deepseek": {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
                      "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "kv_lora_rank": 512,
                      "q_lora_rank": 1536, "max_position_embeddings": 163840, "rope_parameters": _YARN_DS},
    "longrope-phi3": {**_PHI, "rope_parameters": _LONGROPE},
    "longrope-factor-and-attention": {**_PHI, "rope_parameters": {**_LONGROPE, "factor": 16.0,
                                                                  "attention_factor": 1.25}},
    "longrope-partial0.5": {**_PHI, "hidden_size": 6144, "rope_parameters": {**_LONGROPE,
                                                                             "partial_rotary_factor": 0.5}},
    "default-neox-partial0.25": MODEL_CONFIGS["gpt-neox-20b"],
    "default-glm-partial0.5": MODEL_CONFIGS["glm-4-9b-0414"],
}
if "proportional" in ROPE_TYPES:
    EXACT_CONFIGS["proportional"] = {**_L, "head_dim": 256, "rope_parameters": {
        "rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25, "factor": 8.0}}


@pytest.mark.parametrize("name", sorted(EXACT_CONFIGS))
def test_bit_exact_with_transformers_init_functions(name):
    d = EXACT_CONFIGS[name]
    config = hf_config(d)
    if config.rope_parameters["rope_type"] not in ("default", *hf_init_functions()):
        pytest.skip(f"this transformers has no {config.rope_parameters['rope_type']!r} rope type")
    inv, scaling = hf_parameters(config)
    for source in (d, config):
        f = from_hf_config(source)
        assert_equal_bits(f.inv_freq, inv)
        assert f.attention_scaling == scaling and type(f.attention_scaling) is float
    # dynamic / longrope at other lengths: transformers' function of the type with an int length
    M = f.max_position_embeddings
    for seq_len in (1, M - 1, M, M + 1, 3 * M + 17, 40 * M + 1, f.original_max_position_embeddings or 2):
        inv, scaling = hf_parameters(config, seq_len)
        g = f.for_seq_len(seq_len)
        assert_equal_bits(g.inv_freq, inv)
        assert g.attention_scaling == scaling


@pytest.mark.parametrize("name", ["dynamic", "dynamic-partial0.25"])
def test_dynamic_tensor_length_matches_transformers_module_update(name):
    # the rotary module passes position_ids.max() + 1, a tensor: transformers then forms the new base in float32,
    # which differs from the int-length value for some lengths
    d = EXACT_CONFIGS[name]
    config = hf_config(d)
    f = from_hf_config(d)
    lengths = torch.randint(8193, 200_000, (20,)).tolist() + [8193, 12345, 99999]
    differ = 0
    for seq_len in lengths:
        rotary = hf_rotary(config)
        rotary(torch.randn(1, 1, 4), torch.tensor([[seq_len - 1]]))
        g = f.for_seq_len(torch.tensor(seq_len))
        assert_equal_bits(g.inv_freq, rotary.inv_freq)
        differ += not torch.equal(g.inv_freq, f.for_seq_len(seq_len).inv_freq)
    assert differ  # the two paths really are different arithmetic (12345 is one such length)


def test_llama3_keeps_transformers_bounds_exactly():
    # transformers' own llama3 test: default / factor <= llama3 <= default, where the pairs beyond the
    # low-frequency wavelength are exactly default / factor (all in transformers' float32)
    for theta, factor in ((500000.0, 8.0), (500000.0, 32.0), (10000.0, 4.0)):
        params = {**_LLAMA31, "rope_theta": theta, "factor": factor}
        d = {**_L, "max_position_embeddings": 131072, "rope_parameters": params}
        default = {**d, "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
        default_inv, _ = hf_parameters(hf_config(default))
        own_default = from_hf_config(default)
        assert_equal_bits(own_default.inv_freq, default_inv)
        inv = from_hf_config(d).inv_freq
        assert ((default_inv / factor <= inv) & (inv <= default_inv)).all()
        low = 2 * math.pi / default_inv > 8192 / params["low_freq_factor"]
        assert low.sum() >= 10
        assert_equal_bits(inv[low], default_inv[low] / factor)


# ---- explicit construction, ggml knobs, tables -------------------------------------------------------------------


def test_rope_frequencies_rounds_the_config_path_values_once():
    f = rope_frequencies(128, 500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=8192)
    g = from_hf_config(MODEL_CONFIGS["llama-3.1-8b"])
    assert (f.arithmetic, g.arithmetic) == ("float64", "transformers")
    assert torch.equal(f.inv_freq_float64, g.inv_freq_float64)  # the same formulas...
    assert torch.equal(f.inv_freq, f.inv_freq_float64.to(torch.float32))  # ...rounded once here
    assert not torch.equal(f.inv_freq, g.inv_freq)  # transformers' float32 evaluation rounds more often
    assert_rel_close(g.inv_freq, f.inv_freq, 5 * 2.0**-23)


def test_freq_scale_and_freq_factors_follow_ggml():
    # ggml: theta_i = pos * freq_scale * base^(-2i/d) / freq_factors[i]
    d, base = 64, 10000.0
    factors = torch.rand(d // 2, dtype=torch.float64) * 3 + 0.5
    f = rope_frequencies(d, base, freq_scale=0.25, freq_factors=factors)
    expected = 0.25 * base ** -(torch.arange(0, d, 2, dtype=torch.float64) / d) / factors
    assert_rel_close(f.inv_freq_float64, expected, 1e-15)
    assert_rel_close(f.inv_freq, expected, 6e-8)  # one float32 rounding
    # freq_scale = 1/f is linear scaling by f
    lin = rope_frequencies(d, base, rope_type="linear", factor=4.0)
    assert_rel_close(rope_frequencies(d, base, freq_scale=0.25).inv_freq, lin.inv_freq, 1e-7)
    # the knobs stack on top of a scaled type and survive a dynamic recomputation
    dyn = rope_frequencies(d, base, rope_type="dynamic", factor=2.0, max_position_embeddings=1024, freq_scale=0.5)
    plain = rope_frequencies(d, base, rope_type="dynamic", factor=2.0, max_position_embeddings=1024)
    assert_rel_close(dyn.for_seq_len(5000).inv_freq_float64, plain.for_seq_len(5000).inv_freq_float64 * 0.5, 1e-15)


def test_precomputed_table():
    table = torch.rand(24, dtype=torch.float64) * 0.9 + 0.01
    f = RopeFrequencies.from_inv_freq(table, attention_scaling=1.1, head_dim=64, style="interleaved")
    assert f.rotary_dim == 48 and f.head_dim == 64 and f.style == "interleaved"
    assert torch.equal(f.inv_freq, table.to(torch.float32)) and torch.equal(f.inv_freq_float64, table)
    assert f.attention_scaling == 1.1 and not f.is_dynamic and f.for_seq_len(10**6) is f
    g = RopeFrequencies.from_inv_freq(table, freq_factors=torch.full((24,), 2.0))
    assert torch.equal(g.inv_freq_float64, table / 2)


def test_cos_sin_exact_at_long_positions():
    f = from_hf_config(MODEL_CONFIGS["llama-3.1-8b"])
    pos = torch.tensor([0, 1, 131071, 1_000_003, 2**24 + 5, 2**29 - 1])
    cos, sin = f.cos_sin(pos, torch.float64, full=False)
    inv = f.inv_freq.tolist()
    for r, p in enumerate(pos.tolist()):
        for i in (0, 1, 17, 40, 63):
            angle = p * inv[i]  # exact: a float32 value times an integer below 2**29 fits a float64
            assert cos[r, i].item() == pytest.approx(math.cos(angle), abs=1e-9)
            assert sin[r, i].item() == pytest.approx(math.sin(angle), abs=1e-9)


def test_cos_sin_layouts_and_scaling():
    f = from_hf_config(MODEL_CONFIGS["qwen3-8b-yarn"])
    pos = torch.arange(7)
    half_c, half_s = f.cos_sin(pos, full=False)
    full_c, full_s = f.cos_sin(pos)
    assert half_c.shape == (7, 64) and full_c.shape == (7, 128)
    assert torch.equal(full_c[:, :64], half_c) and torch.equal(full_c[:, 64:], half_c)
    assert torch.equal(full_s[:, 64:], half_s)
    torch.testing.assert_close(half_c[0], torch.full((64,), f.attention_scaling))
    torch.testing.assert_close(half_c**2 + half_s**2, torch.full((7, 64), f.attention_scaling**2))
    assert f.cos_sin(pos, torch.bfloat16)[0].dtype == torch.bfloat16


def test_apply_kwargs_and_wavelengths():
    f = from_hf_config(MODEL_CONFIGS["gpt-neox-20b"])
    kw = f.apply_kwargs()
    assert kw["rotary_dim"] == 24 and kw["style"] == "neox" and kw["rotary_at"] == "front"
    assert kw["inv_freq"] is f.inv_freq and kw["rotary_scale"] == 1.0
    torch.testing.assert_close(f.wavelengths, 2 * math.pi / f.inv_freq.double())
    assert f.to_dict()["rotary_dim"] == 24


# ---- errors ------------------------------------------------------------------------------------------------------

_LLAMA = {"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8, "max_position_embeddings": 2048,
          "rope_theta": 10000.0}


@pytest.mark.parametrize("rope_scaling, match", [
    ({"rope_type": "ntk-by-parts"}, r"rope_type 'ntk-by-parts' is not supported; expected one of \['default'"),
    ({"rope_type": "linear"}, r"rope_type 'linear' needs rope_parameters\['factor'\]"),
    ({"rope_type": "dynamic", "factor": "2"}, r"rope_parameters\['factor'\] must be a number"),
    ({"rope_type": "linear", "factor": 0.0}, r"rope_parameters\['factor'\] must be a finite number > 0, got 0.0"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
     r"rope_type 'llama3' needs rope_parameters\['high_freq_factor'\]"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     r"high_freq_factor'\] \(1.0\) must exceed"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 32}, r"needs rope_parameters\['long_factor'\]"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 31, "long_factor": [1.0] * 32},
     r"rope_parameters\['short_factor'\] must hold rotary_dim // 2 = 32 numbers, got 31"),
])
def test_bad_configs_raise(rope_scaling, match):
    with pytest.raises(ValueError, match=match):
        from_hf_config({**_LLAMA, "rope_scaling": rope_scaling})


def test_bad_shapes_and_arguments_raise():
    with pytest.raises(ValueError, match=r"int\(64 \* 0.3\) = 19 is odd"):  # Phi applies the factor (Llama does not)
        from_hf_config({**_LLAMA, "model_type": "phi", "partial_rotary_factor": 0.3})
    with pytest.raises(ValueError, match="needs head_dim, or hidden_size and num_attention_heads"):
        from_hf_config({"model_type": "llama", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="'dynamic' needs max_position_embeddings"):
        rope_frequencies(64, rope_type="dynamic", factor=2.0)
    with pytest.raises(ValueError, match=r"rope_type 'linear' does not read \['low_freq_factor'\]"):
        rope_frequencies(64, rope_type="linear", factor=2.0, low_freq_factor=1.0)
    with pytest.raises(ValueError, match="freq_factors must hold rotary_dim // 2 = 32 values, got 4"):
        rope_frequencies(64, freq_factors=[1.0] * 4)
    with pytest.raises(ValueError, match="freq_factors must be finite and positive"):
        rope_frequencies(4, freq_factors=[1.0, 0.0])
    with pytest.raises(ValueError, match="style must be one of"):
        rope_frequencies(64, style="gptj")
    with pytest.raises(ValueError, match=r"head_dim \(32\) must be at least rotary_dim \(64\)"):
        rope_frequencies(64, head_dim=32)
    with pytest.raises(ValueError, match="must be a finite number > 1"):
        rope_frequencies(64, base=1.0)
    with pytest.raises(ValueError, match="positions must be integers"):
        rope_frequencies(64).angles(torch.tensor([1.5]))
    with pytest.raises(TypeError, match="config must be a transformers PretrainedConfig or a Mapping"):
        from_hf_config(42)


# Every key a rope type reads, with values that used to give NaN/inf/zero frequencies or leak an internal error.
_GOOD = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "attention_factor": 1.1,
             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "truncate": True},
    "longrope": {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 512,
                 "attention_factor": 1.2, "short_factor": [1.0] * 32, "long_factor": [2.0] * 32},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512},
    "proportional": {"rope_type": "proportional", "factor": 2.0, "partial_rotary_factor": 0.5},
}
_WRONG_TYPES = ["2", [2.0], {"a": 1}, True]
_BAD = {
    "factor": [0, 0.0, -1.0, math.nan, math.inf, -math.inf, *_WRONG_TYPES],
    "attention_factor": [0.0, -0.5, math.nan, math.inf, *_WRONG_TYPES],
    "original_max_position_embeddings": [0, -4096, 4096.5, 512.0, math.inf, math.nan, *_WRONG_TYPES],
    "beta_fast": [-1.0, math.nan, math.inf, 1e308, *_WRONG_TYPES],  # 0 means "the default" in transformers
    "beta_slow": [-1.0, math.nan, math.inf, 1e-320, *_WRONG_TYPES],
    "mscale": [-1.0, math.nan, math.inf, *_WRONG_TYPES],
    "mscale_all_dim": [-1.0, math.nan, math.inf, 1e308, *_WRONG_TYPES],
    "truncate": ["no", 1, [True]],
    "low_freq_factor": [0.0, -1.0, math.nan, math.inf, *_WRONG_TYPES],
    "high_freq_factor": [0.0, -1.0, math.nan, math.inf, *_WRONG_TYPES],
    "short_factor": ["abc", 3.0, {"a": 1}, *([1.0] * 31 + [v] for v in (0.0, -1.0, math.nan, math.inf, "1", None))],
    "long_factor": [[1.0] * 16, *([v] + [1.0] * 31 for v in (0.0, -2.0, math.nan, -math.inf, [1.0]))],
    "partial_rotary_factor": [-0.5, 1.5, math.nan, math.inf, *_WRONG_TYPES],
}
_BAD_PARAMETERS = [pytest.param({**good, key: value}, key, id=f"{rope_type}-{key}-{i}")
                   for rope_type, good in _GOOD.items() for key in good if key != "rope_type"
                   for i, value in enumerate(_BAD[key])]


@pytest.mark.parametrize("params, key", _BAD_PARAMETERS)
def test_degenerate_parameters_raise_naming_the_key(params, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        from_hf_config({**_LLAMA, "rope_parameters": params})
    kwargs = {k: v for k, v in params.items() if k != "rope_type"}
    with pytest.raises(ValueError, match=re.escape(key)):
        rope_frequencies(64, rope_type=params["rope_type"], max_position_embeddings=2048, **kwargs)


def test_degenerate_parameter_message():
    with pytest.raises(ValueError, match=re.escape("rope_parameters['factor'] must be a finite number > 0, got inf")):
        from_hf_config({**_LLAMA, "rope_parameters": {"rope_type": "linear", "factor": math.inf}})


@pytest.mark.parametrize("key, value", [
    ("max_position_embeddings", 0), ("max_position_embeddings", -1), ("max_position_embeddings", 2048.5),
    ("max_position_embeddings", "2048"), ("max_position_embeddings", math.inf), ("max_position_embeddings", True),
    ("original_max_position_embeddings", 0), ("original_max_position_embeddings", "4096"),
    ("rope_theta", math.inf), ("rope_theta", math.nan), ("rope_theta", 1.0), ("rope_theta", -1e4),
    ("rope_theta", "1e4"), ("rope_theta", [1e4]), ("rope_theta", 1e300),
    ("hidden_size", "512"), ("hidden_size", -512), ("hidden_size", 512.5), ("num_attention_heads", "8"),
    ("num_attention_heads", -8), ("num_attention_heads", 1000), ("head_dim", -64), ("head_dim", "64"),
    ("head_dim", 64.5), ("partial_rotary_factor", -0.5), ("partial_rotary_factor", 1.5),
    ("partial_rotary_factor", math.nan), ("partial_rotary_factor", "0.5"), ("partial_rotary_factor", 1e-9),
    ("rotary_pct", math.inf), ("rotary_dim", 63), ("rotary_dim", "64"), ("rope_parameters", "linear"),
    ("rope_parameters", [("rope_type", "linear")]), ("rope_scaling", 3), ("model_type", ["llama"]),
])
def test_bad_config_entries_raise_naming_the_key(key, value):
    # dynamic + yarn-like keys so that every entry is read; a value of the wrong type is a ValueError too
    config = {**_LLAMA, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, key: value}
    if key == "original_max_position_embeddings":
        config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match=re.escape(key)):
        from_hf_config(config)


@pytest.mark.parametrize("rope_parameters, key", [
    ({"rope_type": ["linear"], "factor": 2.0}, "rope_type"),  # was "unhashable type"
    ({"rope_type": "linear", "factor": 1e-300}, "factor"),  # finite, but the frequencies overflow float32
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 1e-320},
     "beta_fast"),  # was "math domain error" / an OverflowError
    ({"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 1, "short_factor": [1.0] * 32,
      "long_factor": [1.0] * 32}, "original_max_position_embeddings"),  # was a ZeroDivisionError
])
def test_config_errors_that_used_to_leak(rope_parameters, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        from_hf_config({**_LLAMA, "rope_parameters": rope_parameters}, layer_type="full_attention")


_DYN = {**_LLAMA, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
_BAD_CALLS = {  # id: (call, exception, the argument its message names)
    "rotary_dim-str": (lambda: rope_frequencies("64"), TypeError, "rotary_dim"),
    "rotary_dim-float": (lambda: rope_frequencies(64.0), TypeError, "rotary_dim"),
    "rotary_dim-None": (lambda: rope_frequencies(None), TypeError, "rotary_dim"),
    "rotary_dim-2-dynamic": (lambda: rope_frequencies(2, rope_type="dynamic", factor=2.0,
                                                      max_position_embeddings=64), ValueError, "rotary_dim"),
    "base-None": (lambda: rope_frequencies(64, None), TypeError, "base"),
    "base-nan": (lambda: rope_frequencies(64, math.nan), ValueError, "base"),
    "head_dim-str": (lambda: rope_frequencies(64, head_dim="128"), TypeError, "head_dim"),
    "rope_type-list": (lambda: rope_frequencies(64, rope_type=["linear"]), TypeError, "rope_type"),
    "max_pos-0": (lambda: rope_frequencies(64, rope_type="dynamic", factor=2.0, max_position_embeddings=0),
                  ValueError, "max_position_embeddings"),  # was a ZeroDivisionError
    "max_pos-inf": (lambda: rope_frequencies(64, rope_type="dynamic", factor=2.0,
                                             max_position_embeddings=math.inf), TypeError, "max_position_embeddings"),
    "freq_scale-nan": (lambda: rope_frequencies(64, freq_scale=math.nan), ValueError, "freq_scale"),
    "freq_scale-0": (lambda: rope_frequencies(64, freq_scale=0), ValueError, "freq_scale"),
    "freq_scale-str": (lambda: from_hf_config(_LLAMA, freq_scale="1"), TypeError, "freq_scale"),
    "freq_factors-dict": (lambda: rope_frequencies(4, freq_factors={"a": 1}), TypeError, "freq_factors"),
    "freq_factors-nan": (lambda: rope_frequencies(4, freq_factors=[1.0, math.nan]), ValueError, "freq_factors"),
    "layer_type-list": (lambda: from_hf_config(_LLAMA, layer_type=["full"]), TypeError, "layer_type"),
    "config-None": (lambda: from_hf_config(None), TypeError, "config"),
    "inv_freq-None": (lambda: RopeFrequencies.from_inv_freq(None), TypeError, "inv_freq"),
    "attention_scaling-str": (lambda: RopeFrequencies.from_inv_freq([0.1], attention_scaling="1"), TypeError,
                              "attention_scaling"),
    "attention_scaling-nan": (lambda: RopeFrequencies.from_inv_freq([0.1], attention_scaling=math.nan), ValueError,
                              "attention_scaling"),
    "seq_len-str": (lambda: from_hf_config(_DYN).for_seq_len("10"), TypeError, "seq_len"),
    "seq_len-inf": (lambda: from_hf_config(_DYN).for_seq_len(math.inf), TypeError, "seq_len"),
    "seq_len-negative": (lambda: from_hf_config(_DYN).for_seq_len(-1), ValueError, "seq_len"),
    "seq_len-tensor": (lambda: from_hf_config(_DYN).for_seq_len(torch.tensor([1, 2])), TypeError, "seq_len"),
    "positions-None": (lambda: from_hf_config(_LLAMA).angles(None), TypeError, "positions"),
    "positions-dict": (lambda: from_hf_config(_LLAMA).cos_sin({}), TypeError, "positions"),
}


@pytest.mark.parametrize("name", sorted(_BAD_CALLS))
def test_bad_arguments_raise_naming_the_argument(name):
    call, exception, argument = _BAD_CALLS[name]
    with pytest.raises(exception, match=re.escape(argument)):
        call()
