"""Bound launches for the eager fast path (:mod:`ropekit._fastpath`): ``rope_kernel`` with its grid and every
argument fixed except the data pointers and the position offset.

A :class:`BoundLaunch` calls Triton's compiled launcher directly with integer pointers, on the current stream of
the kernel's device: no argument binding, hashing or pointer-attribute query per call. An
:class:`InterpretedLaunch` is its twin for CPU tensors under the Triton interpreter (the fast path's CPU-testable
form). The slots a call fills are found by the kernel's parameter names, so a change of the kernel's signature
cannot silently shift them.
"""

from __future__ import annotations

import torch

from ropekit._spec import RopeSpec
from ropekit.triton import kernel
from ropekit.triton.launcher import (
    _COMPILED,
    _CONSTEXPR_NAMES,
    _cache_key,
    _current_device,
    _current_raw_stream,
    _launch_hooks_idle,
    kernel_launch,
)

# What a call fills, by the kernel's parameter names, in the order BoundLaunch.__call__ takes them.
VARYING_ARGS = ("q_ptr", "qo_ptr", "k_ptr", "ko_ptr", "pos_ptr", "seq_off_ptr", "cu_ptr", "freq_ptr", "cos_ptr",
                "sin_ptr", "pos_offset")
_INDEX = {name: i for i, name in enumerate(kernel.rope_kernel.arg_names)}
(_Q, _QO, _K, _KO, _POS, _SEQ_OFF, _CU, _FREQ, _COS, _SIN, _POS_OFFSET) = (_INDEX[n] for n in VARYING_ARGS)
_VARYING = frozenset(_INDEX[n] for n in VARYING_ARGS)


class _Bound:
    """The launch's arguments with the varying slots blank; ``_fill`` puts a call's values in."""

    __slots__ = ("_template",)

    def __init__(self, args: tuple):
        # No tensor of the call that made the plan is kept: its slots are blank.
        self._template = [None if i in _VARYING else a for i, a in enumerate(args)]

    def _fill(self, q, q_out, k, k_out, positions, seq_offsets, cu_seqlens, inv_freq, cos, sin,
              pos_offset: int) -> list:
        args = self._template.copy()
        args[_Q] = q
        args[_QO] = q_out
        args[_K] = k
        args[_KO] = k_out
        args[_POS] = positions
        args[_SEQ_OFF] = seq_offsets
        args[_CU] = cu_seqlens
        args[_FREQ] = inv_freq
        args[_COS] = cos
        args[_SIN] = sin
        args[_POS_OFFSET] = pos_offset
        return args


class BoundLaunch(_Bound):
    """One compiled specialisation of ``rope_kernel`` bound to its grid and fixed arguments; a call passes the ten
    data pointers (q, q_out, k, k_out, positions, seq_offsets, cu_seqlens, inv_freq, cos, sin, as ints) and the
    position offset. The caller guarantees that the tensors behind the pointers have the shapes, strides,
    dtypes, device and 16-byte alignment the launch was bound with."""

    __slots__ = ("_run", "_grid", "_function", "_packed", "_tail", "_device_index", "_compiled")

    def __init__(self, compiled, grid, args, constexprs, device_index: int):
        super().__init__(args)
        self._compiled = compiled
        self._run = compiled.run
        self._grid = grid
        self._function = compiled.function
        self._packed = compiled.packed_metadata
        self._tail = constexprs
        self._device_index = device_index

    def __call__(self, *values) -> None:
        args = self._fill(*values)
        if _current_device() != self._device_index:
            with torch.cuda.device(self._device_index):
                self._launch(args)
        else:
            self._launch(args)

    def _launch(self, args: list) -> None:
        if _launch_hooks_idle():
            stream = _current_raw_stream(self._device_index)
            self._run(*self._grid, stream, self._function, self._packed, None, None, None, *args, *self._tail)
        else:  # a profiler hooked Triton's launches: go through Triton's own launch path
            self._compiled[self._grid](*args, *self._tail)


class InterpretedLaunch(_Bound):
    """:class:`BoundLaunch` for CPU tensors under the Triton interpreter: the same call, with tensors instead of
    integer addresses in the pointer slots, through ``rope_kernel[grid]`` (the interpreter needs tensors)."""

    __slots__ = ("_grid", "_kwargs")

    def __init__(self, grid, args, constexprs, num_warps: int):
        super().__init__(args)
        self._grid = grid
        self._kwargs = dict(zip(_CONSTEXPR_NAMES, constexprs), num_warps=num_warps)

    def __call__(self, *values) -> None:
        kernel.rope_kernel[self._grid](*self._fill(*values), **self._kwargs)


def bind_rope(q, k, q_out, k_out, spec: RopeSpec) -> BoundLaunch | InterpretedLaunch | None:
    """A :class:`BoundLaunch` for :func:`ropekit.triton.launcher.launch_rope`'s arguments (an
    :class:`InterpretedLaunch` for CPU tensors), or None where there is none to bind: nothing to rotate, a
    specialisation not compiled yet (the first call goes through ``launch_rope``), or a Triton without the
    launcher attributes this relies on."""
    launch = kernel_launch(q, k, q_out, k_out, spec)
    if launch is None:
        return None
    grid, args, constexprs, num_warps = launch
    if q.device.type == "cpu":
        return InterpretedLaunch(grid, args, constexprs, num_warps)
    if q.device.type != "cuda" or _current_raw_stream is None:
        return None
    device_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    compiled = _COMPILED.get(_cache_key(args, constexprs, num_warps, q.device.index))
    if compiled is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        return None
    return BoundLaunch(compiled, grid, args, constexprs, device_index)
