"""Eager fast path: a launch plan per call signature, so a repeated call costs a dictionary lookup and a launch.

A call's *signature* is everything validation and the kernel's specialisation depend on: every argument's type,
shape, strides, dtype, device and 16-byte alignment, and every other option, but not data pointers or an int
position offset. The first call of a signature goes through the full path (:func:`ropekit._spec.validate`,
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

The same code runs on CPU tensors under :func:`ropekit.testing.kernels_on_cpu` (the Triton interpreter), with
tensors instead of integer addresses as the kernel's pointer arguments, so CPU-only CI tests the fast path
against the full path. ``ROPEKIT_DISABLE_FAST_PATH=1`` or :func:`ropekit.set_fast_path` turns plans off.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict

import torch
from torch import Tensor

from ropekit import _config
from ropekit._memory import span_bytes
from ropekit._spec import (
    MAX_POSITION,
    TENSOR_FIELDS,
    Mode,
    RopeSpec,
    needs_grad,
    to_canonical,
    validate,
    validate_kv_write,
    validate_norm_weights,
)
from ropekit.autograd import rotate as rotate_spec
from ropekit.autograd import write_kv as write_kv_spec
from ropekit.ops import uses_kernels

_PLANS: OrderedDict = OrderedDict()
_MAX_PLANS = 1024
_SEEN: OrderedDict = OrderedDict()  # signatures seen once, not yet worth a plan
_MAX_SEEN = 1024
# The public options, in the order of the public signature (and of validate's keywords, which a test holds the
# public functions to); the ones that may be tensors, and where they sit.
_OPTIONS = tuple(name for name in inspect.signature(validate).parameters if name not in ("q", "k", "mode"))
_TENSOR_OPTIONS = ("positions", "inv_freq", "cos", "sin", "angles", "cu_seqlens")
_TENSOR_SLOTS = tuple(sorted(_OPTIONS.index(name) for name in _TENSOR_OPTIONS))
_POSITIONS_SLOT = _OPTIONS.index("positions")
# The public options each of the spec's tensors can be a view of.
_SOURCES = {"positions": ("positions",), "seq_offsets": ("positions",), "cu_seqlens": ("cu_seqlens",),
            "inv_freq": ("inv_freq",), "cos": ("cos", "angles"), "sin": ("sin",)}


def rotate(q: Tensor, k: Tensor | None, mode: Mode, options: dict):
    """A public call (``options``: its keywords, see :func:`ropekit.apply_rope`) on the ``"auto"`` backend:
    replay the plan of its signature, or validate, run and note the signature. Returns what the public function
    returns."""
    sig = None
    if _config.fast_path and not options["check_positions"]:
        plan, sig = _planned(_PLANS, signature(q, k, mode, options))
        if plan is not None:
            outs = plan(q, k, sig[1], options, mode)
            if outs is not None:
                return outs
            sig = None  # the plan exists; this call's offset or memory needed the full path
    spec = validate(q, k, mode=mode, **options)
    outs = rotate_spec(q, k, spec, mode.inplace)
    if sig is not None:
        _sighted(sig[0], q, k, options, spec, outs, mode)
    return outs[0] if k is None else outs


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


def signature(q: Tensor, k: Tensor | None, mode: Mode, options: dict):
    """(key, handles) of a call, or None when the fast path does not apply: not a kernel call (CUDA, or CPU under
    ``kernels_on_cpu``; float64 runs the reference), tensor subclasses, tracing, in-place calls that need autograd.

    The handles are q's, k's and the tensor options' data pointers in that order (0 for an absent k) -- the
    tensors themselves on CPU, where the interpreter needs them. Calls that need autograd get keys (and plans) of
    their own."""
    if type(q) is not Tensor or (k is not None and type(k) is not Tensor) or not uses_kernels(q):
        return None
    if torch.compiler.is_compiling():
        return None
    grad = needs_grad(q, k)
    if grad and mode.inplace:  # in place with autograd: the full path (mark_dirty and its checks)
        return None
    raw = q.is_cuda
    p = q.data_ptr()
    handles = [p if raw else q]
    q_part = (q.shape, q.stride(), q.dtype, q.get_device(), p & 15)
    if k is None:
        handles.append(0)
        k_part = None
    else:
        p = k.data_ptr()
        handles.append(p if raw else k)
        k_part = (k.shape, k.stride(), k.dtype, k.get_device(), p & 15)
    values = list(options.values())  # in the order of _OPTIONS (the public signature's)
    for i in _TENSOR_SLOTS:
        v = values[i]
        if v is None:
            continue
        if type(v) is Tensor:
            p = v.data_ptr()
            handles.append(p if raw else v)
            values[i] = (v.shape, v.stride(), v.dtype, v.get_device(), p & 15)
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


def _sighted(key, q, k, options, spec, outs, mode) -> None:
    """Note a signature's full-path call; on its second call, record its plan."""
    if key in _SEEN:
        del _SEEN[key]
        _remember(key, q, k, options, spec, outs, mode)
        return
    _SEEN[key] = None
    if len(_SEEN) > _MAX_SEEN:
        _SEEN.popitem(last=False)


class Plan:
    """The bound launch of one call signature and where each of the kernel's positions .. sin pointer slots comes
    from: an index into the call's handles (q's for an absent tensor, the launcher's dummy), or ``~j`` for the
    plan's own constant ``consts[j]`` (the cached default frequencies)."""

    __slots__ = ("launch", "slots", "consts", "const_handles", "int_offset", "max_offset", "q_out", "k_out",
                 "grad", "handle", "q_span", "k_span", "qk_delta")

    def __call__(self, q: Tensor, k: Tensor | None, handles: list, options: dict, mode: Mode):
        """Launch and return the outputs as the full path would, or None to send the call down the full path."""
        pos_offset = 0
        if self.int_offset:
            pos_offset = int(options["positions"])
            if not 0 <= pos_offset <= self.max_offset:
                return None
        const = self.const_handles
        tables = tuple(handles[i] if i >= 0 else const[~i] for i in self.slots)
        if self.grad:
            return PlannedRope.apply(q, k, self, tables, pos_offset, options, mode)
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
    def forward(ctx, q: Tensor, k: Tensor | None, plan: Plan, tables: tuple, pos_offset: int, options: dict,
                mode: Mode):
        ctx.options, ctx.mode = options, mode
        ctx.save_for_backward(*[options[n] for n in _TENSOR_OPTIONS if isinstance(options[n], Tensor)])  # version check
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
        outs = rotate(gq, gk, ctx.mode.gradient(), dict(ctx.options, out_dtype=None))
        dq, dk = (outs, None) if k_info is None else outs
        dq = dq if dq.dtype == q_dtype else dq.to(q_dtype)
        if dk is not None and dk.dtype != k_info[1]:
            dk = dk.to(k_info[1])
        return dq, dk, None, None, None, None, None


def _remember(key, q: Tensor, k: Tensor | None, options: dict, spec: RopeSpec, outs: tuple, mode: Mode) -> None:
    """Keep a plan for ``key`` after a call of it ran the full path successfully with ``spec`` and produced
    ``outs``; skip signatures a plan cannot replay (a spec tensor that is a copy of the user's, not a view)."""
    from ropekit.triton.bound import bind_rope

    # The call's handle index of each tensor option, as signature() lays them out.
    handle_index = {}
    for name in _TENSOR_OPTIONS:
        if isinstance(options[name], Tensor):
            handle_index[name] = 2 + len(handle_index)

    def source(field: str, t: Tensor | None) -> int | None:
        """Where the kernel's tensor ``t`` comes from in a call: q's handle for an absent one (the launcher's
        dummy), else the option it is a view of (same data pointer), else None (a copy: no plan)."""
        if t is None:
            return 0
        for name in _SOURCES[field]:
            arg = options[name]
            if isinstance(arg, Tensor) and arg.data_ptr() == t.data_ptr():
                return handle_index[name]
        return None

    consts = []
    slots = [source(field, t) for field, t in zip(TENSOR_FIELDS, spec.tensors)]
    for j, (field, t) in enumerate(zip(TENSOR_FIELDS, spec.tensors)):
        # Tensors validation takes from its caches, the same for every call of the signature: the default
        # frequencies of base=. The plan keeps them alive.
        if slots[j] is None and field == "inv_freq" and options["inv_freq"] is None:
            slots[j] = ~len(consts)
            consts.append(t)
    if any(s is None for s in slots):
        return
    q_out, k_out = outs
    launch = bind_rope(q, k, q_out, k_out, spec)
    if launch is None:
        return
    plan = Plan()
    plan.launch, plan.slots, plan.grad = launch, tuple(slots), key[1]
    # What the launch takes for a tensor: its address on CUDA (a C call, no Python frame), the tensor under the
    # interpreter.
    plan.handle = Tensor.data_ptr if q.is_cuda else _same
    plan.consts = tuple(consts)
    plan.const_handles = tuple(plan.handle(t) for t in consts)
    positions = options["positions"]
    plan.int_offset = positions is not None and not isinstance(positions, Tensor)
    # The full path refuses offsets whose positions run past MAX_POSITION or a position-indexed table: replay
    # those bounds (with packed sequences, conservatively: S is at least the longest sequence).
    seqlen = to_canonical(q, spec.layout).shape[1]
    max_offset = MAX_POSITION - max(seqlen, 1) + 1
    if spec.cos is not None and not spec.table_by_token and spec.positions is None and spec.seq_offsets is None:
        max_offset = min(max_offset, spec.cos.shape[1] - seqlen)
    plan.max_offset = max_offset
    plan.q_span = plan.k_span = plan.qk_delta = 0
    if mode.inplace and k is not None:  # the full path checked that q and k do not overlap at this relative offset
        plan.q_span, plan.k_span = span_bytes(q), span_bytes(k)
        plan.qk_delta = k.data_ptr() - q.data_ptr()
    plan.q_out = (q_out.shape, q_out.dtype)
    plan.k_out = (k_out.shape, k_out.dtype) if k_out is not None else None
    _PLANS[key] = plan
    if len(_PLANS) > _MAX_PLANS:  # least recently used out
        _PLANS.popitem(last=False)


def _same(t: Tensor) -> Tensor:
    return t



# --- rope_kv_write ---------------------------------------------------------------------------------------------
# The same scheme for the attention prologue's inference call: a plan per signature, recorded on its second call
# from the launch the full path made, replayed by filling the data pointers of the call's tensors.

_KV_PLANS: OrderedDict = OrderedDict()
_KV_SEEN: OrderedDict = OrderedDict()
# rope_kv_write's options that may be tensors, in the order a plan's sources index them (q_out comes last).
_KV_TENSORS = ("q", "k", "v", "k_cache", "v_cache", "positions", "slot_mapping", "q_weight", "k_weight",
               "k_cache_scale", "v_cache_scale", "inv_freq", "cos", "sin", "angles")


def write_kv(options: dict) -> Tensor:
    """:func:`ropekit.rope_kv_write` (``options``: its arguments by name): replay the plan of the call's signature,
    or validate, run and note the signature."""
    sig = None
    if _config.fast_path and not options["check_positions"] and options["cu_seqlens"] is None:
        plan, sig = _planned(_KV_PLANS, _kv_signature(options))
        if plan is not None:
            out = plan(sig[1], options)
            if out is not None:
                return out
            sig = None  # this call's position offset or cache placement needs the full path's checks
    if sig is None:
        return _write_kv_full(options, None)
    from ropekit.triton import prologue

    prologue.LAST_LAUNCH.clear()
    prologue.RECORD_LAUNCH = True
    try:
        return _write_kv_full(options, sig)
    finally:  # the launch holds the call's tensors (caches included): drop it once recorded or not needed
        prologue.RECORD_LAUNCH = False
        prologue.LAST_LAUNCH.clear()


def _write_kv_full(options: dict, sig) -> Tensor:
    """The full path of :func:`write_kv`: validate, run, and note ``sig`` (None: not planned)."""
    o = options
    q4, k4, v4, pos4, layout, cache = validate_kv_write(
        o["q"], o["k"], o["v"], o["k_cache"], o["v_cache"], o["positions"], o["slot_mapping"], o["cache_layout"],
        o["k_cache_scale"], o["v_cache_scale"], o["cu_seqlens"], o["layout"], o["sections"], o["check_positions"])
    spec = validate(q4, k4, positions=pos4, inv_freq=o["inv_freq"], base=o["base"], cos=o["cos"], sin=o["sin"],
                    angles=o["angles"], style=o["style"], layout=layout, rotary_dim=o["rotary_dim"],
                    rotary_at=o["rotary_at"], q_scale=o["q_scale"], k_scale=o["k_scale"],
                    rotary_scale=o["rotary_scale"], cu_seqlens=o["cu_seqlens"] if layout == "thd" else None,
                    sections=o["sections"], section_layout=o["section_layout"], check_positions=o["check_positions"])
    validate_norm_weights(o["q"], o["k"], o["q_weight"], o["k_weight"], o["eps"], o["weight_offset"], required=False)
    q_out = write_kv_spec(q4, k4, v4, o["q_weight"], o["k_weight"], float(o["weight_offset"]), float(o["eps"]), spec,
                          cache)
    out = q_out.view(o["q"].shape) if o["q"].dim() == 3 else q_out
    if sig is not None:
        _kv_sighted(sig, options, q_out, out, to_canonical(q4, layout).shape[1], cache)
    return out


def _kv_signature(options: dict):
    """(key, tensors) of a rope_kv_write call, or None where plans do not apply (not a kernel call, tracing,
    tensor subclasses, autograd). ``tensors``: the call's tensor options in ``_KV_TENSORS`` order (None where
    absent). The key holds every tensor's shape, strides, dtype, device and alignment, which of them share a data
    pointer, and every other option's value (an int position offset by its type)."""
    q = options["q"]
    if type(q) is not Tensor or not uses_kernels(q) or torch.compiler.is_compiling():
        return None
    tensors, parts, ptrs = [], [], []
    for name in _KV_TENSORS:
        t = options[name]
        if t is None or not isinstance(t, Tensor):
            tensors.append(None)
            continue
        if type(t) is not Tensor or (t.requires_grad and torch.is_grad_enabled()):
            return None  # subclasses, and calls the full path refuses for autograd
        p = t.data_ptr()
        tensors.append(t)
        parts.append((name, t.shape, t.stride(), t.dtype, t.get_device(), p & 15))
        ptrs.append(p)
    aliasing = tuple(ptrs.index(p) for p in ptrs)  # a call whose tensors alias differently gets its own plan
    scalars = tuple((n, type(v) if n == "positions" else v) for n, v in options.items()
                    if n not in _KV_TENSORS or not isinstance(v, Tensor))
    # writing inference-tensor caches is refused outside inference mode by the full path: part of the key
    inference = (*(c.is_inference() for c in tensors[3:5] if c is not None), torch.is_inference_mode_enabled())
    return (tuple(parts), aliasing, scalars, inference), tensors


def _kv_sighted(sig, options: dict, q_out: Tensor, out: Tensor, seqlen: int, cache) -> None:
    key = sig[0]
    if key in _KV_SEEN:
        del _KV_SEEN[key]
        from ropekit.triton import prologue

        plan = KvPlan.record(sig[1], options, q_out, out, seqlen, cache, prologue.LAST_LAUNCH)
        if plan is not None:
            _KV_PLANS[key] = plan
            if len(_KV_PLANS) > _MAX_PLANS:
                _KV_PLANS.popitem(last=False)
        return
    _KV_SEEN[key] = None
    if len(_KV_SEEN) > _MAX_SEEN:
        _KV_SEEN.popitem(last=False)


class KvPlan:
    """The prologue kernel's launch for one rope_kv_write signature: its arguments with each pointer slot mapped
    to the call tensor it came from (an index into the call's tensors; ``len(_KV_TENSORS)`` for the fresh q
    output) or kept as the plan's own constant (the cached default frequencies)."""

    __slots__ = ("grid", "args", "slots", "consts", "constexprs", "num_warps", "roles", "compiled", "device_index",
                 "q_out", "out_shape", "pos_index", "max_offset", "kv_spans", "input_spans")

    @classmethod
    def record(cls, tensors: list, options: dict, q_out: Tensor, out: Tensor, seqlen: int, cache, launch: list):
        """A plan from the full path's launch (``launch``: what ``launch_prologue`` recorded), or None where a
        kernel argument is a copy of a call's tensor rather than a view of it."""
        if len(launch) != 1:
            return None
        grid, args, constexprs, num_warps, roles, device = launch[0]
        by_ptr = {}
        for j, t in enumerate(tensors):
            if t is not None:
                by_ptr.setdefault(t.data_ptr(), j)
        by_ptr.setdefault(q_out.data_ptr(), len(_KV_TENSORS))
        plan = cls()
        plan.args = list(args)
        slots = []
        for i in roles.pointers:
            j = by_ptr.get(args[i].data_ptr())
            if j is not None:
                slots.append((i, j))
                plan.args[i] = None
            elif not (options["inv_freq"] is None and args[i] is not None and args[i].dim() == 1
                      and roles.fn.arg_names[i] == "freq_ptr"):
                return None  # a copy made by validation: the plan could not refill it
        plan.slots = tuple(slots)
        # the constants' tensors stay alive with the plan (on CUDA its arguments hold their addresses only)
        plan.consts = tuple(a for i, a in enumerate(plan.args) if i in roles.pointers and a is not None)
        plan.grid, plan.constexprs, plan.num_warps, plan.roles = grid, constexprs, num_warps, roles
        plan.compiled = None
        plan.device_index = None
        if device.type == "cuda":
            plan.device_index = device.index if device.index is not None else torch.cuda.current_device()
            from ropekit.triton import launcher

            plan.compiled = launcher._COMPILED.get(roles.key(args, constexprs, num_warps, device.index))
            if plan.compiled is None:
                return None
            # constants stay tensors on the interpreter, addresses on CUDA
            plan.args = [a.data_ptr() if isinstance(a, Tensor) else a for a in plan.args]
        plan.q_out = (q_out.shape, q_out.dtype)
        plan.out_shape = out.shape
        plan.pos_index = None
        if not isinstance(options["positions"], Tensor):  # an int offset: refilled and bounds-checked per call
            plan.pos_index = roles.index["pos_offset"]
            rows = cache.rows if not cache.paged else MAX_POSITION + 1
            plan.max_offset = min(MAX_POSITION, rows - 1) - max(seqlen, 1) + 1
            const = dict(zip(roles.constexprs, constexprs))
            if const["FREQ_MODE"] in (1, 2) and not const["TABLE_BY_TOKEN"]:  # a table indexed by position
                plan.max_offset = min(plan.max_offset, args[roles.index["table_rows"]] - max(seqlen, 1))
        # the full path proved the caches disjoint at this relative offset (or as disjoint address ranges), and
        # each cache disjoint from q, k and v
        kc, vc = options["k_cache"], options["v_cache"]
        plan.kv_spans = (span_bytes(kc), span_bytes(vc), vc.data_ptr() - kc.data_ptr())
        plan.input_spans = tuple(span_bytes(options[n]) for n in ("q", "k", "v"))
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

    def __call__(self, tensors: list, options: dict):
        args = self.args.copy()
        if self.pos_index is not None:
            offset = int(options["positions"])
            if not 0 <= offset <= self.max_offset:
                return None
            args[self.pos_index] = offset
        if not self._caches_disjoint(tensors[3], tensors[4]) or not self._inputs_outside_caches(tensors):
            return None  # the full path decides (and raises where they overlap)
        q = tensors[0]
        q_out = torch.empty(self.q_out[0], dtype=self.q_out[1], device=q.device)
        handles = [*tensors, q_out]
        cuda = self.compiled is not None
        for i, j in self.slots:
            args[i] = handles[j].data_ptr() if cuda else handles[j]
        if cuda:
            from ropekit.triton import launcher

            if launcher._current_device() != self.device_index:
                with torch.cuda.device(self.device_index):
                    launcher._run_compiled(self.compiled, self.grid, args, self.constexprs, self.device_index)
            else:
                launcher._run_compiled(self.compiled, self.grid, args, self.constexprs, self.device_index)
        else:  # the interpreter: the launcher's own CPU path
            from ropekit.triton import launcher

            launcher._launch(self.grid, args, self.constexprs, self.num_warps, q.device, self.roles)
        for cache in tensors[3:5]:  # the kernel's writes, declared to autograd as the full path does
            torch.autograd.graph.increment_version(cache)
        return q_out.view(self.out_shape)
