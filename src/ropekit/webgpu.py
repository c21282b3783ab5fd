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
  the host -- and evaluates sin/cos of the reduced angle in f32: ~1e-7 at any position below 2**32.
* ``"host"``: cos/sin are computed on the host in float64 for the positions used and uploaded as float32: the f32
  rounding of the exact value, at any position.
* ``"shader_base"``: the frequencies too are computed in the shader, in f32, from ``base`` (the ``rope_q`` /
  ``rope_k`` kernels as a browser program runs them). The angle is still exact for the f32 frequency, but that
  frequency may differ from the host's float32 table by a few ulps, an angle error that grows with the position
  (see docs/webgpu.md).
"""

from __future__ import annotations

import importlib.resources
import math
import threading
import time
from typing import Any, Optional, Union

import numpy as np
import torch

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
_MAX_POSITION = 2**32  # positions are u32 in the shader
_MAX_BINDING_BYTES = 2**31  # keeps every element index of a binding inside u32
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
    larger inputs are cut along the sequence. ``max_workgroups_per_dimension`` may be lowered (tests force the
    2-D grid with it).
    """

    def __init__(self, adapter: Any = None):
        wgpu = _import_wgpu()
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
        Inputs larger than one storage binding run in slices of tokens.
        """
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
        """Upload ``out`` ([seq_len, n_heads, head_dim]) in slices of whole tokens that fit one storage binding.
        Yields ``(view of out, data buffer, encode)``; ``encode(encoder, n)`` records n dispatches of the slice."""
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
            raise ValueError(f"pos_offset must keep positions in [0, 2**32), got {pos_offset} with {seq_len} tokens")
        side = {}
        if source == "base":
            side[2] = self._buffer(np.array([base, 0.0, 0.0, 0.0], np.float32), wgpu.BufferUsage.UNIFORM)
        else:
            name, table, shape = (("inv_freq", inv_freq, "[head_dim/2]") if source == "freq"
                                  else ("cos_sin", cos_sin, "[rows, head_dim/2, 2]"))
            if table is None:
                raise ValueError(f"{name} (float32 {shape}) is required by {entry}")
            table = np.ascontiguousarray(table, dtype=np.float32)
            # An empty table still needs a buffer; the kernel then finds no entry and writes NaN.
            side[_SOURCE_BINDING[source]] = self._buffer(table if table.size else np.zeros(1, np.float32),
                                                         wgpu.BufferUsage.STORAGE)
        if out.size == 0:
            return
        token_bytes = n_heads * head_dim * out.itemsize
        if token_bytes > self.max_binding_bytes:
            raise ValueError(f"one token of x ({token_bytes} bytes) exceeds the adapter's storage binding limit "
                             f"({self.max_binding_bytes} bytes)")
        units_per_token = n_heads * (head_dim // 4 if packed_f16 and neox else head_dim // 2)
        tokens_per_slice = max(1, min(seq_len, self.max_binding_bytes // token_bytes,
                                      (2**32 - 1) // max(units_per_token, 1)))
        pipe = self.pipeline(entry)
        layout = pipe.get_bind_group_layout(0)
        for start in range(0, seq_len, tokens_per_slice):
            part = out[start:start + tokens_per_slice]
            rows = part.shape[0]
            data = self._buffer(part, wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
            dims = self._buffer(np.array([rows, n_heads, head_dim, pos_offset + start], np.uint32),
                                wgpu.BufferUsage.UNIFORM)
            entries = [{"binding": 0, "resource": {"buffer": data}}, {"binding": 1, "resource": {"buffer": dims}}]
            entries += [{"binding": b, "resource": {"buffer": buf}} for b, buf in side.items()]
            group = self.device.create_bind_group(layout=layout, entries=entries)
            grid = workgroup_grid(-(-rows * units_per_token // WORKGROUP_SIZE), self.max_workgroups_per_dimension)

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
            raise ValueError(f"pos_offset must keep positions in [0, 2**32), got {pos_offset} with {S} tokens")

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
            source, cos_sin, kernel_offset = "base", None, pos_offset
        else:
            if inv_freq_t is None:
                _check_base(base)
                inv_freq_t = _default_inv_freq(base, D).to(torch.float64)
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


def _default_inv_freq(base: float, head_dim: int) -> torch.Tensor:
    # The frequencies every other ropekit backend uses (transformers' float32 formula).
    from ropekit.api import default_inv_freq

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
        Position of the first token (the KV-cache length when decoding); positions must stay below 2**32.
    base : float
        RoPE base (theta); frequencies ``inv_freq[i] = base ** (-2i/D)`` computed in float32 on the host as
        transformers does (in the shader for ``angles="shader_base"``).
    inv_freq : [D/2] float array, optional
        Frequencies to use instead of ``base`` (any scaling already applied); used as float32 in the shader,
        in float64 for ``angles="host"``.
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

    Raises ImportError without wgpu, RuntimeError without an adapter, ValueError for invalid arguments.
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
        refs = rope_reference(q, k, layout="bshd", style=style, freq_mode="inv_freq", rotary_dim=D, rotary_start=0,
                              inv_freq=inv_freq, pos_offset=offset, conjugate=conjugate, out_dtype=torch.float64)
        # NaN (an unwritten or poisoned element) counts as an infinite error.
        error = max(torch.nan_to_num((out.to(torch.float64) - ref).abs(), nan=math.inf).max().item()
                    for out, ref in zip((q_out, k_out), refs))
        rows.append({"backend": "webgpu", "device": runner.description, "case": name, "max_error": error,
                     "tolerance": tolerance, "passed": error <= tolerance})
    return rows
