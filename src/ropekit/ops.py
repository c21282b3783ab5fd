"""torch.library registrations: ``ropekit::rope`` (out of place) and ``ropekit::rope_`` (in place), and the
attention prologue's ``ropekit::qk_norm_rope`` (with ``ropekit::qk_norm_rope_backward``) and
``ropekit::rope_kv_write``.

Both take ``q``, ``k`` and the fields of a validated :class:`ropekit._spec.RopeSpec`, in the order of the schema
that :func:`ropekit._spec.op_schema` generates from it. CUDA tensors run the Triton kernel (float64 ones the
reference, which keeps float64 math); float16/bfloat16/float32 tensors on the CPU and on other devices (MPS, XPU,
...) the float32 torch path with host-exact angles (:func:`ropekit.float32_path.rope_float32_into`; on the CPU the
Triton interpreter under :func:`ropekit.testing.kernels_on_cpu`, the float64 reference under
:func:`ropekit.testing.reference_on_cpu`); float64 tensors everywhere the float64 reference.

:func:`rotate_out_of_place` and :func:`rotate_in_place` are the ops' bodies, callable without the dispatcher by
eager calls that need neither autograd nor tracing (its round trips cost more host time than a decode kernel).

The registered ops may be called directly, without the public functions' validation; the kernels step through a
row's columns one element apart, so each op, before anything runs, reads a tensor whose last dim is strided (stride
0 or > 1) as a contiguous copy (:func:`_dense_rows`) and refuses one it writes (``rope_``'s q and k, the caches,
MLA's given q outputs) with a ``ValueError`` naming it (:func:`ropekit._validation.check_last_dim`); the spec's 1-D
tensors, which the kernels index densely, are made contiguous where strided (:func:`_op_spec`). These are
attribute reads on the common contiguous path; the public functions' eager calls, validated already, run the bodies
without them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ropekit import _config
from ropekit._spec import FP8_MAX, CacheSpec, OutQuant, RopeSpec, op_schema, to_canonical
from ropekit._validation import _dense, check_last_dim


def uses_kernels(x: Tensor) -> bool:
    """Whether ``x`` is rotated by the Triton kernels (fp32 math) rather than a torch path."""
    if x.dtype == torch.float64:
        return False
    return x.device.type == "cuda" or (_config.kernels_on_cpu and x.device.type == "cpu")


def uses_float32_path(x: Tensor) -> bool:
    """Whether ``x`` is rotated by the float32 torch path (:func:`ropekit.float32_path.rope_float32_into`): float16,
    bfloat16 and float32 tensors on the CPU (unless :func:`ropekit.testing.kernels_on_cpu` or
    :func:`ropekit.testing.reference_on_cpu` routes them elsewhere) and on devices other than CUDA, which may lack
    float64 (MPS, XPU, ...). float64 inputs keep float64 math wherever they exist."""
    if x.dtype == torch.float64:
        return False
    if x.device.type == "cpu":
        if _config.kernels_on_cpu:
            return False
        return _config.float32_path_on_cpu or not _config.reference_on_cpu
    return x.device.type != "cuda"


def _run(q: Tensor, k: Tensor | None, q_out: Tensor, k_out: Tensor | None, spec: RopeSpec) -> None:
    """Rotate into the given outputs on q's device (outputs may be the inputs)."""
    if q.device.type == "meta":  # shapes only (a model built on the meta device): nothing to compute
        return
    if q_out.dtype in FP8_MAX and not uses_kernels(q):  # float8: the math dtype's result, rounded once, saturated
        from ropekit.reference import to_float8

        math = torch.float32 if uses_float32_path(q) else torch.float64
        for out, y in zip((q_out, k_out), rotate_out_of_place(q, k, spec._replace(out_dtype=math))):
            out.copy_(to_float8(y, out.dtype))
        return
    if uses_kernels(q):
        from ropekit.triton.launcher import launch_rope

        launch_rope(q, k, q_out, k_out, spec)
        if q_out is q:  # a kernel's write is invisible to autograd: declare it (torch's own ops do the same)
            torch.autograd.graph.increment_version(q)
            if k is not None:
                torch.autograd.graph.increment_version(k)
        return
    if uses_float32_path(q):  # straight into the outputs (in place when they are the inputs)
        from ropekit.float32_path import rope_float32_into

        rope_float32_into(q, k, q_out, k_out, spec)
        return
    from ropekit.reference import rope_reference

    results = rope_reference(q, k, spec._replace(out_dtype=q_out.dtype))
    q_out.copy_(results[0])
    if k is not None:
        k_out.copy_(results[1])


def _new_outputs(q: Tensor, k: Tensor | None, out_dtype: torch.dtype | None) -> list[Tensor]:
    outs = [q.new_empty(q.shape, dtype=out_dtype or q.dtype)]
    if k is not None:
        outs.append(k.new_empty(k.shape, dtype=out_dtype or k.dtype))
    return outs


def rotate_out_of_place(q: Tensor, k: Tensor | None, spec: RopeSpec) -> list[Tensor]:
    """``[q_out]`` or ``[q_out, k_out]``: fresh contiguous tensors in ``spec.layout``."""
    outs = _new_outputs(q, k, spec.out_dtype)
    _run(q, k, outs[0], outs[1] if k is not None else None, spec)
    return outs


def rotate_in_place(q: Tensor, k: Tensor | None, spec: RopeSpec) -> None:
    _run(q, k, q, k, spec)


def _dense_rows(x: Tensor | None) -> Tensor | None:
    """``x`` as the kernels read it: itself, or a contiguous copy where its last dim is strided (stride 0 or > 1).
    Only for tensors an op reads; one it writes is refused instead (:func:`ropekit._validation.check_last_dim`)."""
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def _op_spec(fields: tuple) -> RopeSpec:
    """The :class:`RopeSpec` of a registered op's spec arguments, its 1-D tensors (``inv_freq``, ``seq_offsets``,
    ``cu_seqlens``) with unit stride: validation makes them so, a direct call of the op need not, and the kernels
    index them densely (a copy only for a strided one; positions and tables carry their strides)."""
    spec = RopeSpec(*fields)
    vectors = (spec.inv_freq, spec.seq_offsets, spec.cu_seqlens)
    dense = tuple(t if t is None else _dense(t) for t in vectors)
    if any(d is not t for d, t in zip(dense, vectors)):
        spec = spec._replace(inv_freq=dense[0], seq_offsets=dense[1], cu_seqlens=dense[2])
    return spec


def _rope(q: Tensor, k: Tensor | None, *spec) -> list[Tensor]:
    return rotate_out_of_place(_dense_rows(q), _dense_rows(k), _op_spec(spec))


def _rope_(q: Tensor, k: Tensor | None, *spec) -> None:
    check_last_dim("q", q)
    if k is not None:
        check_last_dim("k", k)
    rotate_in_place(q, k, _op_spec(spec))


rope = torch.library.custom_op("ropekit::rope", _rope, mutates_args=(), schema=op_schema(inplace=False))
rope_ = torch.library.custom_op("ropekit::rope_", _rope_, mutates_args=("q", "k"), schema=op_schema(inplace=True))


@rope.register_fake
def _rope_fake(q, k, *spec):
    return _new_outputs(q, k, RopeSpec(*spec).out_dtype)


@rope_.register_fake
def _rope_inplace_fake(q, k, *spec):
    return None


def rotate_float8_dynamic(q: Tensor, k: Tensor | None, spec: RopeSpec) -> list[Tensor]:
    """apply_rope with float8 outputs (``spec.out_dtype``) and dynamic scales (inference only): [q_out, k_out,
    q_scales, k_scales] (without k: [q_out, q_scales]), each (token, head) row divided by its own float32 scale
    ``max |row| / fp8 max``; the scales are shaped like q and k without their last dim."""
    xs = [q] if k is None else [q, k]
    quant = OutQuant(spec.out_dtype, dynamic=True)
    if uses_kernels(q):
        from ropekit.triton.launcher import launch_rope

        outs = _new_float8(xs, quant)
        launch_rope(q, k, outs[0], outs[1] if k is not None else None, spec, q_scales=outs[len(xs)],
                    k_scales=outs[-1] if k is not None else None)
        return outs
    math = torch.float32 if uses_float32_path(q) else torch.float64
    return _float8_outputs(xs, rotate_out_of_place(q, k, spec._replace(out_dtype=math)), quant)


def _rope_fp8_dynamic(q: Tensor, k: Tensor | None, *spec) -> list[Tensor]:
    return rotate_float8_dynamic(_dense_rows(q), _dense_rows(k), _op_spec(spec))


rope_fp8_dynamic = torch.library.custom_op("ropekit::rope_fp8_dynamic", _rope_fp8_dynamic, mutates_args=(),
                                           schema=op_schema(inplace=False))


@rope_fp8_dynamic.register_fake
def _rope_fp8_dynamic_fake(q, k, *spec):
    return _new_float8([q] if k is None else [q, k], OutQuant(RopeSpec(*spec).out_dtype, dynamic=True))


# --- the attention prologue: ropekit::qk_norm_rope (+ its backward) and ropekit::rope_kv_write ------------------

def _norm_rope_torch(q, k, q_weight, k_weight, weight_offset, eps, spec: RopeSpec) -> list[Tensor]:
    """The torch path of norm + RoPE (float64; float32 on devices without Triton kernels): [q_out, k_out]."""
    from ropekit.float32_path import rope_float32
    from ropekit.reference import rms_norm_reference, rope_reference

    f32 = uses_float32_path(q)
    dtype = torch.float32 if f32 else torch.float64
    qn = rms_norm_reference(q, q_weight, weight_offset, eps, dtype)
    kn = rms_norm_reference(k, k_weight, weight_offset, eps, dtype)
    return (rope_float32 if f32 else rope_reference)(qn, kn, spec._replace(out_dtype=q.dtype))


def norm_rotate(q, k, q_weight, k_weight, weight_offset: float, eps: float, spec: RopeSpec) -> list[Tensor]:
    """The body of ``ropekit::qk_norm_rope``: [q_out, k_out], new tensors in q's and k's dtypes."""
    if q.device.type == "meta":  # shapes only: the op's fake
        return _qk_norm_rope_fake(q, k)
    if not uses_kernels(q):
        return _norm_rope_torch(q, k, q_weight, k_weight, weight_offset, eps, spec)
    from ropekit.triton.prologue_launcher import launch_prologue

    q_out, k_out = _new_outputs(q, k, None)
    launch_prologue(q, k, q_out, k_out, spec, q_weight=q_weight, k_weight=k_weight, weight_offset=weight_offset,
                    eps=eps)
    return [q_out, k_out]


def _qk_norm_rope(q, k, q_weight, k_weight, weight_offset, eps, *spec) -> list[Tensor]:
    return norm_rotate(_dense_rows(q), _dense_rows(k), q_weight, k_weight, weight_offset, eps, _op_spec(spec))


def norm_rope_grads(grad_q, grad_k, q, k, q_weight, k_weight, weight_offset: float, eps: float,
                    spec: RopeSpec) -> list[Tensor]:
    """The body of ``ropekit::qk_norm_rope_backward``: [dq, dk, dq_weight, dk_weight] in the inputs' dtypes."""
    if q.device.type == "meta":  # shapes only: the op's fake
        return _qk_norm_rope_backward_fake(grad_q, grad_k, q, k, q_weight, k_weight)
    if uses_kernels(q):
        from ropekit.triton.prologue_launcher import launch_norm_rope_bwd

        # the kernel takes any strides but the last
        grad_q = grad_q if grad_q.stride(-1) == 1 else grad_q.contiguous()
        grad_k = grad_k if grad_k.stride(-1) == 1 else grad_k.contiguous()
        dq, dk, dqw, dkw = launch_norm_rope_bwd(grad_q, q, grad_k, k, spec, q_weight, k_weight, weight_offset, eps)
    else:  # the transposed rotation, then the norm's backward, in the torch path's precision
        from ropekit.float32_path import rope_float32
        from ropekit.reference import rms_norm_backward_reference, rope_reference

        dtype = torch.float32 if uses_float32_path(q) else torch.float64
        rotate = rope_float32 if dtype == torch.float32 else rope_reference
        gq, gk = rotate(grad_q.to(dtype), grad_k.to(dtype), spec._replace(conjugate=not spec.conjugate,
                                                                            out_dtype=dtype))
        dq, dqw = rms_norm_backward_reference(q, q_weight, weight_offset, eps, gq, dtype)
        dk, dkw = rms_norm_backward_reference(k, k_weight, weight_offset, eps, gk, dtype)
    return [dq.to(q.dtype), dk.to(k.dtype), dqw.to(q_weight.dtype), dkw.to(k_weight.dtype)]


def _qk_norm_rope_backward(grad_q, grad_k, q, k, q_weight, k_weight, weight_offset, eps, *spec) -> list[Tensor]:
    return norm_rope_grads(grad_q, grad_k, _dense_rows(q), _dense_rows(k), q_weight, k_weight, weight_offset, eps,
                           _op_spec(spec))


_NORM = "Tensor q_weight, Tensor k_weight, float weight_offset, float eps"
qk_norm_rope = torch.library.custom_op("ropekit::qk_norm_rope", _qk_norm_rope, mutates_args=(),
                                       schema=op_schema(False, f"Tensor q, Tensor k, {_NORM}"))
qk_norm_rope_backward = torch.library.custom_op(
    "ropekit::qk_norm_rope_backward", _qk_norm_rope_backward, mutates_args=(),
    schema=op_schema(False, f"Tensor grad_q, Tensor grad_k, Tensor q, Tensor k, {_NORM}"))


@qk_norm_rope.register_fake
def _qk_norm_rope_fake(q, k, *args):
    return _new_outputs(q, k, None)


@qk_norm_rope_backward.register_fake
def _qk_norm_rope_backward_fake(grad_q, grad_k, q, k, q_weight, k_weight, *args):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(q_weight), torch.empty_like(k_weight)]


def write_kv(q, k, v, q_weight, k_weight, weight_offset: float, eps: float, spec: RopeSpec,
             cache: CacheSpec) -> Tensor:
    """The body of ``ropekit::rope_kv_write``: the rotated q (a new tensor); k and v written into the caches."""
    if uses_kernels(q):
        from ropekit.triton.prologue_launcher import launch_prologue

        q_out = q.new_empty(q.shape)
        launch_prologue(q, k, q_out, None, spec, v=v, cache=cache, q_weight=q_weight, k_weight=k_weight,
                        weight_offset=weight_offset, eps=eps)
        # the kernel's writes are invisible to autograd: declare them, as torch's own in-place ops do
        torch.autograd.graph.increment_version(cache.k_cache)
        torch.autograd.graph.increment_version(cache.v_cache)
        return q_out
    from ropekit.reference import kv_write_reference

    with torch.no_grad():
        return kv_write_reference(q, k, v, q_weight, k_weight, weight_offset, eps, spec, cache,
                                  torch.float32 if uses_float32_path(q) else torch.float64)


def _float8_outputs(xs: list[Tensor], ys: list[Tensor], quant: OutQuant) -> list[Tensor]:
    """The torch path's float8 outputs of the rotated ``ys`` (math dtype) of ``xs``: [outputs..., and with dynamic
    scales, their scales...]."""
    from ropekit.reference import to_float8, to_float8_dynamic

    if quant.dynamic:
        pairs = [to_float8_dynamic(y, quant.dtype) for y in ys]
        return [p[0] for p in pairs] + [p[1] for p in pairs]
    scales = (quant.q_scale, quant.k_scale)
    return [to_float8(y, quant.dtype, float(s)).view(x.shape) for x, y, s in zip(xs, ys, scales)]


def _new_float8(xs: list[Tensor], quant: OutQuant) -> list[Tensor]:
    """Fresh float8 outputs shaped like ``xs`` and, with dynamic scales, their float32 scales x.shape[:-1]."""
    outs = [x.new_empty(x.shape, dtype=quant.dtype) for x in xs]
    if quant.dynamic:
        outs += [x.new_empty(x.shape[:-1], dtype=torch.float32) for x in xs]
    return outs


def norm_rotate_float8(q, k, q_weight, k_weight, weight_offset: float, eps: float, spec: RopeSpec,
                       quant: OutQuant) -> list[Tensor]:
    """qk_norm_rope with float8 outputs (inference only): [q_out, k_out] and, with dynamic scales, [q_scales,
    k_scales] after them."""
    if uses_kernels(q):
        from ropekit.triton.prologue_launcher import launch_prologue

        outs = _new_float8([q, k], quant)
        launch_prologue(q, k, outs[0], outs[1], spec, q_weight=q_weight, k_weight=k_weight,
                        weight_offset=weight_offset, eps=eps, quant=quant, q_scales=outs[2] if quant.dynamic else None,
                        k_scales=outs[3] if quant.dynamic else None)
        return outs
    from ropekit.float32_path import rope_float32
    from ropekit.reference import rms_norm_reference, rope_reference

    dtype = torch.float32 if uses_float32_path(q) else torch.float64
    qn, kn = rms_norm_reference(q, q_weight, weight_offset, eps, dtype), rms_norm_reference(k, k_weight,
                                                                                            weight_offset, eps, dtype)
    ys = (rope_float32 if dtype == torch.float32 else rope_reference)(qn, kn, spec._replace(out_dtype=dtype))
    return _float8_outputs([q, k], ys, quant)


def _qk_norm_rope_fp8(q, k, q_weight, k_weight, weight_offset, eps, fp8_dtype, q_scale_t, k_scale_t, q_scale_f,
                      k_scale_f, dynamic, *spec) -> list[Tensor]:
    quant = OutQuant(fp8_dtype, q_scale_t if q_scale_t is not None else q_scale_f,
                     k_scale_t if k_scale_t is not None else k_scale_f, dynamic)
    return norm_rotate_float8(_dense_rows(q), _dense_rows(k), q_weight, k_weight, weight_offset, eps, _op_spec(spec),
                              quant)


qk_norm_rope_fp8 = torch.library.custom_op(
    "ropekit::qk_norm_rope_fp8", _qk_norm_rope_fp8, mutates_args=(),
    schema=op_schema(False, "Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float weight_offset, float eps, "
                            "ScalarType fp8_dtype, Tensor? q_scale_t, Tensor? k_scale_t, float q_scale_f, "
                            "float k_scale_f, bool dynamic"))


@qk_norm_rope_fp8.register_fake
def _qk_norm_rope_fp8_fake(q, k, q_weight, k_weight, weight_offset, eps, fp8_dtype, *rest):
    return _new_float8([q, k], OutQuant(fp8_dtype, dynamic=rest[4]))


def qk_norm_rope_fp8_args(quant: OutQuant) -> tuple:
    """``quant`` as ``ropekit::qk_norm_rope_fp8`` takes it: (dtype, q's and k's scale tensors or None, their float
    scales, dynamic)."""
    def split(scale):
        return (scale, 1.0) if isinstance(scale, Tensor) else (None, 1.0 if scale is None else scale)

    (qt, qf), (kt, kf) = split(quant.q_scale), split(quant.k_scale)
    return quant.dtype, qt, kt, qf, kf, quant.dynamic


def write_kv_outputs(q, k, v, q_weight, k_weight, weight_offset: float, eps: float, spec: RopeSpec,
                     cache: CacheSpec, quant: OutQuant | None, return_k: bool) -> list[Tensor]:
    """rope_kv_write with a float8 q output (``quant``) and/or the rotated k (``return_k``): [q_out, then q_scales
    (dynamic scales), then k_out (k's dtype)]; k and v written into the caches."""
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if return_k else None  # dense: plans replay it
    if uses_kernels(q):
        from ropekit.triton.prologue_launcher import launch_prologue

        outs = _new_float8([q], quant) if quant is not None else [q.new_empty(q.shape)]
        launch_prologue(q, k, outs[0], None, spec, v=v, cache=cache, q_weight=q_weight, k_weight=k_weight,
                        weight_offset=weight_offset, eps=eps, quant=quant,
                        q_scales=outs[1] if quant is not None and quant.dynamic else None, k_rotated=k_out)
        torch.autograd.graph.increment_version(cache.k_cache)
        torch.autograd.graph.increment_version(cache.v_cache)
        return outs + ([k_out] if return_k else [])
    from ropekit.reference import kv_write_reference

    dtype = torch.float32 if uses_float32_path(q) else torch.float64
    with torch.no_grad():  # float8: the rotated q in the math dtype (q's values, upcast exactly), rounded once below
        y = kv_write_reference(q.to(dtype) if quant is not None else q, k, v, q_weight, k_weight, weight_offset, eps,
                               spec, cache, dtype, k_out=k_out)
    outs = _float8_outputs([q], [y], quant) if quant is not None else [y]
    return outs + ([k_out] if return_k else [])


def cache_op_args(cache: CacheSpec) -> tuple:
    """``cache``'s fields after the two caches, as ``ropekit::rope_kv_write`` takes them (a scale is a tensor or a
    float: one slot of each)."""
    def split(scale):
        return (scale, 1.0) if isinstance(scale, Tensor) else (None, scale)

    (kt, kf), (vt, vf) = split(cache.k_scale), split(cache.v_scale)
    return (cache.layout, cache.cache_batch, cache.slots, kt, vt, kf, vf, cache.kv_indices, cache.kv_indptr,
            cache.kv_last_page_len, cache.batch_indices)



def _cache_spec(k_cache, v_cache, layout, cache_batch, slots, k_scale_t, v_scale_t, k_scale, v_scale, kv_indices,
                kv_indptr, kv_last_page_len, batch_indices) -> CacheSpec:
    """The inverse of :func:`cache_op_args`: the CacheSpec of the cache-writing ops' arguments."""
    return CacheSpec(k_cache, v_cache, layout, cache_batch, slots, k_scale if k_scale_t is None else k_scale_t,
                     v_scale if v_scale_t is None else v_scale_t, kv_indices, kv_indptr, kv_last_page_len,
                     batch_indices)


def _kv_inputs(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
               cache_layout: str) -> tuple[Tensor, Tensor, Tensor]:
    """The cache-writing ops' q, k, v as the kernels read them (:func:`_dense_rows`), after refusing caches whose
    last dim is not contiguous -- except "paged_x" values, [num_blocks, Hkv, D, block_size]: their last dim is a
    block's rows, which the kernel addresses by stride, so only a stride of 0 (rows sharing elements) is refused."""
    check_last_dim("k_cache", k_cache)
    if cache_layout != "paged_x":
        check_last_dim("v_cache", v_cache)
    elif v_cache.stride(-1) == 0 and v_cache.shape[-1] > 1:
        raise ValueError(f"v_cache's last dim (a block's rows, cache_layout='paged_x') has stride 0: its rows share "
                         f"elements; got strides {tuple(v_cache.stride())}")
    return _dense_rows(q), _dense_rows(k), _dense_rows(v)


def _rope_kv_write(q, k, v, k_cache, v_cache, q_weight, k_weight, weight_offset, eps, cache_layout, cache_batch,
                   slots, k_cache_scale_t, v_cache_scale_t, k_cache_scale, v_cache_scale, kv_indices, kv_indptr,
                   kv_last_page_len, batch_indices, *spec) -> Tensor:
    q, k, v = _kv_inputs(q, k, v, k_cache, v_cache, cache_layout)
    cache = _cache_spec(k_cache, v_cache, cache_layout, cache_batch, slots, k_cache_scale_t, v_cache_scale_t,
                        k_cache_scale, v_cache_scale, kv_indices, kv_indptr, kv_last_page_len, batch_indices)
    return write_kv(q, k, v, q_weight, k_weight, weight_offset, eps, _op_spec(spec), cache)


# The two cache-writing ops' arguments before their own: the inputs, the mutated caches, the norm and the cache's
# description (what _cache_spec takes).
_KV_WRITE_SCHEMA = ("Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? q_weight, "
                    "Tensor? k_weight, float weight_offset, float eps, str cache_layout, Tensor? cache_batch, "
                    "Tensor? slots, Tensor? k_cache_scale_t, Tensor? v_cache_scale_t, float k_cache_scale, "
                    "float v_cache_scale, Tensor? kv_indices, Tensor? kv_indptr, Tensor? kv_last_page_len, "
                    "Tensor? batch_indices")

rope_kv_write = torch.library.custom_op(
    "ropekit::rope_kv_write", _rope_kv_write, mutates_args=("k_cache", "v_cache"),
    schema=op_schema(False, _KV_WRITE_SCHEMA, returns="Tensor"))


@rope_kv_write.register_fake
def _rope_kv_write_fake(q, *args):
    return q.new_empty(q.shape)


def _rope_kv_write_outputs(q, k, v, k_cache, v_cache, q_weight, k_weight, weight_offset, eps, cache_layout,
                           cache_batch, slots, k_cache_scale_t, v_cache_scale_t, k_cache_scale, v_cache_scale,
                           kv_indices, kv_indptr, kv_last_page_len, batch_indices, fp8_dtype, q_scale_t, q_scale_f,
                           dynamic, return_k, *spec) -> tuple[Tensor, Tensor, Tensor]:
    """rope_kv_write's float8 q and/or rotated k as one registered op (fixed arity: torch.compile refuses a list
    returned beside mutated caches): (q_out, q_scales or an empty tensor, k_out or an empty tensor)."""
    q, k, v = _kv_inputs(q, k, v, k_cache, v_cache, cache_layout)
    cache = _cache_spec(k_cache, v_cache, cache_layout, cache_batch, slots, k_cache_scale_t, v_cache_scale_t,
                        k_cache_scale, v_cache_scale, kv_indices, kv_indptr, kv_last_page_len, batch_indices)
    quant = None if fp8_dtype is None else OutQuant(fp8_dtype, q_scale_f if q_scale_t is None else q_scale_t, None,
                                                    dynamic)
    outs = write_kv_outputs(q, k, v, q_weight, k_weight, weight_offset, eps, _op_spec(spec), cache, quant, return_k)
    return (outs[0], outs[1] if quant is not None and dynamic else q.new_empty(0, dtype=torch.float32),
            outs[-1] if return_k else k.new_empty(0))


rope_kv_write_outputs = torch.library.custom_op(
    "ropekit::rope_kv_write_outputs", _rope_kv_write_outputs, mutates_args=("k_cache", "v_cache"),
    schema=op_schema(False, _KV_WRITE_SCHEMA + ", ScalarType? fp8_dtype, Tensor? q_scale_t, float q_scale_f, "
                            "bool dynamic, bool return_k",
                     returns="(Tensor, Tensor, Tensor)"))


@rope_kv_write_outputs.register_fake
def _rope_kv_write_outputs_fake(q, k, *args):
    fp8_dtype, _, _, dynamic, return_k = args[18:23]
    scales_shape = q.shape[:-1] if fp8_dtype is not None and dynamic else (0,)
    return (q.new_empty(q.shape, dtype=fp8_dtype or q.dtype), q.new_empty(scales_shape, dtype=torch.float32),
            k.new_empty(k.shape if return_k else (0,)))


def kv_quant_args(quant: OutQuant | None) -> tuple:
    """``quant`` (rope_kv_write's float8 q, or None) as ``ropekit::rope_kv_write_outputs`` takes it: (dtype, scale
    tensor or None, float scale, dynamic)."""
    if quant is None:
        return None, None, 1.0, False
    scale = quant.q_scale
    if isinstance(scale, Tensor):
        return quant.dtype, scale, 1.0, quant.dynamic
    return quant.dtype, None, 1.0 if scale is None else scale, quant.dynamic


# --- RoPE attention -------------------------------------------------------------------------------------------

def _canonical_qkv(q: Tensor, k: Tensor, v: Tensor, layout: str) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as canonical [B, S, H, D] views (the angle rows arrive canonical already, [B or 1, S, D])."""
    return to_canonical(q, layout), to_canonical(k, layout), to_canonical(v, layout)


def _attention_out(q: Tensor, v: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    """(o in ``layout`` with v's head dim, contiguous; lse [B, HQ, S] float32, float64 for float64 q), unwritten."""
    shape = list(q.shape)
    shape[-1] = v.shape[-1]
    o = q.new_empty(shape)
    B, S, HQ, _ = to_canonical(q, layout).shape
    return o, q.new_empty((B, HQ, S), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)


def attention_forward(q, k, v, angles, cu_seqlens, layout, rotary_start, rotary_dim, neox, q_scale, k_scale,
                      qk_mult, causal, max_seqlen) -> tuple[Tensor, Tensor]:
    """The body of ``ropekit::rope_attention``: (o, lse), new tensors. q, k, v, ``angles`` and ``cu_seqlens``
    with a contiguous last dim (the op's wrapper sees to it)."""
    o, lse = _attention_out(q, v, layout)
    qc, kc, vc = _canonical_qkv(q, k, v, layout)
    oc = to_canonical(o, layout)
    if uses_kernels(q):
        from ropekit.triton.attention_launcher import Rotation, launch_forward

        launch_forward(qc, kc, vc, angles, oc, lse, Rotation(rotary_start, rotary_dim, neox), q_scale, k_scale,
                       qk_mult, causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    else:
        from ropekit.reference import rope_attention_reference

        o64, lse64 = rope_attention_reference(qc, kc, vc, angles, rotary_start, rotary_dim, neox, q_scale, k_scale,
                                              qk_mult, causal, cu_seqlens)
        oc.copy_(o64)
        lse.copy_(lse64)
    return o, lse


def attention_backward(do, dlse, q, k, v, angles, cu_seqlens, o, lse, layout, rotary_start, rotary_dim, neox,
                       q_scale, k_scale, qk_mult, causal, max_seqlen) -> tuple[Tensor, Tensor, Tensor]:
    """The body of ``ropekit::rope_attention_backward``: (dq, dk, dv), new tensors. q, k, v, ``angles``,
    ``cu_seqlens`` and o with a contiguous last dim, lse contiguous (the op's wrapper sees to it); ``do`` and
    ``dlse`` may have any strides."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    qc, kc, vc = _canonical_qkv(q, k, v, layout)
    if uses_kernels(q):
        from ropekit.triton.attention_launcher import Rotation, launch_backward

        do = do if do.stride(-1) == 1 else do.contiguous()
        launch_backward(to_canonical(do, layout), None if dlse is None else dlse.float().contiguous(), qc, kc, vc,
                        angles, to_canonical(o, layout), lse, to_canonical(dq, layout), to_canonical(dk, layout),
                        to_canonical(dv, layout), Rotation(rotary_start, rotary_dim, neox), q_scale, k_scale,
                        qk_mult, causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        return dq, dk, dv
    from ropekit.reference import rope_attention_backward_reference

    grads = rope_attention_backward_reference(to_canonical(do, layout), dlse, qc, kc, vc, angles, rotary_start,
                                              rotary_dim, neox, q_scale, k_scale, qk_mult, causal, cu_seqlens)
    for out, g in zip((dq, dk, dv), grads):
        to_canonical(out, layout).copy_(g)
    return dq, dk, dv


def _rope_attention(q, k, v, angles, cu_seqlens, *params) -> tuple[Tensor, Tensor]:
    return attention_forward(_dense_rows(q), _dense_rows(k), _dense_rows(v), _dense_rows(angles),
                             _dense_rows(cu_seqlens), *params)


def _rope_attention_backward(do, dlse, q, k, v, angles, cu_seqlens, o, lse, *params) -> tuple[Tensor, Tensor, Tensor]:
    # the kernels index lse [B, HQ, S] as a contiguous block, not by strides
    return attention_backward(do, dlse, _dense_rows(q), _dense_rows(k), _dense_rows(v), _dense_rows(angles),
                              _dense_rows(cu_seqlens), _dense_rows(o), lse.contiguous(), *params)


_ATTENTION_ARGS = ("str layout, int rotary_start, int rotary_dim, bool neox, float q_scale, float k_scale, "
                   "float qk_mult, bool causal, int max_seqlen")
rope_attention = torch.library.custom_op(
    "ropekit::rope_attention", _rope_attention, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor angles, Tensor? cu_seqlens, {_ATTENTION_ARGS}) -> (Tensor, Tensor)")
rope_attention_backward = torch.library.custom_op(
    "ropekit::rope_attention_backward", _rope_attention_backward, mutates_args=(),
    schema=("(Tensor do, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor angles, Tensor? cu_seqlens, Tensor o, "
            f"Tensor lse, {_ATTENTION_ARGS}) -> (Tensor, Tensor, Tensor)"))


@rope_attention.register_fake
def _rope_attention_fake(q, k, v, angles, cu_seqlens, layout, *args):
    return _attention_out(q, v, layout)


@rope_attention_backward.register_fake
def _rope_attention_backward_fake(do, dlse, q, k, v, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# --- MLA: ropekit::mla_rope (differentiable) and ropekit::mla_rope_kv_write (writes the latent cache) ----------

def _mla_outputs(q: Tensor, k_pe: Tensor, k_heads: int, split_q: bool, rotary_dim: int,
                 q_outs: tuple = (None, None), out_dtype: torch.dtype | None = None) -> list[Tensor]:
    """``[q_out, k_out]`` or ``[q_nope, q_pe, k_out]`` (k_pe's shape with ``k_heads`` heads): the q outputs given in
    ``q_outs`` (the whole q's in its first slot), new tensors of ``out_dtype`` (None: q's) for the others."""
    dtype = out_dtype or q.dtype
    if split_q:
        shapes = ((*q.shape[:-1], q.shape[-1] - rotary_dim), (*q.shape[:-1], rotary_dim))
        outs = [given if given is not None else q.new_empty(shape, dtype=dtype) for given, shape in zip(q_outs, shapes)]
    else:
        outs = [q_outs[0] if q_outs[0] is not None else q.new_empty(q.shape, dtype=dtype)]
    return [*outs, k_pe.new_empty((*k_pe.shape[:-2], k_heads, k_pe.shape[-1]), dtype=dtype)]


def mla_rotate(q: Tensor, k_pe: Tensor, k_heads: int, split_q: bool, spec: RopeSpec, q_outs: tuple = (None, None),
               **cache) -> list[Tensor]:
    """The body of both MLA ops: the rotated q (whole, or split; into ``q_outs`` where given) and k_pe, in
    ``spec.out_dtype`` (float8: divided by ``out_scales``), and with ``cache`` (the keywords of
    :func:`ropekit.triton.mla_launcher.launch_mla` after the outputs) each token's latent cache row."""
    outs = _mla_outputs(q, k_pe, k_heads, split_q, spec.rotary_dim, q_outs, spec.out_dtype)
    if uses_kernels(q):
        from ropekit.triton.mla_launcher import launch_mla

        q_nope, q_pe = (outs[0], outs[1]) if split_q else (outs[0], outs[0])
        launch_mla(q, k_pe, q_nope, q_pe, outs[-1], spec, **cache)
        # the kernel's writes into given tensors are invisible to autograd: declare them
        for written in (cache.get("ckv_cache"), cache.get("kpe_cache"), *q_outs):
            if written is not None:
                torch.autograd.graph.increment_version(written)
        return outs
    from ropekit.reference import mla_reference

    with torch.no_grad():  # float64 math on the CPU (the reference), float32 where float64 may be missing (MPS)
        mla_reference(q, k_pe, outs, spec, **cache,
                      math_dtype=torch.float64 if q.device.type in ("cpu", "cuda") else torch.float32)
    return outs


def _mla_rope(q, k_pe, k_heads, split_q, *spec) -> list[Tensor]:
    return mla_rotate(_dense_rows(q), _dense_rows(k_pe), k_heads, split_q, _op_spec(spec))


def _new_outputs_only(q: Tensor, outs: list[Tensor], q_outs: tuple, split_q: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``ropekit::mla_rope_kv_write``'s fixed outputs (a list output of an op that mutates its arguments is not
    functionalised): q or q_nope, q_pe, k_out -- an empty tensor in place of a q output the caller gave (an output
    may not alias an argument) and of q_pe when q is not split."""
    parts = outs[:-1] if split_q else [outs[0], None]
    kept = [q.new_empty(0) if out is None or given is not None else out for out, given in zip(parts, q_outs)]
    return kept[0], kept[1], outs[-1]


def _mla_rope_kv_write(q, k_pe, kv_c, ckv_cache, kpe_cache, q_nope_out, q_pe_out, slots, paged, cache_scale_t,
                       cache_scale, q_out_scale_t, k_out_scale_t, q_out_scale, k_out_scale, k_heads, split_q,
                       *spec) -> tuple[Tensor, Tensor, Tensor]:
    for name, written in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache), ("q_nope_out", q_nope_out),
                          ("q_pe_out", q_pe_out)):
        if written is not None:
            check_last_dim(name, written)
    q_outs = (q_nope_out, q_pe_out)
    out_scales = (q_out_scale, k_out_scale) if q_out_scale_t is None else (q_out_scale_t, k_out_scale_t)
    q, k_pe, kv_c = _dense_rows(q), _dense_rows(k_pe), _dense_rows(kv_c)
    outs = mla_rotate(q, k_pe, k_heads, split_q, _op_spec(spec), q_outs, kv_c=kv_c, ckv_cache=ckv_cache,
                      kpe_cache=kpe_cache, slots=slots, paged=paged,
                      cache_scale=cache_scale if cache_scale_t is None else cache_scale_t, out_scales=out_scales)
    return _new_outputs_only(q, outs, q_outs, split_q)


_MLA = "int k_heads, bool split_q"
mla_rope = torch.library.custom_op("ropekit::mla_rope", _mla_rope, mutates_args=(),
                                   schema=op_schema(False, f"Tensor q, Tensor k_pe, {_MLA}"))
# Without split_q, q_nope_out holds the whole q's output.
mla_rope_kv_write = torch.library.custom_op(
    "ropekit::mla_rope_kv_write", _mla_rope_kv_write,
    mutates_args=("ckv_cache", "kpe_cache", "q_nope_out", "q_pe_out"),
    schema=op_schema(False, "Tensor q, Tensor k_pe, Tensor? kv_c, Tensor(a!)? ckv_cache, Tensor(b!)? kpe_cache, "
                            "Tensor(c!)? q_nope_out, Tensor(d!)? q_pe_out, Tensor? slots, bool paged, "
                            "Tensor? cache_scale_t, float cache_scale, Tensor? q_out_scale_t, Tensor? k_out_scale_t, "
                            f"float q_out_scale, float k_out_scale, {_MLA}",
                     returns="(Tensor, Tensor, Tensor)"))


@mla_rope.register_fake
def _mla_rope_fake(q, k_pe, k_heads, split_q, *spec):
    spec = RopeSpec(*spec)
    return _mla_outputs(q, k_pe, k_heads, split_q, spec.rotary_dim, out_dtype=spec.out_dtype)


@mla_rope_kv_write.register_fake
def _mla_rope_kv_write_fake(q, k_pe, kv_c, ckv_cache, kpe_cache, q_nope_out, q_pe_out, slots, paged, cache_scale_t,
                            cache_scale, q_out_scale_t, k_out_scale_t, q_out_scale, k_out_scale, k_heads, split_q,
                            *spec):
    q_outs, spec = (q_nope_out, q_pe_out), RopeSpec(*spec)
    outs = _mla_outputs(q, k_pe, k_heads, split_q, spec.rotary_dim, q_outs, spec.out_dtype)
    return _new_outputs_only(q, outs, q_outs, split_q)


# --- the diffusion transformers' whole-hidden norm + RoPE: ropekit::qk_hidden_norm_rope -------------------------

def hidden_norm_rotate(q, k, q_weight, k_weight, v, weight_offset: float, eps: float, spec: RopeSpec) -> list[Tensor]:
    """The body of ``ropekit::qk_hidden_norm_rope``: [q_out, k_out] (and v's copy in q's dtype where v is given),
    new tensors; one kernel launch, else the torch path (the norm of :mod:`ropekit._hidden_norm`, then the
    rotation in the same precision, one rounding at the end). q and k with a contiguous last dim (validated, or
    the op's wrapper sees to it); v and the weights any strides."""
    from ropekit import _hidden_norm

    if uses_kernels(q):
        from ropekit.triton.hidden_norm_launcher import launch_hidden_norm_rope

        v = _dense_rows(v)  # v may have any strides (the public contract); the kernel steps through columns by one
        outs = _new_outputs(q, k, None)
        if v is not None:
            outs.append(v.new_empty(v.shape, dtype=q.dtype))
        launch_hidden_norm_rope(q, k, outs[0], outs[1], spec, q_weight, k_weight, weight_offset, eps, v=v,
                                v_out=outs[2] if v is not None else None)
        return outs
    from ropekit.float32_path import rope_float32
    from ropekit.reference import rope_reference

    f32 = uses_float32_path(q)
    dtype = torch.float32 if f32 else torch.float64
    qn = _hidden_norm.hidden_rms_norm(q, q_weight, eps, weight_offset, spec.layout, dtype)
    kn = _hidden_norm.hidden_rms_norm(k, k_weight, eps, weight_offset, spec.layout, dtype)
    outs = list((rope_float32 if f32 else rope_reference)(qn, kn, spec._replace(out_dtype=q.dtype)))
    return outs if v is None else [*outs, _hidden_norm.copy_v(v, q.dtype)]


def _qk_hidden_norm_rope(q, k, q_weight, k_weight, v, weight_offset, eps, *spec) -> list[Tensor]:
    return hidden_norm_rotate(_dense_rows(q), _dense_rows(k), q_weight, k_weight, v, weight_offset, eps,
                              _op_spec(spec))


qk_hidden_norm_rope = torch.library.custom_op(
    "ropekit::qk_hidden_norm_rope", _qk_hidden_norm_rope, mutates_args=(),
    schema=op_schema(False, "Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor? v, float weight_offset, "
                            "float eps"))


@qk_hidden_norm_rope.register_fake
def _qk_hidden_norm_rope_fake(q, k, q_weight, k_weight, v, *args):
    outs = _new_outputs(q, k, None)
    return outs if v is None else [*outs, v.new_empty(v.shape, dtype=q.dtype)]
