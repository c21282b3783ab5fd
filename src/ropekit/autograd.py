"""Gradients, and the one place that decides how a validated rotation runs (:func:`rotate`).

The backward of a rotation is the conjugate (transposed) rotation by the same op and kernel. ``ropekit::rope`` gets
its autograd formula through ``torch.library.register_autograd`` (so it also holds under ``torch.compile``). Eager
calls use :class:`EagerRope`, the same formula without the dispatcher's round trips; the in-place op is wrapped in
:class:`InplaceRope`, which declares its writes with ``mark_dirty`` so autograd refuses misuse (a leaf, or a
tensor saved by another op) instead of computing wrong gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ropekit import ops
from ropekit._spec import CacheSpec, NormSpec, RopeSpec, needs_grad


def conjugate_rotation(grads: list[Tensor | None], in_dtypes: list[torch.dtype], spec: RopeSpec,
                       eager: bool = False) -> list[Tensor | None]:
    """Gradients w.r.t. the inputs of a rotation, given the gradients of its outputs (None where unused).

    ``eager``: called from the eager Functions below, which may call the implementation directly; the registered
    formula (traced by AOT autograd with fake tensors) always goes through the registered op."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present:
        return [None] * len(grads)
    spec = spec._replace(conjugate=not spec.conjugate, out_dtype=None)
    # The op rotates its first tensor with q_scale and its second with k_scale: keep each grad with its own.
    if present == [1]:
        spec = spec._replace(q_scale=spec.k_scale)
    # The kernel takes any strides but the last: only a gradient whose last dim is not contiguous is copied.
    gs = [grads[i] if grads[i].stride(-1) == 1 else grads[i].contiguous() for i in present]
    g0, g1 = gs[0], gs[1] if len(gs) > 1 else None
    # Double backward (grad mode on) needs the differentiable registered op; a plain eager backward does not.
    if eager and not torch.is_grad_enabled():
        outs = ops.rotate_out_of_place(g0, g1, spec)
    else:
        outs = ops.rope(g0, g1, *spec)
    result: list[Tensor | None] = [None] * len(grads)
    for i, out in zip(present, outs):
        result[i] = out if out.dtype == in_dtypes[i] else out.to(in_dtypes[i])
    return result


def _save(ctx, q: Tensor, k: Tensor | None, spec: RopeSpec) -> None:
    """Keep what the backward needs; the spec's tensors go through ``save_for_backward`` (version checks)."""
    ctx.save_for_backward(*spec.tensors)
    ctx.scalars = spec.scalars
    ctx.in_dtypes = [q.dtype] + ([k.dtype] if k is not None else [])


def _saved_spec(ctx) -> RopeSpec:
    return RopeSpec.from_parts(ctx.saved_tensors, ctx.scalars)


def _setup_context(ctx, inputs, output) -> None:
    q, k, *spec = inputs
    _save(ctx, q, k, RopeSpec(*spec))


def _backward(ctx, grads):
    grads_in = conjugate_rotation(list(grads), ctx.in_dtypes, _saved_spec(ctx))
    return (grads_in[0], grads_in[1] if len(grads_in) > 1 else None, *[None] * len(RopeSpec._fields))


torch.library.register_autograd("ropekit::rope", _backward, setup_context=_setup_context)


class EagerRope(torch.autograd.Function):
    """Eager autograd for the out-of-place rotation without the dispatcher round trips of the registered op
    (its Python autograd wrapper costs far more host time than the kernel at training sizes). Same kernel and
    same conjugate backward as ``ropekit::rope``'s registered formula, which ``torch.compile`` uses."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor | None, spec: RopeSpec) -> tuple:
        outs = ops.rotate_out_of_place(q, k, spec)
        _save(ctx, q, k, spec)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        grads_in = conjugate_rotation(list(grads), ctx.in_dtypes, _saved_spec(ctx), eager=True)
        return grads_in[0], (grads_in[1] if len(grads_in) > 1 else None), None


class InplaceRope(torch.autograd.Function):
    """``ropekit::rope_`` with autograd: rotates q (and k) in place and marks them dirty."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor | None, spec: RopeSpec) -> tuple:
        ops.rope_(q, k, *spec)
        dirty = (q,) if k is None else (q, k)
        ctx.mark_dirty(*dirty)
        _save(ctx, q, k, spec)
        return dirty

    @staticmethod
    def backward(ctx, *grads):
        grads_in = conjugate_rotation(list(grads), ctx.in_dtypes, _saved_spec(ctx), eager=True)
        return grads_in[0], (grads_in[1] if len(grads_in) > 1 else None), None


def _in_place_with_grad(q: Tensor, k: Tensor | None, spec: RopeSpec) -> tuple:
    """In-place rotation recorded by autograd. Compiled: the functional op (which has the autograd formula)
    and a copy back, which functionalization turns into the same in-place write. Eager: one autograd Function
    per tensor where either is a view (autograd allows only one output for a Function that writes into a view,
    e.g. q and k of one packed QKV buffer), else one Function and one launch for both."""
    if torch.compiler.is_compiling():
        rotated = ops.rope(q, k, *spec)
        q.copy_(rotated[0])
        if k is not None:
            k.copy_(rotated[1])
        return (q, k)
    if k is not None and (q._is_view() or k._is_view()):
        (q,) = InplaceRope.apply(q, None, spec)
        (k,) = InplaceRope.apply(k, None, spec._replace(q_scale=spec.k_scale))
        return (q, k)
    return InplaceRope.apply(q, k, spec)


def rotate(q: Tensor, k: Tensor | None, spec: RopeSpec, inplace: bool) -> tuple:
    """Run a validated rotation by the cheapest route that keeps autograd and tracing right: eager calls without
    autograd skip the dispatcher, eager autograd uses the Functions above, tracing uses the registered ops.
    Returns ``(q_out, k_out)`` (``k_out`` None without k; in place, q and k themselves)."""
    compiling = torch.compiler.is_compiling()
    grad = needs_grad(q, k)
    if inplace:
        if grad:
            outs = _in_place_with_grad(q, k, spec)
        elif compiling:
            ops.rope_(q, k, *spec)
            outs = (q, k)
        else:
            ops.rotate_in_place(q, k, spec)
            outs = (q, k)
    elif not compiling and not grad:
        outs = ops.rotate_out_of_place(q, k, spec)
    elif not compiling:
        outs = EagerRope.apply(q, k, spec)
    else:
        outs = ops.rope(q, k, *spec)
    return (outs[0], outs[1] if k is not None else None)



# --- the attention prologue -----------------------------------------------------------------------------------

def _save_norm_rope(ctx, q, k, q_weight, k_weight, weight_offset: float, eps: float, spec: RopeSpec) -> None:
    ctx.save_for_backward(q, k, q_weight, k_weight, *spec.tensors)
    ctx.norm = (weight_offset, eps)
    ctx.scalars = spec.scalars


def _norm_rope_grads(ctx, grad_q, grad_k, eager: bool) -> list:
    """[dq, dk, dq_weight, dk_weight] from the saved context; ``eager`` as in :func:`conjugate_rotation`."""
    q, k, q_weight, k_weight, *tensors = ctx.saved_tensors
    grad_q = torch.zeros_like(q) if grad_q is None else grad_q
    grad_k = torch.zeros_like(k) if grad_k is None else grad_k
    spec = RopeSpec.from_parts(tuple(tensors), ctx.scalars)
    if eager and not torch.is_grad_enabled():
        return ops.norm_rope_grads(grad_q, grad_k, q, k, q_weight, k_weight, *ctx.norm, spec)
    return ops.qk_norm_rope_backward(grad_q, grad_k, q, k, q_weight, k_weight, *ctx.norm, *spec)


def _norm_rope_setup_context(ctx, inputs, output) -> None:
    q, k, q_weight, k_weight, weight_offset, eps, *fields = inputs
    _save_norm_rope(ctx, q, k, q_weight, k_weight, weight_offset, eps, RopeSpec(*fields))


def _norm_rope_backward(ctx, grads):
    return (*_norm_rope_grads(ctx, *grads, eager=False), None, None, *[None] * len(RopeSpec._fields))


torch.library.register_autograd("ropekit::qk_norm_rope", _norm_rope_backward, setup_context=_norm_rope_setup_context)


def _norm_rope_grads_setup_context(ctx, inputs, output) -> None:
    grad_q, grad_k, q, k, q_weight, k_weight, weight_offset, eps, *fields = inputs
    spec = RopeSpec(*fields)
    ctx.save_for_backward(grad_q, grad_k, q, k, q_weight, k_weight, *spec.tensors)
    ctx.norm = (weight_offset, eps)
    ctx.scalars = spec.scalars


def _norm_rope_grads_backward(ctx, out_grads):
    """Double backward of qk_norm_rope: the gradients of its backward's outputs (dq, dk, dq_weight, dk_weight)
    w.r.t. that backward's inputs. Rare (gradient penalties, Hessian-vector products), so it re-forms the first
    backward in differentiable torch math -- the conjugate rotation through ``ropekit::rope`` (linear, with its own
    autograd) and the norm's backward as written in :func:`ropekit.reference.rms_norm_backward_reference` -- in
    float32 (float64 for float64 inputs and on CPU), and differentiates it."""
    from ropekit.reference import rms_norm_backward_reference

    grad_q, grad_k, q, k, q_weight, k_weight, *tensors = ctx.saved_tensors
    spec = RopeSpec.from_parts(tuple(tensors), ctx.scalars)
    weight_offset, eps = ctx.norm
    gg_q, gg_k, gg_q_weight, gg_k_weight = out_grads
    dtype = torch.float64 if q.dtype == torch.float64 or q.device.type == "cpu" else torch.float32
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_(True) for t in (grad_q, grad_k, q, k, q_weight, k_weight)]
        gq, gk, xq, xk, wq, wk = inputs
        rq, rk = ops.rope(gq.to(dtype), gk.to(dtype), *spec._replace(conjugate=not spec.conjugate, out_dtype=None))
        dq, dwq = rms_norm_backward_reference(xq, wq, weight_offset, eps, rq, dtype)
        dk, dwk = rms_norm_backward_reference(xk, wk, weight_offset, eps, rk, dtype)
        pairs = [(o, g) for o, g in zip((dq, dk, dwq, dwk), (gg_q, gg_k, gg_q_weight, gg_k_weight)) if g is not None]
        grads = torch.autograd.grad([o for o, _ in pairs], inputs, [g.to(o.dtype) for o, g in pairs],
                                    allow_unused=True, create_graph=torch.is_grad_enabled())
    grads = [None if g is None else g.to(t.dtype) for g, t in zip(grads, (grad_q, grad_k, q, k, q_weight, k_weight))]
    return (*grads, None, None, *[None] * len(RopeSpec._fields))


torch.library.register_autograd("ropekit::qk_norm_rope_backward", _norm_rope_grads_backward,
                                setup_context=_norm_rope_grads_setup_context)


class EagerNormRope(torch.autograd.Function):
    """Eager autograd for norm + RoPE without the dispatcher round trips of ``ropekit::qk_norm_rope`` (as
    :class:`EagerRope`); same kernels and backward as the op's registered formula, which ``torch.compile`` uses."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, weight_offset, eps, spec):
        outs = ops.norm_rotate(q, k, q_weight, k_weight, weight_offset, eps, spec)
        _save_norm_rope(ctx, q, k, q_weight, k_weight, weight_offset, eps, spec)
        return tuple(outs)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        return (*_norm_rope_grads(ctx, grad_q, grad_k, eager=True), None, None, None)


def norm_rotate(q: Tensor, k: Tensor, norm: NormSpec, spec: RopeSpec) -> tuple:
    """Per-head RMSNorm then rotation, validated: ``(q_out, k_out)``, by the cheapest route as :func:`rotate`:
    eager calls skip the dispatcher (:class:`EagerNormRope` with autograd), tracing uses
    ``ropekit::qk_norm_rope`` (whose backward is registered above)."""
    q_weight, k_weight, weight_offset, eps = norm.q_weight, norm.k_weight, norm.weight_offset, norm.eps
    if torch.compiler.is_compiling():
        return tuple(ops.qk_norm_rope(q, k, q_weight, k_weight, weight_offset, eps, *spec))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, q_weight, k_weight)):
        return EagerNormRope.apply(q, k, q_weight, k_weight, weight_offset, eps, spec)
    return tuple(ops.norm_rotate(q, k, q_weight, k_weight, weight_offset, eps, spec))


def write_kv(q: Tensor, k: Tensor, v: Tensor, norm: NormSpec, spec: RopeSpec, cache: CacheSpec) -> Tensor:
    """Rotated q, with k and v written into the caches (validated; ``norm`` with None weights: no norm). Not
    differentiable: the cache write is an inference step, and a call that would need gradients raises."""
    q_weight, k_weight, weight_offset, eps = norm.q_weight, norm.k_weight, norm.weight_offset, norm.eps
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, q_weight, k_weight)):
        raise RuntimeError("rope_kv_write is not differentiable (it writes an inference cache); call it under "
                           "torch.no_grad() or torch.inference_mode(), or use qk_norm_rope/apply_rope for training")
    if torch.compiler.is_compiling():
        return ops.rope_kv_write(q, k, v, cache.k_cache, cache.v_cache, q_weight, k_weight, weight_offset, eps,
                                 *ops.cache_op_args(cache), *spec)
    return ops.write_kv(q, k, v, q_weight, k_weight, weight_offset, eps, spec, cache)


# --- RoPE attention -------------------------------------------------------------------------------------------

def _attention_setup_context(ctx, inputs, output) -> None:
    q, k, v, angles, cu_seqlens, *params = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, angles, cu_seqlens, o, lse)
    ctx.params = params


def _attention_grads(ctx, grad_o, grad_lse, backward) -> tuple:
    """dq, dk, dv (and None for every other input) from what the forward saved, by ``backward`` (the op or its
    body)."""
    q, k, v, angles, cu_seqlens, o, lse = ctx.saved_tensors
    if grad_o is None:
        grad_o = torch.zeros_like(o)
    dq, dk, dv = backward(grad_o, grad_lse, q, k, v, angles, cu_seqlens, o, lse, *ctx.params)
    return dq, dk, dv, None, None, *[None] * len(ctx.params)


def _attention_backward(ctx, grad_o, grad_lse):
    return _attention_grads(ctx, grad_o, grad_lse, ops.rope_attention_backward)


torch.library.register_autograd("ropekit::rope_attention", _attention_backward,
                                setup_context=_attention_setup_context)


class EagerRopeAttention(torch.autograd.Function):
    """Eager autograd for RoPE attention without the dispatcher round trips of ``ropekit::rope_attention`` (half
    the host time of a call, which bounds short sequences); the same op bodies and the same backward as the op's
    registered formula above, which ``torch.compile`` uses."""

    @staticmethod
    def forward(ctx, q, k, v, angles, cu_seqlens, *params):
        o, lse = ops.attention_forward(q, k, v, angles, cu_seqlens, *params)
        _attention_setup_context(ctx, (q, k, v, angles, cu_seqlens, *params), (o, lse))
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        return _attention_grads(ctx, grad_o, grad_lse, ops.attention_backward)


def attend(q: Tensor, k: Tensor, v: Tensor, angles: Tensor, cu_seqlens: Tensor | None, *params
           ) -> tuple[Tensor, Tensor]:
    """(o, lse) of RoPE attention by the cheapest route, as :func:`norm_rotate`: eager calls skip the dispatcher
    (:class:`EagerRopeAttention` where autograd records), tracing uses ``ropekit::rope_attention``."""
    if torch.compiler.is_compiling():
        return ops.rope_attention(q, k, v, angles, cu_seqlens, *params)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return EagerRopeAttention.apply(q, k, v, angles, cu_seqlens, *params)
    return ops.attention_forward(q, k, v, angles, cu_seqlens, *params)


# --- the diffusion transformers' whole-hidden norm + RoPE -----------------------------------------------------

def hidden_norm_rope_grads(grad_q, grad_k, q, k, q_weight, k_weight, weight_offset: float, eps: float,
                           spec: RopeSpec) -> list[Tensor]:
    """[dq, dk, dq_weight, dk_weight] of ``ropekit::qk_hidden_norm_rope``, composed (not one launch): the conjugate
    rotation through ``ropekit::rope``, then the whole-hidden norm's backward in fp32 torch math (float64 for
    float64 inputs). Differentiable, so double backward works too."""
    from ropekit._hidden_norm import hidden_rms_norm_backward

    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    grad_q = torch.zeros_like(q) if grad_q is None else grad_q
    grad_k = torch.zeros_like(k) if grad_k is None else grad_k
    # contiguous: a gradient may be an expanded view (of a sum's), which ropekit::rope does not check for
    rq, rk = ops.rope(grad_q.to(dtype).contiguous(), grad_k.to(dtype).contiguous(),
                      *spec._replace(conjugate=not spec.conjugate, out_dtype=None))
    dq, dqw = hidden_rms_norm_backward(q, q_weight, weight_offset, eps, rq, spec.layout, dtype)
    dk, dkw = hidden_rms_norm_backward(k, k_weight, weight_offset, eps, rk, spec.layout, dtype)
    return [dq.to(q.dtype), dk.to(k.dtype), dqw.to(q_weight.dtype), dkw.to(k_weight.dtype)]


def _hidden_norm_setup_context(ctx, inputs, output) -> None:
    q, k, q_weight, k_weight, v, weight_offset, eps, *fields = inputs
    spec = RopeSpec(*fields)
    ctx.save_for_backward(q, k, q_weight, k_weight, *spec.tensors)
    ctx.norm = (weight_offset, eps)
    ctx.scalars = spec.scalars
    ctx.v_dtype = None if v is None else v.dtype


def _hidden_norm_backward(ctx, grads):
    q, k, q_weight, k_weight, *tensors = ctx.saved_tensors
    spec = RopeSpec.from_parts(tuple(tensors), ctx.scalars)
    dq, dk, dqw, dkw = hidden_norm_rope_grads(grads[0], grads[1], q, k, q_weight, k_weight, *ctx.norm, spec)
    dv = None if ctx.v_dtype is None or len(grads) < 3 or grads[2] is None else grads[2].to(ctx.v_dtype)
    return (dq, dk, dqw, dkw, dv, None, None, *[None] * len(RopeSpec._fields))


torch.library.register_autograd("ropekit::qk_hidden_norm_rope", _hidden_norm_backward,
                                setup_context=_hidden_norm_setup_context)


def hidden_norm_rotate(q: Tensor, k: Tensor, v: Tensor | None, norm: NormSpec, spec: RopeSpec) -> tuple:
    """Whole-hidden RMSNorm then rotation (validated): ``(q_out, k_out)``, and v's copy last where v is given.
    Through ``ropekit::qk_hidden_norm_rope`` where autograd records or torch.compile traces; other eager calls run
    the op's body without the dispatcher (and without the op's second look at q's and k's strides)."""
    leaves = (q, k, norm.q_weight, norm.k_weight, v)
    if not torch.compiler.is_compiling() and not (
            torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in leaves)):
        return tuple(ops.hidden_norm_rotate(q, k, norm.q_weight, norm.k_weight, v, norm.weight_offset, norm.eps,
                                            spec))
    return tuple(ops.qk_hidden_norm_rope(q, k, norm.q_weight, norm.k_weight, v, norm.weight_offset, norm.eps,
                                         *spec))
