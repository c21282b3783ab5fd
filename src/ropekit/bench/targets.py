"""Targets: goals on ratios, read from the registry's ``TARGETS`` (plain data), and their evaluation over rows."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Target:
    """A goal on a ratio: the worst ratio over the qualifying rows must not exceed ``limit``. A row qualifies when
    its mode is ``mode``, its impl matches ``impl`` (a glob, e.g. ``"ropekit-kv-write-fp8q*"``) and every column
    named in ``where`` lies in its inclusive ``[low, high]`` range (``None``: unbounded)."""

    key: str
    text: str
    limit: float
    mode: str
    where: tuple[tuple[str, float | None, float | None], ...] = ()
    impl: str = "ropekit"
    versus: str | None = None  # divide by this impl's time in the same (case, mode) instead of the baseline

    def select(self, row: dict[str, Any]) -> bool:
        """Whether ``row`` (of this target's mode and impl) is in every range of ``where``."""
        for column, low, high in self.where:
            value = float(row[column])
            if (low is not None and value < low) or (high is not None and value > high):
                return False
        return True


def targets_from_registry(registry: dict[str, Any]) -> tuple[Target, ...]:
    """The registry's ``TARGETS`` entries as :class:`Target` s (the registry docstring describes the fields)."""
    targets = []
    for entry in registry["TARGETS"]:
        unknown = set(entry) - {"key", "what", "limit", "mode", "where", "impl", "versus"}
        if unknown:
            raise ValueError(f"target {entry.get('key')!r}: unknown fields {sorted(unknown)}")
        where = tuple((column, low, high) for column, (low, high) in entry.get("where", {}).items())
        targets.append(Target(key=entry["key"], text=entry["what"], limit=float(entry["limit"]), mode=entry["mode"],
                              where=where, impl=entry.get("impl", "ropekit"), versus=entry.get("versus")))
    return tuple(targets)


def evaluate_targets(rows: list[dict[str, Any]], targets: Sequence[Target]) -> list[dict[str, Any]]:
    """The worst ratio of each of ``targets`` over the rows that qualify (``None`` when no row does)."""
    by_key = {(r["case"], r["mode"], r["impl"]): r for r in rows}
    results = []
    for t in targets:
        worst: tuple[float, str] | None = None
        n = 0
        for r in rows:
            if r["mode"] != t.mode or not fnmatch.fnmatchcase(r["impl"], t.impl) or not r["median_us"] \
                    or not t.select(r):
                continue
            if t.versus is None:
                if not r["ratio_vs_copy"]:
                    continue
                ratio = float(r["ratio_vs_copy"])
            else:
                other = by_key.get((r["case"], r["mode"], t.versus))
                if other is None or not other["median_us"] or other.get("source") != r.get("source"):
                    continue  # a ratio of two implementations only within one run
                ratio = float(r["median_us"]) / float(other["median_us"])
            n += 1
            if worst is None or ratio > worst[0]:
                worst = (ratio, r["case"])
        results.append({
            "target": t.key, "what": t.text, "limit": t.limit, "worst": None if worst is None else round(worst[0], 4),
            "case": "" if worst is None else worst[1], "cases": n,
            "ok": None if worst is None else worst[0] <= t.limit,
        })
    return results
