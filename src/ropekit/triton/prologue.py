"""Launchers of the attention prologue kernels (:mod:`ropekit.triton.prologue_kernels`): ``launch_prologue``
(norm + RoPE, and the K/V cache write) and ``launch_norm_rope_bwd`` (the backward of norm + RoPE), and the launch
recorder of the eager fast path. Their block shapes come from :mod:`ropekit.triton.heuristics`.
"""

from __future__ import annotations

import threading

import torch

from ropekit._spec import CacheSpec, RopeSpec, to_canonical
from ropekit.triton import heuristics, launcher
from ropekit.triton.prologue_kernels import CACHE_NONE, CACHE_PAGED, CACHE_ROWS, norm_rope_bwd_kernel, prologue_kernel


def _record(launch: tuple) -> None:
    launches = getattr(RECORDER, "launches", None)
    if launches is not None:
        launches.append(launch)


def _roles(fn) -> launcher.KernelRoles:
    names = fn.arg_names
    return launcher.KernelRoles(fn, tuple(names[names.index("HEAD_DIM"):]), ("q_scale", "k_scale", "rotary_scale",
                                "w_offset", "eps", "v_scale"), ("pos_offset",))


PROLOGUE = _roles(prologue_kernel)
# The eager fast path (ropekit._fastpath) records a plan from the launch the full path made: while it sets
# RECORDER.launches to a list (per thread: autograd runs backward on its own threads), launch_prologue and
# launch_norm_rope_bwd append their (grid, args, constexprs, num_warps, roles, device); the list holds the call's
# tensors, and the fast path drops it after use.
RECORDER = threading.local()
NORM_ROPE_BWD = _roles(norm_rope_bwd_kernel)

def _rope_arguments(args: tuple, constexprs: tuple) -> dict:
    """``rope_kernel``'s launch by parameter name, its row strides in elements (it takes them in units)."""
    named = dict(zip(launcher.kernel.rope_kernel.arg_names, (*args, *constexprs)))
    for name in launcher.ROW_STRIDES:
        named[name] *= named["STRIDE_UNIT"]
    return named


# rope_kernel's arguments and constexprs that the prologue kernels take too, in their order.
_ROPE_ARGS = ("HQ", "HK", "S", "num_tokens", "pos_ptr", "pos_sb", "pos_ss", "seq_off_ptr", "pos_offset", "cu_ptr",
              "n_seqs", "n_search_steps", "freq_ptr", "cos_ptr", "sin_ptr", "t_sb", "t_sr", "t_sc", "table_rows",
              "q_scale", "k_scale", "rotary_scale", "pos_sa")
_ROPE_CONSTEXPRS = ("HEAD_DIM", "ROT_DIM", "ROT_START", "NEOX", "POS_MODE", "HAS_SEQ_OFFSETS", "FREQ_MODE",
                    "TABLE_BY_TOKEN", "TABLE_FULL", "FAST_TRIG", "NUM_AXES", "AXES_INTERLEAVED", "AXIS_BOUND_1",
                    "AXIS_BOUND_2", "AXIS_BOUND_3", "BLOCK_T", "BLOCK_HQ", "BLOCK_HK", "HALF_BLOCK", "PASS_BLOCK")


def _grid_dims(q, k, spec: RopeSpec) -> tuple[int, int, int, int, int]:
    """(tokens, HQ, HK, head_dim, element size): what the block shapes read of a call."""
    B, S, HQ, D = to_canonical(q, spec.layout).shape
    return B * S, HQ, to_canonical(k, spec.layout).shape[2], D, q.element_size()


def prologue_block_config(q, k, spec: RopeSpec, *, norm: bool, cache: bool, min_programs: int):
    """The block shape ``launch_prologue`` takes on a CUDA device with ``min_programs`` wanted (None: the launcher's
    own choice); see :func:`ropekit.triton.heuristics.prologue_config`."""
    dims = _grid_dims(q, k, spec)
    return heuristics.prologue_config(dims, min_programs, norm=norm, cache=cache,
                                      gathered=spec.positions is not None or spec.cu_seqlens is not None,
                                      partial=spec.rotary_dim != dims[3])


def launch_prologue(q, k, q_out, k_out, spec: RopeSpec, *, v=None, cache: CacheSpec | None = None,
                    q_weight=None, k_weight=None, weight_offset: float = 0.0, eps: float = 1e-6,
                    config=None) -> None:
    """Normalise (with weights) and rotate q into ``q_out`` and k into ``k_out`` -- or, with ``cache``, k and v
    into its caches -- as ``spec`` says, in one launch. q, k, v in ``spec.layout``; allocates nothing.
    ``config`` overrides the block shape as in :func:`ropekit.triton.launcher.launch_rope` (tuning only)."""
    if config is None and q.is_cuda:
        config = prologue_block_config(q, k, spec, norm=q_weight is not None, cache=cache is not None,
                                       min_programs=heuristics.num_programs_wanted(q.device))
    if q_weight is not None:  # the kernel indexes the weights densely
        q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    launch = launcher.kernel_launch(q, k, q_out, k if cache is not None else k_out, spec, config=config)
    if launch is None:
        return
    grid, args, constexprs, num_warps = launch
    named = _rope_arguments(args, constexprs)
    dummy = q
    k_ptr_scale = v_ptr_scale = False
    k_div = v_div = 1.0
    if cache is None:
        mode, k_target, ko_sh, v_target, vo_sh, v_strides = CACHE_NONE.value, k_out, named["ko_sh"], dummy, 0, (0, 0, 0)
        c_args = (dummy, dummy, 0, 0, 0, 1, 0, 0, 0, 0)
        k_fp8 = v_fp8 = False
    else:
        mode = (CACHE_PAGED if cache.paged else CACHE_ROWS).value
        k_target, v_target = cache.views()
        ko_sh, vo_sh = k_target.stride(2), v_target.stride(2)
        v_strides = to_canonical(v, spec.layout).stride()[:3]
        slots = cache.slots
        c_args = (cache.cache_batch if cache.cache_batch is not None else dummy,
                  slots if slots is not None else dummy,
                  slots.stride(0) if slots is not None else 0, slots.stride(1) if slots is not None else 0,
                  cache.rows, cache.block_size, k_target.stride(0), k_target.stride(1), v_target.stride(0),
                  v_target.stride(1))
        k_fp8 = k_target.dtype == torch.float8_e4m3fn
        v_fp8 = v_target.dtype == torch.float8_e4m3fn
        k_ptr_scale = isinstance(cache.k_scale, torch.Tensor)
        v_ptr_scale = isinstance(cache.v_scale, torch.Tensor)
        k_div = 1.0 if k_ptr_scale else 1.0 / cache.k_scale
        v_div = 1.0 if v_ptr_scale else 1.0 / cache.v_scale
        grid = (grid[0] + heuristics.cdiv(named["HK"], named["BLOCK_HK"]), grid[1], grid[2])  # v's head blocks
    prologue_args = (
        named["q_ptr"], named["qo_ptr"], named["k_ptr"], k_target, v if v is not None else dummy, v_target,
        named["q_sb"], named["q_ss"], named["q_sh"], named["qo_sb"], named["qo_ss"], named["qo_sh"],
        named["k_sb"], named["k_ss"], named["k_sh"], named["ko_sb"], named["ko_ss"], ko_sh, *v_strides, vo_sh,
        *(named[n] for n in _ROPE_ARGS[:-3]), named["k_scale"] * k_div, named["rotary_scale"], named["pos_sa"],
        q_weight if q_weight is not None else dummy, k_weight if k_weight is not None else dummy,
        float(weight_offset), float(eps), *c_args,
        cache.k_scale if k_ptr_scale else dummy, cache.v_scale if v_ptr_scale else dummy, v_div,
    )
    const = {n: named[n] for n in _ROPE_CONSTEXPRS}
    const.update(NORM=q_weight is not None, CACHE_MODE=mode,
                 CACHE_BATCH_PER_TOKEN=cache is not None and cache.cache_batch is not None,
                 K_SCALE_PTR=k_ptr_scale, V_SCALE_PTR=v_ptr_scale, K_FP8=k_fp8, V_FP8=v_fp8,
                 ROUND_FP8=q.device.type != "cuda", D_BLOCK=heuristics.next_pow2(named["HEAD_DIM"]))
    constexprs = tuple(const[n] for n in PROLOGUE.constexprs)
    launcher._launch(grid, prologue_args, constexprs, num_warps, q.device, PROLOGUE)
    _record((grid, prologue_args, constexprs, num_warps, PROLOGUE, q.device))


def launch_norm_rope_bwd(grad_q, q, grad_k, k, spec: RopeSpec, q_weight, k_weight, weight_offset: float,
                         eps: float, config=None) -> tuple:
    """(dq, dk, dq_weight, dk_weight) of ``qk_norm_rope`` for the output gradients ``grad_q``/``grad_k`` (last
    dim contiguous); dq/dk in q's/k's dtype, the weight gradients in fp32."""
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()  # the kernel indexes the weights densely
    if config is None and q.is_cuda:  # the interpreter takes the launcher's own (large) programs
        dims = _grid_dims(q, k, spec)
        config = heuristics.norm_block_config(*dims, heuristics.num_programs_wanted(q.device), "backward",
                                              partial=spec.rotary_dim != dims[3])
    launch = launcher.kernel_launch(grad_q, grad_k, dq, dk, spec, config=config)
    if launch is None:
        zq = torch.zeros(q.shape[-1], dtype=torch.float32, device=q.device)
        return dq.zero_(), dk.zero_(), zq, zq.clone()
    grid, args, constexprs, num_warps = launch
    named = _rope_arguments(args, constexprs)
    n_tb = heuristics.cdiv(named["num_tokens"], named["BLOCK_T"])
    n_qb = heuristics.cdiv(named["HQ"], named["BLOCK_HQ"])
    n_kb = heuristics.cdiv(named["HK"], named["BLOCK_HK"])
    groups = heuristics.bwd_program_groups(n_tb, n_qb + n_kb, q.device)
    grid = (n_qb + n_kb, groups, 1)
    D = named["HEAD_DIM"]
    dwq = torch.empty(groups * n_qb, D, dtype=torch.float32, device=q.device)
    dwk = torch.empty(groups * n_kb, D, dtype=torch.float32, device=q.device)
    qc, kc = to_canonical(q, spec.layout), to_canonical(k, spec.layout)
    bwd_args = (
        named["q_ptr"], qc, named["qo_ptr"], named["k_ptr"], kc, named["ko_ptr"], dwq, dwk,
        named["q_sb"], named["q_ss"], named["q_sh"], *qc.stride()[:3], named["qo_sb"], named["qo_ss"], named["qo_sh"],
        named["k_sb"], named["k_ss"], named["k_sh"], *kc.stride()[:3], named["ko_sb"], named["ko_ss"], named["ko_sh"],
        *(named[n] for n in _ROPE_ARGS), q_weight, k_weight, float(weight_offset), float(eps), n_tb,
    )
    const = {n: named[n] for n in _ROPE_CONSTEXPRS}
    constexprs = tuple(const[n] for n in NORM_ROPE_BWD.constexprs)
    launcher._launch(grid, bwd_args, constexprs, num_warps, q.device, NORM_ROPE_BWD)
    _record((grid, bwd_args, constexprs, num_warps, NORM_ROPE_BWD, q.device))
    return dq, dk, dwq.sum(0), dwk.sum(0)
