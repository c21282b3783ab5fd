"""Validation of :func:`ropekit.rope_kv_write`'s cache arguments: :func:`validate_kv_write` checks the tensors and
the caches, before anything is written, and turns them into a :class:`ropekit._spec.CacheSpec`. Raises
``TypeError``/``ValueError``/``IndexError`` naming the argument.

Built on :mod:`ropekit._validation`'s checks; imports nothing of ropekit above it and the leaves.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ropekit._memory import has_internal_overlap, overlap
from ropekit._spec import (
    CACHE_LAYOUTS,
    FP8_CACHE_DTYPES,
    INT_DTYPES,
    PAGED_LAYOUTS,
    CacheArgs,
    CacheSpec,
    RopeArgs,
    to_canonical,
)
from ropekit._validation import (
    _check_offset_tensor,
    _check_tensor,
    _dense,
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
    if tokens:  # per-token [T] tensors in the tokens' [B, S] shape
        slot_mapping, batch_indices = (_as_token_grid(t, cu_seqlens is not None)
                                       for t in (slot_mapping, cache_args.batch_indices))
    else:
        batch_indices = cache_args.batch_indices
    page_table = (cache_args.kv_indices, cache_args.kv_indptr, cache_args.kv_last_page_len, batch_indices)
    kc4 = to_canonical(k, layout)
    B, S, HK, D = kc4.shape
    if not isinstance(cache_layout, str) or cache_layout not in CACHE_LAYOUTS:
        raise ValueError(f"cache_layout must be one of {CACHE_LAYOUTS}, got {cache_layout!r}")
    x_packed = cache_layout == "paged_x"
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(c).__name__}")
        if c.dtype != q.dtype and c.dtype not in FP8_CACHE_DTYPES:
            raise TypeError(f"{name} must have the inputs' dtype {q.dtype}, float8_e4m3fn or float8_e5m2, got "
                            f"{c.dtype}")
        if c.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {c.device}")
        dims = 5 if x_packed and name == "k_cache" else 4
        if x_packed and name == "v_cache":  # [num_blocks, Hkv, D, block_size]: the columns are strided
            if c.dim() != 4:
                raise ValueError(f"v_cache must be a 4-D tensor [num_blocks, Hkv, D, block_size] for "
                                 f"cache_layout='paged_x', got shape {tuple(c.shape)}")
        elif c.dim() != dims or c.stride(-1) != 1:
            raise ValueError(f"{name} must be a {dims}-D tensor with a contiguous last dim, got shape "
                             f"{tuple(c.shape)} strides {c.stride()}")
        if has_internal_overlap(c):  # expand(): rows of different tokens would land on one element
            raise ValueError(f"{name} reaches an element twice through its strides (expand()?): it cannot be "
                             f"written; pass a cache with memory of its own, got strides {c.stride()}")
    kcv, vcv = CacheSpec(k_cache, v_cache, cache_layout, None, None, 1.0, 1.0).views()
    k_grid = (*kcv.shape[:3], kcv.shape[3] * kcv.shape[4]) if x_packed else tuple(kcv.shape)
    if tuple(vcv.shape) != k_grid:
        want = (f"[num_blocks, Hkv, D, block_size] = {[k_grid[0], k_grid[2], k_grid[3], k_grid[1]]} (k_cache's "
                f"blocks, heads, D/x * x and block_size)" if x_packed else f"k_cache's shape {tuple(k_cache.shape)}")
        raise ValueError(f"v_cache must have {want}, got {tuple(v_cache.shape)}")
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
                "paged": "[num_blocks, block_size, Hkv, D]", "paged_hnd": "[num_blocks, Hkv, block_size, D]",
                "paged_x": "[num_blocks, Hkv, D/x, block_size, x]"}[cache_layout]
    if k_grid[2] != HK or k_grid[3] != D:
        raise ValueError(f"k_cache must be {expected} with Hkv = {HK} and D = {D} (k's), got {tuple(k_cache.shape)}")
    paged = cache_layout in PAGED_LAYOUTS
    cache_batch = None
    table = _page_table_given(page_table, paged, slot_mapping, cache_layout)
    if table:
        if sections is not None:
            raise ValueError("multi-axis positions (sections) need slot_mapping: with a page table (kv_indptr, "
                             "...) a token's cache row is its position")
        if tokens and cu_seqlens is not None and page_table[3] is None:
            cache_batch = _packed_batch(cu_seqlens, q, S)
        n_seqs = cu_seqlens.numel() - 1 if tokens and cu_seqlens is not None else B
        page_table = _check_page_table(page_table, q, B, S, n_seqs, k_grid[0], k_grid[1], check_positions)
        _check_page_rows(page_table, positions, B, S, layout, cu_seqlens if tokens else None, cache_batch,
                         k_grid[1], check_positions)
    elif paged:
        if slot_mapping is None:
            raise ValueError(f"cache_layout={cache_layout!r} needs slot_mapping (each token's slot, -1 to skip) or a "
                             "page table (kv_indptr, kv_indices, kv_last_page_len)")
        _check_tensor("slot_mapping", slot_mapping, q, INT_DTYPES, "an int32 or int64 tensor")
        short = tokens and slot_mapping.dim() == 2 and slot_mapping.numel() <= B * S \
            and slot_mapping.shape[1 if cu_seqlens is None else 0] == 1
        if tuple(slot_mapping.shape) != (B, S) and not short:  # a short [T'] mapping: the tokens past T' are padding
            want = f"[T'] with T' <= T = {B * S} (the tokens past T' are padding)" if tokens else f"[{B}, {S}]"
            raise ValueError(f"slot_mapping must have shape {want}, one slot per token, got "
                             f"{tuple(slot_mapping.shape)}")
        rows = k_grid[0] * k_grid[1]
        if (_host_readable(slot_mapping) or check_positions) and slot_mapping.numel() \
                and not torch.compiler.is_compiling():
            lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
            if lo < -1 or hi >= rows:
                raise IndexError(f"slot_mapping must hold slots in [0, {rows}) (num_blocks * block_size) or -1, "
                                 f"got values in [{lo}, {hi}]")
    else:
        if slot_mapping is not None:
            raise ValueError(f"slot_mapping applies to the paged caches {PAGED_LAYOUTS} only, got "
                             f"cache_layout={cache_layout!r}")
        if sections is not None:
            raise ValueError("multi-axis positions (sections) need cache_layout=\"paged\" with slot_mapping: the "
                             "cache row of a token is not one of its positions")
        rows = kcv.shape[1]
        if tokens and cu_seqlens is not None:
            cache_batch = _packed_batch(cu_seqlens, q, S)
            n_seqs = cu_seqlens.numel() - 1
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
    spec = CacheSpec(k_cache, v_cache, cache_layout, cache_batch, slot_mapping if paged and not table else None,
                     k_scale, v_scale, *(page_table if table else (None,) * 4))
    rope_args = args._replace(positions=positions, layout=layout, cu_seqlens=cu_seqlens if layout == "thd" else None)
    return q, k, v, rope_args, spec


def _as_token_grid(t, packed: bool):
    """A 1-D per-token tensor [T] as the tokens' [B, S]: [T, 1] (one token per sequence) or [1, T] (packed)."""
    if isinstance(t, Tensor) and t.dim() == 1:
        return t.view(1, -1) if packed else t.view(-1, 1)
    return t


def _packed_batch(cu_seqlens, q: Tensor, S: int) -> Tensor:
    """Each packed token's sequence [T] int64 (from ``cu_seqlens``, checked)."""
    _check_tensor("cu_seqlens", cu_seqlens, q, INT_DTYPES, "an int32 or int64 tensor")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be [num_seqs + 1], got shape {tuple(cu_seqlens.shape)}")
    token_index = torch.arange(S, device=q.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), token_index, right=True).to(torch.int64)


_TABLE_NAMES = ("kv_indices", "kv_indptr", "kv_last_page_len", "batch_indices")


def _page_table_given(page_table: tuple, paged: bool, slot_mapping, cache_layout: str) -> bool:
    """Whether the call addresses its paged cache by a page table (FlashInfer's ``kv_indices``, ``kv_indptr``,
    ``kv_last_page_len``, with optional ``batch_indices``); raises for a partial table, a table beside
    ``slot_mapping`` or one for a cache that is not paged."""
    given = [name for name, t in zip(_TABLE_NAMES, page_table) if t is not None]
    if not given:
        return False
    if not paged:
        raise ValueError(f"{given[0]} (a page table) applies to the paged caches {PAGED_LAYOUTS}, got "
                         f"cache_layout={cache_layout!r}")
    missing = [name for name, t in zip(_TABLE_NAMES[:3], page_table) if t is None]
    if missing:
        raise ValueError(f"{missing[0]} is missing: a page table needs kv_indices, kv_indptr and kv_last_page_len "
                         "together (batch_indices optional)")
    if slot_mapping is not None:
        raise ValueError("give slot_mapping or a page table (kv_indices, kv_indptr, kv_last_page_len), not both")
    return True


def _check_page_table(page_table: tuple, q: Tensor, B: int, S: int, n_seqs: int, num_pages: int, page_size: int,
                      check_values: bool) -> tuple:
    """The page table's tensors checked (dtype, device, shape; values where on the host or ``check_values``) and
    dense, as the kernel indexes them; ``batch_indices`` as [B, S] or None."""
    for name, t in zip(_TABLE_NAMES, page_table):
        if t is not None:
            _check_tensor(name, t, q, INT_DTYPES, "an int32 or int64 tensor")
    indices, indptr, last, batch = page_table
    for name, t in zip(_TABLE_NAMES[:3], page_table):
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if indptr.numel() < 1:
        raise ValueError("kv_indptr must be [num_requests + 1], got an empty tensor")
    requests = indptr.numel() - 1
    if last.numel() != requests:
        raise ValueError(f"kv_last_page_len must be [num_requests] = [{requests}] (kv_indptr has {requests + 1} "
                         f"entries), got shape {tuple(last.shape)}")
    if batch is not None:
        if tuple(batch.shape) != (B, S):
            want = f"[T] = [{B * S}]" if q.dim() == 3 else f"[{B}, {S}]"
            raise ValueError(f"batch_indices must have shape {want}, one request per token, got "
                             f"{tuple(batch.shape)}")
    elif requests < n_seqs:
        raise ValueError(f"kv_indptr holds {requests} requests, fewer than the {n_seqs} sequences written (pass "
                         "batch_indices to name each token's request)")
    if not torch.compiler.is_compiling():
        if check_values or _host_readable(indptr):
            ptr = indptr.to("cpu", torch.int64)
            if int(ptr[0]) < 0 or bool((ptr[1:] < ptr[:-1]).any()) or int(ptr[-1]) > indices.numel():
                raise ValueError(f"kv_indptr must start at >= 0, never decrease and end at most at len(kv_indices) "
                                 f"= {indices.numel()}; got {ptr.tolist()[:8]}{'...' if ptr.numel() > 8 else ''}")
            if check_values or _host_readable(indices):
                used = indices[int(ptr[0]):int(ptr[-1])]
                if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
                    raise IndexError(f"kv_indices must hold pages in [0, {num_pages}) (num_pages), got values in "
                                     f"[{int(used.min())}, {int(used.max())}]")
        if (check_values or _host_readable(last)) and last.numel():
            if int(last.min()) < 0 or int(last.max()) > page_size:
                raise ValueError(f"kv_last_page_len must hold lengths in [0, {page_size}] (page_size), got values "
                                 f"in [{int(last.min())}, {int(last.max())}]")
        if batch is not None and (check_values or _host_readable(batch)) and batch.numel():
            lo, hi = int(batch.min()), int(batch.max())
            if lo < -1 or hi >= requests:
                raise IndexError(f"batch_indices must hold requests in [0, {requests}) (len(kv_indptr) - 1) or -1, "
                                 f"got values in [{lo}, {hi}]")
    return (_dense(indices), _dense(indptr), _dense(last), batch)


def _host_token_positions(positions, B: int, S: int, layout: str, cu_seqlens, check_values: bool):
    """Each token's position [B, S] int64 on the host, where every value is known there (an int, host tensors, or
    ``check_values``: one sync); None elsewhere or where the forms are malformed (validation names them)."""
    def readable(t) -> bool:
        return not isinstance(t, Tensor) or check_values or _host_readable(t)

    if torch.compiler.is_compiling() or not readable(positions) or (cu_seqlens is not None
                                                                     and not readable(cu_seqlens)):
        return None
    index = torch.arange(S).expand(B, S)  # the token's index within its sequence
    seq = None
    if cu_seqlens is not None:  # packed tokens [1, T]
        cu = cu_seqlens.to("cpu", torch.int64)
        seq = torch.searchsorted(cu[1:], torch.arange(S), right=True).clamp(max=cu.numel() - 2)
        index = (torch.arange(S) - cu[seq]).view(1, S)
    if _is_int(positions) and not _is_symbolic(positions):
        return int(positions) + index
    if not isinstance(positions, Tensor) or positions.dtype not in INT_DTYPES:
        return None
    pos = positions.to("cpu", torch.int64)
    if pos.dim() == 0:
        return int(pos) + index
    if layout == "thd" and pos.dim() == 1 and pos.numel() == S:
        return pos.view(1, S)
    if seq is not None and pos.dim() == 1 and pos.numel() == cu.numel() - 1:
        return (pos[seq] + index.view(S)).view(1, S)
    if pos.dim() == 1 and pos.numel() == B and layout != "thd":
        return pos.view(B, 1) + index
    if pos.dim() == 2 and pos.shape[1] == S and pos.shape[0] in (1, B):
        return pos.expand(B, S)
    return None


def _check_page_rows(page_table: tuple, positions, B: int, S: int, layout: str, cu_seqlens, cache_batch,
                     page_size: int, check_values: bool) -> None:
    """Raise ``IndexError`` for a token whose position lies past its request's pages -- ``(pages - 1) * page_size
    + kv_last_page_len`` rows --, where every value is on the host (or ``check_values``); on the device such tokens
    write nothing. Tokens of request -1 and negative positions (which the rotation's checks name) are left out."""
    indices, indptr, last, batch = page_table
    tensors = [t for t in (indptr, last, batch, cache_batch) if t is not None]
    if torch.compiler.is_compiling() or not (check_values or all(_host_readable(t) for t in tensors)):
        return
    pos = _host_token_positions(positions, B, S, layout, cu_seqlens, check_values)
    if pos is None or pos.numel() == 0:
        return
    if batch is not None:
        req = batch.to("cpu", torch.int64)
    elif cache_batch is not None:
        req = cache_batch.to("cpu", torch.int64).view(1, S)
    else:
        req = torch.arange(B).view(B, 1).expand(B, S)
    ptr, lengths = indptr.to("cpu", torch.int64), last.to("cpu", torch.int64)
    write = (req >= 0) & (pos >= 0)
    if not bool(write.any()):
        return
    req, pos = req[write], pos[write]
    pages = ptr[req + 1] - ptr[req]
    rows = torch.where(pages > 0, (pages - 1) * page_size + lengths[req], 0)
    past = pos >= rows
    if bool(past.any()):
        i = int(past.nonzero()[0, 0])
        raise IndexError(f"positions: a token of request {int(req[i])} is at position {int(pos[i])}, past the "
                         f"{int(rows[i])} cache rows of its pages ((pages - 1) * page_size + kv_last_page_len; "
                         "kv_indptr, kv_last_page_len)")
