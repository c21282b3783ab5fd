"""qk_norm_rope's backward launcher alone (the kernel, which also adds up the weight gradients), replayed in a CUDA
graph, at Qwen3-8B's shape (bf16, 32/8 heads, D 128, positions [B, S], inv_freq given), per value of
`heuristics.BWD_PROGRAMS_PER_SM`, over 1.5 copies of q+k (what it reads and writes besides the gradients' rows: the
output gradients, the inputs, dq and dk are three passes over q+k, i.e. 1.5 copies) timed in the same run. Needs a
CUDA GPU. ``same-grid copy``: the backward's own grid, block shape and loop over token blocks, loading the output
gradient's and the input's tiles and storing their sum where dq and dk go, with no positions, angles, rotation or
norm: what the kernel's access pattern costs apart from its arithmetic.

    python benchmarks/probes/qknorm_bwd.py [--sizes 4x4096,16x4096] [--per-sm 16,8,4,2,1]
"""

import argparse
import itertools

import torch
import triton
import triton.language as tl
from _graphs import do_bench_us, graph_replay

from ropekit._validation import validate
from ropekit.triton import heuristics
from ropekit.triton import prologue_launcher as launcher
from ropekit.triton.kernel import _head_tile, _load_heads, _store_pairs, _token_block


@triton.jit
def _copy_heads(g_ptr, x_ptr, o_ptr, h0, H, num_tokens, S, n_token_blocks, D: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_H: tl.constexpr):
    for tb in range(tl.program_id(1), n_token_blocks, tl.num_programs(1)):
        t, mask_t, b, s = _token_block(tb, num_tokens, S, BLOCK_T)
        base, m = _head_tile(b, s, mask_t, h0, H, S * H * D, H * D, D, BLOCK_H)
        g_lo, g_hi, g_p = _load_heads(g_ptr, base, m, D, D, 0, True, D // 2, 1, False, False)
        x_lo, x_hi, x_p = _load_heads(x_ptr, base, m, D, D, 0, True, D // 2, 1, False, False)
        _store_pairs(o_ptr, base, m, g_lo + x_lo, g_hi + x_hi, g_p, D, D, 0, True, D // 2, 1, False, False, False)


@triton.jit
def _same_grid_copy_kernel(gq_ptr, q_ptr, dq_ptr, gk_ptr, k_ptr, dk_ptr, HQ, HK, S, num_tokens, n_token_blocks,
                           D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr):
    """norm_rope_bwd_kernel's grid and loop (contiguous bshd tensors): dq = gq + q, dk = gk + k."""
    hb = tl.program_id(0)
    n_qb = tl.cdiv(HQ, BLOCK_HQ)
    if hb < n_qb:
        _copy_heads(gq_ptr, q_ptr, dq_ptr, hb * BLOCK_HQ, HQ, num_tokens, S, n_token_blocks, D, BLOCK_T, BLOCK_HQ)
    else:
        _copy_heads(gk_ptr, k_ptr, dk_ptr, (hb - n_qb) * BLOCK_HK, HK, num_tokens, S, n_token_blocks, D, BLOCK_T,
                    BLOCK_HK)


def same_grid_copy(gq, q, gk, k, dq, dk):
    """The launch of :func:`_same_grid_copy_kernel` on the grid the backward launcher takes for these tensors."""
    B, S, HQ, D = q.shape
    HK = k.shape[2]
    bt, bhq, bhk, warps = heuristics.norm_block_config(B * S, HQ, HK, D, q.element_size(),
                                                       heuristics.num_programs_wanted(q.device), "backward")
    n_tb, n_qb, n_kb = heuristics.cdiv(B * S, bt), heuristics.cdiv(HQ, bhq), heuristics.cdiv(HK, bhk)
    grid = (n_qb + n_kb, heuristics.bwd_program_groups(n_tb, n_qb + n_kb, q.device))
    return lambda: _same_grid_copy_kernel[grid](gq, q, dq, gk, k, dk, HQ, HK, S, B * S, n_tb, D=D, BLOCK_T=bt,
                                                BLOCK_HQ=bhq, BLOCK_HK=bhk, num_warps=warps)




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4x4096,16x4096")
    parser.add_argument("--per-sm", default="16,8,4,2,1")
    parser.add_argument("--stages", default="1", help="values of heuristics.BWD_STAGES, comma-separated")
    parser.add_argument("--configs", default="", help="block shapes BT:BHQ:BHK:WARPS besides the default")
    args = parser.parse_args()
    dev, dt, hq, hk, d = "cuda", torch.bfloat16, 32, 8, 128
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for size in args.sizes.split(","):
        b, s = map(int, size.split("x"))
        q, k = torch.randn(b, s, hq, d, device=dev, dtype=dt), torch.randn(b, s, hk, d, device=dev, dtype=dt)
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        w = torch.rand(d, device=dev, dtype=dt) + 0.5
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
        spec = validate(q, k, positions=torch.arange(s, device=dev)[None].expand(b, s), inv_freq=inv_freq)
        flat = torch.cat([q.flatten(), k.flatten()])
        out = torch.empty_like(flat)
        copy = do_bench_us(lambda: out.copy_(flat))
        default, default_stages = heuristics.BWD_PROGRAMS_PER_SM, heuristics.BWD_STAGES
        configs = [None] + [tuple(map(int, c.split(":"))) for c in args.configs.split(",") if c]
        for per_sm, stages, config in itertools.product(map(int, args.per_sm.split(",")),
                                                         map(int, args.stages.split(",")), configs):
            heuristics.BWD_PROGRAMS_PER_SM, heuristics.BWD_STAGES = per_sm, stages
            step = lambda c=config: launcher.launch_norm_rope_bwd(gq, q, gk, k, spec, w, w, 0.0, 1e-6,  # noqa: E731
                                                                  config=c)
            t = do_bench_us(graph_replay(step))
            print(f"{size} programs per SM wanted {per_sm:3d}, stages {stages}, block {config or 'default'}: "
                  f"{t:.1f} us = {t / (1.5 * copy):.3f}x its bytes", flush=True)
        heuristics.BWD_PROGRAMS_PER_SM, heuristics.BWD_STAGES = default, default_stages
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        copy_fn = same_grid_copy(gq, q, gk, k, dq, dk)
        copy_fn()
        torch.testing.assert_close(dq, (gq.float() + q.float()).to(dq.dtype))  # it copies what it should
        t = do_bench_us(graph_replay(copy_fn))
        print(f"{size} same-grid copy (programs per SM wanted {default}): {t:.1f} us = {t / (1.5 * copy):.3f}x its "
              "bytes", flush=True)


if __name__ == "__main__":
    main()
