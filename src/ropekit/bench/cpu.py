"""``apply_rope`` on CPU tensors (the float32 path) against transformers' ``apply_rotary_pos_emb`` on the same
tensors, from decode (one token per sequence) to prefill: the rows of ``ropekit bench --preset cpu`` (the mode
"cpu", :func:`bench_rows`) and the table of ``python -m ropekit.bench.cpu``.

transformers gets what a model hands it: cos/sin already computed for the positions (once per forward, shared by
every layer, so not timed) and q/k as [B, H, S, D] views of the [B, S, H, D] projections. ropekit gets the positions
([B, S] ids, or an int offset) and forms its angles in float64 from them: ``ropekit`` with the positions of the
calls before (a model hands every layer of a forward the same positions, so a later layer may reuse work), and
``ropekit-first-layer`` with positions new to every call (a forward's first layer, which cannot). A forward's
first layer of transformers pays for its cos/sin too: ``hf-first-layer`` times the model's rotary embedding
(Llama's, for positions new to every call) and then ``apply_rotary_pos_emb``, the fair partner of
``ropekit-first-layer``. Each time is the median of repeated calls after warm-up calls, in microseconds; the
functions of one size take turns, one call each, so that a change in the machine's load reaches them alike. The
ratio is ropekit's time over transformers' (below 1: ropekit is faster). Without transformers only ropekit's times
are taken.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .cases import CPU_MODE, POSITION_OFFSET
from .report import gbps
from .timing import Timer, interleaved_median_us

# (sequences, tokens per sequence): decode sizes, then prefill (the registry's SIZES["cpu"])
SIZES = ((1, 1), (8, 1), (32, 1), (256, 1), (2, 4096))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OFFSET = POSITION_OFFSET  # the int offset: a decode step's position
BASELINE = "hf"  # the CPU mode's baseline: transformers' apply_rotary_pos_emb
HF_FIRST_LAYER = "hf-first-layer"  # transformers' rotary embedding forward for new positions, then the rotation
IMPLS = ("ropekit", "ropekit-first-layer")
# The first-layer calls cycle over sets of positions, each one step further than the one before, so that no call
# finds its positions among those of the calls just before it: up to this many position ids in all (8 MB of int64),
# at most FIRST_LAYER_SETS sets.
FIRST_LAYER_IDS = 1 << 20
FIRST_LAYER_SETS = 1024


def hf_rotation() -> Callable | None:
    """transformers' ``apply_rotary_pos_emb`` (Llama's), or None when transformers is not installed."""
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except ImportError:
        return None
    return apply_rotary_pos_emb


def hf_rotary_embedding(heads: int, kv_heads: int, head_dim: int, base: float) -> Callable | None:
    """transformers' Llama rotary embedding module (``(x, position_ids) -> (cos, sin)`` in x's dtype) for these
    sizes and base, or None when transformers is not installed."""
    try:
        import transformers
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    except ImportError:
        return None
    config = transformers.LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, head_dim=head_dim, rope_theta=base)
    return LlamaRotaryEmbedding(config)


def make_tensors(batch: int, seqlen: int, dtype: torch.dtype, *, heads: int, kv_heads: int, head_dim: int,
                 base: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """q [B, S, heads, D] and k [B, S, kv_heads, D] of ``dtype`` (random), ids [B, S] (``OFFSET`` + 0..S-1 in every
    sequence) and transformers' cos/sin [B, S, D] of ``dtype`` for those ids (computed in float64, as a model's
    rotary embedding does once per forward)."""
    q = torch.randn(batch, seqlen, heads, head_dim, generator=generator).to(dtype)
    k = torch.randn(batch, seqlen, kv_heads, head_dim, generator=generator).to(dtype)
    ids = (torch.arange(seqlen) + OFFSET).expand(batch, seqlen).contiguous()
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = ids[..., None].double() * inv_freq
    cos = torch.cat([angles, angles], -1).cos().to(dtype)
    sin = torch.cat([angles, angles], -1).sin().to(dtype)
    return dict(q=q, k=k, ids=ids, cos=cos, sin=sin)


def rotations(t: dict[str, torch.Tensor], positions: str, base: float, apply_rotary_pos_emb: Callable | None,
              rotary_embedding: Callable | None = None) -> dict[str, Callable[[], Any]]:
    """The timed calls of one size and positions kind (``ids`` or ``offset``) on the tensors of
    :func:`make_tensors`: ``hf`` (when ``apply_rotary_pos_emb`` is given), ``hf-first-layer`` (when
    ``rotary_embedding`` is given too: its cos/sin for the first-layer calls' positions, then the rotation),
    ``ropekit`` (the same positions every call) and ``ropekit-first-layer`` (positions new to every call, cycled
    over sets made beforehand)."""
    import ropekit

    if positions not in ("ids", "offset"):
        raise ValueError(f"positions must be 'ids' or 'offset', got {positions!r}")
    q, k, ids = t["q"], t["k"], t["ids"]
    sets = max(8, min(FIRST_LAYER_SETS, FIRST_LAYER_IDS // max(1, ids.numel())))
    shared: torch.Tensor | int = ids if positions == "ids" else OFFSET
    id_sets = [ids + step for step in range(1, sets + 1)]
    fresh = itertools.cycle(id_sets if positions == "ids" else [OFFSET + step for step in range(1, sets + 1)])
    calls: dict[str, Callable[[], Any]] = {}
    if apply_rotary_pos_emb is not None:
        cos, sin = t["cos"], t["sin"]
        calls[BASELINE] = lambda: apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        if rotary_embedding is not None:  # a model hands its rotary embedding position ids, never an int offset
            fresh_ids = itertools.cycle(id_sets)
            calls[HF_FIRST_LAYER] = lambda: apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2),
                                                                 *rotary_embedding(q, next(fresh_ids)))
    calls["ropekit"] = lambda: ropekit.apply_rope(q, k, positions=shared, base=base)
    calls["ropekit-first-layer"] = lambda: ropekit.apply_rope(q, k, positions=next(fresh), base=base)
    return calls


def check_float32_path(q: torch.Tensor) -> None:
    """Raise unless apply_rope rotates ``q`` by the float32 torch path (not the Triton interpreter under
    ``ropekit.testing.kernels_on_cpu``, nor the float64 reference under ``reference_on_cpu``)."""
    from ropekit.ops import uses_float32_path

    if not uses_float32_path(q):
        raise RuntimeError("the CPU measurement times ropekit's float32 path, but CPU tensors are routed elsewhere "
                           "here (ropekit.testing.kernels_on_cpu or reference_on_cpu is in effect)")


def measure(sizes: Sequence[tuple[int, int]], dtypes: Sequence[torch.dtype], *, heads: int = 32, kv_heads: int = 8,
            head_dim: int = 128, base: float = 10000.0, warmup: int = 5, min_calls: int = 5,
            budget_s: float = 0.5, seed: int = 0) -> list[dict]:
    """One row per dtype x size x positions kind (``ids`` [B, S], ``offset`` int) x layer (``first_layer``:
    positions new to every call): ropekit's and (when installed) transformers' median microseconds (of one timing
    of the size and kind; a first layer's transformers time includes its rotary embedding's cos/sin for the new
    positions) and their ratio."""
    apply_rotary_pos_emb = hf_rotation()
    rotary_embedding = hf_rotary_embedding(heads, kv_heads, head_dim, base) if apply_rotary_pos_emb else None
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for dtype in dtypes:
        for batch, seqlen in sizes:
            t = make_tensors(batch, seqlen, dtype, heads=heads, kv_heads=kv_heads, head_dim=head_dim, base=base,
                             generator=generator)
            check_float32_path(t["q"])
            for kind in ("ids", "offset"):
                calls = rotations(t, kind, base, apply_rotary_pos_emb, rotary_embedding)
                times = dict(zip(calls, interleaved_median_us(list(calls.values()), warmup=warmup,
                                                              min_calls=min_calls, budget_s=budget_s)))
                for impl in IMPLS:
                    us, first = times[impl], impl == "ropekit-first-layer"
                    hf_us = times.get(HF_FIRST_LAYER if first else BASELINE)
                    rows.append(dict(dtype=str(dtype).removeprefix("torch."), batch=batch, seqlen=seqlen,
                                     positions=kind, first_layer=first, ropekit_us=us,
                                     hf_us=hf_us, ratio=None if hf_us is None else us / hf_us))
    return rows


def format_rows(rows: Sequence[dict]) -> str:
    """The rows as an aligned text table (a first layer's hf time includes transformers' cos/sin)."""
    lines = [f"{'dtype':9} {'B x S':>9} {'positions':9} {'layer':6} {'ropekit us':>11} {'hf us':>11} "
             f"{'ropekit/hf':>10}"]
    for r in rows:
        hf = "-" if r["hf_us"] is None else f"{r['hf_us']:.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        layer = "first" if r["first_layer"] else "later"
        lines.append(f"{r['dtype']:9} {r['batch']:>4}x{r['seqlen']:<4} {r['positions']:9} {layer:6} "
                     f"{r['ropekit_us']:>11.1f} {hf:>11} {ratio:>10}")
    return "\n".join(lines)


NOTES = {
    BASELINE: "cos/sin computed beforehand (untimed), q/k as [B, H, S, D] views",
    HF_FIRST_LAYER: "Llama's rotary embedding forward for positions new to every call, then the rotation (a "
                    "forward's first layer)",
    "ropekit": "float32 path; the positions of the calls before (a later layer)",
    "ropekit-first-layer": "float32 path; positions new to every call (a forward's first layer)",
}


def bench_rows(case: Any, device: torch.device, timer: Timer, peers: Any, env: dict[str, Any],
               impl_globs: list[str] | None, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The rows of one case of the CPU mode (``ropekit bench --preset cpu``), on CPU tensors whatever the run's
    device: ``hf`` (the baseline: transformers' Llama ``apply_rotary_pos_emb`` from ``peers``; a row without a time
    saying why when transformers is absent), ``ropekit`` and ``ropekit-first-layer``, timed in turn
    (:meth:`Timer.interleaved`). ``ratio_vs_copy`` is the time over hf's, ``max_rel_diff`` hf's output against
    ropekit's. Called as :func:`ropekit.bench.run.run_case` is; ``device`` must be the CPU."""
    if device.type != "cpu":
        raise ValueError(f"the {CPU_MODE!r} mode times CPU tensors, not {device.type} ones")
    import fnmatch

    from ropekit.testing import max_relative_error

    from .inputs import case_bytes
    from .run import MISMATCH, _impl_version, _row

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    t = make_tensors(case.batch, case.seqlen, dtype, heads=case.hq, kv_heads=case.hk, head_dim=case.head_dim,
                     base=case.base, generator=torch.Generator().manual_seed(0))
    check_float32_path(t["q"])
    names = [n for n in (BASELINE, HF_FIRST_LAYER, *IMPLS) if n == BASELINE or impl_globs is None
             or any(fnmatch.fnmatch(n, g) for g in impl_globs)]
    nbytes = case_bytes(case)["fwd"]  # q and k read and written, and the positions: as the fwd mode's
    rotary_embedding = hf_rotary_embedding(case.hq, case.hk, case.head_dim, case.base) if peers.hf_neox else None
    calls = rotations(t, case.positions, case.base, peers.hf_neox, rotary_embedding)
    rows = {}
    for name in names:
        row = _row(env, case, CPU_MODE, name, nbytes, BASELINE)
        row["impl_version"] = _impl_version(name, peers, env)
        row["note"] = NOTES[name] if name in calls else \
            f"skipped: {peers.missing.get('hf', 'transformers not loaded')}"
        rows[name] = row
    timed = {name: fn for name, fn in calls.items() if name in rows}
    if BASELINE in timed:
        diff = max_relative_error([x.transpose(1, 2) for x in calls[BASELINE]()], calls["ropekit"]())
        rows[BASELINE]["max_rel_diff"] = f"{diff:.2e}"
        if diff > MISMATCH:
            rows[BASELINE]["note"] = f"MISMATCH vs ropekit; {rows[BASELINE]['note']}"
    times = timer.interleaved(timed)
    base = times.get(BASELINE)
    for name, us in times.items():
        row = rows[name]
        row["median_us"] = f"{us:.3f}"
        row["gbps"] = gbps(row)
        if base:
            row["ratio_vs_copy"] = f"{us / base:.4f}"
    log(f"  {CPU_MODE:7s} " + ", ".join(f"{n} {us:.1f}" for n, us in times.items()) + " (us)")
    return list(rows.values())


def _size(text: str) -> tuple[int, int]:
    batch, _, seqlen = text.partition("x")
    return int(batch), int(seqlen or 1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ropekit.bench.cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=lambda s: [_size(x) for x in s.split(",")],
                        default=list(SIZES), help="comma-separated BxS (default: 1x1,8x1,32x1,256x1,2x4096)")
    parser.add_argument("--dtypes", type=lambda s: [DTYPES[x] for x in s.split(",")],
                        default=[torch.float32, torch.bfloat16], help="comma-separated of float32,bfloat16,float16")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--budget-s", type=float, default=0.5, help="timing budget per measurement (seconds)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    hf = "transformers' apply_rotary_pos_emb" if hf_rotation() else "no transformers installed: ropekit only"
    print(f"ropekit apply_rope on CPU vs {hf}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.heads}/{args.kv_heads} heads, head_dim {args.head_dim}; median of repeated calls after warm-up; "
          "layer: later = the positions of the calls before, first = positions new to every call")
    rows = measure(args.sizes, args.dtypes, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                   budget_s=args.budget_s)
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
