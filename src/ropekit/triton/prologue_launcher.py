"""Launchers of the attention prologue kernels (:mod:`ropekit.triton.prologue_kernels`): ``launch_prologue``
(norm + RoPE, and the K/V cache write) and ``launch_norm_rope_bwd`` (the backward of norm + RoPE).

Both start from ``rope_kernel``'s launch for the call (:func:`ropekit.triton.launcher.rope_arguments`: positions,
frequencies, block shape and grid), whose arguments the prologue kernels share by name, and add their own. They
allocate nothing but the backward's outputs, and launch through :func:`ropekit.triton.runtime.launch`, which
records the launch for the eager fast path.
"""

from __future__ import annotations

import torch

from ropekit import _config
from ropekit._spec import CacheSpec, OutQuant, RopeSpec, to_canonical
from ropekit.triton import heuristics, launcher, runtime
from ropekit.triton.prologue_kernels import (
    CACHE_NONE,
    CACHE_PAGED,
    CACHE_ROWS,
    CACHE_TABLE,
    FP8_E4M3,
    FP8_E5M2,
    HAS_GDC,
    norm_rope_bwd_kernel,
    prologue_kernel,
)

_FLOATS = ("q_scale", "k_scale", "rotary_scale", "w_offset", "eps", "v_scale", "kr_scale")
PROLOGUE = runtime.KernelRoles(prologue_kernel, _FLOATS, ("pos_offset",), unfused_when="NORM", pdl_when="PDL")
NORM_ROPE_BWD = runtime.KernelRoles(norm_rope_bwd_kernel, _FLOATS, ("pos_offset",))

# rope_kernel's runtime arguments that both prologue kernels take as they are (positions, frequencies, scales).
_ROPE_ARGS = ("HQ", "HK", "S", "num_tokens", "pos_ptr", "pos_sb", "pos_ss", "seq_off_ptr", "pos_offset", "cu_ptr",
              "n_seqs", "n_search_steps", "freq_ptr", "cos_ptr", "sin_ptr", "t_sb", "t_sr", "t_sc", "table_rows",
              "q_scale", "k_scale", "rotary_scale", "pos_sa")


def _rope_launch(q, k, q_out, k_out, spec: RopeSpec, config):
    """(grid, rope_kernel's runtime arguments by name with its row strides in elements -- it takes them in units
    of STRIDE_UNIT, the prologue kernels in elements --, its constexprs by name, num_warps); None when there is
    nothing to rotate."""
    launch = launcher.rope_arguments(q, k, q_out, k_out, spec, config=config)
    if launch is None:
        return None
    grid, args, constexprs, num_warps = launch
    args = dict(args)
    for name in launcher.ROW_STRIDES:
        args[name] *= constexprs["STRIDE_UNIT"]
    return grid, args, constexprs, num_warps


def _shared_constexprs(roles: runtime.KernelRoles, rope_constexprs: dict) -> dict:
    """``rope_constexprs`` that the kernel of ``roles`` takes too (every constexpr of the same name)."""
    return {name: rope_constexprs[name] for name in roles.constexprs if name in rope_constexprs}


def _fp8_kind(dtype: torch.dtype) -> int:
    """The kernel's float8 kind of a target dtype (0: not float8)."""
    return {torch.float8_e4m3fn: FP8_E4M3.value, torch.float8_e5m2: FP8_E5M2.value}.get(dtype, 0)


def _scale_mode(scale) -> int:
    """How the kernel takes a scale: 0 a float divided in on the host, 1 a one-element device tensor, 2 per head."""
    if not isinstance(scale, torch.Tensor):
        return 0
    return 2 if scale.dim() == 1 and scale.numel() > 1 else 1


def _columns(target) -> tuple[int, int, int]:
    """(PACK, col_sa, col_sb) of a cache view's columns for the kernel: (0, 0, 0) for unit-stride columns; a 5-D
    view [.., D/x, x] (x-packed keys) gives (x, its two strides), a 4-D view with strided columns (1, stride, 0)."""
    if target.dim() == 5:
        return target.shape[4], target.stride(3), target.stride(4)
    if target.stride(3) != 1:
        return 1, target.stride(3), 0
    return 0, 0, 0


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
                    quant: OutQuant | None = None, q_scales=None, k_scales=None, k_rotated=None,
                    config=None) -> None:
    """Normalise (with weights) and rotate q into ``q_out`` and k into ``k_out`` -- or, with ``cache``, k and v
    into its caches -- as ``spec`` says, in one launch. q, k, v in ``spec.layout``; allocates nothing.
    float8 ``q_out``/``k_out`` store ``value / scale`` with ``quant``'s scales, or with ``quant.dynamic`` each
    row's own scale, written to ``q_scales``/``k_scales`` (float32, q's/k's [B, S, H] in ``spec.layout``).
    ``k_rotated`` (with ``cache``): k's rotation is also written there (k's shape and dtype).
    ``config`` overrides the block shape as in :func:`ropekit.triton.launcher.launch_rope` (tuning only)."""
    if config is None and q.is_cuda:
        config = prologue_block_config(q, k, spec, norm=q_weight is not None, cache=cache is not None,
                                       min_programs=heuristics.num_programs_wanted(q.device))
    if q_weight is not None:  # the kernel indexes the weights densely
        q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    launch = _rope_launch(q, k, q_out, k if cache is not None else k_out, spec, config)
    if launch is None:
        return
    grid, rope, rope_constexprs, num_warps = launch
    dummy = q  # stands for absent tensors (never read)
    args = {name: rope[name] for name in (
        "q_ptr", "qo_ptr", "k_ptr", "q_sb", "q_ss", "q_sh", "qo_sb", "qo_ss", "qo_sh", "k_sb", "k_ss", "k_sh",
        "ko_sb", "ko_ss", *_ROPE_ARGS)}
    args.update(v_ptr=v if v is not None else dummy, qw_ptr=q_weight if q_weight is not None else dummy,
                kw_ptr=k_weight if k_weight is not None else dummy, w_offset=float(weight_offset), eps=float(eps))
    constexprs = _shared_constexprs(PROLOGUE, rope_constexprs)
    k_div = 1.0  # what k's cache scale divides it by, unless the kernel reads the scale itself
    q_div = 1.0  # the same for q's float8 output scale
    q_scale_mode = 0
    dynamic = quant is not None and quant.dynamic
    args.update(qs_ptr=dummy, qd_ptr=dummy, qd_sb=0, qd_ss=0, qd_sh=0, kd_ptr=dummy, kd_sb=0, kd_ss=0, kd_sh=0,
                n_slots=0, kr_ptr=dummy, kr_sb=0, kr_ss=0, kr_sh=0, kr_scale=rope["k_scale"], pages_ptr=dummy,
                indptr_ptr=dummy, last_ptr=dummy, n_requests=0, n_page_ids=0, kc_sa=0, kc_sx=0, vc_sa=0, vc_sx=0)
    constexprs.update(SLOTS_SHORT=False, K_RETURN=k_rotated is not None, TABLE_BATCH=False, K_PACK=0, V_PACK=0,
                      K_UNIT=1)
    if k_rotated is not None:
        kr_sb, kr_ss, kr_sh = to_canonical(k_rotated, spec.layout).stride()[:3]
        args.update(kr_ptr=k_rotated, kr_sb=kr_sb, kr_ss=kr_ss, kr_sh=kr_sh)
    if quant is not None and not dynamic:
        q_scale_mode = _scale_mode(quant.q_scale)
        q_div = 1.0 if q_scale_mode else 1.0 / quant.q_scale
        if q_scale_mode:
            args.update(qs_ptr=quant.q_scale)
    for name, scales in (("q", q_scales), ("k", k_scales)):
        if dynamic and scales is not None:
            sb, ss, sh = to_canonical(scales.unsqueeze(-1), spec.layout).stride()[:3]
            args.update({f"{name}d_ptr": scales, f"{name}d_sb": sb, f"{name}d_ss": ss, f"{name}d_sh": sh})
    if cache is None:  # k goes to k_out, as q to q_out
        k_scale_mode = 0 if quant is None or dynamic else _scale_mode(quant.k_scale)
        if quant is not None and not dynamic and not k_scale_mode:
            k_div = 1.0 / quant.k_scale
        args.update(ko_ptr=k_out, ko_sh=rope["ko_sh"], vo_ptr=dummy, v_sb=0, v_ss=0, v_sh=0, vo_sh=0,
                    cb_ptr=dummy, slot_ptr=dummy, slot_sb=0, slot_ss=0, cache_rows=0, block_size=1, kc_sb=0,
                    kc_ss=0, vc_sb=0, vc_ss=0, ks_ptr=quant.k_scale if k_scale_mode else dummy, vs_ptr=dummy,
                    v_scale=1.0)
        constexprs.update(CACHE_MODE=CACHE_NONE.value, CACHE_BATCH_PER_TOKEN=False, K_SCALE_PTR=k_scale_mode,
                          V_SCALE_PTR=0, K_FP8=_fp8_kind(k_out.dtype), V_FP8=0, K_DYNAMIC=dynamic)
    else:  # k and v go to the caches' rows; each cache keeps its own strides
        k_target, v_target = cache.views()
        v_sb, v_ss, v_sh = to_canonical(v, spec.layout).stride()[:3]
        slots = cache.slots if not cache.page_table else cache.batch_indices  # the kernel reads either by slot_ptr
        if cache.slots is not None and slots.numel() < rope["num_tokens"]:  # the tokens past slot_mapping: padding
            args["n_slots"] = slots.numel()
            constexprs["SLOTS_SHORT"] = True
        # A scale held in a device tensor is read by the kernel (graph capture); a float is divided in here.
        k_ptr_scale, v_ptr_scale = _scale_mode(cache.k_scale), _scale_mode(cache.v_scale)
        k_div = 1.0 if k_ptr_scale else 1.0 / cache.k_scale
        args.update(
            ko_ptr=k_target, ko_sh=k_target.stride(2), vo_ptr=v_target, v_sb=v_sb, v_ss=v_ss, v_sh=v_sh,
            vo_sh=v_target.stride(2),
            cb_ptr=cache.cache_batch if cache.cache_batch is not None else dummy,
            slot_ptr=slots if slots is not None else dummy,
            slot_sb=slots.stride(0) if slots is not None else 0, slot_ss=slots.stride(1) if slots is not None else 0,
            cache_rows=cache.rows, block_size=cache.block_size, kc_sb=k_target.stride(0),
            kc_ss=k_target.stride(1), vc_sb=v_target.stride(0), vc_ss=v_target.stride(1),
            ks_ptr=cache.k_scale if k_ptr_scale else dummy, vs_ptr=cache.v_scale if v_ptr_scale else dummy,
            v_scale=1.0 if v_ptr_scale else 1.0 / cache.v_scale)
        if cache.page_table:  # pages of the table, not slots: cache_rows counts pages
            args.update(pages_ptr=cache.kv_indices, indptr_ptr=cache.kv_indptr, last_ptr=cache.kv_last_page_len,
                        n_requests=cache.kv_indptr.numel() - 1, n_page_ids=cache.kv_indices.numel(),
                        cache_rows=k_target.shape[0])
            constexprs["TABLE_BATCH"] = slots is not None
        (k_pack, kc_sa, kc_sx), (v_pack, vc_sa, vc_sx) = _columns(k_target), _columns(v_target)
        args.update(kc_sa=kc_sa, kc_sx=kc_sx, vc_sa=vc_sa, vc_sx=vc_sx)
        k_strides = ("kc_sb", "kc_ss", "ko_sh", "kc_sa")
        unit = k_pack if k_pack > 1 and kc_sx == 1 and all(args[n] % k_pack == 0 for n in k_strides) else 1
        for name in k_strides:  # in units of x: the kernel multiplies them back by the constexpr K_UNIT
            args[name] //= unit
        constexprs.update(K_PACK=k_pack, V_PACK=v_pack, K_UNIT=unit)
        mode = CACHE_TABLE if cache.page_table else CACHE_PAGED if cache.paged else CACHE_ROWS
        constexprs.update(CACHE_MODE=mode.value,
                          CACHE_BATCH_PER_TOKEN=cache.cache_batch is not None, K_SCALE_PTR=k_ptr_scale,
                          V_SCALE_PTR=v_ptr_scale, K_FP8=_fp8_kind(k_target.dtype),
                          V_FP8=_fp8_kind(v_target.dtype), K_DYNAMIC=False)
        grid = (grid[0] + heuristics.cdiv(rope["HK"], rope_constexprs["BLOCK_HK"]), grid[1], grid[2])  # v's blocks
    args["k_scale"] = rope["k_scale"] * k_div
    args["q_scale"] = rope["q_scale"] * q_div
    constexprs.update(NORM=q_weight is not None, ROUND_FP8=q.device.type != "cuda",
                      D_BLOCK=heuristics.next_pow2(rope_constexprs["HEAD_DIM"]), Q_FP8=_fp8_kind(q_out.dtype),
                      Q_SCALE_PTR=q_scale_mode, Q_DYNAMIC=dynamic,
                      PDL=_config.pdl_launches and HAS_GDC and runtime.pdl_supported(q.device))
    runtime.launch(PROLOGUE, grid, args, constexprs, num_warps, q.device)


def _sum_tree_scratch(device: torch.device, q_tree, k_tree, head_dim: int) -> tuple:
    """The two weights' sum trees' fp32 rows ([rows, head_dim] each) and their int32 arrival counters, all in the
    stream's workspace (:func:`ropekit.triton.runtime.workspace`): the kernel sets every counter it used back to
    zero, so no launch allocates or clears them."""
    n_counters = q_tree.counters + k_tree.counters
    q_at = -(-4 * n_counters // 16) * 16  # each part 16-byte aligned
    k_at = q_at + 4 * q_tree.rows * head_dim
    end = k_at + 4 * k_tree.rows * head_dim
    buffer = runtime.workspace(device, end)
    counters = buffer[:4 * n_counters].view(torch.int32)
    dwq = buffer[q_at:k_at].view(torch.float32).view(q_tree.rows, head_dim)
    dwk = buffer[k_at:end].view(torch.float32).view(k_tree.rows, head_dim)
    return dwq, dwk, counters


def launch_norm_rope_bwd(grad_q, q, grad_k, k, spec: RopeSpec, q_weight, k_weight, weight_offset: float,
                         eps: float, config=None) -> tuple:
    """(dq, dk, dq_weight, dk_weight) of ``qk_norm_rope`` for the output gradients ``grad_q``/``grad_k`` (last
    dim contiguous); dq/dk in q's/k's dtype, the weight gradients in the weights' dtypes, all from one launch."""
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()  # the kernel indexes the weights densely
    if config is None and q.is_cuda:  # the interpreter takes the launcher's own (large) programs
        dims = _grid_dims(q, k, spec)
        config = heuristics.norm_block_config(*dims, heuristics.num_programs_wanted(q.device), "backward",
                                              partial=spec.rotary_dim != dims[3])
    # rope_kernel's launch for the gradients into dq/dk: its q and k are the gradients, its outputs dq and dk.
    launch = _rope_launch(grad_q, grad_k, dq, dk, spec, config)
    if launch is None:
        return (dq.zero_(), dk.zero_(), torch.zeros_like(q_weight, memory_format=torch.contiguous_format),
                torch.zeros_like(k_weight, memory_format=torch.contiguous_format))
    _, rope, rope_constexprs, num_warps = launch
    n_tb = heuristics.cdiv(rope["num_tokens"], rope_constexprs["BLOCK_T"])
    n_qb = heuristics.cdiv(rope["HQ"], rope_constexprs["BLOCK_HQ"])
    n_kb = heuristics.cdiv(rope["HK"], rope_constexprs["BLOCK_HK"])
    groups = heuristics.bwd_program_groups(n_tb, n_qb + n_kb, q.device)
    grid = (n_qb + n_kb, groups, 1)
    D = rope_constexprs["HEAD_DIM"]
    # A side without heads has no programs: no rows, no tree, and a gradient of zeros.
    fan_in = heuristics.WEIGHT_SUM_FAN_IN
    q_tree, k_tree = (heuristics.sum_tree(groups * n, fan_in) if n else heuristics.SumTree(0, 0, 0)
                      for n in (n_qb, n_kb))
    # per weight: the partial rows and the tree's upper levels (fp32), its gradient; one run of counters
    dwq, dwk, counters = _sum_tree_scratch(q.device, q_tree, k_tree, D)
    dwqo = (torch.empty if n_qb else torch.zeros)(D, dtype=q_weight.dtype, device=q.device)
    dwko = (torch.empty if n_kb else torch.zeros)(D, dtype=k_weight.dtype, device=q.device)
    qc, kc = to_canonical(q, spec.layout), to_canonical(k, spec.layout)
    # The kernel's gradients (g*), inputs and outputs (d*): rope_kernel's launch had the gradients as its q and k,
    # and dq and dk as its outputs.
    args = {name: rope[name] for name in _ROPE_ARGS}
    for x, xc in (("q", qc), ("k", kc)):
        args[f"g{x}_ptr"], args[f"{x}_ptr"], args[f"d{x}_ptr"] = rope[f"{x}_ptr"], xc, rope[f"{x}o_ptr"]
        for d, stride in zip(("sb", "ss", "sh"), xc.stride()[:3]):
            args[f"g{x}_{d}"], args[f"{x}_{d}"], args[f"d{x}_{d}"] = rope[f"{x}_{d}"], stride, rope[f"{x}o_{d}"]
    args.update(dwq_ptr=dwq, dwk_ptr=dwk, cnt_ptr=counters, dwqo_ptr=dwqo, dwko_ptr=dwko, qw_ptr=q_weight,
                kw_ptr=k_weight, w_offset=float(weight_offset), eps=float(eps), n_token_blocks=n_tb,
                k_counters=q_tree.counters)
    constexprs = _shared_constexprs(NORM_ROPE_BWD, rope_constexprs)
    constexprs.update(D_BLOCK=heuristics.next_pow2(D), FAN_IN=fan_in,
                      Q_SUM_LEVELS=max(q_tree.levels, heuristics.WEIGHT_SUM_LEVELS),
                      K_SUM_LEVELS=max(k_tree.levels, heuristics.WEIGHT_SUM_LEVELS), STAGES=heuristics.BWD_STAGES)
    runtime.launch(NORM_ROPE_BWD, grid, args, constexprs, num_warps, q.device)
    return dq, dk, dwqo, dwko
