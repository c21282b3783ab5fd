"""CUDA-graph timing shared by the decode probes (``decode_probe.py``, ``decode_floor.py``): calls captured many
times in one graph, graphs replayed in turn, and each kernel's device time from the profiler.

Not a probe itself. The probes run as scripts (``python benchmarks/probes/decode_probe.py``), so Python puts this
folder first on ``sys.path`` and ``from _graphs import ...`` finds this file without any path set-up.
"""

from __future__ import annotations

import torch

CALLS_PER_GRAPH = 50


def _capture(fn) -> torch.cuda.CUDAGraph:
    """A graph of CALLS_PER_GRAPH calls of ``fn`` (warmed up on a side stream first)."""
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
    return graph


def graph_us_interleaved(fns: dict, rounds: int = 31, replays: int = 10) -> dict:
    """Median microseconds per call of each ``fns`` entry, each captured CALLS_PER_GRAPH times in one graph.

    The graphs are replayed in turn, round after round, so that clock or cache drift over the run spreads over
    every variant instead of favouring the ones timed first."""
    graphs = {name: _capture(fn) for name, fn in fns.items()}
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / replays / CALLS_PER_GRAPH)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def graph_us(fn) -> float:
    """Median microseconds per call of ``fn`` captured CALLS_PER_GRAPH times in one graph."""
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
