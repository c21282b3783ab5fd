"""Timing shared by the probes: calls captured many times in one graph, graphs replayed in turn
(``ropekit.bench.timing``, which ``ropekit bench`` times its decode rows with too; ``decode_probe.py``,
``decode_floor.py``), each kernel's device time from the profiler, and ``triton.testing.do_bench`` medians of a
call or of one captured call's replay (``qknorm_step.py``, ``qknorm_bwd.py``).

Not a probe itself. The probes run as scripts (``python benchmarks/probes/decode_probe.py``), so Python puts this
folder first on ``sys.path`` and ``from _graphs import ...`` finds this file without any path set-up.
"""

from __future__ import annotations

import torch
import triton

from ropekit.bench.timing import graph_us_interleaved


def do_bench_us(fn) -> float:
    """Median microseconds of ``fn`` by ``triton.testing.do_bench`` (L2 flushed between calls)."""
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def graph_replay(fn):
    """The replay of one call of ``fn`` captured in a CUDA graph (after two warm-up calls on a side stream)."""
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


def graph_us(fn) -> float:
    """Median microseconds per call of ``fn`` captured many times in one graph."""
    return graph_us_interleaved({"fn": fn})["fn"]


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
