"""``python -m ropekit.bench.cpu``: ``apply_rope`` on CPU tensors (the float32 path) against transformers'
``apply_rotary_pos_emb`` on the same tensors, from decode (one token per sequence) to prefill.

transformers gets what a model hands it: cos/sin already computed for the positions (once per forward, shared by
every layer, so not timed) and q/k as [B, H, S, D] views of the [B, S, H, D] projections. ropekit gets the positions
([B, S] ids, or an int offset) and forms its angles in float64 on every call. Each time is the median of repeated
calls after warm-up calls, in microseconds; the functions of one size take turns, one call each, so that a change in
the machine's load reaches them alike. The ratio is ropekit's time over transformers' (below 1: ropekit is faster).
Without transformers only ropekit's times are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch

# (sequences, tokens per sequence): decode sizes, then prefill
SIZES = ((1, 1), (8, 1), (32, 1), (256, 1), (2, 4096))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OFFSET = 1000  # the int offset: a decode step's position


def median_us(fns: Sequence[Callable[[], object]], *, warmup: int, min_calls: int,
              budget_s: float) -> list[float]:
    """Median time of one call of each of ``fns`` in microseconds: ``warmup`` untimed calls of each, then rounds
    of one timed call of each (so that a change in the machine's load reaches every function alike), at least
    ``min_calls`` rounds and more while ``budget_s`` lasts."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    deadline = time.perf_counter() + budget_s
    while len(times[0]) < min_calls or time.perf_counter() < deadline:
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) * 1e6 for spent in times]


def hf_rotation() -> Callable | None:
    """transformers' ``apply_rotary_pos_emb`` (Llama's), or None when transformers is not installed."""
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except ImportError:
        return None
    return apply_rotary_pos_emb


def measure(sizes: Sequence[tuple[int, int]], dtypes: Sequence[torch.dtype], *, heads: int = 32, kv_heads: int = 8,
            head_dim: int = 128, base: float = 10000.0, warmup: int = 5, min_calls: int = 5,
            budget_s: float = 0.5, seed: int = 0) -> list[dict]:
    """One row per dtype x size x positions kind (``ids`` [B, S], ``offset`` int): ropekit's and (when installed)
    transformers' median microseconds and their ratio."""
    import ropekit

    apply_rotary_pos_emb = hf_rotation()
    generator = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    rows = []
    for dtype in dtypes:
        for batch, seqlen in sizes:
            q = torch.randn(batch, seqlen, heads, head_dim, generator=generator).to(dtype)
            k = torch.randn(batch, seqlen, kv_heads, head_dim, generator=generator).to(dtype)
            ids = (torch.arange(seqlen) + OFFSET).expand(batch, seqlen).contiguous()
            angles = ids[..., None].double() * inv_freq  # what a model's rotary embedding computes once per forward
            cos = torch.cat([angles, angles], -1).cos().to(dtype)
            sin = torch.cat([angles, angles], -1).sin().to(dtype)
            fns = [lambda q=q, k=k, p=positions: ropekit.apply_rope(q, k, positions=p, base=base)
                   for positions in (ids, OFFSET)]
            if apply_rotary_pos_emb is not None:
                fns.append(lambda q=q, k=k, cos=cos, sin=sin: apply_rotary_pos_emb(
                    q.transpose(1, 2), k.transpose(1, 2), cos, sin))
            times = median_us(fns, warmup=warmup, min_calls=min_calls, budget_s=budget_s)
            hf_us = times[2] if apply_rotary_pos_emb is not None else None
            for kind, us in zip(("ids", "offset"), times):
                rows.append(dict(dtype=str(dtype).removeprefix("torch."), batch=batch, seqlen=seqlen,
                                 positions=kind, ropekit_us=us, hf_us=hf_us,
                                 ratio=None if hf_us is None else us / hf_us))
    return rows


def format_rows(rows: Sequence[dict]) -> str:
    """The rows as an aligned text table."""
    lines = [f"{'dtype':9} {'B x S':>9} {'positions':9} {'ropekit us':>11} {'hf us':>11} {'ropekit/hf':>10}"]
    for r in rows:
        hf = "-" if r["hf_us"] is None else f"{r['hf_us']:.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        lines.append(f"{r['dtype']:9} {r['batch']:>4}x{r['seqlen']:<4} {r['positions']:9} {r['ropekit_us']:>11.1f} "
                     f"{hf:>11} {ratio:>10}")
    return "\n".join(lines)


def _size(text: str) -> tuple[int, int]:
    batch, _, seqlen = text.partition("x")
    return int(batch), int(seqlen or 1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ropekit.bench.cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=lambda s: [_size(x) for x in s.split(",")],
                        default=list(SIZES), help="comma-separated BxS (default: 1x1,8x1,32x1,256x1,2x4096)")
    parser.add_argument("--dtypes", type=lambda s: [DTYPES[x] for x in s.split(",")],
                        default=[torch.float32, torch.bfloat16], help="comma-separated of float32,bfloat16,float16")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--budget-s", type=float, default=0.5, help="timing budget per measurement (seconds)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    hf = "transformers' apply_rotary_pos_emb" if hf_rotation() else "no transformers installed: ropekit only"
    print(f"ropekit apply_rope on CPU vs {hf}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.heads}/{args.kv_heads} heads, head_dim {args.head_dim}; median of repeated calls after warm-up")
    rows = measure(args.sizes, args.dtypes, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                   budget_s=args.budget_s)
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
