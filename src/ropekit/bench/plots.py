"""Plots: one PNG per mode, GB/s against tokens (the attention modes: TFLOP/s against the sequence length), one line
per implementation (matplotlib, imported lazily)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .env import PERF_LABEL
from .impls import BASELINE, EXTRA_BASELINES

# mode -> (y column, its label, x column, its label)
_BYTES_AXES = ("gbps", "GB/s (useful bytes)", "tokens", "tokens")
_FLOPS_AXES = ("tflops", "TFLOP/s (attention flops)", "seqlen", "sequence length")
PLOT_AXES = {"fwd": _BYTES_AXES, "fwdbwd": _BYTES_AXES, "decode": _BYTES_AXES, "kv-decode": _BYTES_AXES,
             "kv-prefill": _BYTES_AXES, "norm-fwdbwd": _BYTES_AXES, "attn-fwd": _FLOPS_AXES,
             "attn-fwdbwd": _FLOPS_AXES, "mla-decode": _BYTES_AXES, "mla-prefill": _BYTES_AXES}


def plot_results(stem: Path, rows: list[dict[str, Any]], meta: dict[str, Any], dpi: int = 110) -> list[Path]:
    """One PNG per mode (fwd, fwdbwd, decode, the prologue's kv-decode, kv-prefill, norm-fwdbwd, the attention
    modes and the MLA prologue's): a panel per series, GB/s against tokens (attention: TFLOP/s against the
    sequence length), one line per implementation (the baseline dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for mode, (y_col, y_label, x_col, x_label) in PLOT_AXES.items():
        mrows = [r for r in rows if r["mode"] == mode and r.get(y_col)]
        if not mrows:
            continue
        series = list(dict.fromkeys(r["series"] for r in mrows))
        ncols = min(3, len(series))
        nrows = math.ceil(len(series) / ncols)
        # constrained layout keeps the figure title clear of the panels' titles (tight_layout ignores it)
        fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 3.8 * nrows), squeeze=False,
                                 layout="constrained")
        for ax, name in zip(axes.flat, series):
            srows = [r for r in mrows if r["series"] == name]
            for impl in dict.fromkeys(r["impl"] for r in srows):
                pts = sorted((int(r[x_col]), float(r[y_col])) for r in srows if r["impl"] == impl)
                is_base = impl in (BASELINE[mode], *EXTRA_BASELINES.get(mode, ()))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=impl,
                        linestyle="--" if is_base else "-", color="black" if impl == BASELINE[mode] else None)
            ax.set_xscale("log", base=2)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel(x_label)
            ax.set_ylabel(y_label)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(series):]:
            ax.set_visible(False)
        title = f"ropekit bench, {mode}: {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, " \
                f"ropekit {meta['ropekit']} @ {meta['commit']}, {meta['date']}"
        if meta["label"] != PERF_LABEL:
            title = f"{meta['label']}\n{title}"
        fig.suptitle(title, fontsize=9)
        path = Path(f"{stem}-{mode}.png")
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        paths.append(path)
    return paths
