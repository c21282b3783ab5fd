"""The results the project keeps, and BENCHMARKS.md generated from them.

``benchmarks/results/all_runs.csv.xz`` holds the rows of the runs that give the newest results (each run appends an
xz stream, ``--history``; superseded rows are pruned now and then, and stay in git history). From it, per card, the
newest run of every (case, mode) -- all its implementations from that one run, so that every ratio and every
"versus" comparison is within one run -- goes to
``benchmarks/results/latest/<card>/results.csv.xz`` (with plots where matplotlib is importable), and BENCHMARKS.md is
written from those rows: per card, one table per mode, one line per registry target (the attention modes add a
table of every implementation's TFLOP/s). The CPU mode's rows (``ropekit bench --preset cpu``) make a card of their
own, named by the CPU and its thread count, with that mode's targets and a table of ropekit / transformers per dtype,
size and positions kind. Analysis lives in docs/perf-notes.md, not in the generated file.

    python -m ropekit.bench.summary            # from a checkout: rewrite latest/ and BENCHMARKS.md
    python -m ropekit.bench.summary --prune    # the same, the history first cut to the rows that give them
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import io
import lzma
import re
import sys
from pathlib import Path
from typing import Any

from .attention import ATTN_BASELINE, ATTN_IMPLS
from .cases import ATTN_MODES, CPU_MODE, RegistryNotFound, load_registry
from .report import open_text, read_history, write_history
from .targets import Target, evaluate_targets, targets_from_registry

# A run's commit as the harness stamps it: a clean commit id. Rows of A/B working trees ("old", "new", "WIP",
# "<id>+dirty") stay in the history but are not "the newest run" of anything.
_CLEAN_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
# The columns of latest/<card>/results.csv.xz: what a row's reader needs (the card, versions and label are in the
# history and in BENCHMARKS.md's header for the card).
LATEST_FIELDS = ("case", "mode", "impl", "tokens", "bytes", "median_us", "gbps", "ratio_vs_copy", "baseline",
                 "max_rel_diff", "note", "commit", "date", "torch", "triton")
PLOT_DPI = 64  # the kept plots, drawn without antialiasing: small files, the text still legible
MODE_ORDER = ("fwd", "fwdbwd", "decode", "host", "kv-decode", "kv-prefill", "norm-fwdbwd", "attn-fwd", "attn-fwdbwd",
              "mla-decode", "mla-prefill", "hidden-norm-fwd", CPU_MODE)


def latest_fields(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """The columns of a card's latest/<card>/results.csv.xz: :data:`LATEST_FIELDS`, with ``flops`` and ``tflops`` after
    ``gbps`` where the card has rows of the attention modes (the other cards' files keep their columns)."""
    if not any(r.get("flops") for r in rows):
        return LATEST_FIELDS
    at = LATEST_FIELDS.index("gbps") + 1
    return (*LATEST_FIELDS[:at], "flops", "tflops", *LATEST_FIELDS[at:])


def card_slug(gpu: str) -> str:
    """A folder name for a card: the model number where the name has one ("NVIDIA H100 80GB HBM3" -> "h100"); for
    the CPU mode's rows, the CPU and its thread count ("CPU: Intel(R) Xeon(R) Platinum 8480C, 16 threads" ->
    "cpu-intel-xeon-platinum-8480c-16-threads")."""
    if gpu.startswith("CPU: "):
        name = re.sub(r"\((r|tm)\)", "", gpu.lower())
        return re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    model = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", gpu)
    return model.group(1).lower() if model else re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")


def newest_runs(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per card (its ``gpu`` string), for every (case, mode, implementation) the rows of the newest clean run that
    timed it. A run that timed only some implementations of a case (say, this round's new variants) so adds its rows
    without hiding the others' last figures. Each row keeps the ratio its own run measured against that run's
    baseline, and a target that compares two implementations pairs rows of one run only
    (:func:`ropekit.bench.targets.evaluate_targets`). Runs are told apart by (source, commit); rows of a
    (case, mode, implementation) that no clean run timed come from the newest run of the case."""
    timed: dict[tuple[str, ...], tuple[str, tuple[str, str]]] = {}
    newest: dict[tuple[str, str, str], tuple[str, tuple[str, str]]] = {}
    for r in rows:
        if not _CLEAN_COMMIT.match(r["commit"] or ""):
            continue
        run, case = (r["source"], r["commit"]), (r["gpu"], r["case"], r["mode"])
        if case not in newest or r["date"] > newest[case][0]:
            newest[case] = (r["date"], run)
        key = (*case, r["impl"])
        if r["median_us"] and (key not in timed or r["date"] > timed[key][0]):
            timed[key] = (r["date"], run)
    by_card: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        case = (r["gpu"], r["case"], r["mode"])
        chosen = timed.get((*case, r["impl"])) or newest.get(case)
        if chosen is not None and (r["source"], r["commit"]) == chosen[1] and case in newest:
            by_card.setdefault(r["gpu"], []).append(r)
    return by_card


def write_latest(by_card: dict[str, list[dict[str, Any]]], latest_dir: Path, plot: bool = True) -> list[Path]:
    """``latest_dir/<card>/results.csv.xz`` per card (the history's columns; xz keeps the checkout small, and
    ``xzcat`` or pandas read it as they are), and its plots where matplotlib is importable."""
    written = []
    for gpu, rows in sorted(by_card.items()):
        folder = latest_dir / card_slug(gpu)
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("*"):
            if plot or stale.suffix != ".png":  # without plotting, the card's plots stay as they were
                stale.unlink()
        path = folder / "results.csv.xz"
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=latest_fields(rows), extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(sorted(rows, key=lambda r: (r["case"], r["mode"], r["impl"])))
        # xz stores no time stamp: the same rows give the same bytes (no churn in the tree when nothing changed)
        path.write_bytes(lzma.compress(text.getvalue().encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))
        written.append(path)
        if plot:
            try:
                from .plots import plot_results
            except ImportError:
                continue
            rows = [dict(r, series=r["case"].rsplit("/", 1)[0]) for r in rows]
            plots = plot_results(folder / "results", rows, _meta(rows), dpi=PLOT_DPI, antialiased=False)
            for path in plots:
                _to_palette(path)
            written += plots
    return written


def _to_palette(path: Path) -> None:
    """Rewrite a kept plot with a 32-colour palette: a quarter of the bytes, the lines as legible (Pillow comes
    with matplotlib)."""
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=32, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def _meta(rows: list[dict[str, Any]]) -> dict[str, Any]:
    first = rows[0]
    return {"gpu": first["gpu"], "torch": _span(rows, "torch"), "triton": _span(rows, "triton"),
            "ropekit": _span(rows, "ropekit"), "commit": _span(rows, "commit"),
            "date": max(r["date"] for r in rows)[:10], "preset": "latest", "label": first["label"]}


def _span(rows: list[dict[str, Any]], column: str) -> str:
    values = sorted({r[column] for r in rows if r[column]})
    if len(values) == 1:
        return values[0]
    return f"{len(values)} values ({', '.join(values[:3])}{', ...' if len(values) > 3 else ''})"


def markdown(by_card: dict[str, list[dict[str, Any]]], targets: tuple[Target, ...], latest_rel: str,
             e2e: list[dict[str, Any]] | None = None) -> str:
    """BENCHMARKS.md: a short preamble, then per card one table per mode with a line per target (and for the
    attention modes, where the card has their rows, a table of every implementation's TFLOP/s); then the newest
    end-to-end run of each card and model (``e2e``: rows of ``python -m ropekit.bench.e2e --csv``)."""
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m ropekit.bench.summary` from `benchmarks/results/all_runs.csv.xz`; do not edit by",
        "hand. For each card, the newest run that timed each implementation of every case and mode; each ratio is",
        "measured within one run against the mode's baseline (a copy of the same bytes, or the implementation the",
        "target names, timed in the same run). Method and",
        "columns: [benchmarks/README.md](benchmarks/README.md); analysis of every miss:",
        "[docs/perf-notes.md](docs/perf-notes.md).",
        "",
    ]
    for gpu, rows in sorted(by_card.items(), key=lambda item: card_slug(item[0])):
        slug = card_slug(gpu)
        dates = sorted(r["date"][:10] for r in rows)
        commits = sorted({r["commit"] for r in rows})
        lines += [f"## {gpu}", "",
                  f"{len(rows)} rows, {len({(r['case'], r['mode']) for r in rows})} case-modes; measured "
                  f"{dates[0]} to {dates[-1]} at {len(commits)} commit(s) (newest: "
                  f"{max(rows, key=lambda r: r['date'])['commit']}); torch {_span(rows, 'torch')}, triton "
                  f"{_span(rows, 'triton')}. Rows and plots: [{latest_rel}/{slug}/]({latest_rel}/{slug}/).", ""]
        results = evaluate_targets(rows, targets)
        # a card of the CPU mode's rows (the CPU named) has that mode's targets alone, and the GPUs' cards not it
        cpu_card = {r["mode"] for r in rows} == {CPU_MODE}
        for mode in sorted({t.mode for t in targets if (t.mode == CPU_MODE) == cpu_card},
                           key=lambda m: MODE_ORDER.index(m) if m in MODE_ORDER else 99):
            mode_results = [(t, res) for t, res in zip(targets, results) if t.mode == mode]
            lines += [f"### {mode}", "", "| target | limit | worst | at | rows | status |", "|---|---|---|---|---|---|"]
            for t, res in mode_results:
                if res["worst"] is None:
                    lines.append(f"| {t.text} | {t.limit:g} | | | 0 | not measured |")
                    continue
                at = next(r for r in rows if r["case"] == res["case"] and r["mode"] == mode
                          and fnmatch.fnmatchcase(r["impl"], t.impl))
                status = "**met**" if res["ok"] else "**missed**"
                lines.append(f"| {t.text} | {t.limit:g} | {res['worst']:.3f} | {res['case']} ({at['commit']}) | "
                             f"{res['cases']} | {status} |")
            lines.append("")
            if mode in ATTN_MODES:
                lines += _throughput_table([r for r in rows if r["mode"] == mode])
            if mode == CPU_MODE:
                lines += _cpu_table([r for r in rows if r["mode"] == mode])
    lines += _e2e_tables(e2e or [])
    return "\n".join(lines)


def read_e2e(path: Path) -> list[dict[str, Any]]:
    """The end-to-end rows kept at ``path`` (``python -m ropekit.bench.e2e --csv``), none where it is absent."""
    if not path.is_file():
        return []
    with open_text(path, "r") as f:
        return list(csv.DictReader(f))


def _e2e_tables(rows: list[dict[str, Any]]) -> list[str]:
    """Per (card, model), the newest run's rows (smoke runs left out): time (with its spread over the interleaved
    rounds), host time per step, ratio to unpatched sdpa with its verdict, and a line per run saying whether a
    ropekit-patched model was slower than sdpa anywhere."""
    rows = [r for r in rows if r.get("tiny") not in ("True", True) and r["device"] != "cpu"
            and not r["device"].startswith("none")]
    if not rows:
        return []
    lines = ["## End to end: patched transformers models", "",
             "`python -m ropekit.bench.e2e` (method: [benchmarks/README.md](benchmarks/README.md)): a training step "
             "(forward, backward, AdamW) and greedy static-cache decoding per token, eager and in a CUDA graph; "
             "random-weight ~0.5 B models, bf16; each ratio is to unpatched sdpa in the same run. The variants take "
             "turns over rounds: ms is the median of the rounds (± half their range), the ratio the median of the "
             "per-round ratios (± half their range), and the verdict calls a ratio faster or SLOWER only outside "
             "that range (and outside 1 %). host ms: the CPU time of issuing one step; near ms, the step is bound "
             "by the host (for eager decoding, with what one step asks of the host).", ""]
    for device, model in sorted({(r["device"], r["model"]) for r in rows}):
        mine = [r for r in rows if (r["device"], r["model"]) == (device, model)]
        newest = max(r["date"] for r in mine)
        run = [r for r in mine if r["date"] == newest]
        lines += [f"### {device}, {model} ({newest[:10]}, {run[0]['commit']}, torch {run[0]['torch']})", "",
                  "| step | batch | variant | ms | host ms | tokens/s | vs sdpa | verdict | greedy tokens as sdpa |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in run:
            if r.get("error"):
                lines.append(f"| {r['kind']} | {r['batch']} | {r['variant']} | failed: {r['error']} | | | | | |")
                continue
            lines.append(f"| {r['kind']} | {r['batch']} | {r['variant']} | {float(r['ms']):.3f}"
                         f"{_plus_minus(r.get('spread'), percent=True)} | "
                         f"{_number(r.get('host_ms'))}{_host_counts(r)} | "
                         f"{float(r['tokens_per_s']):.0f} | {float(r['vs_sdpa']):.3f}"
                         f"{_plus_minus(r.get('vs_sdpa_spread'))} | {r.get('verdict') or '-'} | {r['same_tokens']} |")
        judged = [r for r in run if r.get("verdict") and not r.get("error") and r["variant"].startswith("ropekit")]
        slower = [f"{r['variant']} {r['kind']} batch {r['batch']} ({float(r['vs_sdpa']):.3f})" for r in judged
                  if r["verdict"] == "SLOWER"]
        verdict = ("not judged (this run measured no spread)" if not judged
                   else "no: " + ", ".join(slower) if slower else "yes")
        lines += ["", f"ropekit never slower than sdpa: {verdict}", ""]
    return lines


def _host_counts(row: dict[str, Any]) -> str:
    """An eager decode step's Python calls, aten ops and kernels, where the run counted them."""
    if row.get("py_calls") in (None, ""):
        return ""
    return (f" ({float(row['py_calls']):.0f} Python calls, {float(row['aten_ops']):.0f} aten ops, "
            f"{float(row['kernels']):.0f} kernels)")


def _number(value) -> str:
    return f"{float(value):.3f}" if value not in (None, "") else "-"


def _plus_minus(value, percent: bool = False) -> str:
    """`` ± x`` of a spread kept in the CSV (a fraction: as a percentage with ``percent``); nothing for an older row
    without one."""
    if value in (None, ""):
        return ""
    return f" ± {float(value) * 100:.1f} %" if percent else f" ± {float(value):.3f}"


CPU_KINDS = (("ids", "ropekit", "ids, later layers"), ("ids", "ropekit-first-layer", "ids, first layer"),
             ("offset", "ropekit", "offset, later layers"), ("offset", "ropekit-first-layer", "offset, first layer"))


def _cpu_table(rows: list[dict[str, Any]]) -> list[str]:
    """The CPU mode's rows of one card: a line per dtype and size, a column per positions kind ([B, S] ids or an
    int offset) and layer (later layers: the positions of the calls before; the first: positions new to every call),
    each cell ropekit's time over hf's (measured in the same run and case) with both times."""
    cells: dict[tuple[str, int, int], dict[tuple[str, str], str]] = {}
    for r in rows:
        line = cells.setdefault((r["dtype"], int(r["batch"]), int(r["seqlen"])), {})
        if not r["median_us"] or r["impl"] not in {kind[1] for kind in CPU_KINDS}:
            continue
        # a first layer against transformers' first layer (its cos/sin timed too) where the run has that row
        partners = ("hf-first-layer", "hf") if r["impl"] == "ropekit-first-layer" else ("hf",)
        hf = next((h for impl in partners for h in rows if h["case"] == r["case"] and h["impl"] == impl
                   and h["source"] == r["source"] and h["median_us"]), None)
        us = float(r["median_us"])
        mark = "*" if hf is not None and hf["impl"] == "hf-first-layer" else ""
        line[(r["positions"], r["impl"])] = f"{us:.1f} us" if hf is None else \
            f"{us / float(hf['median_us']):.2f}{mark} ({us:.1f} / {float(hf['median_us']):.1f} us)"
    lines = ["CPU: apply_rope against transformers' apply_rotary_pos_emb: ropekit / hf (ropekit us / hf us; below 1: "
             "ropekit is faster). hf gets cos/sin computed beforehand (untimed, as a model computes them once per "
             "forward) and q/k as [B, H, S, D] views; ropekit gets the positions. Later layers: apply_rope with the "
             "positions of the calls before (a forward hands every layer the same ones); first layer: positions new "
             "to every call. A first layer's ratio marked * is against transformers' first layer, whose time "
             "includes its rotary embedding's cos/sin for those positions; unmarked ones (older runs) are against "
             "apply_rotary_pos_emb alone.", "",
             "| dtype | B x S | " + " | ".join(kind[2] for kind in CPU_KINDS) + " |",
             "|---|---|" + "---|" * len(CPU_KINDS)]
    for (dtype, batch, seqlen), line in sorted(cells.items(), key=lambda item: (item[0][0], item[0][1] * item[0][2])):
        lines.append(f"| {dtype} | {batch}x{seqlen} | "
                     + " | ".join(line.get(kind[:2], "-") for kind in CPU_KINDS) + " |")
    return lines + [""]


def _throughput_table(rows: list[dict[str, Any]]) -> list[str]:
    """The attention modes' rows of one card and mode: a line per case, TFLOP/s (and ms) per implementation."""
    timed = {r["impl"] for r in rows if r["median_us"] and r.get("tflops")}
    impls = [i for i in (ATTN_IMPLS[0], ATTN_BASELINE, *ATTN_IMPLS[1:]) if i in timed]
    if not impls:
        return []
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for r in sorted(rows, key=lambda r: r["case"]):
        by_case.setdefault(r["case"], {})[r["impl"]] = r
    lines = ["TFLOP/s (ms) of each implementation (sdpa-*, flex: attention alone, no RoPE):", "",
             "| case | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
    for case, by_impl in by_case.items():
        cells = []
        for impl in impls:
            r = by_impl.get(impl)
            ok = r is not None and r["median_us"] and r.get("tflops")
            cells.append(f"{float(r['tflops']):.4g} ({float(r['median_us']) / 1e3:.3f})" if ok else "-")
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ropekit.bench.summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/results", help="the results folder (default: %(default)s)")
    parser.add_argument("--out", default="BENCHMARKS.md", help="the generated page (default: %(default)s)")
    parser.add_argument("--registry", default=None, help="the registry (default: the one shipped with ropekit)")
    parser.add_argument("--no-plot", dest="plot", action="store_false")
    parser.add_argument("--prune", action="store_true", help="first rewrite all_runs.csv.xz as the rows that give "
                        "the newest results (the superseded ones stay in git history)")
    args = parser.parse_args(argv)
    results = Path(args.results)
    try:
        registry = load_registry(args.registry)
    except RegistryNotFound as exc:
        print(f"summary: {exc}", file=sys.stderr)
        return 2
    history = results / "all_runs.csv.xz"
    rows = read_history(history)
    by_card = newest_runs(rows)
    if args.prune:
        kept = {id(r) for card in by_card.values() for r in card}
        write_history(history, [r for r in rows if id(r) in kept])
    e2e = read_e2e(results / "e2e.csv.xz")
    written = write_latest(by_card, results / "latest", plot=args.plot)
    out = Path(args.out)
    latest_rel = Path(results / "latest").as_posix()
    out.write_text(markdown(by_card, targets_from_registry(registry), latest_rel, e2e), encoding="utf-8")
    print("wrote " + ", ".join(str(p) for p in [*written, out]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
