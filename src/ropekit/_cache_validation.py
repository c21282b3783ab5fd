"""Validation of :func:`ropekit.rope_kv_write`'s cache arguments: :func:`validate_kv_write` checks the tensors and
the caches, before anything is written, and turns them into a :class:`ropekit._spec.CacheSpec`. Raises
``TypeError``/``ValueError``/``IndexError`` naming the argument.

Built on :mod:`ropekit._validation`'s checks; imports nothing of ropekit above it and the leaves.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ropekit._memory import overlap
from ropekit._spec import (
    CACHE_LAYOUTS,
    FP8_CACHE_DTYPES,
    INT_DTYPES,
    CacheArgs,
    CacheSpec,
    RopeArgs,
    to_canonical,
)
from ropekit._validation import (
    _check_offset_tensor,
    _check_tensor,
    _host_readable,
    _is_int,
    _is_symbolic,
    _last_position,
    _scale,
)


def _cache_scale(name: str, scale, cache: Tensor, cache_name: str, check_values: bool, heads: int):
    """A float8 cache's scale (per tensor, or per head: ``heads``) as the kernels take it."""
    if scale is not None and cache.dtype not in FP8_CACHE_DTYPES:
        raise ValueError(f"{name} applies to float8 caches only; {cache_name} is {cache.dtype}")
    return _scale(name, scale, cache.device, f"{cache_name}'s device", check_values, heads)


def _cache_rows_reached(positions, S: int, n_seqs: int, layout: str, cu_seqlens: Tensor | None,
                        check_positions: bool) -> tuple[str, int] | None:
    """(what, the largest position) of a write into a "bshd"/"bhsd" cache -- the last row it reaches in a sequence:
    the largest per-token position, or a sequence's offset plus its length - 1 -- where the values are on the host
    (ints, CPU tensors, or ``check_positions``: one sync); None elsewhere, where no token is written, or where
    ``positions``/``cu_seqlens`` are malformed (validation names them)."""
    if torch.compiler.is_compiling():
        return None

    def readable(t: Tensor) -> bool:
        return check_positions or _host_readable(t)

    lengths = None  # [n_seqs] on the host, for packed sequences whose boundaries can be read
    if cu_seqlens is not None:
        if cu_seqlens.dtype not in INT_DTYPES or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
                or not readable(cu_seqlens):
            return None
        cu = cu_seqlens.to("cpu", torch.int64)
        lengths = cu[1:] - cu[:-1]
        if cu[0] != 0 or cu[-1] != S or bool((lengths < 0).any()):
            return None
    if isinstance(positions, Tensor):
        if positions.dtype not in INT_DTYPES or not readable(positions) or positions.numel() == 0:
            return None
        per_sequence = positions.dim() == 0 or (positions.dim() == 1 and positions.shape[0] == n_seqs
                                                and (cu_seqlens is not None or layout != "thd"))
        if not per_sequence:
            return "positions", int(positions.max())
        if cu_seqlens is not None and lengths is None:
            return None
        offsets = positions.reshape(-1).to("cpu", torch.int64).expand(n_seqs)
        lens = lengths if cu_seqlens is not None else torch.full((n_seqs,), S, dtype=torch.int64)
        hi = _last_position(offsets, lens)
        return None if hi is None else ("positions (per-sequence offsets)", hi)
    if not _is_int(positions) or _is_symbolic(positions):
        return None
    if cu_seqlens is None:
        longest = S
    elif lengths is None:
        return None
    else:
        longest = int(lengths.max()) if lengths.numel() else 0
    return ("positions", int(positions) + longest - 1) if longest else None


def validate_kv_write(q: Tensor, k: Tensor, cache_args: CacheArgs,
                      args: RopeArgs) -> tuple[Tensor, Tensor, Tensor, RopeArgs, CacheSpec]:
    """Check :func:`ropekit.rope_kv_write`'s tensors and cache arguments. Returns q, k, v as 4-D views (3-D tokens
    [T, H, D] become [T, 1, H, D], one token per sequence, or [1, T, H, D] with ``cu_seqlens``), ``args`` with the
    positions to rotate by in the same shape and that layout (``cu_seqlens`` kept for packed tokens only): what
    :func:`validate_args` takes for the rotation -- and the :class:`CacheSpec`."""
    v, k_cache, v_cache, slot_mapping = cache_args.v, cache_args.k_cache, cache_args.v_cache, cache_args.slot_mapping
    cache_layout, k_cache_scale, v_cache_scale = (cache_args.cache_layout, cache_args.k_cache_scale,
                                                  cache_args.v_cache_scale)
    positions, cu_seqlens, layout = args.positions, args.cu_seqlens, args.layout
    sections, check_positions = args.sections, args.check_positions
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [T, Hq, D] (tokens) or 4-D in layout {layout!r}, got shape {tuple(q.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dim() != q.dim():
            raise ValueError(f"{name} must have q's {q.dim()} dims, got shape {tuple(x.shape)}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if v.stride(-1) != 1:
        raise ValueError("v must have a contiguous last dim (stride 1)")
    if isinstance(positions, Tensor) and positions.dim() == 0:  # one offset for every sequence
        _check_offset_tensor(positions, q)
        if _host_readable(positions) and not torch.compiler.is_compiling():
            positions = int(positions)  # a host scalar: the int offset (a device one stays a tensor: no sync)
    tokens = q.dim() == 3
    if tokens and cu_seqlens is None and sections is None and isinstance(positions, Tensor) \
            and positions.dim() == 2 and positions.shape[0] != q.shape[0] and positions.shape[1] == q.shape[0]:
        raise ValueError(f"positions for [T, H, D] tokens must be [T] = [{q.shape[0]}] (one per token), got shape "
                         f"{tuple(positions.shape)}; a 2-D [A, T] positions tensor holds multi-axis positions (one "
                         "row of ids per axis, M-RoPE): pass sections= too (rotary pairs per axis)")
    if tokens and cu_seqlens is None:  # one token per sequence: [T, 1, H, D]
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
        layout = "bshd"
        if isinstance(positions, Tensor) and positions.dim() == (1 if sections is None else 2):
            positions = positions.unsqueeze(-1)  # [T] -> [T, 1]; multi-axis [A, T] -> [A, T, 1]
    elif tokens:  # packed sequences: the core op's "thd" layout
        layout = "thd"
    elif cu_seqlens is not None:
        raise ValueError("cu_seqlens applies to 3-D [T, H, D] tokens only")
    if tokens and isinstance(slot_mapping, Tensor) and slot_mapping.dim() == 1:
        slot_mapping = slot_mapping.view(-1, 1) if cu_seqlens is None else slot_mapping.view(1, -1)
    kc4 = to_canonical(k, layout)
    B, S, HK, D = kc4.shape
    if not isinstance(cache_layout, str) or cache_layout not in CACHE_LAYOUTS:
        raise ValueError(f"cache_layout must be one of {CACHE_LAYOUTS}, got {cache_layout!r}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(c).__name__}")
        if c.dtype != q.dtype and c.dtype not in FP8_CACHE_DTYPES:
            raise TypeError(f"{name} must have the inputs' dtype {q.dtype}, float8_e4m3fn or float8_e5m2, got "
                            f"{c.dtype}")
        if c.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {c.device}")
        if c.dim() != 4 or c.stride(-1) != 1:
            raise ValueError(f"{name} must be a 4-D tensor with a contiguous last dim, got shape {tuple(c.shape)} "
                             f"strides {c.stride()}")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if not torch.compiler.is_compiling():  # addresses are unknown while tracing
        if overlap(k_cache, v_cache):
            raise ValueError("k_cache and v_cache share memory: the rows written for k and for v would overwrite "
                             "each other. Pass two caches (or non-overlapping views of one buffer)")
        for cache_name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.is_inference() and not torch.is_inference_mode_enabled():
                raise RuntimeError(f"{cache_name} is an inference tensor: writing it outside torch.inference_mode() "
                                   "is refused, as torch refuses in-place updates of inference tensors there")
            for name, x in (("q", q), ("k", k), ("v", v)):
                if overlap(c, x):
                    raise ValueError(f"{cache_name} and {name} share memory: the cache write would change the "
                                     f"input while it is read. Pass {name} as a tensor outside the cache")
    expected = {"bshd": "[B, max_seq, Hkv, D]", "bhsd": "[B, Hkv, max_seq, D]",
                "paged": "[num_blocks, block_size, Hkv, D]"}[cache_layout]
    kcv = k_cache if cache_layout != "bhsd" else k_cache.transpose(1, 2)
    if kcv.shape[2] != HK or kcv.shape[3] != D:
        raise ValueError(f"k_cache must be {expected} with Hkv = {HK} and D = {D} (k's), got {tuple(k_cache.shape)}")
    paged = cache_layout == "paged"
    cache_batch = None
    if paged:
        if slot_mapping is None:
            raise ValueError('cache_layout="paged" needs slot_mapping (each token\'s slot, -1 to skip)')
        _check_tensor("slot_mapping", slot_mapping, q, INT_DTYPES, "an int32 or int64 tensor")
        short = tokens and slot_mapping.dim() == 2 and slot_mapping.numel() <= B * S \
            and slot_mapping.shape[1 if cu_seqlens is None else 0] == 1
        if tuple(slot_mapping.shape) != (B, S) and not short:  # a short [T'] mapping: the tokens past T' are padding
            want = f"[T'] with T' <= T = {B * S} (the tokens past T' are padding)" if tokens else f"[{B}, {S}]"
            raise ValueError(f"slot_mapping must have shape {want}, one slot per token, got "
                             f"{tuple(slot_mapping.shape)}")
        rows = kcv.shape[0] * kcv.shape[1]
        if (_host_readable(slot_mapping) or check_positions) and slot_mapping.numel() \
                and not torch.compiler.is_compiling():
            lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
            if lo < -1 or hi >= rows:
                raise IndexError(f"slot_mapping must hold slots in [0, {rows}) (num_blocks * block_size) or -1, "
                                 f"got values in [{lo}, {hi}]")
    else:
        if slot_mapping is not None:
            raise ValueError(f'slot_mapping applies to cache_layout="paged" only, got cache_layout={cache_layout!r}')
        if sections is not None:
            raise ValueError("multi-axis positions (sections) need cache_layout=\"paged\" with slot_mapping: the "
                             "cache row of a token is not one of its positions")
        rows = kcv.shape[1]
        if tokens and cu_seqlens is not None:
            _check_tensor("cu_seqlens", cu_seqlens, q, INT_DTYPES, "an int32 or int64 tensor")
            if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
                raise ValueError(f"cu_seqlens must be [num_seqs + 1], got shape {tuple(cu_seqlens.shape)}")
            n_seqs = cu_seqlens.numel() - 1
            token_index = torch.arange(S, device=q.device, dtype=cu_seqlens.dtype)
            cache_batch = torch.searchsorted(cu_seqlens[1:].contiguous(), token_index, right=True).to(torch.int64)
        else:
            n_seqs = B
        if kcv.shape[0] < n_seqs:
            raise ValueError(f"k_cache holds {kcv.shape[0]} sequences, fewer than the {n_seqs} written")
        reach = _cache_rows_reached(positions, S, n_seqs, layout, cu_seqlens if tokens else None, check_positions)
        if reach is not None and reach[1] >= rows:
            raise IndexError(f"{reach[0]} reach {reach[1]} but the caches hold {rows} rows per sequence "
                             f"(cache_layout={cache_layout!r})")
    k_scale = _cache_scale("k_cache_scale", k_cache_scale, k_cache, "k_cache", check_positions, HK)
    v_scale = _cache_scale("v_cache_scale", v_cache_scale, v_cache, "v_cache", check_positions, HK)
    spec = CacheSpec(k_cache, v_cache, cache_layout, cache_batch, slot_mapping if paged else None, k_scale, v_scale)
    rope_args = args._replace(positions=positions, layout=layout, cu_seqlens=cu_seqlens if layout == "thd" else None)
    return q, k, v, rope_args, spec
