"""The host side of a WebGPU rotation: from a validated :class:`~ropekit._spec.RopeSpec` to one dispatch of the
WGSL kernels on a :class:`~ropekit.webgpu.runner.WebGPURunner`, and back.

:func:`unsupported` names the options the kernels do not implement (the caller refuses them with one
``ValueError``); then what the kernels read is prepared on the host -- a float32 frequency table, or the cos/sin
rows of the positions used -- q and k are packed into one dispatch, and the results unpacked into new tensors.
:func:`rotate_arrays` is the body of :meth:`WebGPURunner.apply_rope` (numpy arrays as well as tensors, and the
choice of how angles are formed); :func:`ropekit.webgpu.adapter.rotate`, the public route, runs the same code on
the shared runner. This module imports no runner: the runner is handed in, so the runner's method can call it.

Sign convention (shared with the rest of ropekit): the forward rotates pair ``(lo, hi)`` by ``+theta``,
``lo' = lo*cos - hi*sin``, ``hi' = lo*sin + hi*cos``, with ``theta = position * inv_freq[i]``; the conjugate
(``rope_backward``) rotates by ``-theta``.

Angles, three ways (``angles=`` of :meth:`WebGPURunner.apply_rope`; the public route always uses ``"shader"``):

* ``"shader"``: the shader forms ``position * inv_freq[i]`` exactly (integer arithmetic, a 64-bit fraction of a
  turn) from a float32 frequency table -- ``inv_freq``, or transformers' default ``base ** (-2i/D)`` computed on
  the host -- and evaluates sin/cos of the reduced angle in f32: ~1e-7 at any position ropekit takes (below 2**31).
* ``"host"``: cos/sin are computed on the host in float64 for the positions used and uploaded as float32: the f32
  rounding of the exact value, at any position.
* ``"shader_base"``: the frequencies too are computed in the shader, in f32, from ``base`` (the ``rope_q`` /
  ``rope_k`` kernels as a browser program runs them). The angle is still exact for the f32 frequency, but that
  frequency may differ from the host's float32 table by a few ulps, an angle error that grows with the position
  (see docs/webgpu.md).

cos/sin tables (and raw angles, turned into cos/sin in float64 here) go to the ``*_table`` kernels, one row per
position used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from ropekit._spec import Mode, RopeSpec, to_canonical
from ropekit._validation import validate
from ropekit.webgpu.shader import entry_point

if TYPE_CHECKING:
    from ropekit.webgpu.runner import WebGPURunner

__all__ = ["ANGLE_MODES", "rotate_arrays", "unsupported"]

# How angles are formed without a cos/sin table (``angles=`` of WebGPURunner.apply_rope; see above).
ANGLE_MODES = ("shader", "host", "shader_base")

# angle_rotation() in rope.wgsl refuses (writes NaN for) a float32 frequency with a biased exponent above 150, i.e.
# |freq| >= 2**24, or one that is not finite; below that the angle is exact for every u32 position.
_MAX_FREQ = 2.0**24
_F32_MAX = float(np.finfo(np.float32).max)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # float16 packed on the device; bfloat16 through f32


def unsupported(q: torch.Tensor, k: torch.Tensor | None, spec: RopeSpec) -> list[str]:
    """The parts of a validated call that the WGSL kernels do not implement, each as the error names it; [] when
    they can carry it out."""
    frequency_source = "angles" if spec.freq_mode == "angles" else "cos"
    tensors = (("q", q), ("k", k), ("inv_freq", spec.inv_freq), (frequency_source, spec.cos), ("sin", spec.sin))
    grad = [name for name, t in tensors if t is not None and t.requires_grad] if torch.is_grad_enabled() else []
    return [name for name, bad in (
        ("a positions tensor (only an int offset)", spec.positions is not None or spec.seq_offsets is not None),
        ("multi-axis positions (sections=)", spec.sections is not None),
        ("cu_seqlens", spec.cu_seqlens is not None),
        (f"layout={spec.layout!r} (only 'bshd' or 'thd')", spec.layout not in ("bshd", "thd")),
        ("rotary_dim < head_dim", spec.rotary_dim != q.shape[-1]),
        ("q_scale/k_scale/rotary_scale other than 1", (spec.q_scale, spec.k_scale, spec.rotary_scale) != (1, 1, 1)),
        (f"per-token {frequency_source} rows with a batch dimension > 1 (pass [P, W] or [1, S, W])",
         spec.table_by_token and spec.cos.shape[0] != 1),
        ("out_dtype other than the inputs' dtype", spec.out_dtype is not None),
        (f"dtype {q.dtype} (only float32, float16 and bfloat16)", q.dtype not in _DTYPES),
        (f"tensors on {q.device} (only CPU tensors: the backend copies through host memory)", q.device.type != "cpu"),
        (f"autograd ({', '.join(grad)} requires grad and would come back silently detached: pass .detach(), run "
         "under torch.no_grad(), or use backend='auto')", bool(grad)),
    ) if bad]


def rotate_arrays(runner: WebGPURunner, q, k=None, *, pos_offset: int = 0, base: float = 10000.0, inv_freq=None,
                  cos=None, sin=None, style: str = "neox", conjugate: bool = False, angles: str = "shader"):
    """:meth:`WebGPURunner.apply_rope` on ``runner``: numpy arrays become tensors, the call is validated as
    ``ropekit.apply_rope``'s, and ``angles`` picks the kernels."""
    if not isinstance(angles, str) or angles not in ANGLE_MODES:
        raise ValueError(f"angles must be one of {ANGLE_MODES}, got {angles!r}")
    if angles == "shader_base" and (inv_freq is not None or cos is not None or sin is not None):
        raise ValueError("angles='shader_base' computes the frequencies from base in the shader: leave inv_freq, cos "
                         "and sin unset (angles='shader' uses them)")
    as_numpy = isinstance(q, np.ndarray)
    q, k, inv_freq, cos, sin = (torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
                                for x in (q, k, inv_freq, cos, sin))
    layout = "thd" if isinstance(q, torch.Tensor) and q.dim() == 3 else "bshd"
    spec = validate(q, k, positions=pos_offset, inv_freq=inv_freq, base=base, cos=cos, sin=sin, style=style,
                    layout=layout, mode=Mode(False, bool(conjugate), ("q", "k")))
    if angles == "shader_base" and not base <= _F32_MAX:  # validate has checked that it is finite and > 1
        raise ValueError(f"base must be at most float32's largest value {_F32_MAX!r} for angles='shader_base' (the "
                         f"shader uses it as f32), got {base!r}")
    outs = _rotate(q, k, spec, lambda: runner, angles, base)
    if as_numpy:
        outs = tuple(None if y is None else y.numpy() for y in outs)
    return outs[0] if k is None else outs


def _check_frequencies(inv_freq: torch.Tensor, angles: str) -> None:
    """Refuse frequencies the kernels would turn into NaN: finite and |inv_freq| < 2**24, as the shader sees them
    (float32) for ``angles="shader"``, in float64 for ``"host"`` (the same bound, so both accept the same
    tables)."""
    seen = inv_freq.to(torch.float32) if angles == "shader" else inv_freq
    bad = ~(seen.abs() < _MAX_FREQ)  # NaN compares False: caught too
    if bool(bad.any()):
        where = int(bad.nonzero()[0, 0])
        as_f32 = " (as float32)" if angles == "shader" else ""
        raise ValueError(f"inv_freq[{where}] = {seen[where].item()!r}{as_f32}: the WebGPU kernels need finite "
                         "frequencies with |inv_freq| < 2**24")


def _table_rows(spec: RopeSpec, seq_len: int, head_dim: int) -> np.ndarray:
    """The cos/sin rows of positions ``pos_offset .. pos_offset + seq_len - 1`` as float32 [rows, head_dim/2, 2],
    the layout of binding 4; raw angles become cos/sin here, in float64. A full-width table (transformers'
    duplicated halves) must repeat its halves: the kernels take one angle per pair. Rows past the table's end stay
    missing, and the kernel writes NaN for their tokens (validate raises first wherever it can read positions)."""
    half = head_dim // 2
    named = (("angles", spec.cos),) if spec.freq_mode == "angles" else (("cos", spec.cos), ("sin", spec.sin))
    rows = []
    for name, table in named:
        t = table[0, spec.pos_offset:spec.pos_offset + seq_len].detach()
        if t.shape[-1] == head_dim:
            lo, hi = (t[:, :half], t[:, half:]) if spec.style == "neox" else (t[:, 0::2], t[:, 1::2])
            if not torch.equal(lo, hi):
                raise ValueError(f"backend='webgpu' does not support a full-width {name} table whose {spec.style} "
                                 "halves differ (the kernels take one angle per pair): pass [P, head_dim/2] tables")
            t = lo
        rows.append(t)
    if spec.freq_mode == "angles":
        angle = rows[0].to(torch.float64)
        rows = [angle.cos(), angle.sin()]
    return torch.stack([t.to(torch.float32) for t in rows], dim=-1).contiguous().numpy()


def _rotate(q: torch.Tensor, k: torch.Tensor | None, spec: RopeSpec, runner_of: Callable[[], WebGPURunner],
            angles: str = "shader", base: float = 10000.0) -> tuple:
    """New tensors ``(q_out, k_out or None)``: q and k rotated as ``spec`` says in one dispatch on the runner
    ``runner_of()`` returns, called only once every check has passed (so that a call the kernels refuse raises its
    ValueError before the shared runner is looked for)."""
    if names := unsupported(q, k, spec):
        raise ValueError(f"backend='webgpu' does not support {'; '.join(names)}")
    batched = [to_canonical(x, spec.layout) for x in (q, k) if x is not None]  # [B, S, H, D] views
    B, S, _, D = batched[0].shape
    inv_freq = cos_sin = None
    kernel_offset = spec.pos_offset
    if spec.freq_mode != "inv_freq":
        source, cos_sin, kernel_offset = "table", _table_rows(spec, S, D), 0
    elif angles == "shader_base":
        source = "base"
    else:
        inv_freq = spec.inv_freq.detach().to(torch.float64)
        _check_frequencies(inv_freq, angles)
        source = "freq"
        if angles == "host":
            positions = torch.arange(spec.pos_offset, spec.pos_offset + S, dtype=torch.float64)
            theta = positions[:, None] * inv_freq[None, :]  # float64: exact enough below 2**40
            cos_sin = torch.stack([theta.cos(), theta.sin()], dim=-1).to(torch.float32).numpy()
            source, kernel_offset, inv_freq = "table", 0, None
    runner = runner_of()

    # fp16 stays packed on the device; NeoX f16 kernels own two pairs each, so they need head_dim % 4 == 0.
    packed_f16 = q.dtype == torch.float16 and (spec.style == "interleaved" or D % 4 == 0)
    work_dtype = torch.float16 if packed_f16 else torch.float32
    # One dispatch for q and k: tokens first, then the heads of every batch row of q, then those of k.
    heads = [x.shape[2] for x in batched]
    rotated = torch.cat([x.to(work_dtype).permute(1, 0, 2, 3).reshape(S, B * h, D)
                         for x, h in zip(batched, heads)], dim=1).contiguous()  # a fresh tensor: rotated in place
    entry = entry_point(style=spec.style, source=source, packed_f16=packed_f16, conjugate=spec.conjugate)
    runner._rotate(entry, rotated.numpy(), kernel_offset, base,
                   None if inv_freq is None else inv_freq.to(torch.float32).numpy(), cos_sin)
    outs, first = [], 0
    for original, h in zip((q, k), heads):
        y = rotated[:, first:first + B * h].reshape(S, B, h, D).permute(1, 0, 2, 3)
        first += B * h
        outs.append(y.reshape(original.shape).to(original.dtype).contiguous())
    return outs[0], (outs[1] if k is not None else None)
