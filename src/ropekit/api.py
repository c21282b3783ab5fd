"""Public API: :func:`apply_rope`, :func:`apply_rope_` (in place) and :func:`rope_backward`.

The three share one signature. Each bundles its keywords into a :class:`ropekit._spec.RopeArgs` for the layer
below: ``backend="auto"`` to the fast path (:mod:`ropekit._fastpath`: replay a launch plan, or
:func:`ropekit._validation.validate_args` and run), ``backend="webgpu"`` to the WGSL adapter. The prologue's functions
bundle their norm (:class:`ropekit._spec.NormSpec`) and cache arguments (:class:`ropekit._spec.CacheArgs`) too.
Every check that can fail runs before anything is written, so a call that raises leaves its inputs untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ropekit import _fastpath, distributed
from ropekit._rope_float8 import rotate_float8_dynamic
from ropekit._spec import BACKWARD, FORWARD, FORWARD_INPLACE, CacheArgs, Mode, NormSpec, OutScales, Positions, RopeArgs
from ropekit._validation import validate_args

__all__ = ["apply_rope", "apply_rope_", "rope_backward", "qk_norm_rope", "rope_kv_write"]


def _rope(q: Tensor, k: Tensor | None, mode: Mode, args: RopeArgs):
    """The body of the public functions; ``args`` is their keyword arguments after q and k (spelled out, not
    ``locals()``, which torch.compile cannot trace in every supported torch version)."""
    if args.q_out_scale is not None:  # float8 outputs with dynamic scales: their own op
        return rotate_float8_dynamic(q, k, mode, args)
    if args.backend == "auto":
        if type(q) is not Tensor and distributed.is_dtensor(q):
            return distributed.rotate_dtensor(q, k, mode, args)
        return _fastpath.rotate(q, k, mode, args)
    spec = validate_args(q, k, args, mode)
    from ropekit.webgpu import rotate as rotate_webgpu

    outs = rotate_webgpu(q, k, spec, mode.inplace)
    return outs[0] if k is None else outs


def apply_rope(
    q: Tensor, k: Tensor | None = None, *, positions: Positions = None, inv_freq: Tensor | None = None,
    base: float = 10000.0, cos: Tensor | None = None, sin: Tensor | None = None, angles: Tensor | None = None,
    style: str = "neox", layout: str = "bshd", rotary_dim: int | None = None, rotary_at: str = "front",
    q_scale: float = 1.0, k_scale: float = 1.0, rotary_scale: float = 1.0, cu_seqlens: Tensor | None = None,
    sections: Sequence[int] | None = None, section_layout: str = "contiguous", check_positions: bool = False,
    out_dtype: torch.dtype | None = None, backend: str = "auto", q_out_scale: str | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """Rotate ``q`` (and ``k``) by their positions; returns new tensors ``(q_rot, k_rot)``, or ``q_rot`` alone
    when ``k`` is None. Differentiable in q and k (the backward is the conjugate rotation).

    Parameters
    ----------
    q, k : Tensor
        Queries and (optionally) keys in ``layout``: ``"bshd"`` [B, S, H, D], ``"bhsd"`` [B, H, S, D],
        ``"sbhd"`` [S, B, H, D] or ``"thd"`` [T, H, D] (packed tokens). Head counts may differ (GQA/MQA); both
        are rotated in one kernel launch. Any strides with a contiguous last dim (views into a packed QKV
        projection are used in place, never copied). float16, bfloat16, float32 (float64 on CPU); k has q's
        dtype. Math is fp32 (float64 for float64 inputs) with exact angles and one rounding at the store;
        outputs keep the input dtype unless ``out_dtype`` says otherwise.
    positions : None, int or Tensor
        ``None``: 0..S-1. ``int``: offset added to 0..S-1 (KV-cache continuation). Tensor [B] (int32/int64):
        per-sequence offsets (with ``cu_seqlens``: one per packed sequence). Tensor [B, S] or [1, S] (``thd``:
        [T]): per-token position ids, any order. With ``cu_seqlens``, a tensor of one entry per sequence is read as
        offsets even where T equals the number of sequences; per-token ids need no ``cu_seqlens`` (pass them
        without it). A 0-d integer tensor on q's device is an offset like an int: a CPU
        tensor is read as one; a device tensor is not read on the host (no sync) but by the kernel, as every
        sequence's offset, and its value is checked only with ``check_positions``. Strided views are accepted
        ([B] offsets are then read as a dense copy). Every position lies in [0, 2**31 - 1]; see
        ``check_positions`` for what happens outside.
    inv_freq : Tensor, optional
        fp32 (or fp64) [R/2] inverse frequencies; the angle ``pos * inv_freq[i]`` is formed in float64 and reduced
        modulo 2*pi before fp32 sin/cos (error about 1e-7 at any position below 2**24).
    base : float
        Used when no other frequency source is given: ``inv_freq[i] = base ** (-2i / R)``, rounded once to fp32
        as models define their frequencies (for unrounded ones pass ``inv_freq`` in float64).
    cos, sin : Tensor, optional
        Tables [P, W] indexed by position, or [B, S, W] / [1, S, W] already gathered per token (``thd``:
        [1, T, W]). W = R/2 (one value per pair) or R (one per column, transformers' duplicated halves).
        Any float dtype; read in fp32.
    angles : Tensor, optional
        Raw angles (cuDNN's ``freqs``), shaped like ``cos``; sin/cos taken in the kernel after exact reduction.
    style : {"neox", "interleaved"}
        ``neox`` pairs column i with i + R/2 (transformers' ``rotate_half``); ``interleaved`` pairs 2i with 2i+1
        (GPT-J, Meta's original LLaMA).
    rotary_dim : int, optional
        Number R of rotated columns (even, <= head_dim). Default: from ``inv_freq``/tables, else head_dim.
    rotary_at : {"front", "back"}
        Rotated columns first (partial_rotary_factor; the tail passes through) or last (cuDNN ``rope_dim``, MLA:
        the leading columns pass through).
    q_scale, k_scale : float
        Multiply the whole output of q / k (rotated and pass-through columns), e.g. 1/sqrt(D) folded into q.
    rotary_scale : float
        Multiplies cos and sin (rotated columns only): transformers' ``attention_scaling`` (YaRN, LongRoPE).
    cu_seqlens : Tensor, optional
        int32/int64 [num_seqs + 1] boundaries of packed sequences (``layout="thd"``); positions restart at 0 (plus
        the sequence's offset) in each sequence.
    sections : sequence of int, optional
        Multi-axis positions (M-RoPE of vision-language models, axial RoPE): ``positions`` is then an integer tensor
        [A, B, S] or [A, 1, S] (``thd``: [A, T]), one row of ids per axis, and ``sections`` = (n_0, ..., n_{A-1})
        pairs per axis (A <= 4), summing to R/2: pair i turns by ``positions[axis(i)] * inv_freq[i]``, with
        frequencies from ``base`` or ``inv_freq`` (exact in-kernel angles; tables are per position of one axis and
        are refused).
    section_layout : {"contiguous", "interleaved"}
        Which pairs each axis takes: ``contiguous`` -- pairs 0..n_0-1 axis 0, the next n_1 axis 1, ... (Qwen2-VL,
        Qwen2.5-VL ``mrope_section``); ``interleaved`` -- pair i takes axis a = i % A (a >= 1) while i < A * n_a,
        else axis 0 (Qwen3-VL's interleaved M-RoPE).
    check_positions : bool
        Also check device-resident ``positions``/``cu_seqlens`` values on the host (one sync). Without it, CPU
        tensors and int offsets are always checked (a position < 0 or past a table raises ``IndexError``, past
        2**31 - 1 ``ValueError``) and CUDA tokens with an invalid position come out as NaN (never an
        out-of-bounds access or a wrong number).
    out_dtype : torch.dtype, optional
        dtype of the outputs (default: the inputs'), e.g. float32 outputs from bfloat16 inputs, as transformers
        returns when its cos/sin tables are float32. Rounded once from the fp32 (float64 for float64 inputs)
        result. In place it must be the inputs' dtype. ``torch.float8_e4m3fn``/``torch.float8_e5m2``: float8
        outputs for FP8 attention, inference only (raises ``RuntimeError`` where q or k requires grad), each
        value ``x * q_scale`` (k: ``k_scale``) rounded to nearest even and saturated.
    q_out_scale : None or "dynamic"
        ``"dynamic"`` (with a float8 ``out_dtype``; as :func:`qk_norm_rope`'s): each (token, head) row of q and
        k is divided by its own scale ``max |row| / fp8 max`` (pass-through columns included), computed in the
        same launch, and the call returns ``(q_out, k_out, q_scales, k_scales)`` (without k: ``(q_out,
        q_scales)``), the scales float32 shaped like q and k without their last dim (an all-zero row: scale 0,
        zeros stored). Only for :func:`apply_rope` (the other two raise ``ValueError``).
    backend : {"auto", "webgpu"}
        ``auto``: the Triton kernels for CUDA tensors; for CPU tensors the float32 torch path (float64 inputs:
        the float64 reference). ``webgpu``: the WGSL kernels through wgpu on CPU tensors (``pip install
        "ropekit[webgpu]"``), for layouts ``bshd``/``thd``, an int offset, full rotary, unit scales, the inputs'
        dtype and no autograd; other arguments raise ``ValueError``.

    Sign convention: the forward rotation is by +theta, ``x0' = x0*cos - x1*sin``, ``x1' = x0*sin + x1*cos``.
    Raises ``TypeError``/``ValueError``/``IndexError`` naming the argument; nothing is written when it raises.

    Examples
    --------
    >>> qkv = torch.randn(2, 16, (8 + 2 * 2) * 64)            # a packed QKV projection [B, S, (Hq + 2 Hk) D]
    >>> q, k, v = qkv.view(2, 16, 12, 64).split([8, 2, 2], dim=2)   # views, no copies
    >>> q_rot, k_rot = ropekit.apply_rope(q, k, positions=torch.tensor([0, 100]), base=500000.0)
    >>> ropekit.apply_rope_(q, k, positions=100)             # in place: rotates inside qkv
    """
    args = RopeArgs(positions=positions, inv_freq=inv_freq, base=base, cos=cos, sin=sin, angles=angles, style=style,
                    layout=layout, rotary_dim=rotary_dim, rotary_at=rotary_at, q_scale=q_scale, k_scale=k_scale,
                    rotary_scale=rotary_scale, cu_seqlens=cu_seqlens, sections=sections,
                    section_layout=section_layout, check_positions=check_positions,
                    out_dtype=out_dtype, backend=backend, q_out_scale=q_out_scale)
    return _rope(q, k, FORWARD, args)


def apply_rope_(
    q: Tensor, k: Tensor | None = None, *, positions: Positions = None, inv_freq: Tensor | None = None,
    base: float = 10000.0, cos: Tensor | None = None, sin: Tensor | None = None, angles: Tensor | None = None,
    style: str = "neox", layout: str = "bshd", rotary_dim: int | None = None, rotary_at: str = "front",
    q_scale: float = 1.0, k_scale: float = 1.0, rotary_scale: float = 1.0, cu_seqlens: Tensor | None = None,
    sections: Sequence[int] | None = None, section_layout: str = "contiguous", check_positions: bool = False,
    out_dtype: torch.dtype | None = None, backend: str = "auto", q_out_scale: str | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """In-place :func:`apply_rope`: rotates ``q`` (and ``k``) in their own memory and returns them; same
    arguments (``out_dtype``, if given, must be the inputs' dtype).

    The write is declared to autograd (``mark_dirty``, version counters) and to ``torch.library``
    (``mutates_args``): rotating a leaf that requires grad, or a tensor another op saved for its backward, raises
    instead of corrupting gradients. Refused before anything is written: a target whose strides reach an element
    twice, q and k sharing memory (interleaved q and k views of one packed QKV buffer are fine), and inference
    tensors outside ``torch.inference_mode()``.
    """
    args = RopeArgs(positions=positions, inv_freq=inv_freq, base=base, cos=cos, sin=sin, angles=angles, style=style,
                    layout=layout, rotary_dim=rotary_dim, rotary_at=rotary_at, q_scale=q_scale, k_scale=k_scale,
                    rotary_scale=rotary_scale, cu_seqlens=cu_seqlens, sections=sections,
                    section_layout=section_layout, check_positions=check_positions,
                    out_dtype=out_dtype, backend=backend, q_out_scale=q_out_scale)
    return _rope(q, k, FORWARD_INPLACE, args)


def rope_backward(
    dq_rot: Tensor, dk_rot: Tensor | None = None, *, positions: Positions = None, inv_freq: Tensor | None = None,
    base: float = 10000.0, cos: Tensor | None = None, sin: Tensor | None = None, angles: Tensor | None = None,
    style: str = "neox", layout: str = "bshd", rotary_dim: int | None = None, rotary_at: str = "front",
    q_scale: float = 1.0, k_scale: float = 1.0, rotary_scale: float = 1.0, cu_seqlens: Tensor | None = None,
    sections: Sequence[int] | None = None, section_layout: str = "contiguous", check_positions: bool = False,
    out_dtype: torch.dtype | None = None, backend: str = "auto", q_out_scale: str | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """Explicit backward of :func:`apply_rope` (cuDNN's ``rope_backward``): the gradients w.r.t. q (and k)
    given those w.r.t. the rotated outputs ``dq_rot`` (and ``dk_rot``) -- the rotation by -theta, times the same
    ``q_scale``/``k_scale`` and ``rotary_scale``. Pass the same arguments as to the forward call; see
    :func:`apply_rope` for each. Autograd uses the same kernel.
    """
    args = RopeArgs(positions=positions, inv_freq=inv_freq, base=base, cos=cos, sin=sin, angles=angles, style=style,
                    layout=layout, rotary_dim=rotary_dim, rotary_at=rotary_at, q_scale=q_scale, k_scale=k_scale,
                    rotary_scale=rotary_scale, cu_seqlens=cu_seqlens, sections=sections,
                    section_layout=section_layout, check_positions=check_positions,
                    out_dtype=out_dtype, backend=backend, q_out_scale=q_out_scale)
    return _rope(dq_rot, dk_rot, BACKWARD, args)


def qk_norm_rope(
    q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, *, eps: float = 1e-6, weight_offset: float = 0.0,
    positions: Positions = None, inv_freq: Tensor | None = None, base: float = 10000.0, cos: Tensor | None = None,
    sin: Tensor | None = None, angles: Tensor | None = None, style: str = "neox", layout: str = "bshd",
    rotary_dim: int | None = None, rotary_at: str = "front", q_scale: float = 1.0, k_scale: float = 1.0,
    rotary_scale: float = 1.0, cu_seqlens: Tensor | None = None, sections: Sequence[int] | None = None,
    section_layout: str = "contiguous", check_positions: bool = False, out_dtype: torch.dtype | None = None,
    q_out_scale: float | Tensor | str | None = None, k_out_scale: float | Tensor | str | None = None,
    norm_over: str = "head", v: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """Per-head RMSNorm of ``q`` and ``k`` over head_dim, then RoPE, in one kernel: returns new ``(q_out,
    k_out)`` (Qwen3's and OLMo-2's ``q_norm``/``k_norm`` before the rotation). Differentiable in q, k, q_weight and
    k_weight; ``torch.compile`` traces it as the op ``ropekit::qk_norm_rope``. The backward is one Triton kernel on
    CUDA, and deterministic: the weights' gradients (sums over every token and head) are added in a fixed order,
    so the same inputs give the same bits on every run.

    ``x_out = rope(x / sqrt(mean(x**2) + eps) * (weight + weight_offset))`` per head, with the mean over all D
    columns (the pass-through columns of a partial rotary come out normalised, not rotated). fp32 math (float64
    for float64 inputs) with one rounding at the store: unlike transformers' modules, the normalised values are not
    rounded to the input dtype before the rotation.

    q_weight, k_weight : Tensor [D]
        The norms' weights, any float dtype (read in fp32). ``weight_offset=1.0`` gives Gemma's ``(1 + w)``.
    eps : float
        Added to the mean square (> 0).
    out_dtype : None, torch.float8_e4m3fn or torch.float8_e5m2
        float8 outputs for FP8 attention, inference only (raises ``RuntimeError`` where q, k or a weight requires
        grad), traceable by ``torch.compile(fullgraph=True)`` (``ropekit::qk_norm_rope_fp8``). Stored = value / scale,
        rounded once to nearest even and saturated to the format's largest finite value (+-448, +-57344); NaN
        stays NaN.
    q_out_scale, k_out_scale : float, one-element float tensor, or "dynamic"
        float8 outputs' scales (default 1.0); a device tensor of shape [] or [1] keeps the call capturable in a
        CUDA graph. ``q_out_scale="dynamic"`` (k follows): each (token, head) row gets its own scale
        ``max |row| / fp8 max``, computed in the same launch, and the call returns ``(q_out, k_out, q_scales,
        k_scales)``, the scales float32 shaped like q and k without their last dim (an all-zero row: scale 0).

    norm_over : "head" (default) or "hidden"
        ``"hidden"``: the diffusion transformers' norm (WAN 2.x, FLUX.2): each token's mean square is taken over all
        its heads at once (H * D values), with weights ``q_weight`` [H * D] and ``k_weight`` [Hk * D] (head-major, as
        ``nn.RMSNorm(H * D)`` holds them), then each head is rotated; fp32 math (float64 for float64 inputs), one
        rounding at the store. On CUDA one kernel launch (q, k and v's copy), a program holding all heads of a
        token, so the sum of squares is one fixed tree and a token's bits do not depend on its batch; on CPU the
        torch path. Differentiable in q, k and the weights; the backward is composed, not one launch (the
        conjugate rotation, then the norm's backward in fp32 torch math). ``torch.compile(fullgraph=True)``
        traces it as ``ropekit::qk_hidden_norm_rope``. q's and k's dtypes only (no ``out_dtype``).
    v : Tensor, optional
        Shaped like k (any float dtype, any strides): also returned last, as a new contiguous tensor in q's dtype
        (the V copy diffusion transformers fuse; its gradient is the incoming one, cast back).

    Every other keyword is :func:`apply_rope`'s (positions, frequencies, pairing, layout, partial rotary, scales,
    packed sequences, multi-axis positions). Raises ``TypeError``/``ValueError``/``IndexError`` naming the
    argument.

    >>> q_out, k_out = ropekit.qk_norm_rope(q, k, attn.q_norm.weight, attn.k_norm.weight, eps=1e-6,
    ...                                     positions=position_ids, base=1000000.0)
    """
    if norm_over != "head" or v is not None:
        return _qk_hidden_norm_rope(
            q, k, q_weight, k_weight, v, norm_over, eps=eps, weight_offset=weight_offset, positions=positions,
            inv_freq=inv_freq, base=base, cos=cos, sin=sin, angles=angles, style=style, layout=layout,
            rotary_dim=rotary_dim, rotary_at=rotary_at, q_scale=q_scale, k_scale=k_scale, rotary_scale=rotary_scale,
            cu_seqlens=cu_seqlens, sections=sections, section_layout=section_layout,
            check_positions=check_positions, out_dtype=out_dtype, q_out_scale=q_out_scale, k_out_scale=k_out_scale)
    norm = NormSpec(q_weight, k_weight, weight_offset=weight_offset, eps=eps)
    args = RopeArgs(positions=positions, inv_freq=inv_freq, base=base, cos=cos, sin=sin, angles=angles, style=style,
                    layout=layout, rotary_dim=rotary_dim, rotary_at=rotary_at, q_scale=q_scale, k_scale=k_scale,
                    rotary_scale=rotary_scale, cu_seqlens=cu_seqlens, sections=sections,
                    section_layout=section_layout, check_positions=check_positions, out_dtype=out_dtype)
    return _fastpath.norm_rotate(q, k, norm, args, OutScales(q_out_scale, k_out_scale))


def _qk_hidden_norm_rope(q, k, q_weight, k_weight, v, norm_over, *, eps, weight_offset, layout, out_dtype,
                         q_out_scale, k_out_scale, **rope_kwargs):
    """qk_norm_rope with ``norm_over="hidden"`` and/or a ``v`` to copy (:mod:`ropekit._hidden_norm`)."""
    from ropekit import _hidden_norm

    _hidden_norm.check_hidden_norm(q, k, q_weight, k_weight, v, layout, norm_over, out_dtype, q_out_scale,
                                   k_out_scale)
    if norm_over == "hidden":
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        from ropekit import autograd

        spec = validate_args(q, k, RopeArgs(layout=layout, **rope_kwargs), FORWARD)
        norm = NormSpec(q_weight, k_weight, weight_offset=float(weight_offset), eps=float(eps))
        return autograd.hidden_norm_rotate(q, k, v, norm, spec)
    else:
        norm = NormSpec(q_weight, k_weight, weight_offset=weight_offset, eps=eps)
        args = RopeArgs(layout=layout, out_dtype=out_dtype, **rope_kwargs)
        outs = tuple(_fastpath.norm_rotate(q, k, norm, args, OutScales(q_out_scale, k_out_scale)))
    return outs if v is None else (*outs, _hidden_norm.copy_v(v, q.dtype))


def rope_kv_write(
    q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, *, positions: Positions,
    slot_mapping: Tensor | None = None, cache_layout: str = "bshd", q_weight: Tensor | None = None,
    k_weight: Tensor | None = None, eps: float = 1e-6, weight_offset: float = 0.0, k_cache_scale=None,
    v_cache_scale=None, cu_seqlens: Tensor | None = None, inv_freq: Tensor | None = None, base: float = 10000.0,
    cos: Tensor | None = None, sin: Tensor | None = None, angles: Tensor | None = None, style: str = "neox",
    layout: str = "bshd", rotary_dim: int | None = None, rotary_at: str = "front", q_scale: float = 1.0,
    k_scale: float = 1.0, rotary_scale: float = 1.0, sections: Sequence[int] | None = None,
    section_layout: str = "contiguous", check_positions: bool = False, out_dtype: torch.dtype | None = None,
    q_out_scale: float | Tensor | str | None = None, return_k: bool = False, kv_indices: Tensor | None = None,
    kv_indptr: Tensor | None = None, kv_last_page_len: Tensor | None = None, batch_indices: Tensor | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """The attention prologue of a decode or prefill step in one kernel: rotate q and k (after a per-head RMSNorm
    with ``q_weight``/``k_weight``), write the rotated k and the unchanged v into the KV caches, return the rotated
    q. Inputs are never modified. Inference only (raises where autograd would need gradients).

    q : Tensor [T, Hq, D] (packed tokens) or 4-D [B, S, Hq, D] (``layout="bhsd"``: [B, Hq, S, D])
    k, v : Tensor [T, Hkv, D] or 4-D like q
        float16, bfloat16 or float32, one dtype; any strides with a contiguous last dim (views of one packed QKV
        buffer are read in place).
    k_cache, v_cache : Tensor
        ``cache_layout="bshd"``: [B, max_seq, Hkv, D], token (b, p) goes to row [b, p], p its position;
        ``"bhsd"``: [B, Hkv, max_seq, D] (transformers' StaticCache), the same rows. Paged caches, whose rows
        are (block, offset) and whose tokens go to slot ``slot_mapping[t]`` (= block * block_size + offset; -1
        skips the token) or where a page table says (below): ``"paged"`` [num_blocks, block_size, Hkv, D] (NHD:
        vLLM's flash layout, FlashInfer's NHD); ``"paged_hnd"`` [num_blocks, Hkv, block_size, D] (FlashInfer's
        HND); ``"paged_x"``, vLLM's paged-attention layout (``reshape_and_cache``'s): k_cache [num_blocks, Hkv,
        D/x, block_size, x] (column d at [.., d // x, offset, d % x]; vLLM's x is 16 bytes / the cache element
        size: 8 for bf16/fp16, 16 for float8) and v_cache [num_blocks, Hkv, D, block_size]. Each cache is
        written through its own strides. 3-D tokens are one per sequence (b = t), or with ``cu_seqlens`` the
        tokens of sequence b. Cache dtype: the inputs' dtype (v is copied bit for bit), ``torch.float8_e4m3fn`` or
        ``torch.float8_e5m2`` (stored = value / scale, rounded to nearest even, saturated to +-448 / +-57344).
    positions : int or Tensor
        Each token's position (int32/int64 [T] or [B, S]; an int: offset of 0..S-1): the rotation's position and,
        for "bshd"/"bhsd", its cache row.
    slot_mapping : Tensor, optional
        int32/int64 [T] or [B, S]; a paged cache's slots. For [T, H, D] tokens it may be shorter, [T'] (vLLM's
        CUDA-graph padding): the tokens from T' on are rotated but not written.
    kv_indices, kv_indptr, kv_last_page_len, batch_indices : Tensor, optional
        A paged cache's page table instead of ``slot_mapping``, as FlashInfer's ``append_paged_kv_cache`` takes
        it (int32/int64): request r owns pages ``kv_indices[kv_indptr[r]:kv_indptr[r + 1]]`` (kv_indptr [R + 1])
        and ``(pages - 1) * block_size + kv_last_page_len[r]`` rows (kv_last_page_len [R], the length after this
        write). Token t of request ``batch_indices[t]`` ([T], or [B, S] for 4-D inputs; default: the token's own
        sequence; -1 skips the token) at position p (``positions``: the rotation's position is its cache
        position) goes to row ``p % block_size`` of page ``kv_indices[kv_indptr[r] + p // block_size]``. The
        page and row are found in the kernel (no host sync; capturable in a CUDA graph).
    k_cache_scale, v_cache_scale : float or float tensor, optional
        float8 caches' scales (default 1.0): a float, a device tensor of shape [] or [1] (vLLM's), or [Hkv] (one
        per cache head); a device tensor keeps the call capturable in a CUDA graph.
    out_dtype, q_out_scale :
        A float8 q output, as :func:`qk_norm_rope`'s: with ``q_out_scale="dynamic"`` returns ``(q_out,
        q_scales)``, q_scales float32 shaped like q without its last dim.
    return_k : bool
        Also return the rotated (and normalised) k, in k's shape and dtype, last: the values ``qk_norm_rope``
        returns for it (vLLM's fused op rotates ``key`` in place), padding tokens of a short ``slot_mapping``
        included. Computed in the same launch.
    q_weight, k_weight, eps, weight_offset :
        Per-head RMSNorm before the rotation, as :func:`qk_norm_rope` (both weights or neither).

    Every other keyword is :func:`apply_rope`'s. Positions, slots, requests and pages outside the caches (or
    past a request's rows) raise ``IndexError`` where their values are on the host (CPU tensors, ints, or
    ``check_positions=True``: one sync); on the GPU such tokens write nothing (never an out-of-bounds write).
    Tokens that share a cache row write it in no set order. Raises ``TypeError``/``ValueError``/``IndexError``
    naming the argument; nothing is written when it raises.

    >>> # decode: one token per sequence from a packed QKV projection, into a StaticCache-layout cache
    >>> q, k, v = qkv.view(B, Hq + 2 * Hkv, D).split([Hq, Hkv, Hkv], dim=1)
    >>> q_rot = ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=cache_lengths, cache_layout="bhsd",
    ...                               q_weight=q_norm.weight, k_weight=k_norm.weight, base=1000000.0)
    """
    cache = CacheArgs(v, k_cache, v_cache, slot_mapping=slot_mapping, cache_layout=cache_layout,
                      k_cache_scale=k_cache_scale, v_cache_scale=v_cache_scale, kv_indices=kv_indices,
                      kv_indptr=kv_indptr, kv_last_page_len=kv_last_page_len, batch_indices=batch_indices)
    norm = NormSpec(q_weight, k_weight, weight_offset=weight_offset, eps=eps)
    args = RopeArgs(positions=positions, inv_freq=inv_freq, base=base, cos=cos, sin=sin, angles=angles, style=style,
                    layout=layout, rotary_dim=rotary_dim, rotary_at=rotary_at, q_scale=q_scale, k_scale=k_scale,
                    rotary_scale=rotary_scale, cu_seqlens=cu_seqlens, sections=sections,
                    section_layout=section_layout, check_positions=check_positions, out_dtype=out_dtype)
    return _fastpath.write_kv(q, k, cache, norm, args, OutScales(q_out_scale, return_k=return_k))
