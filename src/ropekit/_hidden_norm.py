"""The whole-hidden QK-norm of diffusion transformers (WAN 2.x, FLUX.2): ``qk_norm_rope(..., norm_over="hidden")``.

Each token's q (and k) is RMS-normalised over all its heads at once (weight [H * D]) before the per-head rotation,
and an optional v is copied into a new contiguous tensor in q's dtype beside them. This module checks those
arguments, and holds the torch path of the norm (fp32 math, float64 for float64 inputs: the route without Triton
kernels, whose sum of squares is one fixed tree of adjacent pairs, so a token's bits do not depend on its batch)
and its backward, written from the definition. The kernel is :mod:`ropekit.triton.hidden_norm_kernels`.
"""

from __future__ import annotations

import torch
from torch import Tensor

NORM_OVER = ("head", "hidden")


def head_axis(layout: str) -> int:
    """The heads' axis of q/k in ``layout`` ("bhsd": -3; "bshd", "thd": -2)."""
    return -3 if layout == "bhsd" else -2


def check_hidden_norm(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, v: Tensor | None, layout: str,
                      norm_over: str, out_dtype, q_out_scale, k_out_scale) -> None:
    """Raise ``ValueError``/``TypeError`` naming the argument for a bad whole-hidden norm call or a bad ``v``."""
    if norm_over not in NORM_OVER:
        raise ValueError(f"norm_over must be 'head' or 'hidden', got {norm_over!r}")
    if v is not None:
        if not isinstance(v, Tensor):
            raise TypeError(f"v must be a Tensor or None, got {type(v).__name__}")
        if not isinstance(k, Tensor) or v.shape != k.shape:
            raise ValueError(f"v must have k's shape {tuple(getattr(k, 'shape', ()))}, got {tuple(v.shape)}")
        if v.device != q.device:
            raise ValueError(f"v must be on q's device {q.device}, got {v.device}")
        if not v.dtype.is_floating_point:
            raise TypeError(f"v must be a floating tensor, got {v.dtype}")
        if out_dtype is not None:
            raise ValueError("v is copied in q's dtype: out_dtype (float8 outputs) cannot be combined with v")
    if norm_over != "hidden":
        return
    if out_dtype is not None or q_out_scale is not None or k_out_scale is not None:
        raise ValueError("norm_over='hidden' supports q's and k's own dtypes only: leave out_dtype, q_out_scale "
                         "and k_out_scale unset")
    for name, x, w in (("q_weight", q, q_weight), ("k_weight", k, k_weight)):
        if not isinstance(x, Tensor) or x.dim() < 3:
            raise ValueError(f"norm_over='hidden' needs q and k of 3 or 4 dims, got {name[0]} of "
                             f"{getattr(x, 'dim', lambda: 0)()} dims")
        if not isinstance(w, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(w).__name__}")
        n_heads, head_dim = x.shape[head_axis(layout)], x.shape[-1]
        if w.shape != (n_heads * head_dim,):
            raise ValueError(f"{name} must have shape [{n_heads * head_dim}] (heads {n_heads} x head_dim "
                             f"{head_dim}) with norm_over='hidden', got {list(w.shape)}")
        if not w.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got {w.dtype}")
        if w.device != x.device:
            raise ValueError(f"{name} must be on {name[0]}'s device {x.device}, got {w.device}")


def _tree_sum(x: Tensor) -> Tensor:
    """Sum over the last axis as a fixed tree of adjacent pairs (zero-padded to a power of two)."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x


def _rows(x: Tensor, layout: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """x in ``dtype`` as [..., H, D] (heads moved next to the last axis) and as [..., H * D]."""
    rows = x.to(dtype).movedim(head_axis(layout), -2)
    return rows, rows.reshape(*rows.shape[:-2], rows.shape[-2] * rows.shape[-1])


def hidden_rms_norm(x: Tensor, weight: Tensor, eps: float, weight_offset: float, layout: str,
                    dtype: torch.dtype | None = None) -> Tensor:
    """``x / sqrt(mean(x**2 over the token's H * D values) + eps) * (weight + weight_offset)`` in ``dtype``
    (default fp32, float64 for float64 ``x``), returned in that dtype and x's shape; differentiable."""
    dtype = dtype or (torch.float64 if x.dtype == torch.float64 else torch.float32)
    rows, flat = _rows(x, layout, dtype)
    ms = _tree_sum(flat * flat) / flat.shape[-1]
    inv = torch.rsqrt(ms + eps)[..., None]  # [..., 1, 1]
    w = (weight.to(dtype) + weight_offset).reshape(rows.shape[-2], rows.shape[-1])
    return (rows * inv * w).movedim(-2, head_axis(layout))


def hidden_rms_norm_backward(x: Tensor, weight: Tensor, weight_offset: float, eps: float, grad: Tensor,
                             layout: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(dx, dweight) of :func:`hidden_rms_norm` for the output gradient ``grad``, in ``dtype``, from the
    definition: with ``r = rsqrt(mean(x**2) + eps)`` over the N = H * D values of a token and ``gw = grad *
    (weight + weight_offset)``, ``dx = r * gw - x * r**3 * mean(gw * x)`` and ``dweight = sum over tokens of grad
    * x * r``. Differentiable (torch ops only)."""
    rows, flat_x = _rows(x, layout, dtype)
    _, flat_g = _rows(grad, layout, dtype)
    r = torch.rsqrt(flat_x.pow(2).mean(-1, keepdim=True) + eps)
    gw = flat_g * (weight.to(dtype) + weight_offset)
    dx = r * gw - flat_x * r.pow(3) * (gw * flat_x).mean(-1, keepdim=True)
    dweight = (flat_g * flat_x * r).reshape(-1, flat_x.shape[-1]).sum(0)
    return dx.reshape(rows.shape).movedim(-2, head_axis(layout)), dweight


def copy_v(v: Tensor, dtype: torch.dtype) -> Tensor:
    """A new contiguous copy of ``v`` in ``dtype`` (never ``v`` itself); gradient: the incoming one, cast back."""
    return torch.empty(v.shape, dtype=dtype, device=v.device).copy_(v)
