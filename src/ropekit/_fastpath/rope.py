"""Plans for apply_rope, apply_rope_ and rope_backward: :func:`rotate`, its signature, :class:`Plan` and its
autograd form :class:`PlannedRope`."""

from __future__ import annotations

import torch
from torch import Tensor

from ropekit._fastpath.plans import (
    _PLANS,
    _SEEN,
    _SOURCES,
    _checked_offset,
    _keep,
    _note,
    _offset_bound,
    _planned,
    _plans_apply,
    spec_recipe,
    spec_views,
)
from ropekit._memory import span_bytes
from ropekit._spec import (
    FP8_MAX,
    TENSOR_ARGS,
    TENSOR_FIELDS,
    Mode,
    RopeArgs,
    RopeSpec,
    needs_grad,
    to_canonical,
)
from ropekit._validation import validate_args
from ropekit.autograd import rotate as rotate_spec
from ropekit.ops import uses_float32_path, uses_kernels

# Where RopeArgs' tensor fields sit in it (a call's key is built from its values in field order).
_TENSOR_SLOTS = tuple(sorted(RopeArgs._fields.index(name) for name in TENSOR_ARGS))
_POSITIONS_SLOT = RopeArgs._fields.index("positions")


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

def signature(q: Tensor, k: Tensor | None, mode: Mode, args: RopeArgs):
    """(key, handles) of a call, or None when the fast path does not apply: neither a kernel call (CUDA, or CPU
    under ``kernels_on_cpu``) nor a CPU float32-path call without autograd (float64 runs the reference), tensor
    subclasses, in-place calls that need autograd. Never called while torch.compile traces (:func:`_plans_apply`).

    The handles are q's, k's and the tensor options' data pointers in that order (0 for an absent k) -- the
    tensors themselves on CPU, where the interpreter needs them. Calls that need autograd get keys (and plans) of
    their own."""
    if type(q) is not Tensor or (k is not None and type(k) is not Tensor):
        return None
    kernels = uses_kernels(q)
    grad = needs_grad(q, k)
    if not kernels and (grad or q.device.type != "cpu" or not uses_float32_path(q)):
        return None  # plans of the float32 path: CPU calls without autograd (Float32Plan)
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
    parts = [mode, grad, kernels, q_part, k_part, *values]
    if mode.inplace:  # torch refuses in-place writes to inference tensors outside inference mode: so does the full path
        parts.append((q.is_inference(), k is not None and k.is_inference(), torch.is_inference_mode_enabled()))
    return tuple(parts), handles

def _sighted(key, q, k, args, spec, outs, mode) -> None:
    """Note a signature's full-path call; on its second call, record its plan."""
    _note(_SEEN, key, lambda: _remember(key, q, k, args, spec, outs, mode))


# The rope kernel's slots a plan fills per call, in the order Plan passes them: the data pointers and the offset.
VARYING_ARGS = ("q_ptr", "qo_ptr", "k_ptr", "ko_ptr", "pos_ptr", "seq_off_ptr", "cu_ptr", "freq_ptr", "cos_ptr",
                "sin_ptr", "pos_offset")


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
    if not key[2]:  # the float32 path
        _keep(_PLANS, key, Float32Plan.of(q, k, args, spec, outs, mode))
        return
    from ropekit.triton import launcher, runtime

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
    launch = launcher.kernel_launch(q, k, q_out, k_out, spec)
    if launch is None:  # nothing to rotate
        return
    launch = runtime.Replay.of(runtime.Launch(*launch, launcher.ROPE, q.device), VARYING_ARGS)
    if launch is None:
        return
    plan = Plan()
    plan.launch, plan.slots, plan.grad, plan.saved = launch, tuple(slots), key[1], saved
    plan.handle = launch.handle  # what the launch takes for a tensor: its address on CUDA, itself under the interpreter
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


class Float32Plan:
    """A recorded CPU call of the float32 path (float16/bfloat16/float32 CPU tensors, no autograd): the validated
    spec's scalars and where its tensors come from in a later call's args (:func:`spec_recipe`), so that a repeated
    call -- a model's next layer, or its next decode step -- skips validation; and, at decode sizes, the float32
    tables of its last two calls, reused while the call's tensor arguments (positions, frequencies) hold the same
    values (one ``torch.equal`` each). Per call it re-checks what can change within a signature: the int position
    offset, the overlap of q and k in place, and the position values (a call with a position the full path
    refuses goes back to it)."""

    __slots__ = ("spec", "saved", "int_offset", "max_offset", "q_out", "k_out", "q_span", "k_span", "qk_delta",
                 "last", "copies", "joint")

    # Table elements up to which a plan keeps a call's tables (decode sizes: up to 64 tokens of head_dim 128), so
    # that a thousand plans hold at most about 128 MiB.
    KEPT_TABLE_ELEMENTS = 1 << 14

    @classmethod
    def of(cls, q: Tensor, k: Tensor | None, args: RopeArgs, spec: RopeSpec, outs: tuple, mode: Mode):
        """The plan of a call the full path ran with ``spec``, or None where a replay could not rebuild it: float8
        outputs (another route), packed sequences (whose boundaries validation reads), spec tensors that are
        copies of the call's."""
        saved = spec_recipe(spec, args)
        if saved is None or spec.cu_seqlens is not None or spec.out_dtype in FP8_MAX:
            return None
        plan = cls()
        plan.saved = saved  # where the spec's tensors come from in a call; plan.spec keeps only its scalars
        plan.spec = RopeSpec.from_parts((None,) * len(spec.tensors), spec.scalars)
        positions = args.positions
        # an int offset, or a 0-d CPU tensor (which validation reads as one): checked and passed per call
        plan.int_offset = positions is not None and (not isinstance(positions, Tensor) or positions.dim() == 0)
        plan.max_offset = _offset_bound(spec, to_canonical(q, spec.layout).shape[1])
        plan.q_span = plan.k_span = plan.qk_delta = 0
        if mode.inplace and k is not None:
            plan.q_span, plan.k_span = span_bytes(q), span_bytes(k)
            plan.qk_delta = k.data_ptr() - q.data_ptr()
        plan.q_out = outs[0].dtype
        plan.k_out = None if k is None else outs[1].dtype
        plan.last = ()
        # out of place, bshd, every column rotary, outputs of the inputs' dtypes: inputs that fits_rotated_copy takes
        # rotate into new tensors in the fewest ops
        plan.copies = not mode.inplace and spec.layout == "bshd" and spec.rotary_dim == q.shape[-1] and \
            plan.q_out == q.dtype and (k is None or plan.k_out == k.dtype)
        # 16-bit q and k of one dtype: side by side in one float32 workspace copy (rotated_copies)
        plan.joint = plan.copies and k is not None and q.dtype == k.dtype and q.dtype != torch.float32
        return plan

    _disjoint = Plan._disjoint

    def __call__(self, q: Tensor, k: Tensor | None, handles: list, args: RopeArgs, mode: Mode):
        """Rotate and return what the full path would, or None to send the call down the full path."""
        from ropekit.float32_path import (
            fits_rotated_copy,
            float32_tables,
            rotate_with_tables,
            rotated_copies,
            rotated_copy,
        )

        offset = 0
        if self.int_offset:
            offset = _checked_offset(args.positions, self.max_offset)
            if offset == -1:
                return None
        if mode.inplace and k is not None and not self._disjoint(q, k):
            return None
        tensors = handles[2:]  # the call's tensor arguments (CPU handles are the tensors)
        for i, kept in enumerate(self.last):
            if kept[0] == offset and all(map(torch.equal, kept[1], tensors)):
                made = kept[2]
                if i:  # the most recently used first: a set of positions used again outlives the ones seen once
                    self.last = (kept, *self.last[:i], *self.last[i + 1:])
                break
        else:
            scalars = self.spec.scalars
            if self.int_offset:
                scalars = (offset, *scalars[1:])  # pos_offset leads
            made, all_valid = float32_tables(q, k, RopeSpec.from_parts(tuple(spec_views(self.saved, args)), scalars))
            if not all_valid:
                return None
            small = sum(t.numel() for tables in made.values() for t in tables) <= self.KEPT_TABLE_ELEMENTS and \
                sum(t.numel() for t in tensors) <= self.KEPT_TABLE_ELEMENTS  # compared per call
            if small:  # the two most recent: a forward's layers and the next one's first layer take turns
                self.last = ((offset, [t.clone() for t in tensors], made), *self.last[:1])
        spec = self.spec
        if mode.inplace:
            rotate_with_tables(q, k, q, k, made, spec)
            return q if k is None else (q, k)
        if self.copies and fits_rotated_copy(q) and (k is None or fits_rotated_copy(k)):
            neox = spec.style == "neox"
            if self.joint:
                both = rotated_copies(q, k, made[spec.q_scale], made[spec.k_scale], neox)
                if both is not None:
                    return both
            q_out = rotated_copy(q, made[spec.q_scale], neox)
            return q_out if k is None else (q_out, rotated_copy(k, made[spec.k_scale], neox))
        q_out = torch.empty(q.shape, dtype=self.q_out)
        k_out = None if k is None else torch.empty(k.shape, dtype=self.k_out)
        rotate_with_tables(q, k, q_out, k_out, made, spec)
        return q_out if k is None else (q_out, k_out)
