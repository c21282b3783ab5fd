"""Small decode grids on a CUDA GPU: half the heads per program (``heuristics.block_config``'s ``small_grid`` shape)
against the 8-heads-a-program decode shape at the same warps, for every model shape, dtype and angle source, by
kernel device time and CUDA-graph replay (half / wide). The outputs of the two shapes must be equal bit for bit.
Backs ``heuristics.SMALL_GRID_SM_FRACTION`` and which calls pass ``small_grid``.

    python benchmarks/probes/small_grid_probe.py [--tokens 1,2,4,8,16] [--shapes llama8b,qwen2vl,...]
"""

# ruff: noqa: E402 - options are parsed before torch, Triton and ropekit load, so --help runs on any machine
from __future__ import annotations

import argparse

SHAPES = {"llama8b": (32, 8, 128, "bfloat16"), "llama70b": (64, 8, 128, "bfloat16"),
          "qwen2vl": (28, 4, 128, "bfloat16"), "d64": (32, 8, 64, "bfloat16"),
          "gemma2-d256": (16, 8, 256, "bfloat16"), "fp32": (32, 8, 128, "float32")}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,2,4,8,16", help="comma-separated token counts (one per sequence)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help exits here

import functools

import torch
from _graphs import graph_us_interleaved, kernel_us

from ropekit._validation import validate
from ropekit.triton import heuristics, launcher


def _shapes(T: int, hq: int, hk: int, D: int, elem_size: int) -> dict:
    """{"wide": config, "half": config}: the decode shape without ``small_grid`` and the halved one at any grid
    size (the fraction set to 1 so that only the head counts limit it)."""
    wanted = heuristics.num_programs_wanted(torch.device("cuda"))
    saved = heuristics.SMALL_GRID_SM_FRACTION
    heuristics.SMALL_GRID_SM_FRACTION = 1
    try:  # past block_plan's cache, which holds plans made with the shipped fraction
        half = heuristics.block_plan.__wrapped__(T, hq, hk, D, elem_size, wanted, small_grid=True)[0]
    finally:
        heuristics.SMALL_GRID_SM_FRACTION = saved
    return {"wide": heuristics.block_config(T, hq, hk, D, elem_size, wanted), "half": half}


def _calls(T: int, hq: int, hk: int, D: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """({(mode, shape): fn}, shapes) on shared inputs and preallocated outputs; modes: 1-D positions, full-width
    cos/sin tables and, at D 128, interleaved and contiguous M-RoPE sections."""
    q = torch.randn(T, 1, hq, D, device="cuda", dtype=dtype)
    k = torch.randn(T, 1, hk, D, device="cuda", dtype=dtype)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    ids = torch.randint(0, 8192, (3, T, 1), device="cuda")
    inv = 5e6 ** (-torch.arange(0, D, 2, device="cuda", dtype=torch.float64) / D)
    emb = torch.cat([ids[0, :, :, None] * inv] * 2, -1)
    specs = {"1-d": validate(q, k, positions=ids[0], base=5e6),
             "table": validate(q, k, cos=emb.cos().to(dtype), sin=emb.sin().to(dtype))}
    if D == 128:
        specs["interleaved"] = validate(q, k, positions=ids, sections=(24, 20, 20), section_layout="interleaved",
                                        base=5e6)
        specs["contiguous"] = validate(q, k, positions=ids, sections=(16, 24, 24), base=5e6)
    shapes = _shapes(T, hq, hk, D, q.element_size())
    calls, outs = {}, {}
    for mode, spec in specs.items():
        for name, config in shapes.items():
            calls[mode, name] = fn = functools.partial(launcher.launch_rope, q, k, qo, ko, spec, config=config)
            qo.fill_(float("nan"))
            ko.fill_(float("nan"))
            fn()
            outs[mode, name] = (qo.clone(), ko.clone())
        assert all(torch.equal(a, b) for a, b in zip(outs[mode, "half"], outs[mode, "wide"])), mode
    return calls, shapes


def main(args: argparse.Namespace) -> None:
    import triton
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    for name in args.shapes.split(","):
        hq, hk, D, dtype = SHAPES[name]
        for T in (int(t) for t in args.tokens.split(",")):
            calls, shapes = _calls(T, hq, hk, D, getattr(torch, dtype))
            if shapes["half"] == shapes["wide"]:
                print(f"{name:>11} T={T:<3d} {shapes['wide']}: no smaller shape")
                continue
            replay = graph_us_interleaved(calls, rounds=15)
            device = {key: sum(kernel_us(fn).values()) for key, fn in calls.items()}
            row = "  ".join(f"{mode} {device[mode, 'wide']:.2f}us {device[mode, 'half'] / device[mode, 'wide']:.3f}"
                            f"/{replay[mode, 'half'] / replay[mode, 'wide']:.3f}"
                            for mode in dict.fromkeys(m for m, _ in calls))
            print(f"{name:>11} T={T:<3d} {shapes['wide']} -> {shapes['half']} | {row}", flush=True)


if __name__ == "__main__":
    main(ARGS)
