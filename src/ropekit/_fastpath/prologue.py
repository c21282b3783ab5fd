"""Plans for the attention prologue: rope_kv_write (:func:`write_kv`, :class:`KvPlan`) and qk_norm_rope
(:func:`norm_rotate`, :class:`NormPlan`, :class:`PlannedNormRope`)."""

from __future__ import annotations

import operator
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import Tensor

from ropekit._cache_validation import validate_kv_write
from ropekit._fastpath.plans import (
    _KV_PLANS,
    _KV_SEEN,
    _NORM_PLANS,
    _NORM_SEEN,
    _call_signature,
    _checked_offset,
    _keep,
    _note,
    _offset_bound,
    _plans_apply,
    _prologue_call,
    _recording,
    _Replay,
    _sources_key,
    spec_recipe,
    spec_views,
)
from ropekit._memory import span_bytes
from ropekit._spec import (
    MAX_POSITION,
    TENSOR_ARGS,
    CacheArgs,
    NormSpec,
    OutScales,
    RopeArgs,
    RopeSpec,
    to_canonical,
)
from ropekit._validation import validate_args, validate_norm, validate_out_quant
from ropekit.autograd import norm_rotate as norm_rotate_spec
from ropekit.autograd import write_kv as write_kv_spec

# --- rope_kv_write ---------------------------------------------------------------------------------------------
# The same scheme for the attention prologue's inference call: a plan per signature, recorded on its second call
# from the launch the full path made, replayed by filling the data pointers of the call's tensors.

_NO_SCALES = OutScales()  # no float8 output scales

# rope_kv_write's arguments that may be tensors, in the order a plan's sources index them (its fresh outputs come
# last: q_out, then q's dynamic scales and the rotated k where asked).
_KV_TENSORS = ("q", "k", "v", "k_cache", "v_cache", "positions", "slot_mapping", "q_weight", "k_weight",
               "k_cache_scale", "v_cache_scale", "inv_freq", "cos", "sin", "angles", "q_out_scale", "kv_indices",
               "kv_indptr", "kv_last_page_len", "batch_indices")


class KvCall(NamedTuple):
    """One rope_kv_write call, as the public function bundles it."""

    q: Tensor
    k: Tensor
    cache: CacheArgs
    norm: NormSpec
    args: RopeArgs
    scales: OutScales = _NO_SCALES

    def values(self) -> tuple:
        """The call's possible tensors in ``_KV_TENSORS`` order, and its other arguments."""
        c, n, a = self.cache, self.norm, self.args
        tensors = (self.q, self.k, c.v, c.k_cache, c.v_cache, a.positions, c.slot_mapping, n.q_weight, n.k_weight,
                   c.k_cache_scale, c.v_cache_scale, a.inv_freq, a.cos, a.sin, a.angles, self.scales.q_out_scale,
                   c.kv_indices, c.kv_indptr, c.kv_last_page_len, c.batch_indices)
        return tensors, (c.cache_layout, n.weight_offset, n.eps, self.scales.return_k, *_rope_scalars(a))

    @property
    def extra(self) -> bool:
        """A float8 q output or the rotated k asked for."""
        return self.args.out_dtype is not None or self.scales.given or self.scales.return_k is not False


def write_kv(q: Tensor, k: Tensor, cache: CacheArgs, norm: NormSpec, args: RopeArgs,
             scales: OutScales = _NO_SCALES) -> Tensor:
    """:func:`ropekit.rope_kv_write` (its arguments bundled): replay the plan of the call's signature, or validate,
    run and note the signature; ``scales``: the float8 q output's scale and ``return_k``."""
    call = KvCall(q, k, cache, norm, args, scales)
    if not (_plans_apply() and not args.check_positions and args.cu_seqlens is None):
        return _write_kv_full(call, None, None)
    return _prologue_call(_KV_PLANS, _kv_signature(call), call, _write_kv_full)


# RopeArgs' fields by kind, as getters: a key is built on every planned call, so in C rather than a loop
_SCALAR_FIELDS = tuple(i for i, name in enumerate(RopeArgs._fields) if name not in TENSOR_ARGS)
_scalar_values = operator.itemgetter(*_SCALAR_FIELDS)
_tensor_values = operator.itemgetter(*(RopeArgs._fields.index(name) for name in TENSOR_ARGS))


def _rope_scalars(args: RopeArgs) -> tuple:
    """``args``' fields that are never tensors, as a hashable part of a key (``sections`` as a tuple)."""
    values = _scalar_values(args)
    if list in map(type, values):
        return tuple(tuple(v) if type(v) is list else v for v in values)
    return values

def _write_kv_full(call: KvCall, sig, launches: list | None) -> Tensor:
    """The full path of :func:`write_kv`: validate, run, and note ``sig`` (None: not planned) with the launches
    it made (``launches``)."""
    if call.extra:
        fresh, out, seqlen, cache = _write_kv_outputs(call)
    else:
        q4, k4, v4, rope_args, cache = validate_kv_write(call.q, call.k, call.cache, call.args)
        spec = validate_args(q4, k4, rope_args)
        norm = validate_norm(call.q, call.k, call.norm, required=False) or NormSpec(None, None)
        q_out = write_kv_spec(q4, k4, v4, norm, spec, cache)
        fresh, seqlen = [q_out], to_canonical(q4, rope_args.layout).shape[1]
        out = q_out.view(call.q.shape) if call.q.dim() == 3 else q_out
    if sig is not None:
        _kv_sighted(sig, call, fresh, out, seqlen, cache, launches)
    return out

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


def _kv_sighted(sig, call: KvCall, fresh: list, out, seqlen: int, cache, launches: list) -> None:
    def record():
        _keep(_KV_PLANS, sig[0], KvPlan.record(sig[1], call, fresh, out, seqlen, cache, launches))

    _note(_KV_SEEN, sig[0], record)

class KvPlan:
    """The prologue kernel's launch for one rope_kv_write signature (:class:`_Replay`, whose sources are the call's
    tensors in ``_KV_TENSORS`` order and then its fresh outputs), with the checks a replay repeats per call."""

    __slots__ = ("replay", "fresh", "out_shapes", "int_offset", "max_offset", "kv_spans", "input_spans")

    @classmethod
    def record(cls, tensors: list, call: KvCall, fresh: list, out, seqlen: int, cache, launch: list):
        """A plan from the full path's launch (``launch``: what ``launch_prologue`` recorded; ``fresh``: the
        outputs it wrote, ``out``: what the call returned, views of them), or None where a kernel argument is a
        copy of a call's tensor rather than a view of it."""
        if len(launch) != 1 or not all(f.is_contiguous() for f in fresh):
            return None  # (a replay allocates its outputs dense: the launch's strides must be theirs)
        plan = cls()
        plan.replay = _Replay.record(launch[0], [*tensors, *fresh], call.args.inv_freq is None)
        if plan.replay is None:
            return None
        roles, constexprs, args = plan.replay.roles, plan.replay.constexprs, launch[0][1]
        plan.fresh = tuple((f.shape, f.dtype) for f in fresh)
        plan.out_shapes = tuple(o.shape for o in out) if isinstance(out, tuple) else out.shape
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
        device = tensors[0].device
        fresh = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.fresh]
        self.replay([*tensors, *fresh], offset)
        for cache in tensors[3:5]:  # the kernel's writes, declared to autograd as the full path does
            torch.autograd.graph.increment_version(cache)
        if type(self.out_shapes) is tuple:
            return tuple(f.view(shape) for f, shape in zip(fresh, self.out_shapes))
        return fresh[0].view(self.out_shapes)


# --- float8 outputs and the rotated k -----------------------------------------------------------------------------
# rope_kv_write's are planned as its plain calls are (KvPlan allocates every fresh output); qk_norm_rope's float8
# calls take the full path. Traced, they are ropekit::qk_norm_rope_fp8 and ropekit::rope_kv_write_outputs.

def _refuse_grad(name: str, tensors, what: str = "float8 outputs", traceable: bool = False) -> None:
    if torch.compiler.is_compiling() and not traceable:
        raise NotImplementedError(f"{name} with {what} runs eagerly only: call it outside torch.compile (or wrap "
                                  "the call in torch.compiler.disable)")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(f"{name} with {what} is not differentiable: call it under torch.no_grad() or "
                           "torch.inference_mode(), or leave out_dtype None for training")


def _write_kv_outputs(call: KvCall) -> tuple:
    """The full path of :func:`ropekit.rope_kv_write` with a float8 q output and/or the rotated k: (the outputs the
    kernel wrote, what the call returns -- q_out, then (dynamic scales) q_scales, then (``return_k``) k_out, a tuple
    where there is more than q_out --, the sequence length, the cache spec)."""
    from ropekit import ops

    q, k, cache, norm, args, scales = call
    _refuse_grad("rope_kv_write", (q, k, cache.v, norm.q_weight, norm.k_weight),
                 "float8 outputs" if args.out_dtype is not None or scales.given else "return_k", traceable=True)
    q4, k4, v4, rope_args, cache_spec = validate_kv_write(q, k, cache, args._replace(out_dtype=None))
    spec = validate_args(q4, k4, rope_args)
    norm = validate_norm(q, k, norm, required=False) or NormSpec(None, None)
    if not isinstance(scales.return_k, bool):
        raise TypeError(f"return_k must be a bool, got {type(scales.return_k).__name__}")
    quant = validate_out_quant(args.out_dtype, scales, q, None, args.check_positions)
    if torch.compiler.is_compiling():  # the registered op: fake outputs for the graph, the caches declared written
        q_out, q_scales, k_out = ops.rope_kv_write_outputs(
            q4, k4, v4, cache_spec.k_cache, cache_spec.v_cache, norm.q_weight, norm.k_weight, norm.weight_offset,
            norm.eps, *ops.cache_op_args(cache_spec), *ops.kv_quant_args(quant), scales.return_k, *spec)
        outs = [q_out, *([q_scales] if quant is not None and quant.dynamic else []),
                *([k_out] if scales.return_k else [])]
    else:
        outs = ops.write_kv_outputs(q4, k4, v4, norm.q_weight, norm.k_weight, norm.weight_offset, norm.eps, spec,
                                    cache_spec, quant, scales.return_k)
    shaped = [outs[0].view(q.shape)]
    if quant is not None and quant.dynamic:
        shaped.append(outs[1].view(q.shape[:-1]))
    if scales.return_k:
        shaped.append(outs[-1].view(k.shape))
    seqlen = to_canonical(q4, rope_args.layout).shape[1]
    return outs, shaped[0] if len(shaped) == 1 else tuple(shaped), seqlen, cache_spec


def _norm_rotate_float8(q: Tensor, k: Tensor, norm: NormSpec, args: RopeArgs, scales: OutScales) -> tuple:
    """:func:`ropekit.qk_norm_rope` with float8 outputs: (q_out, k_out) or, with dynamic scales, (q_out, k_out,
    q_scales, k_scales)."""
    from ropekit import ops

    _refuse_grad("qk_norm_rope", (q, k, norm.q_weight, norm.k_weight), traceable=True)
    spec = validate_args(q, k, args._replace(out_dtype=None))
    if k is None:
        raise TypeError("qk_norm_rope needs k (use apply_rope on a normalised q alone)")
    norm = validate_norm(q, k, norm, required=True)
    quant = validate_out_quant(args.out_dtype, scales, q, k, args.check_positions)
    if torch.compiler.is_compiling():  # the registered op: fake float8 outputs (and scales) for the graph
        return tuple(ops.qk_norm_rope_fp8(q, k, norm.q_weight, norm.k_weight, norm.weight_offset, norm.eps,
                                          *ops.qk_norm_rope_fp8_args(quant), *spec))
    return tuple(ops.norm_rotate_float8(q, k, norm.q_weight, norm.k_weight, norm.weight_offset, norm.eps, spec,
                                        quant))


# --- qk_norm_rope --------------------------------------------------------------------------------------------
# The same scheme for norm + RoPE, autograd included: the forward's plan is recorded on a signature's second call
# from the launch the full path made; a planned call that needs gradients runs through PlannedNormRope, whose
# backward replays, per layout of the incoming gradients, the backward launch its first full-path backward made.

# qk_norm_rope's arguments that may be tensors, in the order a plan's sources index them (then the fresh outputs).
_NORM_TENSORS = ("q", "k", "q_weight", "k_weight", *TENSOR_ARGS)
_MAX_BACKWARDS = 8  # gradient layouts kept per plan
# what the backward's launcher allocates per call: the weight gradients, which a replay returns; and what it carves
# from the stream's workspace: the weights' partial rows and their sum tree's counters
_NORM_BWD_SCRATCH = ("dwqo_ptr", "dwko_ptr")
_NORM_BWD_WORKSPACE = ("dwq_ptr", "dwk_ptr", "cnt_ptr")


class NormCall(NamedTuple):
    """One qk_norm_rope call, as the public function bundles it."""

    q: Tensor
    k: Tensor
    norm: NormSpec
    args: RopeArgs

    def values(self) -> tuple:
        """The call's possible tensors in ``_NORM_TENSORS`` order, and its other arguments."""
        n, a = self.norm, self.args
        return (self.q, self.k, n.q_weight, n.k_weight, *_tensor_values(a)), (n.weight_offset, n.eps,
                                                                               *_rope_scalars(a))


def norm_rotate(q: Tensor, k: Tensor, norm: NormSpec, args: RopeArgs, scales: OutScales = _NO_SCALES) -> tuple:
    """:func:`ropekit.qk_norm_rope` (its arguments bundled): replay the plan of the call's signature, or validate,
    run and note the signature. float8 outputs (``args.out_dtype``, ``scales``) take the full path."""
    if args.out_dtype is not None or scales.given:
        return _norm_rotate_float8(q, k, norm, args, scales)
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

class NormPlan:
    """The forward launch of one qk_norm_rope signature (:class:`_Replay`; sources: the call's tensors in
    ``_NORM_TENSORS`` order, then the fresh q and k outputs) and, per layout of the backward's tensors, the
    backward's (sources: the two gradients, the call's tensors, then the fresh dq and dk; ``_NORM_BWD_SCRATCH``
    allocated per call, ``_NORM_BWD_WORKSPACE`` carved from the stream's workspace). ``saved``:
    :func:`spec_recipe` of the forward's spec (what the full path saves for the backward besides q, k and the
    weights)."""

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

    def grads(self, grad_q: Tensor, grad_k: Tensor, tensors: list, offset: int | None, args: RopeArgs,
              weight_offset: float, eps: float) -> tuple:
        """(dq, dk, dq_weight, dk_weight) of a planned call (gradients with a contiguous last dim), by the replay
        recorded for this layout of the gradients and of the saved tensors (which saved-tensor hooks may have
        changed since the forward), or by the full path, which records it."""
        sources = [grad_q, grad_k, *tensors]
        key = _sources_key(sources)
        q, k, q_weight, k_weight = tensors[:4]
        replay = self.backwards.get(key)
        if replay is not None:
            dq, dk = torch.empty_like(q), torch.empty_like(k)
            dwq, dwk = replay([*sources, dq, dk], offset)
            return dq, dk, dwq, dwk
        from ropekit import ops

        spec = validate_args(q, k, args)
        with _recording() as launches:
            grads = ops.norm_rope_grads(grad_q, grad_k, q, k, q_weight, k_weight, weight_offset, eps, spec)
            if len(launches) == 1 and q.numel() and k.numel():  # a side without heads: its zeros are the launcher's
                _keep(self.backwards, key, _Replay.record(launches[0], [*sources, *grads[:2]], self.keep_freq,
                                                          scratch=_NORM_BWD_SCRATCH, workspace=_NORM_BWD_WORKSPACE),
                      _MAX_BACKWARDS)
        return tuple(grads)


class PlannedNormRope(torch.autograd.Function):
    """Eager autograd of a qk_norm_rope call replayed from a plan, as :class:`ropekit.autograd.EagerNormRope` is of
    the full path: the same kernels, and the same tensors saved (q, k, the weights and the spec's tensors), so
    in-place changes before the backward raise as there, and saved-tensor hooks (activation checkpointing,
    offloading) see the same tensors whichever route a call takes."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, plan: NormPlan, tensors: list, offset: int | None, call: NormCall):
        ctx.plan, ctx.offset = plan, offset
        # the rest of the call as it was: q, k and the weights come back from the saved tensors (holding them here
        # would keep checkpointed activations alive); the rotation's tensors are the call's args', held anyway
        ctx.args, ctx.arg_tensors = call.args, tensors[4:]
        ctx.norm_scalars = (float(call.norm.weight_offset), float(call.norm.eps))
        # what EagerNormRope saves (q, k, the weights, the spec's tensors), so that activation checkpointing's
        # recomputation saves the same whichever route it takes
        ctx.save_for_backward(q, k, q_weight, k_weight, *spec_views(plan.saved, call.args))
        return plan.run(tensors, offset)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        plan = ctx.plan
        q, k, q_weight, k_weight = ctx.saved_tensors[:4]  # raises if a saved tensor was modified in place
        grad_q = torch.zeros_like(q) if grad_q is None else grad_q
        grad_k = torch.zeros_like(k) if grad_k is None else grad_k
        # the kernel takes any strides but the last
        grad_q = grad_q if grad_q.stride(-1) == 1 else grad_q.contiguous()
        grad_k = grad_k if grad_k.stride(-1) == 1 else grad_k.contiguous()
        if torch.is_grad_enabled():  # a differentiable backward: the registered op, as the full path takes it
            from ropekit import ops

            grads = ops.qk_norm_rope_backward(grad_q, grad_k, q, k, q_weight, k_weight, *ctx.norm_scalars,
                                              *validate_args(q, k, ctx.args))
        else:
            grads = plan.grads(grad_q, grad_k, [q, k, q_weight, k_weight, *ctx.arg_tensors], ctx.offset, ctx.args,
                               *ctx.norm_scalars)
        return (*grads, None, None, None, None)
