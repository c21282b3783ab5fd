"""Decode latency probe on a CUDA GPU: one q+k rotation per call, replayed from a CUDA graph, at several block
configurations, against a copy of q replayed the same way; plus each kernel's own duration from the profiler.

Separates what a decode call costs into the kernel's execution (profiler duration) and the per-node cost of a
graph replay, for the Llama-3-8B shape by default (32/8 heads, D 128, bf16, one token per sequence, per-sequence
offsets). ``--sweep`` times every block shape instead.

    python benchmarks/probes/decode_probe.py [--tokens 1,16,64] [--heads 32:8] [--sweep]
"""

# ruff: noqa: E402 - options are parsed before torch, Triton and ropekit load, so --help runs on any machine
from __future__ import annotations

import argparse

from _options import decode_parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = decode_parser(__doc__, "HQ:HK (head_dim 128)")
    parser.add_argument("--sweep", action="store_true",
                        help="time every block shape (heads per program x warps), graph replay only, and print "
                             "the fastest per token count")
    parser.add_argument("--dump", help="write the PTX of every compiled rope_kernel specialisation into this folder")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help exits here

import torch
from _graphs import graph_us_interleaved, kernel_us

from ropekit._spec import validate
from ropekit.triton.launcher import _num_programs_wanted, block_config, launch_rope


def main(args: argparse.Namespace) -> None:
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'tokens':>6} {'variant':<34} {'graph us':>9} {'x copy-q':>8} {'kernel us':>10}")
    HQ, HK = (int(h) for h in args.heads.split(":"))
    for T in (int(t) for t in args.tokens.split(",")):
        q = torch.randn(T, 1, HQ, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(T, 1, HK, 128, device="cuda", dtype=torch.bfloat16)
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        offsets = torch.randint(0, 8192, (T,), device="cuda")
        emb = torch.randn(T, 1, 128, device="cuda", dtype=torch.bfloat16)
        variants = {"copy-q": lambda: qo.copy_(q)}
        default = block_config(T, HQ, HK, 128, 2, _num_programs_wanted(q.device))
        for label, kwargs in (("exact", dict(positions=offsets)), ("hf table", dict(cos=emb, sin=emb))):
            launch_kw = validate(q, k, **kwargs)
            configs = {f"default {default}": None}
            hq2, hk2 = 1 << (HQ - 1).bit_length(), 1 << (HK - 1).bit_length()
            shapes = [(bt, bh, min(bh, hk2), nw) for bt in (1, 2, 4) for bh in (1, 2, 4, 8, 16, 32, 64)
                      for nw in (1, 2, 4, 8) if bh <= hq2 and bt * bh * 64 >= 32 * nw and bt <= T
                      and (bt == 1 or bh == 8)] if args.sweep else [(1, 8, 8, 1), (1, 4, 4, 1)]
            for cfg in shapes:
                configs[f"T{cfg[0]} H{cfg[1]}/{cfg[2]} w{cfg[3]}"] = cfg
            for label_cfg, cfg in configs.items():
                variants[f"{label} {label_cfg}"] = (lambda kw=launch_kw, c=cfg: launch_rope(q, k, qo, ko, kw,
                                                                                           config=c))
        timed = graph_us_interleaved(variants)
        base = timed["copy-q"]
        for name, g in timed.items():
            kern_s = "" if args.sweep else ", ".join(f"{v:.2f}" for v in kernel_us(variants[name]).values())
            print(f"{T:>6} {name:<34} {g:>9.2f} {g / base:>8.2f} {kern_s:>10}")
        for label in ("exact", "hf table"):
            mine = {n: g for n, g in timed.items() if n.startswith(label)}
            best = min(mine, key=mine.get)
            print(f"{T:>6} fastest {label}: {best} {mine[best]:.2f} us ({mine[best] / base:.2f}x copy-q)")
    if args.dump:
        import os

        from ropekit.triton.launcher import _COMPILED

        os.makedirs(args.dump, exist_ok=True)
        for i, (key, compiled) in enumerate(_COMPILED.items()):
            with open(os.path.join(args.dump, f"rope_kernel_{i}.ptx"), "w") as f:
                f.write(f"// constexprs, num_warps: {key[-3:]}\n" + compiled.asm["ptx"])


if __name__ == "__main__":
    main(ARGS)
