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
    """Warps for a program holding ``n_heads`` heads of ``head_dim`` (padded to powers of two): 2 up to 1024
    values, 4 up to 4096 (FLUX's 24 x 128 pads to 4096), 8 above (WAN-14B's 40 x 128 pads to 8192)."""
    size = heuristics.next_pow2(n_heads) * heuristics.next_pow2(head_dim)
    return 2 if size <= 1024 else 4 if size <= 4096 else 8


def launch_hidden_norm_rope(q, k, q_out, k_out, spec: RopeSpec, q_weight, k_weight, weight_offset: float,
                            eps: float, v=None, v_out=None) -> None:
    """Normalise each token of q (k) over its H * D values with ``q_weight`` [H * D] (``k_weight`` [Hk * D]),
    rotate each head into ``q_out`` (``k_out``) as ``spec`` says, and copy ``v`` into ``v_out`` (k's shape), in
    one launch. Tensors in ``spec.layout``; allocates nothing."""
    HQ, HK = to_canonical(q, spec.layout).shape[2], to_canonical(k, spec.layout).shape[2]
    D = q.shape[-1]
    block_hq, block_hk = heuristics.next_pow2(HQ), heuristics.next_pow2(HK)
    num_warps = max(hidden_num_warps(HQ, D), hidden_num_warps(HK, D))
    launch = launcher.rope_arguments(q, k, q_out, k_out, spec, config=(1, block_hq, block_hk, num_warps))
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
    constexprs.update(BLOCK_T=1, BLOCK_HQ=block_hq, BLOCK_HK=block_hk)
    grid = (3 if v is not None else 2, grid[1], grid[2])
    runtime.launch(HIDDEN_NORM_ROPE, grid, args, constexprs, num_warps, q.device)
