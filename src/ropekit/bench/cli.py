"""``ropekit bench``'s command line: options, the run over the selected cases, and ``--from-json`` merges."""

from __future__ import annotations

import argparse
import datetime as _dt
import fnmatch
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .cases import CPU_MODE, MODES, Case, RegistryNotFound, expand_preset, load_registry, select_cases
from .compare import compare, run_base
from .env import SMOKE_LABEL, _interpreting, environment
from .impls import MODE_IMPLS
from .inputs import case_bytes
from .peers import Peers, load_peers
from .plots import plot_results
from .prologue import FP8_MISMATCH
from .report import append_history, format_table, skip_notes, write_results
from .run import MISMATCH, _recover, run_case
from .targets import evaluate_targets, targets_from_registry
from .timing import Timer

NO_CUDA_MESSAGE = ("ropekit bench: benchmarks need a CUDA GPU, and torch sees none here. To smoke-test the harness "
                   "on CPU instead (timings are not performance figures): ropekit bench --preset smoke "
                   "(or --device cpu)")


def _warm_up(case: Case, device: torch.device, timer: Timer, peers: Peers, env: dict[str, Any],
             impl_globs: list[str] | None) -> None:
    """One pass of ``case`` on a GPU whose rows are dropped: the first case of a run read up to 1.4x what the same
    shape read later in the run (ropekit decode over a copy of q, H100), so the recorded rows start warm."""
    if device.type != "cuda":
        return
    print(f"warm-up: {case.name} once, not recorded", flush=True)
    try:
        run_case(case, device, timer, peers, env, impl_globs, lambda s: None)
    except torch.cuda.OutOfMemoryError:
        pass  # the case itself reports it when it runs
    _recover(device)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ropekit bench",
        description="Time ropekit against a copy of the same bytes and against the peer implementations present "
                    "(transformers eager and torch.compile, Liger, flash-attn's Triton rotary, our Helion kernel), "
                    "and rope_attention "
                    "against apply_rope + torch's SDPA (cuDNN, flash) or flex_attention (--preset attention). "
                    "Needs a CUDA GPU; "
                    "--preset smoke or --device cpu runs a CPU smoke run of the harness instead (set "
                    "TRITON_INTERPRET=1 for the Triton rows), not a performance figure. --preset cpu times "
                    "apply_rope on CPU tensors (its float32 path) against transformers' apply_rotary_pos_emb: a "
                    "figure of the CPU, whose rows name it and torch's thread count.")
    p.add_argument("--preset", help="registry preset (default: quick on CUDA, smoke with --device cpu; cpu: the CPU "
                                    "measurement)")
    p.add_argument("--quick", action="store_const", const="quick", dest="preset", help="same as --preset quick")
    p.add_argument("--full", action="store_const", const="full", dest="preset", help="same as --preset full")
    p.add_argument("--cases", help="comma-separated globs on group names (or case names) of the preset")
    p.add_argument("--filter", help="regex on case names, e.g. 'llama3-8b/bf16/neox/range'")
    p.add_argument("--modes", help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--impls", help="comma-separated globs on implementation names, e.g. 'ropekit*,hf'; baselines "
                                   "always run")
    p.add_argument("--shard", help="run shard I/N of the selected cases (e.g. 2/4)")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("--registry", help="registry file (default: the one shipped with ropekit, "
                                      "ropekit/bench/registry.py)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--out", default="out/bench", help="output directory (default: out/bench)")
    p.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True,
                   help="write PNG plots (needs matplotlib; default on)")
    p.add_argument("--flash-attn-rotary", help="flash-attn's rotary.py to load (default: .peers/flash_attn_rotary.py)")
    p.add_argument("--commit", help="commit id to stamp when the checkout has no git metadata")
    p.add_argument("--base", metavar="TREE",
                   help="also time the same cases on another ropekit (a commit of this git checkout, or a directory "
                        "holding a checkout) in this run, and print this version against it")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time per measurement (ms)")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up time (ms)")
    p.add_argument("--cpu-budget-s", type=float, default=0.5,
                   help="the CPU mode (--preset cpu): seconds of calls taken in turn per case (default 0.5)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads before the run (the CPU mode's rows name the "
                                               "thread count; default: torch's)")
    p.add_argument("--time-budget", type=float, help="seconds after which no new case starts (results so far are "
                                                      "written)")
    p.add_argument("--history", metavar="FILE",
                   help="also append the run's rows to this CSV (the results columns plus 'source'), e.g. "
                        "benchmarks/results/all_runs.csv.xz (xz or gzip: one stream per run); default: none")
    p.add_argument("--from-json", nargs="+", metavar="FILE",
                   help="no timing: merge the rows of earlier JSON results and redo the table, targets and plots")
    return p


def _run_targets(registry: dict[str, Any], cpu_run: bool) -> tuple:
    """The registry's targets a run evaluates: the CPU mode's for a CPU run, the others for the rest."""
    return tuple(t for t in targets_from_registry(registry) if (t.mode == CPU_MODE) == cpu_run)


def _shown_path(path: str) -> str:
    """``path`` as result files record it: relative to the working directory when inside it (a checkout's
    ``benchmarks/registry.py``), else its file name -- results name no machine's directories."""
    rel = os.path.relpath(path)
    return path if not os.path.isabs(path) else (os.path.basename(path) if rel.startswith("..") else rel)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ropekit bench``."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    out_dir = Path(args.out)
    if args.from_json:
        registry = _registry(args.registry)
        return 2 if registry is None else _replot(args.from_json, out_dir, args.plot, registry)

    if args.device is None and args.preset not in ("smoke", CPU_MODE) and not args.list \
            and not torch.cuda.is_available():
        # a CPU run is a smoke test of the harness: only when asked for, never in place of a benchmark
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    default_device = "cuda" if torch.cuda.is_available() and args.preset != CPU_MODE else "cpu"
    device = torch.device(args.device or default_device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu", file=sys.stderr)
        return 2
    registry = _registry(args.registry)
    if registry is None:
        return 2
    preset = args.preset or ("quick" if device.type == "cuda" else "smoke")
    cases = select_cases(expand_preset(registry, preset), groups=args.cases, pattern=args.filter, modes=args.modes,
                         shard=args.shard)
    # the CPU mode times CPU tensors on the host: a run of its own, whose targets are the CPU mode's alone
    cpu_run = bool(cases) and all(c.modes == (CPU_MODE,) for c in cases)
    if any(CPU_MODE in c.modes for c in cases) and not cpu_run:
        print(f"ropekit bench: the {CPU_MODE!r} mode runs on its own (--preset cpu), not beside the GPU modes",
              file=sys.stderr)
        return 2
    if cpu_run and device.type != "cpu":
        print(f"ropekit bench: the {CPU_MODE!r} mode times CPU tensors: --device cpu (or no --device)", file=sys.stderr)
        return 2
    targets_wanted = _run_targets(registry, cpu_run)
    if args.list:
        for c in cases:
            nbytes = case_bytes(c)
            print(f"{c.group:24s} {c.name:56s} {nbytes.get(c.modes[0], nbytes['fwd']) / 1e6:9.1f} MB  "
                  f"{','.join(c.modes)}")
        print(f"{len(cases)} cases from {registry['source']}, preset {preset}")
        return 0
    if not cases:
        print("no case selected", file=sys.stderr)
        return 2

    env = environment(device, args.commit, cpu_measurement=cpu_run)
    impl_globs = [g.strip() for g in args.impls.split(",") if g.strip()] if args.impls else None
    wanted = {n for names in MODE_IMPLS.values() for n in names
              if impl_globs is None or any(fnmatch.fnmatch(n, g) for g in impl_globs)}
    run_one = run_case
    if cpu_run:  # host timings of CPU tensors against transformers, the baseline (always run)
        wanted = {"hf"}
        # imported here: ``python -m ropekit.bench.cpu`` runs that module, which the package must not import first
        from .cpu import bench_rows as run_one
    peers = load_peers(wanted, args.flash_attn_rotary)
    meta = dict(env, preset=preset, registry=_shown_path(registry["source"]), peers=peers.versions,
                peers_missing=peers.missing, argv=list(sys.argv[1:] if argv is None else argv),
                mismatch_threshold=MISMATCH, mismatch_threshold_fp8_cache=FP8_MISMATCH)
    if device.type == "cuda":
        dynamo_config = importlib.import_module("torch._dynamo").config
        for knob in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
            if hasattr(dynamo_config, knob):
                setattr(dynamo_config, knob, max(getattr(dynamo_config, knob), 256))
        timer = Timer(device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    elif cpu_run:
        timer = Timer(device, interleaved_budget_s=args.cpu_budget_s)
        print(f"CPU measurement on {env['gpu']}: apply_rope's float32 path against transformers' "
              "apply_rotary_pos_emb")
    else:
        timer = Timer(device, host_rounds=3, host_round_s=0.005, host_warm_calls=2)
        print(f"{SMOKE_LABEL}: running on CPU tensors"
              + ("" if _interpreting() else " (set TRITON_INTERPRET=1 to run the Triton launcher too)"))

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    kind = CPU_MODE if cpu_run else "cpu-smoke" if device.type != "cuda" else preset
    stem = out_dir / f"bench-{stamp}-{kind}" if not args.shard else \
        out_dir / f"bench-{stamp}-{kind}-shard{args.shard.replace('/', 'of')}"
    print(f"{len(cases)} cases, preset {preset}, registry {registry['source']}; peers: "
          + (", ".join(f"{k} {v}" for k, v in peers.versions.items()) or "none"))
    for name, why in peers.missing.items():
        print(f"  absent: {name}: {why}")

    if cases:
        _warm_up(cases[0], device, timer, peers, env, impl_globs)
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for i, case in enumerate(cases, 1):
        if args.time_budget is not None and time.perf_counter() - t_start > args.time_budget:
            print(f"time budget reached: {len(cases) - i + 1} cases not run")
            break
        print(f"[{i}/{len(cases)}] {case.name} ({','.join(case.modes)})", flush=True)
        try:
            rows += run_one(case, device, timer, peers, env, impl_globs, lambda s: print(s, flush=True))
        except torch.cuda.OutOfMemoryError as exc:  # making the inputs themselves
            print(f"  out of memory, case skipped: {str(exc).splitlines()[0]}")
        _recover(device)  # the case's inputs are gone: give their memory back
        targets = evaluate_targets(rows, targets_wanted)
        files = write_results(stem, rows, meta, targets)  # after every case: a killed run keeps its rows

    targets = evaluate_targets(rows, targets_wanted)
    files = write_results(stem, rows, meta, targets)
    if args.history:
        files.append(append_history(Path(args.history), rows, stem.with_suffix(".csv").name))
    if args.plot:
        files += _try_plot(stem, rows, meta)
    _report(rows, meta, targets, files, time.perf_counter() - t_start)
    if args.base:
        base_rows, label = run_base(args.base, list(sys.argv[1:] if argv is None else argv), out_dir, args.impls)
        table = compare(rows, base_rows, label)
        stem.with_name(stem.name + "-vs-base.txt").write_text(table, encoding="utf-8")
        print("\n" + table, end="")
    return 0


def _try_plot(stem: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[Path]:
    try:
        return plot_results(stem, rows, meta)
    except ImportError:
        print("matplotlib not importable: no plot (pip install matplotlib)")
        return []


def _report(rows: list[dict[str, Any]], meta: dict[str, Any], targets: list[dict[str, Any]], files: list[Path],
            seconds: float) -> None:
    notes = skip_notes(rows)
    if notes:
        print("\nNot timed or flagged:")
        print("\n".join(notes))
    print(f"\nwrote ({seconds:.0f} s): " + ", ".join(str(f) for f in files))
    print()
    print(format_table(rows, meta, targets), end="")


def _registry(path: str | None) -> dict[str, Any] | None:
    """The registry, or None after saying on stderr why there is none."""
    try:
        return load_registry(path)
    except RegistryNotFound as exc:
        print(f"ropekit bench: {exc}", file=sys.stderr)
        return None


def _replot(files: list[str], out_dir: Path, plot: bool, registry: dict[str, Any]) -> int:
    rows: list[dict[str, Any]] = []
    meta: dict[str, Any] | None = None
    for name in files:
        data = json.loads(Path(name).read_text(encoding="utf-8"))
        meta = meta or data["meta"]
        for r in data["rows"]:
            r = {k: ("" if v is None else v) for k, v in r.items()}
            r.setdefault("series", r["case"].rsplit("/", 1)[0])
            rows.append(r)
    if not rows or meta is None:
        print("no rows", file=sys.stderr)
        return 2
    runs = {(r["gpu"], r["commit"], r["torch"], r["triton"]) for r in rows}
    if len(runs) > 1:
        print(f"warning: merging rows of {len(runs)} different GPUs/commits/versions; the header names the first "
              "file's: " + "; ".join(" ".join(str(x) for x in run) for run in sorted(runs)))
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    stem = out_dir / f"bench-{stamp}-merged"
    meta = dict(meta, merged_from=[str(f) for f in files])
    cpu_run = all(r["mode"] == CPU_MODE for r in rows)  # as a run: the CPU mode's targets, or the others
    targets = evaluate_targets(rows, _run_targets(registry, cpu_run))
    out = write_results(stem, rows, meta, targets)
    if plot:
        out += _try_plot(stem, rows, meta)
    _report(rows, meta, targets, out, 0.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
