"""torch.library registrations: ``ropekit::rope`` (out of place) and ``ropekit::rope_`` (in place).

Both take the *normalised* arguments produced by :mod:`ropekit.api` (which validates user input):

* ``q``, ``k``: tensors in ``layout`` ("bshd", "bhsd", "sbhd" or "thd"), last dimension contiguous.
* positions: ``positions`` [B, S] per-token ids, or ``seq_offsets`` [B] added to each sequence's 0..S-1 (or to
  the index inside each ``cu_seqlens`` sequence), or the int ``pos_offset``.
* frequencies: ``freq_mode`` "inv_freq" (``inv_freq`` [R/2]), "table" (``cos``/``sin`` [Bt, rows, W]) or
  "angles" (raw angles in ``cos`` [Bt, rows, W]); W is R/2 or R; rows are positions, or the tokens' ``s`` when
  ``table_by_token``.
* ``rotary_dim`` R columns starting at ``rotary_start`` are rotated; ``conjugate`` rotates by -theta (backward).
* outputs have dtype ``promote_types(x.dtype, promote_dtype)`` (``promote_dtype`` None: the input dtype).

CUDA tensors run the Triton kernel (float64 ones the reference, which keeps float64 math); every other device
runs the float64 reference, except CPU tensors under :func:`ropekit.testing.kernels_on_cpu` (the Triton
interpreter).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ropekit import _config

# Tensor arguments after q and k, then all of the launcher's/reference's arguments, in schema order.
_TENSOR_ARGS = ("positions", "seq_offsets", "cu_seqlens", "inv_freq", "cos", "sin")
_ROPE_ARGS = (
    *_TENSOR_ARGS, "pos_offset", "layout", "style", "freq_mode", "rotary_dim", "rotary_start", "table_by_token",
    "q_scale", "k_scale", "rotary_scale", "conjugate",
)


def _rope_kwargs(args: dict) -> dict:
    """The launcher's/reference's keyword arguments out of an op's arguments (its ``locals()``)."""
    return {name: args[name] for name in _ROPE_ARGS}


def _out_dtype(x: Tensor, promote_dtype: Optional[torch.dtype]) -> torch.dtype:
    return x.dtype if promote_dtype is None else torch.promote_types(x.dtype, promote_dtype)


def uses_kernels(x: Tensor) -> bool:
    """Whether ``x`` is rotated by the Triton kernels (fp32 math) rather than the float64 reference."""
    if x.dtype == torch.float64:
        return False
    return x.device.type == "cuda" or (_config.kernels_on_cpu and x.device.type == "cpu")


def _run(q: Tensor, k: Optional[Tensor], q_out: Tensor, k_out: Optional[Tensor], kwargs: dict) -> None:
    """Rotate into the given outputs on q's device (outputs may be the inputs)."""
    if uses_kernels(q):
        from ropekit.triton.launcher import launch_rope

        launch_rope(q, k, q_out, k_out, **kwargs)
        if q_out is q:  # a kernel's write is invisible to autograd: declare it (torch's own ops do the same)
            torch.autograd.graph.increment_version(q)
            if k is not None:
                torch.autograd.graph.increment_version(k)
        return
    from ropekit.reference import rope_reference

    results = rope_reference(q, k, out_dtype=q_out.dtype, **kwargs)
    q_out.copy_(results[0])
    if k is not None:
        k_out.copy_(results[1])


def rope_out_of_place(
    q: Tensor, k: Optional[Tensor], positions: Optional[Tensor], seq_offsets: Optional[Tensor],
    cu_seqlens: Optional[Tensor], inv_freq: Optional[Tensor], cos: Optional[Tensor], sin: Optional[Tensor],
    pos_offset: int, layout: str, style: str, freq_mode: str, rotary_dim: int, rotary_start: int,
    table_by_token: bool, q_scale: float, k_scale: float, rotary_scale: float, conjugate: bool,
    promote_dtype: Optional[torch.dtype],
) -> list[Tensor]:
    """Out-of-place rotation; returns ``[q_out]`` or ``[q_out, k_out]`` (fresh tensors in ``layout``).

    Eager calls that need neither autograd nor tracing call this directly; everything else goes through the
    registered op ``ropekit::rope`` below, which runs the same body."""
    kwargs = _rope_kwargs(locals())
    q_out = torch.empty(q.shape, dtype=_out_dtype(q, promote_dtype), device=q.device)
    k_out = None if k is None else torch.empty(k.shape, dtype=_out_dtype(k, promote_dtype), device=k.device)
    _run(q, k, q_out, k_out, kwargs)
    return [q_out] if k is None else [q_out, k_out]


rope = torch.library.custom_op("ropekit::rope", rope_out_of_place, mutates_args=())


@rope.register_fake
def _rope_fake(q, k, positions, seq_offsets, cu_seqlens, inv_freq, cos, sin, pos_offset, layout, style, freq_mode,
               rotary_dim, rotary_start, table_by_token, q_scale, k_scale, rotary_scale, conjugate, promote_dtype):
    outs = [q.new_empty(q.shape, dtype=_out_dtype(q, promote_dtype))]
    if k is not None:
        outs.append(k.new_empty(k.shape, dtype=_out_dtype(k, promote_dtype)))
    return outs


def rope_in_place(
    q: Tensor, k: Optional[Tensor], positions: Optional[Tensor], seq_offsets: Optional[Tensor],
    cu_seqlens: Optional[Tensor], inv_freq: Optional[Tensor], cos: Optional[Tensor], sin: Optional[Tensor],
    pos_offset: int, layout: str, style: str, freq_mode: str, rotary_dim: int, rotary_start: int,
    table_by_token: bool, q_scale: float, k_scale: float, rotary_scale: float, conjugate: bool,
) -> None:
    """In-place rotation of ``q`` (and ``k``); registered as ``ropekit::rope_``."""
    _run(q, k, q, k, _rope_kwargs(locals()))


rope_ = torch.library.custom_op("ropekit::rope_", rope_in_place, mutates_args=("q", "k"))


@rope_.register_fake
def _rope_inplace_fake(q, k, positions, seq_offsets, cu_seqlens, inv_freq, cos, sin, pos_offset, layout, style,
                       freq_mode, rotary_dim, rotary_start, table_by_token, q_scale, k_scale, rotary_scale,
                       conjugate):
    return None
