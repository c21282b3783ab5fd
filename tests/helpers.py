"""What several test files share: the routes a test runs on, float64 oracles, and ``assert_close_to_ref`` taking a
``{dtype: dict(rtol, atol)}`` table (the general helpers live in :mod:`ropekit.testing`)."""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
from collections.abc import Mapping

import pytest
import torch

from ropekit import testing
from ropekit._spec import BACKWARD, FORWARD
from ropekit._validation import validate
from ropekit.reference import rope_reference


def assert_close_to_ref(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
                        backend: str | Mapping | None = None) -> None:
    """:func:`ropekit.testing.assert_close_to_ref`; ``backend`` may also be a ``{dtype: dict(rtol, atol)}`` table."""
    if isinstance(backend, Mapping):
        testing.assert_close_to_ref(out, ref, dtype, tol=testing.Tolerance(**backend[dtype]))
    else:
        testing.assert_close_to_ref(out, ref, dtype, backend)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The three routes a prologue test runs on: plain CPU tensors (the float64 torch path), CPU tensors through the
# Triton kernels under the interpreter (ropekit.testing.kernels_on_cpu), and CUDA.
ROUTES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cpu-kernels", id="cpu-kernels",
                 marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
KERNEL_ROUTES = ROUTES[1:]


def route_context(route: str):
    """The context a route runs in: ``kernels_on_cpu()`` for "cpu-kernels", else nothing."""
    return testing.kernels_on_cpu() if route == "cpu-kernels" else contextlib.nullcontext()


def route_device(route: str) -> str:
    return "cuda" if route == "cuda" else "cpu"


def reference_rope(q, k, conjugate=False, **kwargs):
    """The float64 reference of ``apply_rope(q, k, **kwargs)`` (of ``rope_backward`` with ``conjugate``)."""
    spec = validate(q, k, **kwargs, mode=BACKWARD if conjugate else FORWARD)
    return rope_reference(q, k, spec._replace(out_dtype=torch.float64))


def rope64(x, positions, base=10000.0, *, as_apply_rope=False):
    """Independent float64 RoPE on [B, S, H, D] (rotate_half form) for gradient oracles. ``as_apply_rope``: with
    apply_rope's frequencies (rounded once to float32, :func:`inv_freq64`), for checks at its own tolerance."""
    D = x.shape[-1]
    inv = inv_freq64(D, base) if as_apply_rope else base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = positions.to(torch.float64)[..., None] * inv  # [B, S, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, :, None], torch.cat([ang.sin()] * 2, -1)[:, :, None]
    half = D // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin



# ------------------------------------------------------------------------------------ the prologue's oracles
# The tolerance column of each route. The contract of both prologue ops is fp32 math with one rounding at the store
# on every route; on CPU tensors that is the table's "float32-path" entry (fp32 math, one rounding to nearest), which
# a float64 CPU implementation meets too. Under the interpreter bfloat16 stores truncate ("triton-interpreter").
ROUTE_BACKENDS = {"cpu": "float32-path", "cpu-kernels": "triton-interpreter", "cuda": "kernels"}


@contextlib.contextmanager
def fast_path(enabled: bool):
    """Within the block the eager fast path (plans, the float32 path's kept tables) is ``enabled``."""
    import ropekit

    previous = ropekit.set_fast_path(enabled)
    try:
        yield
    finally:
        ropekit.set_fast_path(previous)


@contextlib.contextmanager
def on_route(route: str, *, clear_plans: bool = False):
    """The context of a route; yields the torch device of its tensors. ``clear_plans``: launch plans start empty."""
    if clear_plans:
        from ropekit import _fastpath

        _fastpath.clear()
    with route_context(route):
        yield route_device(route)


def inv_freq64(R: int, base: float = 10000.0, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """[R/2] inverse frequencies in float64: the tensor given, else apply_rope's ``base ** (-2i / R)`` (formed in
    float64 and rounded once to float32, as ``apply_rope(..., base=)`` documents)."""
    if inv_freq is not None:
        return inv_freq.detach().cpu().double()
    return (base ** -(torch.arange(0, R, 2, dtype=torch.float64) / R)).float().double()


def angles64(pos: torch.Tensor, R: int, *, base: float = 10000.0, inv_freq: torch.Tensor | None = None,
             sections=None) -> torch.Tensor:
    """Angles [..., R/2] of tokens at integer positions ``pos`` [...]; multi-axis: ``pos`` [A, ...] and
    ``sections`` (pairs per axis, contiguous: the first n_0 pairs turn with axis 0, the next n_1 with axis 1...)."""
    inv = inv_freq64(R, base, inv_freq)
    pos = pos.detach().cpu().double()
    if sections is None:
        return pos[..., None] * inv
    axis = torch.repeat_interleave(torch.arange(len(sections)), torch.tensor(list(sections)))
    return torch.stack(list(pos), dim=-1)[..., axis] * inv


def rotate64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, style: str = "neox",
             rotary_dim: int | None = None, rotary_at: str = "front", scale: float = 1.0,
             rotary_scale: float = 1.0) -> torch.Tensor:
    """RoPE of float64 ``x`` [..., H, D] by per-token ``cos``/``sin`` [..., R/2]: ``lo' = lo cos - hi sin``,
    ``hi' = hi cos + lo sin`` for the pairs (i, i + R/2) (neox) or (2i, 2i + 1) (interleaved) of the R rotated
    columns (the first R, or the last R for rotary_at="back"); the other columns pass through; the whole head is
    multiplied by ``scale``. Differentiable (no in-place writes)."""
    D = x.shape[-1]
    R = rotary_dim or D
    start = 0 if rotary_at == "front" else D - R
    c, s = cos[..., None, :] * rotary_scale, sin[..., None, :] * rotary_scale
    before, part, after = x[..., :start], x[..., start:start + R], x[..., start + R:]
    if style == "neox":
        lo, hi = part[..., : R // 2], part[..., R // 2:]
    else:
        lo, hi = part[..., 0::2], part[..., 1::2]
    lo2, hi2 = lo * c - hi * s, hi * c + lo * s
    rotated = torch.cat([lo2, hi2], -1) if style == "neox" else torch.stack([lo2, hi2], -1).flatten(-2)
    return torch.cat([before, rotated, after], -1) * scale


def rms64(x: torch.Tensor, w: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    """``x * rsqrt(mean(x**2 over D) + eps) * (w + weight_offset)`` in float64."""
    x = x.cpu().double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w.cpu().double() + weight_offset)


def cos_sin64(pos: torch.Tensor, D: int, opts: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cos and sin [..., R/2] for apply_rope's options ``opts`` (tables, inv_freq, base, sections)."""
    if opts.get("cos") is not None:
        return opts["cos"].cpu().double()[pos], opts["sin"].cpu().double()[pos]
    R = opts.get("rotary_dim") or D
    ang = angles64(pos, R, base=opts.get("base", 10000.0), inv_freq=opts.get("inv_freq"),
                    sections=opts.get("sections"))
    return ang.cos(), ang.sin()


def rope_opts64(opts: dict, scale: float) -> dict:
    return dict(style=opts.get("style", "neox"), rotary_dim=opts.get("rotary_dim"),
                rotary_at=opts.get("rotary_at", "front"), rotary_scale=opts.get("rotary_scale", 1.0), scale=scale)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``x`` on CPU (NaN == NaN, -0 != +0)."""
    return x.detach().cpu().contiguous().view(_INT_OF_SIZE[x.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def norm_weight(D: int, dtype, device, weight_offset: float = 0.0) -> torch.Tensor:
    """A random norm weight [D] around 1 - weight_offset (so that w + weight_offset is around 1)."""
    w = 1.0 - weight_offset + 0.3 * torch.randn(D, dtype=torch.float64)
    return w.to(dtype=dtype, device=device)


def snapshot(*tensors):
    return [t.clone() if isinstance(t, torch.Tensor) else t for t in tensors]


def assert_unchanged(tensors, before):
    for t, b in zip(tensors, before):
        if isinstance(t, torch.Tensor):
            assert same_bits(t, b), "an input was modified"


# ------------------------------------------------------------------------------------------ model configs
# The RoPE-relevant fields of published ``config.json`` files (no downloads), and transformers' side of them: the
# frequency, module and plot tests share them.

# Phi-3.5-mini-instruct's LongRoPE factors (48 = head_dim 96 / 2).
PHI35_LONG = [
    1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
    1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
    4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
    17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
    32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
    50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
    62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
    63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
    64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
    64.51000213623047, 64.52999877929688, 64.83999633789062,
]
PHI35_SHORT = [
    1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979, 1.0999999046325684,
    1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
    1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788,
    1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745, 2.0199997425079346,
    2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0799996852874756,
    2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533, 2.729999542236328,
    2.749999523162842, 2.8399994373321533,
]

MODEL_CONFIGS: dict[str, dict] = {
    # llama3 smoothing (Llama 3.1)
    "llama-3.1-8b": {
        "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    },
    "llama-3.2-1b": {
        "model_type": "llama", "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    },
    # linear position interpolation (LongChat / Vicuna v1.5 16k)
    "vicuna-7b-v1.5-16k": {
        "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 4096,
        "rope_theta": 10000.0, "rope_scaling": {"factor": 4.0, "type": "linear"},
    },
    # dynamic NTK on a Llama 2 (the rope_scaling of transformers' documentation)
    "llama-2-7b-dynamic": {
        "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 4096,
        "rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0},
    },
    "qwen2.5-7b-instruct": {
        "model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
        "intermediate_size": 18944, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rope_scaling": None, "sliding_window": 131072,
    },
    # Qwen2.5's documented long-context setting: YaRN x4 (legacy "type" key)
    "qwen2.5-7b-instruct-yarn": {
        "model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 131072, "rope_theta": 1000000.0,
        "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
    },
    # transformers 5 spelling: rope_parameters carries rope_theta
    "qwen3-8b": {
        "model_type": "qwen3", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 40960,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "qwen3-8b-yarn": {
        "model_type": "qwen3", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                            "original_max_position_embeddings": 32768},
    },
    "mistral-7b-v0.1": {
        "model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "rope_theta": 10000.0, "sliding_window": 4096,
    },
    # head_dim (128) differs from hidden_size / heads (160)
    "mistral-nemo-2407": {
        "model_type": "mistral", "hidden_size": 5120, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 1024000, "rope_theta": 1000000.0,
    },
    # LongRoPE with the pretraining length beside rope_scaling
    "phi-3.5-mini-instruct": {
        "model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
        "rope_scaling": {"long_factor": PHI35_LONG, "short_factor": PHI35_SHORT, "type": "longrope"},
    },
    # DeepSeek YaRN: mscale / mscale_all_dim, MLA rope head 64, interleaved pairs
    "deepseek-v3": {
        "model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
    },
    # YaRN without truncating the correction range
    "gpt-oss-20b": {
        "model_type": "gpt_oss", "hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "max_position_embeddings": 131072, "rope_theta": 150000,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    },
    # partial rotary through GPT-NeoX's own key names
    "gpt-neox-20b": {
        "model_type": "gpt_neox", "hidden_size": 6144, "num_attention_heads": 64, "max_position_embeddings": 2048,
        "rotary_pct": 0.25, "rotary_emb_base": 10000,
    },
    "pythia-1.4b": {
        "model_type": "gpt_neox", "hidden_size": 2048, "num_attention_heads": 16, "max_position_embeddings": 2048,
        "rotary_pct": 0.25, "rotary_emb_base": 10000,
    },
    # interleaved pairs, half the head rotated
    "glm-4-9b-0414": {
        "model_type": "glm4", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 2,
        "head_dim": 128, "partial_rotary_factor": 0.5, "max_position_embeddings": 32768, "rope_theta": 10000.0,
    },
}


def hf_config(d: dict):
    """A transformers config object built from a copy of ``d`` (transformers mutates the dicts it is given)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoConfig.for_model(**copy.deepcopy(d))


def hf_rotary(config):
    """The model's own rotary-embedding module (its default init differs per family)."""
    module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    classes = [getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding") and "Vision" not in n]
    classes = [c for c in classes if c.__module__ == module.__name__]
    assert len(classes) == 1, classes
    return classes[0](config)


# ------------------------------------------------------------------------------------ tiny transformers models
# Random models built from configs (no downloads), for the patching tests.

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64)


# Sequences of 24 tokens pass original_max_position_embeddings = 16: the scaled regimes are exercised.
TINY = {
    "llama": dict(num_key_value_heads=2, rope_theta=5e5, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    "mistral": dict(num_key_value_heads=2, head_dim=32),
    "qwen2": dict(num_key_value_heads=2, rope_scaling={"type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 16}),
    "qwen3": dict(num_key_value_heads=2, head_dim=16),
    # LongRoPE with partial rotary (as Phi-4-mini): 12 of 16 columns rotated
    "phi3": dict(num_key_value_heads=2, partial_rotary_factor=0.75, original_max_position_embeddings=16,
                 pad_token_id=0, eos_token_id=1, bos_token_id=1, rope_scaling={
                     "type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                     "long_factor": [1.0 + 0.7 * i for i in range(6)]}),
    "gpt_neox": dict(rotary_pct=0.25),
    "glm": dict(num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, pad_token_id=0),
    # every token uses all 4 experts: bf16 rounding cannot flip the routing between patched and unpatched runs
    "deepseek_v3": dict(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=4,
                        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, rope_scaling={
                            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.707,
                            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
}


FAMILIES = sorted(TINY)


def tiny_model(model_type: str, dtype=torch.float32, **overrides):
    transformers = pytest.importorskip("transformers")
    kwargs = {**COMMON, **copy.deepcopy(TINY[model_type]), **overrides}
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(1234)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype)


def forward_backward(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().float(), grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def no_patch_leaks():
    """Autouse in the patching tests' modules (imported there): no test leaves a module-level function patched."""
    from ropekit.integrations import patching

    yield
    assert not patching._ORIGINALS, "a test left a module-level function patched"


VL_SECTIONS = {"qwen2_vl": [4, 6, 6], "qwen2_5_vl": [4, 6, 6], "qwen3_vl": [6, 5, 5]}


def tiny_vl_model(model_type: str):
    """A tiny random vision-language model (no downloads); its language model's rotation is M-RoPE."""
    transformers = pytest.importorskip("transformers")
    text = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": VL_SECTIONS[model_type]})
    vision = dict(depth=1, hidden_size=32, embed_dim=32, num_heads=2, intermediate_size=64, out_hidden_size=128,
                  hidden_act="silu")
    config = transformers.AutoConfig.for_model(model_type, text_config=text, vision_config=vision)
    torch.manual_seed(1234)
    return transformers.AutoModelForImageTextToText.from_config(config).float()


# --- compiling a captured launch for a GPU target on a machine without one --------------------------------------

# target -> (Triton's target, what torch.version.hip reads on such a machine)
GPU_TARGETS = {"sm90": (("cuda", 90, 32), None), "gfx942": (("hip", "gfx942", 64), "6.2")}
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
                torch.int32: "i32", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


def compile_for_target(target: str, fn, args, consts: dict, num_warps: int):
    """Compile ``fn`` for ``target`` (a key of :data:`GPU_TARGETS`) with these runtime arguments (CPU tensors stand
    for device pointers: 16-byte aligned, as the GPU's JIT marks them; ints equal to 1 made constants and ints
    divisible by 16 marked so, as the JIT specialises them unless ``do_not_specialize`` names them) and
    constexprs. With the 1s specialised the SASS of a decode launch is the GPU's own, instruction for instruction
    (checked on an H100 with Triton 3.6)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    gpu_target, _ = GPU_TARGETS[target]
    consts = dict(consts)
    signature, attrs, values = {}, {}, iter(args)
    for index, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        value = next(values)
        dynamic = name in fn.do_not_specialize or index in fn.do_not_specialize
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif type(value) is int and value == 1 and not dynamic:
            signature[name], consts[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0 and not dynamic:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature, consts, attrs)
    return triton.compile(source, target=GPUTarget(*gpu_target), options={"num_warps": num_warps})
