"""One training step of the attention prologue's norm: qk_norm_rope fwd+bwd (and apply_rope's, and autograd of
q * 2) at Qwen3-8B's shape (bf16, 32/8 heads, D 128, positions [B, S], inv_freq given, weights with grad).

Per size and function: the step through `torch.autograd.backward` into leaf gradients that accumulate (what a probe
on leaf tensors times), with the gradients set to None first, and through `torch.autograd.grad` (what the bench
times); the `autograd.grad` step captured in one CUDA graph (the kernels without the host); and the host time to
enqueue one eager step (median of 50, synchronised between steps). Ratios over the ideal bytes: 2.5 copies of q+k
for qk_norm_rope, 2 for apply_rope, from a copy timed in the same run. Needs a CUDA GPU.

    python benchmarks/probes/qknorm_step.py [--sizes 2x4096,4x4096,8x4096,16x4096]
"""

import argparse
import time

import torch
import triton
from _graphs import do_bench_us, graph_replay

import ropekit


def host_us(fn) -> float:
    times = []
    for _ in range(50):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return sorted(times)[25] * 1e6



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2x4096,4x4096,8x4096,16x4096")
    args = parser.parse_args()
    dev, dt, hq, hk, d = "cuda", torch.bfloat16, 32, 8, 128
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for size in args.sizes.split(","):
        b, s = map(int, size.split("x"))
        q = torch.randn(b, s, hq, d, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(b, s, hk, d, device=dev, dtype=dt, requires_grad=True)
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        wq = (torch.rand(d, device=dev, dtype=dt) + 0.5).requires_grad_()
        wk = (torch.rand(d, device=dev, dtype=dt) + 0.5).requires_grad_()
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
        pos = torch.arange(s, device=dev)[None].expand(b, s)
        flat = torch.cat([q.detach().flatten(), k.detach().flatten()])
        out = torch.empty_like(flat)
        copy = do_bench_us(lambda: out.copy_(flat))
        fns = {"qk_norm_rope": (lambda: ropekit.qk_norm_rope(q, k, wq, wk, positions=pos, inv_freq=inv_freq),
                                (q, k, wq, wk), 2.5),
               "apply_rope": (lambda: ropekit.apply_rope(q, k, positions=pos, inv_freq=inv_freq), (q, k), 2.0)}
        for name, (forward, leaves, copies) in fns.items():
            ideal = copies * copy

            def accumulating():
                torch.autograd.backward(forward(), (gq, gk))

            def fresh():
                for t in leaves:
                    t.grad = None
                torch.autograd.backward(forward(), (gq, gk))

            def grad():
                return torch.autograd.grad(forward(), leaves, (gq, gk))

            row = {"backward() accumulating": do_bench_us(accumulating), "backward() fresh": do_bench_us(fresh),
                   "autograd.grad": do_bench_us(grad), "graph": do_bench_us(graph_replay(grad))}
            for t in leaves:
                t.grad = None
            print(f"{size} {name:13s} " + "  ".join(f"{k} {v / ideal:.3f}x" for k, v in row.items())
                  + f"  host {host_us(grad):.0f} us/step  (ideal {ideal:.1f} us)", flush=True)
        scalar = lambda: torch.autograd.grad(q * 2, (q,), gq)  # noqa: E731 -- the least an autograd step costs
        print(f"{size} autograd.grad(q * 2) host {host_us(scalar):.0f} us/step", flush=True)


if __name__ == "__main__":
    main()
