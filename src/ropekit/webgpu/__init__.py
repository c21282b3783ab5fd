"""WebGPU backend: ropekit's WGSL kernels (``ropekit/webgpu/wgsl/rope.wgsl``) run through ``wgpu``.

Runs on any adapter wgpu finds -- Metal, Vulkan, DX12, OpenGL, and CPU software adapters (llvmpipe, lavapipe) --
so ropekit rotates on GPUs without CUDA. Install with ``pip install 'ropekit[webgpu]'``; use it through the public
API, ``ropekit.apply_rope(..., backend="webgpu")`` (and ``apply_rope_``, ``rope_backward``).

Modules, each importing only those listed after it:

* :mod:`~ropekit.webgpu.selfcheck`: :func:`check_rows`, the WebGPU rows of ``ropekit check``.
* :mod:`~ropekit.webgpu.adapter`: :func:`rotate`, the spec-driven entry the public API calls, on
  :func:`default_runner`.
* :mod:`~ropekit.webgpu.runner`: :class:`WebGPURunner` (device, pipelines, dispatch) and the backend's low-level
  interface :meth:`WebGPURunner.apply_rope` (numpy arrays, ``angles=``).
* :mod:`~ropekit.webgpu.host`: the host side of a rotation, shared by both routes: the options the kernels refuse
  (``unsupported``), the frequency table or cos/sin rows they read, q and k packed into one dispatch on a runner
  handed in.
* :mod:`~ropekit.webgpu.shader`: the shader's source, entry points and workgroup grid (the ABI of docs/webgpu.md).
"""

from ropekit.frequencies import STYLES
from ropekit.webgpu.adapter import rotate
from ropekit.webgpu.host import ANGLE_MODES
from ropekit.webgpu.runner import WebGPURunner, adapter_info, default_runner, dispatch
from ropekit.webgpu.selfcheck import _CHECK_CASES as _CHECK_CASES  # counted by ropekit check
from ropekit.webgpu.selfcheck import check_rows
from ropekit.webgpu.shader import entry_point, shader_source, workgroup_grid

__all__ = ["ANGLE_MODES", "STYLES", "WebGPURunner", "adapter_info", "check_rows", "default_runner", "dispatch",
           "entry_point", "rotate", "shader_source", "workgroup_grid"]
