"""Inputs, the bytes model and the flops model: the tensors of a case, shared by every implementation, the bytes
each mode must move at the least and the attention modes' flops. KV modes add v and the K/V caches (q, k and v are
views of one packed QKV buffer, as a fused projection gives them); the attention modes take q, k and v as separate
[B, H, S, D] tensors (layout "bhsd"); cases of a model with ``qk_norm`` add the norms' weights."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from ropekit._spec import pair_axis_tensor
from ropekit.modules import hf_tables

from .cases import CACHE_DTYPES, DTYPES, MAX_CACHE_LEN, MLA_PAGE_SIZE, POSITION_OFFSET, Case

FP8_CACHE_SCALE = 0.05  # fp8 caches: stored = value / scale (N(0, 1) values stay well inside e4m3's +-448)
NORM_EPS = 1e-6  # the per-head RMSNorm's eps (Qwen3's)


@dataclasses.dataclass
class Inputs:
    """The tensors of one case, built once and shared by every implementation."""

    case: Case
    device: torch.device
    dtype: torch.dtype
    layout: str  # "bshd" or "thd"; "bhsd" in the attention modes and the cases of a head-major group
    q: Tensor
    k: Tensor
    positions: Any  # what apply_rope's ``positions`` gets: None, an int or a tensor
    cu_seqlens: Tensor | None
    max_seqlen: int
    pos_grid: Tensor  # int64 position of every token, [B, S] ([1, T] for thd)
    inv_freq: Tensor  # fp32 [R/2], the frequencies every implementation uses
    cos_tab: Tensor  # fp32 [P, R/2] indexed by position
    sin_tab: Tensor
    pos_axes: Tensor | None = None  # positions="mrope": int64 [3, B, S], axis 0 equal to pos_grid
    pair_axis: Tensor | None = None  # positions="mrope": the axis of each pair
    q_weight: Tensor | None = None  # models with qk_norm: the norms' weights [D] in the input dtype
    k_weight: Tensor | None = None
    v: Tensor | None = None  # KV modes: v [B, S, Hk, D] (q, k, v: views of one packed [B, S, (Hq + 2 Hk) D] buffer);
    # attention modes: v [B, Hk, S, Dv] beside q [B, Hq, S, D] and k [B, Hk, S, D], three contiguous tensors
    k_cache: Tensor | None = None  # KV modes: bshd caches [B, max_len, Hk, D] in the case's cache dtype
    v_cache: Tensor | None = None
    cache_scale: Tensor | None = None  # fp8 caches: a 0-d fp32 tensor (the same for k and v)
    cache_index: tuple[Tensor, Tensor] | None = None  # KV modes: each token's (sequence, position), int64 [T] each
    # MLA modes: k is k_pe [B, S, 1, R] and kv_c [B, S, L] the latent, views of one packed [B, S, L + R] buffer (as
    # DeepSeek's kv_a projection gives them); the paged latent cache [blocks, MLA_PAGE_SIZE, L + R] (row
    # [kv_c | R(k_pe)]) and each token's slot in it, int64 [B, S], through a block table of shuffled pages
    kv_c: Tensor | None = None
    mla_cache: Tensor | None = None
    slot_mapping: Tensor | None = None
    _hf: tuple[Tensor, Tensor] | None = None

    @property
    def rotary_start(self) -> int:
        c = self.case
        return 0 if c.rotary_at == "front" else c.head_dim - c.rotary_dim

    def rope_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``apply_rope`` for this case (exact in-kernel angles)."""
        c = self.case
        kwargs = dict(positions=self.positions, base=c.base, style=c.style, layout=self.layout,
                      rotary_dim=c.rotary_dim, rotary_at=c.rotary_at, cu_seqlens=self.cu_seqlens)
        if c.positions == "mrope":
            kwargs["sections"], kwargs["section_layout"] = c.sections, c.section_layout
        return kwargs

    def kv_call(self) -> tuple[Tensor, Tensor, Tensor, dict[str, Any]]:
        """q, k, v and the keyword arguments of ``rope_kv_write`` for this case: one token per sequence ([B, H, D],
        positions [B]) for decode sizes [B, 1] at per-sequence positions, else the 4-D [B, S, H, D] tensors."""
        c = self.case
        kw = {key: v for key, v in self.rope_kwargs().items() if key != "cu_seqlens"}
        kw["positions"] = 0 if self.positions is None else self.positions
        if self.q_weight is not None:
            kw.update(q_weight=self.q_weight, k_weight=self.k_weight, eps=NORM_EPS)
        if self.cache_scale is not None:
            kw.update(k_cache_scale=self.cache_scale, v_cache_scale=self.cache_scale)
        if c.seqlen == 1 and c.positions == "batch":
            kw.pop("layout")
            return self.q[:, 0], self.k[:, 0], self.v[:, 0], kw
        return self.q, self.k, self.v, kw

    def cache_rows(self) -> tuple[Tensor, Tensor]:
        """The K and V cache rows the case's tokens go to, [T, Hk, D], dequantised (fp8: times the scale)."""
        b, p = self.cache_index
        rows = self.k_cache[b, p], self.v_cache[b, p]
        if self.cache_scale is not None:
            rows = tuple(r.float() * self.cache_scale for r in rows)
        return rows

    def hf_tables(self) -> tuple[Tensor, Tensor]:
        """transformers' convention: cos/sin [Bc, S, R] (thd: [1, T, R]) in the input dtype, gathered per token,
        duplicated halves for neox and repeat-interleaved for the interleaved pairing. Bc = 1 where every
        sequence has the same positions (what a model's rotary embedding returns for position_ids [1, S])."""
        if self._hf is None:
            positions = self.pos_grid
            if self.case.positions in ("range", "offset"):
                positions = positions[:1]
            if self.pos_axes is not None:  # M-RoPE: the merged tables of transformers' VL rotary modules
                positions = self.pos_axes
            cos, sin = hf_tables(positions, self.inv_freq, full=False, dtype=torch.float64, pair_axis=self.pair_axis)
            if self.case.style == "neox":
                cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
            else:
                cos, sin = torch.repeat_interleave(cos, 2, dim=-1), torch.repeat_interleave(sin, 2, dim=-1)
            self._hf = (cos.to(self.dtype), sin.to(self.dtype))
        return self._hf

    def hf_axis_tables(self) -> tuple[Tensor, Tensor]:
        """positions="mrope": one duplicated-halves cos/sin table per axis, [3, B, S, R] in the input dtype (what
        Qwen2-VL's ``apply_multimodal_rotary_pos_emb`` and Liger's M-RoPE take)."""
        return hf_tables(self.pos_axes, self.inv_freq, dtype=self.dtype)

    def to_hf(self, x: Tensor) -> Tensor:
        """A [B, H, S, D] view (thd: [1, H, T, D]) of a tensor in the case layout; no copy."""
        if self.layout == "bhsd":
            return x
        return (x.unsqueeze(0) if self.layout == "thd" else x).transpose(1, 2)

    def from_hf(self, x: Tensor) -> Tensor:
        """The inverse of :meth:`to_hf`."""
        if self.layout == "bhsd":
            return x
        y = x.transpose(1, 2)
        return y[0] if self.layout == "thd" else y


def varlen_lengths(batch: int, seqlen: int) -> list[int]:
    """``batch`` unequal sequence lengths summing to ``batch * seqlen``: pairs of 1.5 S and 0.5 S."""
    lengths = [seqlen] * batch
    for i in range(0, batch - 1, 2):
        lengths[i] = seqlen + seqlen // 2
        lengths[i + 1] = seqlen - seqlen // 2
    return lengths


def make_inputs(case: Case, device: torch.device, seed: int = 0, caches_of: Inputs | None = None) -> Inputs:
    """Random q/k and the case's positions, tables and frequencies (fp32 ``inv_freq`` as ropekit's default).

    ``caches_of``: another input set of the same case whose KV caches (and fp8 scale) this one writes to instead of
    its own: the caches are only written, and at 256 sequences they take gigabytes per set."""
    gen = torch.Generator().manual_seed(seed)  # positions, on the host
    dtype = DTYPES[case.dtype]
    B, S, D, R = case.batch, case.seqlen, case.head_dim, case.rotary_dim
    layout = "thd" if case.positions == "thd" else "bshd"
    lead = (B * S,) if layout == "thd" else (B, S)
    v = kv_c = None
    if case.latent_dim is not None:  # MLA: q from its own projection; kv_c and k_pe from the shared latent one
        q, latent = _randn(device, seed, (B, S, case.hq, D), (B, S, case.latent_dim + R), dtype=dtype)
        kv_c, k = latent.split([case.latent_dim, R], dim=-1)
        k = k.unsqueeze(-2)
    elif case.causal is not None:  # attention: fresh [B, H, S, D] tensors, v with its own head dim
        layout = "bhsd"
        q, k, v = _randn(device, seed, (B, case.hq, S, D), (B, case.hk, S, D), (B, case.hk, S, case.value_dim),
                         dtype=dtype)
    elif case.hidden_norm:  # a diffusion transformer: q, k and v from separate projections, v copied by the op
        q, k, v = _randn(device, seed, (*lead, case.hq, D), (*lead, case.hk, D), (*lead, case.hk, D), dtype=dtype)
    elif case.cache is None and case.layout == "bhsd":  # head-major: contiguous [B, H, S, D]
        layout = "bhsd"
        q, k = _randn(device, seed, (B, case.hq, S, D), (B, case.hk, S, D), dtype=dtype)
    elif case.cache is None:
        q, k = _randn(device, seed, (*lead, case.hq, D), (*lead, case.hk, D), dtype=dtype)
    else:  # one packed QKV projection output; q, k and v are views of it (the op reads them in place)
        (qkv,) = _randn(device, seed, (B, S, (case.hq + 2 * case.hk) * D), dtype=dtype)
        q, k, v = qkv.view(B, S, case.hq + 2 * case.hk, D).split([case.hq, case.hk, case.hk], dim=2)
    base_pos = torch.arange(S, dtype=torch.int64)
    cu_seqlens, max_seqlen, positions = None, S, None
    if case.positions == "range":
        grid = base_pos.expand(B, S)
    elif case.positions == "offset":
        positions = POSITION_OFFSET
        grid = (base_pos + POSITION_OFFSET).expand(B, S)
    elif case.positions == "batch":
        offsets = torch.randint(0, MAX_CACHE_LEN, (B,), generator=gen, dtype=torch.int64)
        grid = base_pos[None, :] + offsets[:, None]
        positions = offsets.to(device)
    elif case.positions == "ids":
        offsets = torch.randint(0, MAX_CACHE_LEN, (B,), generator=gen, dtype=torch.int64)
        grid = base_pos[None, :] + offsets[:, None]
        positions = grid.contiguous().to(device)
    elif case.positions == "mrope":  # time runs on; height and width within a 64 x 64 grid of patches
        offsets = torch.randint(0, MAX_CACHE_LEN, (B,), generator=gen, dtype=torch.int64)
        grid = base_pos[None, :] + offsets[:, None]
        spatial = torch.randint(0, 64, (2, B, S), generator=gen, dtype=torch.int64)
        pos_axes = torch.cat([grid[None], spatial]).to(device)
        positions = pos_axes
    else:  # thd
        lengths = varlen_lengths(B, S)
        cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        grid = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])[None, :]
        cu_seqlens = cu.to(device=device, dtype=torch.int32)
        max_seqlen = max(lengths)
    rows = int(grid.max()) + 1 if grid.numel() else 1
    pair_axis = None
    if case.positions == "mrope":
        pair_axis = pair_axis_tensor(case.sections, case.section_layout, device)
    exponent = torch.arange(0, R, 2, dtype=torch.int64).to(torch.float32) / R
    inv_freq = 1.0 / (case.base ** exponent)
    angle = torch.arange(rows, dtype=torch.float64)[:, None] * inv_freq.to(torch.float64)
    inp = Inputs(case=case, device=device, dtype=dtype, layout=layout, q=q, k=k, positions=positions,
                 cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, pos_grid=grid.contiguous().to(device),
                 inv_freq=inv_freq.to(device), cos_tab=torch.cos(angle).to(torch.float32).to(device),
                 sin_tab=torch.sin(angle).to(torch.float32).to(device),
                 pos_axes=positions if case.positions == "mrope" else None, pair_axis=pair_axis, v=v)
    if case.qk_norm:  # weights near 1, as trained norms are; over the hidden: [H * D], head-major
        gen_w = torch.Generator(device=device).manual_seed(seed + 2)
        widths = (case.hq * D, case.hk * D) if case.hidden_norm else (D, D)
        inp.q_weight, inp.k_weight = (torch.rand(w, generator=gen_w, device=device).add_(0.5).to(dtype)
                                      for w in widths)
    if case.latent_dim is not None:
        inp.kv_c = kv_c
        _mla_cache(inp, rows, gen, caches_of)
    elif case.cache is not None and caches_of is not None:
        inp.k_cache, inp.v_cache, inp.cache_scale = caches_of.k_cache, caches_of.v_cache, caches_of.cache_scale
        if inp.k_cache.shape[1] < rows:
            raise ValueError(f"caches_of: its caches hold {inp.k_cache.shape[1]} rows, this set needs {rows}")
    elif case.cache is not None:  # bshd caches long enough for every position, at least MAX_CACHE_LEN rows
        max_len = max(MAX_CACHE_LEN, -(-rows // MAX_CACHE_LEN) * MAX_CACHE_LEN)
        inp.k_cache = torch.zeros(B, max_len, case.hk, D, device=device, dtype=CACHE_DTYPES[case.cache])
        inp.v_cache = torch.zeros_like(inp.k_cache)
        if case.cache == "fp8":
            inp.cache_scale = torch.tensor(FP8_CACHE_SCALE, device=device, dtype=torch.float32)
    if case.cache is not None and case.latent_dim is None:
        seq = torch.arange(B, dtype=torch.int64).repeat_interleave(S)
        inp.cache_index = (seq.to(device), grid.reshape(-1).to(device))
    return inp


def _mla_cache(inp: Inputs, rows: int, gen: torch.Generator, caches_of: Inputs | None) -> None:
    """The MLA modes' paged latent cache (or ``caches_of``'s) and the tokens' slots: each sequence owns enough
    pages for its positions (at least MAX_CACHE_LEN rows), scattered over the cache by a random block table."""
    c = inp.case
    B, S = c.batch, c.seqlen
    pages = -(-max(MAX_CACHE_LEN, rows) // MLA_PAGE_SIZE)
    if caches_of is not None:
        inp.mla_cache, inp.cache_scale = caches_of.mla_cache, caches_of.cache_scale
        if inp.mla_cache.shape[0] < B * pages:
            raise ValueError(f"caches_of: its cache holds {inp.mla_cache.shape[0]} pages, this set needs {B * pages}")
    else:
        inp.mla_cache = torch.zeros(B * pages, MLA_PAGE_SIZE, c.latent_dim + c.rotary_dim, device=inp.device,
                                    dtype=CACHE_DTYPES[c.cache])
        if c.cache == "fp8":
            inp.cache_scale = torch.tensor(FP8_CACHE_SCALE, device=inp.device, dtype=torch.float32)
    blocks = torch.randperm(B * pages, generator=gen).view(B, pages)
    grid = inp.pos_grid.cpu()
    slots = blocks.gather(1, grid // MLA_PAGE_SIZE) * MLA_PAGE_SIZE + grid % MLA_PAGE_SIZE
    inp.slot_mapping = slots.reshape(B, S).contiguous().to(inp.device)


def mla_bytes(case: Case) -> dict[str, int]:
    """The MLA modes' bytes (:func:`bytes_model`; empty for other cases): q read and written, k_pe and kv_c read,
    each token's cache row [kv_c | R(k_pe)] written in the cache dtype, its slot (int64) and position data read,
    ``inv_freq`` and the fp8 cache scale."""
    if case.latent_dim is None:
        return {}
    elem = DTYPES[case.dtype].itemsize
    T, R, L = case.tokens, case.rotary_dim, case.latent_dim
    positions = {"batch": case.batch * 8, "ids": T * 8}.get(case.positions, 0)
    nbytes = (2 * T * case.hq * case.head_dim * elem + T * (L + R) * (elem + CACHE_DTYPES[case.cache].itemsize)
              + T * 8 + positions + (R // 2) * 4 + (4 if case.cache == "fp8" else 0))
    return {"mla-decode": nbytes, "mla-prefill": nbytes}


def case_bytes(case: Case) -> dict[str, int]:
    """:func:`bytes_model` from the case alone (no tensors): what ``--list`` prints and the tests check."""
    elem = DTYPES[case.dtype].itemsize
    q = case.tokens * case.hq * case.head_dim * elem
    kv = case.tokens * case.hk * case.head_dim * elem  # k's bytes, and v's
    cache_elem = CACHE_DTYPES[case.cache or case.dtype].itemsize
    weights = (case.hq + case.hk if case.hidden_norm else 2) * case.head_dim * elem if case.qk_norm else 0
    qk = q + kv
    extra = (case.rotary_dim // 2) * 4
    if case.positions == "batch":
        extra += case.batch * 8
    elif case.positions == "ids":
        extra += case.tokens * 8
    elif case.positions == "mrope":
        extra += 3 * case.tokens * 8
    elif case.positions == "thd":
        extra += (case.batch + 1) * 4
    fwd = 2 * qk + extra
    kv_write = 2 * q + 2 * kv + 2 * kv // elem * cache_elem + extra + weights + (8 if case.cache == "fp8" else 0)
    return {"fwd": fwd, "fwdbwd": 2 * fwd, "decode": fwd, "host": fwd, "kv-decode": kv_write, "kv-prefill": kv_write,
            "norm-fwdbwd": 5 * qk + 2 * extra + 3 * weights, "hidden-norm-fwd": 2 * (qk + kv) + extra + weights,
            **_attention_bytes(case, qk, extra), **mla_bytes(case), "kv-step": kv_write + qkv_gemm_bytes(case)}


def qkv_gemm_bytes(case: Case) -> int:
    """kv-step's QKV projection: x [T, Hq * D] and W_qkv [Hq * D, (Hq + 2 Hk) * D] read, qkv [T, (Hq + 2 Hk) * D]
    written, in the case's dtype."""
    hidden, width = case.hq * case.head_dim, (case.hq + 2 * case.hk) * case.head_dim
    return (case.tokens * hidden + hidden * width + case.tokens * width) * DTYPES[case.dtype].itemsize


def _attention_bytes(case: Case, qk: int, extra: int) -> dict[str, int]:
    """The attention modes' bytes (:func:`bytes_model`): ``qk`` the bytes of q and k, ``extra`` the position data
    and ``inv_freq``."""
    elem = DTYPES[case.dtype].itemsize
    vo = case.tokens * (case.hk + case.hq) * case.value_dim * elem  # v read, o written
    fwd = qk + vo + extra
    return {"attn-fwd": fwd, "attn-fwdbwd": 3 * (qk + vo) + 2 * extra}


def attention_flops(case: Case) -> dict[str, int]:
    """Floating-point operations of the attention modes, the figure ``tflops`` divides by the time (the same for
    every implementation of a case; empty for the other cases): the two products of the forward, ``q k^T`` and
    ``p v``, are ``2 B Hq S^2 D`` and ``2 B Hq S^2 Dv``, halved with the causal mask (the convention of
    flash-attention's benchmarks); fwd+bwd counts 3.5 times the forward (the backward's five products are 2.5
    times its two). The rotation's few flops per element are not counted."""
    if case.causal is None:
        return {}
    fwd = 2 * case.batch * case.hq * case.seqlen * case.seqlen * (case.head_dim + case.value_dim)
    if case.causal:
        fwd //= 2
    return {"attn-fwd": fwd, "attn-fwdbwd": fwd * 7 // 2}


def _randn(device: torch.device, seed: int, *shapes: tuple[int, ...], dtype: torch.dtype) -> list[Tensor]:
    """Standard normal tensors drawn on ``device`` (drawing gigabytes on the host would take seconds)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(shape, generator=gen, device=device, dtype=dtype) for shape in shapes]


def bytes_model(inp: Inputs) -> dict[str, int]:
    """Bytes each mode must move at the least (the same figure for every implementation of a case):

    * ``fwd``: q and k read once and written once, plus the position data ropekit reads (offsets, position ids or
      cu_seqlens) and the fp32 ``inv_freq``; exact angles need no table.
    * ``fwdbwd``: twice that (the backward reads the output gradients and writes the input gradients).
    * ``decode``, ``host``: as ``fwd``.
    * ``kv-decode``, ``kv-prefill`` (``rope_kv_write``): q, k and v read, q written, the K and V cache rows written
      (in the cache dtype), plus the position data, ``inv_freq``, the norms' weights (qk_norm models) and the fp8
      scales.
    * ``norm-fwdbwd`` (``qk_norm_rope`` through autograd): 5 passes over q and k (the forward reads and writes them;
      the backward reads the output gradients and the inputs and writes the input gradients), the position data
      and ``inv_freq`` twice, and the weights three times (read twice, their gradients written).
    * ``attn-fwd`` (``rope_attention``): q, k and v read once, o ``[B, Hq, S, Dv]`` written, plus the position data
      and ``inv_freq`` (the S x S scores never leave the chip; the row statistics are not counted).
    * ``mla-decode``, ``mla-prefill`` (``mla_rope_kv_write``): :func:`mla_bytes`.
    * ``kv-step``: ``kv-decode``'s and the QKV projection's (:func:`qkv_gemm_bytes`).
    * ``hidden-norm-fwd`` (``qk_norm_rope(norm_over="hidden", v=v)``): q, k and v read once and written once (v's
      copy), the weights [H * D], the position data and ``inv_freq``.
    * ``attn-fwdbwd``: three times the tensors' bytes (the backward reads q, k, v, o and the gradient of o and writes
      the gradients of q, k and v), the position data and ``inv_freq`` twice.

    Every figure is of the case's shapes (v and o by the case's ``value_dim``), whatever the tensors of ``inp``.
    """
    elem = inp.q.element_size()
    q, k = inp.q.numel() * elem, inp.k.numel() * elem
    qk = q + k
    extra = inp.inv_freq.numel() * inp.inv_freq.element_size()
    for t in (inp.positions, inp.cu_seqlens):
        if isinstance(t, Tensor):
            extra += t.numel() * t.element_size()
    weights = sum(w.numel() * w.element_size() for w in (inp.q_weight, inp.k_weight) if w is not None)
    cache_elem = inp.dtype.itemsize if inp.k_cache is None else inp.k_cache.element_size()
    scales = 0 if inp.cache_scale is None else 2 * inp.cache_scale.numel() * inp.cache_scale.element_size()
    v = k if inp.k_cache is None else inp.v.numel() * elem  # KV modes; the attention modes count v below
    kv_write = 2 * q + k + v + (k + v) // elem * cache_elem + extra + weights + scales
    fwd = 2 * qk + extra
    return {"fwd": fwd, "fwdbwd": 2 * fwd, "decode": fwd, "host": fwd, "kv-decode": kv_write, "kv-prefill": kv_write,
            "norm-fwdbwd": 5 * qk + 2 * extra + 3 * weights, "hidden-norm-fwd": 2 * (qk + k) + extra + weights,
            **_attention_bytes(inp.case, qk, extra), **mla_bytes(inp.case),
            "kv-step": kv_write + qkv_gemm_bytes(inp.case)}
