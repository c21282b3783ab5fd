"""What every implementation builder shares: the :class:`Bench` a builder returns, the :class:`Unsupported` it
raises, the flat-copy baseline, output gradients for fwd+bwd, the Triton-device check and the per-case
``torch.compile`` cache.

:mod:`.impls` (baselines, ropekit, the peers) and :mod:`.prologue` (the attention prologue) both build on this
module; it imports neither, so the dependency between them runs one way (``impls`` dispatches to ``prologue``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .env import _interpreting
from .inputs import Inputs, _randn


class Unsupported(Exception):
    """An implementation that cannot do a case (the message says why); the row is kept with the reason."""


@dataclasses.dataclass
class Bench:
    """A prepared implementation: ``run`` is what is timed; ``result`` gives fresh outputs (fwdbwd: gradients) in
    the case layout for the check against ropekit."""

    run: Callable[[], Any]
    result: Callable[[], tuple[Tensor, ...]] | None = None
    bytes: int | None = None  # baselines move their own bytes
    note: str = ""
    # per output of ``result``: the largest max_rel_diff that is not a mismatch (None: run.MISMATCH)
    tolerances: tuple[float | None, ...] | None = None


def _flat_copy(inp: Inputs, nbytes: int) -> Bench:
    """One ``copy_`` moving ``nbytes`` (half read, half written) between preallocated contiguous buffers: torch
    issues it as a device-to-device memcpy."""
    elem = inp.q.element_size()
    n = max(1, math.ceil(nbytes / (2 * elem)))
    src = torch.empty(n, dtype=inp.dtype, device=inp.device).normal_()
    dst = torch.empty_like(src)
    return Bench(run=lambda: dst.copy_(src), bytes=2 * n * elem)


def _grad_outputs(inp: Inputs) -> tuple[Tensor, Tensor]:
    gq, gk = _randn(inp.device, 1, tuple(inp.q.shape), tuple(inp.k.shape), dtype=inp.dtype)
    return gq, gk


def _need_triton_device(device: torch.device) -> None:
    # Without a driver a launch fails with "0 active drivers": say what would make it run instead.
    if device.type != "cuda" and not _interpreting():
        raise Unsupported("Triton launches need a CUDA GPU (on CPU: set TRITON_INTERPRET=1)")


_COMPILED: dict[str, Any] = {}


def forget_compiles() -> None:
    """Drop the compile :func:`compiled_per_case` keeps (the run loop calls it as each case starts)."""
    _COMPILED.clear()


def compiled_per_case(fn: Callable, case_name: str, mode: str) -> Callable:
    """``torch.compile(fn)`` (fullgraph, static shapes), fresh for each case and mode and kept while they last: a
    graph mode builds every implementation once per input set (``run.GRAPH_INPUT_SETS``), and one compile serves
    them all (a compile per build, each after a ``torch.compiler.reset()``, would drop the others' and recompile
    inside the CUDA-graph capture). A closure rebuilt per set is the same function when what it closes over is
    equal (ints, strings) or the same object."""
    cells = tuple(c.cell_contents if isinstance(c.cell_contents, (int, float, str, bool, type(None)))
                  else id(c.cell_contents) for c in fn.__closure__ or ())
    key = (fn.__module__, fn.__qualname__, cells, case_name, mode)
    if _COMPILED.get("key") != key:
        torch.compiler.reset()
        _COMPILED.update(key=key, fn=torch.compile(fn, dynamic=False, fullgraph=True))
    return _COMPILED["fn"]
