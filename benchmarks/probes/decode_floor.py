"""What the floor of a decode-sized launch is on a CUDA GPU, under CUDA-graph replay: torch's copy of q (a memcpy
node), an elementwise copy kernel, minimal Triton kernels (empty, copy of q, copy of q and k in one program per
token, with and without programmatic dependent launch), ropekit at several block shapes, and Liger when
importable.

Each row is the median per-call time of 50 calls captured in one graph (``graph us``) and, for calls between
non-PDL neighbours, the marginal time of the call when each is preceded by a copy of q (``after copy``: graph of
[copy-q, call] x 50 minus graph of copy-q x 50), plus the profiler's device time per launch.

    python benchmarks/probes/decode_floor.py [--tokens 1,16,64]
"""

# ruff: noqa: E402 - options are parsed before torch, Triton and ropekit load, so --help runs on any machine
from __future__ import annotations

import argparse

from _options import decode_parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = decode_parser(__doc__, "comma-separated HQ:HK pairs (head_dim 128)")
    parser.add_argument("--configs", default="",
                        help="extra ropekit block shapes, ';'-separated (BLOCK_T, BLOCK_HQ, BLOCK_HK, warps); "
                             "a head block of 0 means every head")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help exits here

import ast

import torch
import triton
import triton.language as tl
from _graphs import graph_us, graph_us_interleaved, kernel_us

from ropekit._validation import validate
from ropekit.triton.launcher import launch_rope

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older Triton
    gdc_wait = gdc_launch_dependents = None


@triton.jit
def empty_kernel(x_ptr):
    pass


@triton.jit
def copy_kernel(src, dst, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(src + offs, mask=m)
    if PDL:
        gdc_launch_dependents()
    tl.store(dst + offs, x, mask=m)


@triton.jit
def copy_qk_kernel(q, qo, k, ko, QN: tl.constexpr, KN: tl.constexpr, PDL: tl.constexpr):
    """One program per token copies its q row and its k row, both loads first."""
    if PDL:
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    iq = tl.arange(0, QN)
    ik = tl.arange(0, KN)
    xq = tl.load(q + t * QN + iq)
    xk = tl.load(k + t * KN + ik)
    if PDL:
        gdc_launch_dependents()
    tl.store(qo + t * QN + iq, xq)
    tl.store(ko + t * KN + ik, xk)


def marginal_us(fn, before) -> float:
    """Per-call time of ``fn`` when each call follows ``before`` in the graph, minus ``before`` alone."""
    def pair():
        before()
        fn()
    return graph_us(pair) - graph_us(before)


def main(args: argparse.Namespace) -> None:
    extra_configs = [tuple(ast.literal_eval(c)) for c in args.configs.split(";") if c.strip()]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception:
        liger_rotary_pos_emb = None
    pdl = gdc_wait is not None and torch.cuda.get_device_capability()[0] >= 9
    print(f"{'tokens':>6} {'variant':<44} {'graph us':>9} {'x copy-q':>8} {'after copy':>10} {'kernel us':>22}")
    shapes = [tuple(int(h) for h in pair.split(":")) for pair in args.heads.split(",")]
    for (HQ, HK), T in ((hs, int(t)) for hs in shapes for t in args.tokens.split(",")):
        print(f"-- {HQ}/{HK} heads, D 128, bf16, {T} tokens")
        q = torch.randn(T, 1, HQ, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(T, 1, HK, 128, device="cuda", dtype=torch.bfloat16)
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        offsets = torch.randint(0, 8192, (T,), device="cuda")
        cos = torch.randn(T, 1, 128, device="cuda", dtype=torch.bfloat16)
        sin = torch.randn(T, 1, 128, device="cuda", dtype=torch.bfloat16)
        n = q.numel()
        copy_q = lambda: qo.copy_(q)  # noqa: E731
        variants = {
            "copy-q (torch copy_)": copy_q,
            "torch.mul(q, 1, out=)": lambda: torch.mul(q, 1, out=qo),
            "triton empty, 1 program": lambda: empty_kernel[(1,)](q, num_warps=1),
            "triton copy-q, 1 prog/token w4": lambda: copy_kernel[(T,)](q, qo, n, BLOCK=HQ * 128, PDL=False,
                                                                        num_warps=4),
            "triton copy-q, 1 prog/head w1": lambda: copy_kernel[(T * HQ,)](q, qo, n, BLOCK=128, PDL=False,
                                                                            num_warps=1),
            "triton copy-qk, 1 prog/token w4": lambda: copy_qk_kernel[(T,)](q, qo, k, ko, QN=HQ * 128, KN=HK * 128,
                                                                            PDL=False, num_warps=4),
        }
        if pdl:
            variants["triton copy-q, 1 prog/token w4 PDL"] = lambda: copy_kernel[(T,)](
                q, qo, n, BLOCK=HQ * 128, PDL=True, num_warps=4, launch_pdl=True)
            variants["triton copy-qk, 1 prog/token w4 PDL"] = lambda: copy_qk_kernel[(T,)](
                q, qo, k, ko, QN=HQ * 128, KN=HK * 128, PDL=True, num_warps=4, launch_pdl=True)
        for label, kwargs in (("exact", dict(positions=offsets)), ("hf table", dict(cos=cos, sin=sin))):
            kw = validate(q, k, **kwargs)
            for cfg in (None, *extra_configs):
                if cfg:  # 0 heads per block: every head (the next power of two)
                    cfg = (cfg[0], cfg[1] or 1 << (HQ - 1).bit_length(), cfg[2] or 1 << (HK - 1).bit_length(), *cfg[3:])
                variants[f"ropekit {label} {cfg or 'default'}"] = (
                    lambda kw=kw, c=cfg: launch_rope(q, k, qo, ko, kw, config=c))
        if liger_rotary_pos_emb is not None:
            ql, kl = q.transpose(1, 2), k.transpose(1, 2)  # Liger takes [B, H, S, D]
            variants["liger (in place)"] = lambda: liger_rotary_pos_emb(ql, kl, cos, sin)
        for name, fn in list(variants.items()):
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - a variant this Triton cannot build is reported, not fatal
                print(f"{T:>6} {name:<44} failed: {type(exc).__name__}: {str(exc)[:120]}")
                del variants[name]
        timed = graph_us_interleaved(variants)
        base = timed["copy-q (torch copy_)"]
        for name, fn in variants.items():
            g = timed[name]
            after = marginal_us(fn, copy_q)
            kern = ", ".join(f"{key.split('(')[0][:14]} {v:.2f}" for key, v in kernel_us(fn).items())
            print(f"{T:>6} {name:<44} {g:>9.2f} {g / base:>8.2f} {after:>10.2f} {kern:>22}")


if __name__ == "__main__":
    main(ARGS)
