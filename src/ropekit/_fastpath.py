"""Eager fast path: a launch plan per call signature, so a repeated call costs a dictionary lookup and a launch.

A call's *signature* is everything validation and the kernel's specialisation depend on: every argument's type,
shape, strides, dtype, device and 16-byte alignment, and every other option, but not data pointers or an int
position offset. The first call of a signature goes through the full path (:func:`ropekit._validation.validate_args`,
:func:`ropekit.autograd.rotate`) and is noted; the second also records a :class:`Plan` holding the compiled kernel
bound to its grid and arguments (:class:`ropekit.triton.bound.BoundLaunch`), so a signature seen once -- packed
sequences whose token count changes every step -- costs only the note. Later calls of a recorded signature skip
validation and argument building: they read the data pointers, allocate the outputs and launch. Calls that need
autograd (out of place) get plans of their own, replayed through :class:`PlannedRope`, whose backward is the
conjugate rotation through :func:`rotate` (itself replayed from a plan keyed by the gradients' layout).

What a plan re-checks per call is what can change within a signature: the int position offset (negative, past a
cos/sin table or past the largest position sends the call back to the full path, which raises or handles it), and
for in-place calls whether q and k share memory in a way the full path has not checked. In-place replays declare
their writes to autograd (version counters), as the full path does.

The attention prologue's calls get plans of the same kind, recorded from the launch their full path made:
``rope_kv_write`` (:class:`KvPlan`) and ``qk_norm_rope`` (:class:`NormPlan`, with its backward's launch replayed
per layout of the incoming gradients through :class:`PlannedNormRope`).

The same code runs on CPU tensors under :func:`ropekit.testing.kernels_on_cpu` (the Triton interpreter), with
tensors instead of integer addresses as the kernel's pointer arguments, so CPU-only CI tests the fast path
against the full path. ``ROPEKIT_DISABLE_FAST_PATH=1`` or :func:`ropekit.set_fast_path` turns plans off.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import Tensor

from ropekit import _config
from ropekit._memory import span_bytes
from ropekit._spec import (
    MAX_POSITION,
    TENSOR_ARGS,
    TENSOR_FIELDS,
    CacheArgs,
    Mode,
    NormSpec,
    RopeArgs,
    RopeSpec,
    needs_grad,
    to_canonical,
)
from ropekit._validation import validate_args, validate_kv_write, validate_norm
from ropekit.autograd import norm_rotate as norm_rotate_spec
from ropekit.autograd import rotate as rotate_spec
from ropekit.autograd import write_kv as write_kv_spec
from ropekit.ops import uses_kernels

_PLANS: OrderedDict = OrderedDict()
_MAX_PLANS = 1024
_SEEN: OrderedDict = OrderedDict()  # signatures seen once, not yet worth a plan
_MAX_SEEN = 1024
# Where RopeArgs' tensor fields sit in it (a call's key is built from its values in field order).
_TENSOR_SLOTS = tuple(sorted(RopeArgs._fields.index(name) for name in TENSOR_ARGS))
_POSITIONS_SLOT = RopeArgs._fields.index("positions")
# The public options each of the spec's tensors can be a view of.
_SOURCES = {"positions": ("positions",), "seq_offsets": ("positions",), "cu_seqlens": ("cu_seqlens",),
            "inv_freq": ("inv_freq",), "cos": ("cos", "angles"), "sin": ("sin",)}


def rotate(q: Tensor, k: Tensor | None, mode: Mode, args: RopeArgs):
    """A public call (``args``: its keywords, see :func:`ropekit.apply_rope`) on the ``"auto"`` backend:
    replay the plan of its signature, or validate, run and note the signature. Returns what the public function
    returns."""
    sig = None
    if _plans_apply() and not args.check_positions:
        plan, sig = _planned(_PLANS, signature(q, k, mode, args))
        if plan is not None:
            outs = plan(q, k, sig[1], args, mode)
            if outs is not None:
                return outs
            sig = None  # the plan exists; this call's offset or memory needed the full path
    spec = validate_args(q, k, args, mode)
    outs = rotate_spec(q, k, spec, mode.inplace)
    if sig is not None:
        _sighted(sig[0], q, k, args, spec, outs, mode)
    return outs[0] if k is None else outs


def _plans_apply() -> bool:
    """Whether calls look up and record plans: the fast path is on and torch.compile is not tracing. Traced code
    must not read the plan dicts at all: dynamo guards on a dict's keys, which change with every new signature
    (and some torch versions fail to build those guards for keys that hold None)."""
    return _config.fast_path and not torch.compiler.is_compiling()


def _planned(plans: OrderedDict, sig):
    """(the plan recorded for ``sig``'s key or None, ``sig``) -- ``sig`` None where there is none or its key is
    unhashable (the full path then names the argument)."""
    if sig is None:
        return None, None
    try:
        plan = plans.get(sig[0])
    except TypeError:
        return None, None
    if plan is not None:
        plans.move_to_end(sig[0])
    return plan, sig


def signature(q: Tensor, k: Tensor | None, mode: Mode, args: RopeArgs):
    """(key, handles) of a call, or None when the fast path does not apply: not a kernel call (CUDA, or CPU under
    ``kernels_on_cpu``; float64 runs the reference), tensor subclasses, in-place calls that need autograd. Never
    called while torch.compile traces (:func:`_plans_apply`).

    The handles are q's, k's and the tensor options' data pointers in that order (0 for an absent k) -- the
    tensors themselves on CPU, where the interpreter needs them. Calls that need autograd get keys (and plans) of
    their own."""
    if type(q) is not Tensor or (k is not None and type(k) is not Tensor) or not uses_kernels(q):
        return None
    grad = needs_grad(q, k)
    if grad and mode.inplace:  # in place with autograd: the full path (mark_dirty and its checks)
        return None
    raw = q.is_cuda
    p = q.data_ptr()
    handles = [p if raw else q]
    q_part = (q.shape, q.stride(), q.dtype, q.device, p & 15)
    if k is None:
        handles.append(0)
        k_part = None
    else:
        p = k.data_ptr()
        handles.append(p if raw else k)
        k_part = (k.shape, k.stride(), k.dtype, k.device, p & 15)
    values = list(args)  # in RopeArgs' field order
    for i in _TENSOR_SLOTS:
        v = values[i]
        if v is None:
            continue
        if type(v) is Tensor:
            p = v.data_ptr()
            handles.append(p if raw else v)
            values[i] = (v.shape, v.stride(), v.dtype, v.device, p & 15)
        elif isinstance(v, Tensor):  # a subclass: the full path
            return None
        elif i == _POSITIONS_SLOT:  # an int position offset is checked per call: its type is the key
            values[i] = type(v)
    parts = [mode, grad, q_part, k_part, *values]
    if mode.inplace:  # torch refuses in-place writes to inference tensors outside inference mode: so does the full path
        parts.append((q.is_inference(), k is not None and k.is_inference(), torch.is_inference_mode_enabled()))
    return tuple(parts), handles


def clear() -> None:
    """Forget every plan and sighting (tests; the plans hold no tensors of the calls that made them)."""
    _PLANS.clear()
    _SEEN.clear()
    _KV_PLANS.clear()
    _KV_SEEN.clear()
    _NORM_PLANS.clear()
    _NORM_SEEN.clear()


def _sighted(key, q, k, args, spec, outs, mode) -> None:
    """Note a signature's full-path call; on its second call, record its plan."""
    _note(_SEEN, key, lambda: _remember(key, q, k, args, spec, outs, mode))


class Plan:
    """The bound launch of one call signature and where each of the kernel's positions .. sin pointer slots comes
    from: an index into the call's handles (q's for an absent tensor, the launcher's dummy), or ``~j`` for the
    plan's own constant ``consts[j]`` (the cached default frequencies)."""

    __slots__ = ("launch", "slots", "consts", "const_handles", "int_offset", "max_offset", "q_out", "k_out",
                 "grad", "handle", "q_span", "k_span", "qk_delta", "saved")

    def __call__(self, q: Tensor, k: Tensor | None, handles: list, args: RopeArgs, mode: Mode):
        """Launch and return the outputs as the full path would, or None to send the call down the full path."""
        pos_offset = _checked_offset(args.positions, self.max_offset) if self.int_offset else 0
        if pos_offset == -1:
            return None
        const = self.const_handles
        tables = tuple(handles[i] if i >= 0 else const[~i] for i in self.slots)
        if self.grad:
            return PlannedRope.apply(q, k, self, tables, pos_offset, args, mode)
        if mode.inplace:
            q_h, k_h = handles[0], handles[1]
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
        return self.rotate(q, k, tables, pos_offset)

    def _disjoint(self, q: Tensor, k: Tensor) -> bool:
        """q and k of an in-place call occupy disjoint address ranges, or sit at the relative offset the full
        path proved safe when it recorded this plan (interleaved views of one packed buffer)."""
        qp, kp = q.data_ptr(), k.data_ptr()
        return kp >= qp + self.q_span or qp >= kp + self.k_span or kp - qp == self.qk_delta

    def rotate(self, q: Tensor, k: Tensor | None, tables: tuple, pos_offset: int):
        """Out-of-place rotation of ``q`` (and ``k``) with the bound launch; the outputs are fresh tensors."""
        q_out = torch.empty(self.q_out[0], dtype=self.q_out[1], device=q.device)
        q_h, qo_h = self.handle(q), self.handle(q_out)
        if k is None:  # the launcher passes q's pointers in k's slots
            self.launch(q_h, qo_h, q_h, qo_h, *tables, pos_offset)
            return q_out
        k_out = torch.empty(self.k_out[0], dtype=self.k_out[1], device=q.device)
        self.launch(q_h, qo_h, self.handle(k), self.handle(k_out), *tables, pos_offset)
        return q_out, k_out


class PlannedRope(torch.autograd.Function):
    """Eager autograd of a call replayed from a plan: the forward launches the plan's bound kernel; the backward
    is the conjugate rotation through :func:`rotate`. Gradients arrive in whatever layout autograd produced
    (transposed, expanded with zero strides, sliced): the kernel takes any strides but the last, so only a
    gradient whose last dimension is not contiguous is copied, exactly as for the full path."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor | None, plan: Plan, tables: tuple, pos_offset: int, args: RopeArgs,
                mode: Mode):
        ctx.args, ctx.mode = args, mode
        # what the full path saves (its spec's tensors), so that activation checkpointing's recomputation saves the
        # same whichever route it takes; the backward reads the args, the saved views give the version check
        ctx.save_for_backward(*spec_views(plan.saved, args))
        ctx.inputs = (q.shape, q.dtype, q.device), (None if k is None else (k.shape, k.dtype))
        return plan.rotate(q, k, tables, pos_offset)

    @staticmethod
    def backward(ctx, *grads):
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
        outs = rotate(gq, gk, ctx.mode.gradient(), ctx.args._replace(out_dtype=None))
        dq, dk = (outs, None) if k_info is None else outs
        dq = dq if dq.dtype == q_dtype else dq.to(q_dtype)
        if dk is not None and dk.dtype != k_info[1]:
            dk = dk.to(k_info[1])
        return dq, dk, None, None, None, None, None


def _remember(key, q: Tensor, k: Tensor | None, args: RopeArgs, spec: RopeSpec, outs: tuple, mode: Mode) -> None:
    """Keep a plan for ``key`` after a call of it ran the full path successfully with ``spec`` and produced
    ``outs``; skip signatures a plan cannot replay (a spec tensor that is a copy of the user's, not a view)."""
    from ropekit.triton.bound import bind_rope

    # The call's handle index of each tensor option, as signature() lays them out.
    handle_index = {}
    for name in TENSOR_ARGS:
        if isinstance(getattr(args, name), Tensor):
            handle_index[name] = 2 + len(handle_index)

    def source(field: str, t: Tensor | None) -> int | None:
        """Where the kernel's tensor ``t`` comes from in a call: q's handle for an absent one (the launcher's
        dummy), else the option it is a view of (same data pointer), else None (a copy: no plan)."""
        if t is None:
            return 0
        for name in _SOURCES[field]:
            arg = getattr(args, name)
            if isinstance(arg, Tensor) and arg.data_ptr() == t.data_ptr():
                return handle_index[name]
        return None

    consts = []
    slots = [source(field, t) for field, t in zip(TENSOR_FIELDS, spec.tensors)]
    for j, (field, t) in enumerate(zip(TENSOR_FIELDS, spec.tensors)):
        # Tensors validation takes from its caches, the same for every call of the signature: the default
        # frequencies of base=. The plan keeps them alive.
        if slots[j] is None and field == "inv_freq" and args.inv_freq is None:
            slots[j] = ~len(consts)
            consts.append(t)
    if any(s is None for s in slots):
        return
    saved = spec_recipe(spec, args)
    if saved is None:
        return
    q_out, k_out = outs
    launch = bind_rope(q, k, q_out, k_out, spec)
    if launch is None:
        return
    plan = Plan()
    plan.launch, plan.slots, plan.grad, plan.saved = launch, tuple(slots), key[1], saved
    # What the launch takes for a tensor: its address on CUDA (a C call, no Python frame), the tensor under the
    # interpreter.
    plan.handle = Tensor.data_ptr if q.is_cuda else _same
    plan.consts = tuple(consts)
    plan.const_handles = tuple(plan.handle(t) for t in consts)
    plan.int_offset = args.positions is not None and not isinstance(args.positions, Tensor)
    # The full path refuses offsets whose positions run past MAX_POSITION or a position-indexed table: replay
    # those bounds (with packed sequences, conservatively: S is at least the longest sequence).
    plan.max_offset = _offset_bound(spec, to_canonical(q, spec.layout).shape[1])
    plan.q_span = plan.k_span = plan.qk_delta = 0
    if mode.inplace and k is not None:  # the full path checked that q and k do not overlap at this relative offset
        plan.q_span, plan.k_span = span_bytes(q), span_bytes(k)
        plan.qk_delta = k.data_ptr() - q.data_ptr()
    plan.q_out = (q_out.shape, q_out.dtype)
    plan.k_out = (k_out.shape, k_out.dtype) if k_out is not None else None
    _keep(_PLANS, key, plan)


def _same(t: Tensor) -> Tensor:
    return t


def spec_recipe(spec: RopeSpec, args: RopeArgs) -> tuple | None:
    """How a replay rebuilds ``spec.tensors`` -- what the full path saves for its backward -- from a later call's
    args: per field None (absent), a tensor (a constant of the signature: the cached default frequencies), an
    argument's name (the argument itself), or (name, size, stride, storage-offset delta) for a view of it. None
    where a field is neither (a copy: no plan)."""
    recipe = []
    for field, t in zip(TENSOR_FIELDS, spec.tensors):
        if t is None:
            recipe.append(None)
            continue
        for name in _SOURCES[field]:
            arg = getattr(args, name)
            if isinstance(arg, Tensor) and arg.dtype == t.dtype and arg.data_ptr() == t.data_ptr():
                if arg.shape == t.shape and arg.stride() == t.stride():
                    recipe.append(name)
                else:
                    recipe.append((name, t.shape, t.stride(), t.storage_offset() - arg.storage_offset()))
                break
        else:
            if field != "inv_freq" or args.inv_freq is not None:
                return None
            recipe.append(t)  # base=: the cached default frequencies, the same tensor every call
    return tuple(recipe)


def spec_views(recipe: tuple, args: RopeArgs) -> list:
    """The tensors the full path would save for a call with ``args`` (:func:`spec_recipe`), so that both routes
    save the same number of tensors with the same metadata: activation checkpointing recomputes a forward by
    either route and compares what each saved."""
    views = []
    for r in recipe:
        if r is None or type(r) is Tensor:
            views.append(r)
        elif type(r) is str:
            views.append(getattr(args, r))
        else:
            name, size, stride, delta = r
            t = getattr(args, name)
            views.append(t.as_strided(size, stride, t.storage_offset() + delta))
    return views


def _offset_bound(spec: RopeSpec, seqlen: int) -> int:
    """The largest int position offset the full path accepts for a call of ``seqlen`` tokens per sequence: its
    positions stay within MAX_POSITION and within a position-indexed table (with packed sequences,
    conservatively: S is at least the longest sequence)."""
    bound = MAX_POSITION - max(seqlen, 1) + 1
    if spec.cos is not None and not spec.table_by_token and spec.positions is None and spec.seq_offsets is None:
        bound = min(bound, spec.cos.shape[1] - seqlen)
    return bound


def _checked_offset(positions, max_offset: int) -> int:
    """A call's int position offset, or -1 where the full path must check it (below 0 or past ``max_offset``)."""
    offset = int(positions)
    return offset if 0 <= offset <= max_offset else -1


def _note(seen: OrderedDict, key, record) -> None:
    """Note a signature's full-path call; on its second, ``record()`` (which keeps a plan, or not)."""
    if key in seen:
        del seen[key]
        record()
        return
    seen[key] = None
    if len(seen) > _MAX_SEEN:
        seen.popitem(last=False)


def _keep(plans: OrderedDict, key, plan, limit: int = _MAX_PLANS) -> None:
    """Keep ``plan`` (unless None) under ``key``, least recently used out beyond ``limit``."""
    if plan is None:
        return
    plans[key] = plan
    if len(plans) > limit:
        plans.popitem(last=False)



# --- rope_kv_write ---------------------------------------------------------------------------------------------
# The same scheme for the attention prologue's inference call: a plan per signature, recorded on its second call
# from the launch the full path made, replayed by filling the data pointers of the call's tensors.

_KV_PLANS: OrderedDict = OrderedDict()
_KV_SEEN: OrderedDict = OrderedDict()
# rope_kv_write's arguments that may be tensors, in the order a plan's sources index them (q_out comes last).
_KV_TENSORS = ("q", "k", "v", "k_cache", "v_cache", "positions", "slot_mapping", "q_weight", "k_weight",
               "k_cache_scale", "v_cache_scale", "inv_freq", "cos", "sin", "angles")


class KvCall(NamedTuple):
    """One rope_kv_write call, as the public function bundles it."""

    q: Tensor
    k: Tensor
    cache: CacheArgs
    norm: NormSpec
    args: RopeArgs

    def values(self) -> tuple:
        """The call's possible tensors in ``_KV_TENSORS`` order, and its other arguments."""
        c, n, a = self.cache, self.norm, self.args
        tensors = (self.q, self.k, c.v, c.k_cache, c.v_cache, a.positions, c.slot_mapping, n.q_weight, n.k_weight,
                   c.k_cache_scale, c.v_cache_scale, a.inv_freq, a.cos, a.sin, a.angles)
        return tensors, (c.cache_layout, n.weight_offset, n.eps, *_rope_scalars(a))


def write_kv(q: Tensor, k: Tensor, cache: CacheArgs, norm: NormSpec, args: RopeArgs) -> Tensor:
    """:func:`ropekit.rope_kv_write` (its arguments bundled): replay the plan of the call's signature, or validate,
    run and note the signature."""
    call = KvCall(q, k, cache, norm, args)
    if not (_plans_apply() and not args.check_positions and args.cu_seqlens is None):
        return _write_kv_full(call, None, None)
    return _prologue_call(_KV_PLANS, _kv_signature(call), call, _write_kv_full)


def _rope_scalars(args: RopeArgs) -> tuple:
    """``args``' fields that are never tensors, as a hashable part of a key (``sections`` as a tuple)."""
    return tuple(tuple(v) if type(v) is list else v for n, v in zip(RopeArgs._fields, args) if n not in TENSOR_ARGS)


@contextlib.contextmanager
def _recording():
    """Within the block (on this thread) the prologue's launchers record their launches in the yielded list, which
    holds the call's tensors: dropped on the way out."""
    from ropekit.triton import prologue

    launches = []
    prologue.RECORDER.launches = launches
    try:
        yield launches
    finally:
        prologue.RECORDER.launches = None


def _prologue_call(plans: OrderedDict, sig, call, full):
    """A prologue call (rope_kv_write, qk_norm_rope): replay the plan of ``sig`` (the call's signature, or None
    where plans do not apply), else ``full(call, sig)``, recording its launch while ``sig`` may get a plan."""
    plan, sig = _planned(plans, sig)
    if plan is not None:
        out = plan(sig[1], call)
        if out is not None:
            return out
        sig = None  # this call's position offset or memory placement needs the full path's checks
    if sig is None:
        return full(call, None, None)
    with _recording() as launches:
        return full(call, sig, launches)


def _write_kv_full(call: KvCall, sig, launches: list | None) -> Tensor:
    """The full path of :func:`write_kv`: validate, run, and note ``sig`` (None: not planned) with the launches
    it made (``launches``)."""
    q4, k4, v4, rope_args, cache = validate_kv_write(call.q, call.k, call.cache, call.args)
    spec = validate_args(q4, k4, rope_args)
    norm = validate_norm(call.q, call.k, call.norm, required=False) or NormSpec(None, None)
    q_out = write_kv_spec(q4, k4, v4, norm, spec, cache)
    out = q_out.view(call.q.shape) if call.q.dim() == 3 else q_out
    if sig is not None:
        _kv_sighted(sig, call, q_out, out, to_canonical(q4, rope_args.layout).shape[1], cache, launches)
    return out


def _call_signature(values: tuple, names: tuple, scalars: tuple, grad_ok: bool):
    """(key, tensors) of a call whose possible tensors are ``values`` (named ``names``, in that order) and whose
    other arguments are ``scalars``, or None where plans do not apply (not a kernel call, tensor subclasses, or --
    unless ``grad_ok`` -- autograd; never called while tracing, see :func:`_plans_apply`). ``tensors``: ``values``
    with None where absent or not a tensor. The key holds every tensor's shape, strides, dtype, device and
    alignment, which of them share a data pointer, whether autograd records the call, and every other argument's
    value (an int position offset by its type)."""
    q = values[0]
    if type(q) is not Tensor or not uses_kernels(q):
        return None
    tensors, parts, ptrs = [], [], []
    grad = False
    for name, t in zip(names, values):
        if not isinstance(t, Tensor):
            tensors.append(None)
            parts.append(type(t) if name == "positions" else t)  # absent, a float scale, or an int offset's type
            continue
        if type(t) is not Tensor and type(t) is not torch.nn.Parameter:
            return None  # subclasses (a Parameter is a plain tensor to torch functions: its override is disabled)
        if t.requires_grad and torch.is_grad_enabled():
            if not grad_ok:
                return None  # the full path refuses the call
            grad = True
        p = t.data_ptr()
        tensors.append(t)
        parts.append((t.shape, t.stride(), t.dtype, t.device, p & 15))
        ptrs.append(p)
    aliasing = tuple(ptrs.index(p) for p in ptrs)  # a call whose tensors alias differently gets its own plan
    return (tuple(parts), aliasing, scalars, grad), tensors


def _kv_signature(call: KvCall):
    """:func:`_call_signature` of a rope_kv_write call (``_KV_TENSORS``; no autograd), with whether its caches are
    inference tensors, whose writes the full path refuses outside inference mode."""
    values, scalars = call.values()
    sig = _call_signature(values, _KV_TENSORS, scalars, grad_ok=False)
    if sig is None:
        return None
    key, tensors = sig
    inference = (*(c.is_inference() for c in tensors[3:5] if c is not None), torch.is_inference_mode_enabled())
    return (key, inference), tensors


def _kv_sighted(sig, call: KvCall, q_out: Tensor, out: Tensor, seqlen: int, cache, launches: list) -> None:
    def record():
        _keep(_KV_PLANS, sig[0], KvPlan.record(sig[1], call, q_out, out, seqlen, cache, launches))

    _note(_KV_SEEN, sig[0], record)


class _Replay:
    """A prologue-kernel launch the full path made (recorded by :func:`_recording`), replayed with a later call's
    tensors: each pointer argument is refilled from the call's tensors (the index, in ``sources``, of the one it
    pointed at when recorded), allocated afresh per call (``scratch``: arguments the launcher allocates itself, by
    name), or kept (the default frequencies of ``base=``, which validation caches). Everything else is the recorded
    value, which the call's signature fixes."""

    __slots__ = ("grid", "args", "slots", "scratch", "consts", "constexprs", "num_warps", "roles", "compiled",
                 "device_index")

    @classmethod
    def record(cls, launch: tuple, sources: list, keep_freq: bool, scratch: tuple = ()):
        """The replay of ``launch`` (grid, args, constexprs, num_warps, roles, device), or None where a pointer
        argument is a copy validation made of a call's tensor (no later call could refill it)."""
        grid, args, constexprs, num_warps, roles, device = launch
        by_ptr = {}
        for j, t in enumerate(sources):
            if t is not None:
                by_ptr.setdefault(t.data_ptr(), j)
        r = cls()
        r.args = list(args)
        slots, r.scratch = [], []
        for i in roles.pointers:
            name = roles.fn.arg_names[i]
            if name in scratch:
                r.scratch.append((i, tuple(args[i].shape), args[i].dtype))
                r.args[i] = None
                continue
            j = by_ptr.get(args[i].data_ptr())
            if j is not None:
                slots.append((i, j))
                r.args[i] = None
            elif not (keep_freq and name == "freq_ptr" and args[i] is not None and args[i].dim() == 1):
                return None
        r.slots, r.scratch = tuple(slots), tuple(r.scratch)
        # the constants' tensors stay alive with the replay (on CUDA its arguments hold their addresses only)
        r.consts = tuple(a for i, a in enumerate(r.args) if i in roles.pointers and a is not None)
        r.grid, r.constexprs, r.num_warps, r.roles = grid, constexprs, num_warps, roles
        r.compiled = r.device_index = None
        if device.type == "cuda":
            from ropekit.triton import launcher

            r.device_index = device.index if device.index is not None else torch.cuda.current_device()
            r.compiled = launcher._COMPILED.get(roles.key(args, constexprs, num_warps, device.index))
            if r.compiled is None:
                return None
            r.args = [a.data_ptr() if isinstance(a, Tensor) else a for a in r.args]
        return r

    def __call__(self, sources: list, pos_offset: int | None = None) -> list:
        """Launch with ``sources`` (and this call's int position offset, where the signature has one); returns the
        scratch tensors it allocated."""
        from ropekit.triton import launcher

        args = self.args.copy()
        if pos_offset is not None:
            args[self.roles.index["pos_offset"]] = pos_offset
        device = sources[0].device
        scratch = [torch.empty(shape, dtype=dtype, device=device) for _, shape, dtype in self.scratch]
        cuda = self.compiled is not None
        for i, j in self.slots:
            args[i] = sources[j].data_ptr() if cuda else sources[j]
        for (i, _, _), t in zip(self.scratch, scratch):
            args[i] = t.data_ptr() if cuda else t
        if not cuda:  # the interpreter: the launcher's own CPU path
            launcher._launch(self.grid, args, self.constexprs, self.num_warps, device, self.roles)
        elif launcher._current_device() != self.device_index:
            with torch.cuda.device(self.device_index):
                launcher._run_compiled(self.compiled, self.grid, args, self.constexprs, self.device_index)
        else:
            launcher._run_compiled(self.compiled, self.grid, args, self.constexprs, self.device_index)
        return scratch


class KvPlan:
    """The prologue kernel's launch for one rope_kv_write signature (:class:`_Replay`, whose sources are the call's
    tensors in ``_KV_TENSORS`` order and then the fresh q output), with the checks a replay repeats per call."""

    __slots__ = ("replay", "q_out", "out_shape", "int_offset", "max_offset", "kv_spans", "input_spans")

    @classmethod
    def record(cls, tensors: list, call: KvCall, q_out: Tensor, out: Tensor, seqlen: int, cache, launch: list):
        """A plan from the full path's launch (``launch``: what ``launch_prologue`` recorded), or None where a
        kernel argument is a copy of a call's tensor rather than a view of it."""
        if len(launch) != 1:
            return None
        plan = cls()
        plan.replay = _Replay.record(launch[0], [*tensors, q_out], call.args.inv_freq is None)
        if plan.replay is None:
            return None
        roles, constexprs, args = plan.replay.roles, plan.replay.constexprs, launch[0][1]
        plan.q_out = (q_out.shape, q_out.dtype)
        plan.out_shape = out.shape
        plan.int_offset = not isinstance(call.args.positions, Tensor)
        if plan.int_offset:  # refilled and bounds-checked per call
            rows = cache.rows if not cache.paged else MAX_POSITION + 1
            plan.max_offset = min(MAX_POSITION, rows - 1) - max(seqlen, 1) + 1
            const = dict(zip(roles.constexprs, constexprs))
            if const["FREQ_MODE"] in (1, 2) and not const["TABLE_BY_TOKEN"]:  # a table indexed by position
                plan.max_offset = min(plan.max_offset, args[roles.index["table_rows"]] - max(seqlen, 1))
        # the full path proved the caches disjoint at this relative offset (or as disjoint address ranges), and
        # each cache disjoint from q, k and v
        kc, vc = call.cache.k_cache, call.cache.v_cache
        plan.kv_spans = (span_bytes(kc), span_bytes(vc), vc.data_ptr() - kc.data_ptr())
        plan.input_spans = tuple(span_bytes(x) for x in (call.q, call.k, call.cache.v))
        return plan

    def _inputs_outside_caches(self, tensors: list) -> bool:
        """q, k and v lie outside both caches' address ranges (else the full path decides exactly)."""
        k_span, v_span, _ = self.kv_spans
        caches = ((tensors[3].data_ptr(), k_span), (tensors[4].data_ptr(), v_span))
        for x, span in zip(tensors[:3], self.input_spans):
            xp = x.data_ptr()
            for cp, c_span in caches:
                if not (xp >= cp + c_span or cp >= xp + span):
                    return False
        return True

    def _caches_disjoint(self, kc: Tensor, vc: Tensor) -> bool:
        k_span, v_span, delta = self.kv_spans
        kp, vp = kc.data_ptr(), vc.data_ptr()
        return vp >= kp + k_span or kp >= vp + v_span or vp - kp == delta

    def __call__(self, tensors: list, call: KvCall):
        offset = _checked_offset(call.args.positions, self.max_offset) if self.int_offset else None
        if offset == -1:
            return None
        if not self._caches_disjoint(tensors[3], tensors[4]) or not self._inputs_outside_caches(tensors):
            return None  # the full path decides (and raises where they overlap)
        q_out = torch.empty(self.q_out[0], dtype=self.q_out[1], device=tensors[0].device)
        self.replay([*tensors, q_out], offset)
        for cache in tensors[3:5]:  # the kernel's writes, declared to autograd as the full path does
            torch.autograd.graph.increment_version(cache)
        return q_out.view(self.out_shape)


# --- qk_norm_rope --------------------------------------------------------------------------------------------
# The same scheme for norm + RoPE, autograd included: the forward's plan is recorded on a signature's second call
# from the launch the full path made; a planned call that needs gradients runs through PlannedNormRope, whose
# backward replays, per layout of the incoming gradients, the backward launch its first full-path backward made.

_NORM_PLANS: OrderedDict = OrderedDict()
_NORM_SEEN: OrderedDict = OrderedDict()
# qk_norm_rope's arguments that may be tensors, in the order a plan's sources index them (then the fresh outputs).
_NORM_TENSORS = ("q", "k", "q_weight", "k_weight", *TENSOR_ARGS)
_MAX_BACKWARDS = 8  # gradient layouts kept per plan


class NormCall(NamedTuple):
    """One qk_norm_rope call, as the public function bundles it."""

    q: Tensor
    k: Tensor
    norm: NormSpec
    args: RopeArgs

    def values(self) -> tuple:
        """The call's possible tensors in ``_NORM_TENSORS`` order, and its other arguments."""
        n, a = self.norm, self.args
        tensors = (self.q, self.k, n.q_weight, n.k_weight, *(getattr(a, name) for name in TENSOR_ARGS))
        return tensors, (n.weight_offset, n.eps, *_rope_scalars(a))


def norm_rotate(q: Tensor, k: Tensor, norm: NormSpec, args: RopeArgs) -> tuple:
    """:func:`ropekit.qk_norm_rope` (its arguments bundled): replay the plan of the call's signature, or validate,
    run and note the signature."""
    call = NormCall(q, k, norm, args)
    if not (_plans_apply() and not args.check_positions):
        return _norm_full(call, None, None)
    values, scalars = call.values()
    return _prologue_call(_NORM_PLANS, _call_signature(values, _NORM_TENSORS, scalars, grad_ok=True), call,
                          _norm_full)


def _norm_full(call: NormCall, sig, launches: list | None) -> tuple:
    """The full path of :func:`norm_rotate`: validate, run, and note ``sig`` (None: not planned) with the launches
    it made (``launches``)."""
    q, k = call.q, call.k
    spec = validate_args(q, k, call.args)
    if k is None:
        raise TypeError("qk_norm_rope needs k (use apply_rope on a normalised q alone)")
    norm = validate_norm(q, k, call.norm, required=True)
    outs = norm_rotate_spec(q, k, norm, spec)
    if sig is not None:
        _note(_NORM_SEEN, sig[0], lambda: _keep(_NORM_PLANS, sig[0], NormPlan.record(sig, call, spec, outs,
                                                                                      launches)))
    return outs


def _layout(t: Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.data_ptr() & 15


class NormPlan:
    """The forward launch of one qk_norm_rope signature (:class:`_Replay`; sources: the call's tensors in
    ``_NORM_TENSORS`` order, then the fresh q and k outputs) and, per layout of the backward's tensors, the
    backward's (sources: the two gradients, the call's tensors, then the fresh dq and dk; its partial weight-
    gradient rows allocated per call). ``saved``: :func:`spec_recipe` of the forward's spec (what the full path
    saves for the backward besides q, k and the weights)."""

    __slots__ = ("forward", "outs", "int_offset", "max_offset", "grad", "keep_freq", "saved", "backwards")

    @classmethod
    def record(cls, sig, call: NormCall, spec: RopeSpec, outs: tuple, launches: list):
        if len(launches) != 1:
            return None
        key, tensors = sig
        plan = cls()
        plan.keep_freq = call.args.inv_freq is None
        plan.forward = _Replay.record(launches[0], [*tensors, *outs], plan.keep_freq)
        if plan.forward is None:
            return None
        plan.outs = tuple((o.shape, o.dtype) for o in outs)
        plan.grad = key[3]
        plan.saved = spec_recipe(spec, call.args)
        if plan.saved is None:
            return None
        positions = call.args.positions
        plan.int_offset = positions is not None and not isinstance(positions, Tensor)
        if plan.int_offset:  # refilled and bounds-checked per call
            plan.max_offset = _offset_bound(spec, to_canonical(tensors[0], spec.layout).shape[1])
        plan.backwards = OrderedDict()
        return plan

    def __call__(self, tensors: list, call: NormCall):
        """The call's (q_out, k_out), or None to send it down the full path."""
        offset = _checked_offset(call.args.positions, self.max_offset) if self.int_offset else None
        if offset == -1:
            return None
        if self.grad:
            return PlannedNormRope.apply(*tensors[:4], self, tensors, offset, call)
        return self.run(tensors, offset)

    def run(self, tensors: list, offset: int | None) -> tuple:
        device = tensors[0].device
        outs = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.outs)
        self.forward([*tensors, *outs], offset)
        return outs

    def grads(self, grad_q: Tensor, grad_k: Tensor, tensors: list, offset: int | None, call: NormCall) -> tuple:
        """(dq, dk, dq_weight, dk_weight) of a planned call (gradients with a contiguous last dim), by the replay
        recorded for this layout of the gradients and of the saved tensors (which saved-tensor hooks may have
        changed since the forward), or by the full path, which records it."""
        sources = [grad_q, grad_k, *tensors]
        present = [t for t in sources if t is not None]
        ptrs = [t.data_ptr() for t in present]
        key = (tuple(_layout(t) for t in present), tuple(ptrs.index(p) for p in ptrs))
        q, k, q_weight, k_weight = tensors[:4]
        replay = self.backwards.get(key)
        if replay is not None:
            dq, dk = torch.empty_like(q), torch.empty_like(k)
            dwq, dwk = replay([*sources, dq, dk], offset)
            return dq, dk, dwq.sum(0).to(q_weight.dtype), dwk.sum(0).to(k_weight.dtype)
        from ropekit import ops

        spec = validate_args(q, k, call.args)
        with _recording() as launches:
            grads = ops.norm_rope_grads(grad_q, grad_k, q, k, q_weight, k_weight, float(call.norm.weight_offset),
                                        float(call.norm.eps), spec)
            if len(launches) == 1:
                _keep(self.backwards, key, _Replay.record(launches[0], [*sources, *grads[:2]], self.keep_freq,
                                                          scratch=("dwq_ptr", "dwk_ptr")), _MAX_BACKWARDS)
        return tuple(grads)


class PlannedNormRope(torch.autograd.Function):
    """Eager autograd of a qk_norm_rope call replayed from a plan, as :class:`ropekit.autograd.EagerNormRope` is of
    the full path: the same kernels, and the same tensors saved (q, k, the weights and the spec's tensors), so
    in-place changes before the backward raise as there, and saved-tensor hooks (activation checkpointing,
    offloading) see the same tensors whichever route a call takes."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, plan: NormPlan, tensors: list, offset: int | None, call: NormCall):
        ctx.plan, ctx.offset = plan, offset
        # the rest of the call as it was (q, k and the weights come back from the saved tensors: holding them here
        # would keep checkpointed activations alive)
        ctx.call = call._replace(q=None, k=None, norm=call.norm._replace(q_weight=None, k_weight=None))
        # what EagerNormRope saves (q, k, the weights, the spec's tensors), so that activation checkpointing's
        # recomputation saves the same whichever route it takes
        ctx.save_for_backward(q, k, q_weight, k_weight, *spec_views(plan.saved, call.args))
        return plan.run(tensors, offset)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        plan = ctx.plan
        q, k, q_weight, k_weight = ctx.saved_tensors[:4]  # raises if a saved tensor was modified in place
        call = ctx.call._replace(q=q, k=k, norm=ctx.call.norm._replace(q_weight=q_weight, k_weight=k_weight))
        tensors = [t if isinstance(t, Tensor) else None for t in call.values()[0]]
        grad_q = torch.zeros_like(q) if grad_q is None else grad_q
        grad_k = torch.zeros_like(k) if grad_k is None else grad_k
        # the kernel takes any strides but the last
        grad_q = grad_q if grad_q.stride(-1) == 1 else grad_q.contiguous()
        grad_k = grad_k if grad_k.stride(-1) == 1 else grad_k.contiguous()
        if torch.is_grad_enabled():  # a differentiable backward: the registered op, as the full path takes it
            from ropekit import ops

            grads = ops.qk_norm_rope_backward(grad_q, grad_k, q, k, q_weight, k_weight,
                                              float(call.norm.weight_offset), float(call.norm.eps),
                                              *validate_args(q, k, call.args))
        else:
            grads = plan.grads(grad_q, grad_k, tensors, ctx.offset, call)
        return (*grads, None, None, None, None)
