"""apply_rope's forward on contiguous head-major (bhsd) q/k at Llama-3-8B's shape (bf16, 32/8 heads, D 128): the
kernel with the grid's token blocks first (TOKENS_FIRST, what the launcher picks for head-major inputs on large
grids) against the same kernel with head blocks first, and the public call, each over a copy of the same bytes
(cold L2, best of two rounds); token-major (bshd) for reference. The two orders are checked bit for bit. Needs a
CUDA GPU.

    python benchmarks/probes/bhsd_order.py
"""

import argparse

import torch
import triton

import ropekit
from ropekit._validation import validate
from ropekit.triton import runtime
from ropekit.triton.launcher import ROPE, launch_rope, rope_arguments

SIZES = ((1, 2048, "bhsd"), (1, 8192, "bhsd"), (1, 16384, "bhsd"), (1, 32768, "bhsd"), (4, 4096, "bhsd"),
         (8, 4096, "bhsd"), (1, 16384, "bshd"))


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
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
               "apply_rope": lambda: ropekit.apply_rope(q, k, inv_freq=inv_freq, layout=layout)}
        fns["tokens-first"]()
        first = q_out.clone()
        fns["heads-first"]()
        assert torch.equal(first, q_out), "the two grid orders disagree"
        times = {name: min(bench(fn) for _ in range(2)) for name, fn in fns.items()}
        print(f"{layout} {b}x{s}: copy {times['copy']:.1f} us; "
              + "; ".join(f"{n} {t / times['copy']:.3f}x" for n, t in times.items() if n != "copy"), flush=True)


if __name__ == "__main__":
    main()
