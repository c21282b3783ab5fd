"""``ropekit.apply_rope(..., backend="webgpu")``: a :class:`~ropekit._spec.RopeSpec` carried out by the WGSL kernels.

:func:`rotate` is what :mod:`ropekit.api` calls, after :func:`ropekit._spec.validate` has checked the call exactly
as for every other backend. It refuses, with one ``ValueError`` naming them, the options the kernels do not
implement (:func:`unsupported`), then rotates q and k in one dispatch of the shared
:class:`~ropekit.webgpu.runner.WebGPURunner` (:func:`~ropekit.webgpu.runner.default_runner`), prepared on the host
by :mod:`ropekit.webgpu.host` (where the sign convention and the three ways of forming angles are described).
"""

from __future__ import annotations

import torch

from ropekit._spec import RopeSpec
from ropekit.webgpu.host import _rotate, rotate_arrays, unsupported
from ropekit.webgpu.runner import default_runner

__all__ = ["rotate", "rotate_arrays", "unsupported"]


def rotate(q: torch.Tensor, k: torch.Tensor | None, spec: RopeSpec, inplace: bool) -> tuple:
    """``apply_rope(..., backend="webgpu")`` (and ``apply_rope_``, ``rope_backward``): the rotation ``spec``
    describes, by the WGSL kernels on the shared runner. Returns ``(q_out, k_out)`` (``k_out`` None without k);
    in place, the results are copied back into ``q`` and ``k``, which are returned.

    Raises ``ValueError`` naming what the kernels cannot do (:func:`unsupported`; a full-width cos/sin table whose
    halves differ; a frequency with ``|inv_freq| >= 2**24`` or not finite) before anything is written, then
    ``ImportError`` without wgpu and ``RuntimeError`` without an adapter."""
    outs = _rotate(q, k, spec, default_runner)
    if inplace:
        for x, out in zip((q, k), outs):
            if x is not None:
                x.copy_(out)
        outs = (q, k)
    return outs
