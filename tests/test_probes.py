"""The probes under ``benchmarks/probes/`` stay runnable: each one's ``--help`` exits 0 on any machine (the options
are parsed before torch, Triton or ropekit internals are imported), and the GPU suite script parses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBES = ROOT / "benchmarks" / "probes"
# Modules whose names start with "_" are helpers the probes share, not probes.
SCRIPTS = sorted(p for p in PROBES.glob("*.py") if not p.name.startswith("_"))


def test_the_probes_folder_has_the_probes():
    names = {p.name for p in SCRIPTS}
    assert {"tune.py", "decode_probe.py", "decode_floor.py", "host_time.py", "hf_patch_gpu.py",
            "webgpu_device_smoke.py"} <= names
    readme = (PROBES / "README.md").read_text(encoding="utf-8")
    for name in sorted(names) + ["gpu_suite.sh"]:
        assert f"`{name}`" in readme, f"benchmarks/probes/README.md has no entry for {name}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_probe_help_exits_zero(script):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, str(script), "--help"], env=env, capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:500]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_gpu_suite_script_parses():
    proc = subprocess.run(["bash", "-n", str(PROBES / "gpu_suite.sh")], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_sass_count_reads_issue_cycles_from_the_control_codes(monkeypatch):
    """The stall count is the control code's last field, in hex; the branch ends at its first EXIT."""
    monkeypatch.syspath_prepend(str(PROBES))
    import sass_count

    class Compiled:
        asm = {"sass": "\n".join([
            "Function:rope_kernel",
            "--:-:0:-:8\tLDC R1, c[0x0][0x28];",
            "--:-:3:-:a\t@!P0 LDG.E.64 R6, desc[UR6][R18.64];",
            "08:-:-:Y:1\tIMAD R0, R6, R2, RZ;",
            "--:-:-:-:2\tSTG.E.64 desc[UR6][R2.64], R0;",
            "--:-:-:-:5\tEXIT;",
            "--:-:-:-:1\tLDG.E R1, desc[UR6][R2.64];",
        ])}

    ops, cycles = sass_count._branch(Compiled)
    assert ops == ["LDC", "LDG", "IMAD", "STG"]
    assert cycles == [0, 8, 18, 19]
    assert sass_count._memory_cycles(ops, cycles) == "loads @8  first store @19"
