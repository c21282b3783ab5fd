"""Plots: one PNG per mode, GB/s against tokens (the attention modes: TFLOP/s against the sequence length), one line
per implementation (matplotlib, imported lazily)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

from .env import PERF_LABEL
from .impls import BASELINE, EXTRA_BASELINES

# mode -> (y column, its label, x column, its label)
_BYTES_AXES = ("gbps", "GB/s (useful bytes)", "tokens", "tokens")
_FLOPS_AXES = ("tflops", "TFLOP/s (attention flops)", "seqlen", "sequence length")
PLOT_AXES = {"fwd": _BYTES_AXES, "fwdbwd": _BYTES_AXES, "decode": _BYTES_AXES, "kv-decode": _BYTES_AXES,
             "kv-prefill": _BYTES_AXES, "norm-fwdbwd": _BYTES_AXES, "attn-fwd": _FLOPS_AXES,
             "attn-fwdbwd": _FLOPS_AXES, "mla-decode": _BYTES_AXES, "mla-prefill": _BYTES_AXES,
             "hidden-norm-fwd": _BYTES_AXES}
PANEL_INCHES = (3.6, 2.5)  # one panel's width and height
# what fits across one inch of the figure: characters of the 9-point title, entries of the 8-point legend
_TITLE_CHARS_PER_INCH, _LEGEND_ENTRIES_PER_INCH = 14, 0.75


def impl_colours(mode: str, impls: list[str]) -> dict[str, Any]:
    """One colour per implementation of a mode's plot, the same in every panel so that one legend serves them all:
    the mode's baseline black, the others in order from tab10 (tab20 where there are more than ten)."""
    from matplotlib import colormaps

    others = [impl for impl in impls if impl != BASELINE[mode]]
    cmap = colormaps["tab10" if len(others) <= 10 else "tab20"]
    colours: dict[str, Any] = {impl: cmap(k % cmap.N) for k, impl in enumerate(others)}
    colours[BASELINE[mode]] = "black"
    return colours


def plot_results(stem: Path, rows: list[dict[str, Any]], meta: dict[str, Any], dpi: int = 110,
                 antialiased: bool = True) -> list[Path]:
    """One PNG per mode (fwd, fwdbwd, decode, the prologue's kv-decode, kv-prefill, norm-fwdbwd, the attention
    modes and the MLA prologue's): a panel per series, GB/s against tokens (attention: TFLOP/s against the
    sequence length), one line per implementation (baselines dashed, the mode's own black) in one colour across
    the panels, and one legend below them. ``antialiased=False`` draws lines and text without antialiasing: a
    handful of colours, so a palette PNG of it is less than half the bytes (the plots kept in the tree)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    style = {"lines.antialiased": antialiased, "patch.antialiased": antialiased, "text.antialiased": antialiased}
    for mode, (y_col, y_label, x_col, x_label) in PLOT_AXES.items():
        mrows = [r for r in rows if r["mode"] == mode and r.get(y_col)]
        if not mrows:
            continue
        series = list(dict.fromkeys(r["series"] for r in mrows))
        impls = list(dict.fromkeys(r["impl"] for r in mrows))
        colours = impl_colours(mode, impls)
        ncols = min(3, len(series))
        nrows = math.ceil(len(series) / ncols)
        with plt.rc_context(style):
            # constrained layout keeps the figure title and the legend clear of the panels (tight_layout ignores
            # them)
            fig, axes = plt.subplots(nrows, ncols, figsize=(PANEL_INCHES[0] * ncols, PANEL_INCHES[1] * nrows),
                                     squeeze=False, layout="constrained")
            handles = {}
            for ax, name in zip(axes.flat, series):
                srows = [r for r in mrows if r["series"] == name]
                for impl in dict.fromkeys(r["impl"] for r in srows):
                    pts = sorted((int(r[x_col]), float(r[y_col])) for r in srows if r["impl"] == impl)
                    is_base = impl in (BASELINE[mode], *EXTRA_BASELINES.get(mode, ()))
                    (handles[impl],) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                                               label=impl, linestyle="--" if is_base else "-", color=colours[impl])
                ax.set_xscale("log", base=2)
                ax.set_title(name, fontsize=9)
                ax.set_xlabel(x_label)
                ax.set_ylabel(y_label)
                ax.grid(True, alpha=0.3)
            for ax in list(axes.flat)[len(series):]:
                ax.set_visible(False)
            width = PANEL_INCHES[0] * ncols
            fig.legend([handles[impl] for impl in impls], impls, loc="outside lower center", fontsize=8,
                       ncols=max(1, min(len(impls), int(width * _LEGEND_ENTRIES_PER_INCH))))
            title = f"ropekit bench, {mode}: {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, " \
                    f"ropekit {meta['ropekit']} @ {meta['commit']}, {meta['date']}"
            if meta["label"] != PERF_LABEL:
                title = f"{meta['label']}\n{title}"
            chars = int(width * _TITLE_CHARS_PER_INCH)
            fig.suptitle("\n".join(textwrap.fill(line, chars) for line in title.split("\n")), fontsize=9)
            path = Path(f"{stem}-{mode}.png")
            fig.savefig(path, dpi=dpi)
            plt.close(fig)
        paths.append(path)
    return paths
