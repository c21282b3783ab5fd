"""``python -m ropekit.bench.cpu``: ropekit's CPU path timed against transformers' ``apply_rotary_pos_emb``, run at
a tiny size (timings of a CI machine are not figures; the table's shape and contents are checked)."""

from __future__ import annotations

import pytest

from ropekit.bench import cpu


def test_measure_rows_and_table():
    pytest.importorskip("transformers")
    import torch

    rows = cpu.measure([(2, 3)], [torch.bfloat16], heads=2, kv_heads=1, head_dim=16, warmup=1, min_calls=2,
                       budget_s=0.0)
    assert [(r["positions"], r["dtype"], r["batch"], r["seqlen"]) for r in rows] == [
        ("ids", "bfloat16", 2, 3), ("offset", "bfloat16", 2, 3)]
    for r in rows:
        assert r["ropekit_us"] > 0 and r["hf_us"] > 0 and r["ratio"] == pytest.approx(r["ropekit_us"] / r["hf_us"])
    table = cpu.format_rows(rows).splitlines()
    assert len(table) == 3 and "ropekit/hf" in table[0] and table[1].split()[2] == "ids"


def test_main_prints_threads_and_a_row_per_case(capsys):
    pytest.importorskip("transformers")
    import torch

    threads = torch.get_num_threads()
    try:
        code = cpu.main(["--sizes", "1x1", "--dtypes", "float32", "--heads", "2", "--kv-heads", "1", "--head-dim",
                         "8", "--budget-s", "0", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    out = capsys.readouterr().out.splitlines()
    assert "1 threads" in out[0]
    assert [line.split()[:3] for line in out[2:]] == [["float32", "1x1", "ids"], ["float32", "1x1", "offset"]]


def test_without_transformers_only_ropekit_is_timed(monkeypatch):
    import torch

    monkeypatch.setattr(cpu, "hf_rotation", lambda: None)
    rows = cpu.measure([(1, 1)], [torch.float32], heads=1, kv_heads=1, head_dim=8, warmup=0, min_calls=1,
                       budget_s=0.0)
    assert all(r["hf_us"] is None and r["ratio"] is None for r in rows)
    assert cpu.format_rows(rows).splitlines()[1].split()[-2:] == ["-", "-"]
