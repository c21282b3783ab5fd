"""qk_norm_rope's backward launcher alone (the kernel, which also adds up the weight gradients), replayed in a CUDA
graph, at Qwen3-8B's shape (bf16, 32/8 heads, D 128, positions [B, S], inv_freq given), per value of
`heuristics.BWD_PROGRAMS_PER_SM`, over 1.5 copies of q+k (what it reads and writes besides the gradients' rows: the
output gradients, the inputs, dq and dk are three passes over q+k, i.e. 1.5 copies) timed in the same run. Needs a
CUDA GPU.

    python benchmarks/probes/qknorm_bwd.py [--sizes 4x4096,16x4096] [--per-sm 16,8,4,2,1]
"""

import argparse

import torch
import triton

from ropekit._validation import validate
from ropekit.triton import heuristics
from ropekit.triton import prologue_launcher as launcher


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def graphed(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4x4096,16x4096")
    parser.add_argument("--per-sm", default="16,8,4,2,1")
    args = parser.parse_args()
    dev, dt, hq, hk, d = "cuda", torch.bfloat16, 32, 8, 128
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for size in args.sizes.split(","):
        b, s = map(int, size.split("x"))
        q, k = torch.randn(b, s, hq, d, device=dev, dtype=dt), torch.randn(b, s, hk, d, device=dev, dtype=dt)
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        w = torch.rand(d, device=dev, dtype=dt) + 0.5
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
        spec = validate(q, k, positions=torch.arange(s, device=dev)[None].expand(b, s), inv_freq=inv_freq)
        flat = torch.cat([q.flatten(), k.flatten()])
        out = torch.empty_like(flat)
        copy = bench(lambda: out.copy_(flat))
        default = heuristics.BWD_PROGRAMS_PER_SM
        for per_sm in map(int, args.per_sm.split(",")):
            heuristics.BWD_PROGRAMS_PER_SM = per_sm
            t = bench(graphed(lambda: launcher.launch_norm_rope_bwd(gq, q, gk, k, spec, w, w, 0.0, 1e-6)))
            print(f"{size} programs per SM wanted {per_sm:3d}: {t:.1f} us = {t / (1.5 * copy):.3f}x its bytes",
                  flush=True)
        heuristics.BWD_PROGRAMS_PER_SM = default


if __name__ == "__main__":
    main()
