"""The ``ropekit`` command: ``check`` reports the backends it skips (absence simulated, nothing uninstalled), its
table never cuts a device name, and start-up stays lazy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ropekit import check

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^\d+ passed, \d+ failed(, \d+ skipped)?$")


def _run_check(capsys) -> list[str]:
    assert check.main([]) == 0
    return capsys.readouterr().out.splitlines()


def test_check_lists_backends_missing_their_packages(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "triton", None)  # find_spec and import both see it absent
    monkeypatch.setitem(sys.modules, "wgpu", None)
    lines = _run_check(capsys)
    n_triton = len(check._case_table("cpu", True)) + check._PROLOGUE_ROWS + check._ATTENTION_ROWS
    backend = "cuda" if check.torch.cuda.is_available() else "triton-interpreter"
    assert any(line.startswith(f"skipped {backend} ({n_triton} cases)") and 'pip install "ropekit[triton]"' in line
               for line in lines), lines
    assert any(line.startswith("skipped webgpu") and 'pip install "ropekit[webgpu]"' in line for line in lines), lines
    assert SUMMARY.match(lines[-1]), lines[-1]
    assert lines[-1].endswith(f", {n_triton + check._webgpu_case_count()} skipped")
    assert not any(line.startswith(("triton-interpreter ", "webgpu ")) for line in lines)


def test_check_lists_webgpu_without_an_adapter(monkeypatch, capsys):
    webgpu = pytest.importorskip("ropekit.webgpu")
    pytest.importorskip("wgpu")

    def no_adapter():
        raise RuntimeError("no WebGPU adapter (none found); install a driver")

    monkeypatch.setattr(webgpu, "default_runner", no_adapter)
    monkeypatch.setattr(check, "_triton_missing", lambda: "simulated")  # keep the test fast
    lines = _run_check(capsys)
    assert any(line.startswith("skipped webgpu") and "no wgpu adapter found" in line for line in lines), lines
    assert SUMMARY.match(lines[-1]), lines[-1]


def test_webgpu_case_count_matches_the_module():
    webgpu = pytest.importorskip("ropekit.webgpu")
    assert check._WEBGPU_CASES == len(webgpu._CHECK_CASES)


def test_prologue_rows_count_and_pass_on_the_cpu_path():
    # The rows `ropekit check` reports for the prologue (and counts as skipped without Triton), on the float64
    # CPU path; they run through the kernels in the check's own run.
    rows = check._prologue_rows("cpu", "cpu")
    assert len(rows) == check._PROLOGUE_ROWS
    assert all(row.passed for row in rows), [(r.case, r.max_error, r.tolerance) for r in rows]


def test_attention_rows_count_and_pass_on_the_cpu_path():
    rows = check._attention_rows("cpu", "cpu")
    assert len(rows) == check._ATTENTION_ROWS
    assert all(row.passed for row in rows), [(r.case, r.max_error, r.tolerance) for r in rows]


def test_check_table_keeps_long_device_names_whole(monkeypatch):
    gpu = "NVIDIA H100 80GB HBM3 (a long name that must not be cut)"
    monkeypatch.setattr(check, "_device_name", lambda backend: gpu)
    adapter = "llvmpipe (LLVM 15.0.6, 256 bits) (Vulkan, CPU)"
    rows = [check.CheckRow("cuda", "cuda", "case a", 1e-7, 2e-6),
            check.CheckRow("webgpu", adapter, "case b", 1e-3, 1e-5)]
    lines = check.format_table(rows, [])
    assert gpu in lines[1] and adapter in lines[2]
    starts = {line.index("case ") for line in lines[1:3]} | {lines[0].index("case")}
    assert len(starts) == 1  # the columns stay aligned
    assert lines[-1] == "1 passed, 1 failed"


def test_help_imports_no_subcommand_module():
    """``ropekit --help`` routes without importing a subcommand's module (nor triton, matplotlib, wgpu).
    torch itself is imported by ``ropekit/__init__.py`` before the CLI runs."""
    code = ("import sys, contextlib, io\n"
            "from ropekit.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n"
            "        main(['--help'])\n"
            "    except SystemExit:\n"
            "        pass\n"
            "heavy = ('ropekit.bench', 'ropekit.check', 'ropekit.plot', 'triton', 'matplotlib', 'wgpu')\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
