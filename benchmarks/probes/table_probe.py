"""Where the cos/sin-table path loses against exact angles on a CUDA GPU: the transformers drop-in
(``apply_rotary_pos_emb`` on transformers' [B, H, S, D] views with full-width bf16 tables [1, S, D]) against the
native call with exact angles and with half-width fp32 tables, each against a copy of q and k, cold L2; then the
drop-in's launch at other block shapes (raw launcher), to tell the block shape from the table reads.

``--ablate`` takes the table reads apart instead (raw launcher, each against the copy): the drop-in launch as
users get it; the same with every token reading row 0 of the tables (the same instructions, the table traffic
gone to one row that stays in L1); half-width tables (half the table loads); exact angles on the drop-in's own
block shape and on their own; and the drop-in at fewer head blocks per token (each head block of a token reads
that token's table row again).

    python benchmarks/probes/table_probe.py [--shapes 8x4096] [--models llama3-8b,hd256] [--ablate]
"""

# ruff: noqa: E402 - options are parsed before torch, Triton and ropekit load, so --help runs on any machine
from __future__ import annotations

import argparse


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="8x4096", help="comma-separated BxS shapes")
    parser.add_argument("--models", default="llama3-8b,hd256", help="comma-separated: llama3-8b, hd256, mha16-d64")
    parser.add_argument("--ablate", action="store_true", help="take the table path apart instead of the sweep")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help exits here

import torch
import triton
from triton.testing import do_bench

import ropekit
from ropekit._validation import validate
from ropekit.integrations.transformers import apply_rotary_pos_emb
from ropekit.triton.heuristics import block_config, num_programs_wanted
from ropekit.triton.launcher import launch_rope

MODELS = {"llama3-8b": (32, 8, 128), "hd256": (16, 8, 256), "mha16-d64": (16, 16, 64)}


def _us(fn) -> float:
    return min(do_bench(fn, warmup=10, rep=100, return_mode="median") for _ in range(2)) * 1e3


def _ablations(qv, kv, cos_hf, sin_hf, B, S, HQ, HK, D) -> dict:
    """Raw launches of the drop-in's inputs with one thing changed each (see the module docstring)."""
    qo, ko = torch.empty_like(qv), torch.empty_like(kv)
    spec = lambda **kw: validate(qv, kv, style="neox", layout="bhsd", rotary_dim=D, **kw)  # noqa: E731
    full = spec(cos=cos_hf, sin=sin_hf)
    row0 = spec(cos=cos_hf[:, :1].expand_as(cos_hf), sin=sin_hf[:, :1].expand_as(sin_hf))
    half = spec(cos=cos_hf[..., :D // 2].contiguous(), sin=sin_hf[..., :D // 2].contiguous())
    half_row0 = spec(cos=half.cos[:, :1].expand_as(half.cos), sin=half.sin[:, :1].expand_as(half.sin))
    exact = spec(base=10000.0)
    table_cfg = block_config(B * S, HQ, HK, D, 2, num_programs_wanted(qv.device), full_table=True)
    rows = {
        f"drop-in {table_cfg}": lambda: launch_rope(qv, kv, qo, ko, full),
        "  every token reads row 0": lambda: launch_rope(qv, kv, qo, ko, row0),
        "  half-width bf16 tables": lambda: launch_rope(qv, kv, qo, ko, half, config=table_cfg),
        "  half-width, row 0": lambda: launch_rope(qv, kv, qo, ko, half_row0, config=table_cfg),
        "  exact angles, same shape": lambda: launch_rope(qv, kv, qo, ko, exact, config=table_cfg),
        "  exact angles, own shape": lambda: launch_rope(qv, kv, qo, ko, exact),
    }
    # fewer head blocks per token: fewer reads of each token's table row (16 bytes per thread as the rule gives)
    hq2, hk2 = triton.next_power_of_2(HQ), triton.next_power_of_2(HK)
    for bh in (16, 32, 64):
        if bh <= hq2 and bh > table_cfg[1]:
            cfg = (1, bh, min(bh, hk2), min(8, bh * D * 2 // (32 * 16)))
            rows[f"  drop-in at {cfg}"] = lambda c=cfg: launch_rope(qv, kv, qo, ko, full, config=c)
            rows[f"  row 0 at {cfg}"] = lambda c=cfg: launch_rope(qv, kv, qo, ko, row0, config=c)
    return rows


def main(args: argparse.Namespace) -> None:
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    for model in args.models.split(","):
        HQ, HK, D = MODELS[model]
        for shape in args.shapes.split(","):
            B, S = (int(x) for x in shape.split("x"))
            q = torch.randn(B, S, HQ, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(B, S, HK, D, device="cuda", dtype=torch.bfloat16)
            src = torch.empty(2 * (q.numel() + k.numel()), dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            t_copy = _us(lambda: dst.copy_(src))
            inv = 10000.0 ** (-torch.arange(0, D, 2, device="cuda", dtype=torch.float64) / D)
            ang = torch.outer(torch.arange(S, device="cuda", dtype=torch.float64), inv)
            cos_half, sin_half = ang.cos().float(), ang.sin().float()
            cos_hf = torch.cat([ang, ang], -1).cos().to(torch.bfloat16)[None]  # transformers: [1, S, D], bf16
            sin_hf = torch.cat([ang, ang], -1).sin().to(torch.bfloat16)[None]
            qv, kv = q.transpose(1, 2), k.transpose(1, 2)  # transformers' [B, H, S, D] views
            rows = {
                "exact angles": lambda: ropekit.apply_rope(q, k, base=10000.0),
                "fp32 half table": lambda: ropekit.apply_rope(q, k, cos=cos_half, sin=sin_half),
                "bf16 half table": lambda: ropekit.apply_rope(q, k, cos=cos_half.bfloat16(), sin=sin_half.bfloat16()),
                "drop-in bf16 full": lambda: apply_rotary_pos_emb(qv, kv, cos_hf, sin_hf),
                "drop-in fp32 full": lambda: apply_rotary_pos_emb(qv, kv, cos_hf.float(), sin_hf.float()),
            }
            print(f"{model} {shape}: copy of q and k {t_copy:.1f} us")
            if args.ablate:
                rows = _ablations(qv, kv, cos_hf, sin_hf, B, S, HQ, HK, D)
            for name, fn in rows.items():
                t = _us(fn)
                print(f"  {name:<34} {t:>8.1f} us {t / t_copy:>7.3f}x")
            if args.ablate:
                continue
            spec = validate(qv, kv, cos=cos_hf, sin=sin_hf, style="neox", layout="bhsd", rotary_dim=D)
            qo, ko = torch.empty_like(qv), torch.empty_like(kv)
            default = block_config(B * S, HQ, HK, D, 2, num_programs_wanted(q.device), full_table=True)
            timed = {}
            for bt in (1, 2, 4, 8):
                for bh in (2, 4, 8, 16):
                    for nw in (2, 4, 8):
                        if bh > HQ or bt * bh * D * 2 > 32768:
                            continue
                        cfg = (bt, bh, min(bh, HK), nw)
                        timed[cfg] = _us(lambda c=cfg: launch_rope(qv, kv, qo, ko, spec, config=c))
            t_default = _us(lambda: launch_rope(qv, kv, qo, ko, spec))
            ranked = sorted(timed.items(), key=lambda kv_: kv_[1])
            print(f"  drop-in launch, default {default} {t_default:.1f} us {t_default / t_copy:.3f}x; by shape "
                  "(BLOCK_T, BLOCK_HQ, BLOCK_HK, warps):")
            for i in range(0, len(ranked), 6):
                print("    " + "  ".join(f"{c} {t / t_copy:.3f}x" for c, t in ranked[i:i + 6]))


if __name__ == "__main__":
    main(ARGS)
