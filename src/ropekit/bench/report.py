"""Writers: CSV, JSON and Markdown results, the append-only history CSV, and the short table printed last."""

from __future__ import annotations

import csv
import gzip
import io
import json
import lzma
import re
from pathlib import Path
from typing import Any

from .attention import ATTN_BASELINE, ATTN_IMPLS
from .cases import ATTN_MODES, CPU_MODE
from .env import CPU_PERF_LABEL, PERF_LABEL
from .impls import BASELINE, EXTRA_BASELINES, FORWARD_PEER_IMPLS, PEER_IMPLS, PROLOGUE_IMPLS, ROPEKIT_IMPLS

NO_TARGETS_LINE = "Targets not evaluated: CPU timings are not performance figures (targets need a CUDA GPU)."

ROW_FIELDS = (
    "gpu", "date", "torch", "triton", "ropekit", "commit", "case", "mode", "impl", "tokens", "bytes", "median_us",
    "gbps", "flops", "tflops", "ratio_vs_copy", "baseline", "model", "dtype", "style", "positions", "batch",
    "seqlen", "hq", "hk", "head_dim", "rotary_dim", "rotary_at", "max_rel_diff", "label", "note", "impl_version",
)
HISTORY_FIELDS = (*ROW_FIELDS, "source")  # the columns of --history FILE (benchmarks/results/all_runs.csv.xz)
# The history columns of earlier harnesses, newest first: a compressed history keeps the members they wrote (each
# with its header) and takes new members after them; their rows read back with the columns they lack empty.
LEGACY_HISTORY_FIELDS = (
    # before the attention modes' flops and tflops
    ("gpu", "date", "torch", "triton", "ropekit", "commit", "case", "mode", "impl", "tokens", "bytes", "median_us",
     "gbps", "ratio_vs_copy", "baseline", "model", "dtype", "style", "positions", "batch", "seqlen", "hq", "hk",
     "head_dim", "rotary_dim", "rotary_at", "max_rel_diff", "label", "note", "impl_version", "source"),
)


def write_results(stem: Path, rows: list[dict[str, Any]], meta: dict[str, Any],
                  targets: list[dict[str, Any]]) -> list[Path]:
    """``stem``.csv (one row per case x mode x impl), ``stem``.json (meta, rows, targets), ``stem``.md (the short
    table)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    csv_path, json_path, md_path = (stem.with_suffix(s) for s in (".csv", ".json", ".md"))
    with csv_path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=ROW_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    with json_path.open("w", encoding="utf-8") as f:
        json.dump({"meta": meta, "rows": [{k: r.get(k, "") for k in (*ROW_FIELDS, "series")} for r in rows],
                   "targets": targets}, f, indent=1)
    md_path.write_text(format_table(rows, meta, targets, markdown=True), encoding="utf-8")
    return [csv_path, json_path, md_path]


def append_history(history: Path, rows: list[dict[str, Any]], source: str) -> Path:
    """Append ``rows`` to the append-only history (``benchmarks/results/all_runs.csv.xz``: the results CSV's columns
    plus ``source``, the file the rows were first written to). A compressed history (``.xz``: one xz stream per run;
    ``.gz``: one gzip member per run) gets its header with every run (they read back as one text,
    :func:`read_history`; members of an earlier harness's columns, :data:`LEGACY_HISTORY_FIELDS`, stay as they
    are); a plain CSV gets its header once, so it must have today's columns."""
    history.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=HISTORY_FIELDS, extrasaction="ignore", lineterminator="\n")
    compressed = history.suffix in _OPENERS
    new = not history.is_file() or history.stat().st_size == 0
    if not new:
        (header,) = _lines(read_text(history), 1)
        if header != ",".join(HISTORY_FIELDS):
            legacy = header in {",".join(fields) for fields in LEGACY_HISTORY_FIELDS}
            if not (compressed and legacy):
                raise ValueError(f"{history}: its header is not the results columns plus 'source'"
                                 + ("" if not legacy else " (an earlier harness's columns: a plain CSV has one "
                                    "header, so start a new file, or keep the history as .xz or .gz)")
                                 + "; not appending")
    if compressed or new:
        writer.writeheader()
    writer.writerows(dict(r, source=source) for r in rows)
    with (_OPENERS[history.suffix](history, "at", encoding="utf-8", newline="") if compressed
          else history.open("a", newline="", encoding="utf-8")) as f:
        f.write(buffer.getvalue())
    return history


# A compressed CSV's opener by suffix. Appending opens a new member (gzip) or stream (xz), and reading goes through
# every one of them in turn, so a history grows run by run without rewriting what it holds. xz keeps the history at
# about 60% of gzip's bytes (its window spans the whole file, where gzip's is 32 KiB).
_OPENERS = {".gz": gzip.open, ".xz": lzma.open}


def open_text(path: Path, mode: str):
    """``path`` opened in text ``mode`` ("r", "w" or "a") for the csv module, through xz or gzip where the name ends
    in .xz or .gz (appending adds a stream or member)."""
    opener = _OPENERS.get(path.suffix)
    if opener is None:
        return path.open(mode, newline="", encoding="utf-8")
    return opener(path, mode + "t", newline="", encoding="utf-8")


def read_text(path: Path) -> str:
    """A CSV's text, decompressed where the name ends in .xz or .gz."""
    if path.suffix in _OPENERS:
        with _OPENERS[path.suffix](path, "rt", newline="", encoding="utf-8") as f:
            return f.read()
    return path.read_text(encoding="utf-8")


def _lines(text: str, n: int) -> list[str]:
    return [line.rstrip("\r") for line in text.split("\n", n)[:n]]


def gbps(row: dict[str, Any]) -> str:
    """A timed row's useful GB/s, as the harness writes it (bytes / time), from its ``bytes`` and ``median_us``:
    empty for host-time rows and rows without a time."""
    if row["mode"] == "host" or not row["bytes"] or not row["median_us"]:
        return ""
    return f"{int(row['bytes']) / float(row['median_us']) / 1e3:.4g}"


def write_history(history: Path, rows: list[dict[str, Any]]) -> None:
    """Rewrite the history as ``rows`` in one stream, without ``gbps`` (:func:`read_history` forms it again from
    ``bytes`` and ``median_us``: about an eighth of the compressed file)."""
    with open_text(history, "w") as f:
        writer = csv.DictWriter(f, fieldnames=HISTORY_FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(dict(r, gbps="") for r in rows)


def read_history(history: Path) -> list[dict[str, Any]]:
    """Every row of the history (a CSV, or an xz or gzip of one whose streams or members were appended run by run,
    each with its header), with today's columns (:data:`HISTORY_FIELDS`; those an earlier harness's member lacks
    are empty, but ``gbps``, formed from the row's bytes and time where a rewrite dropped it)."""
    headers = [",".join(fields) for fields in (HISTORY_FIELDS, *LEGACY_HISTORY_FIELDS)]
    pattern = "^(" + "|".join(re.escape(h) for h in headers) + ")\r?\n"
    parts = re.split(pattern, read_text(history), flags=re.MULTILINE)  # [before, header, body, header, body, ...]
    if parts[0].strip():
        raise ValueError(f"{history}: does not start with the results columns plus 'source'")
    rows: list[dict[str, Any]] = []
    for header, body in zip(parts[1::2], parts[2::2]):
        for row in csv.DictReader(io.StringIO(header + "\n" + body)):
            rows.append({k: row.get(k, "") for k in HISTORY_FIELDS})
            if not rows[-1]["gbps"]:
                rows[-1]["gbps"] = gbps(rows[-1])
    return rows


ATTN_INTRO = ("attention modes: baseline ms = median milliseconds of rope+sdpa-cudnn (ropekit.apply_rope, then "
              "SDPA's cuDNN backend); Nx = time / baseline time; TF/s = flops / time, flops = 2 B Hq S^2 (D + Dv), "
              "half of it causal, fwd+bwd 3.5x the forward; sdpa-*, flex: attention alone, no RoPE")


def format_table(rows: list[dict[str, Any]], meta: dict[str, Any], targets: list[dict[str, Any]],
                 markdown: bool = False) -> str:
    """The short table: a line per (case, mode) with the mode's baseline time, then a column per implementation
    with its ratio to that baseline (Markdown: time and ratio); the attention modes in a grid of their own (with
    TFLOP/s); then the targets."""
    attn_rows = [r for r in rows if r["mode"] in ATTN_MODES]
    cpu_rows = [r for r in rows if r["mode"] == CPU_MODE]
    rows = [r for r in rows if r["mode"] not in ATTN_MODES and r["mode"] != CPU_MODE]
    order = [*ROPEKIT_IMPLS, *PROLOGUE_IMPLS, *PEER_IMPLS, *FORWARD_PEER_IMPLS,
             *(n for v in EXTRA_BASELINES.values() for n in v)]
    timed = {r["impl"] for r in rows if r["median_us"]}
    impls = [i for i in order if i in timed]  # "copy" is also decode's reference row
    header = ["case", "mode", "tokens", "MB", "baseline us", *impls, "exact/table"]
    lines_data = []
    groups: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["case"], r["mode"]), {})[r["impl"]] = r
    for (case, mode), by_impl in groups.items():
        base = by_impl.get(BASELINE[mode])
        first = base or next(iter(by_impl.values()))
        mb = f"{int(first['bytes']) / 1e6:.1f}" if mode != "host" else "-"
        base_cell = f"{BASELINE[mode]} {float(base['median_us']):.1f}" if base and base["median_us"] else \
            f"{BASELINE[mode]} -"
        cells = [case, mode, str(first["tokens"]), mb, base_cell]
        cells += [_impl_cell(by_impl.get(impl), markdown) for impl in impls]
        a, b = by_impl.get("ropekit"), by_impl.get("ropekit-table")
        cells.append(f"{float(a['median_us']) / float(b['median_us']):.3f}"
                     if a and b and a["median_us"] and b["median_us"] else "-")
        lines_data.append(cells)
    t_header = ["target", "limit", "worst", "ok", "cases", "worst case"]
    t_rows = [[t["what"], f"{t['limit']:.2f}", "-" if t["worst"] is None else f"{t['worst']:.3f}",
               "not run" if t["ok"] is None else ("yes" if t["ok"] else "NO"), str(t["cases"]), t["case"]]
              for t in targets]
    head = (f"{meta['gpu']} | torch {meta['torch']} | triton {meta['triton']} | ropekit {meta['ropekit']} @ "
            f"{meta['commit']} | {meta['date']}")
    intro = ("baseline us = median microseconds of the mode's baseline (fwd: copy of the same bytes; fwdbwd: "
             "copy-4pass; decode: copy-q; host: add_; kv-decode, kv-prefill: copy-kv; norm-fwdbwd: copy-5pass; "
             "mla-decode, mla-prefill: copy-mla; hidden-norm-fwd: copy-qkv; the float8 fwd row: copy-fp8out); "
             "Nx = time / baseline time; exact/table = ropekit / ropekit-table")
    label = f"**{meta['label']}**" if markdown else f"*** {meta['label']} ***"
    performance = meta["label"] in (PERF_LABEL, CPU_PERF_LABEL)
    out = [label] if not performance else []
    out.append(head)
    if rows or not (attn_rows or cpu_rows):
        out += [intro, ""]
        out += _grid(header, lines_data, markdown)
    if attn_rows:
        out += (["", ATTN_INTRO, ""] if rows else [ATTN_INTRO, ""]) + _attention_grid(attn_rows, markdown)
    if cpu_rows:
        out += ["", CPU_INTRO, ""] + _cpu_grid(cpu_rows, markdown)
    if performance:
        out += ["", "Targets (worst ratio over the qualifying ropekit rows):", ""]
        out += _grid(t_header, t_rows, markdown)
    else:  # ratios of CPU timings against targets set for a GPU mean nothing (they read "NO (300x)")
        out += ["", NO_TARGETS_LINE]
    if not performance:
        out += ["", label]
    return "\n".join(out) + "\n"


CPU_INTRO = ("cpu mode: hf us = median microseconds of transformers' apply_rotary_pos_emb (cos/sin computed "
             "beforehand); ropekit: apply_rope with the positions of the calls before (a later layer), "
             "ropekit-first-layer: positions new to every call; Nx = time / hf's time")


def _cpu_grid(rows: list[dict[str, Any]], markdown: bool) -> list[str]:
    """A line per case of the CPU mode: hf's time, then ropekit's implementations' ratios to it (Markdown: time
    and ratio; without hf, the time)."""
    impls = ["ropekit", "ropekit-first-layer"]
    groups: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["case"], {})[r["impl"]] = r
    data = []
    for case, by_impl in groups.items():
        hf = by_impl.get("hf")
        cells = [case, str(next(iter(by_impl.values()))["tokens"]),
                 f"{float(hf['median_us']):.1f}" if hf and hf["median_us"] else "-"]
        cells += [_impl_cell(by_impl.get(impl), markdown) for impl in impls]
        data.append(cells)
    return _grid(["case", "tokens", "hf us", *impls], data, markdown)


def _impl_cell(r: dict[str, Any] | None, markdown: bool) -> str:
    """An implementation's cell of the printed table: its ratio (with its time in Markdown), its time where it has
    no ratio, or "-"."""
    if r is None or not r["median_us"]:
        return "-"
    if not r["ratio_vs_copy"]:
        return f"{float(r['median_us']):.1f}us"
    if markdown:
        return f"{float(r['median_us']):.1f} ({float(r['ratio_vs_copy']):.3f}x)"
    return f"{float(r['ratio_vs_copy']):.3f}x"


def _tf(value: Any) -> str:
    return f"{float(value):.3g}"


def _attention_grid(rows: list[dict[str, Any]], markdown: bool) -> list[str]:
    """A line per (case, mode) of the attention modes: the flops, the baseline's time, then a column per
    implementation with its ratio to the baseline and its TFLOP/s (Markdown: time too)."""
    timed = {r["impl"] for r in rows if r["median_us"]}
    impls = [i for i in ATTN_IMPLS if i in timed]
    groups: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["case"], r["mode"]), {})[r["impl"]] = r
    data = []
    for (case, mode), by_impl in groups.items():
        first = next(iter(by_impl.values()))
        base = by_impl.get(ATTN_BASELINE)
        base_cell = f"{ATTN_BASELINE} -"
        if base and base["median_us"]:
            base_cell = f"{ATTN_BASELINE} {float(base['median_us']) / 1e3:.3f} ({_tf(base['tflops'])} TF/s)"
        cells = [case, mode, _tf(int(first["flops"]) / 1e12) if first["flops"] else "-", base_cell]
        for impl in impls:
            r = by_impl.get(impl)
            if r is None or not r["median_us"]:
                cells.append("-")
                continue
            ms, tf = float(r["median_us"]) / 1e3, _tf(r["tflops"]) if r["tflops"] else "-"
            ratio = f"{float(r['ratio_vs_copy']):.3f}x" if r["ratio_vs_copy"] else ""
            if markdown:
                cells.append(f"{ms:.3f} ms, {tf} TF/s" + (f" ({ratio})" if ratio else ""))
            else:
                cells.append(f"{ratio or f'{ms:.3f}ms'} {tf}TF")
        data.append(cells)
    return _grid(["case", "mode", "TFLOP", "baseline ms", *impls], data, markdown)


def _grid(header: list[str], data: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return lines + ["| " + " | ".join(row) + " |" for row in data]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *data)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*row) for row in data]


def skip_notes(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (impl, reason) for skipped, failed or mismatching rows."""
    seen: dict[tuple[str, str], int] = {}
    for r in rows:
        note = r["note"]
        if note.startswith(("skipped", "failed")) or "MISMATCH" in note:
            key = (r["impl"], note.split("; compiled")[0])
            seen[key] = seen.get(key, 0) + 1
    return [f"  {impl}: {note} ({n} row{'s' if n > 1 else ''})" for (impl, note), n in seen.items()]
