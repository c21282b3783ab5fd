"""Timers: ``do_bench`` (cold L2), ``do_bench_cudagraph`` and host time per eager call on CUDA; ``timeit`` on CPU."""

from __future__ import annotations

import dataclasses
import statistics
import time
import timeit
from collections.abc import Callable
from typing import Any

import torch

from ._triton import triton_testing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Timer:
    """Medians in microseconds. CUDA: ``do_bench`` (cold L2) and ``do_bench_cudagraph``; CPU: ``timeit``."""

    device: torch.device
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    graph_rep_ms: float = 50.0
    host_rounds: int = 7
    host_round_s: float = 0.05
    host_warm_calls: int = 20

    def kernel(self, fn: Callable[[], Any]) -> float:
        if self.device.type == "cuda":
            return 1e3 * triton_testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")
        return self._cpu(fn)

    def graph(self, fn: Callable[[], Any]) -> float:
        if self.device.type == "cuda":
            return 1e3 * triton_testing.do_bench_cudagraph(fn, rep=self.graph_rep_ms, return_mode="median")
        return self._cpu(fn)

    def host(self, fn: Callable[[], Any]) -> float:
        """Host time per eager call: many calls, no sync inside the loop, a sync between rounds (untimed)."""
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else (lambda: None)
        n = self.host_warm_calls
        for _ in range(n):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per_call = max((time.perf_counter() - t0) / n, 1e-7)
        sync()
        number = int(min(5000, max(1, self.host_round_s / per_call)))
        rounds = timeit.Timer(fn, setup=sync).repeat(repeat=self.host_rounds, number=number)
        sync()
        return 1e6 * statistics.median(rounds) / number

    def _cpu(self, fn: Callable[[], Any]) -> float:
        """CPU smoke timing: a warm call, then the median of three."""
        fn()
        return 1e6 * statistics.median(timeit.Timer(fn).repeat(repeat=3, number=1))
