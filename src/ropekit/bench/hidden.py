"""The diffusion transformers' attention prologue (mode ``hidden-norm-fwd``): ``qk_norm_rope(norm_over="hidden",
v=v)`` (RMSNorm over each token's whole H * D, the rotation, v's copy; one launch), its baseline ``copy-qkv`` (one
copy of the bytes it must move) and the unfused PyTorch code a WAN-style model runs (``unfused-eager``, and
``unfused-compile`` its ``torch.compile``).

Every implementation returns q, k and v's copy; the check holds them to ``ropekit-hidden-norm``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from ropekit.modules import hf_tables

from .base import Bench, Unsupported, _flat_copy, compiled_per_case
from .inputs import NORM_EPS, Inputs
from .timing import _sync

HIDDEN_NORM_IMPLS = ("ropekit-hidden-norm", "unfused-eager", "unfused-compile")


def build_copy_qkv(inp: Inputs, nbytes: dict[str, int]) -> Bench:
    b = _flat_copy(inp, nbytes["hidden-norm-fwd"])
    b.note = "one copy of the bytes: q, k and v read and written, the weights and position data read"
    return b


def _rotate_pairs(x: Tensor, interleaved: bool) -> Tensor:
    """The second factor of RoPE, ``x * cos + rotate(x) * sin``: (x1, x2) -> (-x2, x1) for every pair."""
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def unfused_hidden_norm_rope(q: Tensor, k: Tensor, v: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor,
                             sin: Tensor, interleaved: bool, eps: float = NORM_EPS) -> tuple[Tensor, Tensor, Tensor]:
    """A WAN-style prologue in PyTorch: fp32 ``rms_norm`` of each token's [H * D] (q and k in bshd), the rotation
    with fp32 cos/sin tables [B, S, 1, D] (pairs spread as the style's), one rounding to the input dtype, and v
    copied to a new contiguous tensor."""

    def norm_rope(x: Tensor, weight: Tensor) -> Tensor:
        xn = torch.nn.functional.rms_norm(x.float().flatten(-2), (weight.numel(),), weight.float(), eps)
        xn = xn.view(x.shape)
        return (xn * cos + _rotate_pairs(xn, interleaved) * sin).to(x.dtype)

    return norm_rope(q, q_weight), norm_rope(k, k_weight), v.clone(memory_format=torch.contiguous_format)


def _fp32_tables(inp: Inputs) -> tuple[Tensor, Tensor]:
    """cos/sin [B, S, 1, D] in fp32 for every token (multi-axis: each pair's angle from its axis's position), pairs
    laid out as the case's style rotates them."""
    positions = inp.pos_axes if inp.pos_axes is not None else inp.pos_grid
    cos, sin = hf_tables(positions, inp.inv_freq, full=False, dtype=torch.float64, pair_axis=inp.pair_axis)
    spread = ((lambda t: torch.repeat_interleave(t, 2, dim=-1)) if inp.case.style == "interleaved"
              else (lambda t: torch.cat([t, t], dim=-1)))
    return tuple(spread(t).float().unsqueeze(2) for t in (cos, sin))


def build_hidden(name: str, inp: Inputs, mode: str) -> Bench:
    import ropekit

    c = inp.case
    if not c.hidden_norm or inp.v is None:
        raise Unsupported("the hidden-norm mode needs a model with qk_norm 'hidden' (q, k, v and weights [H * D])")
    q, k, v, qw, kw = inp.q, inp.k, inp.v, inp.q_weight, inp.k_weight
    if name == "ropekit-hidden-norm":
        rope = inp.rope_kwargs()
        fn: Callable[[], tuple[Tensor, ...]] = lambda: ropekit.qk_norm_rope(  # noqa: E731
            q, k, qw, kw, eps=NORM_EPS, norm_over="hidden", v=v, **rope)
        return Bench(run=fn, result=fn, note="one launch: RMSNorm over H * D, the rotation and v's copy")
    if name in ("unfused-eager", "unfused-compile"):
        if inp.layout != "bshd" or c.rotary_dim != c.head_dim:
            raise Unsupported("the unfused code rotates full-width pairs of bshd tensors")
        cos, sin = _fp32_tables(inp)
        interleaved = c.style == "interleaved"
        forward = unfused_hidden_norm_rope
        note = "torch fp32 rms_norm over H * D x2 + RoPE with fp32 cos/sin [B, S, 1, D] + v.clone()"
        if name == "unfused-compile":
            forward = compiled_per_case(unfused_hidden_norm_rope, c.name, mode)
            note = "torch.compile(fullgraph, static shapes) of " + note
        fn = lambda: forward(q, k, v, qw, kw, cos, sin, interleaved)  # noqa: E731
        bench = Bench(run=fn, result=fn, note=note)
        if name == "unfused-compile":  # compile outside the timed region
            t0 = time.perf_counter()
            fn()
            _sync(inp.device)
            bench.note += f"; compiled in {time.perf_counter() - t0:.1f} s"
        return bench
    raise ValueError(name)
