"""Instructions per warp of ``rope_kernel``'s decode specialisations, compiled offline for sm_90 (no GPU needed):
what each kind of call adds to the access path, which the issue rate turns into time once a grid has a few warps
on every scheduler (decode at 64-256 tokens).

Compiles, with Triton's own ptxas, the q-head branch of the kernel the launcher would launch on a GPU for the
Llama-3-8B decode shape (32/8 heads, D 128, bf16, one token per sequence) at a block shape, for: exact angles
from per-token positions, a transformers-style per-token table (no angle math), M-RoPE positions (contiguous and
interleaved sections 16/24/24), and ``decode_probe.py``'s ``rope path, no rotation`` (the same grid, addresses,
loads and stores, no rotation). Prints the SASS instruction count up to the branch's exit and its largest opcode
groups, and the issue cycles (the stall counts of the instructions before it) at which each global load and the
first store issue: a one-token program is one pass through this list, so the data loads must issue before the
first instruction that waits for a position, or the call pays two round trips to memory instead of one.

Compiled with the Triton version the GPU runs (``pip install triton==<version> --target <dir>`` and that dir first
on PYTHONPATH), the SASS, stall counts included, equals the GPU JIT's instruction for instruction.

    python benchmarks/probes/sass_count.py [--tokens 256] [--configs 1x8x8x1,1x8x8x4]
"""

# ruff: noqa: E402 - options are parsed before torch, Triton and ropekit load, so --help runs on any machine
from __future__ import annotations

import argparse


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256, help="decode tokens (one per sequence)")
    parser.add_argument("--configs", default="1x8x8x1,1x8x8x4",
                        help="comma-separated block shapes BLOCK_T x BLOCK_HQ x BLOCK_HK x warps")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help exits here

import collections
import sys
from pathlib import Path

import torch

# the offline compile helpers of the compile-target test (the same specialisation rules as the GPU's JIT)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from _copies import same_grid_copy_kernel

from helpers import compile_for_target
from test_compile_targets import _compile_for


def _branch(compiled) -> tuple[list[str], list[int]]:
    """SASS opcodes of the first branch (the q heads), up to its first EXIT, and the issue cycle of each: the sum
    of the stall counts (the control code's last field, in hex) of the instructions before it."""
    ops, cycles, cycle = [], [], 0
    for line in compiled.asm["sass"].splitlines():
        if "\t" not in line:
            continue
        control, text = line.split("\t", 1)
        words = text.split()
        op = words[1] if words[0].startswith("@") else words[0]
        if op.startswith("EXIT"):
            break
        ops.append(op.split(".")[0])
        cycles.append(cycle)
        cycle += int(control.rsplit(":", 1)[-1], 16)
    return ops, cycles


def _memory_cycles(ops: list[str], cycles: list[int]) -> str:
    """Issue cycles of the branch's global loads and of its first store."""
    loads = ",".join(str(c) for op, c in zip(ops, cycles) if op == "LDG")
    store = next((c for op, c in zip(ops, cycles) if op == "STG"), None)
    return f"loads @{loads}  first store @{store}"


def main(args: argparse.Namespace) -> None:
    T = args.tokens
    q = torch.randn(T, 1, 32, 128, dtype=torch.bfloat16)
    k = torch.randn(T, 1, 8, 128, dtype=torch.bfloat16)
    positions = torch.randint(0, 8192, (3, T, 1))
    table = torch.randn(T, 1, 128, dtype=torch.bfloat16)
    calls = {
        "exact angles": dict(positions=positions[0].clone(), base=5e5),
        "per-token table": dict(cos=table, sin=table),
        "M-RoPE contiguous": dict(positions=positions, sections=(16, 24, 24), base=5e5),
        "M-RoPE interleaved": dict(positions=positions, sections=(16, 24, 24), section_layout="interleaved",
                                   base=5e5),
    }
    print(f"{T} tokens, 32/8 heads, D 128, bf16; SASS instructions per warp in the q branch (sm_90)")
    for text in args.configs.split(","):
        config = tuple(int(x) for x in text.split("x"))
        rows = {name: _branch(_compile_for("sm90", q, k, config, **kw)) for name, kw in calls.items()}
        bt, bhq, bhk, warps = config
        copy_args = (q, q, k, k, *q.stride()[:3], *k.stride()[:3], 32, 8, 1, T)
        rows["rope path, no rotation"] = _branch(compile_for_target(
            "sm90", same_grid_copy_kernel, copy_args,
            dict(D=128, BLOCK_T=bt, BLOCK_HQ=bhq, BLOCK_HK=bhk, TOKENS_FIRST=False), warps))
        print(f"block shape {config}")
        for name, (ops, cycles) in rows.items():
            top = ", ".join(f"{op} {n}" for op, n in collections.Counter(ops).most_common(8))
            print(f"  {name:<24} {len(ops):>5}   {top}")
            print(f"  {'':<24} {'':>5}   issue cycles: {_memory_cycles(ops, cycles)}")


if __name__ == "__main__":
    main(ARGS)
