"""M-RoPE cost probe on a CUDA GPU: the multi-axis call against the same call with 1-D positions, at Qwen2-VL-7B's
shape (28/4 heads, D 128, bf16; sections 16/24/24 unless ``--sections`` says otherwise), decode under CUDA-graph
replay (with each kernel's device time from the profiler) and forward with a cold L2.

Both go through the raw launcher with preallocated outputs, so the ratio is the kernel's alone (the bench's
``mrope-*`` targets measure the public call). Backs the way ``kernel._pair_positions`` reads each pair's
position.

    python benchmarks/probes/mrope_probe.py [--tokens 1,16,64,256] [--prefill 1x4096,2x4096,8x4096]
        [--layout interleaved --sections 24,20,20] [--positions axis-major,token-major,wide]

``--positions`` times the same decode call with the same position values stored up to four ways: ``axis-major`` (a
contiguous [3, B, S] tensor, as the default), ``token-major`` (a [B, S, 3] buffer viewed as [3, B, S]: a token's
positions side by side), ``token-major-strided`` (the same with a gap after each position: an axis stride of 2) and
``wide`` (the first B*S columns of a persistent [3, 4096] buffer, as a serving engine keeps them). The kernel is the
same; only where the three positions of a token lie changes.
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
    parser.add_argument("--positions", default="axis-major",
                        help="comma-separated storage of the decode positions: axis-major, token-major, "
                             "token-major-strided, wide")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help exits here

import torch
import triton.testing
from _graphs import graph_us_interleaved, kernel_us

from ropekit._validation import validate
from ropekit.triton.launcher import launch_rope


def _stored(ids: torch.Tensor, storage: str) -> torch.Tensor:
    """``ids`` [3, B, S], the same values stored as ``storage`` says (see the module docstring)."""
    if storage == "axis-major":
        return ids
    if storage == "token-major":
        return ids.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    if storage == "token-major-strided":  # the same neighbourhood, axis stride 2: not a compile-time constant
        buffer = torch.zeros(*ids.shape[1:], ids.shape[0], 2, dtype=ids.dtype, device=ids.device)
        buffer[..., 0] = ids.permute(1, 2, 0)
        return buffer[..., 0].permute(2, 0, 1)
    if storage == "wide":
        A, B, S = ids.shape
        buffer = torch.zeros(A, max(4096, B * S), dtype=ids.dtype, device=ids.device)
        buffer[:, :B * S] = ids.reshape(A, B * S)
        return buffer[:, :B * S].view(A, B, S)
    raise SystemExit(f"--positions: unknown storage {storage!r} (axis-major, token-major, token-major-strided, "
                     "wide)")


def _calls(B: int, S: int, HQ: int, HK: int, layout: str, sections: tuple, storages=("axis-major",)) -> dict:
    """{"1-d": fn, "mrope <storage>": fn, ...}: the raw launch of each, on shared inputs and preallocated outputs.
    Every storage of the positions gives the same output bits (checked here)."""
    q = torch.randn(B, S, HQ, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, HK, 128, device="cuda", dtype=torch.bfloat16)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    ids = torch.randint(0, 8192, (3, B, S), device="cuda")
    specs = {"1-d": validate(q, k, positions=ids[0], base=1e6)}
    for storage in storages:
        specs[f"mrope {storage}"] = validate(q, k, positions=_stored(ids, storage), sections=sections,
                                             section_layout=layout, base=1e6)
    calls = {name: (lambda s=spec: launch_rope(q, k, qo, ko, s)) for name, spec in specs.items()}
    outputs = []
    for name in specs:
        if name != "1-d":
            qo.fill_(float("nan"))
            calls[name]()
            outputs.append(qo.clone())
    assert all(torch.equal(o, outputs[0]) for o in outputs), "the storages of the positions disagree"
    return calls


def main(args: argparse.Namespace) -> None:
    HQ, HK = (int(h) for h in args.heads.split(":"))
    sections = tuple(int(n) for n in args.sections.split(","))
    storages = tuple(args.positions.split(","))
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"{args.layout} sections {args.sections}  {args.label}")
    print(f"{'shape':>10} {'mode':>7} {'positions':>11} {'1-d us':>8} {'mrope us':>9} {'ratio':>6}   "
          "kernel device us 1-d / mrope")
    for T in (int(t) for t in args.tokens.split(",")):
        calls = _calls(T, 1, HQ, HK, args.layout, sections, storages)
        timed = graph_us_interleaved(calls)
        device = {name: sum(kernel_us(fn).values()) for name, fn in calls.items()}
        one_d = timed["1-d"]
        for storage in storages:
            name = f"mrope {storage}"
            print(f"{T:>10} {'decode':>7} {storage:>11} {one_d:>8.2f} {timed[name]:>9.2f} "
                  f"{timed[name] / one_d:>6.3f}   {device['1-d']:.2f} / {device[name]:.2f} "
                  f"({device[name] / device['1-d']:.3f})")
    for shape in filter(None, args.prefill.split(",")):
        B, S = (int(x) for x in shape.split("x"))
        calls = _calls(B, S, HQ, HK, args.layout, sections)
        best = {name: [] for name in calls}
        for _ in range(3):  # interleaved rounds, best of each
            for name, fn in calls.items():
                best[name].append(triton.testing.do_bench(fn, rep=200))
        t1, tm = min(best["1-d"]) * 1e3, min(best["mrope axis-major"]) * 1e3
        print(f"{shape:>10} {'fwd':>7} {'axis-major':>11} {t1:>8.1f} {tm:>9.1f} {tm / t1:>6.3f}")


if __name__ == "__main__":
    main(ARGS)
