"""apply_rope's float8 outputs with dynamic scales (``q_out_scale="dynamic"``): the checks the general validation
does not make, then ``ropekit::rope_fp8_dynamic`` (traced under torch.compile) or its body (eager)."""

from __future__ import annotations

import torch
from torch import Tensor

from ropekit import ops
from ropekit._spec import FP8_DTYPES, Mode, RopeArgs
from ropekit._validation import validate_args


def rotate_float8_dynamic(q: Tensor, k: Tensor | None, mode: Mode, args: RopeArgs) -> tuple[Tensor, ...]:
    """``(q_out, k_out, q_scales, k_scales)`` (without k: ``(q_out, q_scales)``) of an apply_rope call with
    ``q_out_scale="dynamic"``; raises ``ValueError``/``TypeError`` naming the argument before anything runs."""
    if not (isinstance(args.q_out_scale, str) and args.q_out_scale == "dynamic"):
        raise ValueError(f'q_out_scale must be None or "dynamic", got {args.q_out_scale!r}')
    if mode.inplace or mode.conjugate:
        raise ValueError('q_out_scale="dynamic" is for apply_rope (out of place, forward) only')
    if args.out_dtype not in FP8_DTYPES:
        raise ValueError('q_out_scale="dynamic" needs out_dtype torch.float8_e4m3fn or torch.float8_e5m2, got '
                         f"{args.out_dtype}")
    if args.backend != "auto":
        raise ValueError(f'q_out_scale="dynamic" runs on the "auto" backend only, got backend={args.backend!r}')
    if type(q) is not Tensor or (k is not None and type(k) is not Tensor):
        raise TypeError('q_out_scale="dynamic" takes plain tensors (not DTensor or other subclasses)')
    spec = validate_args(q, k, args._replace(q_out_scale=None), mode)  # refuses inputs that require grad
    if torch.compiler.is_compiling():
        return tuple(ops.rope_fp8_dynamic(q, k, *spec))
    return tuple(ops.rotate_float8_dynamic(q, k, spec))
