"""M-RoPE cost probe on a CUDA GPU: the multi-axis call against the same call with 1-D positions, at Qwen2-VL-7B's
shape (28/4 heads, D 128, bf16; sections 16/24/24 unless ``--sections`` says otherwise), decode under CUDA-graph
replay (with each kernel's device time from the profiler) and forward with a cold L2.

Both go through the raw launcher with preallocated outputs, so the ratio is the kernel's alone (the bench's
``mrope-*`` targets measure the public call). Backs the way ``kernel._pair_positions`` reads each pair's
position.

    python benchmarks/probes/mrope_probe.py [--tokens 1,16,64,256] [--prefill 1x4096,2x4096,8x4096]
        [--layout interleaved --sections 24,20,20]
"""

# ruff: noqa: E402 - options are parsed before torch, Triton and ropekit load, so --help runs on any machine
from __future__ import annotations

import argparse

from _options import decode_parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = decode_parser(__doc__, "HQ:HK (head_dim 128)")
    parser.set_defaults(tokens="1,16,64,256", heads="28:4")
    parser.add_argument("--prefill", default="1x4096,2x4096,8x4096", help="comma-separated BxS forward shapes")
    parser.add_argument("--label", default="", help="a label printed on every row (e.g. the variant under test)")
    parser.add_argument("--layout", default="contiguous", choices=["contiguous", "interleaved"],
                        help="section layout (interleaved: Qwen3-VL's)")
    parser.add_argument("--sections", default="16,24,24",
                        help="pairs per axis (Qwen2-VL: 16,24,24; Qwen3-VL: 24,20,20 with --layout interleaved)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help exits here

import torch
import triton.testing
from _graphs import graph_us_interleaved, kernel_us

from ropekit._spec import validate
from ropekit.triton.launcher import launch_rope


def _calls(B: int, S: int, HQ: int, HK: int, layout: str, sections: tuple) -> dict:
    """{"1-d": fn, "mrope": fn}: the raw launch of each, on shared inputs and preallocated outputs."""
    q = torch.randn(B, S, HQ, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, HK, 128, device="cuda", dtype=torch.bfloat16)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    ids = torch.randint(0, 8192, (3, B, S), device="cuda")
    specs = {"1-d": validate(q, k, positions=ids[0], base=1e6),
             "mrope": validate(q, k, positions=ids, sections=sections, section_layout=layout, base=1e6)}
    return {name: (lambda s=spec: launch_rope(q, k, qo, ko, s)) for name, spec in specs.items()}


def main(args: argparse.Namespace) -> None:
    HQ, HK = (int(h) for h in args.heads.split(":"))
    sections = tuple(int(n) for n in args.sections.split(","))
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"{args.layout} sections {args.sections}  {args.label}")
    print(f"{'shape':>10} {'mode':>7} {'1-d us':>8} {'mrope us':>9} {'ratio':>6}   kernel device us 1-d / mrope")
    for T in (int(t) for t in args.tokens.split(",")):
        calls = _calls(T, 1, HQ, HK, args.layout, sections)
        timed = graph_us_interleaved(calls)
        one_d, multi = timed["1-d"], timed["mrope"]
        device = {name: sum(kernel_us(fn).values()) for name, fn in calls.items()}
        print(f"{T:>10} {'decode':>7} {one_d:>8.2f} {multi:>9.2f} {multi / one_d:>6.3f}   "
              f"{device['1-d']:.2f} / {device['mrope']:.2f} ({device['mrope'] / device['1-d']:.3f})")
    for shape in filter(None, args.prefill.split(",")):
        B, S = (int(x) for x in shape.split("x"))
        calls = _calls(B, S, HQ, HK, args.layout, sections)
        best = {name: [] for name in calls}
        for _ in range(3):  # interleaved rounds, best of each
            for name, fn in calls.items():
                best[name].append(triton.testing.do_bench(fn, rep=200))
        t1, tm = min(best["1-d"]) * 1e3, min(best["mrope"]) * 1e3
        print(f"{shape:>10} {'fwd':>7} {t1:>8.1f} {tm:>9.1f} {tm / t1:>6.3f}")


if __name__ == "__main__":
    main(ARGS)
