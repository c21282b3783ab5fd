"""Checks of the values the frequency code reads, shared by the frequency set, the formulas and config parsing.

Each returns the value in the form the code computes with (a float, an int, an integer tensor, a float64 table) or
raises naming it: a ``ValueError`` for a bad value, and for a wrong type a ``TypeError`` when it is a Python
argument (``arg=True``), a ``ValueError`` when it is a config entry (configs are data: their types are values).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch


def _real(value: Any, name: str, *, arg: bool = False, above: float = 0.0, closed: bool = False,
          at_most: float | None = None) -> float:
    """``value`` as a float, checked finite and ``> above`` (``>=`` when ``closed``; ``<= at_most``). Errors name
    ``name``; a wrong type is a TypeError for a Python argument (``arg``), a ValueError for a config entry."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise (TypeError if arg else ValueError)(f"{name} must be a number, got {value!r}")
    try:
        v = float(value)
    except OverflowError:  # an int beyond float range
        v = math.inf
    if not (math.isfinite(v) and (v >= above if closed else v > above) and (at_most is None or v <= at_most)):
        bound = f"{'>=' if closed else '>'} {above:g}" + ("" if at_most is None else f" and <= {at_most:g}")
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return v


def _integer(value: Any, name: str, *, arg: bool = False, minimum: int = 1) -> int:
    """``value`` as an int in ``[minimum, 2**53]`` (beyond, float math loses it; errors as for :func:`_real`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise (TypeError if arg else ValueError)(f"{name} must be an integer, got {value!r}")
    if not minimum <= value <= 2**53:
        raise ValueError(f"{name} must be an integer >= {minimum} (and <= 2**53), got {value!r}")
    return int(value)


def _length_arg(value: Any, name: str) -> int:
    """A sequence length: an int or a one-element integer tensor, >= 0."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an int or a one-element integer tensor, got a {value.dtype} tensor "
                            f"of shape {tuple(value.shape)}")
        value = int(value.item())
    return _integer(value, name, arg=True, minimum=0)


def _positions_arg(positions: Any) -> torch.Tensor:
    """Positions as an integer tensor."""
    if not isinstance(positions, torch.Tensor):
        if positions is None or isinstance(positions, (str, bytes, Mapping)):
            raise TypeError(f"positions must be an int, a sequence of ints or an integer tensor, got {positions!r}")
        try:
            positions = torch.as_tensor(positions)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError("positions must be an int, a sequence of ints or an integer tensor, got "
                            f"{type(positions).__name__}") from None
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"positions must be integers, got dtype {positions.dtype}")
    return positions


def _float_table(values: Any, name: str) -> torch.Tensor:
    """A flat float64 CPU copy of a sequence of numbers or a tensor."""
    if not isinstance(values, torch.Tensor):
        if isinstance(values, (str, bytes, Mapping, bool)) or values is None:
            raise TypeError(f"{name} must be a sequence of numbers or a tensor, got {values!r}")
        try:
            values = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{name} must be a sequence of numbers or a tensor, got {type(values).__name__}") from None
    if values.dtype == torch.bool or values.is_complex():
        raise TypeError(f"{name} must hold real numbers, got dtype {values.dtype}")
    return values.detach().to(device="cpu", dtype=torch.float64).reshape(-1).clone()
