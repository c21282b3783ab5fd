"""ropekit inside the loops users actually run: training steps, a patched model's optimizer steps, decoding.

Every case compares against an independent computation -- a float64 RoPE written here with transformers'
``rotate_half`` formula, or the unpatched transformers model -- over several steps with fresh data each step,
because bugs of repeated calls (launch plans replayed from the second call of a signature, version counters,
gradients arriving with unusual strides) only show from the second step on.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import ropekit
from helpers import ROUTES, assert_close_to_ref, on_route, rope64
from ropekit import testing
from ropekit.integrations import transformers as rk_hf

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16]
BF16_ULP = 2.0**-7  # spacing of bf16 numbers in [1, 2): one unit in the last place, relative

# Small shapes: GQA (4 query heads, 2 kv heads), head_dim 16, 8 tokens, 2 sequences.
B, S, HQ, HK, D, E = 2, 8, 4, 2, 16, 32
STEPS = 4
LR = 0.1


# ------------------------------------------------------------------------------------------------------------------
# the oracle: RoPE in float64, written independently of ropekit
# ------------------------------------------------------------------------------------------------------------------


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def oracle_inv_freq(dim: int, base: float = 10000.0) -> torch.Tensor:
    # ropekit's documented default: base ** (-2i / R) formed in float64 and rounded once to fp32
    return (1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float().double()


def oracle_rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] (any strides), pos [B, S] int: x*cos + rotate_half(x)*sin in float64, rounded once to x's
    dtype. Differentiable (autograd of the float64 formula)."""
    ang = pos.to(x.device, torch.float64)[..., None] * oracle_inv_freq(x.shape[-1]).to(x.device)  # [B, S, D/2]
    emb = torch.cat((ang, ang), dim=-1)[:, :, None, :]  # [B, S, 1, D]
    xd = x.double()
    return (xd * emb.cos() + rotate_half(xd) * emb.sin()).to(x.dtype)


def explicit_positions(kind: str, arg) -> torch.Tensor:
    """The [B, S] positions a ``positions=`` argument means (None, int offset, [B] offsets, [B, S] ids)."""
    s = torch.arange(S)
    if kind == "none":
        return s.expand(B, S)
    if kind == "int":
        return (arg + s).expand(B, S)
    if kind == "offsets":
        return arg.cpu()[:, None] + s
    return arg.cpu()


def make_positions(kind: str, step: int, gen: torch.Generator, device):
    if kind == "none":
        return None
    if kind == "int":
        return 3 + 29 * step  # a KV-cache offset that moves every step
    if kind == "offsets":
        return torch.randint(0, 4096, (B,), generator=gen).to(device)
    return torch.randint(0, 1 << 16, (B, S), generator=gen).to(device)  # per-token ids, any order


# ------------------------------------------------------------------------------------------------------------------
# 1. training loops with the native API, in place, and the transformers drop-in
# ------------------------------------------------------------------------------------------------------------------


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:  # [B, H, S, D] -> [B, H*groups, S, D]
    return x.repeat_interleave(groups, dim=1)


def loss_of(kind: str, qr: torch.Tensor, kr: torch.Tensor, v: torch.Tensor, target: torch.Tensor,
            layout: str) -> torch.Tensor:
    """qr, kr, v in ``layout`` (bshd from the native API, bhsd from the transformers drop-in)."""
    if kind == "sliced":  # k's output gets no gradient at all; q's arrives as a strided scatter
        # Half the head dim too: the squared norm of whole rotated pairs would not depend on the rotation at all.
        return qr[:, ::2, :, : D // 2].pow(2).mean()
    if kind == "sum":  # the gradients arrive expanded (all strides 0)
        return qr.sum() + 2 * kr.sum()
    if layout == "bshd":
        qr, kr, v = qr.transpose(1, 2), kr.transpose(1, 2), v.transpose(1, 2)
    kr, v = repeat_kv(kr, HQ // HK), repeat_kv(v, HQ // HK)
    scores = qr @ kr.transpose(-2, -1)
    if kind == "qk":  # the gradient arrives as an expanded constant; without the scale SGD diverges in 4 steps
        return scores.sum() / scores.numel()
    assert kind == "softmax"  # eager attention, as transformers' eager_attention_forward computes it
    causal = torch.ones(S, S, dtype=torch.bool, device=qr.device).triu(1)
    probs = torch.softmax((scores / math.sqrt(D)).masked_fill(causal, float("-inf")).float(), dim=-1)
    out = probs.to(v.dtype) @ v
    return (out - target).pow(2).mean()


def run_training(api: str, rope_fn, device: str, dtype: torch.dtype, loss: str, steps_data: list,
                 qk_norm: bool = False):
    """STEPS SGD steps of a packed QKV projection (+ a Qwen3-style q/k RMSNorm) + RoPE + ``loss``; returns the
    losses and the final weights."""
    torch.manual_seed(0)  # same initial weights for the ropekit run and the oracle run
    proj = torch.nn.Linear(E, (HQ + 2 * HK) * D).to(device=device, dtype=dtype)
    opt = torch.optim.SGD(proj.parameters(), lr=LR)
    losses, grads = [], []
    for x, pos_arg, pos, target in steps_data:
        qkv = proj(x).view(B, S, HQ + 2 * HK, D)
        q, k, v = qkv[:, :, :HQ], qkv[:, :, HQ:HQ + HK], qkv[:, :, HQ + HK:]  # strided views, as packed QKV gives
        if qk_norm:  # fresh (non-view) non-leaf tensors
            q, k = F.rms_norm(q, (D,)), F.rms_norm(k, (D,))
        if api == "hf":  # transformers' layout: [B, H, S, D] views of the projection, cos/sin [B|1, S, D]
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            qr, kr = rope_fn(q, k, pos_arg, pos)
            layout = "bhsd"
        else:
            qr, kr = rope_fn(q, k, pos_arg, pos)
            layout = "bshd"
        value = loss_of(loss, qr, kr, v, target, layout)
        opt.zero_grad(set_to_none=True)
        value.backward()
        grads.append({n: p.grad.detach().double().cpu() for n, p in proj.named_parameters()})
        opt.step()
        losses.append(value.detach().double().cpu())
    return torch.stack(losses), grads, {n: p.detach().clone() for n, p in proj.named_parameters()}


def hf_tables(pos: torch.Tensor, dtype: torch.dtype, device: str):
    """cos, sin as transformers' LlamaRotaryEmbedding builds them: fp32 angles, rounded to the model dtype."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    freqs = pos.float()[..., None] * inv_freq  # [B|1, S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def hf_oracle(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb in float64, rounded once to promote(q, cos)."""
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    qd, kd = q.double(), k.double()
    return (qd * c + rotate_half(qd) * s).to(out_dtype), (kd * c + rotate_half(kd) * s).to(out_dtype)


def _ropekit_native(q, k, pos_arg, pos):
    return ropekit.apply_rope(q, k, positions=pos_arg)


def _ropekit_inplace(q, k, pos_arg, pos):
    out = ropekit.apply_rope_(q, k, positions=pos_arg)
    assert out[0] is q and out[1] is k
    return q, k


def _oracle_native(q, k, pos_arg, pos):
    return oracle_rope(q, pos), oracle_rope(k, pos)


def _ropekit_hf(q, k, pos_arg, pos):
    cos, sin = hf_tables(pos, q.dtype, q.device)
    return rk_hf.apply_rotary_pos_emb(q, k, cos, sin)


def _oracle_hf(q, k, pos_arg, pos):
    cos, sin = hf_tables(pos, q.dtype, q.device)
    return hf_oracle(q, k, cos, sin)


APIS = {"native": (_ropekit_native, _oracle_native), "inplace": (_ropekit_inplace, _oracle_native),
        "hf": (_ropekit_hf, _oracle_hf)}

# fp32: ropekit's output is the float64 result rounded once (CPU) or fp32 math with one rounding (GPU, ~1e-7
# relative): everything after it is the same fp32 arithmetic in both runs, so losses, gradients and weights agree
# to a few fp32 ulps.
# bf16: ropekit's rounded outputs and gradients (fp32 math on the GPU, one rounding) may each differ from the
# correctly rounded oracle by one bf16 ulp (2**-8 relative); everything after that is the same bf16 arithmetic in
# both runs. Hence: losses within 2 ulps (2**-7 relative), each step's weight gradients within 2 ulps in norm,
# weights within 2 ulps elementwise, with an atol of one ulp of the weights' scale (~0.1) for weights near zero.
# (Measured: a rotation by -theta, or a backward that skips the rotation, moves the gradients by >= 0.19 in norm;
# positions off by one by 0.36 or more for the "sum"/"sliced" losses -- qk and softmax see relative positions.)
TOL = {torch.float32: dict(loss=dict(rtol=1e-5, atol=1e-6), grad=1e-5, weight=dict(rtol=1e-5, atol=1e-6)),
       torch.bfloat16: dict(loss=dict(rtol=BF16_ULP, atol=1e-3), grad=BF16_ULP,
                            weight=dict(rtol=BF16_ULP, atol=BF16_ULP * 0.1))}
LOSSES = ["qk", "sum", "softmax", "sliced"]


def _steps_data(device, dtype, positions: str, api: str):
    gen = torch.Generator().manual_seed(1234)
    data = []
    for step in range(STEPS):
        x = torch.randn(B, S, E, generator=gen).to(device=device, dtype=dtype)
        pos_arg = make_positions(positions, step, gen, device)
        pos = explicit_positions(positions, pos_arg)
        if api == "hf" and positions == "none":
            pos = pos[:1]  # position_ids [1, S]: tables broadcast over the batch, as transformers passes them
        target = torch.randn(B, HQ, S, D, generator=gen).to(device=device, dtype=dtype)
        data.append((x, pos_arg, pos, target))
    return data


def _check_training(api, device, dtype, loss, positions, qk_norm=False):
    rope_fn, oracle_fn = APIS[api]
    data = _steps_data(device, dtype, positions, api)
    got_losses, got_g, got_w = run_training(api, rope_fn, device, dtype, loss, data, qk_norm)
    want_losses, want_g, want_w = run_training(api, oracle_fn, device, dtype, loss, data, qk_norm)
    tol = TOL[dtype]
    assert torch.isfinite(got_losses).all()
    torch.testing.assert_close(got_losses, want_losses, **tol["loss"])
    for step, (got, want) in enumerate(zip(got_g, want_g)):
        for name, g in got.items():
            assert rel_err(g, want[name]) <= tol["grad"], f"step {step}: grad of {name}: {rel_err(g, want[name])}"
    torch.manual_seed(0)
    init = torch.nn.Linear(E, (HQ + 2 * HK) * D).to(device=device, dtype=dtype)
    assert not torch.equal(got_w["weight"], init.weight), "the optimizer steps changed nothing"
    for name, w in got_w.items():
        torch.testing.assert_close(w.float(), want_w[name].float(), **tol["weight"],
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("positions", ["none", "int", "offsets", "ids"])
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_training_loop_native(device, dtype, loss, positions):
    _check_training("native", device, dtype, loss, positions)


@pytest.mark.parametrize("source", ["qk_norm", "views"])
@pytest.mark.parametrize("positions", ["int", "ids"])
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_training_loop_in_place(device, dtype, loss, positions, source):
    """apply_rope_ on non-leaf q/k, rotated in their own memory: fresh tensors out of a q/k RMSNorm (Qwen3), or
    the strided views of the QKV projection's output themselves."""
    _check_training("inplace", device, dtype, loss, positions, qk_norm=source == "qk_norm")


@pytest.mark.parametrize("positions", ["none", "ids"])
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_training_loop_transformers_dropin(device, dtype, loss, positions):
    """The drop-in on transformers' [B, H, S, D] transposed views, followed by eager attention."""
    _check_training("hf", device, dtype, loss, positions)


# The public calls over several training steps on every route (the CPU path, the kernels under the interpreter,
# CUDA), launch plans cleared first, gradients against the float64 RoPE of helpers.py.
STEP_LOSSES = {
    "qk-transposed": lambda q, k: (q @ k.transpose(-2, -1)).sum(),
    "sum": lambda q, k: q.sum() + k.sum(),  # gradients expanded with stride 0
    "sliced": lambda q, k: q[:, ::2].pow(2).mean() + k[..., 1:3].sum(),
    "softmax-attention": lambda q, k: torch.softmax(q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2), -1)
    .pow(2).sum(),
}


@pytest.mark.parametrize("loss", STEP_LOSSES)
@pytest.mark.parametrize("mode", ROUTES)
def test_training_steps_past_the_first(mode, loss):
    """Each step's gradients are the float64 backward of the rotation applied to the very gradients the losses
    handed ropekit (captured by hooks, in their own layouts): the check is the rotation's alone, not the float32
    loss's conditioning, which amplifies a last-bit difference of the forward past any fixed tolerance."""
    with on_route(mode, clear_plans=True) as device:
        B, S, H, D = 2, 6, 2, 16
        positions = torch.randint(0, 1000, (B, S))
        for _step in range(4):  # plans engage from the second call; the bug was at step 2
            q = torch.randn(B, S, H, D, dtype=torch.float64)
            k = torch.randn(B, S, H, D, dtype=torch.float64)
            q_d = q.to(device, torch.float32).requires_grad_(True)
            k_d = k.to(device, torch.float32).requires_grad_(True)
            qr, kr = ropekit.apply_rope(q_d, k_d, positions=positions.to(device))
            upstream = {}
            qr.register_hook(lambda g, seen=upstream: seen.__setitem__("q", g))
            kr.register_hook(lambda g, seen=upstream: seen.__setitem__("k", g))
            STEP_LOSSES[loss](qr, kr).backward()
            q64, k64 = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
            q_ref, k_ref = rope64(q64, positions, as_apply_rope=True), rope64(k64, positions, as_apply_rope=True)
            assert_close_to_ref(qr.detach(), q_ref.detach(), torch.float32)
            assert_close_to_ref(kr.detach(), k_ref.detach(), torch.float32)
            dq_ref, dk_ref = torch.autograd.grad((q_ref, k_ref), (q64, k64),
                                                 (upstream["q"].cpu().double(), upstream["k"].cpu().double()))
            # the gradients are not unit-scale (the losses sum over rows): the bound is relative to their largest
            assert testing.max_relative_error((q_d.grad, k_d.grad), (dq_ref, dk_ref)) <= \
                testing.max_relative_tolerance(torch.float32)


@pytest.mark.parametrize("mode", ROUTES)
def test_transformers_drop_in_then_eager_attention_for_several_steps(mode):
    from ropekit.integrations.transformers import apply_rotary_pos_emb

    with on_route(mode, clear_plans=True) as device:
        B, H, S, D = 2, 2, 5, 16
        positions = torch.arange(S).expand(B, S)
        inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        emb = torch.cat([positions[..., None] * inv] * 2, -1)
        cos, sin = emb.cos().float().to(device), emb.sin().float().to(device)
        for _step in range(3):
            qkv = torch.randn(B, S, 3, H, D, dtype=torch.float64)
            x = qkv.to(device, torch.float32).requires_grad_(True)
            q, k = x[:, :, 0].transpose(1, 2), x[:, :, 1].transpose(1, 2)  # HF's [B, H, S, D] views
            qr, kr = apply_rotary_pos_emb(q, k, cos, sin)
            torch.softmax(qr @ kr.transpose(-1, -2) / math.sqrt(D), -1).sum(-1).pow(2).sum().backward()
            x64 = qkv.clone().requires_grad_(True)
            q64, k64 = rope64(x64[:, :, 0], positions), rope64(x64[:, :, 1], positions)
            q64, k64 = q64.transpose(1, 2), k64.transpose(1, 2)
            torch.softmax(q64 @ k64.transpose(-1, -2) / math.sqrt(D), -1).sum(-1).pow(2).sum().backward()
            torch.testing.assert_close(x.grad.cpu().double(), x64.grad, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------------------------
# 2. and 3. a tiny random Llama: training steps and greedy decoding, patched vs unpatched
# ------------------------------------------------------------------------------------------------------------------


def tiny_llama(attn: str, device: str, dtype=torch.float32):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = attn
    torch.manual_seed(1234)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)


ADAM_LR = 1e-2


def train_steps(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=ADAM_LR, weight_decay=0.01)
    model.train()
    losses = []
    for ids in batches:
        out = model(ids, labels=ids)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        losses.append(out.loss.detach().double().cpu())
    return torch.stack(losses), {n: p.detach().double().cpu() for n, p in model.named_parameters()}


def _assert_unpatched(model, reference, modeling, original_fn, ids):
    rk_hf.unpatch(model)
    from ropekit.integrations import patching

    assert modeling.apply_rotary_pos_emb is original_fn
    assert not rk_hf.is_patched(model) and "forward" not in model.model.rotary_emb.__dict__
    assert not patching._ORIGINALS
    model.load_state_dict(reference.state_dict())  # the trained weights differed by rounding; now the same
    model.eval()
    reference.eval()
    with torch.no_grad():  # same weights, both run transformers' own code again: bit-identical logits
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("device", DEVICES)
def test_llama_adamw_steps_fp32(device, attn, rope_calls):
    from transformers.models.llama import modeling_llama as modeling

    original_fn = modeling.apply_rotary_pos_emb
    model = tiny_llama(attn, device)
    reference = copy.deepcopy(model)
    initial = {n: p.detach().double().cpu() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 128, (2, 24), generator=gen).to(device) for _ in range(3)]
    rk_hf.patch(model)
    try:
        losses, weights = train_steps(model, batches)
    finally:
        rk_hf.unpatch(model)
    assert len(rope_calls) == 3 * 2  # 3 steps x 2 layers went through ropekit
    ref_losses, ref_weights = train_steps(reference, batches)
    # fp32: ropekit forms angles in float64 where transformers multiplies in fp32 (angle error ~1e-6 rad at these
    # positions), so losses and gradients agree to ~1e-6 relative. Adam divides each gradient by its own running
    # RMS, so an element whose gradient is near zero turns a rounding-level gradient difference into a visible
    # update difference (seen: 1.4e-5 = 0.14% of one lr=1e-2 step). Hence: every weight within 1% of one Adam
    # step of the reference, and each tensor's total update within 1e-4 of the reference's in norm. A wrong
    # rotation (sign, frequency, pairing, gradient) changes the updates by O(1).
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert weights.keys() == ref_weights.keys()
    for name, w in weights.items():
        w0 = initial[name]
        torch.testing.assert_close(w, ref_weights[name], rtol=0, atol=1e-2 * ADAM_LR,
                                   msg=lambda m, name=name: f"{name}: {m}")
        assert rel_err(w - w0, ref_weights[name] - w0) < 1e-4, name
    rk_hf.patch(model)
    _assert_unpatched(model, reference, modeling, original_fn, batches[0])


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_llama_adamw_steps_bf16_cuda(attn, rope_calls):
    from transformers.models.llama import modeling_llama as modeling

    original_fn = modeling.apply_rotary_pos_emb
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 128, (2, 24), generator=gen).cuda() for _ in range(3)]
    exact_losses, exact_w = train_steps(tiny_llama(attn, "cuda"), batches)  # fp32: the yardstick
    model = tiny_llama(attn, "cuda", torch.bfloat16)
    reference = copy.deepcopy(model)
    rk_hf.patch(model)
    try:
        losses, weights = train_steps(model, batches)
    finally:
        rk_hf.unpatch(model)
    assert len(rope_calls) == 3 * 2
    hf_losses, hf_weights = train_steps(reference, batches)
    # bf16 patched and unpatched cannot agree bit for bit: transformers rounds its cos/sin tables to bf16 (a
    # relative error up to 2**-9 on every rotated element) where ropekit uses exact fp32 angles, and bf16 AdamW
    # then amplifies any difference (a normalised step of lr = 50% of a 0.02 weight; measured on an H200: each
    # bf16 run's weights are 3-8% from the fp32 run's in norm, the two bf16 runs 2-6% from each other). Both are
    # bf16 approximations of the same fp32 run, so the fp32 run is the yardstick: ropekit must be no further from
    # it than transformers is (50% and a small absolute slack, as both errors are bf16 noise of similar size), and
    # the two bf16 runs no further from each other than that noise. Losses (fp32 cross-entropy of bf16 logits)
    # agree to one bf16 ulp relative (measured: 1e-3). A wrong rotation or gradient changes Adam's updates by O(1).
    torch.testing.assert_close(losses, hf_losses, rtol=BF16_ULP, atol=0)
    assert (losses - exact_losses).abs().max() <= 1.5 * (hf_losses - exact_losses).abs().max() + BF16_ULP
    for name, w in weights.items():
        noise = rel_err(hf_weights[name], exact_w[name])
        assert rel_err(w, exact_w[name]) <= 1.5 * noise + 1e-2, name
        assert rel_err(w, hf_weights[name]) <= 1.5 * noise + 1e-2, name
    rk_hf.patch(model)
    _assert_unpatched(model, reference, modeling, original_fn, batches[0])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("device", DEVICES)
def test_llama_greedy_decode(device, attn, rope_calls):
    model = tiny_llama(attn, device)
    model.eval()
    prompt = torch.tensor([[1, 17, 42, 99, 5, 63, 27, 88], [1, 3, 120, 64, 64, 12, 9, 111]], device=device)
    kwargs = dict(do_sample=False, max_new_tokens=16, attention_mask=torch.ones_like(prompt), pad_token_id=0,
                  eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    reference = copy.deepcopy(model)
    rk_hf.patch(model)
    try:
        out = model.generate(prompt, **kwargs)
    finally:
        rk_hf.unpatch(model)
    want = reference.generate(prompt, **kwargs)
    assert out.sequences.shape == (2, 8 + 16)
    assert len(rope_calls) == 16 * 2  # prefill + 15 decode steps, every layer
    assert torch.equal(out.sequences, want.sequences), (out.sequences, want.sequences)
    # A random tiny model's greedy tokens barely depend on positions (measured: rotating by -theta can leave all
    # 16 tokens unchanged), so every step's logits are compared too: fp32 rounding-level agreement (measured
    # 1.2e-7 on logits of scale 0.5; a decode position off by one moves them by 2e-3).
    assert len(out.logits) == len(want.logits) == 16
    for step, (got, ref) in enumerate(zip(out.logits, want.logits)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=lambda m, step=step: f"decode step {step}: {m}")


# ------------------------------------------------------------------------------------------------------------------
# 3b. a decode loop under CUDA-graph replay
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_cuda_graph_decode_loop(dtype):
    """One decode step -- rotate the new token's q/k at per-sequence positions, append k/v to a static cache,
    attend over the cache -- captured once and replayed 16 times with the positions and inputs updated in place;
    every step must equal the same step run eagerly and the float64 oracle."""
    dev = "cuda"
    smax, steps = 32, 16
    start = torch.tensor([3, 7])

    def randn(*shape):
        return torch.randn(*shape, device=dev).to(dtype)

    # static buffers the graph reads and writes
    q_in, k_in, v_in = randn(B, 1, HQ, D), randn(B, 1, HK, D), randn(B, 1, HK, D)
    pos = start.to(dev).clone()  # [B] per-sequence offsets: token s=0 sits at pos[b]
    k_cache0, v_cache0 = randn(B, smax, HK, D), randn(B, smax, HK, D)  # earlier tokens (already rotated)
    k_cache, v_cache = k_cache0.clone(), v_cache0.clone()
    batch_idx = torch.arange(B, device=dev)
    slots = torch.arange(smax, device=dev)

    def step(q, k, v, p, kc, vc, rope):
        qr, kr = rope(q, k, p)
        kc[batch_idx, p] = kr[:, 0]
        vc[batch_idx, p] = v[:, 0]
        keys, values = repeat_kv(kc.transpose(1, 2), HQ // HK), repeat_kv(vc.transpose(1, 2), HQ // HK)
        scores = (qr.transpose(1, 2).float() @ keys.float().transpose(-2, -1)) / math.sqrt(D)  # [B, HQ, 1, smax]
        scores = scores.masked_fill((slots[None, :] > p[:, None])[:, None, None, :], float("-inf"))
        return torch.softmax(scores, dim=-1) @ values.float()  # [B, HQ, 1, D]

    def rk(q, k, p):
        return ropekit.apply_rope(q, k, positions=p)

    def oracle(q, k, p):
        pp = p.cpu()[:, None]
        return oracle_rope(q, pp), oracle_rope(k, pp)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs' docs require
        for _ in range(3):
            step(q_in, k_in, v_in, pos, k_cache, v_cache, rk)
    torch.cuda.current_stream().wait_stream(side)
    k_cache.copy_(k_cache0)
    v_cache.copy_(v_cache0)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(q_in, k_in, v_in, pos, k_cache, v_cache, rk)

    eager_k, eager_v = k_cache0.clone(), v_cache0.clone()
    oracle_k, oracle_v = k_cache0.clone(), v_cache0.clone()
    for t in range(steps):
        q, k, v = randn(B, 1, HQ, D), randn(B, 1, HK, D), randn(B, 1, HK, D)
        q_in.copy_(q)
        k_in.copy_(k)
        v_in.copy_(v)
        pos.copy_(start.to(dev) + t)
        graph.replay()
        p = start.to(dev) + t
        want = step(q, k, v, p, eager_k, eager_v, rk)
        exact = step(q, k, v, p, oracle_k, oracle_v, oracle)
        torch.cuda.synchronize()
        # graph replay runs the very kernels of the eager step: identical results
        torch.testing.assert_close(static_out, want, rtol=0, atol=0, msg=lambda m, t=t: f"step {t}: {m}")
        torch.testing.assert_close(k_cache, eager_k, rtol=0, atol=0, msg=lambda m, t=t: f"step {t} cache: {m}")
        # and the rotation is right: within one output rounding of the oracle (the attention is fp32 after it)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 * BF16_ULP, atol=BF16_ULP)
        torch.testing.assert_close(static_out, exact, **tol, msg=lambda m, t=t: f"step {t} vs oracle: {m}")
        torch.testing.assert_close(k_cache.float(), oracle_k.float(), **tol)


# ------------------------------------------------------------------------------------------------------------------
# 3c. the patched model's own decode loop under CUDA-graph replay
# ------------------------------------------------------------------------------------------------------------------


def _static_cache_decode(model, prompt: torch.Tensor, steps: int, graph: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decode of ``steps`` tokens after the prompt's with a static KV cache, every decode step one forward
    over static buffers (token ids, cache position, position ids, a 4-D additive mask), captured once as a CUDA
    graph and replayed when ``graph``, as serving loops run it. Returns the [B, steps + 1] new tokens and the
    logits [B, steps + 1, vocab] they were chosen from."""
    transformers = pytest.importorskip("transformers")
    dev = prompt.device
    batch, plen = prompt.shape
    length = plen + steps + 1
    cache = transformers.StaticCache(config=model.config, max_cache_len=length)
    dtype = next(model.parameters()).dtype
    mask = torch.full((batch, 1, 1, length), torch.finfo(dtype).min, device=dev, dtype=dtype)
    with torch.no_grad():
        logits = model(prompt, past_key_values=cache, cache_position=torch.arange(plen, device=dev),
                       use_cache=True).logits[:, -1]
        tokens, all_logits = [logits.argmax(-1)], [logits]
        ids = tokens[0][:, None].clone()
        cache_pos = torch.tensor([plen], device=dev)
        pos_ids = torch.full((batch, 1), plen, device=dev)

        def step():
            return model(ids, attention_mask=mask, past_key_values=cache, cache_position=cache_pos,
                         position_ids=pos_ids, use_cache=True).logits[:, -1]

        run = step
        if graph:
            mask[..., : plen + 1] = 0
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up, as torch.cuda.graphs' docs require
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            # transformers' static layers count the tokens written on the device (cumulative_length), and
            # the warm-up advanced that count: put it back, in place (the graph reads it at this address)
            for layer in cache.layers:
                layer.cumulative_length.fill_(plen)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                static_logits = step()

            def run():
                cuda_graph.replay()
                return static_logits

        for t in range(steps):
            mask[..., : plen + t + 1] = 0
            logits = run()
            tokens.append(logits.argmax(-1))
            all_logits.append(logits.clone())
            ids.copy_(tokens[-1][:, None])
            cache_pos += 1
            pos_ids += 1
    return torch.stack(tokens, 1), torch.stack(all_logits, 1)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("device", DEVICES)
def test_llama_static_cache_decode_same_tokens(device, attn, rope_calls):
    """The patched model decodes 16 tokens through a static cache -- on CUDA under CUDA-graph replay, with the
    position tensors updated in place between replays -- and gives the unpatched model's greedy tokens and
    logits."""
    model = tiny_llama(attn, device)
    model.eval()
    prompt = torch.tensor([[1, 17, 42, 99, 5, 63, 27, 88], [1, 3, 120, 64, 64, 12, 9, 111]], device=device)
    reference = copy.deepcopy(model)
    want = reference.generate(prompt, do_sample=False, max_new_tokens=17, attention_mask=torch.ones_like(prompt),
                              pad_token_id=0, eos_token_id=None)[:, prompt.shape[1]:]
    unpatched, unpatched_logits = _static_cache_decode(reference, prompt, 16, graph=False)
    assert torch.equal(unpatched, want)  # the loop itself is transformers' greedy decode
    rk_hf.patch(model)
    try:
        got, logits = _static_cache_decode(model, prompt, 16, graph=device == "cuda")
    finally:
        rk_hf.unpatch(model)
    assert rope_calls  # the patched rotation ran (captured once; replays launch the same kernels)
    assert torch.equal(got, want), (got, want)
    # greedy tokens of a random model barely depend on positions: the logits of every step must agree too
    torch.testing.assert_close(logits, unpatched_logits, rtol=1e-5, atol=1e-5)
