"""WebGPU backend: ropekit's WGSL kernels (``ropekit/wgsl/rope.wgsl``) run through ``wgpu``.

Runs on any adapter wgpu finds -- Metal, Vulkan, DX12, OpenGL, and CPU software adapters (llvmpipe, lavapipe) --
so ropekit rotates on GPUs without CUDA. Install with ``pip install 'ropekit[webgpu]'``.

Two levels:

* :func:`apply_rope` -- torch CPU tensors or numpy arrays in, rotated copies of the same type out; chooses the
  kernel, builds frequency or cos/sin tables, batches Q and K into one dispatch.
* :func:`dispatch` -- runs one named entry point on a ``[seq_len, n_heads, head_dim]`` array exactly as the
  shader's bind-group ABI describes (the contract a browser program uses).

Sign convention (shared with the rest of ropekit): the forward rotates pair ``(lo, hi)`` by ``+theta``,
``lo' = lo*cos - hi*sin``, ``hi' = lo*sin + hi*cos``, with ``theta = position * inv_freq[i]``; ``conjugate=True``
(the backward) rotates by ``-theta``.

Angles, three ways (``angles=``):

* ``"shader"`` (default): the shader forms ``position * inv_freq[i]`` exactly (integer arithmetic, a 64-bit fraction
  of a turn) from a float32 frequency table -- ``inv_freq``, or transformers' default ``base ** (-2i/D)`` computed on
  the host -- and evaluates sin/cos of the reduced angle in f32: ~1e-7 at any position ropekit takes (below 2**31).
* ``"host"``: cos/sin are computed on the host in float64 for the positions used and uploaded as float32: the f32
  rounding of the exact value, at any position.
* ``"shader_base"``: the frequencies too are computed in the shader, in f32, from ``base`` (the ``rope_q`` /
  ``rope_k`` kernels as a browser program runs them). The angle is still exact for the f32 frequency, but that
  frequency may differ from the host's float32 table by a few ulps, an angle error that grows with the position
  (see docs/webgpu.md).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.resources
import importlib.util
import math
import os
import sys
import threading
import time
import warnings
from typing import Any, Optional, Union

import numpy as np
import torch

from ropekit._spec import MAX_POSITION, RopeSpec, needs_grad

__all__ = [
    "ANGLE_MODES",
    "STYLES",
    "WebGPURunner",
    "adapter_info",
    "apply_rope",
    "check_rows",
    "default_runner",
    "dispatch",
    "entry_point",
    "shader_source",
    "workgroup_grid",
]

SHADER_FILE = "rope.wgsl"
WORKGROUP_SIZE = 256
STYLES = ("interleaved", "neox")
ANGLE_MODES = ("shader", "host", "shader_base")
# Where a kernel gets its rotation -> the binding that carries it.
_SOURCE_BINDING = {"base": 2, "freq": 3, "table": 4}
_MAX_POSITION = MAX_POSITION + 1  # ropekit's range (the shader's u32 positions would reach 2**32)
# angle_rotation() in rope.wgsl refuses (writes NaN for) a float32 frequency with a biased exponent above 150, i.e.
# |freq| >= 2**24, or one that is not finite; below that the angle is exact for every u32 position.
_MAX_FREQ = 2.0**24
_MAX_BINDING_BYTES = 2**31  # keeps every element index of a binding inside u32
# Bound in place of an empty frequency or cos/sin table (a binding cannot be empty): one vec2 of NaN, so every
# entry a kernel looks up is missing or NaN and it writes NaN, as documented, instead of rotating by 0.
_MISSING_ENTRIES = np.full(2, np.nan, np.float32)
_NO_ADAPTER_HINT = ("on Linux without a GPU, wgpu uses llvmpipe through OpenGL (Mesa) or lavapipe through Vulkan: "
                    "apt-get install mesa-vulkan-drivers libvulkan1")

Array = Union[torch.Tensor, np.ndarray]


def shader_source() -> str:
    """The WGSL source of every ropekit kernel (``ropekit/wgsl/rope.wgsl``)."""
    return importlib.resources.files("ropekit").joinpath("wgsl", SHADER_FILE).read_text(encoding="utf-8")


def entry_point(*, style: str = "interleaved", source: str = "base", packed_f16: bool = False,
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


def workgroup_grid(n_workgroups: int, max_per_dimension: int) -> tuple[int, int]:
    """An (x, y) grid of at least ``n_workgroups`` workgroups, each side at most ``max_per_dimension`` (WebGPU
    guarantees 65535); the kernels flatten it as ``gid.x + gid.y * x * 256``."""
    if n_workgroups <= max_per_dimension:
        return max(n_workgroups, 1), 1
    rows = -(-n_workgroups // max_per_dimension)
    if rows > max_per_dimension:
        raise ValueError(f"{n_workgroups} workgroups exceed a {max_per_dimension} x {max_per_dimension} grid")
    return -(-n_workgroups // rows), rows


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
                 inv_freq: Optional[np.ndarray] = None, cos_sin: Optional[np.ndarray] = None) -> np.ndarray:
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
                       base: float = 10000.0, inv_freq: Optional[np.ndarray] = None,
                       cos_sin: Optional[np.ndarray] = None) -> float:
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

    def apply_rope(self, q: Array, k: Optional[Array] = None, *, pos_offset: int = 0, base: float = 10000.0,
                   inv_freq: Optional[Array] = None, cos: Optional[Array] = None, sin: Optional[Array] = None,
                   style: str = "interleaved", conjugate: bool = False, angles: str = "shader"):
        """See :func:`ropekit.webgpu.apply_rope`."""
        as_numpy = isinstance(q, np.ndarray)
        qt = _as_tensor("q", q)
        kt = None
        if k is not None:
            if isinstance(k, np.ndarray) != as_numpy:
                raise ValueError(f"k must be the same kind of array as q ({type(q).__name__}), got {type(k).__name__}")
            kt = _as_tensor("k", k)
            if kt.ndim != qt.ndim or kt.shape[:-2] != qt.shape[:-2] or kt.shape[-1] != qt.shape[-1]:
                raise ValueError(f"k must match q in every dimension but heads, got q {tuple(qt.shape)} and "
                                 f"k {tuple(kt.shape)}")
            if kt.dtype != qt.dtype:
                raise ValueError(f"k must have q's dtype {qt.dtype}, got {kt.dtype}")
        if style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {style!r}")
        if angles not in ANGLE_MODES:
            raise ValueError(f"angles must be one of {ANGLE_MODES}, got {angles!r}")
        if isinstance(pos_offset, bool) or not isinstance(pos_offset, (int, np.integer)):
            raise ValueError(f"pos_offset must be an int, got {type(pos_offset).__name__}")
        pos_offset = int(pos_offset)
        batched = [x.unsqueeze(0) if x.ndim == 3 else x for x in (qt, kt) if x is not None]  # [B, S, H, D]
        B, S, _, D = batched[0].shape
        if pos_offset < 0 or pos_offset + S > _MAX_POSITION:
            raise ValueError(f"pos_offset must keep positions in [0, 2**31), got {pos_offset} with {S} tokens")

        half = D // 2
        inv_freq_t = None
        if inv_freq is not None:
            inv_freq_t = _as_tensor("inv_freq", inv_freq, ndim=(1,)).to(torch.float64)
            if inv_freq_t.shape != (half,):
                raise ValueError(f"inv_freq must have head_dim/2 = {half} elements, got shape "
                                 f"{tuple(inv_freq_t.shape)}")
        if (cos is None) != (sin is None):
            raise ValueError("cos and sin must be given together")
        if cos is not None:
            if inv_freq is not None or angles == "shader_base":
                raise ValueError("cos/sin are a complete rotation table: leave inv_freq unset and angles at "
                                 "'shader' or 'host'")
            source, cos_sin, kernel_offset = "table", _table_rows(cos, sin, pos_offset, S, D, style), 0
        elif angles == "shader_base":
            if inv_freq is not None:
                raise ValueError("angles='shader_base' computes the frequencies from base: leave inv_freq unset "
                                 "(angles='shader' uses it)")
            _check_base(base)
            _check_shader_base(base, D)
            source, cos_sin, kernel_offset = "base", None, pos_offset
        else:
            if inv_freq_t is None:
                _check_base(base)
                inv_freq_t = _default_inv_freq(base, D).to(torch.float64)
            _check_frequencies(inv_freq_t, angles, base=None if inv_freq is not None else base)
            if angles == "host":
                positions = torch.arange(pos_offset, pos_offset + S, dtype=torch.float64)
                theta = positions[:, None] * inv_freq_t[None, :]  # float64: exact enough below 2**40
                cos_sin = torch.stack([theta.cos(), theta.sin()], dim=-1).to(torch.float32).numpy()
                source, kernel_offset = "table", 0
            else:
                source, cos_sin, kernel_offset = "freq", None, pos_offset

        # fp16 stays packed on the device; NeoX f16 kernels own two pairs each, so they need head_dim % 4 == 0.
        packed_f16 = qt.dtype == torch.float16 and (style == "interleaved" or D % 4 == 0)
        work_dtype = torch.float16 if packed_f16 else torch.float32
        # One dispatch for q and k: tokens first, then the heads of every batch row of q, then those of k.
        heads = [x.shape[2] for x in batched]
        stacked = torch.cat([x.to(work_dtype).permute(1, 0, 2, 3).reshape(S, B * h, D)
                             for x, h in zip(batched, heads)], dim=1)
        entry = entry_point(style=style, source=source, packed_f16=packed_f16, conjugate=conjugate)
        rotated = stacked.contiguous()  # a fresh tensor: rotated in place
        self._rotate(entry, rotated.numpy(), kernel_offset, base,
                     None if inv_freq_t is None else inv_freq_t.to(torch.float32).numpy(), cos_sin)
        outs, first = [], 0
        for x, original, h in zip(batched, (qt, kt), heads):
            y = rotated[:, first:first + B * h].reshape(S, B, h, D).permute(1, 0, 2, 3)
            first += B * h
            y = y.reshape(original.shape).to(original.dtype).contiguous()
            outs.append(y.numpy() if as_numpy else y)
        return outs[0] if k is None else (outs[0], outs[1])


def _as_tensor(name: str, x: Array, *, ndim: tuple = (3, 4)) -> torch.Tensor:
    """``x`` as a CPU torch tensor (numpy arrays shared, not copied), with the rank and dtype checked: q and k
    (``ndim`` (3, 4)) must be float32/float16/bfloat16 with an even last dimension, tables any floating type."""
    if isinstance(x, np.ndarray):
        if x.dtype not in (np.float16, np.float32, np.float64):
            raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")
        x = torch.from_numpy(np.ascontiguousarray(x))
    elif not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    x = _no_autograd(name, x)
    if x.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor (the WebGPU backend copies through host memory), "
                         f"got device {x.device}")
    if x.ndim not in ndim:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndim))} dimensions, got shape {tuple(x.shape)}")
    if ndim == (3, 4):
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
        D = x.shape[-1]
        if D < 2 or D % 2:
            raise ValueError(f"{name} must have an even head_dim (last dimension) of at least 2, got {D}: RoPE "
                             "rotates pairs of columns")
    elif not x.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    return x.detach()


def _check_base(base: float) -> None:
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 0:
        raise ValueError(f"base must be a finite number > 0, got {base!r}")


def _check_frequencies(inv_freq: torch.Tensor, angles: str, base: Optional[float] = None) -> None:
    """Refuse frequencies the kernels would turn into NaN: finite and |inv_freq| < 2**24, as the shader sees them
    (float32) for ``angles="shader"``, in float64 for ``"host"`` (the same bound, so both modes accept the same
    tables). ``base``: the frequencies were derived from it, so the message names it."""
    seen = inv_freq.to(torch.float32) if angles == "shader" else inv_freq
    bad = ~(seen.abs() < _MAX_FREQ)  # NaN compares False: caught too
    if bool(bad.any()):
        where = int(bad.nonzero()[0, 0])
        value = f"inv_freq[{where}] = {seen[where].item()!r}" + (" (as float32)" if angles == "shader" else "")
        what = value if base is None else f"base={base!r} gives {value} (base ** (-2i/head_dim))"
        raise ValueError(f"{what}: the WebGPU kernels need finite frequencies with |inv_freq| < 2**24")


def _check_shader_base(base: float, head_dim: int) -> None:
    """angles="shader_base": the shader forms ``exp2(-2p/D * log2(base))`` in f32, NaN unless base is a normal
    finite float32, and above 2**24 it refuses the frequency (only possible for base < 1)."""
    tiny, largest = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    if not tiny <= base <= largest:
        raise ValueError(f"base must be within float32's normal range [{tiny!r}, {largest!r}] for "
                         f"angles='shader_base' (it is used as f32 in the shader), got {base!r}")
    # The largest frequency is that of the last pair when base < 1; the margin covers the shader's f32
    # exp2/log2 (a few ulps).
    if base < 1 and base ** -((head_dim - 2) / head_dim) >= _MAX_FREQ * (1 - 2**-12):
        raise ValueError(f"base={base!r} gives frequencies up to {base ** -((head_dim - 2) / head_dim):.6g} with "
                         f"head_dim {head_dim}: the WebGPU kernels need |inv_freq| < 2**24")


def _default_inv_freq(base: float, head_dim: int) -> torch.Tensor:
    # The frequencies every other ropekit backend uses (transformers' float32 formula).
    from ropekit.frequencies import default_inv_freq

    return default_inv_freq(float(base), head_dim, torch.device("cpu"))


def _table_rows(cos: Array, sin: Array, pos_offset: int, seq_len: int, head_dim: int, style: str) -> np.ndarray:
    """Rows ``pos_offset .. pos_offset + seq_len - 1`` of a cos/sin table as float32 [seq_len, head_dim/2, 2].

    Tables are [P, head_dim/2] or full-width [P, head_dim] (halves duplicated, as transformers builds them; NeoX
    halves side by side, interleaved columns repeated), optionally with a leading dimension of 1."""
    half = head_dim // 2
    parts = []
    for name, table in (("cos", cos), ("sin", sin)):
        t = _as_tensor(name, table, ndim=(2, 3))
        if t.ndim == 3:
            if t.shape[0] != 1:
                raise ValueError(f"{name} must be [positions, width] or [1, positions, width], got {tuple(t.shape)}")
            t = t[0]
        if t.shape[1] not in (half, head_dim):
            raise ValueError(f"{name} must have head_dim/2 = {half} or head_dim = {head_dim} columns, got "
                             f"{tuple(t.shape)}")
        if t.shape[0] < pos_offset + seq_len:
            raise ValueError(f"{name} has {t.shape[0]} rows but positions reach {pos_offset + seq_len - 1}")
        t = t[pos_offset:pos_offset + seq_len]
        if t.shape[1] == head_dim:
            lo, hi = (t[:, :half], t[:, half:]) if style == "neox" else (t[:, 0::2], t[:, 1::2])
            if not torch.equal(lo, hi):
                raise ValueError(f"a full-width {name} must repeat its {style} halves (one angle per pair)")
            t = lo
        parts.append(t.to(torch.float32))
    return torch.stack(parts, dim=-1).contiguous().numpy()


_DEFAULT_RUNNER: Optional[WebGPURunner] = None
_DEFAULT_FAILURE: Optional[Exception] = None  # looking for an adapter takes seconds: fail fast the next time
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


def apply_rope(q: Array, k: Optional[Array] = None, *, pos_offset: int = 0, base: float = 10000.0,
               inv_freq: Optional[Array] = None, cos: Optional[Array] = None, sin: Optional[Array] = None,
               style: str = "interleaved", conjugate: bool = False, angles: str = "shader"):
    """Rotary position embedding on a WebGPU adapter; returns rotated copies, inputs untouched.

    Parameters
    ----------
    q : torch.Tensor (CPU) or numpy.ndarray
        [S, H, D] or [B, S, H, D], float32 or float16 (bfloat16 tensors are rotated in float32 and rounded back).
        Token ``s`` sits at position ``pos_offset + s`` in every batch row. D must be even.
    k : same kind, dtype and shape as q except the head count (GQA), optional
    pos_offset : int
        Position of the first token (the KV-cache length when decoding); positions must stay below 2**31
        (ropekit's range on every backend).
    base : float
        RoPE base (theta); frequencies ``inv_freq[i] = base ** (-2i/D)`` computed in float32 on the host as
        transformers does (in the shader for ``angles="shader_base"``).
    inv_freq : [D/2] float array, optional
        Frequencies to use instead of ``base`` (any scaling already applied); used as float32 in the shader,
        in float64 for ``angles="host"``. Each must be finite with ``|inv_freq| < 2**24`` (as float32 for
        ``angles="shader"``); the frequencies derived from ``base`` too.
    cos, sin : [P, D/2] or full-width [P, D] float arrays (optionally [1, P, W]), optional
        A rotation table indexed by position; rows ``pos_offset .. pos_offset + S - 1`` are uploaded (float32).
        Takes the place of ``base``/``inv_freq``; a table too short raises.
    style : "interleaved" (pairs 2i, 2i+1) or "neox" (pairs i, i + D/2)
    conjugate : bool
        Rotate by -theta: the backward of the forward rotation (and its inverse).
    angles : "shader" | "host" | "shader_base"
        How angles are formed when no cos/sin are given (module docstring): exact in-shader reduction of
        ``position * inv_freq`` (default), float64 host tables, or frequencies too computed in the shader.

    Returns
    -------
    q_out, or (q_out, k_out) when k is given: the type, dtype and shape of the inputs. Forward:
    ``lo' = lo*cos - hi*sin``, ``hi' = lo*sin + hi*cos``.

    Raises ImportError without wgpu, RuntimeError without an adapter, ValueError for invalid arguments -- among
    them any input that requires grad while grad mode is on (no autograd here: detach, or use the CPU/CUDA
    backends). Inputs of any size that fits in memory run in blocks that fit the adapter's storage binding.
    """
    return default_runner().apply_rope(q, k, pos_offset=pos_offset, base=base, inv_freq=inv_freq, cos=cos,
                                       sin=sin, style=style, conjugate=conjugate, angles=angles)


def dispatch(entry: str, x: np.ndarray, *, pos_offset: int = 0, base: float = 10000.0,
             inv_freq: Optional[np.ndarray] = None, cos_sin: Optional[np.ndarray] = None) -> np.ndarray:
    """Run one kernel by name on the default adapter (see :meth:`WebGPURunner.dispatch`)."""
    return default_runner().dispatch(entry, x, pos_offset=pos_offset, base=base, inv_freq=inv_freq,
                                     cos_sin=cos_sin)


def adapter_info() -> Optional[str]:
    """Description of the adapter the backend uses, or None without wgpu or an adapter."""
    try:
        return default_runner().description
    except (ImportError, RuntimeError):
        return None


# name, style, angles, pos_offset, seq_len, heads (q, k), head_dim, dtype, conjugate, base, tolerance.
# Tolerances: max |out - ref| on N(0, 1) inputs; f32 kernels ~1e-6 (angle ~1e-7, f32 stores of values up to ~5);
# float16 one rounding (half an ulp of |x| <= 8 is 2**-8); shader_base frequencies are f32 from exp2/log2, an
# angle error that grows with position * freq, so that case keeps positions short.
_CHECK_CASES = (
    ("interleaved fp32 shader angles, GQA", "interleaved", "shader", 0, 64, (8, 2), 64, torch.float32, False,
     10000.0, 1e-5),
    ("neox fp32 shader angles, pos_offset 2^20", "neox", "shader", 2**20, 32, (4, 1), 128, torch.float32, False,
     500000.0, 1e-5),
    ("interleaved fp32 host table, pos_offset 2^20", "interleaved", "host", 2**20, 32, (4, 2), 64, torch.float32,
     False, 1e6, 1e-5),
    ("neox fp32 backward (conjugate)", "neox", "shader", 17, 48, (4, 4), 64, torch.float32, True, 10000.0, 1e-5),
    ("interleaved fp16 packed", "interleaved", "shader", 1000, 32, (4, 2), 64, torch.float16, False, 10000.0,
     2.0**-8),
    ("neox fp16 packed", "neox", "shader", 5, 32, (4, 2), 128, torch.float16, False, 10000.0, 2.0**-8),
    ("interleaved fp32 rope_q/rope_k (frequencies in the shader)", "interleaved", "shader_base", 0, 64, (4, 2), 64,
     torch.float32, False, 10000.0, 1e-4),
)


def check_rows(runner: Optional[WebGPURunner] = None) -> list[dict]:
    """Compare the WebGPU kernels with the float64 reference over a few cases, on ``runner`` (default: the shared
    runner).

    Returns rows ``{"backend": "webgpu", "device", "case", "max_error", "tolerance", "passed"}``; [] when wgpu or
    an adapter is missing."""
    if runner is None:
        try:
            runner = default_runner()
        except (ImportError, RuntimeError):
            return []
    from ropekit._spec import BACKWARD, FORWARD, validate
    from ropekit.reference import rope_reference

    generator = torch.Generator().manual_seed(0)
    rows = []
    for name, style, angles, offset, S, (hq, hk), D, dtype, conjugate, base, tolerance in _CHECK_CASES:
        q = torch.randn(1, S, hq, D, generator=generator).to(dtype)
        k = torch.randn(1, S, hk, D, generator=generator).to(dtype)
        q_out, k_out = runner.apply_rope(q, k, pos_offset=offset, base=base, style=style, conjugate=conjugate,
                                         angles=angles)
        if angles == "shader_base":  # the exact frequencies the shader approximates
            inv_freq = base ** -(torch.arange(0, D, 2, dtype=torch.float64) / D)
        else:
            inv_freq = _default_inv_freq(base, D)
        spec = validate(q, k, positions=offset, inv_freq=inv_freq, style=style,
                        mode=BACKWARD if conjugate else FORWARD)._replace(out_dtype=torch.float64)
        refs = rope_reference(q, k, spec)
        # NaN (an unwritten or poisoned element) counts as an infinite error.
        error = max(torch.nan_to_num((out.to(torch.float64) - ref).abs(), nan=math.inf).max().item()
                    for out, ref in zip((q_out, k_out), refs))
        rows.append({"backend": "webgpu", "device": runner.description, "case": name, "max_error": error,
                     "tolerance": tolerance, "passed": error <= tolerance})
    return rows


def rotate(q: torch.Tensor, k: Optional[torch.Tensor], spec: RopeSpec, inplace: bool) -> tuple:
    """``apply_rope(..., backend="webgpu")``: the rotation ``spec`` describes, by the WGSL kernels, for the
    options they implement; the others raise ``ValueError`` naming them. Returns ``(q_out, k_out)``."""
    unsupported = [name for name, bad in (
        ("a positions tensor (only an int offset)", spec.positions is not None or spec.seq_offsets is not None),
        ("cu_seqlens", spec.cu_seqlens is not None),
        (f"layout={spec.layout!r} (only 'bshd' or 'thd')", spec.layout not in ("bshd", "thd")),
        ("rotary_dim < head_dim", spec.rotary_dim != q.shape[-1]),
        ("q_scale/k_scale/rotary_scale other than 1", (spec.q_scale, spec.k_scale, spec.rotary_scale) != (1, 1, 1)),
        ("raw angles or per-token cos/sin", spec.freq_mode == "angles" or spec.table_by_token),
        ("out_dtype other than the inputs' dtype", spec.out_dtype is not None),
        ("autograd (inputs that require grad)", needs_grad(q, k)),
    ) if bad]
    if unsupported:
        raise ValueError(f"backend='webgpu' does not support {', '.join(unsupported)}")
    outs = apply_rope(q, k, pos_offset=spec.pos_offset, inv_freq=spec.inv_freq if spec.cos is None else None,
                      cos=spec.cos, sin=spec.sin, style=spec.style, conjugate=spec.conjugate)
    outs = (outs, None) if k is None else outs
    if inplace:
        for x, out in zip((q, k), outs):
            if x is not None:
                x.copy_(out)
        outs = (q, k)
    return outs
