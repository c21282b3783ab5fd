#!/usr/bin/env python
"""Patched vs unpatched transformers Llama on one GPU: agreement of logits and gradients, and timings.

Builds a small randomly initialised Llama (default: 4 layers, hidden 1024, 16 heads, 4 KV heads, head_dim 64,
Llama-3.1 rope scaling), then for each dtype:

1. checks that ``ropekit.integrations.transformers.patch`` leaves logits and parameter gradients unchanged
   (fp32: relative error < 1e-5; bf16: the patched and unpatched errors against an fp32 copy of the same weights
   are compared, and patched vs unpatched must agree to bf16 accuracy);
2. times the rotary embedding alone (rotary module + every layer's apply, forward and backward) as transformers
   does it and through ropekit;
3. times a full training step (forward, backward, fused AdamW step);
4. times greedy ``generate()`` (prefill + decode with a KV cache) and checks the generated tokens.

Prints a table (and writes JSON rows with ``--json``). Example::

    python benchmarks/probes/hf_patch_gpu.py                       # defaults, CUDA
    python benchmarks/probes/hf_patch_gpu.py --device cpu --hidden 128 --layers 2 --batch 2 --seq 64 \
        --gen-new 8 --iters 2
"""

# ruff: noqa: E402 - options are parsed before torch, Triton and ropekit load, so --help runs on any machine
from __future__ import annotations

import argparse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--commit", help="commit id to print (default: git's HEAD, which a copied tree may not match)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32,bf16,fp16")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=None, help="default: 3.5 x hidden")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rope", default="llama3", choices=["default", "llama3", "yarn", "dynamic"],
                   help="rope scaling of the model (default llama3, as Llama 3.1)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--gen-batch", type=int, default=1)
    p.add_argument("--gen-prompt", type=int, default=128)
    p.add_argument("--gen-new", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, ...)")
    p.add_argument("--json", default=None, help="write result rows to this JSON file")
    return p.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help exits here

import copy
import datetime
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

import ropekit
from ropekit.integrations.transformers import patch, unpatch

ROOT = Path(__file__).resolve().parents[2]  # the repository (for the commit id)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_config(args):
    import transformers

    rope = {
        "default": None,
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    }[args.rope]
    kwargs = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  intermediate_size=args.intermediate or int(3.5 * args.hidden) // 64 * 64,
                  max_position_embeddings=131072 if args.rope != "dynamic" else max(args.seq // 2, 16),
                  rope_theta=500000.0, tie_word_embeddings=False)
    if rope is not None:
        kwargs["rope_scaling"] = rope
    config = transformers.LlamaConfig(**kwargs)
    config._attn_implementation = args.attn
    return config


def build_model(config, device, dtype, seed=0):
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    return model.to(device=device, dtype=dtype)


# ---- timing --------------------------------------------------------------------------------------------------


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, warmup, iters):
    """Median milliseconds of ``fn()`` (CUDA events on GPU, wall clock elsewhere)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    cuda = torch.device(device).type == "cuda"
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---- checks --------------------------------------------------------------------------------------------------


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def forward_backward(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().float(), grads


def check(config, args, dtype, ids):
    model32 = build_model(config, args.device, torch.float32)
    ref_logits, ref_grads = forward_backward(model32, ids)
    model = model32 if dtype == torch.float32 else copy.deepcopy(model32).to(dtype)
    if dtype != torch.float32:
        del model32
    hf_logits, hf_grads = forward_backward(model, ids) if dtype != torch.float32 else (ref_logits, ref_grads)
    patch(model)
    try:
        rk_logits, rk_grads = forward_backward(model, ids)
    finally:
        unpatch(model)
    row = {
        "logits_rel_err_vs_unpatched": rel_err(rk_logits, hf_logits),
        "grad_rel_err_vs_unpatched_max": max(rel_err(rk_grads[n], hf_grads[n]) for n in hf_grads),
    }
    if dtype == torch.float32:
        row["ok"] = row["logits_rel_err_vs_unpatched"] < 1e-5 and row["grad_rel_err_vs_unpatched_max"] < 1e-4
    else:
        hf_vs_32 = rel_err(hf_logits, ref_logits)
        rk_vs_32 = rel_err(rk_logits, ref_logits)
        row.update(logits_rel_err_hf_vs_fp32=hf_vs_32, logits_rel_err_ropekit_vs_fp32=rk_vs_32)
        # Both runs round differently, so they may differ by up to the sum of their own errors against the fp32
        # run; ropekit must be at least about as accurate as transformers.
        row["ok"] = (row["logits_rel_err_vs_unpatched"] <= hf_vs_32 + rk_vs_32 + 1e-3
                     and rk_vs_32 <= 1.5 * hf_vs_32 + 2e-3)
    return row


# ---- benchmarks ----------------------------------------------------------------------------------------------


def rope_only_ms(model, args, dtype, patched: bool):
    """Forward + backward of just the rotary part as the model runs it: one rotary-module call and every
    layer's apply on q [B, Hq, S, D], k [B, Hkv, S, D]."""
    from transformers.models.llama import modeling_llama

    cfg = model.config
    D = cfg.hidden_size // cfg.num_attention_heads
    B, S = args.batch, args.seq
    dev = args.device
    q = torch.randn(B, cfg.num_attention_heads, S, D, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(B, cfg.num_key_value_heads, S, D, device=dev, dtype=dtype, requires_grad=True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    x = torch.randn(B, S, 8, device=dev, dtype=dtype)
    pos = torch.arange(S, device=dev)[None]
    rotary = model.model.rotary_emb
    if patched:
        patch(model)
    try:
        def step():
            cos, sin = rotary(x, pos)
            outs = []
            for _ in range(cfg.num_hidden_layers):
                outs.extend(modeling_llama.apply_rotary_pos_emb(q, k, cos, sin))
            torch.autograd.backward(outs, [gq, gk] * cfg.num_hidden_layers)
        return timed(step, dev, args.warmup, args.iters)
    finally:
        if patched:
            unpatch(model)


def train_step_ms(model, args, ids, patched: bool):
    cuda = torch.device(args.device).type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    if patched:
        patch(model)
    try:
        def step():
            opt.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()
            opt.step()
        return timed(step, args.device, args.warmup, args.iters)
    finally:
        if patched:
            unpatch(model)


def generate(model, args, prompt, patched: bool):
    if patched:
        patch(model)
    try:
        kwargs = dict(max_new_tokens=args.gen_new, min_new_tokens=args.gen_new, do_sample=False,
                      attention_mask=torch.ones_like(prompt), pad_token_id=0)
        with torch.no_grad():
            model.generate(prompt, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
            times = []
            for _ in range(3):  # median of three: one-off initialisation must not decide the comparison
                sync(args.device)
                t0 = time.perf_counter()
                out = model.generate(prompt, **kwargs)
                sync(args.device)
                times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[1], out
    finally:
        if patched:
            unpatch(model)


def environment(device, commit=None):
    import transformers

    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True, check=False).stdout.strip() or None
        except OSError:
            commit = None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name() if torch.device(device).type == "cuda" else platform.processor() or "cpu"
    return {"device": gpu, "torch": torch.__version__, "triton": triton_version,
            "transformers": transformers.__version__, "ropekit": ropekit.__version__, "commit": commit,
            "date": datetime.date.today().isoformat()}


def main(args: argparse.Namespace) -> int:
    config = build_config(args)
    env = environment(args.device, args.commit)
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(f"model: Llama {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, "
          f"head_dim {args.hidden // args.heads}, vocab {args.vocab}, rope {args.rope}; train batch {args.batch}x"
          f"{args.seq}; generate batch {args.gen_batch}, prompt {args.gen_prompt}, new {args.gen_new}")
    torch.manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    prompt = torch.randint(1, args.vocab, (args.gen_batch, args.gen_prompt), device=args.device)
    rows = []
    all_ok = True
    for name in args.dtypes.split(","):
        dtype = DTYPES[name.strip()]
        row = {"dtype": name, **env, "layers": args.layers, "hidden": args.hidden, "batch": args.batch,
               "seq": args.seq, "rope": args.rope}
        row.update(check(config, args, dtype, ids))
        all_ok &= bool(row["ok"])
        model = build_model(config, args.device, dtype)
        row["rope_only_ms_hf"] = rope_only_ms(model, args, dtype, patched=False)
        row["rope_only_ms_ropekit"] = rope_only_ms(model, args, dtype, patched=True)
        row["train_step_ms_hf"] = train_step_ms(model, args, ids, patched=False)
        row["train_step_ms_ropekit"] = train_step_ms(model, args, ids, patched=True)
        model.eval()
        ms_hf, out_hf = generate(model, args, prompt, patched=False)
        ms_rk, out_rk = generate(model, args, prompt, patched=True)
        new = args.gen_new * args.gen_batch
        row.update(generate_ms_hf=ms_hf, generate_ms_ropekit=ms_rk, generate_tok_s_hf=new / ms_hf * 1e3,
                   generate_tok_s_ropekit=new / ms_rk * 1e3,
                   generated_tokens_equal=float((out_hf == out_rk).float().mean().item()))
        rows.append(row)
        del model
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()

    header = ("dtype", "check", "logits rel", "grad rel max", "rope fwd+bwd ms HF", "ropekit", "train step ms HF",
              "ropekit", "generate tok/s HF", "ropekit", "same tokens")
    print()
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for r in rows:
        print(" | ".join([
            r["dtype"], "PASS" if r["ok"] else "FAIL", f"{r['logits_rel_err_vs_unpatched']:.2e}",
            f"{r['grad_rel_err_vs_unpatched_max']:.2e}", f"{r['rope_only_ms_hf']:.3f}",
            f"{r['rope_only_ms_ropekit']:.3f}", f"{r['train_step_ms_hf']:.2f}", f"{r['train_step_ms_ropekit']:.2f}",
            f"{r['generate_tok_s_hf']:.1f}", f"{r['generate_tok_s_ropekit']:.1f}",
            f"{100 * r['generated_tokens_equal']:.1f}%"]))
    for r in rows:
        if "logits_rel_err_hf_vs_fp32" in r:
            print(f"{r['dtype']}: logits rel err vs fp32 weights: transformers {r['logits_rel_err_hf_vs_fp32']:.3e}, "
                  f"ropekit {r['logits_rel_err_ropekit_vs_fp32']:.3e}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
        print(f"wrote {args.json}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main(ARGS))
