"""Plans for rope_attention (:func:`planned_attention`, :class:`AttentionPlan`, :class:`PlannedRopeAttention`).

A full-path call makes a few launches: the rotation of the unit rows into the angle rows, the rotated copy of k and
the attention's forward kernel (its backward: the delta rows, rotated copies of q and k, the dk/dv and dq kernels).
A plan is that sequence as recorded (:class:`_Chain`), each pointer argument refilled per call from the call's
tensors, from buffers the replay allocates where the launchers allocated theirs (the angle rows, the rotated
copies, the delta rows), or kept (the unit rows and the default frequencies: cached constants, never written).

What a replay re-checks per call is what the full path reads from the data: an int position offset (as the rotation's
plans), and packed boundaries (``cu_seqlens``) that live on the host, which the full path checks on every call. Calls
with ``cu_seqlens`` but no ``max_seqlen`` (the kernels' grid comes from the boundaries' values) and calls with
``check_positions=True`` always take the full path. ``return_lse`` and ``return_rotated`` are planned: the first
is a view of the lse the forward wrote, the second one more rotation call (with its own plans).
"""

from __future__ import annotations

import functools
import operator
from collections import OrderedDict

import torch
from torch import Tensor

from ropekit._fastpath.plans import (
    _ATTENTION_PLANS,
    _ATTENTION_SEEN,
    _call_signature,
    _checked_offset,
    _keep,
    _note,
    _offset_bound,
    _planned,
    _plans_apply,
    _recording,
    _sources_key,
)
from ropekit._fastpath.rope import rotate
from ropekit._spec import FORWARD, to_canonical
from ropekit._validation import check_cu_seqlens_bounds

# rope_attention's arguments that may be tensors, in the order a call's tensors are kept (_call_signature)
_TENSORS = ("q", "k", "v", "positions", "inv_freq", "cos", "sin", "angles", "cu_seqlens")
_TENSOR_OPTIONS = frozenset(_TENSORS[3:])
# the pointer arguments through which a launcher hands a kernel a buffer it allocated itself (the angle rows, the
# rotated copies, the delta rows): a replay allocates its own
_SCRATCH_SLOTS = frozenset(("qo_ptr", "ko_ptr", "out_ptr", "delta_ptr"))
_MAX_BACKWARDS = 8  # gradient layouts kept per plan


def attention_outputs(o: Tensor, lse: Tensor, options, rotated: tuple | None = None):
    """What :func:`ropekit.rope_attention` returns from the attention's (o, lse): o; lse in the call's layout where
    asked; then ``rotated`` (the rotated q and k, where asked)."""
    if not (options.return_lse or options.return_rotated):
        return o
    outs = [o]
    if options.return_lse:
        outs.append(lse[0] if options.layout == "thd" else lse)
    if options.return_rotated:
        outs.extend(rotated)
    return tuple(outs)


@functools.cache
def _scalar_getter(fields: tuple):
    return operator.itemgetter(*[i for i, name in enumerate(fields) if name not in _TENSOR_OPTIONS])


def _scalars(options) -> tuple:
    """The call's options that are never tensors, with their types (True and 1 are one key otherwise, but not one
    call: validation refuses a bool where it wants a number)."""
    values = _scalar_getter(options._fields)(options)
    if type(options.sections) is list:
        values = tuple(tuple(v) if type(v) is list else v for v in values)
    return values, tuple(map(type, values))


def planned_attention(q: Tensor, k: Tensor, v: Tensor, options, full):
    """:func:`ropekit.rope_attention` (its keywords bundled in ``options``): replay the plan of the call's signature,
    or run ``full(q, k, v, options)`` -- the full path -- noting the signature (and, on its second call, recording
    its plan from the launches it made, which ``full`` reports through its ``note`` argument)."""
    if (not _plans_apply() or options.check_positions
            or (options.cu_seqlens is not None and options.max_seqlen is None)):
        return full(q, k, v, options)
    values = (q, k, v, options.positions, options.inv_freq, options.cos, options.sin, options.angles,
              options.cu_seqlens)
    try:
        scalars = _scalars(options)
    except TypeError:  # an unhashable option: the full path names it
        return full(q, k, v, options)
    plan, sig = _planned(_ATTENTION_PLANS, _call_signature(values, _TENSORS, scalars, grad_ok=True))
    if plan is not None:
        out = plan(sig[1], q, k, v, options)
        if out is not None:
            return out
        return full(q, k, v, options)  # this call's offset or boundaries need the full path's checks
    if sig is None:
        return full(q, k, v, options)
    key, tensors = sig
    with _recording() as launches:
        def note(run) -> None:
            _note(_ATTENTION_SEEN, key, lambda: _keep(_ATTENTION_PLANS, key,
                                                      AttentionPlan.record(tensors, options, run, list(launches))))

        return full(q, k, v, options, note)


class _Chain:
    """Recorded launches (:class:`ropekit.triton.runtime.Replay` each), replayed in order with a call's tensors.
    ``sources``: the call's tensors (None where absent); ``scratch``: per buffer a launcher allocated, its
    (elements, dtype, size, stride, storage offset), allocated before its first use and dropped after its last
    (as the launchers do), unless kept for the caller."""

    __slots__ = ("steps", "scratch", "n_sources", "kept")

    @classmethod
    def record(cls, launches: list, sources: list, constants: tuple, open_offset: bool, kept: tuple = ()):
        """The chain of ``launches`` (:class:`ropekit.triton.runtime.Launch`), or None where a pointer argument is
        none of ``sources``, a launcher's own buffer or one of ``constants`` (a copy validation made), or a kernel
        is not compiled. ``open_offset``: the rotation's int position offset is refilled per call. ``kept``:
        data pointers of launcher buffers the caller reads after the chain (never dropped; ``chain.kept``: where
        each is in the list a call returns, None where no launch took it)."""
        from ropekit.triton import runtime

        where = {}
        for j, t in enumerate(sources):
            if t is not None:
                where.setdefault(t.data_ptr(), j)
        fixed = {c.data_ptr() for c in constants}
        n = len(sources)
        scratch, first, last, steps = [], {}, {}, []
        for s, launch in enumerate(launches):
            names, args = launch.roles.fn.arg_names, launch.args
            for i in launch.roles.pointers:  # buffers this launch's launcher allocated
                t = args[i]
                if names[i] in _SCRATCH_SLOTS and isinstance(t, Tensor):
                    p = t.data_ptr()
                    if p not in where and p not in fixed:
                        where[p] = n + len(scratch)
                        scratch.append((t.untyped_storage().nbytes() // t.element_size(), t.dtype, tuple(t.shape),
                                        t.stride(), t.storage_offset()))
            slots, refs = [], []
            for i in launch.roles.pointers:
                t = args[i]
                if not isinstance(t, Tensor):
                    continue
                ref = where.get(t.data_ptr())
                if ref is None:
                    if t.data_ptr() in fixed and names[i] not in _SCRATCH_SLOTS:
                        continue  # a constant: stays as recorded
                    return None
                slots.append(names[i])
                refs.append(ref)
                if ref >= n:
                    first.setdefault(ref, s)
                    last[ref] = s
            with_offset = open_offset and "pos_offset" in launch.roles.index
            if with_offset:
                slots.append("pos_offset")
            replay = runtime.Replay.of(launch, tuple(slots))
            if replay is None:
                return None
            steps.append((replay, tuple(refs), with_offset, [], []))
        keep = tuple(where.get(p) for p in kept)
        for ref, s in first.items():
            steps[s][3].append(ref)
        for ref, s in last.items():
            if ref not in keep:
                steps[s][4].append(ref)
        chain = cls()
        chain.steps, chain.scratch, chain.n_sources, chain.kept = tuple(steps), tuple(scratch), n, keep
        return chain

    def __call__(self, sources: list, offset: int | None) -> list:
        """Launch every step with ``sources`` (and the int position offset, where open); returns the sources and
        the kept buffers (the others None)."""
        bufs = [*sources, *[None] * len(self.scratch)]
        device = sources[0].device
        for replay, refs, with_offset, alloc, drop in self.steps:
            for r in alloc:
                elements, dtype, size, stride, storage_offset = self.scratch[r - self.n_sources]
                bufs[r] = torch.empty(elements, dtype=dtype, device=device).as_strided(size, stride, storage_offset)
            handle = replay.handle
            values = [handle(bufs[r]) for r in refs]
            if with_offset:
                values.append(offset)
            replay(*values)
            for r in drop:
                bufs[r] = None
        return bufs


class AttentionPlan:
    """The forward launches of one rope_attention signature (:class:`_Chain`; sources: q, k, v with a contiguous
    last dim, the call's other tensors in ``_TENSORS`` order, the packed boundaries as the kernels take them, then
    the fresh o and lse) and, per layout of the backward's tensors, the backward's (sources: the gradients of o and
    lse, the saved q, k, v, angle rows, boundaries, o and lse, then the fresh dq, dk, dv)."""

    __slots__ = ("forward", "o_shape", "lse_shape", "dtype", "angles", "int_offset", "max_offset", "read_bounds",
                 "params", "rope_args", "backwards")

    @classmethod
    def record(cls, tensors: list, options, run, launches: list):
        """A plan from the full path's launches (``run``: its :class:`ropekit.attention.AttentionRun`), or None
        where they cannot be replayed."""
        q_in, k_in, v_in = run.inputs
        positions = options.positions
        if any(t.numel() == 0 for t in run.inputs) or not (positions is None or isinstance(positions, Tensor)
                                                           or type(positions) is int):
            return None
        plan = cls()
        plan.int_offset = type(positions) is int
        spec = run.unit_spec
        constants = [run.unit]
        if options.inv_freq is None and spec.inv_freq is not None:
            constants.append(spec.inv_freq)  # the default frequencies of base=, cached by validation
        sources = [q_in, k_in, v_in, *tensors[3:], run.sequences, run.o, run.lse]
        plan.forward = _Chain.record(launches, sources, tuple(constants), plan.int_offset,
                                     kept=(run.angles.data_ptr(),))
        if plan.forward is None:
            return None
        ref = plan.forward.kept[0]
        if ref is None or ref < len(sources):
            return None
        # the saved angle rows: a view of the rotation's output, a buffer the replay allocates like it
        plan.angles = (ref, tuple(run.angles.shape), run.angles.stride(), run.angles.storage_offset())
        plan.o_shape, plan.lse_shape, plan.dtype = run.o.shape, run.lse.shape, run.o.dtype
        plan.max_offset = _offset_bound(spec, to_canonical(q_in, options.layout).shape[1]) if plan.int_offset else 0
        plan.read_bounds = run.sequences is not None and options.cu_seqlens.device.type == "cpu"
        plan.params = run.params
        plan.rope_args = run.args._replace(positions=None, inv_freq=None, cos=None, sin=None, angles=None,
                                           cu_seqlens=None)
        plan.backwards = OrderedDict()
        return plan

    def __call__(self, tensors: list, q: Tensor, k: Tensor, v: Tensor, options):
        """What the call returns, or None to send it down the full path (its offset or boundaries need checks)."""
        offset = None
        if self.int_offset:
            offset = _checked_offset(options.positions, self.max_offset)
            if offset == -1:
                return None
        cu_seqlens, sequences = tensors[8], None
        if cu_seqlens is not None:
            if self.read_bounds and not _bounds_fit(cu_seqlens, q.shape[0], options.max_seqlen):
                return None
            sequences = cu_seqlens.to(device=q.device, dtype=torch.int32)
        q_in, k_in, v_in = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        sources = [q_in, k_in, v_in, *tensors[3:], sequences]
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            o, lse = PlannedRopeAttention.apply(q_in, k_in, v_in, self, sources, offset)
        else:
            o, lse, _ = self.run(sources, offset)
        rotated = None
        if options.return_rotated:  # as the public rotation of plain tensors: its own plans
            args = self.rope_args._replace(positions=options.positions, inv_freq=options.inv_freq, cos=options.cos,
                                           sin=options.sin, angles=options.angles, cu_seqlens=options.cu_seqlens)
            rotated = rotate(q, k, FORWARD, args)
        return attention_outputs(o, lse, options, rotated)

    def run(self, sources: list, offset: int | None) -> tuple:
        """(o, lse, the angle rows) of the forward's launches with ``sources`` (:class:`AttentionPlan`'s)."""
        device = sources[0].device
        o = torch.empty(self.o_shape, dtype=self.dtype, device=device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=device)
        bufs = self.forward([*sources, o, lse], offset)
        ref, size, stride, storage_offset = self.angles
        return o, lse, bufs[ref].as_strided(size, stride, storage_offset)

    def grads(self, do: Tensor, dlse: Tensor | None, saved: tuple) -> tuple:
        """(dq, dk, dv) from the gradients of o and lse and the forward's saved tensors (q, k, v, angle rows,
        boundaries, o, lse), by the replay recorded for this layout of them (which saved-tensor hooks may have
        changed since the forward), or by the full path's op body, which records it."""
        from ropekit import ops

        do = do if do.stride(-1) == 1 else do.contiguous()  # as the op body: the kernels take any other strides
        if dlse is not None:
            dlse = dlse.float().contiguous()
        sources = [do, dlse, *saved]
        key = _sources_key(sources)
        chain = self.backwards.get(key)
        q, k, v = saved[:3]
        if chain is not None:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            chain([*sources, dq, dk, dv], None)
            return dq, dk, dv
        with _recording() as launches:
            dq, dk, dv = ops.attention_backward(do, dlse, *saved, *self.params)
            _keep(self.backwards, key, _Chain.record(launches, [*sources, dq, dk, dv], (), False), _MAX_BACKWARDS)
        return dq, dk, dv


def _bounds_fit(cu_seqlens: Tensor, tokens: int, max_seqlen: int) -> bool:
    """Host boundaries the full path would accept (it reads them on every call): else it raises."""
    try:
        bounds = check_cu_seqlens_bounds(cu_seqlens, tokens)
        return int((bounds[1:] - bounds[:-1]).max()) <= max_seqlen
    except (ValueError, RuntimeError, IndexError):
        return False


class PlannedRopeAttention(torch.autograd.Function):
    """Eager autograd of a rope_attention call replayed from a plan, as :class:`ropekit.autograd.EagerRopeAttention`
    is of the full path: the same kernels, and the same tensors saved (q, k, v, the angle rows, the boundaries, o
    and lse), so that in-place changes before the backward raise as there and activation checkpointing's
    recomputation saves the same whichever route it takes."""

    @staticmethod
    def forward(ctx, q, k, v, plan: AttentionPlan, sources: list, offset: int | None):
        o, lse, angles = plan.run(sources, offset)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, angles, sources[9], o, lse)
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        saved = ctx.saved_tensors  # raises if a saved tensor was modified in place
        if grad_o is None:
            grad_o = torch.zeros_like(saved[5])
        return (*ctx.plan.grads(grad_o, grad_lse, saved), None, None, None)
