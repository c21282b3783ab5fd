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
cos/sin table or past the largest position sends the call back to the full path, which raises or handles it), and
for in-place calls whether q and k share memory in a way the full path has not checked. In-place replays declare
their writes to autograd (version counters), as the full path does.

The same code runs on CPU tensors under :func:`ropekit.testing.kernels_on_cpu` (the Triton interpreter), with
tensors instead of integer addresses as the kernel's pointer arguments, so CPU-only CI tests the fast path
against the full path. ``ROPEKIT_DISABLE_FAST_PATH=1`` or :func:`ropekit.set_fast_path` turns plans off.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch
from torch import Tensor

from ropekit._layout import to_canonical
from ropekit._memory import span_bytes
from ropekit.ops import uses_kernels
from ropekit.reference import MAX_POSITION

_PLANS: OrderedDict = OrderedDict()
_MAX_PLANS = 1024

# Sources of the kernel's positions .. sin pointer slots, indices into the per-call tuple built in Plan.__call__:
# q (the launcher's dummy for an absent tensor), positions, inv_freq, cos, sin, angles, cu_seqlens, the plan's
# constant inv_freq.
_Q, _POS, _FREQ, _COS, _SIN, _ANGLES, _CU, _CONST_FREQ = range(8)


def signature(q: Tensor, k: Optional[Tensor], optional: tuple, scalars: tuple):
    """(key, handles) of a call, or None when the fast path does not apply: not a kernel call (CUDA, or CPU under
    ``kernels_on_cpu``; float64 runs the reference), tensor subclasses, tracing, in-place calls that need autograd.

    ``optional`` = (positions, inv_freq, cos, sin, angles, cu_seqlens) as the user passed them; ``scalars``
    starts with the ``inplace`` flag. The handles are q's, k's and the optional tensors' data pointers in that
    order (0 where absent) -- the tensors themselves on CPU, where the interpreter needs them. Calls that need
    autograd get keys (and plans) of their own."""
    if type(q) is not Tensor or (k is not None and type(k) is not Tensor) or not uses_kernels(q):
        return None
    raw = q.is_cuda
    if torch.compiler.is_compiling():
        return None
    inplace = scalars[0]
    grad = torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))
    if grad and inplace:  # in place with autograd: the full path (mark_dirty and its checks)
        return None
    p = q.data_ptr()
    handles = [p if raw else q]
    parts = [(q.shape, q.stride(), q.dtype, q.get_device(), p & 15)]
    for t in (k, *optional):
        if t is None:
            handles.append(0)
            parts.append(None)
        elif type(t) is Tensor:
            p = t.data_ptr()
            handles.append(p if raw else t)
            parts.append((t.shape, t.stride(), t.dtype, t.get_device(), p & 15))
        else:  # an int position offset (its value is checked per call), or something the full path rejects
            handles.append(0)
            parts.append(type(t))
    if inplace:  # torch refuses in-place writes to inference tensors outside inference mode: so does the full path
        parts.append((q.is_inference(), k is not None and k.is_inference(), torch.is_inference_mode_enabled()))
    return (*parts, *scalars, grad), handles


def lookup(key) -> Optional["Plan"]:
    """The plan of a signature, or None; raises TypeError for an unhashable key (an argument of a wrong type)."""
    plan = _PLANS.get(key)
    if plan is not None:
        _PLANS.move_to_end(key)
    return plan


def clear() -> None:
    """Forget every plan (tests; the plans hold no tensors of the calls that made them)."""
    _PLANS.clear()


class Plan:
    """The bound launch of one call signature and where each of its positions .. sin pointer slots comes from
    (q's and k's slots are always the call's own tensors)."""

    __slots__ = ("launch", "slots", "const_freq", "const_freq_handle", "int_offset", "max_offset", "q_out", "k_out",
                 "inplace", "grad", "call_kwargs", "handle", "q_span", "k_span", "qk_delta")

    def __call__(self, q: Tensor, k: Optional[Tensor], positions, handles: list, optional: tuple):
        """Launch and return the outputs as the full path would, or None to send the call down the full path."""
        pos_offset = 0
        if self.int_offset:
            pos_offset = int(positions)
            if not 0 <= pos_offset <= self.max_offset:
                return None
        q_h, k_h, pos_h, freq_h, cos_h, sin_h, angles_h, cu_h = handles
        source = (q_h, pos_h, freq_h, cos_h, sin_h, angles_h, cu_h, self.const_freq_handle)
        tables = tuple(source[i] for i in self.slots)
        if self.grad:
            from ropekit.autograd import PlannedRope

            return PlannedRope.apply(q, k, self, tables, pos_offset, positions, optional)
        if self.inplace:
            if k is None:  # the launcher passes q's pointers in k's slots
                self.launch(q_h, q_h, q_h, q_h, *tables, pos_offset)
                torch.autograd.graph.increment_version(q)
                return q
            if not self._disjoint(q, k):
                return None
            self.launch(q_h, q_h, k_h, k_h, *tables, pos_offset)
            torch.autograd.graph.increment_version(q)
            torch.autograd.graph.increment_version(k)
            return q, k
        return self.rotate(self.launch, q, k, tables, pos_offset)

    def _disjoint(self, q: Tensor, k: Tensor) -> bool:
        """q and k of an in-place call occupy disjoint address ranges, or sit at the relative offset the full
        path proved safe when it recorded this plan (interleaved views of one packed buffer)."""
        qp, kp = q.data_ptr(), k.data_ptr()
        return kp >= qp + self.q_span or qp >= kp + self.k_span or kp - qp == self.qk_delta

    def rotate(self, launch, q: Tensor, k: Optional[Tensor], tables: tuple, pos_offset: int):
        """Out-of-place rotation of ``q`` (and ``k``) with a bound launch; the outputs are fresh tensors."""
        q_out = torch.empty(self.q_out[0], dtype=self.q_out[1], device=q.device)
        q_h, qo_h = self.handle(q), self.handle(q_out)
        if k is None:  # the launcher passes q's pointers in k's slots
            launch(q_h, qo_h, q_h, qo_h, *tables, pos_offset)
            return q_out
        k_out = torch.empty(self.k_out[0], dtype=self.k_out[1], device=q.device)
        launch(q_h, qo_h, self.handle(k), self.handle(k_out), *tables, pos_offset)
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
    seqlen = to_canonical(q, scalars["layout"]).shape[1]
    launch = bind_rope(q, k, q_out, k_out, **normalised.launch_kwargs())
    if launch is None:
        return
    plan = Plan()
    plan.launch, plan.slots, plan.inplace, plan.grad = launch, slots, inplace, key[-1]
    plan.call_kwargs = call_kwargs
    # What the launch takes for a tensor: its address on CUDA (a C call, no Python frame), the tensor under the
    # interpreter.
    plan.handle = Tensor.data_ptr if q.is_cuda else _same
    plan.const_freq = const_freq
    plan.const_freq_handle = plan.handle(const_freq) if const_freq is not None else 0
    plan.int_offset = int_offset
    # The full path refuses offsets whose positions run past MAX_POSITION or a position-indexed table: replay
    # those bounds (with packed sequences, conservatively: S is at least the longest sequence).
    max_offset = MAX_POSITION - max(seqlen, 1) + 1
    if cos_t is not None and not scalars["table_by_token"] and pos_t is None and seq_offsets is None:
        max_offset = min(max_offset, cos_t.shape[1] - seqlen)
    plan.max_offset = max_offset
    plan.q_span = plan.k_span = plan.qk_delta = 0
    if inplace and k is not None:  # the full path checked that q and k do not overlap at this relative offset
        plan.q_span, plan.k_span = span_bytes(q), span_bytes(k)
        plan.qk_delta = k.data_ptr() - q.data_ptr()
    plan.q_out = (q_out.shape, q_out.dtype)
    plan.k_out = (k_out.shape, k_out.dtype) if k_out is not None else None
    _PLANS[key] = plan
    if len(_PLANS) > _MAX_PLANS:  # least recently used out
        _PLANS.popitem(last=False)


def _same(t: Tensor) -> Tensor:
    return t

