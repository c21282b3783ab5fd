"""The attention prologue moved: its kernels to :mod:`ropekit.triton.prologue_kernels`, their launchers to
:mod:`ropekit.triton.prologue_launcher`, the launch recorder to :mod:`ropekit.triton.runtime`."""

# moved to runtime; re-exported until _fastpath and bound.py switch
from ropekit.triton.runtime import RECORDER  # noqa: F401
