"""The plan caches the fast path keeps, and what its rope and prologue plans share: when plans apply, the LRU
bookkeeping, the saved-tensor recipe, the recorded prologue launch (:class:`_Replay`) and the call signature."""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch
from torch import Tensor

from ropekit import _config
from ropekit._spec import (
    MAX_POSITION,
    TENSOR_FIELDS,
    RopeArgs,
    RopeSpec,
)
from ropekit.ops import uses_kernels

_PLANS: OrderedDict = OrderedDict()
_MAX_PLANS = 1024
_SEEN: OrderedDict = OrderedDict()  # signatures seen once, not yet worth a plan
# the prologue's: rope_kv_write's and qk_norm_rope's
_KV_PLANS: OrderedDict = OrderedDict()
_KV_SEEN: OrderedDict = OrderedDict()
_NORM_PLANS: OrderedDict = OrderedDict()
_NORM_SEEN: OrderedDict = OrderedDict()
# rope_attention's
_ATTENTION_PLANS: OrderedDict = OrderedDict()
_ATTENTION_SEEN: OrderedDict = OrderedDict()
_MAX_SEEN = 1024
# The arguments each of the spec's tensors can be a view of.
_SOURCES = {"positions": ("positions",), "seq_offsets": ("positions",), "cu_seqlens": ("cu_seqlens",),
            "inv_freq": ("inv_freq",), "cos": ("cos", "angles"), "sin": ("sin",)}


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

def clear() -> None:
    """Forget every plan and sighting (tests; the plans hold no tensors of the calls that made them)."""
    _PLANS.clear()
    _SEEN.clear()
    _KV_PLANS.clear()
    _KV_SEEN.clear()
    _NORM_PLANS.clear()
    _NORM_SEEN.clear()
    _ATTENTION_PLANS.clear()
    _ATTENTION_SEEN.clear()

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


def _keep(plans: OrderedDict, key, plan, limit: int | None = None) -> None:
    """Keep ``plan`` (unless None) under ``key``, least recently used out beyond ``limit`` (default
    ``_MAX_PLANS``, read per call)."""
    if plan is None:
        return
    plans[key] = plan
    if len(plans) > (_MAX_PLANS if limit is None else limit):
        plans.popitem(last=False)

@contextlib.contextmanager
def _recording():
    """Within the block (on this thread) the prologue's launchers record their launches in the yielded list, which
    holds the call's tensors: dropped on the way out."""
    from ropekit.triton.runtime import RECORDER

    launches = []
    RECORDER.launches = launches
    try:
        yield launches
    finally:
        RECORDER.launches = None


def _prologue_call(plans: OrderedDict, sig, call, full):
    """A prologue call (rope_kv_write, qk_norm_rope): replay the plan of ``sig`` (the call's signature, or None
    where plans do not apply), else ``full(call, sig)``, recording its launch while ``sig`` may get a plan."""
    if _config.pdl_launches:  # plans replay launches recorded with or without PDL: the full path decides
        sig = None
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
    grad_mode = torch.is_grad_enabled()
    for name, t in zip(names, values):
        if t is None:  # absent (most of them)
            tensors.append(None)
            parts.append(None)
            continue
        kind = type(t)
        if kind is not Tensor and kind is not torch.nn.Parameter:
            if isinstance(t, Tensor):
                return None  # subclasses (a Parameter is a plain tensor to torch functions: its override is disabled)
            tensors.append(None)
            parts.append(kind if name == "positions" else t)  # absent, a float scale, or an int offset's type
            continue
        if grad_mode and t.requires_grad:
            if not grad_ok:
                return None  # the full path refuses the call
            grad = True
        p = t.data_ptr()
        tensors.append(t)
        parts.append((t.shape, t.stride(), t.dtype, t.device, p & 15))
        ptrs.append(p)
    # a call whose tensors alias differently gets its own plan
    return (tuple(parts), _aliasing(ptrs), scalars, grad), tensors

class _Replay:
    """A prologue-kernel launch the full path made (recorded by :func:`_recording`) as a
    :class:`ropekit.triton.runtime.Replay`, and where a later call's values for its open slots come from: each
    pointer argument from the call's tensors (the index, in ``sources``, of the one it pointed at when recorded),
    allocated afresh per call (``scratch``: arguments the launcher allocates itself, by name), carved from the
    stream's workspace at the recorded offset (``workspace``: by name, as the launcher carved them; see
    :func:`ropekit.triton.runtime.workspace`), or kept (the default frequencies of ``base=``, which validation
    caches); the int position offset, where the signature has one."""

    __slots__ = ("launch", "sources", "scratch", "carved", "workspace_bytes", "roles", "constexprs", "pos_offset")

    @classmethod
    def record(cls, launch, sources: list, keep_freq: bool, scratch: tuple = (), workspace: tuple = ()):
        """The replay of ``launch`` (a :class:`ropekit.triton.runtime.Launch`), or None where a pointer argument is
        a copy validation made of a call's tensor (no later call could refill it) or the kernel is not compiled."""
        from ropekit.triton import runtime

        roles, args = launch.roles, launch.args
        by_ptr = {}
        for j, t in enumerate(sources):
            if t is not None:
                by_ptr.setdefault(t.data_ptr(), j)
        from_sources, fresh, carved, found = [], [], [], {}
        for i in roles.pointers:
            name = roles.fn.arg_names[i]
            if name in scratch:
                fresh.append((tuple(args[i].shape), args[i].dtype))
                found[name] = "scratch"
                continue
            if name in workspace:  # a view of the workspace buffer: its byte offset and extent there
                t = args[i]
                at = t.data_ptr() - t.untyped_storage().data_ptr()
                carved.append((at, at + t.numel() * t.element_size(), t.dtype))
                found[name] = "workspace"
                continue
            j = by_ptr.get(args[i].data_ptr())
            if j is not None:
                found[name] = "source"
                from_sources.append(j)
            elif not (keep_freq and name == "freq_ptr" and args[i] is not None and args[i].dim() == 1):
                return None
        # open slots in the order __call__ passes them: the call's tensors, the scratch, the workspace, the offset
        names = [n for kind in ("source", "scratch", "workspace") for n, k in found.items() if k == kind]
        names.append("pos_offset")
        r = cls()
        r.pos_offset = args[roles.index["pos_offset"]]
        r.launch = runtime.Replay.of(launch, tuple(names))
        if r.launch is None:
            return None
        r.sources, r.scratch, r.carved = tuple(from_sources), tuple(fresh), tuple(carved)
        r.workspace_bytes = max((end for _, end, _ in carved), default=0)
        r.roles, r.constexprs = roles, launch.constexprs
        return r

    def __call__(self, sources: list, pos_offset: int | None = None) -> list:
        """Launch with ``sources`` (and this call's int position offset, where the signature has one: else the
        recorded one); returns the scratch tensors it allocated."""
        device = sources[0].device
        scratch = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.scratch]
        handle = self.launch.handle
        values = [handle(sources[j]) for j in self.sources]
        if scratch:
            values += [handle(t) for t in scratch]
        if self.carved:
            from ropekit.triton.runtime import workspace

            buffer = workspace(device, self.workspace_bytes)
            if device.type == "cuda":
                base = buffer.data_ptr()
                values += [base + at for at, _, _ in self.carved]
            else:  # the interpreter takes tensors
                values += [buffer[at:end].view(dtype) for at, end, dtype in self.carved]
        self.launch(*values, self.pos_offset if pos_offset is None else pos_offset)
        return scratch

def _aliasing(ptrs: list) -> tuple | None:
    """Which of the data pointers ``ptrs`` are the same (each one's first index), or None where none are, the
    usual case: part of a key, so that tensors aliasing differently get replays of their own."""
    return None if len(set(ptrs)) == len(ptrs) else tuple(ptrs.index(p) for p in ptrs)


def _sources_key(sources: list) -> tuple:
    """The key of a recorded backward's replay over ``sources`` (None where absent): each tensor's shape, strides,
    dtype and alignment, and their aliasing (:func:`_aliasing`)."""
    layouts, ptrs = [], []
    for t in sources:
        if t is None:
            layouts.append(None)
            continue
        p = t.data_ptr()
        ptrs.append(p)
        layouts.append((t.shape, t.stride(), t.dtype, p & 15))
    return tuple(layouts), _aliasing(ptrs)
