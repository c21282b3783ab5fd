"""Timers: ``do_bench`` (cold L2), CUDA-graph replay (several implementations in turn) and host time per eager call
on CUDA; ``timeit`` on CPU (the smoke run), and the median of calls taken in turn (:func:`interleaved_median_us`) for
the CPU measurement."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
import timeit
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._triton import triton_testing

GRAPH_CALLS = 50  # calls captured in one graph: replaying it shrinks the launch gaps between them


def capture_graph(fn: Callable[[], Any], calls: int = GRAPH_CALLS, pool: Any = None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn``, warmed up on a side stream first (as capture requires).

    ``pool`` (``torch.cuda.graph_pool_handle()``) is a memory pool shared with the graphs captured beside it: what a
    call allocates is dead once it returns, so every graph's calls write their outputs to the same blocks, and two
    graphs compared by their times do not differ in where their outputs lie (which moves a decode call's time by
    up to 2%, ``benchmarks/probes/placement_probe.py``). Safe only for graphs none of which reads what another
    wrote and whose calls keep nothing they allocate during the capture (lazy set-up runs before it: the bench
    calls every input set once first), as here."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        for _ in range(calls):
            fn()
    return graph


def cycling(fns: list[Callable[[], Any]]) -> Callable[[], Any]:
    """One call that runs the next of ``fns`` each time: the calls captured in a graph cycle over them (input sets
    at other addresses, so that a time is not that of one placement)."""
    turn = itertools.cycle(fns)
    return lambda: next(turn)()


def graph_us_interleaved(fns: dict[str, Callable[[], Any]], rounds: int = 31, replays: int = 10,
                         calls: int = GRAPH_CALLS) -> dict[str, float]:
    """Median microseconds per call of each ``fns`` entry, each captured ``calls`` times in one graph (the graphs
    share one memory pool, :func:`capture_graph`).

    The graphs are replayed in turn, round after round, so that clock or cache drift over the run spreads over
    every entry instead of favouring the ones timed first."""
    pool = torch.cuda.graph_pool_handle()
    graphs = {name: capture_graph(fn, calls, pool) for name, fn in fns.items()}
    return _replay_in_turn(graphs, rounds, replays, calls)


# GPU clock cycles a sleep kernel holds the GPU before each timed interval (about 0.3 ms at H100 clocks): long
# enough for the host to queue the start event and the first replay behind it.
HOLD_CYCLES = 1 << 19


def _replay_in_turn(graphs: dict[str, torch.cuda.CUDAGraph], rounds: int, replays: int,
                    calls: int) -> dict[str, float]:
    """Median microseconds per call of each graph, ``replays`` replays of each timed in turn, ``rounds`` times.

    Each interval starts on a busy GPU: a sleep kernel ahead of the start event holds it while the host queues the
    replays, so the host's launch of the first replay (which differs between graphs) stays out of the interval.
    Odd rounds go through the graphs in reverse order, so that no graph always follows the same one."""
    names = list(graphs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(HOLD_CYCLES)
            start.record()
            for _ in range(replays):
                graphs[name].replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / replays / calls)
    return {name: statistics.median(times[name]) for name in names}


def interleaved_median_us(fns: Sequence[Callable[[], Any]], *, warmup: int, min_calls: int,
                          budget_s: float) -> list[float]:
    """Median time of one call of each of ``fns`` in microseconds: ``warmup`` untimed calls of each, then rounds
    of one timed call of each (so that a change in the machine's load reaches every function alike), at least
    ``min_calls`` rounds and more while ``budget_s`` lasts."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    deadline = time.perf_counter() + budget_s
    while len(times[0]) < min_calls or time.perf_counter() < deadline:
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) * 1e6 for spent in times]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Timer:
    """Medians in microseconds. CUDA: ``do_bench`` (cold L2) and graph replay in turn (:meth:`graphs`); CPU:
    ``timeit`` (the smoke run), and calls in turn for the CPU measurement (:meth:`interleaved`)."""

    device: torch.device
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    graph_rounds: int = 31
    graph_replays: int = 10
    host_rounds: int = 7
    host_round_s: float = 0.05
    host_warm_calls: int = 20
    interleaved_warmup: int = 5
    interleaved_min_calls: int = 5
    interleaved_budget_s: float = 0.5

    def interleaved(self, fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
        """Microseconds per call of each entry, the entries called in turn (:func:`interleaved_median_us`) for
        ``interleaved_budget_s`` seconds after ``interleaved_warmup`` calls each: host-side work, no device sync."""
        times = interleaved_median_us(list(fns.values()), warmup=self.interleaved_warmup,
                                      min_calls=self.interleaved_min_calls, budget_s=self.interleaved_budget_s)
        return dict(zip(fns, times))

    def kernel(self, fn: Callable[[], Any]) -> float:
        if self.device.type == "cuda":
            return 1e3 * triton_testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")
        return self._cpu(fn)

    def graphs(self, fns: dict[str, Callable[[], Any]]) -> dict[str, float | Exception]:
        """Microseconds per call of each entry under CUDA-graph replay, the graphs (one memory pool) replayed in
        turn (:func:`graph_us_interleaved`): timed one after another, the same kernel called three ways in one decode
        case read up to 5% apart, more than the differences the decode targets judge. An entry whose capture
        fails gets its exception instead; the others are still timed. CPU: :meth:`_cpu` each."""
        out: dict[str, float | Exception] = {}
        graphs = {}
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        for name, fn in fns.items():
            try:
                if self.device.type == "cuda":
                    graphs[name] = capture_graph(fn, GRAPH_CALLS, pool)
                else:
                    out[name] = self._cpu(fn)
            except Exception as exc:  # noqa: BLE001 - one failing implementation must not stop the others
                out[name] = exc
        if graphs:
            out.update(_replay_in_turn(graphs, self.graph_rounds, self.graph_replays, GRAPH_CALLS))
        return {name: out[name] for name in fns}

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
