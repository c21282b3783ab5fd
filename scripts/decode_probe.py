"""Decode latency probe on a CUDA GPU: one q+k rotation per call, replayed from a CUDA graph, at several block
configurations, against a copy of q replayed the same way; plus each kernel's own duration from the profiler.

Separates what a decode call costs into the kernel's execution (profiler duration) and the per-node cost of a
graph replay, for the Llama-3-8B shape (32/8 heads, D 128, bf16, one token per sequence, per-sequence offsets).

    python scripts/decode_probe.py [--tokens 1,16,64]
"""

from __future__ import annotations

import argparse

import torch

from ropekit.api import _normalise
from ropekit.triton.launcher import _num_programs_wanted, block_config, launch_rope

CALLS_PER_GRAPH = 50


def graph_us(fn, replays: int = 200) -> float:
    """Median microseconds per call of ``fn`` captured CALLS_PER_GRAPH times in one graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    times = []
    for _ in range(21):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays // 20):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays // 20) / CALLS_PER_GRAPH)
    return sorted(times)[len(times) // 2]


def kernel_us(fn) -> dict[str, float]:
    """Average device time per launch of each kernel ``fn`` runs, from the profiler."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.count:
            out[e.key[:40]] = e.self_device_time_total / e.count
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,16,64")
    parser.add_argument("--dump", help="write the PTX of every compiled rope_kernel specialisation into this folder")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'tokens':>6} {'variant':<34} {'graph us':>9} {'x copy-q':>8} {'kernel us':>10}")
    for T in (int(t) for t in args.tokens.split(",")):
        q = torch.randn(T, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(T, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        offsets = torch.randint(0, 8192, (T,), device="cuda")
        emb = torch.randn(T, 1, 128, device="cuda", dtype=torch.bfloat16)
        variants = {"copy-q": lambda: qo.copy_(q)}
        default = block_config(T, 32, 8, 128, 2, _num_programs_wanted(q.device))
        for label, kwargs in (("exact", dict(positions=offsets)), ("hf table", dict(cos=emb, sin=emb))):
            n = _normalise(q, k, **kwargs)
            launch_kw = n.launch_kwargs()
            configs = {f"default {default}": None}
            for bt, bh, bk, nw in ((1, 32, 8, 4), (1, 32, 8, 2), (1, 16, 8, 2), (1, 8, 8, 1), (1, 4, 4, 1),
                                   (2, 32, 8, 4), (4, 32, 8, 4)):
                if bt <= max(T, 1):
                    configs[f"T{bt} H{bh}/{bk} w{nw}"] = (bt, bh, bk, nw)
            for label_cfg, cfg in configs.items():
                variants[f"{label} {label_cfg}"] = (lambda kw=launch_kw, c=cfg: launch_rope(q, k, qo, ko, **kw,
                                                                                           config=c))
        base = None
        for name, fn in variants.items():
            g = graph_us(fn)
            base = base or g
            kern = kernel_us(fn)
            kern_s = ", ".join(f"{v:.2f}" for v in kern.values())
            print(f"{T:>6} {name:<34} {g:>9.2f} {g / base:>8.2f} {kern_s:>10}")
    if args.dump:
        import os

        from ropekit.triton.launcher import _COMPILED

        os.makedirs(args.dump, exist_ok=True)
        for i, (key, compiled) in enumerate(_COMPILED.items()):
            with open(os.path.join(args.dump, f"rope_kernel_{i}.ptx"), "w") as f:
                f.write(f"// constexprs, num_warps: {key[-3:]}\n" + compiled.asm["ptx"])


if __name__ == "__main__":
    main()
