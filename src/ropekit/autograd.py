"""Gradients: the backward of a rotation is the conjugate (transposed) rotation by the same op and kernel.

``ropekit::rope`` gets its autograd formula through ``torch.library.register_autograd`` (so it also holds under
``torch.compile``); the in-place op is wrapped in :class:`InplaceRope`, which declares its writes with
``mark_dirty`` so autograd refuses misuse (a leaf, or a tensor saved by another op) instead of computing wrong
gradients.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ropekit import ops
from ropekit.ops import _TENSOR_ARGS

# The non-tensor arguments of ropekit::rope, in schema order (the tensor ones: ops._TENSOR_ARGS).
_SCALAR_ARGS = ("pos_offset", "layout", "style", "freq_mode", "rotary_dim", "rotary_start", "table_by_token",
                "q_scale", "k_scale", "rotary_scale", "conjugate")


def conjugate_rotation(grads: list[Optional[Tensor]], in_dtypes: list[torch.dtype], tensors: tuple,
                       scalars: dict[str, Any], eager: bool = False) -> list[Optional[Tensor]]:
    """Gradients w.r.t. the inputs of a rotation, given the gradients of its outputs (None where unused).

    ``eager``: called from the eager Functions below, which may call the implementation directly; the registered
    formula (traced by AOT autograd with fake tensors) always goes through the registered op."""
    scalars = dict(scalars, conjugate=not scalars["conjugate"])
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present:
        return [None] * len(grads)
    # The op rotates its first tensor with q_scale and its second with k_scale: keep each grad with its own.
    if present == [1]:
        scalars["q_scale"] = scalars["k_scale"]
    gs = [grads[i] if grads[i].stride(-1) == 1 else grads[i].contiguous() for i in present]
    # Double backward (grad mode on) needs the differentiable registered op; a plain eager backward does not.
    rotate = ops.rope_out_of_place if eager and not torch.is_grad_enabled() else ops.rope
    outs = rotate(gs[0], gs[1] if len(gs) > 1 else None, *tensors, **scalars, promote_dtype=None)
    result: list[Optional[Tensor]] = [None] * len(grads)
    for i, out in zip(present, outs):
        result[i] = out if out.dtype == in_dtypes[i] else out.to(in_dtypes[i])
    return result


def _setup_context(ctx, inputs, output) -> None:
    q, k, *rest = inputs
    tensors = rest[: len(_TENSOR_ARGS)]
    scalars = dict(zip(_SCALAR_ARGS, rest[len(_TENSOR_ARGS): len(_TENSOR_ARGS) + len(_SCALAR_ARGS)]))
    ctx.save_for_backward(*tensors)
    ctx.scalars = scalars
    ctx.in_dtypes = [q.dtype] + ([k.dtype] if k is not None else [])


def _backward(ctx, grads):
    grads_in = conjugate_rotation(list(grads), ctx.in_dtypes, ctx.saved_tensors, ctx.scalars)
    nones = [None] * (len(_TENSOR_ARGS) + len(_SCALAR_ARGS) + 1)
    return (grads_in[0], grads_in[1] if len(grads_in) > 1 else None, *nones)


torch.library.register_autograd("ropekit::rope", _backward, setup_context=_setup_context)


class Rope(torch.autograd.Function):
    """Eager autograd for the out-of-place rotation without the dispatcher round trips of the registered op
    (its Python autograd wrapper costs far more host time than the kernel at training sizes). Same kernel and
    same conjugate backward as ``ropekit::rope``'s registered formula, which ``torch.compile`` uses."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Optional[Tensor], tensors: tuple, scalars: dict,
                promote_dtype: Optional[torch.dtype]) -> tuple:
        outs = ops.rope_out_of_place(q, k, *tensors, **scalars, promote_dtype=promote_dtype)
        ctx.save_for_backward(*tensors)
        ctx.scalars = scalars
        ctx.in_dtypes = [q.dtype] + ([k.dtype] if k is not None else [])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        grads_in = conjugate_rotation(list(grads), ctx.in_dtypes, ctx.saved_tensors, ctx.scalars, eager=True)
        return grads_in[0], (grads_in[1] if len(grads_in) > 1 else None), None, None, None


class InplaceRope(torch.autograd.Function):
    """``ropekit::rope_`` with autograd: rotates q (and k) in place and marks them dirty."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Optional[Tensor], tensors: tuple, scalars: dict) -> tuple:
        ops.rope_(q, k, *tensors, **scalars)
        dirty = (q,) if k is None else (q, k)
        ctx.mark_dirty(*dirty)
        ctx.save_for_backward(*tensors)
        ctx.scalars = scalars
        ctx.in_dtypes = [t.dtype for t in dirty]
        return dirty

    @staticmethod
    def backward(ctx, *grads):
        grads_in = conjugate_rotation(list(grads), ctx.in_dtypes, ctx.saved_tensors, ctx.scalars, eager=True)
        return grads_in[0], (grads_in[1] if len(grads_in) > 1 else None), None, None


class PlannedRope(torch.autograd.Function):
    """Eager autograd of a call replayed from a launch plan (:mod:`ropekit._eager`): the forward launches the
    plan's bound kernel; the backward is the conjugate rotation through the public path (itself replayed from a
    plan keyed by the gradients' layout). Gradients arrive in whatever layout autograd produced (transposed,
    expanded with zero strides, sliced): the kernel takes any strides but the last, so only a gradient whose
    last dimension is not contiguous is copied, exactly as for :class:`Rope`."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Optional[Tensor], plan, tables: tuple, pos_offset: int, positions,
                optional: tuple):
        ctx.plan, ctx.positions, ctx.optional = plan, positions, optional
        ctx.save_for_backward(*[t for t in optional if isinstance(t, Tensor)])  # in-place changes raise later
        ctx.inputs = (q.shape, q.dtype, q.device), (None if k is None else (k.shape, k.dtype))
        return plan.rotate(plan.launch, q, k, tables, pos_offset)

    @staticmethod
    def backward(ctx, *grads):
        from ropekit.api import _rope

        ctx.saved_tensors  # noqa: B018 -- raises if positions or tables were modified in place since forward
        (q_shape, q_dtype, device), k_info = ctx.inputs
        gq = grads[0]
        gk = grads[1] if k_info is not None else None
        if gq is None:  # only k's output was used: rotate zeros for q (rare; keeps one code path)
            gq = torch.zeros(q_shape, dtype=gk.dtype, device=device)
        if k_info is not None and gk is None:
            gk = torch.zeros(k_info[0], dtype=gq.dtype, device=device)
        gq = gq if gq.stride(-1) == 1 else gq.contiguous()
        if gk is not None and gk.stride(-1) != 1:
            gk = gk.contiguous()
        positions, inv_freq, cos, sin, angles, cu_seqlens = ctx.optional
        kw = dict(ctx.plan.call_kwargs, conjugate=not ctx.plan.call_kwargs["conjugate"], promote_dtype=None)
        outs = _rope(gq, gk, positions=ctx.positions, inv_freq=inv_freq, cos=cos, sin=sin, angles=angles,
                     cu_seqlens=cu_seqlens, names=("grad of q_rot", "grad of k_rot"), **kw)
        dq, dk = (outs, None) if k_info is None else outs
        dq = dq if dq.dtype == q_dtype else dq.to(q_dtype)
        if dk is not None and dk.dtype != k_info[1]:
            dk = dk.to(k_info[1])
        return dq, dk, None, None, None, None, None
