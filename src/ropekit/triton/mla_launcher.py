"""Launcher of the MLA prologue kernel (:func:`ropekit.triton.mla_kernels.mla_kernel`).

It starts from ``rope_kernel``'s launch for q alone (:func:`ropekit.triton.launcher.rope_arguments`: positions,
frequencies, block shape and grid), whose position and frequency arguments the MLA kernel shares by name, adds one
block of grid axis 0 for the shared key and the latent, and launches through :func:`ropekit.triton.runtime.launch`.
It allocates nothing.
"""

from __future__ import annotations

import torch

from ropekit._spec import RopeSpec, to_canonical
from ropekit.triton import heuristics, launcher, runtime
from ropekit.triton.mla_kernels import CACHE_NONE, CACHE_PAGED, CACHE_ROWS, mla_kernel
from ropekit.triton.prologue_kernels import FP8_E4M3, FP8_E5M2

MLA = runtime.KernelRoles(mla_kernel, ("q_scale", "k_scale", "rotary_scale", "cache_scale", "q_out_mult",
                                       "k_out_mult"), ("pos_offset",))

# rope_kernel's arguments (runtime, then constexprs) that the MLA kernel takes as they are
_FP8_KINDS = {torch.float8_e4m3fn: FP8_E4M3.value, torch.float8_e5m2: FP8_E5M2.value}  # CACHE_FP8 of a cache dtype
_SHARED_ARGS = ("S", "num_tokens", "pos_ptr", "pos_sb", "pos_ss", "seq_off_ptr", "pos_offset", "cu_ptr", "n_seqs",
                "n_search_steps", "freq_ptr", "cos_ptr", "sin_ptr", "t_sb", "t_sr", "t_sc", "table_rows", "q_scale",
                "k_scale", "rotary_scale", "pos_sa")
_SHARED_CONSTEXPRS = ("ROT_DIM", "NEOX", "POS_MODE", "HAS_SEQ_OFFSETS", "FREQ_MODE", "TABLE_BY_TOKEN", "TABLE_FULL",
                      "FAST_TRIG", "NUM_AXES", "AXES_INTERLEAVED", "AXIS_BOUND_1", "AXIS_BOUND_2", "AXIS_BOUND_3",
                      "BLOCK_T", "HALF_BLOCK", "PASS_BLOCK")


def _rows(x: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """(batch, sequence, head) strides of ``x``'s canonical [B, S, H, D] view."""
    return to_canonical(x, layout).stride()[:3]


def launch_mla(q, k_pe, q_nope_out, q_pe_out, k_out, spec: RopeSpec, *, kv_c=None, ckv_cache=None,
               kpe_cache=None, slots=None, paged: bool = True, cache_scale=1.0, out_scales=(1.0, 1.0)) -> None:
    """Rotate the last ``spec.rotary_dim`` columns of q into ``q_pe_out`` (at their own columns when it is
    ``q_nope_out``, else from column 0) and copy the others into ``q_nope_out``; rotate ``k_pe`` (one head) into
    ``k_out`` (its heads: one, or q's where broadcast); with ``ckv_cache``, write each token's ``kv_c`` and rotated
    ``k_pe`` into its cache row. q, k_pe and the outputs in ``spec.layout``; ``kv_c`` [B, S, L] or [T, L] (``thd``);
    the caches [num_blocks, block_size, W] (``paged``: token (b, s) at slot ``slots[b, s]``) or [B, max_seq, W]
    (at row [b, its position]), ``kpe_cache`` None for one cache (the key after the latent columns);
    ``cache_scale`` a float or a 0-d float32 tensor (float8 caches). float8 outputs (their dtype says) hold the
    values divided by ``out_scales`` (q's, k's): floats, or 0-d float32 tensors both."""
    launch = launcher.rope_arguments(q, None, q_pe_out, None, spec)
    if launch is None:
        return
    grid, rope, rope_constexprs, num_warps = launch
    dummy = q  # stands for absent tensors (never read)
    q_sb, q_ss, q_sh = _rows(q, spec.layout)
    qn_sb, qn_ss, qn_sh = _rows(q_nope_out, spec.layout)
    qpe_sb, qpe_ss, qpe_sh = _rows(q_pe_out, spec.layout)
    k_sb, k_ss, _ = _rows(k_pe, spec.layout)
    ko_sb, ko_ss, ko_sh = _rows(k_out, spec.layout)
    args = {name: rope[name] for name in _SHARED_ARGS}
    args.update(q_ptr=to_canonical(q, spec.layout), qn_ptr=q_nope_out, qpe_ptr=q_pe_out, kpe_ptr=k_pe, ko_ptr=k_out,
                q_sb=q_sb, q_ss=q_ss, q_sh=q_sh, qn_sb=qn_sb, qn_ss=qn_ss, qn_sh=qn_sh, qpe_sb=qpe_sb,
                qpe_ss=qpe_ss, qpe_sh=qpe_sh, k_sb=k_sb, k_ss=k_ss, ko_sb=ko_sb, ko_ss=ko_ss, ko_sh=ko_sh,
                HQ=rope["HQ"], KH=to_canonical(k_out, spec.layout).shape[2])
    constexprs = {name: rope_constexprs[name] for name in _SHARED_CONSTEXPRS}
    D = q.shape[-1]
    q_scale_out, k_scale_out = out_scales
    out_ptrs = isinstance(q_scale_out, torch.Tensor)
    args.update(qs_ptr=q_scale_out if out_ptrs else dummy, ks_ptr=k_scale_out if out_ptrs else dummy,
                q_out_mult=1.0 if out_ptrs else 1.0 / float(q_scale_out),
                k_out_mult=1.0 if out_ptrs else 1.0 / float(k_scale_out))
    constexprs.update(OUT_FP8=_FP8_KINDS.get(q_pe_out.dtype, 0), OUT_SCALE_PTR=out_ptrs)
    constexprs.update(Q_DIM=D, QPE_START=D - spec.rotary_dim if q_pe_out is q_nope_out else 0,
                      BLOCK_H=rope_constexprs["BLOCK_HQ"], ROUND_FP8=q.device.type != "cuda")
    if ckv_cache is None:
        args.update(kvc_ptr=dummy, kvc_sb=0, kvc_ss=0, ckv_ptr=dummy, kpc_ptr=dummy, slot_ptr=dummy, slot_sb=0,
                    slot_ss=0, cache_rows=0, block_size=1, ckv_sb=0, ckv_ss=0, kpc_sb=0, kpc_ss=0, cs_ptr=dummy,
                    cache_scale=1.0)
        constexprs.update(LATENT_DIM=1, LATENT_BLOCK=1, KPE_COL=0, CACHE_MODE=CACHE_NONE.value, SCALE_PTR=False,
                          CACHE_FP8=0)
    else:
        one_cache = kpe_cache is None
        kpc = ckv_cache if one_cache else kpe_cache
        latent = kv_c.shape[-1]
        block_size = ckv_cache.shape[1] if paged else 1
        cache_rows = ckv_cache.shape[0] * ckv_cache.shape[1] if paged else ckv_cache.shape[1]
        scale_ptr = isinstance(cache_scale, torch.Tensor)
        kvc_sb, kvc_ss = (kv_c.stride(0), kv_c.stride(1)) if kv_c.dim() == 3 else (0, kv_c.stride(0))
        args.update(kvc_ptr=kv_c, kvc_sb=kvc_sb, kvc_ss=kvc_ss, ckv_ptr=ckv_cache, kpc_ptr=kpc,
                    slot_ptr=slots if slots is not None else dummy,
                    slot_sb=slots.stride(0) if slots is not None else 0,
                    slot_ss=slots.stride(1) if slots is not None else 0,
                    cache_rows=cache_rows, block_size=block_size, ckv_sb=ckv_cache.stride(0),
                    ckv_ss=ckv_cache.stride(1), kpc_sb=kpc.stride(0), kpc_ss=kpc.stride(1),
                    cs_ptr=cache_scale if scale_ptr else dummy,
                    cache_scale=1.0 if scale_ptr else 1.0 / float(cache_scale))
        constexprs.update(LATENT_DIM=latent, LATENT_BLOCK=heuristics.next_pow2(latent),
                          KPE_COL=latent if one_cache else 0,
                          CACHE_MODE=(CACHE_PAGED if paged else CACHE_ROWS).value, SCALE_PTR=scale_ptr,
                          CACHE_FP8=_FP8_KINDS.get(ckv_cache.dtype, 0))
    grid = (grid[0] + 1, grid[1], grid[2])  # the key and latent block of each token block
    runtime.launch(MLA, grid, args, constexprs, num_warps, q.device)
