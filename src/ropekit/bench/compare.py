"""``ropekit bench --base TREE``: the same cases timed on another version of ropekit in the same run, on the same
machine, and one table of this version against it.

A before/after claim needs both sides measured by one run: hosts differ by tens of percent in launch overhead and
GPUs by a few percent in bandwidth, so a number from an earlier run says little about a change. ``TREE`` is a
commit (checked out into a temporary git worktree) or a directory holding another ropekit checkout. Its bench runs
in a child process (two versions of one package cannot share a process) with the same arguments, limited to the
ropekit rows and the copy baseline; this version's rows are then matched to the base's by (case, mode, impl).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Options that must not pass to the base's run: where its results go and whether it plots or appends history are
# this run's business.
_OWN_OPTIONS = {"--base": 1, "--out": 1, "--history": 1, "--impls": 1, "--commit": 1, "--plot": 0, "--no-plot": 0}


def base_argv(argv: list[str]) -> list[str]:
    """``argv`` without the options that the base's run sets itself (with their values)."""
    out: list[str] = []
    skip = 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in _OWN_OPTIONS:
            skip = _OWN_OPTIONS[name] if "=" not in a else 0
            continue
        out.append(a)
    return out


@contextlib.contextmanager
def checkout(tree: str) -> Iterator[tuple[Path, str]]:
    """(the ``src`` directory to import ropekit from, a label) for ``tree``: a directory with ``src/ropekit``, or a
    commit of the current git checkout, checked out into a temporary worktree that is removed afterwards."""
    path = Path(tree)
    if (path / "src" / "ropekit").is_dir():
        yield path / "src", path.resolve().name
        return
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", f"{tree}^{{commit}}"], check=True,
                                capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ValueError(f"--base {tree!r} is neither a directory holding a ropekit checkout (src/ropekit) nor a "
                         "commit of this git checkout") from exc
    with tempfile.TemporaryDirectory(prefix="ropekit-base-") as tmp:
        work = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(work), commit], check=True)
        try:
            yield work / "src", commit
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(work)], check=False)


def run_base(tree: str, argv: list[str], out_dir: Path, impls: str | None) -> tuple[list[dict[str, Any]], str]:
    """Run ``ropekit bench`` of ``tree`` on ``argv`` (this run's arguments) and return (its rows, its label)."""
    with checkout(tree) as (src, label):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")])))
        base_out = out_dir / "base"
        cmd = [sys.executable, "-m", "ropekit.bench", *base_argv(argv), "--out", str(base_out), "--no-plot",
               "--commit", label, "--impls", impls or "ropekit*"]
        # older versions kept the registry in the repository (benchmarks/registry.py), not in the package
        registry = src.parent / "benchmarks" / "registry.py"
        if registry.is_file() and not any(a.split("=", 1)[0] == "--registry" for a in argv):
            cmd += ["--registry", str(registry)]
        print(f"\n=== base {label}: {' '.join(cmd[1:])}", flush=True)
        before = set(base_out.glob("*.json")) if base_out.is_dir() else set()
        subprocess.run(cmd, check=True, env=env)
    (result,) = set(base_out.glob("*.json")) - before
    return json.loads(result.read_text(encoding="utf-8"))["rows"], label


def _number(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def compare(rows: list[dict[str, Any]], base_rows: list[dict[str, Any]], label: str) -> str:
    """A text table: per (case, mode, impl) present on both sides, this version's median time and ratio against
    the copy baseline beside the base's, and new/base of each. Ratios are what to compare for GPU-bound rows (each
    side divides by its own copy, timed minutes apart); host-bound rows have only times."""
    base = {(r["case"], r["mode"], r["impl"]): r for r in base_rows}
    lines = [f"{'case':44s} {'mode':10s} {'impl':22s} {'us':>9s} {'base us':>9s} {'t/base':>7s} "
             f"{'ratio':>7s} {'base':>7s} {'r/base':>7s}"]
    for r in rows:
        b = base.get((r["case"], r["mode"], r["impl"]))
        if b is None:
            continue
        us, bus = _number(r.get("median_us")), _number(b.get("median_us"))
        ratio, bratio = _number(r.get("ratio_vs_copy")), _number(b.get("ratio_vs_copy"))

        def cell(v: float | None, fmt: str) -> str:
            return format(v, fmt) if v is not None else "-"

        lines.append(f"{r['case'][:44]:44s} {r['mode'][:10]:10s} {r['impl'][:22]:22s} {cell(us, '9.2f')} "
                     f"{cell(bus, '9.2f')} {cell(us / bus if us and bus else None, '7.3f')} "
                     f"{cell(ratio, '7.3f')} {cell(bratio, '7.3f')} "
                     f"{cell(ratio / bratio if ratio and bratio else None, '7.3f')}")
    if len(lines) == 1:
        return f"no row of this run matches one of base {label}\n"
    return f"this version against base {label} (same machine, one run)\n" + "\n".join(lines) + "\n"
