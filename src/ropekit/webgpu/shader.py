"""The WGSL shader (``ropekit/webgpu/wgsl/rope.wgsl``) as the host sees it: its source, the names of its entry
points and what each reads, and the workgroup grid a dispatch uses -- the ABI of docs/webgpu.md.

Both sides of a dispatch read it: :mod:`~ropekit.webgpu.host` picks the entry point for a call and
:mod:`~ropekit.webgpu.runner` binds and dispatches it. It needs no wgpu.
"""

from __future__ import annotations

import importlib.resources

from ropekit.frequencies import STYLES

__all__ = ["SHADER_FILE", "WORKGROUP_SIZE", "entry_point", "shader_source", "workgroup_grid"]

SHADER_FILE = "rope.wgsl"
WORKGROUP_SIZE = 256
# Where a kernel gets its rotation -> the binding that carries it.
_SOURCE_BINDING = {"base": 2, "freq": 3, "table": 4}


def shader_source() -> str:
    """The WGSL source of every ropekit kernel (``ropekit/webgpu/wgsl/rope.wgsl``)."""
    return importlib.resources.files("ropekit.webgpu").joinpath("wgsl", SHADER_FILE).read_text(encoding="utf-8")


def entry_point(*, style: str, source: str = "base", packed_f16: bool = False,
                conjugate: bool = False) -> str:
    """Name of the kernel for a pairing ``style``, rotation ``source`` (``"base"``: frequencies from rope_base;
    ``"freq"``: a frequency table at binding 3; ``"table"``: cos/sin rows at binding 4), data type and direction.
    The interleaved f32 kernel on ``base`` is ``rope_q`` (``rope_k`` is the same code)."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if source not in _SOURCE_BINDING:
        raise ValueError(f"source must be one of {tuple(_SOURCE_BINDING)}, got {source!r}")
    parts = ["rope"]
    if style == "neox":
        parts.append("neox")
    if source != "base":
        parts.append(source)
    if packed_f16:
        parts.append("f16")
    name = "rope_q" if parts == ["rope"] else "_".join(parts)
    return name + "_backward" if conjugate else name


# Every entry point of the shader -> (source, packed_f16, neox).
_KERNELS = {entry_point(style=style, source=source, packed_f16=f16, conjugate=conj): (source, f16, style == "neox")
            for style in STYLES for source in _SOURCE_BINDING for f16 in (False, True) for conj in (False, True)}
_KERNELS.update({"rope_k": _KERNELS["rope_q"], "rope_k_backward": _KERNELS["rope_q_backward"]})


def workgroup_grid(n_workgroups: int, max_per_dimension: int) -> tuple[int, int]:
    """An (x, y) grid of at least ``n_workgroups`` workgroups, each side at most ``max_per_dimension`` (WebGPU
    guarantees 65535); the kernels flatten it as ``gid.x + gid.y * x * 256``."""
    if n_workgroups <= max_per_dimension:
        return max(n_workgroups, 1), 1
    rows = -(-n_workgroups // max_per_dimension)
    if rows > max_per_dimension:
        raise ValueError(f"{n_workgroups} workgroups exceed a {max_per_dimension} x {max_per_dimension} grid")
    return -(-n_workgroups // rows), rows
