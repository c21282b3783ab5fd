"""The kept results: the append-only history, the newest run per card, and BENCHMARKS.md generated from them."""

from __future__ import annotations

import csv
import gzip
import io
import lzma
from pathlib import Path

import pytest

from ropekit.bench import cases as bench_cases
from ropekit.bench import report, summary
from ropekit.bench.targets import Target, evaluate_targets, targets_from_registry

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = ROOT / "src" / "ropekit" / "bench" / "registry.py"
HISTORY = ROOT / "benchmarks" / "results" / "all_runs.csv.xz"


def _row(case="m/bf16/neox/range/1x4096", mode="fwd", impl="ropekit", commit="abcdef1", date="2026-01-01T00:00",
         ratio="1.0", gpu="NVIDIA H100 80GB HBM3", **extra):
    row = {k: "" for k in report.HISTORY_FIELDS}
    row.update(gpu=gpu, date=date, commit=commit, case=case, mode=mode, impl=impl, median_us="10.0",
               ratio_vs_copy=ratio, tokens="4096", bytes="200000000", label="performance", **extra)
    return row


@pytest.mark.parametrize("name", ["all_runs.csv", "all_runs.csv.gz"])
def test_history_appends_runs_and_reads_them_back(tmp_path, name):
    history = tmp_path / name
    report.append_history(history, [_row(), _row(impl="copy")], "first.csv")
    report.append_history(history, [_row(commit="1234567")], "second.csv")
    got = report.read_history(history)
    assert [r["source"] for r in got] == ["first.csv", "first.csv", "second.csv"]
    assert [r["commit"] for r in got] == ["abcdef1", "abcdef1", "1234567"]
    if name.endswith(".gz"):
        with gzip.open(history, "rt") as f:  # one member per run, each with its header
            assert f.read().count(",".join(report.HISTORY_FIELDS)) == 2
    bad = tmp_path / ("bad" + history.suffix)
    with gzip.open(bad, "wt") if name.endswith(".gz") else bad.open("w") as f:
        f.write("a,b\n1,2\n")
    with pytest.raises(ValueError, match="header"):
        report.append_history(bad, [_row()], "x.csv")


def test_history_reads_and_extends_members_of_an_earlier_harness(tmp_path):
    """A gzip history keeps the members an earlier harness wrote (fewer columns: before flops and tflops) and takes
    today's after them; every row reads back with today's columns. A plain CSV has one header: no mixing."""
    (legacy,) = report.LEGACY_HISTORY_FIELDS
    old_row = {k: v for k, v in _row(source="old.csv").items() if k in legacy}
    history = tmp_path / "all_runs.csv.gz"
    with gzip.open(history, "wt", encoding="utf-8", newline="") as f:
        f.write(",".join(legacy) + "\n" + ",".join(old_row[k] for k in legacy) + "\n")
    report.append_history(history, [_row(mode="attn-fwd", flops="1000", tflops="2.5")], "new.csv")
    got = report.read_history(history)
    assert [list(r) for r in got] == [list(report.HISTORY_FIELDS)] * 2
    assert [(r["source"], r["flops"], r["tflops"]) for r in got] == [("old.csv", "", ""), ("new.csv", "1000", "2.5")]
    assert got[0]["median_us"] == "10.0" and got[1]["mode"] == "attn-fwd"
    plain = tmp_path / "all_runs.csv"
    plain.write_text(",".join(legacy) + "\n" + ",".join(old_row[k] for k in legacy) + "\n")
    assert [r["source"] for r in report.read_history(plain)] == ["old.csv"]
    with pytest.raises(ValueError, match="earlier harness's columns"):
        report.append_history(plain, [_row()], "x.csv")


def test_the_kept_history_has_the_harness_columns():
    rows = report.read_history(HISTORY)
    assert rows and list(rows[0]) == list(report.HISTORY_FIELDS)


def test_newest_runs_take_every_impl_of_a_case_from_one_clean_run():
    rows = [
        _row(impl="copy", commit="aaaaaaa", date="2026-01-01", source="a.csv"),
        _row(impl="ropekit", commit="aaaaaaa", date="2026-01-01", ratio="1.3", source="a.csv"),
        _row(impl="copy", commit="bbbbbbb", date="2026-01-02", source="b.csv"),
        _row(impl="ropekit", commit="bbbbbbb", date="2026-01-02", ratio="0.99", source="b.csv"),
        _row(impl="ropekit", commit="new", date="2026-01-03", ratio="5.0", source="ab.csv"),  # an A/B label
        _row(impl="ropekit", commit="ccccccc+dirty", date="2026-01-04", ratio="5.0", source="d.csv"),
        _row(impl="ropekit", gpu="NVIDIA H200", commit="ddddddd", date="2026-01-01", ratio="1.2", source="h.csv"),
    ]
    by_card = summary.newest_runs(rows)
    assert sorted(by_card) == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    assert {(r["impl"], r["commit"]) for r in by_card["NVIDIA H100 80GB HBM3"]} == {("copy", "bbbbbbb"),
                                                                                  ("ropekit", "bbbbbbb")}
    assert summary.card_slug("NVIDIA H100 80GB HBM3") == "h100" and summary.card_slug("NVIDIA H200") == "h200"


def test_a_run_of_some_implementations_keeps_the_others_last_figures():
    """A newer run that timed only some implementations of a case (a new variant beside the baseline) adds its rows
    and hides none of the older run's; the implementations both timed come from the newer run. A target that
    compares two implementations pairs rows of one run only, so ropekit from one run never meets the unfused code
    from another."""
    kv = dict(case="m/bf16/neox/batch/cache-bf16/64x1", mode="kv-decode")
    rows = [
        _row(impl="copy-kv", commit="aaaaaaa", date="2026-01-01", source="a.csv", **kv),
        _row(impl="ropekit-kv-write", commit="aaaaaaa", date="2026-01-01", source="a.csv", **kv),
        _row(impl="unfused-kv", commit="aaaaaaa", date="2026-01-01", source="a.csv", **kv),
        _row(impl="copy-kv", commit="bbbbbbb", date="2026-01-02", source="b.csv", **kv),
        _row(impl="ropekit-kv-write-paged-x", commit="bbbbbbb", date="2026-01-02", ratio="1.5", source="b.csv", **kv),
    ]
    kept = {(r["impl"], r["source"]) for r in summary.newest_runs(rows)["NVIDIA H100 80GB HBM3"]}
    assert kept == {("copy-kv", "b.csv"), ("ropekit-kv-write-paged-x", "b.csv"), ("ropekit-kv-write", "a.csv"),
                    ("unfused-kv", "a.csv")}
    newer = [_row(impl="ropekit-kv-write", commit="ccccccc", date="2026-01-03", source="c.csv", **kv)]
    versus = Target(key="t", text="t", limit=0.5, mode="kv-decode", impl="ropekit-kv-write", versus="unfused-kv")
    (paired,) = evaluate_targets(summary.newest_runs(rows)["NVIDIA H100 80GB HBM3"], (versus,))
    (unpaired,) = evaluate_targets(summary.newest_runs(rows + newer)["NVIDIA H100 80GB HBM3"], (versus,))
    assert paired["cases"] == 1 and unpaired["cases"] == 0 and unpaired["worst"] is None


def test_markdown_has_a_table_per_card_and_mode_and_a_line_per_target():
    targets = targets_from_registry(bench_cases.load_registry(str(REGISTRY)))
    rows = [_row(ratio="1.005", source="a.csv"), _row(case="m/bf16/neox/range/8x4096", ratio="1.2", source="a.csv")]
    page = summary.markdown(summary.newest_runs(rows), targets, "benchmarks/results/latest")
    assert "## NVIDIA H100 80GB HBM3" in page and "### fwd" in page and "### decode" in page
    fwd_large = next(line for line in page.splitlines() if line.startswith("| fwd, >= 100 MB moved, vs copy |"))
    assert "1.200" in fwd_large and "**missed**" in fwd_large and "m/bf16/neox/range/8x4096" in fwd_large
    decode = next(line for line in page.splitlines() if line.startswith("| decode 1-64 tokens"))
    assert "not measured" in decode


def _attention_rows(gpu="NVIDIA H100 80GB HBM3"):
    rows = []
    for case in ("llama3-8b/bf16/neox/range/causal/8x1024", "mla-rope/bf16/neox/range/causal/8x1024"):
        for impl, us in (("rope+sdpa-cudnn", 1000.0), ("ropekit", 900.0), ("sdpa-cudnn", 800.0),
                         ("rope+flex", 1100.0)):
            if impl == "rope+flex" and case.startswith("mla"):
                continue  # skipped there (Dv != D): no time
            rows.append(_row(case=case, mode="attn-fwd", impl=impl, gpu=gpu, source="a.csv", flops="600000000000",
                             tflops=f"{6e11 / us / 1e6:.4g}", ratio=f"{us / 1000:.4f}"))
            rows[-1]["median_us"] = str(us)
    return rows


def test_markdown_has_the_attention_targets_and_throughput():
    targets = targets_from_registry(bench_cases.load_registry(str(REGISTRY)))
    rows = _attention_rows() + [_row(ratio="1.005", source="a.csv")]
    page = summary.markdown(summary.newest_runs(rows), targets, "benchmarks/results/latest")
    assert "### attn-fwd" in page and "### attn-fwdbwd" in page
    assert page.index("### norm-fwdbwd") < page.index("### attn-fwd") < page.index("### attn-fwdbwd")
    lines = page.splitlines()
    flex = next(line for line in lines if line.startswith("| required: rope_attention fwd vs apply_rope + flex"))
    assert "0.818" in flex and "**met**" in flex and "| 1 |" in flex  # 900 / 1100, the one case with a flex row
    moon = next(line for line in lines if line.startswith("| moonshot: rope_attention fwd vs SDPA cuDNN"))
    assert "1.125" in moon and "**missed**" in moon
    assert "not measured" in next(line for line in lines if line.startswith("| required: rope_attention fwd+bwd"))
    header = "| case | ropekit | rope+sdpa-cudnn | sdpa-cudnn | rope+flex |"
    at = lines.index(header)
    assert lines[at + 2] == "| llama3-8b/bf16/neox/range/causal/8x1024 | 666.7 (0.900) | 600 (1.000) | 750 (0.800) | " \
                            "545.5 (1.100) |"
    assert lines[at + 3].startswith("| mla-rope/bf16/neox/range/causal/8x1024 | 666.7 (0.900) |")
    assert lines[at + 3].endswith(" | - |")  # no flex row there
    assert header not in page.split("### attn-fwdbwd")[1]  # no rows of that mode: no throughput table


def test_latest_csv_carries_flops_where_a_card_has_attention_rows(tmp_path):
    rows = _attention_rows() + [_row(gpu="NVIDIA H200", source="h.csv")]
    by_card = summary.newest_runs(rows)
    summary.write_latest(by_card, tmp_path, plot=False)
    h100 = lzma.decompress((tmp_path / "h100" / "results.csv.xz").read_bytes()).decode().splitlines()
    h200 = lzma.decompress((tmp_path / "h200" / "results.csv.xz").read_bytes()).decode().splitlines()
    assert h200[0] == ",".join(summary.LATEST_FIELDS)  # no attention rows: the columns stay as they were
    assert h100[0] == ",".join(summary.latest_fields(by_card["NVIDIA H100 80GB HBM3"]))
    assert ",gbps,flops,tflops,ratio_vs_copy," in h100[0] and len(h100) == len(by_card["NVIDIA H100 80GB HBM3"]) + 1


def test_latest_without_plotting_keeps_the_cards_plots(tmp_path):
    """``--no-plot`` rewrites a card's CSV and leaves its plots (it once deleted them with the stale files)."""
    rows = [_row(gpu="NVIDIA H200", source="h.csv")]
    folder = tmp_path / "h200"
    folder.mkdir()
    (folder / "results-fwd.png").write_bytes(b"png")
    (folder / "old.csv").write_text("stale")
    summary.write_latest(summary.newest_runs(rows), tmp_path, plot=False)
    assert sorted(p.name for p in folder.iterdir()) == ["results-fwd.png", "results.csv.xz"]
    assert (folder / "results-fwd.png").read_bytes() == b"png"


def test_prune_keeps_the_newest_runs_and_forms_gbps_again(tmp_path):
    # --prune rewrites the history as the rows that give the newest results, without the derivable gbps; the page
    # and each card's rows come out as they did from the whole history.
    results = tmp_path / "results"
    history = results / "all_runs.csv.xz"
    old, new = dict(_row(impl="copy"), median_us="12.5"), _row(commit="1234567", date="2026-02-01T00:00")
    report.append_history(history, [_row(), old], "first.csv")
    report.append_history(history, [new, dict(_row(commit="1234567", mode="host"), bytes="")], "second.csv")
    args = ["--results", str(results), "--no-plot", "--registry", str(REGISTRY)]
    for prune in ([], ["--prune"]):
        assert summary.main([*args, "--out", str(tmp_path / f"page{len(prune)}.md"), *prune]) == 0
    assert (tmp_path / "page0.md").read_text() == (tmp_path / "page1.md").read_text()
    kept = list(csv.DictReader(io.StringIO(report.read_text(history))))  # one stream, gbps dropped
    assert len(kept) == 3 and {r["gbps"] for r in kept} == {""}
    got = report.read_history(history)
    assert [(r["commit"], r["impl"], r["mode"]) for r in got] == [("abcdef1", "copy", "fwd"),
                                                                  ("1234567", "ropekit", "fwd"),
                                                                  ("1234567", "ropekit", "host")]
    assert [r["gbps"] for r in got] == ["1.6e+04", "2e+04", ""]  # 200 MB in 12.5 and 10 us; none for host time


def test_benchmarks_md_is_generated_from_the_kept_history():
    """BENCHMARKS.md is what ``python -m ropekit.bench.summary`` writes from the history (never edited by hand),
    and each card's kept rows are those of the history's newest runs."""
    targets = targets_from_registry(bench_cases.load_registry(str(REGISTRY)))
    by_card = summary.newest_runs(report.read_history(HISTORY))
    e2e = summary.read_e2e(ROOT / "benchmarks" / "results" / "e2e.csv.xz")
    assert (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8") == summary.markdown(
        by_card, targets, "benchmarks/results/latest", e2e)
    for gpu, rows in by_card.items():
        latest = ROOT / "benchmarks" / "results" / "latest" / summary.card_slug(gpu) / "results.csv.xz"
        kept = lzma.decompress(latest.read_bytes()).decode("utf-8").splitlines()
        assert kept[0] == ",".join(summary.latest_fields(rows)) and len(kept) == len(rows) + 1


def test_end_to_end_rows_render_the_newest_run_per_card_and_model():
    """The page's end-to-end section: per (card, model) the newest run's rows only, each with its spread, host time,
    ratio and verdict, failures shown with their error, a "never slower" line per run naming the SLOWER rows, CPU
    smoke rows left out, and older rows (no spread measured) shown without a verdict."""
    def row(date, variant, kind, ms, **extra):
        return dict(date=date, commit="abc1234", torch="2.11", model="qwen3", device="NVIDIA H200", variant=variant,
                    kind=kind, batch="4", seq="2048", ms=str(ms), tokens_per_s="1000", vs_sdpa=str(ms / 10),
                    same_tokens="", tiny="False", error="", **extra)

    def judged(date, variant, kind, ms, verdict, **extra):
        return row(date, variant, kind, ms, spread="0.02", host_ms="3.5", vs_sdpa_spread="0.015", verdict=verdict,
                   **extra)

    rows = [row("2026-11-01T00:00:00", "sdpa", "train", 99.0),
            judged("2026-11-02T00:00:00", "sdpa", "train", 10.0, "-"),
            judged("2026-11-02T00:00:00", "ropekit", "train", 9.0, "faster"),
            judged("2026-11-02T00:00:00", "liger-rope", "train", 12.0, "SLOWER"),  # not ropekit's: not named
            judged("2026-11-02T00:00:00", "ropekit", "decode", 13.5, "SLOWER", py_calls="1500.0", aten_ops="300",
                   kernels="250.0"),
            dict(row("2026-11-02T00:00:00", "liger", "train", float("nan")), error="ImportError: x"),
            dict(row("2026-11-03T00:00:00", "sdpa", "train", 1.0), device="none (CPU x86_64)", tiny="True"),
            dict(row("2026-11-01T00:00:00", "ropekit", "train", 9.0), model="llama")]
    page = summary.markdown({}, (), "benchmarks/results/latest", rows)
    section = page.split("## End to end")[1]
    assert "### NVIDIA H200, qwen3 (2026-11-02, abc1234" in section
    assert "| train | 4 | ropekit | 9.000 ± 2.0 % | 3.500 | 1000 | 0.900 ± 0.015 | faster |  |" in section
    assert "ropekit never slower than sdpa: no: ropekit decode batch 4 (1.350)" in section
    assert "| 3.500 (1500 Python calls, 300 aten ops, 250 kernels) |" in section
    assert "failed: ImportError: x" in section
    assert "99.000" not in section and "none (CPU" not in section
    llama = section.split("### NVIDIA H200, llama")[1].split("###")[0]
    assert "| train | 4 | ropekit | 9.000 | - | 1000 | 0.900 | - |  |" in llama
    assert "ropekit never slower than sdpa: not judged (this run measured no spread)" in llama
    assert "End to end" not in summary.markdown({}, (), "benchmarks/results/latest")
