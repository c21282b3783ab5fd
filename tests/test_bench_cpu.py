"""The CPU measurement: ``python -m ropekit.bench.cpu``'s table and ``ropekit bench --preset cpu``'s rows (the mode
"cpu"), ropekit's float32 path timed against transformers' ``apply_rotary_pos_emb``, and BENCHMARKS.md's CPU table
made from such rows. Run at tiny sizes with no time budget (timings of a CI machine are not figures; the rows'
shape and contents are checked)."""

from __future__ import annotations

import csv
import dataclasses

import pytest
import torch

from ropekit.bench import cases as bench_cases
from ropekit.bench import cli, cpu, report, run, summary
from ropekit.bench import env as bench_env
from ropekit.bench.peers import Peers, load_peers
from ropekit.bench.targets import targets_from_registry
from ropekit.bench.timing import Timer

CPU_IMPLS = ["hf", "hf-first-layer", "ropekit", "ropekit-first-layer"]


def test_measure_rows_and_table():
    pytest.importorskip("transformers")
    rows = cpu.measure([(2, 3)], [torch.bfloat16], heads=2, kv_heads=1, head_dim=16, warmup=1, min_calls=2,
                       budget_s=0.0)
    assert [(r["positions"], r["first_layer"], r["dtype"], r["batch"], r["seqlen"]) for r in rows] == [
        ("ids", False, "bfloat16", 2, 3), ("ids", True, "bfloat16", 2, 3),
        ("offset", False, "bfloat16", 2, 3), ("offset", True, "bfloat16", 2, 3)]
    for r in rows:
        assert r["ropekit_us"] > 0 and r["hf_us"] > 0 and r["ratio"] == pytest.approx(r["ropekit_us"] / r["hf_us"])
    # a first layer's partner is transformers' first layer (its cos/sin timed too), a later layer's hf's rotation
    assert rows[0]["hf_us"] != rows[1]["hf_us"]
    table = cpu.format_rows(rows).splitlines()
    assert len(table) == 5 and "ropekit/hf" in table[0]
    assert [line.split()[2:4] for line in table[1:]] == [["ids", "later"], ["ids", "first"], ["offset", "later"],
                                                         ["offset", "first"]]


def test_main_prints_threads_and_a_row_per_case(capsys):
    pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    try:
        code = cpu.main(["--sizes", "1x1", "--dtypes", "float32", "--heads", "2", "--kv-heads", "1", "--head-dim",
                         "8", "--budget-s", "0", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    out = capsys.readouterr().out.splitlines()
    assert "1 threads" in out[0]
    assert [line.split()[:4] for line in out[2:]] == [["float32", "1x1", "ids", "later"],
                                                      ["float32", "1x1", "ids", "first"],
                                                      ["float32", "1x1", "offset", "later"],
                                                      ["float32", "1x1", "offset", "first"]]


def test_without_transformers_only_ropekit_is_timed(monkeypatch):
    monkeypatch.setattr(cpu, "hf_rotation", lambda: None)
    rows = cpu.measure([(1, 1)], [torch.float32], heads=1, kv_heads=1, head_dim=8, warmup=0, min_calls=1,
                       budget_s=0.0)
    assert len(rows) == 4 and all(r["hf_us"] is None and r["ratio"] is None and r["ropekit_us"] > 0 for r in rows)
    assert cpu.format_rows(rows).splitlines()[1].split()[-2:] == ["-", "-"]


@pytest.mark.parametrize("positions", ["ids", "offset"])
def test_first_layer_calls_get_positions_new_to_each_call(positions):
    """The first-layer calls cycle over position sets one step apart, more of them than the float32 path keeps
    tables for, while the later-layer calls hand apply_rope the same positions every time."""
    import ropekit
    from ropekit.float32_path import RECENT_TABLES

    t = cpu.make_tensors(2, 3, torch.float32, heads=2, kv_heads=1, head_dim=16, base=10000.0,
                         generator=torch.Generator().manual_seed(0))
    calls = cpu.rotations(t, positions, 10000.0, None)
    assert list(calls) == ["ropekit", "ropekit-first-layer"]
    later = [calls["ropekit"]()[0] for _ in range(2)]
    assert torch.equal(later[0], later[1])
    shared = t["ids"] if positions == "ids" else cpu.OFFSET
    assert torch.equal(later[0], ropekit.apply_rope(t["q"], t["k"], positions=shared, base=10000.0)[0])
    first = [calls["ropekit-first-layer"]()[0] for _ in range(RECENT_TABLES.size + 4)]
    for step, out in enumerate(first, 1):  # positions ids + step (or offset + step): each call's own
        moved = t["ids"] + step if positions == "ids" else cpu.OFFSET + step
        assert torch.equal(out, ropekit.apply_rope(t["q"], t["k"], positions=moved, base=10000.0)[0])
    assert len({out.sum().item() for out in first}) == len(first)


@pytest.mark.parametrize("positions", ["ids", "offset"])
def test_transformers_first_layer_forms_cos_sin_for_new_positions(positions):
    """hf-first-layer runs transformers' rotary embedding for positions new to every call (the first-layer calls'
    positions, as position ids) and then its rotation: the same rotation as ropekit's first layer, call by call,
    within the bench's agreement bound (transformers forms its angles in float32)."""
    pytest.importorskip("transformers")
    from ropekit.testing import max_relative_error

    base = 500000.0
    t = cpu.make_tensors(2, 3, torch.float32, heads=2, kv_heads=1, head_dim=16, base=base,
                         generator=torch.Generator().manual_seed(0))
    calls = cpu.rotations(t, positions, base, cpu.hf_rotation(), cpu.hf_rotary_embedding(2, 1, 16, base))
    assert list(calls) == ["hf", "hf-first-layer", "ropekit", "ropekit-first-layer"]
    outs = [(calls["hf-first-layer"]()[0].transpose(1, 2), calls["ropekit-first-layer"]()[0]) for _ in range(3)]
    for hf, ours in outs:
        assert max_relative_error(hf, ours) <= run.MISMATCH  # a wrong position would be off by O(1)
    assert not torch.equal(outs[0][0], outs[1][0])  # each call's positions are new
    assert cpu.hf_rotary_embedding(2, 1, 16, base).inv_freq.shape == (8,)


def _cpu_case(positions="ids", dtype="bf16"):
    """A case of the cpu preset, shrunk to tiny heads."""
    registry = bench_cases.load_registry()
    case = next(c for c in bench_cases.expand_preset(registry, "cpu")
                if c.positions == positions and c.dtype == dtype)
    return dataclasses.replace(case, hq=2, hk=1, head_dim=16, rotary_dim=16, batch=2, seqlen=3)


def _timer():
    return Timer(torch.device("cpu"), interleaved_warmup=1, interleaved_min_calls=2, interleaved_budget_s=0.0)


def test_cpu_mode_rows_name_the_cpu_and_time_ropekit_against_hf():
    pytest.importorskip("transformers")
    case = _cpu_case()
    env = bench_env.environment(torch.device("cpu"), "test", cpu_measurement=True)
    logged = []
    rows = cpu.bench_rows(case, torch.device("cpu"), _timer(), load_peers({"hf"}, None), env, None, logged.append)
    assert [r["impl"] for r in rows] == CPU_IMPLS
    by_impl = {r["impl"]: r for r in rows}
    for r in rows:
        assert set(report.ROW_FIELDS) <= set(r)
        assert r["mode"] == "cpu" and r["baseline"] == "hf" and r["case"] == case.name
        assert r["gpu"].startswith("CPU: ") and r["gpu"].endswith(f", {torch.get_num_threads()} threads")
        assert r["label"] == bench_env.CPU_PERF_LABEL != bench_env.SMOKE_LABEL
        assert float(r["median_us"]) > 0 and float(r["gbps"]) > 0
        ratio = float(r["median_us"]) / float(by_impl["hf"]["median_us"])
        assert float(r["ratio_vs_copy"]) == pytest.approx(ratio, rel=1e-3)
        assert "MISMATCH" not in r["note"] and not r["note"].startswith(("skipped", "failed"))
    assert float(by_impl["hf"]["max_rel_diff"]) <= run.MISMATCH  # hf's output is ropekit's, up to its bf16 cos/sin
    assert by_impl["hf"]["impl_version"].startswith("transformers ")
    assert logged and logged[0].split()[0] == "cpu"


def test_cpu_mode_without_transformers_has_ropekit_rows_and_says_why():
    peers = Peers(missing={"hf": "transformers not importable: no module"})
    env = bench_env.environment(torch.device("cpu"), "test", cpu_measurement=True)
    rows = cpu.bench_rows(_cpu_case("offset", "fp32"), torch.device("cpu"), _timer(), peers, env, None,
                          lambda s: None)
    by_impl = {r["impl"]: r for r in rows}
    assert list(by_impl) == CPU_IMPLS
    assert not by_impl["hf"]["median_us"] and "transformers not importable" in by_impl["hf"]["note"]
    for impl in ("ropekit", "ropekit-first-layer"):
        assert float(by_impl[impl]["median_us"]) > 0 and by_impl[impl]["ratio_vs_copy"] == ""


@pytest.mark.parametrize("route", ["kernels_on_cpu", "reference_on_cpu"])
def test_cpu_mode_refuses_another_route_than_the_float32_path(monkeypatch, route):
    """Under ropekit.testing.kernels_on_cpu (the Triton interpreter) or reference_on_cpu (float64) the CPU rows
    would time another path than the float32 one: refused before anything is timed (the switch set directly, so
    that the test needs no TRITON_INTERPRET)."""
    from ropekit import _config

    monkeypatch.setattr(_config, route, True)
    with pytest.raises(RuntimeError, match="float32 path"):
        cpu.bench_rows(_cpu_case(), torch.device("cpu"), _timer(), Peers(), {}, None, lambda s: None)
    with pytest.raises(ValueError, match="CPU tensors"):
        cpu.bench_rows(_cpu_case(), torch.device("cuda"), _timer(), Peers(), {}, None, lambda s: None)


def test_cpu_group_rules():
    registry = bench_cases.load_registry()
    group = {"name": "g", "models": ["tiny"], "dtypes": ["fp32"], "styles": ["neox"], "positions": ["ids"],
             "sizes": [[1, 1]], "modes": ["cpu"]}
    for bad, match in ((dict(modes=["cpu", "fwd"]), "group of its own"), (dict(positions=["batch"]), "positions")):
        with pytest.raises(ValueError, match=match):
            bench_cases.expand_preset(dict(registry, PRESETS={"p": [dict(group, **bad)]}), "p")
    assert [c.modes for c in bench_cases.expand_preset(dict(registry, PRESETS={"p": [group]}), "p")] == [("cpu",)]


def test_cpu_preset_refuses_a_gpu_device(monkeypatch, capsys):
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: True)
    assert cli.main(["--preset", "cpu", "--device", "cuda"]) == 2
    assert "--device cpu" in capsys.readouterr().err


def _section(page, heading):
    """The part of ``page`` from ``heading`` to the next heading of its level."""
    rest = page[page.index(heading + "\n"):]
    end = rest.find("\n## ", 1)
    return rest if end < 0 else rest[:end]


def test_bench_preset_cpu_writes_rows_and_the_summary_renders_the_cpu_table(tmp_path, capsys):
    """``ropekit bench --preset cpu`` (two cases, no time budget) into a history, then BENCHMARKS.md from it: the CPU
    card has the CPU mode's targets and table, a GPU card beside it neither."""
    pytest.importorskip("transformers")
    history = tmp_path / "all_runs.csv.xz"
    argv = ["--preset", "cpu", "--filter", r"/bf16/neox/(ids|offset)/1x1$", "--cpu-budget-s", "0", "--no-plot",
            "--out", str(tmp_path / "out"), "--commit", "abc1234", "--history", str(history)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "Targets" in out and bench_env.SMOKE_LABEL not in out
    (written,) = (tmp_path / "out").glob("bench-*-cpu.csv")
    with written.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [(r["positions"], r["impl"]) for r in rows] == [(p, i) for p in ("ids", "offset") for i in CPU_IMPLS]
    assert {r["label"] for r in rows} == {bench_env.CPU_PERF_LABEL} and {r["mode"] for r in rows} == {"cpu"}

    kept = report.read_history(history)
    gpu_row = dict(kept[0], gpu="NVIDIA H100 80GB HBM3", mode="fwd", impl="ropekit", label=bench_env.PERF_LABEL)
    by_card = summary.newest_runs(kept + [gpu_row])
    card = kept[0]["gpu"]
    assert set(by_card) == {card, "NVIDIA H100 80GB HBM3"}
    assert summary.card_slug(card).startswith("cpu-") and summary.card_slug(card).endswith("-threads")
    page = summary.markdown(by_card, targets_from_registry(bench_cases.load_registry()), "latest")
    cpu_part, gpu_part = (_section(page, f"## {name}") for name in (card, "NVIDIA H100 80GB HBM3"))
    assert "### cpu" in cpu_part and "### fwd" not in cpu_part and "### cpu" not in gpu_part
    assert "CPU: apply_rope against transformers' apply_rotary_pos_emb" in cpu_part
    table = [line for line in cpu_part.splitlines() if line.startswith("| bf16 | 1x1 |")]
    assert len(table) == 1 and table[0].count(" us)") == 4  # a ratio with both times for each kind and layer
    hf = {(r["positions"], r["impl"]): float(r["median_us"]) for r in kept if r["impl"].startswith("hf")}
    ours = {(r["positions"], r["impl"]): float(r["median_us"]) for r in kept if r["impl"].startswith("ropekit")}
    cells = table[0].split(" | ")
    assert cells[2].startswith(f"{ours['ids', 'ropekit'] / hf['ids', 'hf']:.2f} (")
    # the first layer against transformers' first layer, marked
    assert cells[3].startswith(f"{ours['ids', 'ropekit-first-layer'] / hf['ids', 'hf-first-layer']:.2f}* (")
    written = summary.write_latest(by_card, tmp_path / "latest", plot=False)
    assert tmp_path / "latest" / summary.card_slug(card) / "results.csv.xz" in written
