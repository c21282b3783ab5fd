"""RotaryEmbedding: rotations equal transformers' own apply functions (each family's pairing, partial rotary,
attention scaling), dynamic/longrope switching with transformers' state, layouts, gradients, dtypes; on the kernels
with launch plans (CUDA marked ``gpu``) and under torch.compile."""

from __future__ import annotations

import copy
import importlib
import math
import re
import sys
import threading

import pytest
import torch

from helpers import KERNEL_ROUTES, MODEL_CONFIGS, hf_config, hf_rotary, on_route
from ropekit.api import apply_rope
from ropekit.frequencies import from_hf_config, rope_frequencies
from ropekit.modules import RotaryEmbedding, hf_tables
from ropekit.testing import assert_close_to_ref


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
        assert rope.max_seq_len_cached == int(rotary.max_seq_len_cached)
        assert torch.equal(rope.inv_freq, rotary.inv_freq)  # bit for bit, grown sets included
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
        assert torch.equal(rope.inv_freq, rotary.inv_freq)
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


# ---- state: threads, failed calls ---------------------------------------------------------------------------------

_SMALL_DYNAMIC = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 16,
                  "rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}}


@pytest.mark.parametrize("method", ["forward", "cos_sin"])
def test_threads_sharing_a_dynamic_module_rotate_with_their_own_frequencies(method):
    # max_position_embeddings 16: calls of 8 or 12 tokens reset to the original set, longer ones grow it. Given
    # transformers' rules, a call of length L < 16 must use the original set and a call of length L > 16 the set
    # grown to some length >= L (its own, or a longer one another thread left) -- whatever the interleaving.
    rope = RotaryEmbedding(_SMALL_DYNAMIC)
    f0 = rope.frequencies
    lengths = [8, 12, 20, 24, 28, 32]
    grown = {n: f0.for_seq_len(torch.tensor(n)) for n in lengths if n > 16}
    allowed = {n: [f0] if n < 16 else [g for m, g in grown.items() if m >= n] for n in lengths}
    calls = [(lengths[i % len(lengths)], torch.randn(1, lengths[i % len(lengths)], 2, 64)) for i in range(8 * 150)]
    order = torch.randperm(len(calls)).tolist()
    outputs = [None] * len(calls)

    def run(q, inv_freq=None, scale=None):  # through the module, or the reference for one frequency set
        if method == "forward":
            return rope(q) if inv_freq is None else apply_rope(q, inv_freq=inv_freq, rotary_scale=scale)
        pos = torch.arange(q.shape[1])
        return rope.cos_sin(pos) if inv_freq is None else hf_tables(pos, inv_freq, scale)

    def worker(indices):
        for i in indices:
            outputs[i] = run(calls[i][1])

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up in every run
    try:
        threads = [threading.Thread(target=worker, args=(order[t::8],)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    wrong = 0
    for (n, q), out in zip(calls, outputs):
        refs = [run(q, g.inv_freq, g.attention_scaling) for g in allowed[n]]
        wrong += not any(all(map(torch.equal, out, ref)) if method == "cos_sin" else torch.equal(out, ref)
                         for ref in refs)
    assert wrong == 0, f"{wrong} of {len(calls)} calls rotated with another call's frequencies"
    # the state left behind is consistent
    assert torch.equal(rope.inv_freq, rope.frequencies.inv_freq)
    assert rope.frequencies.seq_len in (None, rope.max_seq_len_cached)


def _narrow_q(length):  # head_dim 64 < rotary_dim 128: rejected after the frequencies were chosen
    return lambda rope: rope(torch.randn(1, 1, 2, 64), positions=torch.tensor([[length - 1]]))


_FAILING_CALLS = {
    "narrow-q-growing": _narrow_q(9000),
    "narrow-q-resetting": _narrow_q(100),
    "float-positions": lambda rope: rope(torch.randn(1, 1, 2, 128), positions=torch.tensor([[8999.0]])),
    "positions-wrong-shape": lambda rope: rope(torch.randn(1, 2, 2, 128), positions=torch.tensor([[1, 8999, 3]])),
    "k-wrong-head_dim": lambda rope: rope(torch.randn(1, 2, 2, 128), torch.randn(1, 2, 2, 96), seq_len=9000),
    "cos_sin-bad-dtype": lambda rope: rope.cos_sin(torch.tensor([8999]), dtype="float32"),
}


@pytest.mark.parametrize("name", sorted(_FAILING_CALLS))
@pytest.mark.parametrize("config", ["llama-2-7b-dynamic", "phi-3.5-mini-instruct"])
def test_a_call_that_raises_leaves_the_state_unchanged(name, config):
    d = MODEL_CONFIGS[config]
    rope = RotaryEmbedding(d)
    rope(torch.randn(1, 1, 2, rope.head_dim), positions=torch.tensor([[4999]]))  # grown / long factors
    before = (rope.frequencies, rope.inv_freq.clone(), rope.max_seq_len_cached)
    assert before[0] is not from_hf_config(d)
    with pytest.raises((ValueError, TypeError)):
        _FAILING_CALLS[name](rope)
    assert rope.frequencies is before[0]
    assert torch.equal(rope.inv_freq, before[1])
    assert rope.max_seq_len_cached == before[2]


def test_copies_and_pickles_keep_the_state():
    import pickle

    rope = RotaryEmbedding(MODEL_CONFIGS["llama-2-7b-dynamic"])
    rope(torch.randn(1, 1, 2, 128), seq_len=6000)
    q = torch.randn(1, 3, 2, 128, dtype=torch.float64)
    grown = rope(q, seq_len=5000)  # keeps the set grown to 6000
    for clone in (copy.deepcopy(rope), pickle.loads(pickle.dumps(rope))):
        assert clone._lock is not rope._lock
        assert clone.max_seq_len_cached == 6000 and torch.equal(clone.inv_freq, rope.inv_freq)
        assert torch.equal(clone(q, seq_len=5000), grown)


_DYN = MODEL_CONFIGS["llama-2-7b-dynamic"]
_BAD_MODULE_CALLS = {  # id: (call, exception, the argument its message names)
    "source-None": (lambda: RotaryEmbedding(None), TypeError, "source"),
    "source-float": (lambda: RotaryEmbedding(64.0), TypeError, "source"),
    "source-str": (lambda: RotaryEmbedding("llama"), TypeError, "source"),
    "source-list": (lambda: RotaryEmbedding([64]), TypeError, "source"),
    "source-bool": (lambda: RotaryEmbedding(True), TypeError, "source"),
    "source-int-negative": (lambda: RotaryEmbedding(-64), ValueError, "rotary_dim"),
    "kwarg-base-nan": (lambda: RotaryEmbedding(64, base=math.nan), ValueError, "base"),
    "config-factor-inf": (lambda: RotaryEmbedding({**_DYN, "rope_scaling": {"type": "dynamic", "factor": math.inf}}),
                          ValueError, "factor"),
    "q-None": (lambda: RotaryEmbedding(_DYN)(None), TypeError, "q"),
    "q-list": (lambda: RotaryEmbedding(64)([1.0]), TypeError, "q"),
    "positions-str": (lambda: RotaryEmbedding(_DYN)(torch.randn(1, 2, 1, 128), positions="3"), TypeError,
                      "positions"),
    "positions-inf": (lambda: RotaryEmbedding(_DYN)(torch.randn(1, 2, 1, 128), positions=math.inf), TypeError,
                      "positions"),
    "seq_len-str": (lambda: RotaryEmbedding(_DYN)(torch.randn(1, 2, 1, 128), seq_len="10"), TypeError, "seq_len"),
    "seq_len-inf": (lambda: RotaryEmbedding(_DYN)(torch.randn(1, 2, 1, 128), seq_len=math.inf), TypeError,
                    "seq_len"),
    "seq_len-negative": (lambda: RotaryEmbedding(_DYN)(torch.randn(1, 2, 1, 128), seq_len=-5), ValueError,
                         "seq_len"),
    "cu_seqlens-list": (lambda: RotaryEmbedding(_DYN)(torch.randn(4, 1, 128), layout="thd", cu_seqlens=[0, 4]),
                        TypeError, "cu_seqlens"),
    "layout-unknown": (lambda: RotaryEmbedding(_DYN)(torch.randn(1, 2, 1, 128), layout="bsd"), ValueError, "layout"),
    "layout-wrong-ndim": (lambda: RotaryEmbedding(_DYN)(torch.randn(2, 1, 128), layout="bhsd"), ValueError, "layout"),
    "cos_sin-positions-None": (lambda: RotaryEmbedding(_DYN).cos_sin(None), TypeError, "positions"),
    "cos_sin-dtype-str": (lambda: RotaryEmbedding(_DYN).cos_sin(torch.arange(3), "float32"), TypeError, "dtype"),
    "cos_sin-seq_len-nan": (lambda: RotaryEmbedding(_DYN).cos_sin(torch.arange(3), seq_len=math.nan), TypeError,
                            "seq_len"),
    "update-str": (lambda: RotaryEmbedding(_DYN).update("4096"), TypeError, "seq_len"),
}


@pytest.mark.parametrize("name", sorted(_BAD_MODULE_CALLS))
def test_bad_module_arguments_raise_naming_the_argument(name):
    call, exception, argument = _BAD_MODULE_CALLS[name]
    with pytest.raises(exception, match=re.escape(argument)):
        call()


def test_cos_sin_of_empty_positions_keeps_the_set():
    rope = RotaryEmbedding(MODEL_CONFIGS["llama-2-7b-dynamic"])
    rope.update(6000)
    before = rope.frequencies
    cos, sin = rope.cos_sin(torch.zeros(0, dtype=torch.int64))
    assert cos.shape == sin.shape == (0, 128) and rope.frequencies is before


# ---------------------------------------------------------------------- the kernels, launch plans, torch.compile
# Static rope types (no length-dependent state): Llama 3.1's bands, Qwen2.5's YaRN (attention scaling != 1), GLM-4's
# interleaved half-rotary.
STATIC_FAMILIES = ["llama-3.1-8b", "qwen2.5-7b-instruct-yarn", "glm-4-9b-0414"]


@pytest.mark.parametrize("route", KERNEL_ROUTES)
@pytest.mark.parametrize("name", STATIC_FAMILIES)
def test_kernels_and_plans_equal_the_float64_path(name, route, plan_calls):
    """The module on the kernels (the interpreter on CPU, CUDA), called four times with fresh q, k and positions:
    the first call notes the signature, the second records a launch plan, which serves the last two. Outputs and
    gradients equal a second module's float64 CPU path on the same values, within the kernels' tolerance."""
    config = MODEL_CONFIGS[name]
    exact = RotaryEmbedding(config)
    with on_route(route, clear_plans=True) as device:
        rope = RotaryEmbedding(config).to(device)
        D = rope.head_dim
        for _call in range(4):
            q = torch.randn(2, 5, 4, D, dtype=torch.float64).to(device, torch.float32).requires_grad_(True)
            k = torch.randn(2, 5, 2, D, dtype=torch.float64).to(device, torch.float32).requires_grad_(True)
            positions = torch.randint(0, 30000, (2, 5))
            out = rope(q, k, positions=positions.to(device))
            grads = [torch.randn_like(o) for o in out]
            got = (*out, *torch.autograd.grad(out, (q, k), grads))
            leaves = [x.detach().cpu().double().requires_grad_(True) for x in (q, k)]
            ref = exact(*leaves, positions=positions)
            want = (*ref, *torch.autograd.grad(ref, leaves, [g.cpu().double() for g in grads]))
            for g, w in zip(got, want):
                assert_close_to_ref(g, w, torch.float32)
    assert plan_calls["served"] >= 2


@pytest.mark.parametrize("name", STATIC_FAMILIES)
def test_compiled_module_equals_the_eager_module(name):
    """torch.compile(fullgraph=True) of the module (a static type takes no lock, so nothing breaks the graph): on
    CPU the compiled graph runs the registered op through the float64 path as eager calls do, so outputs and
    gradients equal the eager module's exactly, over two calls with fresh data through the same graph; and they are
    the float64 rotation within the CPU path's tolerance."""
    rope = RotaryEmbedding(MODEL_CONFIGS[name])
    torch._dynamo.reset()
    compiled = torch.compile(rope, fullgraph=True)
    D = rope.head_dim
    for _call in range(2):
        q = torch.randn(2, 6, 4, D, requires_grad=True)
        k = torch.randn(2, 6, 2, D, requires_grad=True)
        positions = torch.randint(0, 30000, (2, 6))
        out = compiled(q, k, positions=positions)
        grads = [torch.randn_like(o) for o in out]
        got = (*out, *torch.autograd.grad(out, (q, k), grads))
        eager = rope(q, k, positions=positions)
        want = (*eager, *torch.autograd.grad(eager, (q, k), grads))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        exact = rope(q.detach().double(), k.detach().double(), positions=positions)
        for g, w in zip(out, exact):
            assert_close_to_ref(g, w, torch.float32, "cpu")

