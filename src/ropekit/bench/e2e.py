"""End to end: what a patched transformers model gains, measured in one run (``python -m ropekit.bench.e2e``).

Every variant of one random-weight model config runs in a child process of its own (a peer's class-level patches
and the allocator's state never leak into the next), in this order: ``sdpa`` (transformers unpatched, torch's SDPA),
``ropekit`` (:func:`ropekit.patch`: ropekit's rotation and the fused prologue where the family has one),
``ropekit-attention`` (``patch(model, attention=True)``: also ``rope_attention`` where it is exact), and Liger
where it is installed and covers the family: ``liger-rope`` (its RoPE only) and ``liger`` (its default patch set:
RMSNorm, SwiGLU, fused linear cross-entropy and RoPE). Each child reports:

* ``train``: one training step -- forward with labels, backward, fused AdamW -- of a ``batch x seq`` token batch
  (bf16 weights, ``use_cache=False`` as training scripts pass); median over the timed steps, CUDA events;
* ``decode``: greedy decoding with transformers' ``StaticCache``: the time per generated token after a prefill, at
  each batch size, run eagerly and captured in one CUDA graph per step (the capture that torch.compile's
  ``reduce-overhead`` mode makes, without its compiler); the tokens of the first sequence, which the parent
  compares with ``sdpa``'s.

The parent prints one table (time and ratio to ``sdpa``) and, with ``--csv``, appends the rows to a CSV. ``--tiny``
shrinks the configs to a smoke test that runs on CPU (its timings are not performance figures).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

VARIANTS = ("sdpa", "ropekit", "ropekit-attention", "liger-rope", "liger")

# ~0.5 B parameters each (embeddings tied); transformers' own defaults for everything not named
CONFIGS = {
    "qwen3": ("Qwen3Config", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=24,
                                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                  tie_word_embeddings=True, max_position_embeddings=8192)),
    "llama": ("LlamaConfig", dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                  num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                                  tie_word_embeddings=True, max_position_embeddings=8192)),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512)


def build_model(name: str, variant: str, device: torch.device, dtype: torch.dtype, tiny: bool):
    """The random-weight model of config ``name`` with ``variant`` applied (Liger's patches before it is built, as
    its functions patch the modeling module's classes)."""
    import transformers

    cls_name, sizes = CONFIGS[name]
    config = getattr(transformers, cls_name)(**{**sizes, **(TINY if tiny else {})})
    if variant.startswith("liger"):
        import liger_kernel.transformers as liger

        apply = getattr(liger, f"apply_liger_kernel_to_{name}")
        if variant == "liger-rope":
            apply(rope=True, rms_norm=False, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=False)
        else:
            apply()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.to(device)
    if variant.startswith("ropekit"):
        from ropekit.integrations.transformers import patch

        patch(model, attention=variant == "ropekit-attention")
    return model


class _Clock:
    """Elapsed milliseconds of a callable: CUDA events on a GPU, the wall clock elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3


def time_training(model, batch: int, seq: int, steps: int, device: torch.device) -> dict:
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    def step():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    clock = _Clock(device)
    for _ in range(2):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [clock(step) for _ in range(steps)]
    ms = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return dict(kind="train", batch=batch, seq=seq, ms=ms, tokens_per_s=batch * seq / ms * 1e3, peak_gib=peak)


def time_decoding(model, batch: int, prompt: int, new_tokens: int, graph: bool, device: torch.device) -> dict:
    """Greedy decoding into a StaticCache: ms per step after the prefill, and the first sequence's tokens."""
    from transformers import StaticCache

    model.eval()
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=g).to(device)
    cache = StaticCache(config=model.config, max_cache_len=prompt + new_tokens + 4)
    tokens = []
    with torch.inference_mode():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True,
                       cache_position=torch.arange(prompt, device=device)).logits
        tok = logits[:, -1:].argmax(-1)
        position = torch.tensor([prompt], device=device)

        def step():
            out = model(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=position,
                        position_ids=position.expand(batch, 1)).logits
            return out[:, -1:].argmax(-1)

        clock = _Clock(device)
        if graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up writes at this position; the replays write it again
                    step()
            torch.cuda.current_stream().wait_stream(side)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                next_tok = step()

            def advance():
                cuda_graph.replay()
                tok.copy_(next_tok)
                position.add_(1)
        else:
            def advance():
                tok.copy_(step())
                position.add_(1)
        times = []
        for _ in range(new_tokens):
            tokens.append(int(tok[0, 0]))
            times.append(clock(advance))
    ms = statistics.median(times)
    return dict(kind="decode-graph" if graph else "decode", batch=batch, seq=prompt, ms=ms,
                tokens_per_s=batch / ms * 1e3, tokens=tokens)


def run_variant(args) -> list[dict]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.model, args.variant, device, dtype, args.tiny)
    rows = [_attempt(lambda: time_training(model, args.batch, args.seq, args.steps, device), "train", args.batch,
                     args.seq)]
    for batch in args.decode_batches:
        for graph in (False, True) if device.type == "cuda" else (False,):
            rows.append(_attempt(lambda b=batch, g=graph: time_decoding(model, b, args.prompt, args.new_tokens, g,
                                                                        device),
                                 "decode-graph" if graph else "decode", batch, args.prompt))
    return rows


def _attempt(measure, kind: str, batch: int, seq: int) -> dict:
    """``measure()``'s row, or a row saying why it failed (one failing measurement keeps the variant's others)."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 -- reported in the table, not hidden
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return dict(kind=kind, batch=batch, seq=seq, ms=float("nan"), tokens_per_s=float("nan"),
                    error=f"{type(exc).__name__}: {str(exc)[:200]}")


def _available(variant: str, model: str) -> str | None:
    """Why ``variant`` cannot run here, or None."""
    if variant.startswith("liger"):
        try:
            import liger_kernel.transformers as liger
        except ImportError:
            return "liger-kernel not installed"
        if not hasattr(liger, f"apply_liger_kernel_to_{model}"):
            return f"Liger has no patch for {model}"
    return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ropekit.bench.e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(CONFIGS), default="qwen3")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from " + ", ".join(VARIANTS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8, help="timed training steps (after two warm-up steps)")
    p.add_argument("--decode-batches", default="1,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny configs: a smoke test of the harness (CPU)")
    p.add_argument("--csv", type=Path, help="append the rows to this CSV (benchmarks/results/e2e.csv feeds "
                                             "BENCHMARKS.md)")
    p.add_argument("--commit", help="the commit to stamp on the rows (default: git's, where there is a checkout)")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # the child's one variant
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.decode_batches = [int(b) for b in str(args.decode_batches).split(",") if b]
    if args.variant:  # a child: one variant, JSON rows on stdout's last line
        print(json.dumps(run_variant(args)))
        return 0
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
    results: dict[str, list[dict]] = {}
    for variant in args.variants.split(","):
        reason = _available(variant, args.model)
        if reason:
            print(f"{variant}: skipped ({reason})", flush=True)
            continue
        proc = subprocess.run([sys.executable, "-m", "ropekit.bench.e2e", *forwarded, "--variant", variant],
                              capture_output=True, text=True)
        if proc.returncode:
            print(f"{variant}: failed\n{proc.stderr[-3000:]}", flush=True)
            continue
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{variant}: done", flush=True)
    rows = _table(results, args)
    if args.csv and rows:
        new = not args.csv.exists()
        with args.csv.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                w.writeheader()
            w.writerows(rows)
    return 0 if results else 1


def _table(results: dict[str, list[dict]], args) -> list[dict]:
    """Print time, throughput and ratio to sdpa per (kind, batch) and variant; return the rows for the CSV."""
    from .env import environment

    env = environment(torch.device(args.device), args.commit)
    device = env["gpu"]
    base = {(r["kind"], r["batch"]): r for r in results.get("sdpa", [])}
    out = []
    print(f"\n{args.model} ({'tiny' if args.tiny else '~0.5B'}), {device}; train {args.batch}x{args.seq} tokens, "
          f"decode prompt {args.prompt} + {args.new_tokens} tokens")
    print(f"{'kind':<13}{'batch':>6} {'variant':<18}{'ms':>10}{'tok/s':>12}{'vs sdpa':>9}  same tokens")
    for variant, rows in results.items():
        for r in rows:
            ref = base.get((r["kind"], r["batch"]))
            ratio = r["ms"] / ref["ms"] if ref else float("nan")
            same = ""
            if ref and "tokens" in r:
                same = f"{sum(a == b for a, b in zip(r['tokens'], ref['tokens']))}/{len(ref['tokens'])}"
            print(f"{r['kind']:<13}{r['batch']:>6} {variant:<18}{r['ms']:>10.3f}{r['tokens_per_s']:>12.0f}"
                  f"{ratio:>9.3f}  {same}{r.get('error', '')}")
            out.append(dict(date=env["date"], commit=env["commit"], torch=env["torch"], model=args.model,
                            device=device, variant=variant, kind=r["kind"], batch=r["batch"],
                            seq=r["seq"], ms=round(r["ms"], 4), tokens_per_s=round(r["tokens_per_s"], 1),
                            vs_sdpa=round(ratio, 4), same_tokens=same, tiny=args.tiny, error=r.get("error", "")))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
