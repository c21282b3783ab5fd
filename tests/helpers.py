"""What several test files share: the routes a test runs on, float64 oracles, and ``assert_close_to_ref`` taking a
``{dtype: dict(rtol, atol)}`` table (the general helpers live in :mod:`ropekit.testing`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

import pytest
import torch

from ropekit import testing
from ropekit._spec import BACKWARD, FORWARD
from ropekit._validation import validate
from ropekit.reference import rope_reference


def assert_close_to_ref(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
                        backend: str | Mapping | None = None) -> None:
    """:func:`ropekit.testing.assert_close_to_ref`; ``backend`` may also be a ``{dtype: dict(rtol, atol)}`` table."""
    if isinstance(backend, Mapping):
        testing.assert_close_to_ref(out, ref, dtype, tol=testing.Tolerance(**backend[dtype]))
    else:
        testing.assert_close_to_ref(out, ref, dtype, backend)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The three routes a prologue test runs on: plain CPU tensors (the float64 torch path), CPU tensors through the
# Triton kernels under the interpreter (ropekit.testing.kernels_on_cpu), and CUDA.
ROUTES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cpu-kernels", id="cpu-kernels",
                 marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
KERNEL_ROUTES = ROUTES[1:]


def route_context(route: str):
    """The context a route runs in: ``kernels_on_cpu()`` for "cpu-kernels", else nothing."""
    return testing.kernels_on_cpu() if route == "cpu-kernels" else contextlib.nullcontext()


def route_device(route: str) -> str:
    return "cuda" if route == "cuda" else "cpu"


def reference_rope(q, k, conjugate=False, **kwargs):
    """The float64 reference of ``apply_rope(q, k, **kwargs)`` (of ``rope_backward`` with ``conjugate``)."""
    spec = validate(q, k, **kwargs, mode=BACKWARD if conjugate else FORWARD)
    return rope_reference(q, k, spec._replace(out_dtype=torch.float64))


def rope64(x, positions, base=10000.0):
    """Independent float64 RoPE on [B, S, H, D] (rotate_half form) for gradient oracles."""
    D = x.shape[-1]
    inv = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = positions.to(torch.float64)[..., None] * inv  # [B, S, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, :, None], torch.cat([ang.sin()] * 2, -1)[:, :, None]
    half = D // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin



# ------------------------------------------------------------------------------------ the prologue's oracles
# The tolerance column of each route. The contract of both prologue ops is fp32 math with one rounding at the store
# on every route; on CPU tensors that is the table's "float32-path" entry (fp32 math, one rounding to nearest), which
# a float64 CPU implementation meets too. Under the interpreter bfloat16 stores truncate ("triton-interpreter").
ROUTE_BACKENDS = {"cpu": "float32-path", "cpu-kernels": "triton-interpreter", "cuda": "kernels"}


@contextlib.contextmanager
def on_route(route: str, *, clear_plans: bool = False):
    """The context of a route; yields the torch device of its tensors. ``clear_plans``: launch plans start empty."""
    if clear_plans:
        from ropekit import _fastpath

        _fastpath.clear()
    with route_context(route):
        yield route_device(route)


def inv_freq64(R: int, base: float = 10000.0, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """[R/2] inverse frequencies in float64: the tensor given, else apply_rope's ``base ** (-2i / R)`` (formed in
    float64 and rounded once to float32, as ``apply_rope(..., base=)`` documents)."""
    if inv_freq is not None:
        return inv_freq.detach().cpu().double()
    return (base ** -(torch.arange(0, R, 2, dtype=torch.float64) / R)).float().double()


def angles64(pos: torch.Tensor, R: int, *, base: float = 10000.0, inv_freq: torch.Tensor | None = None,
             sections=None) -> torch.Tensor:
    """Angles [..., R/2] of tokens at integer positions ``pos`` [...]; multi-axis: ``pos`` [A, ...] and
    ``sections`` (pairs per axis, contiguous: the first n_0 pairs turn with axis 0, the next n_1 with axis 1...)."""
    inv = inv_freq64(R, base, inv_freq)
    pos = pos.detach().cpu().double()
    if sections is None:
        return pos[..., None] * inv
    axis = torch.repeat_interleave(torch.arange(len(sections)), torch.tensor(list(sections)))
    return torch.stack(list(pos), dim=-1)[..., axis] * inv


def rotate64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, style: str = "neox",
             rotary_dim: int | None = None, rotary_at: str = "front", scale: float = 1.0,
             rotary_scale: float = 1.0) -> torch.Tensor:
    """RoPE of float64 ``x`` [..., H, D] by per-token ``cos``/``sin`` [..., R/2]: ``lo' = lo cos - hi sin``,
    ``hi' = hi cos + lo sin`` for the pairs (i, i + R/2) (neox) or (2i, 2i + 1) (interleaved) of the R rotated
    columns (the first R, or the last R for rotary_at="back"); the other columns pass through; the whole head is
    multiplied by ``scale``. Differentiable (no in-place writes)."""
    D = x.shape[-1]
    R = rotary_dim or D
    start = 0 if rotary_at == "front" else D - R
    c, s = cos[..., None, :] * rotary_scale, sin[..., None, :] * rotary_scale
    before, part, after = x[..., :start], x[..., start:start + R], x[..., start + R:]
    if style == "neox":
        lo, hi = part[..., : R // 2], part[..., R // 2:]
    else:
        lo, hi = part[..., 0::2], part[..., 1::2]
    lo2, hi2 = lo * c - hi * s, hi * c + lo * s
    rotated = torch.cat([lo2, hi2], -1) if style == "neox" else torch.stack([lo2, hi2], -1).flatten(-2)
    return torch.cat([before, rotated, after], -1) * scale


def rms64(x: torch.Tensor, w: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    """``x * rsqrt(mean(x**2 over D) + eps) * (w + weight_offset)`` in float64."""
    x = x.cpu().double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w.cpu().double() + weight_offset)


def cos_sin64(pos: torch.Tensor, D: int, opts: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cos and sin [..., R/2] for apply_rope's options ``opts`` (tables, inv_freq, base, sections)."""
    if opts.get("cos") is not None:
        return opts["cos"].cpu().double()[pos], opts["sin"].cpu().double()[pos]
    R = opts.get("rotary_dim") or D
    ang = angles64(pos, R, base=opts.get("base", 10000.0), inv_freq=opts.get("inv_freq"),
                    sections=opts.get("sections"))
    return ang.cos(), ang.sin()


def rope_opts64(opts: dict, scale: float) -> dict:
    return dict(style=opts.get("style", "neox"), rotary_dim=opts.get("rotary_dim"),
                rotary_at=opts.get("rotary_at", "front"), rotary_scale=opts.get("rotary_scale", 1.0), scale=scale)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``x`` on CPU (NaN == NaN, -0 != +0)."""
    return x.detach().cpu().contiguous().view(_INT_OF_SIZE[x.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def norm_weight(D: int, dtype, device, weight_offset: float = 0.0) -> torch.Tensor:
    """A random norm weight [D] around 1 - weight_offset (so that w + weight_offset is around 1)."""
    w = 1.0 - weight_offset + 0.3 * torch.randn(D, dtype=torch.float64)
    return w.to(dtype=dtype, device=device)


def snapshot(*tensors):
    return [t.clone() if isinstance(t, torch.Tensor) else t for t in tensors]


def assert_unchanged(tensors, before):
    for t, b in zip(tensors, before):
        if isinstance(t, torch.Tensor):
            assert same_bits(t, b), "an input was modified"
