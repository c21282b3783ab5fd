"""qk_norm_rope's forward (per-head RMSNorm + NeoX RoPE of q and k) against the Helion peer kernel of
``ropekit.bench.helion_peers`` and a copy of the same bytes, at Qwen3-8B's shape (bf16, 32/8 heads, D 128):
prefill sizes cold (do_bench) and decode sizes (one token per sequence) replayed from a CUDA graph. The Helion
kernel takes per-token cos/sin tables gathered before timing (as the bench's table peers do); ropekit computes
exact angles from the positions. Needs a CUDA GPU and helion.

    python benchmarks/probes/helion_norm.py
"""

import argparse

import torch
import triton

import ropekit


def cold(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3


def replayed(fn, calls: int = 20) -> float:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median") * 1e3 / calls


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    from ropekit.bench.helion_peers import helion_qk_norm_rope  # helion is optional: imported past --help
    dev, dt, hq, hk, d = "cuda", torch.bfloat16, 32, 8, 128
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float64) / d))
    inv_freq32 = inv_freq.float()  # ropekit's frequencies, made once (a cast per call would be timed)
    for b, s in ((1, 1), (16, 1), (64, 1), (256, 1), (1, 2048), (1, 8192), (4, 4096), (16, 4096)):
        q = torch.randn(b, s, hq, d, device=dev, dtype=dt)
        k = torch.randn(b, s, hk, d, device=dev, dtype=dt)
        wq, wk = torch.rand(d, device=dev, dtype=dt) + 0.5, torch.rand(d, device=dev, dtype=dt) + 0.5
        pos = torch.randint(0, 4096, (b, 1), device=dev) + torch.arange(s, device=dev)
        angle = pos.reshape(-1, 1).double() * inv_freq
        cos, sin = angle.cos().float(), angle.sin().float()
        flat = torch.cat([q.flatten(), k.flatten()])
        out = torch.empty_like(flat)
        fns = {"copy": lambda: out.copy_(flat),
               "ropekit": lambda: ropekit.qk_norm_rope(q, k, wq, wk, positions=pos, inv_freq=inv_freq32),
               "helion": lambda: helion_qk_norm_rope(q, k, wq, wk, cos, sin, 1e-6)}
        ref = fns["ropekit"]()
        got = fns["helion"]()
        err = max((a.float() - r.float()).abs().max().item() for a, r in zip(got, ref))
        time = replayed if s == 1 else cold
        t = {n: time(f) for n, f in fns.items()}
        print(f"{b}x{s} ({'graph replay' if s == 1 else 'cold L2'}): copy {t['copy']:.2f} us; ropekit "
              f"{t['ropekit']:.2f} us ({t['ropekit'] / t['copy']:.3f}x); helion {t['helion']:.2f} us "
              f"({t['helion'] / t['copy']:.3f}x); helion/ropekit {t['helion'] / t['ropekit']:.3f}; "
              f"max |diff| {err:.3g}", flush=True)


if __name__ == "__main__":
    main()
