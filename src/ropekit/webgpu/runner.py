"""The WebGPU runner: one wgpu device, ropekit's shader (``ropekit/webgpu/wgsl/rope.wgsl``) and its dispatches.

:class:`WebGPURunner` compiles the kernels once per device and runs one named entry point on a
``[seq_len, n_heads, head_dim]`` array exactly as the shader's bind-group ABI describes (:meth:`WebGPURunner.dispatch`,
the contract a browser program uses; docs/webgpu.md), cutting inputs larger than one storage binding into blocks.
It also loads triton's native library before the first adapter exists (:func:`_load_triton_native_first`), which
keeps ``import triton`` from crashing later in the same process.

The public route is ``ropekit.apply_rope(..., backend="webgpu")`` (:mod:`ropekit.webgpu.adapter`).
:meth:`WebGPURunner.apply_rope` is the backend's low-level interface, for tests and experts: numpy arrays as well as
tensors, and the choice of how angles are formed (``angles=``); both prepare the dispatch with
:mod:`ropekit.webgpu.host`. The shader's entry points and bindings are named in :mod:`ropekit.webgpu.shader`
(``entry_point``, ``shader_source``, ``workgroup_grid`` and ``ANGLE_MODES`` are importable from here too).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import sys
import threading
import time
import warnings
from typing import Any

import numpy as np
import torch

from ropekit._spec import MAX_POSITION
from ropekit.webgpu.host import ANGLE_MODES, rotate_arrays
from ropekit.webgpu.shader import _KERNELS, SHADER_FILE, WORKGROUP_SIZE, entry_point, shader_source, workgroup_grid

__all__ = ["ANGLE_MODES", "WebGPURunner", "adapter_info", "default_runner", "dispatch", "entry_point",
           "shader_source", "workgroup_grid"]

_MAX_POSITION = MAX_POSITION + 1  # ropekit's range (the shader's u32 positions would reach 2**32)
_MAX_BINDING_BYTES = 2**31  # keeps every element index of a binding inside u32
# Bound in place of an empty frequency or cos/sin table (a binding cannot be empty): one vec2 of NaN, so every
# entry a kernel looks up is missing or NaN and it writes NaN, as documented, instead of rotating by 0.
_MISSING_ENTRIES = np.full(2, np.nan, np.float32)
_NO_ADAPTER_HINT = ("on Linux without a GPU, wgpu uses llvmpipe through OpenGL (Mesa) or lavapipe through Vulkan: "
                    "apt-get install mesa-vulkan-drivers libvulkan1")

Array = torch.Tensor | np.ndarray


_TRITON_NATIVE: Any = None  # triton's native library, loaded before the first adapter (see below)


def _load_triton_native_first() -> None:
    """Load triton's native library, when triton is installed, before wgpu looks for adapters.

    Why: on Linux, wgpu starts its OpenGL backend whichever adapter it picks; libEGL then dlopens Mesa's
    ``swrast_dri.so`` (llvmpipe) with RTLD_GLOBAL, which puts Mesa's libLLVM into the process's global symbol
    scope. ``libtriton.so`` exports its own LLVM; loaded after that, its relocations bind to Mesa's LLVM (the global
    scope is searched first) and its static constructors crash the process (SIGSEGV on ``import triton``).
    Loaded first, RTLD_LOCAL and RTLD_NOW, every symbol binds to triton's own copy once and for all; a later
    ``import triton`` reuses the loaded library. Only the shared object is loaded: no triton Python code runs."""
    global _TRITON_NATIVE
    if _TRITON_NATIVE is not None or not sys.platform.startswith("linux") or "triton._C.libtriton" in sys.modules:
        return
    try:
        spec = importlib.util.find_spec("triton")  # a top-level name: finds it without importing it
    except (ImportError, ValueError):
        return
    folders = list(spec.submodule_search_locations or ()) if spec is not None else []
    paths = [os.path.join(folder, "_C", "libtriton" + suffix) for folder in folders
             for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    path = next((p for p in paths if os.path.isfile(p)), None)
    if path is None:
        return
    try:
        llvm_is_global = hasattr(ctypes.CDLL(None), "LLVMContextCreate")
    except OSError:
        llvm_is_global = False
    if llvm_is_global:
        # Someone (a wgpu adapter created outside ropekit, most likely) already made an LLVM global: loading
        # triton now would crash at once, and so will a later `import triton`. Say so rather than crash here.
        warnings.warn("an LLVM library (Mesa's llvmpipe, loaded when a wgpu adapter was created) is already in the "
                      "process's global symbol scope, so `import triton` will crash this process; import triton (or "
                      "create ropekit's runner) before creating wgpu adapters", RuntimeWarning, stacklevel=3)
        return
    try:
        _TRITON_NATIVE = ctypes.CDLL(path, mode=os.RTLD_LOCAL | os.RTLD_NOW)
    except OSError:
        pass  # a broken triton install fails on `import triton` anyway; WebGPU does not need it


def _no_autograd(name: str, value):
    """``value``, detached if it is a tensor; raises if autograd would expect a gradient through it."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} requires grad, but ropekit.webgpu does not support autograd (its result would "
                             f"come back silently detached): pass {name}.detach(), run under torch.no_grad(), or "
                             "use ropekit.apply_rope without backend='webgpu' (the CPU/CUDA backends)")
        return value.detach()
    return value


def _host_array(name: str, value):
    """An argument of :meth:`WebGPURunner.dispatch`: numpy arrays (and None) as given, tensors as numpy views."""
    value = _no_autograd(name, value)
    return value.numpy() if isinstance(value, torch.Tensor) else value


def _import_wgpu():
    try:
        import wgpu
    except ImportError as exc:
        raise ImportError("ropekit.webgpu needs the wgpu package: pip install 'ropekit[webgpu]'") from exc
    return wgpu


class WebGPURunner:
    """One wgpu device with ropekit's shader module and a cache of compute pipelines.

    ``adapter``: a ``wgpu.GPUAdapter``; default: the adapter wgpu prefers (``power_preference="high-performance"``).
    Raises RuntimeError when there is none. The device asks for the adapter's largest storage-buffer binding;
    larger inputs run in blocks of tokens, and of heads (batch rows) when one token is too big: any size that
    fits in memory works. ``max_binding_bytes`` may be lowered to force the blocks, ``max_workgroups_per_dimension``
    to force the 2-D grid (tests do both).
    """

    def __init__(self, adapter: Any = None):
        wgpu = _import_wgpu()
        _load_triton_native_first()  # before any adapter exists: see the function
        self._wgpu = wgpu
        if adapter is None:
            try:
                adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
            except RuntimeError as exc:  # wgpu raises when it finds nothing; older releases return None
                lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                reason = lines[-1] if lines else type(exc).__name__  # the last line holds wgpu's cause
                raise RuntimeError(f"no WebGPU adapter ({reason}); {_NO_ADAPTER_HINT}") from exc
        if adapter is None:
            raise RuntimeError(f"no WebGPU adapter; {_NO_ADAPTER_HINT}")
        self.adapter = adapter
        limits = adapter.limits
        self.max_binding_bytes = min(int(limits["max-storage-buffer-binding-size"]), _MAX_BINDING_BYTES)
        self.max_workgroups_per_dimension = int(limits["max-compute-workgroups-per-dimension"])
        self.device = adapter.request_device_sync(required_limits={
            "max-storage-buffer-binding-size": self.max_binding_bytes,
            "max-buffer-size": max(int(limits["max-buffer-size"]), self.max_binding_bytes),
        })
        self.module = self.device.create_shader_module(label="ropekit rope.wgsl", code=shader_source())
        self._pipelines: dict[str, Any] = {}
        self._lock = threading.RLock()  # one queue: dispatches from several threads take turns

    @property
    def description(self) -> str:
        """Adapter name, backend and type, e.g. ``"llvmpipe (LLVM 15.0.6, 256 bits) (Vulkan, CPU)"``."""
        info = self.adapter.info
        name = info.get("device") or info.get("description") or "unknown adapter"
        return f"{name} ({info.get('backend_type', '?')}, {info.get('adapter_type', '?')})"

    def pipeline(self, entry: str):
        """The compute pipeline of ``entry``, compiled once."""
        with self._lock:
            pipe = self._pipelines.get(entry)
            if pipe is None:
                pipe = self.device.create_compute_pipeline(
                    label=entry, layout="auto", compute={"module": self.module, "entry_point": entry})
                self._pipelines[entry] = pipe
            return pipe

    def _buffer(self, array: np.ndarray, usage) -> Any:
        return self.device.create_buffer_with_data(data=np.ascontiguousarray(array).tobytes(), usage=usage)

    def dispatch(self, entry: str, x: np.ndarray, *, pos_offset: int = 0, base: float = 10000.0,
                 inv_freq: np.ndarray | None = None, cos_sin: np.ndarray | None = None) -> np.ndarray:
        """Run kernel ``entry`` on ``x`` and return the rotated copy (``x`` is not modified).

        ``x``: [seq_len, n_heads, head_dim], float32 (float16 for ``*_f16`` kernels). Token ``s`` sits at position
        ``s + pos_offset``. ``base`` feeds binding 2 (base kernels); ``inv_freq`` float32 [head_dim/2] binding 3
        (``*_freq``); ``cos_sin`` float32 [rows, head_dim/2, 2] binding 4 (``*_table``; row ``s + pos_offset``).
        Inputs larger than one storage binding run in blocks of tokens (and of heads when one token is too big).
        No autograd: a tensor that requires grad raises ValueError while grad mode is on.
        """
        x, inv_freq, cos_sin = (_host_array(name, value) for name, value in
                                (("x", x), ("inv_freq", inv_freq), ("cos_sin", cos_sin)))
        out = np.array(x, copy=True, order="C")
        self._rotate(entry, out, pos_offset, base, inv_freq, cos_sin)
        return out

    def _rotate(self, entry, out, pos_offset, base, inv_freq, cos_sin) -> None:
        """:meth:`dispatch` into ``out`` (C-contiguous), in place."""
        with self._lock:
            for part, data, encode in self._slices(entry, out, pos_offset, base, inv_freq, cos_sin):
                encoder = self.device.create_command_encoder()
                encode(encoder, 1)
                self.device.queue.submit([encoder.finish()])
                # Mapping the result waits for the work (on_submitted_work_done_sync is broken in wgpu 0.32.0).
                part[...] = np.frombuffer(self.device.queue.read_buffer(data), dtype=out.dtype).reshape(part.shape)

    def kernel_seconds(self, entry: str, x: np.ndarray, *, repeats: int = 20, pos_offset: int = 0,
                       base: float = 10000.0, inv_freq: np.ndarray | None = None,
                       cos_sin: np.ndarray | None = None) -> float:
        """Device time of one dispatch of ``entry`` on ``x`` (arguments as :meth:`dispatch`), in seconds: the
        wall time of ``repeats`` back-to-back dispatches minus that of one, divided by ``repeats - 1``. Data is
        uploaded before the clock starts; ``x`` must fit one storage binding."""
        x, inv_freq, cos_sin = (_host_array(name, value) for name, value in
                                (("x", x), ("inv_freq", inv_freq), ("cos_sin", cos_sin)))
        with self._lock:
            slices = list(self._slices(entry, np.array(x, copy=True, order="C"), pos_offset, base, inv_freq,
                                       cos_sin))
            if len(slices) != 1:
                raise ValueError("x must fit one storage binding to be timed")
            _, data, encode = slices[0]
            done = self.device.create_buffer(size=4, usage=self._wgpu.BufferUsage.COPY_DST
                                             | self._wgpu.BufferUsage.COPY_SRC)

            def run(n: int) -> float:
                encoder = self.device.create_command_encoder()
                encode(encoder, n)
                encoder.copy_buffer_to_buffer(data, 0, done, 0, 4)
                start = time.perf_counter()
                self.device.queue.submit([encoder.finish()])
                self.device.queue.read_buffer(done)  # waits for the dispatches
                return time.perf_counter() - start

            run(2)  # warm-up
            return max((min(run(repeats) for _ in range(3)) - min(run(1) for _ in range(3))) / (repeats - 1), 0.0)

    def _slices(self, entry, out, pos_offset, base, inv_freq, cos_sin):
        """Upload ``out`` ([seq_len, n_heads, head_dim]) in blocks that each fit one storage binding: every head of
        as many tokens as fit or, when one token alone is too big (apply_rope stacks the batch rows of q and k
        along the heads), as many heads as fit of as many tokens as fit. Yields ``(view of out, data buffer,
        encode)``; ``encode(encoder, n)`` records n dispatches of the block."""
        wgpu = self._wgpu
        if entry not in _KERNELS:
            raise ValueError(f"entry must name a kernel of {SHADER_FILE}, got {entry!r}")
        source, packed_f16, neox = _KERNELS[entry]
        want = np.float16 if packed_f16 else np.float32
        if out.ndim != 3 or out.dtype != want:
            raise ValueError(f"x must be a [seq_len, n_heads, head_dim] {np.dtype(want).name} array for {entry}, "
                             f"got shape {out.shape} and dtype {out.dtype}")
        seq_len, n_heads, head_dim = out.shape
        if pos_offset < 0 or pos_offset + seq_len > _MAX_POSITION:
            raise ValueError(f"pos_offset must keep positions in [0, 2**31), got {pos_offset} with {seq_len} tokens")
        side, table = {}, None
        if source == "base":
            side[2] = self._buffer(np.array([base, 0.0, 0.0, 0.0], np.float32), wgpu.BufferUsage.UNIFORM)
        else:
            name, given, shape = (("inv_freq", inv_freq, "[head_dim/2]") if source == "freq"
                                  else ("cos_sin", cos_sin, "[rows, head_dim/2, 2]"))
            if given is None:
                raise ValueError(f"{name} (float32 {shape}) is required by {entry}")
            given = np.ascontiguousarray(given, dtype=np.float32).reshape(-1)
            if source == "freq":
                side[3] = self._buffer(given if given.size else _MISSING_ENTRIES, wgpu.BufferUsage.STORAGE)
            else:
                table = given[:given.size // 2 * 2]  # whole vec2 entries; bound per block below
        if out.size == 0:
            return
        head_bytes = head_dim * out.itemsize
        if head_bytes > self.max_binding_bytes:
            raise ValueError(f"one head of one token of x ({head_bytes} bytes) exceeds the adapter's storage "
                             f"binding limit ({self.max_binding_bytes} bytes)")
        units_per_head = max(head_dim // 4 if packed_f16 and neox else head_dim // 2, 1)
        max_units = 2**32 - 1  # the kernels number their invocations with a u32
        heads_per_block = min(n_heads, self.max_binding_bytes // head_bytes, max_units // units_per_head)
        tokens_per_block = max(1, min(seq_len, self.max_binding_bytes // (heads_per_block * head_bytes),
                                      max_units // (heads_per_block * units_per_head)))
        half = head_dim // 2
        pipe = self.pipeline(entry)
        layout = pipe.get_bind_group_layout(0)
        for first_head in range(0, n_heads, heads_per_block):
            for start in range(0, seq_len, tokens_per_block):
                part = out[start:start + tokens_per_block, first_head:first_head + heads_per_block]
                rows, heads = part.shape[:2]
                data = self._buffer(part, wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
                position = pos_offset + start
                bindings = dict(side)
                if table is not None:
                    # Only this block's rows: the whole table may exceed a binding. Row 0 is then the block's
                    # first position; rows past the table's end stay missing, so the kernel still writes NaN.
                    rows_of_table = table[position * half * 2:(position + rows) * half * 2]
                    bindings[4] = self._buffer(rows_of_table if rows_of_table.size else _MISSING_ENTRIES,
                                               wgpu.BufferUsage.STORAGE)
                    position = 0
                dims = self._buffer(np.array([rows, heads, head_dim, position], np.uint32), wgpu.BufferUsage.UNIFORM)
                entries = [{"binding": 0, "resource": {"buffer": data}},
                           {"binding": 1, "resource": {"buffer": dims}}]
                entries += [{"binding": b, "resource": {"buffer": buf}} for b, buf in bindings.items()]
                group = self.device.create_bind_group(layout=layout, entries=entries)
                grid = workgroup_grid(-(-rows * heads * units_per_head // WORKGROUP_SIZE),
                                      self.max_workgroups_per_dimension)

                def encode(encoder, n, group=group, grid=grid):
                    compute = encoder.begin_compute_pass()
                    compute.set_pipeline(pipe)
                    compute.set_bind_group(0, group)
                    for _ in range(n):
                        compute.dispatch_workgroups(grid[0], grid[1], 1)
                    compute.end()

                yield part, data, encode

    def apply_rope(self, q: Array, k: Array | None = None, *, pos_offset: int = 0, base: float = 10000.0,
                   inv_freq: Array | None = None, cos: Array | None = None, sin: Array | None = None,
                   style: str = "neox", conjugate: bool = False, angles: str = "shader"):
        """The backend's low-level interface: rotated copies of ``q`` (and ``k``) on this runner's adapter.

        The public route is ``ropekit.apply_rope(..., backend="webgpu")``; this method adds what only WebGPU has,
        for tests and experts. The arguments mean what they mean there, with the same defaults (``style="neox"``,
        ``base=10000.0``) and the same validation, except:

        * ``q``/``k`` may be numpy arrays (then so are the results); ``[S, H, D]`` is layout ``"thd"``,
          ``[B, S, H, D]`` ``"bshd"``.
        * ``pos_offset``: the int ``positions`` (the ABI's name for it); ``conjugate=True`` is ``rope_backward``.
        * ``angles``: how angles are formed without a cos/sin table: ``"shader"`` (exact in-shader reduction of
          ``position * inv_freq``), ``"host"`` (float64 tables on the host, uploaded as float32) or
          ``"shader_base"`` (the frequencies too are computed in the shader, in f32, from ``base``: the ``rope_q``
          / ``rope_k`` kernels of the ABI; ``inv_freq`` and tables are refused).

        Raises what ``ropekit.apply_rope`` raises, and ``ValueError`` for what the kernels cannot do (see
        :func:`ropekit.webgpu.adapter.rotate`)."""
        return rotate_arrays(self, q, k, pos_offset=pos_offset, base=base, inv_freq=inv_freq, cos=cos, sin=sin,
                             style=style, conjugate=conjugate, angles=angles)

_DEFAULT_RUNNER: WebGPURunner | None = None
_DEFAULT_FAILURE: Exception | None = None  # looking for an adapter takes seconds: fail fast the next time
_DEFAULT_LOCK = threading.Lock()


def default_runner() -> WebGPURunner:
    """The shared runner on wgpu's preferred adapter (created on first use). Raises ImportError without wgpu and
    RuntimeError without an adapter."""
    global _DEFAULT_RUNNER, _DEFAULT_FAILURE
    with _DEFAULT_LOCK:
        if _DEFAULT_RUNNER is None:
            if _DEFAULT_FAILURE is not None:
                raise type(_DEFAULT_FAILURE)(str(_DEFAULT_FAILURE))
            try:
                _DEFAULT_RUNNER = WebGPURunner()
            except (ImportError, RuntimeError) as exc:
                _DEFAULT_FAILURE = exc
                raise
        return _DEFAULT_RUNNER


def dispatch(entry: str, x: np.ndarray, *, pos_offset: int = 0, base: float = 10000.0,
             inv_freq: np.ndarray | None = None, cos_sin: np.ndarray | None = None) -> np.ndarray:
    """Run one kernel by name on the default adapter (see :meth:`WebGPURunner.dispatch`)."""
    return default_runner().dispatch(entry, x, pos_offset=pos_offset, base=base, inv_freq=inv_freq,
                                     cos_sin=cos_sin)


def adapter_info() -> str | None:
    """Description of the adapter the backend uses, or None without wgpu or an adapter."""
    try:
        return default_runner().description
    except (ImportError, RuntimeError):
        return None

