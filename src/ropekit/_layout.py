"""Layouts: every supported layout is viewed (never copied) as canonical [B, S, H, D]."""

from __future__ import annotations

import torch

LAYOUTS = ("bshd", "bhsd", "sbhd", "thd")


def to_canonical(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A [B, S, H, D] view of ``x`` given in ``layout`` (``thd`` becomes [1, T, H, D])."""
    if layout == "bshd":
        return x
    if layout == "bhsd":
        return x.permute(0, 2, 1, 3)
    if layout == "sbhd":
        return x.permute(1, 0, 2, 3)
    if layout == "thd":
        return x.unsqueeze(0)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def layout_ndim(layout: str) -> int:
    return 3 if layout == "thd" else 4
