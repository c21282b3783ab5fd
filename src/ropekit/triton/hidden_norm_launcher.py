"""Launcher of the whole-hidden QK-norm + RoPE kernel (:mod:`ropekit.triton.hidden_norm_kernels`).

It starts from ``rope_kernel``'s launch for the call (positions, frequencies, grid over tokens) with a block shape
of its own: one token a program and all of a tensor's heads in it, so that each token's norm is one fixed tree.
"""

from __future__ import annotations

from ropekit._spec import RopeSpec, to_canonical
from ropekit.triton import heuristics, launcher, runtime
from ropekit.triton.hidden_norm_kernels import hidden_norm_rope_kernel

HIDDEN_NORM_ROPE = runtime.KernelRoles(hidden_norm_rope_kernel, ("q_scale", "k_scale", "rotary_scale", "w_offset",
                                                                 "eps"), ("pos_offset",))
_ROPE_ARGS = ("q_ptr", "qo_ptr", "k_ptr", "q_sb", "q_ss", "q_sh", "qo_sb", "qo_ss", "qo_sh", "k_sb", "k_ss", "k_sh",
              "ko_sb", "ko_ss", "ko_sh", "HQ", "HK", "S", "num_tokens", "pos_ptr", "pos_sb", "pos_ss",
              "seq_off_ptr", "pos_offset", "cu_ptr", "n_seqs", "n_search_steps", "freq_ptr", "cos_ptr", "sin_ptr",
              "t_sb", "t_sr", "t_sc", "table_rows", "q_scale", "k_scale", "rotary_scale", "pos_sa")


def hidden_num_warps(n_heads: int, head_dim: int) -> int:
    """Warps for a program holding ``n_heads`` rows (heads, or tokens x heads) of ``head_dim`` (padded to powers
    of two): 2 up to 1024 values, 4 up to 4096 (one token of FLUX's 24 x 128 pads to 4096), 8 above."""
    size = heuristics.next_pow2(n_heads) * heuristics.next_pow2(head_dim)
    return 2 if size <= 1024 else 4 if size <= 4096 else 8


# Values (tokens x padded heads x padded head dim) a program holds: one token a program left the H200 at 4.4-5x a
# copy of the bytes at WAN shapes, 4 x 64 x 128 (40 heads) and 8 x 32 x 128 (24) cut that by 1.8-2x
# (docs/perf-notes.md, "Whole-hidden norm").
HIDDEN_TILE_VALUES = 32768


def hidden_tokens_and_warps(block_h: int, head_dim: int) -> tuple[int, int]:
    """(tokens a program holds, its warps) for ``block_h`` (padded) heads of ``head_dim``: tokens up to
    :data:`HIDDEN_TILE_VALUES` values (1 to 8; each token's norm is its own fixed tree whatever their number),
    and warps as :func:`hidden_num_warps` counts them for the whole tile."""
    per_token = block_h * heuristics.next_pow2(head_dim)
    block_t = max(1, min(8, HIDDEN_TILE_VALUES // per_token))
    return block_t, hidden_num_warps(block_t * block_h, head_dim)


def launch_hidden_norm_rope(q, k, q_out, k_out, spec: RopeSpec, q_weight, k_weight, weight_offset: float,
                            eps: float, v=None, v_out=None, tokens_and_warps: tuple[int, int] | None = None) -> None:
    """Normalise each token of q (k) over its H * D values with ``q_weight`` [H * D] (``k_weight`` [Hk * D]),
    rotate each head into ``q_out`` (``k_out``) as ``spec`` says, and copy ``v`` into ``v_out`` (k's shape), in
    one launch. Tensors in ``spec.layout``; allocates nothing. ``tokens_and_warps`` overrides the tokens a
    program holds and its warps (tuning only)."""
    HQ, HK = to_canonical(q, spec.layout).shape[2], to_canonical(k, spec.layout).shape[2]
    D = q.shape[-1]
    block_hq, block_hk = heuristics.next_pow2(HQ), heuristics.next_pow2(HK)
    block_t, num_warps = tokens_and_warps or hidden_tokens_and_warps(max(block_hq, block_hk), D)
    launch = launcher.rope_arguments(q, k, q_out, k_out, spec, config=(block_t, block_hq, block_hk, num_warps))
    if launch is None:
        return
    grid, rope, rope_constexprs, num_warps = launch
    rope = dict(rope)
    for name in launcher.ROW_STRIDES:  # rope_kernel takes them in units of STRIDE_UNIT, this kernel in elements
        rope[name] *= rope_constexprs["STRIDE_UNIT"]
    args = {name: rope[name] for name in _ROPE_ARGS}
    args.update(ko_ptr=k_out, qw_ptr=q_weight.contiguous(), kw_ptr=k_weight.contiguous(),
                w_offset=float(weight_offset), eps=float(eps))
    if v is not None:
        v_sb, v_ss, v_sh = to_canonical(v, spec.layout).stride()[:3]
        vo_sb, vo_ss, vo_sh = to_canonical(v_out, spec.layout).stride()[:3]
        args.update(v_ptr=v, vo_ptr=v_out, v_sb=v_sb, v_ss=v_ss, v_sh=v_sh, vo_sb=vo_sb, vo_ss=vo_ss, vo_sh=vo_sh)
    else:
        args.update(v_ptr=q, vo_ptr=q_out, v_sb=0, v_ss=0, v_sh=0, vo_sb=0, vo_ss=0, vo_sh=0)
    constexprs = {name: rope_constexprs[name] for name in HIDDEN_NORM_ROPE.constexprs if name in rope_constexprs}
    constexprs["D_BLOCK"] = heuristics.next_pow2(D)
    constexprs.update(BLOCK_T=block_t, BLOCK_HQ=block_hq, BLOCK_HK=block_hk)
    grid = (3 if v is not None else 2, grid[1], grid[2])
    runtime.launch(HIDDEN_NORM_ROPE, grid, args, constexprs, num_warps, q.device)
