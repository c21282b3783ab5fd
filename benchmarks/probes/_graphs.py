"""Timing shared by the probes: calls captured many times in one graph, graphs replayed in turn
(``ropekit.bench.timing``, which ``ropekit bench`` times its decode rows with too; ``decode_probe.py``,
``decode_floor.py``) and each kernel's device time from the profiler.

Not a probe itself. The probes run as scripts (``python benchmarks/probes/decode_probe.py``), so Python puts this
folder first on ``sys.path`` and ``from _graphs import ...`` finds this file without any path set-up.
"""

from __future__ import annotations

import torch

from ropekit.bench.timing import graph_us_interleaved


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
