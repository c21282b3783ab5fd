"""Decode grids on a CUDA GPU: the launcher's block shape against the same heads per program with twice the warps
(half the pairs a thread) and half the heads at the same warps, for 1-D positions and multi-axis positions (the
model's section layout), by kernel device time and CUDA-graph replay, each over the launcher's shape of the same
call. The last column is the multi-axis call over the 1-D call, both at the launcher's shape (issue #13's ratio).
The outputs of every shape of a call must be equal bit for bit. Backs ``heuristics.PAIR_AXES_LATENCY_BYTES_PER_THREAD``
and ``heuristics.PAIR_AXES_SM_FRACTION``.

    python benchmarks/probes/warps_probe.py [--tokens 8,12,16,20,24,32] [--shapes qwen3vl8b,qwen3vl32b,...]
"""

# ruff: noqa: E402 - options are parsed before torch, Triton and ropekit load, so --help runs on any machine
from __future__ import annotations

import argparse

# (q heads, kv heads, head_dim, section layout, sections): Qwen3-VL-2B/8B/32B and -30B-A3B (interleaved), Qwen2-VL-7B
# (contiguous), and two head sizes with contiguous sections of the same proportions
SHAPES = {"qwen3vl2b": (16, 8, 128, "interleaved", (24, 20, 20)),
          "qwen3vl8b": (32, 8, 128, "interleaved", (24, 20, 20)),
          "qwen3vl32b": (64, 8, 128, "interleaved", (24, 20, 20)),
          "qwen3vl30b": (32, 4, 128, "interleaved", (24, 20, 20)),
          "qwen2vl7b": (28, 4, 128, "contiguous", (16, 24, 24)),
          "d64": (32, 8, 64, "contiguous", (8, 12, 12)),
          "d256": (16, 8, 256, "contiguous", (32, 48, 48))}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="8,12,16,20,24,32", help="comma-separated token counts (one a sequence)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help exits here

import functools

import torch
from _graphs import graph_us_interleaved, kernel_us

from ropekit._validation import validate
from ropekit.triton import launcher

VARIANTS = ("launcher", "2x warps", "half heads")


def _calls(T: int, hq: int, hk: int, D: int, layout: str, sections: tuple, dtype: torch.dtype) -> tuple[dict, dict]:
    """({(call, variant): fn}, {call: the launcher's (BLOCK_T, BLOCK_HQ, BLOCK_HK, warps)}) on shared inputs and
    preallocated outputs; the variants of each call are checked equal bit for bit."""
    q = torch.randn(T, 1, hq, D, device="cuda", dtype=dtype)
    k = torch.randn(T, 1, hk, D, device="cuda", dtype=dtype)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    ids = torch.randint(0, 8192, (3, T, 1), device="cuda")
    specs = {"1-d": validate(q, k, positions=ids[0], base=5e5),
             layout: validate(q, k, positions=ids, sections=sections, section_layout=layout, base=5e5)}
    calls, shapes = {}, {}
    for call, spec in specs.items():
        _, _, named, warps = launcher.rope_arguments(q, k, qo, ko, spec)
        bt, bhq, bhk = named["BLOCK_T"], named["BLOCK_HQ"], named["BLOCK_HK"]
        shapes[call] = (bt, bhq, bhk, warps)
        configs = {"launcher": None, "2x warps": (bt, bhq, bhk, min(8, 2 * warps)),
                   "half heads": (bt, max(1, bhq // 2), max(1, bhk // 2), warps)}
        outs = {}
        for variant, config in configs.items():
            calls[call, variant] = fn = functools.partial(launcher.launch_rope, q, k, qo, ko, spec, config=config)
            qo.fill_(float("nan"))
            ko.fill_(float("nan"))
            fn()
            outs[variant] = (qo.clone(), ko.clone())
        assert all(all(torch.equal(a, b) for a, b in zip(o, outs["launcher"])) for o in outs.values()), call
    return calls, shapes


def main(args: argparse.Namespace) -> None:
    import triton
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  {args.dtype}; "
          "each variant device / replay over the launcher's shape of its call")
    for name in args.shapes.split(","):
        hq, hk, D, layout, sections = SHAPES[name]
        for T in (int(t) for t in args.tokens.split(",")):
            calls, shapes = _calls(T, hq, hk, D, layout, sections, getattr(torch, args.dtype))
            replay = graph_us_interleaved(calls, rounds=21)
            device = {key: sum(kernel_us(fn).values()) for key, fn in calls.items()}
            row = "  ".join(f"{call} {shapes[call]} {device[call, 'launcher']:.2f}us " + " ".join(
                f"{v} {device[call, v] / device[call, 'launcher']:.3f}/{replay[call, v] / replay[call, 'launcher']:.3f}"
                for v in VARIANTS[1:]) for call in shapes)
            ratio = (f"{device[layout, 'launcher'] / device['1-d', 'launcher']:.3f}/"
                     f"{replay[layout, 'launcher'] / replay['1-d', 'launcher']:.3f}")
            print(f"{name:>10} T={T:<3d} | {row} | {layout}/1-d {ratio}", flush=True)


if __name__ == "__main__":
    main(ARGS)
