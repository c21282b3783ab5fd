"""The end-to-end harness (``python -m ropekit.bench.e2e``) on CPU with tiny models: every variant runs, Liger's are
skipped with a reason where it does not import (and run through its public functions where a stand-in provides
them), the variants take turns, and the verdict logic on synthetic numbers."""

from __future__ import annotations

import csv
import importlib
import math
import os
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
try:
    import ropekit.bench  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(ROOT / "src"))
from ropekit.bench import e2e  # noqa: E402

TINY_RUN = ["--tiny", "--device", "cpu", "--batch", "2", "--seq", "16", "--decode-batches", "2", "--prompt", "4",
            "--rounds", "3", "--train-steps", "1", "--decode-steps", "2", "--budget", "30"]


# ------------------------------------------------------------------------------------------ verdict and statistics


@pytest.mark.parametrize("ratio, spread, want", [
    (0.75, 0.02, "faster"), (0.96, 0.03, "faster"),
    (1.02, 0.05, "within noise"), (0.97, 0.05, "within noise"),
    (1.005, 0.0, "within noise"),  # inside the 1 % floor however tight the rounds
    (1.35, 0.03, "SLOWER"), (1.04, 0.02, "SLOWER"),
    (math.nan, 0.01, "-"),
])
def test_verdict_against_the_measured_noise(ratio, spread, want):
    assert e2e.verdict(ratio, spread) == want


def test_summarise_pairs_each_round_with_the_baselines_round():
    """The ratio is the median of per-round ratios: a drift that slows every variant in one round (round 2 here)
    cancels; a variant whose rounds straddle 1.0 is within noise; one slower in every round is SLOWER."""
    base = [10.0, 20.0, 10.2]
    stats = e2e.summarise({"sdpa": base, "fast": [7.5, 15.0, 7.6], "noisy": [9.0, 23.0, 10.0],
                           "slow": [13.5, 27.0, 13.8]})
    assert stats["sdpa"]["verdict"] == "-" and stats["sdpa"]["ratio"] == 1.0
    assert stats["sdpa"]["ms"] == 10.2 and stats["sdpa"]["spread"] == pytest.approx(5.0 / 10.2)
    assert stats["fast"]["ratio"] == pytest.approx(0.75) and stats["fast"]["verdict"] == "faster"
    assert stats["fast"]["ratio_spread"] == pytest.approx((0.75 - 7.6 / 10.2) / 2)
    assert stats["noisy"]["verdict"] == "within noise"
    assert stats["slow"]["ratio"] == pytest.approx(1.35) and stats["slow"]["verdict"] == "SLOWER"
    partial = e2e.summarise({"sdpa": base, "cut": [8.0, 8.0]})  # a variant that left the measurement early
    assert math.isnan(partial["cut"]["ratio"]) and partial["cut"]["verdict"] == "-"


def test_plan_fits_the_budget_cutting_steps_then_rounds():
    p = e2e.plan(probe_s=0.7, rounds=5, max_steps=3, budget_s=8.0)  # five 0.14 s training steps per turn
    assert (p.rounds, p.steps) == (5, 2) and p.seconds <= 8.0
    assert (e2e.plan(0.001, 5, 8, 8.0).rounds, e2e.plan(0.001, 5, 8, 8.0).steps) == (5, 8)
    p = e2e.plan(probe_s=2.0, rounds=5, max_steps=3, budget_s=8.0)
    assert (p.rounds, p.steps) == (4, 1) and p.seconds <= 8.0
    p = e2e.plan(probe_s=10.0, rounds=5, max_steps=3, budget_s=8.0)  # never fewer than MIN_ROUNDS
    assert (p.rounds, p.steps) == (e2e.MIN_ROUNDS, 1)


# ------------------------------------------------------------------------------------------------------- the CSV


@pytest.mark.parametrize("name", ["e2e.csv", "e2e.csv.xz"])  # the kept file is xz, appended stream by stream
def test_append_keeps_the_rows_of_an_older_header(tmp_path, name):
    from ropekit.bench.report import open_text
    from ropekit.bench.summary import read_e2e

    path = tmp_path / name
    old = ["date", "commit", "torch", "model", "device", "variant", "kind", "batch", "seq", "ms", "tokens_per_s",
           "vs_sdpa", "same_tokens", "tiny", "error"]
    with open_text(path, "w") as f:
        w = csv.DictWriter(f, fieldnames=old)
        w.writeheader()
        w.writerow({k: "old" for k in old})
    e2e.append_csv(path, [dict(variant="ropekit", verdict="faster", spread=0.01)])
    e2e.append_csv(path, [dict(variant="sdpa", verdict="-")])
    rows = read_e2e(path)
    assert list(rows[0]) == list(e2e.CSV_FIELDS)
    assert rows[0]["ms"] == "old" and rows[0]["verdict"] == ""
    assert [(r["variant"], r["verdict"]) for r in rows[1:]] == [("ropekit", "faster"), ("sdpa", "-")]


# -------------------------------------------------------------------------------------------------- the harness


def _stand_in_liger(calls: list[str]) -> types.ModuleType:
    """``liger_kernel.transformers`` with ``apply_liger_kernel_to_{qwen3,llama}`` of Liger's signature: the RoPE
    switch swaps the modeling module's ``apply_rotary_pos_emb`` for a counting wrapper (as Liger swaps in its own);
    the fused cross-entropy switch gives the instance a forward of its own (as Liger's does)."""
    module = types.ModuleType("liger_kernel.transformers")

    def make(family: str):
        def apply(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True,
                  model=None):
            modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
            original = modeling.apply_rotary_pos_emb

            def rope_stand_in(*args, **kwargs):
                calls.append(family)
                return original(*args, **kwargs)

            if rope:
                modeling.apply_rotary_pos_emb = rope_stand_in
            if fused_linear_cross_entropy and model is not None:
                model.forward = types.MethodType(type(model).forward, model)
        return apply

    module.apply_liger_kernel_to_qwen3 = make("qwen3")
    module.apply_liger_kernel_to_llama = make("llama")
    return module


def test_every_variant_runs_a_short_step_of_both_models(monkeypatch, tmp_path, capsys):
    """In one process (``--in-process``): each model's five variants (Liger's through a stand-in of its public
    functions) give train and decode rows, decode the sdpa tokens, and leave the modeling modules and ropekit's
    module-level state as they were."""
    pytest.importorskip("transformers")
    from ropekit.integrations import patching

    calls: list[str] = []
    package = types.ModuleType("liger_kernel")
    package.transformers = _stand_in_liger(calls)
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", package.transformers)
    modelings = {m: importlib.import_module(f"transformers.models.{m}.modeling_{m}") for m in e2e.CONFIGS}
    before = {m: mod.apply_rotary_pos_emb for m, mod in modelings.items()}
    refs = {k: n for k, n in patching._GLOBAL_REFS.items() if n}
    out = tmp_path / "e2e.csv"
    assert e2e.main([*TINY_RUN, "--in-process", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert {(r["model"], r["variant"], r["kind"]) for r in rows} == {
        (m, v, k) for m in e2e.CONFIGS for v in e2e.VARIANTS for k in ("train", "decode")}
    for r in rows:
        assert not r["error"] and float(r["ms"]) > 0 and float(r["host_ms"]) > 0, r
        assert int(r["rounds"]) == 3 and r["verdict"] in ("-", "faster", "within noise", "SLOWER")
        if r["kind"] == "decode":
            assert r["same_tokens"] == "10/10", r  # prefill, 2 warm-up, 1 probe and 3 x 2 timed tokens
            assert float(r["py_calls"]) > 0 and float(r["aten_ops"]) > 0 and float(r["kernels"]) == 0
    assert set(calls) == set(e2e.CONFIGS)
    assert {m: mod.apply_rotary_pos_emb for m, mod in modelings.items()} == before
    assert {k: n for k, n in patching._GLOBAL_REFS.items() if n} == refs
    printed = capsys.readouterr().out
    assert "planned" in printed and "ropekit never slower than sdpa:" in printed


def test_a_variant_changes_the_modeling_module_only_while_it_runs(monkeypatch):
    pytest.importorskip("transformers")
    import torch

    package = types.ModuleType("liger_kernel")
    package.transformers = _stand_in_liger([])
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", package.transformers)
    modeling = importlib.import_module("transformers.models.qwen3.modeling_qwen3")
    original = modeling.apply_rotary_pos_emb
    built, failed = e2e.build_variants("qwen3", ["sdpa", "ropekit", "liger-rope"], torch.device("cpu"),
                                       torch.float32, True, lambda line: None)
    try:
        assert not failed
        by_name = {v.name: v for v in built}
        assert modeling.apply_rotary_pos_emb is original
        with by_name["sdpa"].active():
            assert modeling.apply_rotary_pos_emb is original
        with by_name["liger-rope"].active():
            assert modeling.apply_rotary_pos_emb.__name__ == "rope_stand_in"
        with by_name["ropekit"].active():
            assert hasattr(modeling.apply_rotary_pos_emb, "_ropekit_original")
        assert modeling.apply_rotary_pos_emb is original
        assert by_name["liger-rope"].model is not by_name["sdpa"].model  # a copy of the same weights each
        for a, b in zip(by_name["sdpa"].model.parameters(), by_name["liger-rope"].model.parameters()):
            assert torch.equal(a, b)
    finally:
        e2e.release(built)
    assert modeling.apply_rotary_pos_emb is original


def test_liger_variants_skip_with_a_reason_where_liger_does_not_import(monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import liger_kernel raises ImportError
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    assert "liger_kernel not importable" in e2e.unavailable("liger-rope", "qwen3")
    assert e2e.unavailable("ropekit", "qwen3") is None
    assert e2e.main([*TINY_RUN, "--in-process", "--models", "qwen3", "--variants", "sdpa,liger-rope,liger"]) == 0
    printed = capsys.readouterr().out
    assert "liger-rope: skipped (liger_kernel not importable" in printed
    assert "liger: skipped (liger_kernel not importable" in printed


def test_e2e_harness_smoke_on_cpu(tmp_path, monkeypatch, capsys):
    """``python -m ropekit.bench.e2e --tiny``: a child process per model reporting as it goes, one table, CSV rows
    with the ratio to sdpa, its verdict and the greedy tokens compared (a patched model decodes the same tokens as
    the unpatched one)."""
    pytest.importorskip("transformers")
    src = str(ROOT / "src")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "e2e.csv"
    rc = e2e.main([*TINY_RUN, "--models", "llama", "--variants", "sdpa,ropekit", "--csv", str(out)])
    assert rc == 0
    rows = list(csv.DictReader(out.open()))
    assert {(r["variant"], r["kind"]) for r in rows} == {(v, k) for v in ("sdpa", "ropekit")
                                                         for k in ("train", "decode")}
    for r in rows:
        assert float(r["ms"]) > 0 and r["model"] == "llama" and r["tiny"] == "True"
        if r["kind"] == "decode":
            assert r["same_tokens"] == "10/10"
    assert "timed in" in capsys.readouterr().out


def test_a_child_past_its_timeout_is_killed_and_reported(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    src = str(ROOT / "src")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    out = tmp_path / "e2e.csv"
    assert e2e.main([*TINY_RUN, "--models", "llama", "--variants", "sdpa", "--timeout", "0.5", "--csv",
                     str(out)]) == 1
    rows = list(csv.DictReader(out.open()))
    assert [(r["variant"], r["kind"], r["error"]) for r in rows] == [("-", "run", "timed out after 0.5 s")]


@pytest.mark.gpu
def test_every_variant_runs_on_the_gpu_with_graphs_and_the_host_profile(tmp_path, monkeypatch):
    """The GPU-only parts with tiny models: bf16, decoding captured in CUDA graphs, CUDA events and the profiler's
    kernel counts; Liger's variants run where it imports and are skipped otherwise. Every row has a time and
    decodes the same greedy tokens as sdpa on the first sequence, but for bf16 rounding (at most two). (Liger's rows
    may carry an error of Liger's: they are reported, not checked here.)"""
    pytest.importorskip("transformers")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "e2e.csv"
    argv = [a if a != "cpu" else "cuda" for a in TINY_RUN]
    assert e2e.main([*argv, "--in-process", "--decode-batches", "1,4", "--csv", str(out)]) == 0
    rows = [r for r in csv.DictReader(out.open()) if not r["variant"].startswith("liger")]
    kinds = {(r["model"], r["kind"], r["batch"]) for r in rows}
    assert kinds == {(m, k, b) for m in e2e.CONFIGS for k, b in (("train", "2"), ("decode", "1"), ("decode", "4"),
                                                                  ("decode-graph", "1"), ("decode-graph", "4"))}
    for r in rows:
        assert not r["error"] and float(r["ms"]) > 0, r
        if r["kind"].startswith("decode"):
            same, total = map(int, r["same_tokens"].split("/"))
            assert same >= total - 2, r
        if r["kind"] == "decode":
            assert float(r["kernels"]) > 0 and float(r["host_ms"]) > 0, r
