"""Kernel tuning sweep on a CUDA GPU: ropekit's launcher at several tile sizes against a copy of the same bytes.

Prints one row per (case, variant) with the median time (triton.testing.do_bench, L2 flushed between runs) and
the ratio to a single-kernel copy of the same bytes. Used to pick ``TILE_BYTES`` and to check the heuristics.

    python benchmarks/probes/tune.py [--tiles 4096,8192,16384,32768] [--quick]
"""

# ruff: noqa: E402 - options are parsed before torch, Triton and ropekit load, so --help runs on any machine
from __future__ import annotations

import argparse


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", default="16384,32768,65536")
    parser.add_argument("--sweep", type=int, default=3, help="sweep explicit configs on the first N cases")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cases", help="regex on case names: tune only those")
    parser.add_argument("--log", default="tune_sweep.tsv", help="every variant's time, appended")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help exits here

import re
import time

import torch
import triton
from triton.testing import do_bench

import ropekit
from ropekit._validation import validate
from ropekit.triton.launcher import launch_rope

# (name, B, S, HQ, HK, D, dtype, api kwargs)
CASES = [
    ("llama8b bf16 B8 S4096", 8, 4096, 32, 8, 128, torch.bfloat16, {}),
    ("llama8b bf16 B1 S32768", 1, 32768, 32, 8, 128, torch.bfloat16, {}),
    ("mha16 D64 bf16 B16 S2048", 16, 2048, 16, 16, 64, torch.bfloat16, {}),
    ("mha16 D64 bf16 B1 S2048", 1, 2048, 16, 16, 64, torch.bfloat16, {}),
    ("mha16 D64 bf16 B1 S4096", 1, 4096, 16, 16, 64, torch.bfloat16, {}),
    ("llama8b fp32 B4 S4096", 4, 4096, 32, 8, 128, torch.float32, {}),
    ("llama8b bf16 interleaved B8 S4096", 8, 4096, 32, 8, 128, torch.bfloat16, dict(style="interleaved")),
    ("D256 bf16 B4 S4096 16/8", 4, 4096, 16, 8, 256, torch.bfloat16, {}),
    ("mla D192 rope64 back bf16 B8 S4096", 8, 4096, 32, 8, 192, torch.bfloat16,
     dict(rotary_dim=64, rotary_at="back")),
    ("llama8b bf16 table B8 S4096", 8, 4096, 32, 8, 128, torch.bfloat16, dict(table=True)),
    ("llama70b bf16 S2048", 1, 2048, 64, 8, 128, torch.bfloat16, {}),
    ("llama8b bf16 S8192", 1, 8192, 32, 8, 128, torch.bfloat16, {}),
    ("llama8b bf16 S16384 pos ids", 1, 16384, 32, 8, 128, torch.bfloat16, dict(ids=True)),
    ("llama8b bf16 B32 S4096", 32, 4096, 32, 8, 128, torch.bfloat16, {}),
    ("llama70b bf16 B32 S4096", 32, 4096, 64, 8, 128, torch.bfloat16, {}),
]


def _prepare(B, S, HQ, HK, D, dtype, extra):
    q = torch.randn(B, S, HQ, D, device="cuda", dtype=dtype)
    k = torch.randn(B, S, HK, D, device="cuda", dtype=dtype)
    kwargs = {k_: v for k_, v in extra.items() if k_ not in ("table", "ids")}
    R = kwargs.get("rotary_dim", D)
    if extra.get("table"):
        inv = 10000.0 ** (-torch.arange(0, R, 2, device="cuda", dtype=torch.float64) / R)
        ang = torch.outer(torch.arange(S, device="cuda", dtype=torch.float64), inv)
        kwargs.update(cos=ang.cos().float(), sin=ang.sin().float())
    if extra.get("ids"):
        kwargs.update(positions=torch.randint(0, S, (B, S), device="cuda"))
    return q, k, kwargs, validate(q, k, **kwargs)


def main(args: argparse.Namespace) -> None:
    tiles = [int(t) for t in args.tiles.split(",")]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"DRAM {triton.testing.get_dram_gbps():.0f} GB/s")
    print(f"{'case':<38} {'variant':<14} {'us':>9} {'x copy':>7} {'GB/s':>7}")
    cases = [c for c in CASES[: 4 if args.quick else None] if not args.cases or re.search(args.cases, c[0])]
    for name, B, S, HQ, HK, D, dtype, extra in cases:
        q, k, kwargs, launch_kw = _prepare(B, S, HQ, HK, D, dtype, extra)
        nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        t_copy = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
        print(f"{name:<38} {'copy':<14} {t_copy * 1e3:>9.1f} {1.0:>7.3f} {nbytes / t_copy / 1e6:>7.0f}")
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        from ropekit.triton.heuristics import block_config, num_programs_wanted

        variants = [("tile " + str(tile), dict(tile_bytes=tile)) for tile in tiles]
        if cases.index((name, B, S, HQ, HK, D, dtype, extra)) < args.sweep:
            d_pad = triton.next_power_of_2(D)
            for bh in (8, 16, 32):
                for bt in (1, 2, 4, 8, 16):
                    for nw in (1, 2, 4, 8):
                        if bh > triton.next_power_of_2(HQ) or bh * d_pad * bt * q.element_size() > 65536:
                            continue
                        cfg = (bt, bh, min(bh, triton.next_power_of_2(HK)), nw)
                        variants.append((f"T{bt} H{bh} w{nw}", dict(config=cfg)))
        default = block_config(B * S, HQ, HK, D, q.element_size(), num_programs_wanted(q.device))
        print(f"{'':<38} config before the per-card stream rule (BLOCK_T, BLOCK_HQ, BLOCK_HK, warps) = {default}")
        best = None
        for label, extra_kw in variants:
            # ko is bound in this iteration (the `del` at its end misleads the linter)
            t = do_bench(lambda: launch_rope(q, k, qo, ko, launch_kw, **extra_kw), warmup=10,  # noqa: F821
                         rep=60, return_mode="median")
            best = min(best or (t, label), (t, label))
            with open(args.log, "a") as log:
                log.write(f"{name}\t{label}\t{t * 1e3:.2f}\t{t / t_copy:.4f}\n")
            if not label.startswith("T"):
                print(f"{'':<38} {label:<14} {t * 1e3:>9.1f} {t / t_copy:>7.3f} {nbytes / t / 1e6:>7.0f}")
        print(f"{'':<38} {'best ' + best[1]:<14} {best[0] * 1e3:>9.1f} {best[0] / t_copy:>7.3f}")
        t = do_bench(lambda: ropekit.apply_rope(q, k, **kwargs), warmup=25, rep=200, return_mode="median")
        print(f"{'':<38} {'apply_rope':<14} {t * 1e3:>9.1f} {t / t_copy:>7.3f} {nbytes / t / 1e6:>7.0f}")
        t = do_bench(lambda: ropekit.apply_rope_(q, k, **kwargs), warmup=25, rep=200, return_mode="median")
        print(f"{'':<38} {'apply_rope_':<14} {t * 1e3:>9.1f} {t / t_copy:>7.3f} {nbytes / t / 1e6:>7.0f}")
        del q, k, qo, ko, src, dst
    # fwd+bwd through autograd, against the ideal 4 passes (read+write forward, read+write backward)
    q, k, kwargs, _ = _prepare(4, 4096, 32, 8, 128, torch.bfloat16, {})
    q.requires_grad_(True)
    k.requires_grad_(True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    src = torch.empty(2 * (q.numel() + k.numel()) * 2 // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t_copy = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")

    def fwd_bwd():
        a, b = ropekit.apply_rope(q, k)
        torch.autograd.backward((a, b), (gq, gk))

    t = do_bench(fwd_bwd, warmup=25, rep=200, return_mode="median", grad_to_none=[q, k])
    print(f"{'fwd+bwd bf16 B4 S4096':<38} {'autograd':<14} {t * 1e3:>9.1f} {t / (2 * t_copy):>7.3f} (x 4-pass copy)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            q.grad = k.grad = None
            fwd_bwd()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=40))
    # decode under CUDA-graph replay, and eager host time per call
    for tokens in (1, 64):
        q = torch.randn(tokens, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(tokens, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
        pos = torch.randint(0, 4096, (tokens,), device="cuda")
        qo = torch.empty_like(q)
        for _ in range(3):
            ropekit.apply_rope_(q, k, positions=pos)
            qo.copy_(q)
        g_rope, g_copy = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        n_rep = 100
        with torch.cuda.graph(g_rope):
            for _ in range(n_rep):
                ropekit.apply_rope_(q, k, positions=pos)
        with torch.cuda.graph(g_copy):
            for _ in range(n_rep):
                qo.copy_(q)
        t_r = do_bench(g_rope.replay, warmup=10, rep=200, return_mode="median") / n_rep
        t_c = do_bench(g_copy.replay, warmup=10, rep=200, return_mode="median") / n_rep
        print(f"{'decode ' + str(tokens) + ' tok, graph replay':<38} {'rope/copy q':<14} {t_r * 1e3:>9.2f} "
              f"{t_r / t_c:>7.3f} (copy {t_c * 1e3:.2f} us)")
        x = torch.randn(16, device="cuda")
        launch_kw = validate(q, k, positions=pos)
        for fn, label in ((lambda: ropekit.apply_rope_(q, k, positions=pos), "apply_rope_"),
                          (lambda: ropekit.apply_rope(q, k, positions=pos), "apply_rope"),
                          (lambda: validate(q, k, positions=pos), "validate only"),
                          (lambda: launch_rope(q, k, q, k, launch_kw), "launch only"),
                          (lambda: x.add_(1), "x.add_(1)")):
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(2000):
                fn()
            t_host = (time.perf_counter() - t0) / 2000
            torch.cuda.synchronize()
            print(f"{'host time, decode ' + str(tokens):<38} {label:<14} {t_host * 1e6:>9.1f}")


if __name__ == "__main__":
    main(ARGS)
