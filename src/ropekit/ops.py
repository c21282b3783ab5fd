"""torch.library registrations: ``ropekit::rope`` (out of place) and ``ropekit::rope_`` (in place).

Both take ``q``, ``k`` and the fields of a validated :class:`ropekit._spec.RopeSpec`, in the order of the schema
that :func:`ropekit._spec.op_schema` generates from it. CUDA tensors run the Triton kernel (float64 ones the
reference, which keeps float64 math); CPU tensors the float64 reference (the Triton interpreter under
:func:`ropekit.testing.kernels_on_cpu`); other devices (MPS, XPU, ...) the float32 torch path with host-exact
angles (:func:`ropekit.reference.rope_float32`).

:func:`rotate_out_of_place` and :func:`rotate_in_place` are the ops' bodies, callable without the dispatcher by
eager calls that need neither autograd nor tracing (its round trips cost more host time than a decode kernel).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ropekit import _config
from ropekit._spec import RopeSpec, op_schema


def uses_kernels(x: Tensor) -> bool:
    """Whether ``x`` is rotated by the Triton kernels (fp32 math) rather than a torch path."""
    if x.dtype == torch.float64:
        return False
    return x.device.type == "cuda" or (_config.kernels_on_cpu and x.device.type == "cpu")


def uses_float32_path(x: Tensor) -> bool:
    """Whether ``x`` is rotated by the float32 torch path (:func:`ropekit.reference.rope_float32`): devices other
    than CPU and CUDA, which may lack float64 (MPS), and CPU tensors under
    :func:`ropekit.testing.float32_path_on_cpu`. float64 inputs keep float64 math wherever they exist."""
    if x.dtype == torch.float64:
        return False
    return x.device.type not in ("cpu", "cuda") or (_config.float32_path_on_cpu and x.device.type == "cpu")


def _run(q: Tensor, k: Tensor | None, q_out: Tensor, k_out: Tensor | None, spec: RopeSpec) -> None:
    """Rotate into the given outputs on q's device (outputs may be the inputs)."""
    if uses_kernels(q):
        from ropekit.triton.launcher import launch_rope

        launch_rope(q, k, q_out, k_out, spec)
        if q_out is q:  # a kernel's write is invisible to autograd: declare it (torch's own ops do the same)
            torch.autograd.graph.increment_version(q)
            if k is not None:
                torch.autograd.graph.increment_version(k)
        return
    from ropekit.reference import rope_float32, rope_reference

    rotate = rope_float32 if uses_float32_path(q) else rope_reference
    results = rotate(q, k, spec._replace(out_dtype=q_out.dtype))
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


def _rope(q: Tensor, k: Tensor | None, *spec) -> list[Tensor]:
    return rotate_out_of_place(q, k, RopeSpec(*spec))


def _rope_(q: Tensor, k: Tensor | None, *spec) -> None:
    rotate_in_place(q, k, RopeSpec(*spec))


rope = torch.library.custom_op("ropekit::rope", _rope, mutates_args=(), schema=op_schema(inplace=False))
rope_ = torch.library.custom_op("ropekit::rope_", _rope_, mutates_args=("q", "k"), schema=op_schema(inplace=True))


@rope.register_fake
def _rope_fake(q, k, *spec):
    return _new_outputs(q, k, RopeSpec(*spec).out_dtype)


@rope_.register_fake
def _rope_inplace_fake(q, k, *spec):
    return None
