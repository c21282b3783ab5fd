"""Inputs and the bytes model: the tensors of a case, shared by every implementation, and the bytes each mode must
move at the least."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from ropekit._spec import pair_axis_tensor
from ropekit.modules import hf_tables

from .cases import DTYPES, MAX_CACHE_LEN, POSITION_OFFSET, Case


@dataclasses.dataclass
class Inputs:
    """The tensors of one case, built once and shared by every implementation."""

    case: Case
    device: torch.device
    dtype: torch.dtype
    layout: str  # "bshd" or "thd"
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
            kwargs["sections"] = c.sections
        return kwargs

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
        return (x.unsqueeze(0) if self.layout == "thd" else x).transpose(1, 2)

    def from_hf(self, x: Tensor) -> Tensor:
        """The inverse of :meth:`to_hf`."""
        y = x.transpose(1, 2)
        return y[0] if self.layout == "thd" else y


def varlen_lengths(batch: int, seqlen: int) -> list[int]:
    """``batch`` unequal sequence lengths summing to ``batch * seqlen``: pairs of 1.5 S and 0.5 S."""
    lengths = [seqlen] * batch
    for i in range(0, batch - 1, 2):
        lengths[i] = seqlen + seqlen // 2
        lengths[i + 1] = seqlen - seqlen // 2
    return lengths


def make_inputs(case: Case, device: torch.device, seed: int = 0) -> Inputs:
    """Random q/k and the case's positions, tables and frequencies (fp32 ``inv_freq`` as ropekit's default)."""
    gen = torch.Generator().manual_seed(seed)  # positions, on the host
    dtype = DTYPES[case.dtype]
    B, S, D, R = case.batch, case.seqlen, case.head_dim, case.rotary_dim
    layout = "thd" if case.positions == "thd" else "bshd"
    lead = (B * S,) if layout == "thd" else (B, S)
    q, k = _randn(device, seed, (*lead, case.hq, D), (*lead, case.hk, D), dtype=dtype)
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
        pair_axis = pair_axis_tensor(case.sections, "contiguous", device)
    exponent = torch.arange(0, R, 2, dtype=torch.int64).to(torch.float32) / R
    inv_freq = 1.0 / (case.base ** exponent)
    angle = torch.arange(rows, dtype=torch.float64)[:, None] * inv_freq.to(torch.float64)
    return Inputs(case=case, device=device, dtype=dtype, layout=layout, q=q, k=k, positions=positions,
                  cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, pos_grid=grid.contiguous().to(device),
                  inv_freq=inv_freq.to(device), cos_tab=torch.cos(angle).to(torch.float32).to(device),
                  sin_tab=torch.sin(angle).to(torch.float32).to(device),
                  pos_axes=positions if case.positions == "mrope" else None, pair_axis=pair_axis)


def case_bytes(case: Case) -> dict[str, int]:
    """:func:`bytes_model` from the case alone (no tensors): what ``--list`` prints and the tests check."""
    elem = DTYPES[case.dtype].itemsize
    qk = case.tokens * (case.hq + case.hk) * case.head_dim * elem
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
    return {"fwd": fwd, "fwdbwd": 2 * fwd, "decode": fwd, "host": fwd}


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
    """
    qk = (inp.q.numel() + inp.k.numel()) * inp.q.element_size()
    extra = inp.inv_freq.numel() * inp.inv_freq.element_size()
    for t in (inp.positions, inp.cu_seqlens):
        if isinstance(t, Tensor):
            extra += t.numel() * t.element_size()
    fwd = 2 * qk + extra
    return {"fwd": fwd, "fwdbwd": 2 * fwd, "decode": fwd, "host": fwd}
