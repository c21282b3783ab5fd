"""Decode latency probe on a CUDA GPU: one q+k rotation per call, replayed from a CUDA graph, at several block
configurations, against a copy of q replayed the same way; plus each kernel's own duration from the profiler.

Separates what a decode call costs into the kernel's execution (profiler duration) and the per-node cost of a
graph replay, for the Llama-3-8B shape by default (32/8 heads, D 128, bf16, one token per sequence, per-sequence
offsets; ``--heads``, ``--head-dim``); ``--sweep`` times every block shape instead. Beside them: Liger (given
per-token tables, as its callers do) and a Triton copy of q and k on two grids, one program per token (Liger's
grid) and one per block of heads of q or of k as ropekit's default decode grid has them (8 at head_dim 128), to
tell the grid's cost from the rotation's; and ``rope_kernel``'s own token block, address, load and store helpers on its
own grid with no position, angle or rotation (``rope path, no rotation``), to tell the kernel's access path from
its arithmetic.

    python benchmarks/probes/decode_probe.py [--tokens 1,16,64] [--heads 32:8] [--head-dim 128] [--sweep]
"""

# ruff: noqa: E402 - options are parsed before torch, Triton and ropekit load, so --help runs on any machine
from __future__ import annotations

import argparse

from _options import decode_parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = decode_parser(__doc__, "HQ:HK")
    parser.add_argument("--head-dim", type=int, default=128, help="head_dim (a power of two)")
    parser.add_argument("--sweep", action="store_true",
                        help="time every block shape (heads per program x warps), graph replay only, and print "
                             "the fastest per token count")
    parser.add_argument("--dump", help="write the PTX of every compiled rope_kernel specialisation into this folder")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help exits here

import torch
import triton
import triton.language as tl
from _copies import same_grid_copy_kernel
from _graphs import graph_us_interleaved, kernel_us

from ropekit._validation import validate
from ropekit.triton.heuristics import block_config, num_programs_wanted
from ropekit.triton.launcher import launch_rope


@triton.jit
def _copy_qk_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, QW: tl.constexpr, KW: tl.constexpr, BQ: tl.constexpr,
                    BK: tl.constexpr, SEPARATE: tl.constexpr):
    """Program (hb, t) copies block hb of token t's q row (BQ elements) and, unless ``SEPARATE``, block hb of its
    k row (BK elements); with ``SEPARATE`` the programs past q's blocks copy k's."""
    hb = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    n_qb: tl.constexpr = QW // BQ
    iq = hb * BQ + tl.arange(0, BQ)
    ik = (hb - n_qb if SEPARATE else hb) * BK + tl.arange(0, BK)
    if hb < n_qb:
        tl.store(qo_ptr + t * QW + iq, tl.load(q_ptr + t * QW + iq))
    if SEPARATE:
        if hb >= n_qb:
            tl.store(ko_ptr + t * KW + ik, tl.load(k_ptr + t * KW + ik))
    elif hb < KW // BK:
        tl.store(ko_ptr + t * KW + ik, tl.load(k_ptr + t * KW + ik))


def rope_path_copy(q, k, qo, ko, config):
    """q -> qo, k -> ko ([T, 1, H, D], contiguous) through :func:`_copies.same_grid_copy_kernel` at ``config``
    (BLOCK_T, BLOCK_HQ, BLOCK_HK, num_warps)."""
    T, S, HQ, D = q.shape
    HK = k.shape[2]
    bt, bhq, bhk, nw = config
    grid = (triton.cdiv(HQ, bhq) + triton.cdiv(HK, bhk), triton.cdiv(T * S, bt))
    same_grid_copy_kernel[grid](q, qo, k, ko, *q.stride()[:3], *k.stride()[:3], HQ, HK, S, T * S, D=D,
                                BLOCK_T=bt, BLOCK_HQ=bhq, BLOCK_HK=bhk, TOKENS_FIRST=False, num_warps=nw)


def copy_qk(q, k, qo, ko, heads: int | None):
    """Copy contiguous q and k ([T, 1, H, D]): one program per token (``heads`` None) or one per ``heads``
    heads of q or of k."""
    T, _, HQ, D = q.shape
    HK = k.shape[2]
    if heads is None:
        grid, bq, bk, separate = (1, T), HQ * D, HK * D, False
    else:
        grid, bq, bk, separate = (HQ // heads + HK // heads, T), heads * D, heads * D, True
    _copy_qk_kernel[grid](q, k, qo, ko, QW=HQ * D, KW=HK * D, BQ=bq, BK=bk, SEPARATE=separate, num_warps=4)


def main(args: argparse.Namespace) -> None:
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'tokens':>6} {'variant':<34} {'graph us':>9} {'x copy-q':>8} {'kernel us':>10}")
    HQ, HK = (int(h) for h in args.heads.split(":"))
    D = args.head_dim
    print(f"{HQ}/{HK} heads, head_dim {D}, bf16")
    for T in (int(t) for t in args.tokens.split(",")):
        q = torch.randn(T, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(T, 1, HK, D, device="cuda", dtype=torch.bfloat16)
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        offsets = torch.randint(0, 8192, (T,), device="cuda")
        emb = torch.randn(T, 1, D, device="cuda", dtype=torch.bfloat16)
        variants = {"copy-q": lambda: qo.copy_(q)}
        default = block_config(T, HQ, HK, D, 2, num_programs_wanted(q.device))
        variants["copy q+k, 1 program/token"] = lambda: copy_qk(q, k, qo, ko, None)
        # ropekit's grid: its default heads per program (8 at head_dim 128)
        variants[f"copy q+k, {default[1]} heads/program"] = lambda: copy_qk(q, k, qo, ko, default[1])
        variants[f"rope path, no rotation {default}"] = lambda: rope_path_copy(q, k, qo, ko, default)
        try:
            from liger_kernel.transformers.rope import liger_rotary_pos_emb
        except ImportError as exc:
            print(f"(no Liger: {exc})")
        else:
            qh, kh = q.transpose(1, 2).clone(), k.transpose(1, 2).clone()  # [T, H, 1, D], rotated in place
            variants["liger (hf table)"] = lambda: liger_rotary_pos_emb(qh, kh, emb, emb)
        for label, kwargs in (("exact", dict(positions=offsets)), ("hf table", dict(cos=emb, sin=emb))):
            launch_kw = validate(q, k, **kwargs)
            configs = {f"default {default}": None}
            hq2, hk2 = 1 << (HQ - 1).bit_length(), 1 << (HK - 1).bit_length()
            shapes = [(bt, bh, min(bh, hk2), nw) for bt in (1, 2, 4) for bh in (1, 2, 4, 8, 16, 32, 64)
                      for nw in (1, 2, 4, 8) if bh <= hq2 and bt * bh * D // 2 >= 32 * nw and bt <= T
                      and (bt == 1 or bh == 8)] if args.sweep else [(1, 8, 8, 1), (1, 4, 4, 1)]
            for cfg in shapes:
                configs[f"T{cfg[0]} H{cfg[1]}/{cfg[2]} w{cfg[3]}"] = cfg
            for label_cfg, cfg in configs.items():
                variants[f"{label} {label_cfg}"] = (lambda kw=launch_kw, c=cfg: launch_rope(q, k, qo, ko, kw,
                                                                                           config=c))
        timed = graph_us_interleaved(variants)
        base = timed["copy-q"]
        for name, g in timed.items():
            swept = args.sweep and " T" in name  # the sweep's shapes: replay time only
            kern_s = "" if swept else ", ".join(f"{v:.2f}" for v in kernel_us(variants[name]).values())
            print(f"{T:>6} {name:<34} {g:>9.2f} {g / base:>8.2f} {kern_s:>10}")
        for label in ("exact", "hf table"):
            mine = {n: g for n, g in timed.items() if n.startswith(label)}
            best = min(mine, key=mine.get)
            print(f"{T:>6} fastest {label}: {best} {mine[best]:.2f} us ({mine[best] / base:.2f}x copy-q)")
    if args.dump:
        import os

        from ropekit.triton.runtime import compiled_kernels

        os.makedirs(args.dump, exist_ok=True)
        for i, (key, compiled) in enumerate(compiled_kernels().items()):
            with open(os.path.join(args.dump, f"rope_kernel_{i}.ptx"), "w") as f:
                f.write(f"// constexprs, num_warps: {key[-3:]}\n" + compiled.asm["ptx"])


if __name__ == "__main__":
    main(ARGS)
