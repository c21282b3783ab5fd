"""The two exact angle reductions on a CUDA GPU, timed in one run: float64 (the default where float64 is fast) and
64-bit integer turns (``kernel.FREQ_INV_FREQ_INT``, the default on GPUs without fast float64), each forced with
``ropekit.testing.exact_angles``. Llama-3-8B (32/8 heads, D 128, bf16, base 500000): the forward with a cold L2,
decode under CUDA-graph replay (one token per sequence at its own offset), ``rope_kv_write`` decode with Qwen3's
norm (graph replay) and forward + backward through autograd.

    python benchmarks/probes/angle_probe.py [--tokens 1,16,64,256] [--prefill 1x2048,8x4096,32x4096]
"""

# ruff: noqa: E402 - options are parsed before torch, Triton and ropekit load, so --help runs on any machine
from __future__ import annotations

import argparse

from _options import decode_parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = decode_parser(__doc__, "HQ:HK (head_dim 128)")
    parser.set_defaults(tokens="1,16,64,256")
    parser.add_argument("--prefill", default="1x2048,8x4096,32x4096", help="comma-separated BxS forward shapes")
    parser.add_argument("--train", default="4x4096,8x4096", help="comma-separated BxS forward + backward shapes")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help exits here

import torch
import triton
import triton.testing
from _graphs import graph_us_interleaved

import ropekit
from ropekit._validation import validate
from ropekit.testing import exact_angles
from ropekit.triton.launcher import launch_rope

METHODS = ("float64", "integer")
BASE = 500000.0


def _captured(method: str, fn):
    """``fn`` whose first calls (graph warm-up and capture, where the kernel is chosen) run under ``method``."""
    def call():
        with exact_angles(method):
            fn()
    return call


def _best_of_rounds(fns: dict, rounds: int = 3) -> dict:
    """Best do_bench median (us) of each entry over interleaved rounds, each round under its own method."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for (name, method), fn in fns.items():
            with exact_angles(method):
                times[(name, method)].append(triton.testing.do_bench(fn, rep=200) * 1e3)
    return {key: min(t) for key, t in times.items()}


def main(args: argparse.Namespace) -> None:
    HQ, HK = (int(h) for h in args.heads.split(":"))
    dev = "cuda"
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"{'case':>24} {'float64 us':>11} {'integer us':>11} {'int/f64':>8}")

    def row(label, timed):
        f, i = timed["float64"], timed["integer"]
        print(f"{label:>24} {f:>11.2f} {i:>11.2f} {i / f:>8.3f}")

    for T in (int(t) for t in args.tokens.split(",")):
        q = torch.randn(T, 1, HQ, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(T, 1, HK, 128, device=dev, dtype=torch.bfloat16)
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        offsets = torch.randint(0, 100_000, (T,), device=dev)  # each sequence at its own position
        spec = validate(q, k, positions=offsets.view(T, 1), base=BASE)
        row(f"decode {T}", graph_us_interleaved(
            {m: _captured(m, lambda: launch_rope(q, k, qo, ko, spec)) for m in METHODS}))

    previous = ropekit.set_fast_path(False)  # plans are bound to one method; the graph replays the kernel alone
    try:
        for T in (int(t) for t in args.tokens.split(",")):
            q = torch.randn(T, HQ, 128, device=dev, dtype=torch.bfloat16)
            k, v = (torch.randn(T, HK, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
            caches = [torch.zeros(T, HK, 4096, 128, device=dev, dtype=torch.bfloat16) for _ in range(2)]
            w = torch.rand(128, device=dev, dtype=torch.bfloat16) + 0.5
            pos = torch.randint(0, 4096, (T,), device=dev)

            def kv_write():
                ropekit.rope_kv_write(q, k, v, *caches, positions=pos, cache_layout="bhsd", q_weight=w,
                                      k_weight=w, base=1e6)
            with torch.no_grad():
                row(f"kv-write+norm decode {T}", graph_us_interleaved({m: _captured(m, kv_write) for m in METHODS}))
    finally:
        ropekit.set_fast_path(previous)

    for shape in args.prefill.split(","):
        B, S = (int(x) for x in shape.split("x"))
        q = torch.randn(B, S, HQ, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, S, HK, 128, device=dev, dtype=torch.bfloat16)
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        spec = validate(q, k, base=BASE)
        timed = _best_of_rounds({("fwd", m): (lambda: launch_rope(q, k, qo, ko, spec)) for m in METHODS})
        row(f"fwd {shape}", {m: timed[("fwd", m)] for m in METHODS})

    for shape in args.train.split(","):
        B, S = (int(x) for x in shape.split("x"))
        q = torch.randn(B, S, HQ, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, S, HK, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
        gq, gk = torch.randn_like(q), torch.randn_like(k)

        def fwd_bwd():
            qr, kr = ropekit.apply_rope(q, k, base=BASE)
            torch.autograd.backward((qr, kr), (gq, gk))
        timed = _best_of_rounds({("fwdbwd", m): fwd_bwd for m in METHODS})
        row(f"fwd+bwd {shape}", {m: timed[("fwdbwd", m)] for m in METHODS})


if __name__ == "__main__":
    main(ARGS)
