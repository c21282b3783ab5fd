"""Launchers of the RoPE-attention kernels (:mod:`ropekit.triton.attention_kernels`): :func:`launch_forward`
(o and lse) and :func:`launch_backward` (dq, dk, dv). Arguments and constexprs by parameter name, through
:func:`ropekit.triton.runtime.launch`; they write into the tensors they are given and allocate only the backward's
``delta`` rows.

Every tensor is canonical ``[B, S, H, D]`` (any strides, contiguous last dim); ``angles`` is ``[B or 1, S, D]``
float32 with the cosine and sine of each rotated pair at the pair's columns (see the kernels' module). Packed
sequences come as ``[1, T, H, D]`` with ``cu_seqlens`` (int32 [num_seqs + 1], on the device) and the longest
sequence's length ``max_seqlen``, which sizes the grid.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ropekit.triton import heuristics, runtime
from ropekit.triton.attention_kernels import (
    rope_attention_bwd_delta_kernel,
    rope_attention_bwd_dkdv_kernel,
    rope_attention_bwd_dq_kernel,
    rope_attention_fwd_kernel,
    rope_attention_rotate_kernel,
)

_FLOATS = ("q_scale", "k_scale", "qk_mult")
FORWARD = runtime.KernelRoles(rope_attention_fwd_kernel, _FLOATS, ())
DELTA = runtime.KernelRoles(rope_attention_bwd_delta_kernel, (), ())
DKDV = runtime.KernelRoles(rope_attention_bwd_dkdv_kernel, _FLOATS, ())
DQ = runtime.KernelRoles(rope_attention_bwd_dq_kernel, _FLOATS, ())
ROTATE_ROWS = runtime.KernelRoles(rope_attention_rotate_kernel, ("scale",), ())


class Rotation(NamedTuple):
    """Which columns of q and k are rotated and how: ``rotary_dim`` columns from ``rotary_start`` (the rest pass
    through, one contiguous run), paired neox-style (i, i + R/2) or interleaved (2i, 2i + 1)."""

    rotary_start: int
    rotary_dim: int
    neox: bool


class Blocks(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def forward_blocks(device: torch.device, head_dim: int, v_dim: int) -> Blocks:
    """The forward's block shape (tile rows of q and of k, warps, pipeline stages)."""
    if device.type != "cuda":  # the interpreter: few, small programs
        return Blocks(16, 16, 4, 1)
    if max(head_dim, v_dim) <= 64:
        return Blocks(128, 64, 4, 3)
    if max(head_dim, v_dim) <= 128:  # H200 sweep at 4 x 4096, 32/8 heads (docs/perf-notes.md, "RoPE attention")
        return Blocks(128, 128, 8, 3)
    if max(head_dim, v_dim) <= 192:  # MLA's 192/128: the same sweep
        return Blocks(128, 64, 8, 3)
    return Blocks(64, 32, 4, 2)


class BackwardBlocks(NamedTuple):
    """The backward kernels' block shapes, each its own: the dk/dv kernel keeps BLOCK_N key rows and streams
    BLOCK_M query rows, the dq kernel keeps BLOCK_M query rows and streams BLOCK_N key rows."""

    dkdv: Blocks
    dq: Blocks


def backward_blocks(device: torch.device, head_dim: int, v_dim: int) -> BackwardBlocks:
    """Each backward kernel's block shape: swept per kernel (profiler time of each), since the best shapes differ
    -- the dk/dv kernel gains from more resident key rows than streamed query rows, the dq kernel does not."""
    width = max(head_dim, v_dim)
    if device.type != "cuda":
        dkdv = dq = Blocks(16, 16, 4, 1)
    elif width <= 64:
        dkdv, dq = Blocks(64, 128, 4, 2), Blocks(64, 64, 4, 3)
    elif width <= 128:
        dkdv, dq = Blocks(64, 128, 8, 2), Blocks(64, 64, 4, 2)
    elif width <= 192:
        dkdv, dq = Blocks(32, 64, 4, 2), Blocks(128, 64, 8, 2)
    else:
        dkdv = dq = Blocks(32, 32, 4, 1)
    return BackwardBlocks(dkdv, dq)


def _rotation_constexprs(rot: Rotation, head_dim: int) -> dict:
    """Which columns every kernel rotates and passes through, and their (power-of-2) block widths."""
    pass_len = head_dim - rot.rotary_dim
    if pass_len and rot.rotary_start not in (0, pass_len):
        raise ValueError("the rotated columns must be the first or the last rotary_dim of the head")
    return {
        "ROT_START": rot.rotary_start, "ROT_HALF": rot.rotary_dim // 2, "NEOX": rot.neox,
        "PASS_START": rot.rotary_dim if rot.rotary_start == 0 else 0, "PASS_LEN": pass_len,
        # tl.dot takes no dimension below 16
        "HALF_BLOCK": max(16, heuristics.next_pow2(rot.rotary_dim // 2)),
        "PASS_BLOCK": max(16, heuristics.next_pow2(max(pass_len, 1))),
    }


def _layout_constexprs(rot: Rotation, head_dim: int, v_dim: int, causal: bool, dtype: torch.dtype,
                       blocks: Blocks, device: torch.device, rotate: bool = True) -> dict:
    dot_f32 = device.type != "cuda" and dtype == torch.bfloat16  # the interpreter's bf16 products are wrong
    return {
        **_rotation_constexprs(rot, head_dim), "DV": v_dim, "CAUSAL": causal, "BLOCK_M": blocks.block_m,
        "BLOCK_N": blocks.block_n, "DV_BLOCK": max(16, heuristics.next_pow2(v_dim)),
        # float32 operands: full-precision products (the default would round them to tf32)
        "PRECISION": "ieee" if dtype == torch.float32 or dot_f32 else "tf32",
        "DOT_F32": dot_f32, "ROTATE": rotate,
    }


def rotated_copy(x: torch.Tensor, angles: torch.Tensor, rot: Rotation, scale: float, rotate: bool = True
                 ) -> torch.Tensor:
    """``scale * R(theta) x`` in x's dtype, a new contiguous [B, S, H, D] tensor: the operand that the attention
    loop re-reads (k for the forward and dq kernels, q for the dk/dv kernel), rotated once per call instead of once
    per program that loads it -- GROUP * S / BLOCK_M times for k in the forward. It is transient (freed when the
    launch returns) and never saved for the backward."""
    B, S, H, D = x.shape
    out = torch.empty((B, S, H, D), dtype=x.dtype, device=x.device)
    if B * S * H == 0:
        return out
    block_t = 16 if x.device.type != "cuda" else 32
    args = {"x_ptr": x, "tab_ptr": angles, "out_ptr": out, **_strides(x, "x"),
            "t_sb": angles.stride(0) if angles.shape[0] > 1 else 0, "t_ss": angles.stride(1), **_strides(out, "o"),
            "S": S, "num_tokens": B * S, "scale": scale}
    constexprs = {**_rotation_constexprs(rot, D), "BLOCK_T": block_t, "ROTATE": rotate}
    runtime.launch(ROTATE_ROWS, (heuristics.cdiv(B * S, block_t), H, 1), args, constexprs, 4, x.device)
    return out


def _strides(x: torch.Tensor, prefix: str) -> dict:
    sb, ss, sh = x.stride()[:3]
    return {f"{prefix}_sb": sb, f"{prefix}_ss": ss, f"{prefix}_sh": sh}


def _scalars(q, k, angles, q_scale: float, k_scale: float, qk_mult: float) -> dict:
    return {"S": q.shape[1], "HQ": q.shape[2], "GROUP": q.shape[2] // k.shape[2], "q_scale": q_scale,
            "k_scale": k_scale, "qk_mult": qk_mult,
            "t_sb": angles.stride(0) if angles.shape[0] > 1 else 0, "t_ss": angles.stride(1)}


def _sequences(q, cu_seqlens, max_seqlen: int) -> tuple[int, int, dict]:
    """(number of sequences, their longest length, the kernels' sequence arguments): the batch's, or the packed
    sequences of ``cu_seqlens``."""
    if cu_seqlens is None:
        return q.shape[0], q.shape[1], {"cu_ptr": q}  # cu_ptr is never read
    return cu_seqlens.shape[0] - 1, max_seqlen, {"cu_ptr": cu_seqlens}


def launch_forward(q, k, v, angles, o, lse, rot: Rotation, q_scale: float, k_scale: float, qk_mult: float,
                   causal: bool, blocks: Blocks | None = None, rotate: bool = True, prerotate: bool = True,
                   cu_seqlens: torch.Tensor | None = None, max_seqlen: int = 0) -> None:
    """Write the attention output ``o`` [B, S, HQ, DV] and the natural-log ``lse`` [B, HQ, S] (float32).
    ``prerotate``: k is rotated once into a transient copy (:func:`rotated_copy`) rather than by every program
    that loads a tile of it. ``blocks`` overrides the block shape and ``rotate=False`` skips the rotation (tuning
    and benchmarks only)."""
    _, S, HQ, D = q.shape
    B, longest, sequences = _sequences(q, cu_seqlens, max_seqlen)
    if B * longest * HQ == 0:
        return
    blocks = blocks or forward_blocks(q.device, D, v.shape[3])
    if blocks.block_m % blocks.block_n:
        raise ValueError(f"the forward's BLOCK_M must be a multiple of BLOCK_N, got {blocks}")
    if prerotate:
        k, k_scale = rotated_copy(k, angles, rot, k_scale, rotate), 1.0
    args = {"q_ptr": q, "k_ptr": k, "v_ptr": v, "tab_ptr": angles, "o_ptr": o, "lse_ptr": lse, **sequences,
            **_strides(q, "q"), **_strides(k, "k"), **_strides(v, "v"), **_strides(o, "o"),
            **_scalars(q, k, angles, q_scale, k_scale, qk_mult)}
    constexprs = {**_layout_constexprs(rot, D, v.shape[3], causal, q.dtype, blocks, q.device, rotate),
                  "K_ROTATED": prerotate, "VARLEN": cu_seqlens is not None}
    grid = (B * HQ, heuristics.cdiv(longest, blocks.block_m), 1)
    runtime.launch(FORWARD, grid, args, constexprs, blocks.num_warps, q.device, num_stages=blocks.num_stages)


def launch_backward(do, dlse, q, k, v, angles, o, lse, dq, dk, dv, rot: Rotation, q_scale: float, k_scale: float,
                    qk_mult: float, causal: bool, blocks: BackwardBlocks | Blocks | None = None, rotate: bool = True,
                    prerotate: bool = True, cu_seqlens: torch.Tensor | None = None, max_seqlen: int = 0) -> None:
    """Write dq, dk, dv (each like its input) from the gradients of o (``do``) and of lse (``dlse``, contiguous
    [B, HQ, S], or None) and the forward's ``o`` and ``lse``. ``prerotate``: the dk/dv kernel reads q, and the dq
    kernel k, from transient rotated copies (:func:`rotated_copy`)."""
    B, S, HQ, D = q.shape
    HK, DV = k.shape[2], v.shape[3]
    if B * S == 0:
        return
    num_seqs, longest, sequences = _sequences(q, cu_seqlens, max_seqlen)
    if HQ == 0:
        dk.zero_()
        dv.zero_()
        return
    blocks = blocks or backward_blocks(q.device, D, DV)
    if isinstance(blocks, Blocks):  # one shape for both kernels
        blocks = BackwardBlocks(blocks, blocks)
    dv_block = max(16, heuristics.next_pow2(DV))
    delta = torch.empty((B, HQ, S), dtype=torch.float32, device=q.device)
    delta_rows = 64
    runtime.launch(DELTA, (B * HQ, heuristics.cdiv(S, delta_rows), 1),
                   {"o_ptr": o, "do_ptr": do, "dlse_ptr": dlse if dlse is not None else delta, "delta_ptr": delta,
                    **_strides(o, "o"), **_strides(do, "do"), "S": S, "HQ": HQ},
                   {"DV": DV, "HAS_DLSE": dlse is not None, "BLOCK_M": delta_rows, "DV_BLOCK": dv_block}, 4,
                   q.device)
    constexprs = {"VARLEN": cu_seqlens is not None}
    common = {"v_ptr": v, "tab_ptr": angles, "do_ptr": do, "lse_ptr": lse, "delta_ptr": delta, **sequences,
              **_strides(v, "v"), **_strides(do, "do"), **_scalars(q, k, angles, q_scale, k_scale, qk_mult)}
    # each kernel keeps its own operand resident (rotated once per program) and may read the other from a copy
    q_in, q_scale_in = (rotated_copy(q, angles, rot, q_scale, rotate), 1.0) if prerotate else (q, q_scale)
    runtime.launch(DKDV, (num_seqs * HK, heuristics.cdiv(longest, blocks.dkdv.block_n), 1),
                   {**common, "q_ptr": q_in, "k_ptr": k, **_strides(q_in, "q"), **_strides(k, "k"),
                    "q_scale": q_scale_in, "dk_ptr": dk, "dv_ptr": dv, **_strides(dk, "dk"), **_strides(dv, "dv"),
                    "HK": HK},
                   {**constexprs, **_layout_constexprs(rot, D, DV, causal, q.dtype, blocks.dkdv, q.device, rotate),
                    "Q_ROTATED": prerotate}, blocks.dkdv.num_warps, q.device, num_stages=blocks.dkdv.num_stages)
    del q_in
    k_in, k_scale_in = (rotated_copy(k, angles, rot, k_scale, rotate), 1.0) if prerotate else (k, k_scale)
    runtime.launch(DQ, (num_seqs * HQ, heuristics.cdiv(longest, blocks.dq.block_m), 1),
                   {**common, "q_ptr": q, "k_ptr": k_in, **_strides(q, "q"), **_strides(k_in, "k"),
                    "k_scale": k_scale_in, "dq_ptr": dq, **_strides(dq, "dq")},
                   {**constexprs, **_layout_constexprs(rot, D, DV, causal, q.dtype, blocks.dq, q.device, rotate),
                    "K_ROTATED": prerotate}, blocks.dq.num_warps, q.device, num_stages=blocks.dq.num_stages)
