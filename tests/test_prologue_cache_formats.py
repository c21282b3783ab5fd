"""``ropekit.rope_kv_write`` into the cache formats engines use beyond "bshd"/"bhsd"/"paged" with slots: vLLM's
paged-attention layout (``cache_layout="paged_x"``: keys [num_blocks, Hkv, D/x, block_size, x], values [num_blocks,
Hkv, D, block_size]), FlashInfer's HND pages (``"paged_hnd"``) and FlashInfer's page table (``kv_indices``,
``kv_indptr``, ``kv_last_page_len``, ``batch_indices``) in place of ``slot_mapping``.

The expected caches are written here from each format's documented semantics, by explicit loops over tokens, heads
and columns, into copies of the poisoned caches (NaN, or the byte 0xFF for float8): every element a token maps to
holds its rotated k (within the tolerance table) or its v (bit for bit), every other element keeps its poison bits.
Routes as the rest of the suite: the CPU path, the kernels under the interpreter, CUDA (``gpu``).
"""

from __future__ import annotations

import pytest
import torch

import ropekit
from helpers import (
    INTERPRETED,
    ROUTE_BACKENDS,
    ROUTES,
    assert_unchanged,
    cos_sin64,
    norm_weight,
    on_route,
    rms64,
    rope_opts64,
    rotate64,
    same_bits,
    snapshot,
)
from ropekit.testing import assert_close_to_ref

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


# ------------------------------------------------------------------------------------------ the oracle

def _poisoned(shape, dtype, device) -> torch.Tensor:
    """A cache full of NaN; float8: every byte 0xFF (e4m3fn's NaN)."""
    if dtype == FP8:
        return torch.full(shape, 0xFF, dtype=torch.uint8, device=device).view(FP8)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _element(layout: str, block: int, offset: int, h: int, d: int, x: int, value_cache: bool) -> tuple:
    """The index of column d of head h at (block, offset) in a cache of ``layout`` (as the docstring states)."""
    if layout == "paged":
        return block, offset, h, d
    if layout == "paged_hnd":
        return block, h, offset, d
    if value_cache:  # paged_x values [num_blocks, Hkv, D, block_size]
        return block, h, d, offset
    return block, h, d // x, offset, d % x  # paged_x keys [num_blocks, Hkv, D/x, block_size, x]


def _slot_destinations(slot_mapping, T: int, block_size: int) -> list:
    """(block, offset) of each token by slot_mapping (shorter than the tokens: the rest are padding), or None."""
    slots = slot_mapping.cpu().tolist()
    out = []
    for t in range(T):
        slot = slots[t] if t < len(slots) else -1
        out.append(None if slot < 0 else (slot // block_size, slot % block_size))
    return out


def _table_destinations(requests: list, positions: list, kv_indices, kv_indptr, kv_last_page_len,
                        page_size: int, num_pages: int) -> list:
    """(page, row) of each token by FlashInfer's page table: token t of request r at position p goes to row
    ``p % page_size`` of page ``kv_indices[kv_indptr[r] + p // page_size]``, if r owns that page and p is below
    its length ``(pages - 1) * page_size + kv_last_page_len[r]`` and the page is one of the cache's; else None."""
    indices, indptr, last = kv_indices.cpu().tolist(), kv_indptr.cpu().tolist(), kv_last_page_len.cpu().tolist()
    out = []
    for r, p in zip(requests, positions):
        if not 0 <= r < len(indptr) - 1:
            out.append(None)
            continue
        pages = indptr[r + 1] - indptr[r]
        if p < 0 or p // page_size >= pages or p >= (pages - 1) * page_size + last[r] \
                or indptr[r] < 0 or indptr[r + 1] > len(indices):  # a request's pages must lie in kv_indices
            out.append(None)
            continue
        page = indices[indptr[r] + p // page_size]
        out.append((page, p % page_size) if 0 <= page < num_pages else None)
    return out


def _rotated_k64(k, positions, rope: dict, k_weight=None, eps=1e-6):
    """k [T, Hkv, D] normed (with a weight) and rotated, float64."""
    cos, sin = cos_sin64(positions.cpu().long(), k.shape[-1], rope)
    x = rms64(k, k_weight, eps, 0.0) if k_weight is not None else k.cpu().double()
    return rotate64(x, cos, sin, **rope_opts64(rope, 1.0))


def _check_caches(route, layout, k_cache, v_cache, k_before, v_before, dests, k64, v, x=1, k_scale=1.0,
                  v_scale=1.0):
    """Build the expected caches element by element from ``dests`` and compare: the written elements hold k
    (tolerance; float8: the rounding of k / scale) and v (bits; float8: v / scale rounded), the rest is unchanged."""
    k_mask = torch.zeros(k_cache.shape, dtype=torch.bool)
    v_mask = torch.zeros(v_cache.shape, dtype=torch.bool)
    k_want = torch.zeros(k_cache.shape, dtype=torch.float64)
    v_want = torch.zeros(v_cache.shape, dtype=torch.float64)
    T, H, D = k64.shape
    v64 = v.cpu().double()
    for t in range(T):
        if dests[t] is None:
            continue
        block, offset = dests[t]
        for h in range(H):
            for d in range(D):
                ki = _element(layout, block, offset, h, d, x, False)
                vi = _element(layout, block, offset, h, d, x, True)
                assert not k_mask[ki], "test bug: two tokens of one call share a row"
                k_mask[ki], v_mask[vi] = True, True
                k_want[ki], v_want[vi] = k64[t, h, d], v64[t, h, d]
    kc, vc, kb, vb = (c.cpu() for c in (k_cache, v_cache, k_before, v_before))
    assert same_bits(kc[~k_mask], kb[~k_mask]), "an element of k_cache that no token maps to changed"
    assert same_bits(vc[~v_mask], vb[~v_mask]), "an element of v_cache that no token maps to changed"
    assert int(k_mask.sum()) == sum(d is not None for d in dests) * H * D
    if kc.dtype == FP8:
        stored = kc[k_mask].float().double()
        assert torch.isfinite(stored).all()
        torch.testing.assert_close(stored, (k_want[k_mask] / k_scale).clamp(-FP8_MAX, FP8_MAX), rtol=2.0**-4,
                                   atol=2.0**-10)
    else:
        assert_close_to_ref(kc[k_mask], k_want[k_mask], kc.dtype, ROUTE_BACKENDS[route])
    if vc.dtype == FP8:  # a power-of-two scale: v / scale is exact, and its rounding is torch's own
        assert same_bits(vc[v_mask], (v_want[v_mask] / v_scale).float().to(FP8))
    else:
        assert same_bits(vc[v_mask], v_want[v_mask].to(vc.dtype))


def _x_packed_shapes(num_blocks, block_size, H, D, x):
    return (num_blocks, H, D // x, block_size, x), (num_blocks, H, D, block_size)


def _cache_shapes(layout, num_blocks, block_size, H, D, x=1):
    if layout == "paged_x":
        return _x_packed_shapes(num_blocks, block_size, H, D, x)
    shape = (num_blocks, block_size, H, D) if layout == "paged" else (num_blocks, H, block_size, D)
    return shape, shape


# ---------------------------------------------------------------------------- vLLM's x-packed layout

X_CASES = {
    # name: (tokens, (Hq, Hkv), D, num_blocks, block_size, slots given (-1 skips; shorter: padding), options)
    "decode-gqa-norm-skip": (4, (4, 2), 16, 3, 4, [9, -1, 0, 6], dict(norm=True)),
    "block8-interleaved-partial-padding": (5, (2, 2), 32, 2, 8, [15, 3, 8], dict(style="interleaved",
                                                                                 rotary_dim=16)),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", X_CASES)
def test_paged_x_equals_the_layout_written_by_hand(route, dtype, name):
    """vLLM's paged-attention layout, x = 16 bytes / element size: column d of a key at [block, h, d // x, offset,
    d % x], of a value at [block, h, d, offset]; two calls into the same caches (the second overwrites its rows)
    and one into fresh caches, each checked element by element."""
    T, (Hq, Hkv), D, nb, bs, slots, opts = X_CASES[name]
    opts = dict(opts)
    norm = opts.pop("norm", False)
    x = 16 // torch.empty((), dtype=dtype).element_size()
    k_shape, v_shape = _x_packed_shapes(nb, bs, Hkv, D, x)
    with on_route(route, clear_plans=True) as dev:
        for call in range(3):
            if call != 1:
                k_cache, v_cache = _poisoned(k_shape, dtype, dev), _poisoned(v_shape, dtype, dev)
            q, k, v = (torch.randn(T, h, D, dtype=dtype, device=dev) for h in (Hq, Hkv, Hkv))
            positions = torch.randint(0, 100, (T,), device=dev)
            slot_mapping = torch.tensor(slots, device=dev)
            kw = dict(q_weight=norm_weight(D, dtype, dev), k_weight=norm_weight(D, dtype, dev)) if norm else {}
            inputs = (q, k, v, positions, slot_mapping)
            before = snapshot(*inputs)
            k_before, v_before = k_cache.clone(), v_cache.clone()
            with torch.no_grad():
                q_out = ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=positions,
                                              slot_mapping=slot_mapping, cache_layout="paged_x", **kw, **opts)
            assert_unchanged(inputs, before)
            k64 = _rotated_k64(k, positions, opts, kw.get("k_weight"))
            q64 = _rotated_k64(q, positions, opts, kw.get("q_weight"))
            assert_close_to_ref(q_out, q64, dtype, ROUTE_BACKENDS[route])
            _check_caches(route, "paged_x", k_cache, v_cache, k_before, v_before,
                          _slot_destinations(slot_mapping, T, bs), k64, v, x)


@pytest.mark.parametrize("route", ROUTES)
def test_paged_x_float8_caches_pack_sixteen(route):
    """float8_e4m3fn caches in the x-packed layout (x = 16): k stored as k / k_cache_scale rounded, v as
    v / v_cache_scale, per-tensor scales as a device tensor and a float."""
    T, Hq, Hkv, D, nb, bs, x = 3, 2, 1, 32, 2, 4, 16
    k_shape, v_shape = _x_packed_shapes(nb, bs, Hkv, D, x)
    with on_route(route) as dev:
        k_cache, v_cache = _poisoned(k_shape, FP8, dev), _poisoned(v_shape, FP8, dev)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        q, k, v = (torch.randn(T, h, D, dtype=torch.bfloat16, device=dev) for h in (Hq, Hkv, Hkv))
        positions, slot_mapping = torch.tensor([3, 0, 41], device=dev), torch.tensor([5, 2, -1], device=dev)
        with torch.no_grad():
            ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=positions, slot_mapping=slot_mapping,
                                  cache_layout="paged_x", k_cache_scale=torch.tensor(0.5, device=dev),
                                  v_cache_scale=2.0)
        _check_caches(route, "paged_x", k_cache, v_cache, k_before, v_before,
                      _slot_destinations(slot_mapping, T, bs), _rotated_k64(k, positions, {}), v, x, 0.5, 2.0)


@pytest.mark.parametrize("route", ROUTES)
def test_paged_x_views_with_their_own_odd_strides(route):
    """x-packed caches that are views with strides of their own: the key cache's head stride not a multiple of x
    (its columns then addressed element by element), the value cache's blocks padded: each is written through
    its own strides, nothing between their elements touched."""
    T, Hq, Hkv, D, nb, bs, x = 3, 2, 2, 16, 2, 4, 4
    with on_route(route) as dev:
        k_buffer = torch.full((nb * (Hkv * (D * bs + 3)),), float("nan"), device=dev)
        k_cache = k_buffer.as_strided((nb, Hkv, D // x, bs, x), (Hkv * (D * bs + 3), D * bs + 3, bs * x, x, 1))
        v_buffer = torch.full((nb, Hkv, D, bs + 2), float("nan"), device=dev)
        v_cache = v_buffer[..., 1:bs + 1]
        buffers_before = k_buffer.clone(), v_buffer.clone()
        q, k, v = (torch.randn(T, h, D, device=dev) for h in (Hq, Hkv, Hkv))
        positions, slots = torch.tensor([4, 0, 9], device=dev), torch.tensor([7, 2, 4], device=dev)
        with torch.no_grad():
            ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=positions, slot_mapping=slots,
                                  cache_layout="paged_x")
        k_seen = torch.zeros_like(k_buffer, dtype=torch.bool)  # the elements the view reaches
        k_seen.as_strided(k_cache.shape, k_cache.stride()).fill_(True)
        assert same_bits(k_buffer[~k_seen], buffers_before[0][~k_seen]), "k written outside its view"
        assert same_bits(v_buffer[..., 0], buffers_before[1][..., 0]) and same_bits(v_buffer[..., -1],
                                                                                   buffers_before[1][..., -1])
        k_view_before = buffers_before[0].as_strided(k_cache.shape, k_cache.stride())
        _check_caches(route, "paged_x", k_cache, v_cache, k_view_before, buffers_before[1][..., 1:bs + 1],
                      _slot_destinations(slots, T, bs), _rotated_k64(k, positions, {}), v, x)


def test_paged_x_and_page_table_calls_replay_launch_plans_with_the_full_paths_bytes():
    """The fast path's replays (from the third call of one signature) write the bytes the full path writes
    (check_positions=True always takes it): "paged_x" by slots, and page-table calls into NHD pages, each call with
    fresh inputs, positions and page tables of the same shapes."""
    if not INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1")
    from ropekit import _fastpath

    def paged_x(dev):
        caches = [torch.full(s, float("nan"), device=dev) for s in _x_packed_shapes(2, 4, 1, 16, 4)]
        kw = dict(positions=torch.randint(0, 50, (3,), device=dev), slot_mapping=torch.randperm(8)[:3].to(dev),
                  cache_layout="paged_x")
        return caches, kw

    def page_table(dev):
        caches = [torch.full((6, 2, 1, 16), float("nan"), device=dev) for _ in range(2)]
        kv_indices, kv_indptr, last = (t.to(dev) for t in _page_table([3, 4], 2, 6))
        kw = dict(positions=torch.tensor([1, 2, 3], device=dev), cache_layout="paged", kv_indices=kv_indices,
                  kv_indptr=kv_indptr, kv_last_page_len=last, batch_indices=torch.tensor([0, 0, 1], device=dev))
        kw["positions"][2] = int(torch.randint(0, 4, ()))  # request 1 holds 4 rows
        return caches, kw

    for make in (paged_x, page_table):
        with on_route("cpu-kernels", clear_plans=True) as dev:
            for _ in range(4):
                q, k, v = (torch.randn(3, h, 16, device=dev) for h in (2, 1, 1))
                caches, kw = make(dev)
                full = [c.clone() for c in caches]
                with torch.no_grad():
                    q_out = ropekit.rope_kv_write(q, k, v, *caches, **kw)
                    q_full = ropekit.rope_kv_write(q, k, v, *full, **kw, check_positions=True)
                assert same_bits(q_out, q_full) and same_bits(caches[0], full[0]) and same_bits(caches[1], full[1])
                assert not torch.isnan(caches[0]).all()
            assert len(_fastpath._KV_PLANS) == 1, make.__name__  # recorded on the second call, then replayed


# ------------------------------------------------------------------------------- FlashInfer's page table

def _page_table(lengths: list, page_size: int, num_pages: int):
    """kv_indices, kv_indptr, kv_last_page_len for requests of ``lengths`` rows on shuffled pages."""
    counts = [(n + page_size - 1) // page_size for n in lengths]
    pages = torch.randperm(num_pages)[: sum(counts)]
    indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    last = torch.tensor([n - (c - 1) * page_size if c else 0 for n, c in zip(lengths, counts)])
    return pages, indptr, last


TABLE_CASES = {
    # name: (layout, page_size, request lengths after the append, tokens appended per request, how addressed)
    "append-nhd-page4": ("paged", 4, [6, 9, 3], [2, 4, 1], "batch_indices"),
    "append-hnd-page2-skip": ("paged_hnd", 2, [5, 2], [3, 2], "batch_indices-skip"),
    "decode-x-page4-own-request": ("paged_x", 4, [7, 1, 12], [1, 1, 1], "own"),
    "prefill-nhd-page2-cu_seqlens": ("paged", 2, [3, 4], [3, 2], "cu_seqlens"),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", TABLE_CASES)
def test_page_table_equals_flashinfers_append(route, name):
    """Token t of request batch_indices[t] at position positions[t] (the request's last rows, as FlashInfer's
    get_batch_indices_positions gives them) goes to row p % page_size of page kv_indices[kv_indptr[r] + p //
    page_size]; requests default to the token's own sequence (one token per request, or cu_seqlens)."""
    layout, ps, lengths, appended, how = TABLE_CASES[name]
    Hq, Hkv, D, num_pages = 4, 2, 16, 12
    requests = [r for r, n in enumerate(appended) for _ in range(n)]
    positions = [lengths[r] - appended[r] + i for r, n in enumerate(appended) for i in range(n)]
    if how == "batch_indices-skip":
        requests[1] = -1
    T = len(requests)
    k_shape, v_shape = _cache_shapes(layout, num_pages, ps, Hkv, D, 4)
    with on_route(route) as dev:
        kv_indices, kv_indptr, last = (t.to(dev) for t in _page_table(lengths, ps, num_pages))
        k_cache, v_cache = _poisoned(k_shape, torch.float32, dev), _poisoned(v_shape, torch.float32, dev)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        q, k, v = (torch.randn(T, h, D, device=dev) for h in (Hq, Hkv, Hkv))
        kw = dict(kv_indices=kv_indices, kv_indptr=kv_indptr, kv_last_page_len=last)
        if how.startswith("batch_indices"):
            kw["batch_indices"] = torch.tensor(requests, dtype=torch.int32, device=dev)
        elif how == "cu_seqlens":
            kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(appended).cumsum(0).tolist()], device=dev)
        pos = torch.tensor(positions, device=dev)
        inputs = (q, k, v, pos, *kw.values())
        before = snapshot(*inputs)
        with torch.no_grad():
            q_out = ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=pos, cache_layout=layout, **kw)
        assert_unchanged(inputs, before)
        assert_close_to_ref(q_out, _rotated_k64(q, pos, {}), torch.float32, ROUTE_BACKENDS[route])
        dests = _table_destinations(requests, positions, kv_indices, kv_indptr, last, ps, num_pages)
        assert sum(d is not None for d in dests) == T - (how == "batch_indices-skip")
        _check_caches(route, layout, k_cache, v_cache, k_before, v_before, dests, _rotated_k64(k, pos, {}), v, 4)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("layout", ["paged_hnd", "paged_x"])
def test_prefill_4d_at_an_int_offset_by_page_table(route, layout):
    """4-D [B, S, H, D] inputs continuing each sequence at one int offset, requests defaulting to the batch entry
    b, bf16 with GQA: token (b, s) at position offset + s of request b."""
    B, S, Hq, Hkv, D, ps, num_pages, offset = 2, 3, 4, 2, 16, 2, 8, 3
    lengths = [offset + S, offset + S + 1]  # request 1 holds one more row (written by an earlier step)
    k_shape, v_shape = _cache_shapes(layout, num_pages, ps, Hkv, D, 8)
    with on_route(route) as dev:
        kv_indices, kv_indptr, last = (t.to(dev) for t in _page_table(lengths, ps, num_pages))
        k_cache, v_cache = _poisoned(k_shape, torch.bfloat16, dev), _poisoned(v_shape, torch.bfloat16, dev)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        q, k, v = (torch.randn(B, S, h, D, dtype=torch.bfloat16, device=dev) for h in (Hq, Hkv, Hkv))
        with torch.no_grad():
            q_out = ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=offset, cache_layout=layout,
                                          kv_indices=kv_indices, kv_indptr=kv_indptr, kv_last_page_len=last)
        pos = (offset + torch.arange(S)).expand(B, S).reshape(-1)
        assert_close_to_ref(q_out.reshape(B * S, Hq, D), _rotated_k64(q.reshape(B * S, Hq, D), pos, {}),
                            torch.bfloat16, ROUTE_BACKENDS[route])
        requests = torch.arange(B).repeat_interleave(S).tolist()
        dests = _table_destinations(requests, pos.tolist(), kv_indices, kv_indptr, last, ps, num_pages)
        assert None not in dests
        _check_caches(route, layout, k_cache, v_cache, k_before, v_before, dests,
                      _rotated_k64(k.reshape(B * S, Hkv, D), pos, {}), v.reshape(B * S, Hkv, D), 8)
        with pytest.raises(IndexError, match="positions"), torch.no_grad():  # past request 0's rows
            ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=offset + 1, cache_layout=layout,
                                  kv_indices=kv_indices, kv_indptr=kv_indptr, kv_last_page_len=last,
                                  check_positions=True)


@pytest.mark.parametrize("route", ROUTES)
def test_paged_hnd_by_slot_mapping(route):
    """FlashInfer's HND pages [num_blocks, Hkv, block_size, D] addressed by slot_mapping (-1 skips)."""
    T, Hq, Hkv, D, nb, bs = 4, 2, 2, 16, 3, 4
    shape = (nb, Hkv, bs, D)
    with on_route(route) as dev:
        k_cache, v_cache = _poisoned(shape, torch.float32, dev), _poisoned(shape, torch.float32, dev)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        q, k, v = (torch.randn(T, h, D, device=dev) for h in (Hq, Hkv, Hkv))
        positions, slots = torch.tensor([2, 9, 4, 0], device=dev), torch.tensor([11, 0, -1, 5], device=dev)
        with torch.no_grad():
            ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=positions, slot_mapping=slots,
                                  cache_layout="paged_hnd")
        _check_caches(route, "paged_hnd", k_cache, v_cache, k_before, v_before, _slot_destinations(slots, T, bs),
                      _rotated_k64(k, positions, {}), v)


def test_page_table_bad_device_values_write_nothing_and_never_out_of_bounds():
    """Values the host does not read (tensors standing in for device ones, under the interpreter): a request past
    the table, a position past its request's rows, a page past the cache and a kv_indptr past kv_indices each
    leave their token unwritten -- inside the caches and in the memory around them -- and the others land."""
    if not INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1")
    ps, Hkv, D, num_pages = 2, 1, 8, 4
    with on_route("cpu-kernels") as dev:
        buffers = [torch.full((num_pages + 2, ps, Hkv, D), float("nan"), device=dev) for _ in range(2)]
        k_cache, v_cache = (b[1:-1] for b in buffers)  # a page of margin each side
        before = [b.clone() for b in buffers]
        # requests: 0 owns pages [2, 0] (3 rows), 1 owns [7] (page past the cache), 2 owns kv_indices[3:9]
        # (past kv_indices' 4 entries)
        kv_indices, kv_indptr = torch.tensor([2, 0, 7, 1]), torch.tensor([0, 2, 3, 9])
        last = torch.tensor([1, 2, 2])  # request 0: 3 rows
        #        good, on its page but past kv_last_page_len, bad page, past kv_indices, request past the table, good
        batch = torch.tensor([0, 0, 1, 2, 5, 0])
        positions = torch.tensor([2, 3, 0, 0, 0, 0])
        q, k, v = (torch.randn(6, h, D, device=dev) for h in (2, Hkv, Hkv))
        with torch.no_grad():
            ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=positions, cache_layout="paged",
                                  kv_indices=kv_indices, kv_indptr=kv_indptr, kv_last_page_len=last,
                                  batch_indices=batch)
    dests = _table_destinations(batch.tolist(), positions.tolist(), kv_indices, kv_indptr, last, ps, num_pages)
    assert dests == [(0, 0), None, None, None, None, (2, 0)]  # position 2 of request 0: page kv_indices[1] = 0
    for b, bb in zip(buffers, before):  # the margins untouched
        assert same_bits(b[0], bb[0]) and same_bits(b[-1], bb[-1])
    _check_caches("cpu-kernels", "paged", k_cache, v_cache, before[0][1:-1], before[1][1:-1], dests,
                  _rotated_k64(k, positions, {}), v)


# ------------------------------------------------------------------------------------------ bad input

def _good(dev):
    """A valid page-table call into paged caches [4 pages, page_size 2, Hkv 1, D 8]: tokens of requests 0 and 1."""
    q, k, v = (torch.randn(3, h, 8, device=dev) for h in (2, 1, 1))
    caches = [torch.full((4, 2, 1, 8), float("nan"), device=dev) for _ in range(2)]
    kw = dict(positions=torch.tensor([0, 2, 1], device=dev), cache_layout="paged",
              kv_indices=torch.tensor([3, 1, 0], device=dev), kv_indptr=torch.tensor([0, 2, 3], device=dev),
              kv_last_page_len=torch.tensor([1, 2], device=dev), batch_indices=torch.tensor([0, 0, 1], device=dev))
    return [q, k, v, *caches], kw


def _kw(**changes):
    def change(args, kw, dev):
        for name, value in changes.items():
            if value is None:
                kw.pop(name)
            else:
                kw[name] = value(dev) if callable(value) else value
    return change


def _caches(k_shape, v_shape, layout="paged_x", **changes):
    def change(args, kw, dev):
        args[3], args[4] = (torch.full(s, float("nan"), device=dev) for s in (k_shape, v_shape))
        kw.update(cache_layout=layout, slot_mapping=torch.tensor([0, 1, 2], device=dev))
        for name in ("kv_indices", "kv_indptr", "kv_last_page_len", "batch_indices"):
            kw.pop(name)
        _kw(**changes)(args, kw, dev)
    return change


def _t(values, dtype=torch.int64):
    return lambda d: torch.tensor(values, dtype=dtype, device=d)


BAD = [
    # (id, change, exception, message fragment, checked on the host only)
    ("paged_x k_cache 4-D", _caches((2, 1, 8, 4), (2, 1, 8, 4)), ValueError, "k_cache", False),
    ("paged_x v_cache block_size", _caches((2, 1, 2, 4, 4), (2, 1, 8, 2)), ValueError, "v_cache", False),
    ("paged_x v_cache head_dim", _caches((2, 1, 2, 4, 4), (2, 1, 16, 4)), ValueError, "v_cache", False),
    ("paged_x D/x * x != D", _caches((2, 1, 3, 4, 2), (2, 1, 6, 4)), ValueError, "k_cache", False),
    ("paged_x slot past the blocks", _caches((2, 1, 2, 4, 4), (2, 1, 8, 4), slot_mapping=_t([0, 8, 1])),
     IndexError, "slot_mapping", True),
    ("kv_indices missing", _kw(kv_indices=None), ValueError, "kv_indices", False),
    ("kv_last_page_len missing", _kw(kv_last_page_len=None), ValueError, "kv_last_page_len", False),
    ("page table and slot_mapping", _kw(slot_mapping=_t([0, 1, 2])), ValueError, "slot_mapping", False),
    ("page table for a bshd cache", _kw(cache_layout="bshd"), ValueError, "kv_indices", False),
    ("kv_indptr float", _kw(kv_indptr=_t([0.0, 2.0, 3.0], torch.float32)), TypeError, "kv_indptr", False),
    ("kv_indptr 2-D", _kw(kv_indptr=_t([[0, 2, 3]])), ValueError, "kv_indptr", False),
    ("kv_last_page_len one short", _kw(kv_last_page_len=_t([1])), ValueError, "kv_last_page_len", False),
    ("batch_indices wrong length", _kw(batch_indices=_t([0, 1])), ValueError, "batch_indices", False),
    ("fewer requests than sequences", _kw(batch_indices=None), ValueError, "kv_indptr", False),
    ("multi-axis positions", _kw(positions=_t([[0, 2, 1]] * 2), sections=(2, 2)), ValueError, "sections", False),
    ("batch_indices past the requests", _kw(batch_indices=_t([0, 2, 1])), IndexError, "batch_indices", True),
    ("kv_indices page past the cache", _kw(kv_indices=_t([3, 4, 0])), IndexError, "kv_indices", True),
    ("kv_indptr decreasing", _kw(kv_indptr=_t([0, 2, 1])), ValueError, "kv_indptr", True),
    ("kv_indptr past kv_indices", _kw(kv_indptr=_t([0, 2, 4])), ValueError, "kv_indptr", True),
    ("kv_last_page_len past page_size", _kw(kv_last_page_len=_t([1, 3])), ValueError, "kv_last_page_len", True),
    ("position past the request's rows", _kw(positions=_t([0, 3, 1])), IndexError, "positions", True),
]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("change, exc, match, host_only", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_cache_format_arguments_name_the_argument_and_write_nothing(route, change, exc, match, host_only):
    """Each bad argument raises naming it, and no cache or input changes. Values are read on the host for CPU
    tensors (the CPU path) or with check_positions=True."""
    for check in ((False, True) if host_only else (False,)):
        if host_only and route != "cpu" and not check:
            continue
        with on_route(route) as dev:
            args, kw = _good(dev)
            change(args, kw, dev)
            tensors = [t for t in (*args, *kw.values()) if isinstance(t, torch.Tensor)]
            before = snapshot(*tensors)
            with pytest.raises(exc, match=match), torch.no_grad():
                ropekit.rope_kv_write(*args, **kw, check_positions=check)
            assert_unchanged(tensors, before)


def test_good_page_table_call_is_accepted():
    """The base of the bad-input cases is itself valid (so each case fails for its own change)."""
    args, kw = _good("cpu")
    with torch.no_grad():
        ropekit.rope_kv_write(*args, **kw, check_positions=True)
    assert not torch.isnan(args[3]).all()


# --------------------------------------------------------------------------------------------- compile

def test_page_table_and_paged_x_compile_to_the_eager_bytes():
    """Under torch.compile(fullgraph=True) both formats are the mutating op ropekit::rope_kv_write: the same q and
    cache bytes as eager."""
    q, k, v = (torch.randn(3, h, 16) for h in (2, 1, 1))
    pos = torch.tensor([5, 0, 2])
    table = dict(kv_indices=torch.tensor([1, 3, 0]), kv_indptr=torch.tensor([0, 2, 3, 3]),
                 kv_last_page_len=torch.tensor([2, 1, 0]), batch_indices=torch.tensor([0, 1, 0]))

    def f(q, k, v, k_cache, v_cache, x_k_cache, x_v_cache):
        q1 = ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=pos, cache_layout="paged", **table)
        q2 = ropekit.rope_kv_write(q, k, v, x_k_cache, x_v_cache, positions=pos, slot_mapping=pos,
                                   cache_layout="paged_x")
        return q1, q2

    caches = (torch.zeros(4, 4, 1, 16), torch.zeros(4, 4, 1, 16), *(torch.zeros(s) for s in
                                                                    _x_packed_shapes(2, 4, 1, 16, 4)))
    caches_c = tuple(c.clone() for c in caches)
    with torch.no_grad():
        eager = f(q, k, v, *caches)
        compiled = torch.compile(f, fullgraph=True)(q, k, v, *caches_c)
    for a, b in zip((*compiled, *caches_c), (*eager, *caches)):
        assert same_bits(a, b)
    assert all(c.abs().sum() > 0 for c in caches)


@pytest.mark.gpu
def test_page_table_into_x_packed_caches_replays_in_a_cuda_graph():
    """The page and row are found on the device: captured once in a CUDA graph, each replay writes where the page
    table, requests and positions then in the static tensors say (no host sync in the call)."""
    Hq, Hkv, D, ps, num_pages, x, dtype = 4, 2, 64, 4, 16, 8, torch.bfloat16
    lengths, appended = [5, 9, 2], [1, 3, 2]
    T = sum(appended)
    k_shape, v_shape = _x_packed_shapes(num_pages, ps, Hkv, D, x)
    k_cache, v_cache = _poisoned(k_shape, dtype, "cuda"), _poisoned(v_shape, dtype, "cuda")
    q, k, v = (torch.randn(T, h, D, dtype=dtype, device="cuda") for h in (Hq, Hkv, Hkv))
    kv_indices, kv_indptr, last = (t.cuda() for t in _page_table(lengths, ps, num_pages))
    batch = torch.zeros(T, dtype=torch.int32, device="cuda")
    positions = torch.zeros(T, dtype=torch.int64, device="cuda")

    def step():
        return ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=positions, cache_layout="paged_x",
                                     kv_indices=kv_indices, kv_indptr=kv_indptr, kv_last_page_len=last,
                                     batch_indices=batch)

    with torch.inference_mode():
        step()  # compiles the kernel outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            q_out = step()
        for _ in range(3):
            table = _page_table(lengths, ps, num_pages)  # the same shapes, pages shuffled anew
            for static, fresh in zip((kv_indices, kv_indptr, last), table):
                static.copy_(fresh)
            requests = [r for r, n in enumerate(appended) for _ in range(n)]
            pos = [lengths[r] - appended[r] + i for r, n in enumerate(appended) for i in range(n)]
            batch.copy_(torch.tensor(requests))
            positions.copy_(torch.tensor(pos))
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
            k_cache.fill_(float("nan"))
            v_cache.fill_(float("nan"))
            k_before, v_before = k_cache.clone(), v_cache.clone()
            graph.replay()
            torch.cuda.synchronize()
            assert_close_to_ref(q_out, _rotated_k64(q, positions, {}), dtype, "kernels")
            dests = _table_destinations(requests, pos, kv_indices, kv_indptr, last, ps, num_pages)
            _check_caches("cuda", "paged_x", k_cache, v_cache, k_before, v_before, dests,
                          _rotated_k64(k, positions, {}), v, x)
