"""Positions and rotation tables from the definition: each token's position and the float64 cos/sin of its pairs'
angles, for every position mode and frequency source. The float64 reference (:mod:`ropekit.reference`) and the
float32 path (:mod:`ropekit.float32_path`) both build on them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ropekit._spec import pair_axis_map


def token_positions(
    batch: int,
    seqlen: int,
    *,
    positions: torch.Tensor | None = None,
    seq_offsets: torch.Tensor | None = None,
    pos_offset: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The position of every token of the canonical [B, S] grid, int64 on ``device``.

    ``positions`` [B, S] per-token ids win; else ``cu_seqlens`` (varlen, B == 1, S == total tokens): the position
    is the token's index inside its sequence plus ``seq_offsets[seq]`` or ``pos_offset``; else ``s`` plus
    ``seq_offsets[b]`` or ``pos_offset``. Tokens outside every sequence of ``cu_seqlens`` get -1 (invalid).
    """
    if positions is not None and positions.dim() == 3:  # multi-axis: [A, B, S], one row of ids per axis
        return positions.to(device=device, dtype=torch.int64).expand(-1, batch, seqlen)
    if positions is not None:
        return positions.to(device=device, dtype=torch.int64).reshape(batch, seqlen)
    base = torch.arange(seqlen, dtype=torch.int64, device=device)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        seq = torch.searchsorted(cu[1:], base, right=True)  # sequence index of every token
        inside = (base >= cu[0]) & (base < cu[-1])
        seq = seq.clamp(max=cu.numel() - 2)
        offset = seq_offsets.to(device=device, dtype=torch.int64)[seq] if seq_offsets is not None else pos_offset
        pos = base - cu[seq] + offset
        return torch.where(inside, pos, torch.full_like(pos, -1)).reshape(1, seqlen)
    if seq_offsets is not None:
        return base[None, :] + seq_offsets.to(device=device, dtype=torch.int64)[:, None]
    return (base + pos_offset).expand(batch, seqlen)


def reduced_angle(angle: torch.Tensor) -> torch.Tensor:
    """``angle`` (float64) reduced to [-pi, pi]; exact enough for any position below 2**40."""
    return torch.remainder(angle + math.pi, 2 * math.pi) - math.pi


def rotation_tables(
    pos: torch.Tensor,
    *,
    half: int,
    neox: bool,
    freq_mode: str,
    inv_freq: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    table_by_token: bool = False,
    sections: Sequence[int] | None = None,
    section_layout: str = "contiguous",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``(cos_lo, cos_hi, sin_lo, sin_hi)``, each float64 [B, S, R/2].

    Multi-axis positions ``pos`` [A, B, S] (``freq_mode="inv_freq"``, ``sections`` pairs per axis): pair i turns
    by ``pos[axis[i]] * inv_freq[i]``, ``axis = pair_axis_map(sections, section_layout)``.

    ``freq_mode``: ``"inv_freq"`` (angle = pos * inv_freq[i]), ``"table"`` (cos/sin rows), ``"angles"`` (raw angle
    rows in ``cos``). Tables are 3-D [Bt, rows, W] with Bt in {1, B} and W in {R/2, R}; rows are positions, or
    tokens ``s`` when ``table_by_token``.
    """
    B, S = pos.shape[-2:]
    if freq_mode == "inv_freq":
        angle = pos.to(torch.float64)[..., None] * inv_freq.to(device=pos.device, dtype=torch.float64)
        if pos.dim() == 3:  # [A, B, S, R/2]: each pair takes its axis
            axis = torch.tensor(pair_axis_map(tuple(sections), section_layout), device=pos.device)
            angle = angle.gather(0, axis.expand(1, B, S, -1))[0]
        angle = reduced_angle(angle)
        c, s = torch.cos(angle), torch.sin(angle)
        return c, c, s, s

    def rows(table: torch.Tensor) -> torch.Tensor:  # [B, S, W] gathered per token
        table = table.to(device=pos.device, dtype=torch.float64).expand(B, -1, -1)
        if table_by_token:
            return table[:, :S]
        return torch.gather(table, 1, pos.clamp(0, table.shape[1] - 1)[..., None].expand(B, S, table.shape[-1]))

    def halves(full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if full.shape[-1] == half:
            return full, full
        return (full[..., :half], full[..., half:]) if neox else (full[..., 0::2], full[..., 1::2])

    if freq_mode == "angles":
        a_lo, a_hi = halves(rows(cos))
        return torch.cos(a_lo), torch.cos(a_hi), torch.sin(a_lo), torch.sin(a_hi)
    c_lo, c_hi = halves(rows(cos))
    s_lo, s_hi = halves(rows(sin))
    return c_lo, c_hi, s_lo, s_hi
