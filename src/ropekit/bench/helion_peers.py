"""Helion peers: our own RoPE and fused per-head RMSNorm + RoPE kernels written in Helion (PyTorch's kernel DSL,
which generates Triton), so the benchmark can report ropekit against what a Helion author would write.

Imported only when a ``helion`` implementation is asked for; helion is never a dependency of ropekit. Each kernel
runs with one fixed :class:`helion.Config` (no autotuning at benchmark time). Both take q and k as
``[T, H, 2, D/2]`` views of contiguous ``[..., H, D]`` tensors (the two NeoX halves of each head on their own
axis, so no slicing inside the kernel) and per-token float32 cos/sin ``[T, D/2]``; the math is float32 and the
outputs are new tensors in the input dtype.
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch
from torch import Tensor

# One hand-picked config for every shape (block_sizes: tokens a program takes in the q loop, then the k loop): at
# Llama-3/Qwen3-8B's heads (Hq=32, Hk=8, D=128) a tile is 8192 elements of q (2 tokens) or of k (8 tokens), 64
# float32 values a thread with 4 warps. Not autotuned: autotuning takes minutes a shape.
ROPE_CONFIG = helion.Config(block_sizes=[2, 8], num_warps=4)
NORM_ROPE_CONFIG = helion.Config(block_sizes=[2, 8], num_warps=4)


@helion.kernel(config=ROPE_CONFIG, static_shapes=True)
def _rope_neox_kernel(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    q_out = torch.empty_like(q)
    k_out = torch.empty_like(k)
    for tile in hl.tile(q.size(0)):
        c = cos[tile, :].unsqueeze(1)
        s = sin[tile, :].unsqueeze(1)
        x1 = q[tile, :, 0, :].to(torch.float32)
        x2 = q[tile, :, 1, :].to(torch.float32)
        q_out[tile, :, 0, :] = (x1 * c - x2 * s).to(q.dtype)
        q_out[tile, :, 1, :] = (x2 * c + x1 * s).to(q.dtype)
    for tile in hl.tile(k.size(0)):
        c = cos[tile, :].unsqueeze(1)
        s = sin[tile, :].unsqueeze(1)
        x1 = k[tile, :, 0, :].to(torch.float32)
        x2 = k[tile, :, 1, :].to(torch.float32)
        k_out[tile, :, 0, :] = (x1 * c - x2 * s).to(k.dtype)
        k_out[tile, :, 1, :] = (x2 * c + x1 * s).to(k.dtype)
    return q_out, k_out


@helion.kernel(config=NORM_ROPE_CONFIG, static_shapes=True)
def _norm_rope_neox_kernel(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
                           eps: float) -> tuple[Tensor, Tensor]:
    q_out = torch.empty_like(q)
    k_out = torch.empty_like(k)
    inv_d = 0.5 / q.size(3)  # 1 / D: the halves hold D/2 columns each
    for tile in hl.tile(q.size(0)):
        c = cos[tile, :].unsqueeze(1)
        s = sin[tile, :].unsqueeze(1)
        x1 = q[tile, :, 0, :].to(torch.float32)
        x2 = q[tile, :, 1, :].to(torch.float32)
        r = torch.rsqrt((torch.sum(x1 * x1, -1) + torch.sum(x2 * x2, -1)) * inv_d + eps).unsqueeze(-1)
        n1 = x1 * r * q_weight[0, :].to(torch.float32)
        n2 = x2 * r * q_weight[1, :].to(torch.float32)
        q_out[tile, :, 0, :] = (n1 * c - n2 * s).to(q.dtype)
        q_out[tile, :, 1, :] = (n2 * c + n1 * s).to(q.dtype)
    for tile in hl.tile(k.size(0)):
        c = cos[tile, :].unsqueeze(1)
        s = sin[tile, :].unsqueeze(1)
        x1 = k[tile, :, 0, :].to(torch.float32)
        x2 = k[tile, :, 1, :].to(torch.float32)
        r = torch.rsqrt((torch.sum(x1 * x1, -1) + torch.sum(x2 * x2, -1)) * inv_d + eps).unsqueeze(-1)
        n1 = x1 * r * k_weight[0, :].to(torch.float32)
        n2 = x2 * r * k_weight[1, :].to(torch.float32)
        k_out[tile, :, 0, :] = (n1 * c - n2 * s).to(k.dtype)
        k_out[tile, :, 1, :] = (n2 * c + n1 * s).to(k.dtype)
    return q_out, k_out


def _halves(x: Tensor) -> Tensor:
    """``x`` [..., H, D] contiguous as a [T, H, 2, D/2] view."""
    if not x.is_contiguous():
        raise ValueError("the Helion peers take contiguous q and k")
    if x.shape[-1] % 2:
        raise ValueError(f"head_dim must be even, got {x.shape[-1]}")
    return x.view(-1, x.shape[-2], 2, x.shape[-1] // 2)


def helion_apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """NeoX RoPE of q [B, S, Hq, D] and k [B, S, Hk, D] (bf16/fp16/fp32, contiguous bshd) with per-token float32
    tables cos/sin [B * S, D/2]; float32 math, new outputs shaped and typed as q and k."""
    qo, ko = _rope_neox_kernel(_halves(q), _halves(k), cos, sin)
    return qo.view(q.shape), ko.view(k.shape)


def helion_qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
                        eps: float) -> tuple[Tensor, Tensor]:
    """Per-head RMSNorm (``x / sqrt(mean(x**2) + eps) * weight`` over D) then NeoX RoPE, of q [B, S, Hq, D] and
    k [B, S, Hk, D] (contiguous bshd), weights [D], per-token float32 cos/sin [B * S, D/2]: what
    ``ropekit.qk_norm_rope`` computes forward. Float32 math, new outputs shaped and typed as q and k."""
    half = q.shape[-1] // 2
    qo, ko = _norm_rope_neox_kernel(_halves(q), _halves(k), q_weight.view(2, half), k_weight.view(2, half), cos, sin,
                                    eps)
    return qo.view(q.shape), ko.view(k.shape)
