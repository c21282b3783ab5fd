"""Where the buffers lie, on a CUDA GPU: one decode call, multi-axis and 1-D, timed under CUDA-graph replay with its
positions, inputs and outputs at several addresses, and once with its captured calls cycling over all of them.

A decode program is a few memory round trips long, so the L2 slice a buffer maps to may move its time. If it
does, a ratio of two calls whose buffers lie in different places measures the placement as well as the kernels,
and a run-to-run spread follows (the allocation's physical pages change with every process). Each placement
allocates a padding tensor of random size first, then fresh q, k, outputs, multi-axis positions [3, 1, T] and 1-D
positions [T] (the same values as axis 0, a separate tensor as in ``ropekit bench``). The rows go through the raw
launcher (``launch_rope``), all graphs replayed in turn (``ropekit.bench.timing.graph_us_interleaved``).

    python benchmarks/probes/placement_probe.py [--tokens 4] [--heads 32:8] [--layout interleaved]
        [--sections 24,20,20] [--placements 8] [--seed 0]
"""

# ruff: noqa: E402 - options are parsed before torch, Triton and ropekit load, so --help runs on any machine
from __future__ import annotations

import argparse
import statistics

from _options import decode_parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = decode_parser(__doc__, "HQ:HK (head_dim 128)")
    parser.set_defaults(tokens="4", heads="32:8")
    parser.add_argument("--layout", default="interleaved", choices=["contiguous", "interleaved"],
                        help="section layout (interleaved: Qwen3-VL's)")
    parser.add_argument("--sections", default="24,20,20", help="pairs per axis (Qwen2-VL: 16,24,24 contiguous)")
    parser.add_argument("--placements", type=int, default=8, help="buffer sets at different addresses")
    parser.add_argument("--seed", type=int, default=0, help="seed of the padding sizes and the data")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help exits here

import torch
import triton

from ropekit._validation import validate
from ropekit.bench.timing import GRAPH_CALLS, cycling, graph_us_interleaved
from ropekit.triton.launcher import launch_rope

PAD_UNIT = 512  # the caching allocator's granule: every padding size is a multiple of it
MAX_PAD_UNITS = 2048  # paddings of up to 1 MiB, so placements spread over many L2 slices and pages


def _placements(T: int, HQ: int, HK: int, layout: str, sections: tuple, n: int, gen: torch.Generator) -> list:
    """``n`` sets of buffers, each behind a random padding; each set is (1-D call, multi-axis call, pads)."""
    out = []
    for _ in range(n):
        pad = torch.empty(PAD_UNIT * int(torch.randint(1, MAX_PAD_UNITS, (1,), generator=gen)), dtype=torch.uint8,
                          device="cuda")
        q = torch.randn(1, T, HQ, 128, generator=gen).to("cuda", torch.bfloat16)
        k = torch.randn(1, T, HK, 128, generator=gen).to("cuda", torch.bfloat16)
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        ids = torch.randint(0, 8192, (3, 1, T), generator=gen).to("cuda")
        ids_1d = ids[0].clone()
        one_d = validate(q, k, positions=ids_1d, base=1e6)
        multi = validate(q, k, positions=ids, sections=sections, section_layout=layout, base=1e6)
        out.append(((lambda s=one_d, b=(q, k, qo, ko): launch_rope(*b, s)),
                    (lambda s=multi, b=(q, k, qo, ko): launch_rope(*b, s)), (pad, ids, ids_1d)))
    return out


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f} (max/min {max(values) / min(values):.3f})"


def main(args: argparse.Namespace) -> None:
    HQ, HK = (int(h) for h in args.heads.split(":"))
    sections = tuple(int(n) for n in args.sections.split(","))
    gen = torch.Generator().manual_seed(args.seed)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"{HQ}/{HK} heads  {args.layout} sections {args.sections}  {args.placements} placements")
    for T in (int(t) for t in args.tokens.split(",")):
        sets = _placements(T, HQ, HK, args.layout, sections, args.placements, gen)
        calls = {}
        for p, (one_d, multi, _) in enumerate(sets):
            calls[f"1-d {p}"], calls[f"mrope {p}"] = one_d, multi
        calls["1-d cycling"] = cycling([s[0] for s in sets])
        calls["mrope cycling"] = cycling([s[1] for s in sets])
        timed = graph_us_interleaved(calls, calls=GRAPH_CALLS - GRAPH_CALLS % len(sets))  # each set equally often
        print(f"{'tokens':>6} {'placement':>9} {'1-d us':>8} {'mrope us':>9} {'ratio':>6}")
        ratios = []
        for p in range(len(sets)):
            a, b = timed[f"1-d {p}"], timed[f"mrope {p}"]
            ratios.append(b / a)
            print(f"{T:>6} {p:>9} {a:>8.3f} {b:>9.3f} {b / a:>6.3f}")
        a, b = timed["1-d cycling"], timed["mrope cycling"]
        print(f"{T:>6} {'cycling':>9} {a:>8.3f} {b:>9.3f} {b / a:>6.3f}")
        one_d = [timed[f"1-d {p}"] for p in range(len(sets))]
        multi = [timed[f"mrope {p}"] for p in range(len(sets))]
        print(f"  {T} tokens: 1-d us {_spread(one_d)}; mrope us {_spread(multi)}; ratio {min(ratios):.3f}-"
              f"{max(ratios):.3f} (median {statistics.median(ratios):.3f}); mrope of one placement over 1-d of "
              f"another {min(multi) / max(one_d):.3f}-{max(multi) / min(one_d):.3f}")


if __name__ == "__main__":
    main(ARGS)
