"""Pictures of RoPE frequency spectra: what to look at when choosing a base or a context-extension method.

:func:`plot_frequencies` draws, for each frequency set, three panels into one PNG:

1. the wavelength of every pair (positions per full turn, log scale) against the pair index, with the context
   lengths marked: pairs whose wavelength exceeds the training context never completed a turn in training;
2. how much each method stretches each pair relative to plain RoPE with the same base (``default / scaled``
   inverse frequency): 1 = untouched, ``factor`` = fully interpolated;
3. the relative-position property: the mean ``q . k`` of a key equal to its query, as a function of the distance
   between them, normalised to 1 at distance 0 and computed through :func:`ropekit.apply_rope` on random heads.
   It depends on the distance only (not on the absolute positions) and shows how fast attention to an identical
   token decays and where it starts to alias.

``ropekit plot`` is the command-line front end (:func:`main`). Needs matplotlib (``pip install ropekit[plot]``).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ropekit.frequencies import ROPE_TYPES, RopeFrequencies, _read_config_json, from_hf_config, rope_frequencies

__all__ = ["binned_relative_position_curve", "main", "parse_method", "plot_frequencies", "relative_position_curve"]

_NEEDS_ORIGINAL = ("yarn", "longrope", "llama3")
DEFAULT_METHODS = ("default", "linear:factor=4", "dynamic:factor=4", "yarn:factor=4", "llama3:factor=4")


def _import_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("ropekit plot needs matplotlib: pip install 'ropekit[plot]'") from err
    return Figure, FigureCanvasAgg


# --------------------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------------------


def relative_position_curve(freqs: RopeFrequencies, distances: torch.Tensor, *, samples: int = 64,
                            start: int = 0, seed: int = 0) -> torch.Tensor:
    """Mean ``q . k`` of random heads whose key equals the query, the query ``d`` positions after the key, for
    each distance ``d`` in ``distances`` (int64 [N]); float64 [N], normalised so that ``d = 0`` gives 1.

    Rotations go through :func:`ropekit.apply_rope` in float64 on the CPU (with the frequencies' attention
    scaling, style and partial rotary); the key sits at position ``start``. For Gaussian heads the expectation is
    ``(2 s^2 sum_i cos(d * theta_i) + head_dim - R) / (s^2 R + head_dim - R)`` (``s`` the attention scaling).
    """
    from ropekit.api import apply_rope

    gen = torch.Generator().manual_seed(seed)
    D = freqs.head_dim
    x = torch.randn(1, 1, samples, D, generator=gen, dtype=torch.float64)
    dist = torch.as_tensor(distances, dtype=torch.int64).reshape(-1)
    n = dist.numel()
    kw = freqs.apply_kwargs()
    kw["inv_freq"] = kw["inv_freq"].to(torch.float64)
    q = apply_rope(x.expand(1, n, samples, D).contiguous(), positions=(start + dist)[None], **kw)
    k = apply_rope(x, positions=torch.tensor([[start]]), **kw)
    dots = (q * k).sum(-1).mean(-1)[0]  # [N]
    return dots / (k * k).sum(-1).mean()  # at distance 0 the query is the key


def _distance_bins(max_distance: int, *, bins: int = 90, per_bin: int = 12, seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-spaced distance bins over [1, max_distance]: (distances [N], bin index of each [N], bin centres [nb]).
    Each bin holds every distance when it is narrow, else ``per_bin`` random ones."""
    gen = torch.Generator().manual_seed(seed + 1)
    edges = torch.unique(torch.logspace(0, math.log10(max_distance + 1), bins + 1, dtype=torch.float64).floor()
                         .to(torch.int64))
    dists, which, centres = [], [], []
    for j, (a, b) in enumerate(zip(edges[:-1].tolist(), edges[1:].tolist())):
        d = torch.arange(a, b) if b - a <= per_bin else torch.randint(a, b, (per_bin,), generator=gen)
        dists.append(d)
        which.append(torch.full_like(d, j))
        centres.append(math.sqrt(a * max(b - 1, a)))
    return torch.cat(dists), torch.cat(which), torch.tensor(centres, dtype=torch.float64)


def binned_relative_position_curve(freqs: RopeFrequencies, max_distance: int, *, samples: int = 32, seed: int = 0
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(bin centres, mean normalised q.k per log-spaced distance bin) of :func:`relative_position_curve`, so
    that the decay reads through the oscillations."""
    dist, which, centres = _distance_bins(max_distance, seed=seed)
    curve = relative_position_curve(freqs, dist, samples=samples, seed=seed)
    sums = torch.zeros(centres.numel(), dtype=torch.float64).index_add_(0, which, curve)
    counts = torch.zeros(centres.numel(), dtype=torch.float64).index_add_(0, which, torch.ones_like(curve))
    return centres, sums / counts


# --------------------------------------------------------------------------------------------------------------
# drawing
# --------------------------------------------------------------------------------------------------------------


def _same_curve(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    xa, ya = (torch.as_tensor(v, dtype=torch.float64) for v in a)
    xb, yb = (torch.as_tensor(v, dtype=torch.float64) for v in b)
    return (xa.shape == xb.shape and ya.shape == yb.shape and torch.allclose(xa, xb, equal_nan=True)
            and torch.allclose(ya, yb, rtol=1e-6, atol=0.0, equal_nan=True))


def coincident_styles(curves: Sequence[tuple[Any, Any]], styles: Sequence[Any], widths: Sequence[float],
                      *, dash: float = 6.0) -> list[Any]:
    """Line styles that keep every one of ``curves`` (``(x, y)``, drawn in order) visible: a curve equal to earlier
    ones is dashed, and the m curves of a group take turns along the line (dashes of ``dash`` points, each its own
    slot of a period ``m * dash``) so the first, drawn solid beneath, shows in the last slot. Other curves keep
    their style. Dash lengths are divided by the line width, which matplotlib multiplies them by."""
    group_of = list(range(len(curves)))  # index of the first curve each one coincides with
    for i in range(len(curves)):
        group_of[i] = next((j for j in range(i) if group_of[j] == j and _same_curve(curves[j], curves[i])), i)
    out = list(styles)
    for lead in set(group_of):
        members = [i for i, g in enumerate(group_of) if g == lead]
        m = len(members)
        for rank, i in enumerate(members[1:]):
            period, lw = m * dash, widths[i]
            offset = (period - rank * dash) % period  # starts this curve's dash at slot ``rank``
            out[i] = (offset / lw, (dash / lw, (period - dash) / lw))
    return out


def plot_frequencies(
    out: str | Path,
    entries: Mapping[str, RopeFrequencies] | Sequence[tuple[str, RopeFrequencies]],
    *,
    context: int | None = None,
    max_distance: int | None = None,
    samples: int = 32,
    seed: int = 0,
    title: str | None = None,
    dpi: int = 110,
) -> Path:
    """Write the three-panel PNG (see the module docstring) for the named frequency sets; returns the path.

    Parameters
    ----------
    out : path
        The PNG file to write (parent directories are created).
    entries : mapping or sequence of (label, RopeFrequencies)
        What to draw. ``dynamic`` and ``longrope`` sets are drawn twice: as built (solid) and as used for a
        sequence of ``max_distance`` tokens (dashed).
    context : int, optional
        A training context length to mark; by default each set's ``original_max_position_embeddings`` /
        ``max_position_embeddings`` are marked.
    max_distance : int, optional
        The largest distance of the relative-position panel (default: 4x the largest context, at least 4096).
    samples : int
        Random heads averaged in the relative-position panel.
    """
    Figure, FigureCanvasAgg = _import_matplotlib()
    items = list(entries.items()) if isinstance(entries, Mapping) else list(entries)
    if not items:
        raise ValueError("plot_frequencies needs at least one (label, RopeFrequencies) entry")
    for label, f in items:
        if not isinstance(f, RopeFrequencies):
            raise TypeError(f"entry {label!r} must be a RopeFrequencies, got {type(f).__name__}")
    contexts = sorted({c for _, f in items for c in (f.original_max_position_embeddings, f.max_position_embeddings)
                       if c} | ({context} if context else set()))
    if max_distance is None:
        max_distance = max(4096, 4 * max(contexts, default=1024))
    if max_distance < 1:
        raise ValueError(f"max_distance must be >= 1, got {max_distance}")

    curves: dict[str, list[tuple[Any, Any, Any, str, float, str]]] = {"wave": [], "ratio": [], "rel": []}
    fig = Figure(figsize=(17, 5.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax_wave, ax_ratio, ax_rel = fig.subplots(1, 3)
    n = len(items)
    # with different rotary dims, put pairs on a common axis: the exponent 2i / R of plain RoPE
    fractional = len({f.rotary_dim for _, f in items}) > 1
    pair_label = "pair exponent 2i / rotary_dim" if fractional else "pair index i"
    for idx, (label, f) in enumerate(items):
        color = f"C{idx % 10}"
        lw = 1.2 + 1.6 * (n - 1 - idx) / max(n - 1, 1)  # earlier entries wider, so overlapping curves all show
        variants = [(f, "-", label)]
        if f.is_dynamic:
            g = f.for_seq_len(max_distance)
            if g is not f:
                variants.append((g, "--", f"{label} @ {max_distance:,} tokens"))
        for g, ls, name in variants:
            pairs = torch.arange(g.rotary_dim // 2, dtype=torch.float64)
            if fractional:
                pairs = 2 * pairs / g.rotary_dim
            curves["wave"].append((pairs, g.wavelengths, ls, color, lw, name))
            if g.base is not None:
                plain = rope_frequencies(g.rotary_dim, g.base, head_dim=g.head_dim).inv_freq.double()
                ratio = torch.where(g.inv_freq > 0, plain / g.inv_freq.double(), torch.full_like(plain, math.nan))
                curves["ratio"].append((pairs, ratio, ls, color, lw, name))
            centres, curve = binned_relative_position_curve(g, max_distance, samples=samples, seed=seed)
            curves["rel"].append((centres, curve, ls, color, lw, name))
    for ax, key in ((ax_wave, "wave"), (ax_ratio, "ratio"), (ax_rel, "rel")):
        styles = coincident_styles([(x, y) for x, y, *_ in curves[key]], [c[2] for c in curves[key]],
                                   [c[4] for c in curves[key]])
        for (x, y, _, color, lw, name), ls in zip(curves[key], styles):
            ax.plot(x, y, linestyle=ls, color=color, lw=lw, label=name)
    for c in contexts:
        ax_wave.axhline(c, color="0.45", lw=0.8, ls=":")
        ax_wave.annotate(f"{c:,} tokens", (0, c), xytext=(2, 2), textcoords="offset points", fontsize=7, color="0.35")
        ax_rel.axvline(c, color="0.45", lw=0.8, ls=":")
    ax_wave.set(yscale="log", xlabel=pair_label, ylabel="wavelength 2\u03c0 / \u03b8\u1d62 (positions)",
                title="Wavelength per pair")
    ax_ratio.set(yscale="log", xlabel=pair_label, ylabel="\u03b8\u1d62 (plain RoPE, same base) / \u03b8\u1d62",
                 title="Stretch per pair (1 = untouched)")
    ax_rel.set(xscale="log", xlabel="distance between query and key (positions)",
               ylabel="mean q\u00b7k / |q|\u00b2  (key = query, log-binned)",
               title=f"Relative-position property ({samples} random heads)")
    ax_rel.axhline(0, color="0.6", lw=0.6)
    for ax in (ax_wave, ax_ratio, ax_rel):
        ax.grid(True, which="major", alpha=0.3)
    ax_wave.legend(fontsize=7, loc="upper left")
    if title:
        fig.suptitle(title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    return out


# --------------------------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------------------------


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        low = text.lower()
        if low in ("true", "false"):
            return low == "true"
        return text


def parse_method(spec: str, *, head_dim: int = 128, rotary_dim: int | None = None, base: float = 10000.0,
                 context: int = 4096) -> RopeFrequencies:
    """Frequencies from a ``TYPE[:key=value,...]`` spec, e.g. ``"yarn:factor=8,beta_fast=16"`` or
    ``"default:base=500000"``. ``base``, ``head_dim``, ``rotary_dim``, ``freq_scale`` may also be keys.
    ``original_max_position_embeddings`` defaults to ``context``, and so does ``max_position_embeddings``
    (``dynamic``); ``llama3`` defaults to Llama 3.1's ``low_freq_factor=1``, ``high_freq_factor=4``."""
    rope_type, _, rest = spec.partition(":")
    rope_type = rope_type.strip()
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"method {spec!r}: rope type {rope_type!r} is not one of {list(ROPE_TYPES)}")
    params: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"method {spec!r}: expected key=value, got {item!r}")
        params[key.strip()] = _value(value.strip())
    base = float(params.pop("base", base))
    head_dim = int(params.pop("head_dim", head_dim))
    rotary_dim = int(params.pop("rotary_dim", rotary_dim or head_dim))
    freq_scale = float(params.pop("freq_scale", 1.0))
    max_pos = int(params.pop("max_position_embeddings", context))
    if rope_type in _NEEDS_ORIGINAL:
        params.setdefault("original_max_position_embeddings", context)
    if rope_type == "llama3":  # Llama 3.1's published values, for short specs
        params.setdefault("low_freq_factor", 1.0)
        params.setdefault("high_freq_factor", 4.0)
    if rope_type in ("yarn", "longrope") and "factor" not in params:
        raise ValueError(f"method {spec!r}: give factor=...")
    return rope_frequencies(rotary_dim, base, rope_type=rope_type, head_dim=head_dim, freq_scale=freq_scale,
                            max_position_embeddings=max_pos, **params)


def _load_config(path: str) -> tuple[str, dict]:
    """(legend label, parsed config) of a ``--config`` path, read as :func:`from_hf_config` reads a path."""
    p, cfg = _read_config_json(path)
    named = p.stem
    if p.name == "config.json":  # named by its folder; a bare ``config.json`` has none (an empty legend label)
        named = p.parent.name or cfg.get("model_type") or p.stem
    return str(cfg.get("_name_or_path") or named), cfg


def main(argv: Sequence[str] | None = None) -> int:
    """``ropekit plot``: draw frequency spectra and the relative-position property to a PNG."""
    parser = argparse.ArgumentParser(
        prog="ropekit plot",
        description="Draw per-pair wavelengths, the per-pair stretch of scaling methods and the relative-position "
                    "property (mean q.k against distance) to a PNG.",
        epilog="Examples: ropekit plot --method default --method 'yarn:factor=8' --context 8192; "
               "ropekit plot --config path/to/config.json --out llama.png",
    )
    parser.add_argument("--out", "-o", default="rope.png", help="PNG to write (default: rope.png)")
    parser.add_argument("--method", "-m", action="append", default=[], metavar="SPEC",
                        help="TYPE[:key=value,...], TYPE one of " + ", ".join(ROPE_TYPES) +
                             "; repeatable (default when neither --method nor --config: " +
                             " ".join(DEFAULT_METHODS) + ")")
    parser.add_argument("--config", "-c", action="append", default=[], metavar="FILE",
                        help="a model's config.json (or its folder); repeatable")
    parser.add_argument("--layer-type", default=None, help="layer type for configs with per-layer rope parameters")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim of --method sets (default 128)")
    parser.add_argument("--rotary-dim", type=int, default=None, help="rotated dims of --method sets (default: all)")
    parser.add_argument("--base", type=float, default=10000.0, help="rope_theta of --method sets (default 1e4)")
    parser.add_argument("--context", type=int, default=4096,
                        help="training context of --method sets and the marked length (default 4096)")
    parser.add_argument("--max-distance", type=int, default=None,
                        help="largest distance of the relative-position panel (default 4x the largest context)")
    parser.add_argument("--samples", type=int, default=32, help="random heads for the q.k panel (default 32)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(list(argv) if argv is not None else None)

    entries: list[tuple[str, RopeFrequencies]] = []
    methods = args.method or ([] if args.config else list(DEFAULT_METHODS))
    try:
        for spec in methods:
            entries.append((spec, parse_method(spec, head_dim=args.head_dim, rotary_dim=args.rotary_dim,
                                               base=args.base, context=args.context)))
        for path in args.config:
            label, cfg = _load_config(path)
            entries.append((label, from_hf_config(cfg, layer_type=args.layer_type)))
        out = plot_frequencies(args.out, entries, context=args.context if methods else None,
                               max_distance=args.max_distance, samples=args.samples, title=args.title)
    except (ValueError, OSError) as err:
        parser.exit(2, f"ropekit plot: error: {err}\n")
    print(out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
