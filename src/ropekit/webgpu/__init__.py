"""WebGPU backend: ropekit's WGSL kernels (``ropekit/webgpu/wgsl/rope.wgsl``) run through ``wgpu``.

Runs on any adapter wgpu finds -- Metal, Vulkan, DX12, OpenGL, and CPU software adapters (llvmpipe, lavapipe) --
so ropekit rotates on GPUs without CUDA. Install with ``pip install 'ropekit[webgpu]'``; use it through the public
API, ``ropekit.apply_rope(..., backend="webgpu")`` (and ``apply_rope_``, ``rope_backward``).

* :mod:`~ropekit.webgpu.adapter`: :func:`rotate`, the spec-driven entry the public API calls.
* :mod:`~ropekit.webgpu.runner`: :class:`WebGPURunner` (device, pipelines, dispatch) and the backend's low-level
  interface :meth:`WebGPURunner.apply_rope` (numpy arrays, ``angles=``) on :func:`default_runner`.
* :mod:`~ropekit.webgpu.selfcheck`: :func:`check_rows`, the WebGPU rows of ``ropekit check``.
"""

from ropekit.frequencies import STYLES
from ropekit.webgpu.adapter import rotate
from ropekit.webgpu.runner import (
    ANGLE_MODES,
    WebGPURunner,
    adapter_info,
    default_runner,
    dispatch,
    entry_point,
    shader_source,
    workgroup_grid,
)
from ropekit.webgpu.selfcheck import _CHECK_CASES as _CHECK_CASES  # counted by ropekit check
from ropekit.webgpu.selfcheck import check_rows

__all__ = ["ANGLE_MODES", "STYLES", "WebGPURunner", "adapter_info", "check_rows", "default_runner", "dispatch",
           "entry_point", "rotate", "shader_source", "workgroup_grid"]
