"""transformers integration: an exact drop-in for ``apply_rotary_pos_emb``, and model patching.

``patch``/``unpatch`` live in :mod:`ropekit.integrations.patching` and are re-exported lazily, so importing this
module never imports transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ropekit._spec import FLOAT_DTYPES, to_canonical
from ropekit.api import apply_rope

if TYPE_CHECKING:  # served lazily by __getattr__ below, so that importing this module never imports transformers
    from ropekit.integrations.patching import SUPPORTED_MODEL_TYPES, is_patched, patch, unpatch

__all__ = ["apply_rotary_pos_emb", "apply_multimodal_rotary_pos_emb", "apply_rotary_pos_emb_vision",
           "apply_rotary_pos_emb_interleaved", "apply_rotary_emb_complex", "rotate_half", "patch", "unpatch",
           "is_patched", "SUPPORTED_MODEL_TYPES"]


def rotate_half(x: Tensor) -> Tensor:
    """``cat(-x[..., D/2:], x[..., :D/2])``: transformers' helper, for the eager fallback."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _eager(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int) -> tuple[Tensor, Tensor]:
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _per_token_table(table: Tensor, x: Tensor, layout: str) -> Tensor | None:
    """``table`` (already unsqueezed) broadcast to ``x`` as a [B, S, D] view, or None when it varies by head or
    does not broadcast."""
    try:
        expanded = table.expand(x.shape)
    except RuntimeError:
        return None
    canonical = to_canonical(expanded, layout)
    if canonical.stride(2) != 0:
        return None
    return canonical[:, :, 0, :]


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
                         ) -> tuple[Tensor, Tensor]:
    """Drop-in for transformers' ``apply_rotary_pos_emb`` (same signature, semantics, output dtype, gradients).

    Computes ``q * cos + rotate_half(q) * sin`` (and the same for ``k``) with ``cos``/``sin`` unsqueezed at
    ``unsqueeze_dim``: q, k [B, H, S, D] with ``unsqueeze_dim=1`` or [B, S, H, D] with ``unsqueeze_dim=2``;
    cos, sin [B, S, D] or [S, D] in transformers' duplicated-halves layout, any float dtype. The output dtype is
    ``promote_types(q.dtype, cos.dtype, sin.dtype)`` as in transformers. ropekit evaluates it in fp32 (float64 on
    CPU) and rounds once, so in bf16/fp16 it is at least as accurate as the original. Gradients flow to q and k;
    when cos/sin themselves require grad, or shapes fall outside the cases above, the original formula runs
    in eager torch so behaviour stays identical.
    """
    fast = (
        isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(cos, Tensor) and isinstance(sin, Tensor)
        and q.dim() == 4 and k.dim() == 4 and cos.dim() in (2, 3) and cos.shape == sin.shape
        and q.dtype in FLOAT_DTYPES and k.dtype == q.dtype
        and cos.dtype in FLOAT_DTYPES and sin.dtype in FLOAT_DTYPES
        and q.device == k.device == cos.device == sin.device
        and q.shape[-1] % 2 == 0 and k.shape[-1] == q.shape[-1] == cos.shape[-1]
        and not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))
    )
    if fast:
        dim = unsqueeze_dim % (cos.dim() + 1) if -cos.dim() - 1 <= unsqueeze_dim <= cos.dim() else None
        layout = {1: "bhsd", 2: "bshd"}.get(dim) if cos.dim() == 3 or dim == 1 else None
        fast = layout is not None
    if fast and cos.dim() == 3:
        # What models pass: [B or 1, S, D] rows per token, which ropekit takes as they are (building broadcast
        # views per call would cost more host time than the kernel at decode sizes).
        batch, seqlen = (q.shape[0], q.shape[2]) if layout == "bhsd" else (q.shape[0], q.shape[1])
        cos_t, sin_t = cos, sin
        fast = cos.shape[0] in (1, batch) and cos.shape[1] == seqlen and k.shape[0] == batch \
            and k.shape[2 if layout == "bhsd" else 1] == seqlen
    elif fast:
        c4, s4 = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        cos_t, sin_t = _per_token_table(c4, q, layout), _per_token_table(s4, q, layout)
        cos_k = _per_token_table(c4, k, layout)
        fast = cos_t is not None and sin_t is not None and cos_k is not None and cos_k.shape == cos_t.shape
    if not fast:
        return _eager(q, k, cos, sin, unsqueeze_dim)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    out_dtype = torch.promote_types(q.dtype, torch.promote_types(cos.dtype, sin.dtype))
    return apply_rope(q, k, cos=cos_t, sin=sin_t, style="neox", layout=layout, rotary_dim=q.shape[-1],
                      out_dtype=out_dtype)


def apply_rotary_pos_emb_vision(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Drop-in for the vision towers' ``apply_rotary_pos_emb_vision`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): q, k
    [N, H, D] patches, cos/sin [N, D] per patch (duplicated halves), math in float32, outputs in q's and k's own
    dtypes -- one ropekit launch on the tables as given. Shapes outside that run the original formula."""
    fast = (
        isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(cos, Tensor) and isinstance(sin, Tensor)
        and q.dim() == 3 and k.dim() == 3 and cos.dim() == 2 and cos.shape == sin.shape
        and q.dtype in FLOAT_DTYPES and k.dtype == q.dtype and q.device == k.device == cos.device == sin.device
        and cos.dtype in FLOAT_DTYPES and sin.dtype in FLOAT_DTYPES
        and q.shape[0] == k.shape[0] == cos.shape[0] and q.shape[-1] == k.shape[-1] == cos.shape[-1]
        and q.shape[-1] % 2 == 0 and not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))
    )
    if not fast:
        cos32, sin32 = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
        q32, k32 = q.float(), k.float()
        return ((q32 * cos32 + rotate_half(q32) * sin32).to(q.dtype),
                (k32 * cos32 + rotate_half(k32) * sin32).to(k.dtype))
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    return apply_rope(q, k, cos=cos[None], sin=sin[None], style="neox", layout="thd", rotary_dim=q.shape[-1])


def _rotate_pairs(x: Tensor) -> Tensor:
    """``(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)``: Cohere's ``rotate_half``, for the eager fallback."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rotary_pos_emb_interleaved(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
                                     ) -> tuple[Tensor, Tensor]:
    """Drop-in for Cohere's (and Cohere 2's) ``apply_rotary_pos_emb``: the same signature, results, output dtype
    and gradients.

    Pairs columns (2i, 2i+1): ``x * cos + rotate_pairs(x) * sin`` in float32, returned in q's dtype, with
    ``cos``/``sin`` [B, S, D] (or [S, D]) in the repeated-pairs layout ``[c0, c0, c1, c1, ...]`` of Cohere's
    rotary module, unsqueezed at ``unsqueeze_dim`` (q, k [B, H, S, D] with 1, [B, S, H, D] with 2). One ropekit
    launch on the per-pair columns ``cos[..., 0::2]``; other shapes, or tables that require grad, run the original
    formula."""
    fast = (
        isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(cos, Tensor) and isinstance(sin, Tensor)
        and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape
        and unsqueeze_dim in (1, 2) and q.dtype in FLOAT_DTYPES and k.dtype == q.dtype
        and cos.dtype in FLOAT_DTYPES and sin.dtype in FLOAT_DTYPES
        and q.device == k.device == cos.device == sin.device
        and q.shape[-1] % 2 == 0 and k.shape[-1] == q.shape[-1] == cos.shape[-1]
        and not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))
    )
    if fast:
        layout = "bhsd" if unsqueeze_dim == 1 else "bshd"
        batch, seqlen = q.shape[0], q.shape[2 if layout == "bhsd" else 1]
        fast = cos.shape[0] in (1, batch) and cos.shape[1] == seqlen and k.shape[0] == batch \
            and k.shape[2 if layout == "bhsd" else 1] == seqlen
    if not fast:
        dtype = q.dtype
        q, k = q.float(), k.float()
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return ((q * cos + _rotate_pairs(q) * sin).to(dtype), (k * cos + _rotate_pairs(k) * sin).to(dtype))
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    return apply_rope(q, k, cos=cos[..., 0::2].contiguous(), sin=sin[..., 0::2].contiguous(), style="interleaved",
                      layout=layout, rotary_dim=q.shape[-1], out_dtype=q.dtype)


def apply_rotary_emb_complex(xq: Tensor, xk: Tensor, freqs_cis: Tensor) -> tuple[Tensor, Tensor]:
    """Drop-in for Llama 4's ``apply_rotary_emb(xq, xk, freqs_cis)``: the same signature, results, output dtypes
    and gradients.

    xq, xk [B, S, H, D] (any float dtype); ``freqs_cis`` complex [B, S, D/2] (or [1, S, D/2]), one unit-or-scaled
    complex number per pair: the pair (2i, 2i+1) read as ``x[2i] + 1j * x[2i+1]`` is multiplied by
    ``freqs_cis[..., i]`` in float32 and the outputs are returned in xq's and xk's dtypes. One ropekit launch with
    ``cos = freqs_cis.real``, ``sin = freqs_cis.imag``; other shapes, or a table that requires grad, run the
    original complex product."""
    fast = (
        isinstance(xq, Tensor) and isinstance(xk, Tensor) and isinstance(freqs_cis, Tensor)
        and xq.dim() == 4 and xk.dim() == 4 and freqs_cis.dim() == 3 and freqs_cis.dtype == torch.complex64
        and xq.dtype in FLOAT_DTYPES and xk.dtype == xq.dtype and xq.device == xk.device == freqs_cis.device
        and xq.shape[-1] == xk.shape[-1] == 2 * freqs_cis.shape[-1]
        and freqs_cis.shape[0] in (1, xq.shape[0]) and freqs_cis.shape[1] == xq.shape[1]
        and xk.shape[:2] == xq.shape[:2]
        and not (torch.is_grad_enabled() and freqs_cis.requires_grad)
    )
    if not fast:
        q_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        k_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        q_out = torch.view_as_real(q_ * freqs_cis[:, :, None, :]).flatten(3)
        k_out = torch.view_as_real(k_ * freqs_cis[:, :, None, :]).flatten(3)
        return q_out.type_as(xq), k_out.type_as(xk)
    xq = xq if xq.stride(-1) == 1 else xq.contiguous()
    xk = xk if xk.stride(-1) == 1 else xk.contiguous()
    return apply_rope(xq, xk, cos=freqs_cis.real.contiguous(), sin=freqs_cis.imag.contiguous(), style="interleaved",
                      layout="bshd", rotary_dim=xq.shape[-1], out_dtype=xq.dtype)


def apply_multimodal_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, mrope_section: list[int],
                                    unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """Drop-in for Qwen2-VL's ``apply_multimodal_rotary_pos_emb`` (transformers 4.x; model code that copied it still
    calls it): the same signature, results, output dtype and gradients.

    ``cos``/``sin`` [A, B, S, D] hold one duplicated-halves table per position axis (time, height, width);
    ``mrope_section`` (pairs per axis) picks, for each half of the head, the first ``mrope_section[0]`` columns
    from axis 0, the next ``mrope_section[1]`` from axis 1, and so on (the section index cycles over the axes).
    The merged [B, S, D] tables then rotate q and k as :func:`apply_rotary_pos_emb` does (one ropekit launch)."""
    if not isinstance(cos, Tensor) or not isinstance(sin, Tensor) or cos.dim() != 4 or cos.shape != sin.shape:
        raise ValueError("cos and sin must be [A, B, S, D] tensors of one shape (one table per position axis), got "
                         f"{getattr(cos, 'shape', type(cos).__name__)} and {getattr(sin, 'shape', type(sin).__name__)}")
    if (isinstance(mrope_section, (str, bytes)) or not isinstance(mrope_section, (list, tuple))
            or any(not isinstance(n, int) or isinstance(n, bool) for n in mrope_section)):
        raise TypeError(f"mrope_section must be a list of ints (pairs per position axis), got {mrope_section!r}")
    sections = list(mrope_section) * 2  # the same split for both halves of the duplicated table
    if sum(sections) != cos.shape[-1]:
        raise ValueError(f"mrope_section {list(mrope_section)} (pairs per axis) must sum to {cos.shape[-1] // 2} (half "
                         f"the table width {cos.shape[-1]}), got {sum(mrope_section)}")
    axes = cos.shape[0]

    def merge(table: Tensor) -> Tensor:
        return torch.cat([m[i % axes] for i, m in enumerate(table.split(sections, dim=-1))], dim=-1)

    return apply_rotary_pos_emb(q, k, merge(cos), merge(sin), unsqueeze_dim=unsqueeze_dim)


def __getattr__(name: str):
    if name in ("patch", "unpatch", "is_patched", "SUPPORTED_MODEL_TYPES"):
        from ropekit.integrations import patching

        return getattr(patching, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
