"""Eager fast path: a launch plan per call signature, so a repeated call costs a dictionary lookup and a launch.

A call's *signature* is everything validation and the kernel's specialisation depend on: every argument's type,
shape, strides, dtype, device and 16-byte alignment, and every scalar argument, but not data pointers or an int
position offset. The first call of a signature goes through the full path (:func:`ropekit.api._normalise`, the
launcher); if it succeeds on CUDA outside tracing, :func:`record` keeps a :class:`Plan` holding the compiled
kernel bound to its grid and arguments (:class:`ropekit.triton.launcher.BoundLaunch`). Later calls of the same
signature skip validation, normalisation and the launcher's argument building: they read the data pointers,
allocate the outputs and launch. Calls that need autograd (out of place) get plans of their own, replayed through
:class:`ropekit.autograd.PlannedRope`, whose backward is the conjugate rotation through the public path.

What a plan re-checks per call is what can change within a signature: the int position offset (negative, past a
cos/sin table or beyond int32 sends the call back to the full path, which raises or handles it).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ropekit._layout import to_canonical

_PLANS: dict = {}
_MAX_PLANS = 1024
_INT32_MAX = 2**31 - 1

# Sources of the kernel's positions .. sin pointer slots, indices into the per-call tuple built in Plan.__call__:
# q (the launcher's dummy for an absent tensor), positions, inv_freq, cos, sin, angles, cu_seqlens, the plan's
# constant inv_freq.
_Q, _POS, _FREQ, _COS, _SIN, _ANGLES, _CU, _CONST_FREQ = range(8)


def signature(q: Tensor, k: Optional[Tensor], optional: tuple, scalars: tuple):
    """(key, data pointers) of a call, or None when the fast path does not apply: not CUDA, tensor subclasses,
    tracing, in-place calls that need autograd.

    ``optional`` = (positions, inv_freq, cos, sin, angles, cu_seqlens) as the user passed them; ``scalars``
    starts with the ``inplace`` flag. The pointers are q's, k's and the optional tensors' in that order (0 where
    absent). Calls that need autograd get keys (and plans) of their own."""
    if type(q) is not Tensor or not q.is_cuda or (k is not None and type(k) is not Tensor):
        return None
    if torch.compiler.is_compiling():
        return None
    grad = torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))
    if grad and scalars[0]:  # in place with autograd: the full path (mark_dirty and its checks)
        return None
    ptrs = [q.data_ptr()]
    parts = [(q.shape, q.stride(), q.dtype, q.get_device(), ptrs[0] & 15)]
    for t in (k, *optional):
        if t is None:
            ptrs.append(0)
            parts.append(None)
        elif type(t) is Tensor:
            p = t.data_ptr()
            ptrs.append(p)
            parts.append((t.shape, t.stride(), t.dtype, t.get_device(), p & 15))
        else:  # an int position offset (its value is checked per call), or something the full path rejects
            ptrs.append(0)
            parts.append(type(t))
    return (*parts, *scalars, grad), ptrs


class Plan:
    """The bound launch of one call signature and where each of its positions .. sin pointer slots comes from
    (q's and k's slots are always the call's own tensors)."""

    __slots__ = ("launch", "slots", "const_freq", "const_freq_ptr", "int_offset", "max_offset", "q_out", "k_out",
                 "inplace", "grad", "call_kwargs")

    def __call__(self, q: Tensor, k: Optional[Tensor], positions, ptrs: list, optional: tuple):
        """Launch and return the outputs as the full path would, or None to send the call down the full path."""
        pos_offset = 0
        if self.int_offset:
            pos_offset = int(positions)
            if not 0 <= pos_offset <= self.max_offset:
                return None
        q_ptr, k_ptr, pos_ptr, freq_ptr, cos_ptr, sin_ptr, angles_ptr, cu_ptr = ptrs
        source = (q_ptr, pos_ptr, freq_ptr, cos_ptr, sin_ptr, angles_ptr, cu_ptr, self.const_freq_ptr)
        tables = tuple(source[i] for i in self.slots)
        if self.grad:
            from ropekit.autograd import PlannedRope

            return PlannedRope.apply(q, k, self, tables, pos_offset, positions, optional)
        if self.inplace:
            k_ptr = k_ptr if k is not None else q_ptr  # the launcher passes q's pointers in k's slots
            self.launch(q_ptr, q_ptr, k_ptr, k_ptr, *tables, pos_offset)
            return q if k is None else (q, k)
        return self.rotate(self.launch, q, k, tables, pos_offset)

    def rotate(self, launch, q: Tensor, k: Optional[Tensor], tables: tuple, pos_offset: int):
        """Out-of-place rotation of ``q`` (and ``k``) with a bound launch; the outputs are fresh tensors."""
        q_out = torch.empty(self.q_out[0], dtype=self.q_out[1], device=q.device)
        q_ptr, qo_ptr = q.data_ptr(), q_out.data_ptr()
        if k is None:  # the launcher passes q's pointers in k's slots
            launch(q_ptr, qo_ptr, q_ptr, qo_ptr, *tables, pos_offset)
            return q_out
        k_out = torch.empty(self.k_out[0], dtype=self.k_out[1], device=q.device)
        launch(q_ptr, qo_ptr, k.data_ptr(), k_out.data_ptr(), *tables, pos_offset)
        return q_out, k_out


def record(key, q: Tensor, k: Optional[Tensor], optional: tuple, normalised, outs: tuple, inplace: bool,
           call_kwargs: dict) -> None:
    """Keep a plan for ``key`` after its first call ran the full path successfully with ``normalised`` arguments
    (see :class:`ropekit.api._Normalised`) and produced ``outs``; skip signatures a plan cannot replay.
    ``call_kwargs``: the call's non-tensor keyword arguments (``conjugate``, ``promote_dtype``, ``base``, ...), for
    the backward of calls that need autograd."""
    from ropekit.triton.launcher import bind_rope

    positions, inv_freq, cos, sin, angles, cu_seqlens = optional
    pos_t, seq_offsets, cu_t, inv_freq_t, cos_t, sin_t = normalised.tensors
    scalars = normalised.scalars
    q_out, k_out = outs if k is not None else (outs[0], None)

    def source(t: Optional[Tensor], candidates: tuple) -> Optional[int]:
        """The per-call source of normalised tensor ``t``: q's slot for an absent one (the launcher's dummy),
        else the user argument it is a view of (same data pointer), else None (a copy: no plan)."""
        if t is None:
            return _Q
        for index, arg in candidates:
            if isinstance(arg, Tensor) and arg.data_ptr() == t.data_ptr():
                return index
        return None

    const_freq = None
    freq_source = source(inv_freq_t, ((_FREQ, inv_freq),))
    if freq_source is None and inv_freq is None and inv_freq_t is not None:  # the cached default frequencies
        const_freq, freq_source = inv_freq_t, _CONST_FREQ
    slots = (source(pos_t, ((_POS, positions),)), source(seq_offsets, ((_POS, positions),)),
             source(cu_t, ((_CU, cu_seqlens),)), freq_source, source(cos_t, ((_COS, cos), (_ANGLES, angles))),
             source(sin_t, ((_SIN, sin),)))
    if any(s is None for s in slots):
        return
    int_offset = positions is not None and not isinstance(positions, Tensor)
    pos_offset = scalars["pos_offset"]
    if int_offset and not 0 <= pos_offset <= _INT32_MAX:
        return
    launch = bind_rope(q, k, q_out, k_out, **normalised.launch_kwargs())
    if launch is None:
        return
    plan = Plan()
    plan.launch, plan.slots, plan.inplace, plan.grad = launch, slots, inplace, key[-1]
    plan.call_kwargs = call_kwargs
    plan.const_freq = const_freq
    plan.const_freq_ptr = const_freq.data_ptr() if const_freq is not None else 0
    plan.int_offset = int_offset
    # The full path refuses offsets that run past a position-indexed table (no cu_seqlens): replay that bound.
    max_offset = _INT32_MAX
    if cos_t is not None and not scalars["table_by_token"] and cu_t is None and pos_t is None and seq_offsets is None:
        seqlen = to_canonical(q, scalars["layout"]).shape[1]
        max_offset = min(max_offset, cos_t.shape[1] - seqlen)
    plan.max_offset = max_offset
    plan.q_out = (q_out.shape, q_out.dtype)
    plan.k_out = (k_out.shape, k_out.dtype) if k_out is not None else None
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan
