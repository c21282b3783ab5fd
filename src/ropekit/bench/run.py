"""The run loop: every mode of a case, baselines first, then ropekit and the peers; one row each."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

import torch

from ropekit.testing import max_relative_error

from .cases import GRAD_MODES, Case
from .impls import (
    BASELINE,
    EXTRA_BASELINES,
    MODE_IMPLS,
    REFERENCE,
    Bench,
    Unsupported,
    build,
    build_baseline,
    forget_compiles,
)
from .inputs import Inputs, attention_flops, bytes_model, make_inputs
from .peers import Peers
from .report import gbps
from .timing import Timer, cycling

MISMATCH = 0.05  # max|out - ropekit| / max|ropekit| above which a row is flagged
# timed under CUDA-graph replay, a mode's implementations in turn
GRAPH_MODES = ("decode", "kv-decode", "mla-decode", "kv-step")
# Input sets the captured calls of a graph mode cycle over (GRAPH_CALLS a multiple of it): where a decode call's
# few-kB buffers lie moves its time by up to 2% (benchmarks/probes/placement_probe.py), so one set per process
# made a ratio of two implementations read a different placement in every run.
GRAPH_INPUT_SETS = 5


def run_case(case: Case, device: torch.device, timer: Timer, peers: Peers, env: dict[str, Any],
             impl_globs: list[str] | None, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every mode of ``case``: baselines first, then ropekit and the peers; one row each. Each implementation is
    built, checked against ropekit's output (the mode's :data:`impls.REFERENCE`, else ``ropekit``), timed and freed
    before the next one (memory stays at the inputs, ropekit's reference output and one implementation). The
    :data:`GRAPH_MODES` (decode sizes, small) keep every implementation until all are checked, then time them
    together, their graphs replayed in turn (:meth:`Timer.graphs`), each graph's calls cycling over
    :data:`GRAPH_INPUT_SETS` input sets (the first is the checked one; all write to its KV caches)."""
    rows: list[dict[str, Any]] = []
    inp = make_inputs(case, device)
    more_inputs: list[Inputs] | None = None  # the graph modes' other input sets, made when first needed
    nbytes = bytes_model(inp)
    forget_compiles()  # each case compiles its torch.compile peers afresh
    for mode in case.modes:
        names = [n for n in MODE_IMPLS[mode] if (case.impls is None or n in case.impls)
                 and (impl_globs is None or any(fnmatch.fnmatch(n, g) for g in impl_globs))]
        order = [(n, True) for n in (BASELINE[mode], *EXTRA_BASELINES.get(mode, ()))] + [(n, False) for n in names]
        mode_rows: list[dict[str, Any]] = []
        times: dict[str, float] = {}
        in_turn: dict[str, tuple[dict[str, Any], Callable[[], Any]]] = {}
        # fwd/decode/host run without autograd, as inference does; fwd+bwd with it. torch.compile warms up in
        # the same grad mode as the calls it times.
        reference = REFERENCE.get(mode, "ropekit")
        with torch.enable_grad() if mode in GRAD_MODES else torch.no_grad():
            refs = None
            if reference in names:
                ref_bench = _try_build(build, reference, inp, mode, peers)
                if isinstance(ref_bench, Bench):
                    got = _try_build(ref_bench.result)
                    refs = tuple(t.detach() for t in got) if isinstance(got, (tuple, list)) else None
                del ref_bench
            for name, is_baseline in order:
                row = _row(env, case, mode, name, nbytes[mode], BASELINE[mode])
                row["impl_version"] = _impl_version(name, peers, env)
                mode_rows.append(row)
                bench = _build(name, is_baseline, inp, mode, peers, nbytes)
                if isinstance(bench, str):
                    row["note"] = bench
                    continue
                row["note"] = bench.note
                if bench.bytes is not None:
                    row["bytes"] = bench.bytes
                try:
                    if refs is not None and bench.result is not None:
                        outs = [t.detach() for t in bench.result()]
                        diff, agree = (0.0, True) if name == reference else _agreement(outs, refs, bench.tolerances)
                        row["max_rel_diff"] = f"{diff:.2e}"
                        if not agree:
                            row["note"] = f"MISMATCH vs {reference}; {row['note']}"
                    if mode in GRAPH_MODES:  # timed below, all of the mode's implementations in turn
                        if more_inputs is None:
                            more_inputs = [make_inputs(case, device, seed, caches_of=inp)
                                           for seed in range(1, GRAPH_INPUT_SETS)]
                        runs = [bench.run] + [_built(_build(name, is_baseline, more, mode, peers, nbytes)).run
                                              for more in more_inputs]
                        for call in runs:  # each set's first call (lazy set-up) before any graph capture
                            call()
                        in_turn[name] = (row, cycling(runs))
                        continue
                    _record(row, times, name, _time(timer, mode, bench.run))
                except Exception as exc:  # noqa: BLE001 - one failing implementation must not stop the run
                    row["note"] = f"failed: {_first_line(exc)}; {row['note']}"
                    continue
                finally:
                    del bench
                    _recover(device)
            del refs
            if in_turn:
                timed = timer.graphs({name: run for name, (_, run) in in_turn.items()})
                for name, (row, _) in in_turn.items():
                    if isinstance(timed[name], Exception):
                        row["note"] = f"failed: {_first_line(timed[name])}; {row['note']}"
                    else:
                        _record(row, times, name, timed[name])
                del in_turn, timed
                _recover(device)
        base = times.get(BASELINE[mode])
        for row in mode_rows:
            if row["impl"] in times and base:
                row["ratio_vs_copy"] = f"{times[row['impl']] / base:.4f}"
            if device.type != "cuda" and mode in GRAPH_MODES:
                row["note"] = "; ".join(x for x in ("eager (no CUDA graph on CPU)", row["note"]) if x)
        rows += mode_rows
        log(f"  {mode:7s} " + ", ".join(f"{n} {t:.1f}" for n, t in times.items()) + " (us)")
    return rows


def _agreement(outs: list[torch.Tensor], refs: tuple[torch.Tensor, ...],
               tolerances: tuple[float | None, ...] | None) -> tuple[float, bool]:
    """The worst max_rel_diff over the outputs, and whether each is within its tolerance (default
    :data:`MISMATCH`)."""
    if len(outs) != len(refs):
        raise ValueError(f"{len(outs)} outputs against {len(refs)} of the reference")
    diffs = [max_relative_error(o, r) for o, r in zip(outs, refs)]
    limits = tolerances or (None,) * len(diffs)
    agree = all(d <= (MISMATCH if lim is None else lim) for d, lim in zip(diffs, limits, strict=True))
    return max(diffs, default=0.0), agree


def _impl_version(name: str, peers: Peers, env: dict[str, Any]) -> str:
    if name.startswith("ropekit"):
        return f"ropekit {env['ropekit']}"
    if name.startswith("rope+"):  # ropekit.apply_rope, then torch's attention
        return f"ropekit {env['ropekit']} + " + _impl_version(name.removeprefix("rope+"), peers, env)
    if name == "sdpa-cudnn" and not env["gpu"].startswith("none") and torch.backends.cudnn.is_available():
        return f"torch {env['torch']}, cuDNN {torch.backends.cudnn.version()}"
    if name.startswith("unfused"):  # the prologue's PyTorch code (around ropekit.apply_rope for unfused-kv)
        return f"torch {env['torch']}"
    if name in ("copy-kv", "copy-mla"):
        return f"triton {env['triton']}"
    if name in ("hf", "hf-compile", "hf-first-layer"):
        return f"transformers {peers.versions.get('transformers', '')}".strip()
    if name in ("liger", "flash-attn", "helion"):
        return peers.versions.get(name, "")
    return f"torch {env['torch']}" if name != "triton-launch" else f"triton {env['triton']}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def _try_build(make: Callable[..., Any], *args: Any) -> Any:
    """``make(*args)``, or a string saying why not."""
    try:
        return make(*args)
    except Unsupported as exc:
        return f"skipped: {exc}"
    except Exception as exc:  # noqa: BLE001
        return f"failed: {_first_line(exc)}"


def _build(name: str, is_baseline: bool, inp: Inputs, mode: str, peers: Peers, nbytes: dict[str, int]) -> Any:
    """The :class:`Bench` of baseline or implementation ``name`` on ``inp``, or a string saying why not."""
    if is_baseline:
        return _try_build(build_baseline, name, inp, nbytes, mode)
    return _try_build(build, name, inp, mode, peers)


def _built(bench: Any) -> Bench:
    """``bench``, which built on the first input set, so a string here (it failed on another set) is an error."""
    if isinstance(bench, str):
        raise RuntimeError(f"on another input set: {bench}")
    return bench


def _time(timer: Timer, mode: str, fn: Callable[[], Any]) -> float:
    return timer.host(fn) if mode == "host" else timer.kernel(fn)


def _record(row: dict[str, Any], times: dict[str, float], name: str, us: float) -> None:
    times[name] = us
    row["median_us"] = f"{us:.3f}"
    row["gbps"] = gbps(row)  # from the rounded time, as the history's reader forms it
    if row["flops"]:  # the attention modes: flops / (us * 1e-6) / 1e12
        row["tflops"] = f"{int(row['flops']) / us / 1e6:.4g}"


def _recover(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _row(env: dict[str, Any], case: Case, mode: str, impl: str, nbytes: int, baseline: str) -> dict[str, Any]:
    return {
        "gpu": env["gpu"], "date": env["date"], "torch": env["torch"], "triton": env["triton"],
        "ropekit": env["ropekit"], "commit": env["commit"], "case": case.name, "mode": mode, "impl": impl,
        "tokens": case.tokens, "bytes": nbytes, "median_us": "", "gbps": "",
        "flops": attention_flops(case).get(mode, ""), "tflops": "", "ratio_vs_copy": "",
        "baseline": baseline, "model": case.model, "dtype": case.dtype, "style": case.style,
        "positions": case.positions, "batch": case.batch, "seqlen": case.seqlen, "hq": case.hq, "hk": case.hk,
        "head_dim": case.head_dim, "rotary_dim": case.rotary_dim, "rotary_at": case.rotary_at,
        "max_rel_diff": "", "label": env["label"], "note": "", "impl_version": "", "series": case.series,
    }
