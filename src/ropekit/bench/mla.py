"""The MLA prologue's implementations (modes ``mla-decode``, ``mla-prefill``): ``mla_rope_kv_write`` (q's rope
columns and the shared ``k_pe`` rotated, each token's latent cache row ``[kv_c | R(k_pe)]`` written to a paged
cache, one launch; ``-fp8q``: q as float8_e4m3fn for FP8 attention), its baseline ``copy-mla`` (one Triton kernel
moving the bytes it must move) and the unfused code (``ropekit.apply_rope`` and a scatter by indexing).

Every implementation writes into the case's paged cache; the check against ``ropekit-mla-kv-write`` compares the
returned q and the cache rows of the tokens' slots (the cache is filled with NaN first, so a row left unwritten
counts as a mismatch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._triton import tl, triton
from .base import Bench, Unsupported, _need_triton_device
from .inputs import Inputs

# fp8 cache rows agree within one e4m3 step (a value rounded from bf16 and from fp32 may land on neighbouring steps).
FP8_MISMATCH = 0.13
FP8_MAX = 448.0
MLA_IMPLS = ("ropekit-mla-kv-write", "ropekit-mla-kv-write-fp8q", "unfused-mla")
Q_BLOCK = 2048  # copy-mla: q elements per program (a program per token and block of q's row)


def _need_mla(inp: Inputs) -> None:
    if inp.mla_cache is None:
        raise Unsupported("MLA modes only (the case has no latent cache)")


def _calls(inp: Inputs) -> tuple[Tensor, Tensor, Tensor, dict]:
    """q, k_pe, kv_c and the keywords of ``mla_rope_kv_write``: one token per sequence ([B, H, D], positions [B])
    for decode sizes [B, 1] at per-sequence positions, else the 4-D [B, S, ..] tensors."""
    c = inp.case
    kw = dict(positions=0 if inp.positions is None else inp.positions, kv_cache=inp.mla_cache,
              slot_mapping=inp.slot_mapping, kv_cache_scale=inp.cache_scale, base=c.base, style=c.style)
    if c.seqlen == 1 and c.positions == "batch":
        kw["slot_mapping"] = inp.slot_mapping[:, 0]
        return inp.q[:, 0], inp.k[:, 0], inp.kv_c[:, 0], kw
    return inp.q, inp.k, inp.kv_c, kw


def cache_rows(inp: Inputs) -> Tensor:
    """The cache rows of the case's tokens, [T, L + R], dequantised (fp8: times the scale)."""
    rows = inp.mla_cache.view(-1, inp.mla_cache.shape[-1])[inp.slot_mapping.reshape(-1)]
    return rows.float() * inp.cache_scale if inp.cache_scale is not None else rows


def _bench(inp: Inputs, call: Callable[[], Tensor], note: str) -> Bench:
    """``call`` writes the case's cache and returns q; the check reads q and the cache rows of the tokens."""
    c = inp.case

    def result() -> tuple[Tensor, Tensor]:
        inp.mla_cache.fill_(float("nan"))
        return call().reshape(c.tokens, c.hq, c.head_dim), cache_rows(inp)

    fp8 = inp.cache_scale is not None
    cache = (f"fp8 e4m3 cache, 0-d tensor scale (rows within one e4m3 step: max_rel_diff <= {FP8_MISMATCH})"
             if fp8 else f"{c.cache} cache")
    return Bench(run=call, result=result, note=f"{note}; paged {cache}, page size {inp.mla_cache.shape[1]}",
                 tolerances=(None, FP8_MISMATCH) if fp8 else None)


def _fp8_q_bench(inp: Inputs) -> Bench:
    """mla_rope_kv_write with a float8_e4m3fn q (FP8 MLA attention) at a static 0-d scale, calibrated once from the
    bf16 call's q (its amax over 448). The check dequantises q (times the scale) and holds it to one e4m3 step."""
    import ropekit

    c = inp.case
    q, k_pe, kv_c, kw = _calls(inp)
    calibration = ropekit.mla_rope_kv_write(q, k_pe, kv_c, **kw)[0]
    scale = (calibration.float().abs().amax() / FP8_MAX).clamp_min(1e-12).reshape(())

    def call() -> Tensor:
        return ropekit.mla_rope_kv_write(q, k_pe, kv_c, out_dtype=torch.float8_e4m3fn, q_out_scale=scale, **kw)[0]

    def result() -> tuple[Tensor, Tensor]:
        inp.mla_cache.fill_(float("nan"))
        return (call().float() * scale).reshape(c.tokens, c.hq, c.head_dim), cache_rows(inp)

    bench = _bench(inp, call, f"one launch, float8_e4m3fn q with a static 0-d tensor scale (q within one e4m3 step: "
                              f"max_rel_diff <= {FP8_MISMATCH})")
    bench.result = result
    bench.tolerances = (FP8_MISMATCH, FP8_MISMATCH if inp.cache_scale is not None else None)
    return bench


def _unfused(inp: Inputs) -> Callable[[], Tensor]:
    """``ropekit.apply_rope`` of q's rope columns and k_pe, q's other columns copied beside them, then the cache
    rows ``[kv_c | R(k_pe)]`` scattered by indexing (fp8: ``(x.float() / scale).clamp(-448, 448)`` to e4m3)."""
    import ropekit

    c = inp.case
    d_nope, cache, scale = c.head_dim - c.rotary_dim, inp.mla_cache, inp.cache_scale
    rows = cache.view(-1, cache.shape[-1])
    slots = inp.slot_mapping.reshape(-1)
    kw = dict(positions=inp.positions, base=c.base, style=c.style, layout="bshd")

    def call() -> Tensor:
        q_pe, k_pe = ropekit.apply_rope(inp.q[..., d_nope:], inp.k, **kw)
        q_out = torch.cat([inp.q[..., :d_nope], q_pe], dim=-1)
        row = torch.cat([inp.kv_c, k_pe.squeeze(-2)], dim=-1).reshape(c.tokens, -1)
        if scale is not None:
            row = (row.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(cache.dtype)
        rows[slots] = row
        return q_out

    return call


def build_mla(name: str, inp: Inputs) -> Bench:
    import ropekit

    _need_mla(inp)
    if name == "ropekit-mla-kv-write":
        q, k_pe, kv_c, kw = _calls(inp)
        return _bench(inp, lambda: ropekit.mla_rope_kv_write(q, k_pe, kv_c, **kw)[0], "one launch")
    if name == "ropekit-mla-kv-write-fp8q":
        return _fp8_q_bench(inp)
    if name == "unfused-mla":
        return _bench(inp, _unfused(inp), "ropekit.apply_rope + torch.cat + cache scatter by indexing")
    raise ValueError(name)


def build_copy_mla(inp: Inputs) -> Bench:
    """``copy-mla``: one Triton kernel moving the bytes ``mla_rope_kv_write`` must move: read q (to a preallocated
    output), k_pe and kv_c (to each token's cache row at its slot, cast to the cache dtype, no scale), reading the
    slots and the same position data. A program per token and block of q's row; the first block's writes the row."""
    if triton is None:
        raise Unsupported("triton not importable")
    _need_triton_device(inp.device)
    _need_mla(inp)
    c = inp.case
    q, k_pe, kv_c, cache, slots = inp.q, inp.k, inp.kv_c, inp.mla_cache, inp.slot_mapping
    if not q.is_contiguous() or k_pe.stride(1) != kv_c.stride(1) or slots.stride(-1) != 1:
        raise Unsupported("copy-mla reads a contiguous q and k_pe, kv_c as views of one packed [B, S, L + R] buffer")
    q_out = torch.empty_like(q)
    pos = inp.positions
    if isinstance(pos, Tensor):
        pos_kind, pos_ptr, offset = (1 if c.positions == "batch" else 2), pos, 0
    else:
        pos_kind, pos_ptr, offset = 0, slots, int(pos or 0)  # pointer unused
    qw, latent, rope = c.hq * c.head_dim, c.latent_dim, c.rotary_dim
    q_block = min(triton.next_power_of_2(qw), Q_BLOCK)
    grid = (c.tokens, triton.cdiv(qw, q_block))

    def launch() -> None:
        _copy_mla_kernel[grid](q, k_pe, kv_c, q_out, cache, slots, pos_ptr, offset, c.seqlen, kv_c.stride(1),
                               cache.stride(1), QW=qw, L=latent, R=rope, QB=q_block,
                               LB=triton.next_power_of_2(latent), RB=triton.next_power_of_2(rope), POS_KIND=pos_kind,
                               num_warps=4)

    pos_bytes = pos.numel() * pos.element_size() if isinstance(pos, Tensor) else 0
    row = (latent + rope) * c.tokens
    nbytes = (2 * q.numel() * q.element_size() + row * (q.element_size() + cache.element_size())
              + slots.numel() * slots.element_size() + pos_bytes)
    return Bench(run=launch, bytes=nbytes, note="one Triton kernel: q to a buffer, kv_c and k_pe to the cache row at "
                                                "the slot (a cast, no rotation or scale)")


if triton is not None:
    @triton.jit
    def _copy_mla_kernel(q_ptr, kpe_ptr, kvc_ptr, qo_ptr, c_ptr, slot_ptr, pos_ptr, pos_offset, S, lat_st, c_row,
                         QW: tl.constexpr, L: tl.constexpr, R: tl.constexpr, QB: tl.constexpr, LB: tl.constexpr,
                         RB: tl.constexpr, POS_KIND: tl.constexpr):
        """Program (t, j), t = b * S + s: block j of q's row t to q_out; j = 0 also writes kv_c's and k_pe's rows
        to the cache row slot_ptr[t]. The position (POS_KIND 0: pos_offset + s; 1: pos_ptr[b] + s; 2: pos_ptr[t])
        is read as the op reads it and only guards the writes (it is never negative)."""
        t = tl.program_id(0)
        j = tl.program_id(1)
        if POS_KIND == 0:
            pos = pos_offset + t % S
        elif POS_KIND == 1:
            pos = tl.load(pos_ptr + t // S) + t % S
        else:
            pos = tl.load(pos_ptr + t)
        t64 = t.to(tl.int64)
        iq = j * QB + tl.arange(0, QB)
        keep = (iq < QW) & (pos >= 0)
        tl.store(qo_ptr + t64 * QW + iq, tl.load(q_ptr + t64 * QW + iq, mask=keep), mask=keep)
        if j == 0:
            row = tl.load(slot_ptr + t).to(tl.int64) * c_row
            il = tl.arange(0, LB)
            ir = tl.arange(0, RB)
            x = tl.load(kvc_ptr + t64 * lat_st + il, mask=il < L)
            tl.store(c_ptr + row + il, x.to(c_ptr.dtype.element_ty), mask=(il < L) & (pos >= 0))
            y = tl.load(kpe_ptr + t64 * lat_st + ir, mask=ir < R)
            tl.store(c_ptr + row + L + ir, y.to(c_ptr.dtype.element_ty), mask=(ir < R) & (pos >= 0))
else:  # pragma: no cover
    _copy_mla_kernel = None
