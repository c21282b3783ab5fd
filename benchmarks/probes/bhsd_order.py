"""apply_rope's forward on contiguous head-major (bhsd) q/k at Llama-3-8B's shape (bf16, 32/8 heads, D 128): the
kernel with the grid's token blocks first (TOKENS_FIRST, what the launcher picks for head-major inputs on large
grids) against the same kernel with head blocks first, and the public call, each over a copy of the same bytes
(cold L2, best of two rounds); token-major (bshd) for reference. The two orders are checked bit for bit.
``same-grid copy``: the kernel's own grid, block shape, token block, addresses, loads and stores with no position,
angle or rotation (y = x), which tells what the access pattern costs from what the arithmetic does. Needs a CUDA
GPU.

    python benchmarks/probes/bhsd_order.py [--configs 16:1:1:4,32:2:2:4]

``--configs BT:BHQ:BHK:WARPS,...`` also times ``launch_rope`` at those block shapes on the head-major sizes (the grid
order the launcher picks for each: tokens first where there are enough token blocks).
"""

import argparse

import torch
import triton
from _copies import same_grid_copy_kernel

import ropekit
from ropekit._validation import validate
from ropekit.triton import runtime
from ropekit.triton.launcher import ROPE, launch_rope, rope_arguments

SIZES = ((1, 2048, "bhsd"), (1, 8192, "bhsd"), (1, 16384, "bhsd"), (1, 32768, "bhsd"), (4, 4096, "bhsd"),
         (8, 4096, "bhsd"), (1, 16384, "bshd"))


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3


def same_grid_copy(q, k, q_out, k_out, spec):
    """q -> q_out, k -> k_out through :func:`_copies.same_grid_copy_kernel` on the grid and block shape that
    ``launch_rope`` takes for these tensors."""
    grid, _, constexprs, num_warps = rope_arguments(q, k, q_out, k_out, spec)
    layout = spec.layout
    qc, kc = (x.permute(0, 2, 1, 3) if layout == "bhsd" else x for x in (q, k))  # canonical [B, S, H, D] views
    qoc, koc = (x.permute(0, 2, 1, 3) if layout == "bhsd" else x for x in (q_out, k_out))
    B, S, HQ, D = qc.shape
    fn = same_grid_copy_kernel[grid]
    return lambda: fn(qc, qoc, kc, koc, *qc.stride()[:3], *kc.stride()[:3], HQ, kc.shape[2], S, B * S, D=D,
                      BLOCK_T=constexprs["BLOCK_T"], BLOCK_HQ=constexprs["BLOCK_HQ"],
                      BLOCK_HK=constexprs["BLOCK_HK"], TOKENS_FIRST=constexprs["TOKENS_FIRST"], num_warps=num_warps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="", help="block shapes BT:BHQ:BHK:WARPS, comma-separated")
    args = parser.parse_args()
    configs = [tuple(map(int, c.split(":"))) for c in args.configs.split(",") if c]
    dev, dt, hq, hk, d = "cuda", torch.bfloat16, 32, 8, 128
    inv_freq = 1.0 / (5e5 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for b, s, layout in SIZES:
        shape = (lambda h: (b, h, s, d)) if layout == "bhsd" else (lambda h: (b, s, h, d))
        q = torch.randn(shape(hq), device=dev, dtype=dt)
        k = torch.randn(shape(hk), device=dev, dtype=dt)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        flat = torch.cat([q.flatten(), k.flatten()])
        out = torch.empty_like(flat)
        spec = validate(q, k, positions=None, inv_freq=inv_freq, layout=layout)
        heads_first = rope_arguments(q, k, q_out, k_out, spec, tokens_first_ok=False)
        fns = {"copy": lambda: out.copy_(flat),
               "heads-first": lambda: runtime.launch(ROPE, *heads_first, q.device),
               "tokens-first": lambda: launch_rope(q, k, q_out, k_out, spec),
               "same-grid copy": same_grid_copy(q, k, q_out, k_out, spec),
               "apply_rope": lambda: ropekit.apply_rope(q, k, inv_freq=inv_freq, layout=layout)}
        for c in configs if layout == "bhsd" else ():
            launch = rope_arguments(q, k, q_out, k_out, spec, config=c, tokens_first_ok=True)
            order = "T" if launch[2]["TOKENS_FIRST"] else "H"
            fns[f"{order}{c}"] = lambda c=c: launch_rope(q, k, q_out, k_out, spec, config=c)
        fns["same-grid copy"]()
        assert torch.equal(q_out, q) and torch.equal(k_out, k), "the same-grid copy is not a copy"
        fns["tokens-first"]()
        first = q_out.clone()
        fns["heads-first"]()
        assert torch.equal(first, q_out), "the two grid orders disagree"
        times = {name: min(bench(fn) for _ in range(2)) for name, fn in fns.items()}
        print(f"{layout} {b}x{s}: copy {times['copy']:.1f} us; "
              + "; ".join(f"{n} {t / times['copy']:.3f}x" for n, t in times.items() if n != "copy"), flush=True)


if __name__ == "__main__":
    main()
