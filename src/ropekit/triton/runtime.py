"""Running kernels: the one launch function, the compiled-kernel cache and the launch recorder.

Every launcher hands its launch to :func:`launch` with the kernel's arguments and constexprs by parameter name;
:class:`KernelRoles` puts them in the kernel's order (the only place that knows it) and :func:`run` launches the
result, a :class:`Launch`: through the Triton interpreter for CPU tensors, and on CUDA through a compiled kernel
kept per specialisation, which skips Triton's per-call argument binding (tens of microseconds of host time).

While ``RECORDER.launches`` is a list (per thread: autograd runs backward on its own threads), :func:`launch`
appends each :class:`Launch` it made; the eager fast path (:mod:`ropekit._fastpath`) records its plans that way.
The list holds the call's tensors; whoever set it drops it after use. A :class:`Replay` is the one way to launch a
recorded launch again with other tensors: the eager fast path's plans hold one each.
"""

from __future__ import annotations

import operator
import threading
import types
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

__all__ = ["RECORDER", "KernelRoles", "Launch", "Replay", "compiled_kernels", "current_device", "current_raw_stream",
           "launch", "launch_hooks_idle", "pdl_supported", "run", "run_compiled", "workspace"]

_MAX_COMPILED = 256  # compiled specialisations kept (least recently used out)
_COMPILED: OrderedDict = OrderedDict()

# What Triton's own launch path reads to pick the device (no torch.cuda wrapper).
current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
# What Triton's own launch path reads for the stream (its CUDA driver calls this torch function); None without CUDA.
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

try:
    from triton import knobs as _knobs

    _RUNTIME_KNOBS = _knobs.runtime
except ImportError:  # older Triton: hooks live on CompiledKernel
    from triton.compiler import CompiledKernel as _RUNTIME_KNOBS

RECORDER = threading.local()

# Per (device, stream): bytes kernels may use as scratch between launches, zero where they keep counters.
_WORKSPACES: dict = {}


def workspace(device: torch.device, nbytes: int) -> torch.Tensor:
    """``nbytes`` (uint8) of scratch on ``device`` for a launch on its current stream: kept for later launches on
    that stream, zero when first allocated. A kernel that keeps counters in it sets each one back to zero before
    it ends, so the next launch on the stream (which starts after it) finds them zero, and no launch pays a
    memset. Launches on one stream run in order; each stream has its own workspace, so concurrent streams never
    share one. While a CUDA graph is captured the scratch is fresh zeros from the graph's pool instead (a
    replay may run on another stream, beside eager launches)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else current_device()
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(nbytes, dtype=torch.uint8, device=device)
        key = (index, current_raw_stream(index) if current_raw_stream is not None
               else torch.cuda.current_stream(index).cuda_stream)
    else:
        key = (device.type, device.index)
    buffer = _WORKSPACES.get(key)
    if buffer is None or buffer.numel() < nbytes:
        # the old buffer is freed on this stream: the caching allocator reuses it only for later work on it
        buffer = torch.zeros(max(nbytes, 2 * buffer.numel() if buffer is not None else 0), dtype=torch.uint8,
                             device=device)
        _WORKSPACES[key] = buffer
    return buffer


def _is_constexpr(annotation) -> bool:
    # ``tl.constexpr``, or its name as a string where the kernel's module postpones annotations
    return "constexpr" in (annotation if isinstance(annotation, str) else getattr(annotation, "__name__", ""))


def _getter(keys: tuple):
    """A function from a dict (names) or a sequence (positions) to the tuple of its items at ``keys``, in that
    order: one C-level gather."""
    if not keys:
        return lambda d: ()
    get = operator.itemgetter(*keys)
    return (lambda d: (get(d),)) if len(keys) == 1 else get


def _int_class(v: int) -> int:
    """What Triton specialises an int argument on: == 1, divisible by 16, and whether it needs 64 bits."""
    return (v == 1) + 2 * (v & 15 == 0) + 4 * (not _INT32_MIN <= v <= _INT32_MAX)


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


class KernelRoles:
    """A kernel's parameters by role, found from its signature (so that a new parameter cannot shift a hard-coded
    index): the runtime arguments (``runtime``) and the constexprs (``constexprs``, annotated ``tl.constexpr``; a
    compiled handle takes them positionally after the runtime arguments), positions of the pointers (names ending
    in ``_ptr``) and of the ints Triton specialises on (all but the ``floats`` and the ``dynamic`` ones).
    ``unfused_when``: a constexpr whose truth compiles the kernel without fused multiply-adds -- the compiler
    contracts ``a * b + c`` where the tile's layout lets it, so a result would otherwise depend on the block
    shape (the prologue's normalised rows must have the same bits whatever batch they come in).
    ``pdl_when``: a constexpr whose truth launches the kernel as a programmatic dependent launch (Triton's
    ``launch_pdl``, CUDA only; the kernel waits for the previous grid's memory itself when it is set)."""

    def __init__(self, fn, floats: tuple[str, ...], dynamic: tuple[str, ...], unfused_when: str | None = None,
                 pdl_when: str | None = None):
        names = tuple(fn.arg_names)
        annotations = fn.fn.__annotations__
        constexprs = tuple(n for n in names if _is_constexpr(annotations.get(n, "")))
        if names[len(names) - len(constexprs):] != constexprs:
            raise ImportError(f"{fn.__name__}'s constexpr parameters must come after its runtime arguments")
        self.fn, self.constexprs = fn, constexprs
        self.runtime = names[:len(names) - len(constexprs)]
        self._runtime_values, self._constexpr_values = _getter(self.runtime), _getter(constexprs)
        self.index = {name: i for i, name in enumerate(names)}
        self.unfused_at = None if unfused_when is None else constexprs.index(unfused_when)
        self.pdl_at = None if pdl_when is None else constexprs.index(pdl_when)
        self.pointers = tuple(i for i, n in enumerate(names) if n.endswith("_ptr"))
        self.ints = tuple(i for i, n in enumerate(self.runtime)
                          if i not in self.pointers and n not in floats and n not in dynamic)
        # C-level gathers for key(), which runs on every launch of an uncached call (host time)
        self._pointer_values, self._int_values = _getter(self.pointers), _getter(self.ints)

    def ordered(self, args: Mapping[str, Any], constexprs: Mapping[str, Any]) -> tuple[tuple, tuple]:
        """``args`` and ``constexprs`` (by parameter name) in the kernel's order; every parameter named once."""
        if len(args) != len(self.runtime) or len(constexprs) != len(self.constexprs):
            given, wanted = {*args, *constexprs}, {*self.runtime, *self.constexprs}
            raise TypeError(f"{self.fn.__name__}: missing {sorted(wanted - given)}, unknown {sorted(given - wanted)}")
        return self._runtime_values(args), self._constexpr_values(constexprs)

    def key(self, args, constexprs, num_warps, device_index, num_stages=None) -> tuple:
        """Everything Triton specialises the kernel on, and nothing else, so that the cache holds one entry per
        compiled variant (not one per sequence length): pointers' dtypes and 16-byte alignment, each int's class
        (:func:`_int_class`), the constexprs, the warp and stage counts and the device."""
        ptrs = self._pointer_values(args)
        # _int_class inlined: a call per int would be most of the key's cost
        return (self.fn, *[p.dtype for p in ptrs], *[p.data_ptr() & 15 for p in ptrs],
                *[(v == 1) + 2 * (v & 15 == 0) + 4 * (not _INT32_MIN <= v <= _INT32_MAX)
                  for v in self._int_values(args)], constexprs, num_warps, device_index, num_stages)


class Launch(NamedTuple):
    """One kernel launch, its arguments and constexprs in the kernel's order: what :func:`run` launches and
    ``RECORDER`` holds."""

    grid: tuple
    args: tuple
    constexprs: tuple
    num_warps: int
    roles: KernelRoles
    device: torch.device
    num_stages: int | None = None  # None: Triton's default


def launch(roles: KernelRoles, grid: tuple, args: Mapping[str, Any], constexprs: Mapping[str, Any],
           num_warps: int, device: torch.device, num_stages: int | None = None) -> None:
    """Launch ``roles.fn`` with its runtime arguments and constexprs by parameter name, and record the launch
    while ``RECORDER.launches`` is a list."""
    call = Launch(grid, *roles.ordered(args, constexprs), num_warps, roles, device, num_stages)
    run(call)
    launches = getattr(RECORDER, "launches", None)
    if launches is not None:
        launches.append(call)


def run(call: Launch) -> None:
    """Launch ``call``: through ``fn[grid]`` for tensors off CUDA (the interpreter); on CUDA through the compiled
    kernel of its specialisation, cached after the first launch, which goes through Triton (compiling if
    needed), so behaviour is Triton's own."""
    grid, args, constexprs, num_warps, roles, device, num_stages = call
    options = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
    if device.type != "cuda":
        roles.fn[grid](*args, **dict(zip(roles.constexprs, constexprs)), **options)
        return
    if device.index is not None and device.index != current_device():
        # Triton launches (and compiles) for the current device: make it the tensors' device.
        with torch.cuda.device(device.index):
            run(call)
        return
    if roles.unfused_at is not None and constexprs[roles.unfused_at]:
        options["enable_fp_fusion"] = False  # part of the key through the constexpr
    if roles.pdl_at is not None and constexprs[roles.pdl_at]:
        options["launch_pdl"] = True  # a compile option Triton keeps in the kernel's metadata; keyed likewise
    key = roles.key(args, constexprs, num_warps, device.index, num_stages)
    compiled = _COMPILED.get(key)
    if compiled is not None:
        _COMPILED.move_to_end(key)
        run_compiled(compiled, grid, args, constexprs, device.index if device.index is not None else current_device())
        return
    compiled = roles.fn[grid](*args, **dict(zip(roles.constexprs, constexprs)), **options)
    if compiled is not None and hasattr(compiled, "__getitem__"):
        _COMPILED[key] = compiled
        if len(_COMPILED) > _MAX_COMPILED:
            _COMPILED.popitem(last=False)


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched as programmatic dependent launches: a CUDA device of
    compute capability 9.0 or later (``griddepcontrol``) and a Triton whose CUDA backend takes ``launch_pdl``."""
    if device.type != "cuda" or torch.version.hip is not None or not _PDL_OPTION:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _has_pdl_option() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


_PDL_OPTION = _has_pdl_option()


def compiled_kernels() -> Mapping:
    """The compiled-kernel cache, read only: :meth:`KernelRoles.key` -> Triton's compiled kernel, least recently
    used first."""
    return types.MappingProxyType(_COMPILED)


def launch_hooks_idle() -> bool:
    """No launch hooks installed in Triton (None, or an empty hook chain in Triton >= 3.4)."""
    enter, exit_ = _RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook
    return (enter is None or not getattr(enter, "calls", True)) and (exit_ is None or not getattr(exit_, "calls", True))


def run_compiled(compiled, grid, args, constexprs, device_index: int) -> None:
    """Launch an already compiled (and once launched) kernel through Triton's compiled launcher directly: what
    ``compiled[grid](...)`` ends in, without its per-call set-up; through ``compiled[grid]`` when a profiler hooked
    Triton's launches or this Triton lacks the attributes."""
    if current_raw_stream is not None and launch_hooks_idle() and getattr(compiled, "function", None) is not None:
        compiled.run(*grid, current_raw_stream(device_index), compiled.function, compiled.packed_metadata, None,
                     None, None, *args, *constexprs)
    else:
        compiled[grid](*args, *constexprs)


class Replay:
    """A :class:`Launch` made once, launched again with new values in its *open* slots (named when it is made:
    the data pointers, say, and an int position offset) and every other argument as recorded, which the caller's
    call signature fixes. No tensor of the recording call is kept in an open slot.

    A call passes the open slots' values in the order they were named: for a pointer slot the tensor's address
    (an int, :attr:`handle` of the tensor) on CUDA, the tensor itself under the interpreter. On CUDA it runs the
    compiled kernel directly (:func:`run_compiled`): no argument binding, hashing or pointer-attribute query. The
    caller guarantees that the tensors behind the addresses have the shapes, strides, dtypes, device and 16-byte
    alignment of the recorded ones."""

    __slots__ = ("grid", "args", "open", "constexprs", "num_warps", "num_stages", "roles", "compiled", "device_index",
                 "keep", "handle")

    @classmethod
    def of(cls, call: Launch, open_slots: tuple[str, ...]) -> Replay | None:
        """The replay of ``call`` with ``open_slots`` (parameter names) left open, or None on CUDA where its
        specialisation is not compiled yet or this Triton lacks the compiled launcher's attributes."""
        roles = call.roles
        r = cls()
        r.open = tuple(roles.index[name] for name in open_slots)
        args = list(call.args)
        for i in r.open:
            args[i] = None
        r.grid, r.constexprs, r.num_warps, r.num_stages, r.roles = (call.grid, call.constexprs, call.num_warps,
                                                                    call.num_stages, roles)
        r.compiled = r.device_index = None
        r.keep = ()
        r.handle = _same
        if call.device.type == "cuda":
            compiled = _COMPILED.get(roles.key(call.args, call.constexprs, call.num_warps, call.device.index,
                                               call.num_stages))
            if (compiled is None or current_raw_stream is None
                    or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))):
                return None
            r.compiled = compiled
            r.device_index = call.device.index if call.device.index is not None else current_device()
            # the fixed tensors (cached default frequencies) stay alive with the replay, which holds their addresses
            r.keep = tuple(a for a in args if isinstance(a, torch.Tensor))
            args = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
            r.handle = torch.Tensor.data_ptr
        r.args = args
        return r

    def __call__(self, *values) -> None:
        args = self.args.copy()
        for i, v in zip(self.open, values):
            args[i] = v
        if self.compiled is None:  # the interpreter
            run(Launch(self.grid, tuple(args), self.constexprs, self.num_warps, self.roles, torch.device("cpu"),
                       self.num_stages))
        elif current_device() != self.device_index:
            with torch.cuda.device(self.device_index):
                run_compiled(self.compiled, self.grid, args, self.constexprs, self.device_index)
        else:
            run_compiled(self.compiled, self.grid, args, self.constexprs, self.device_index)


def _same(t):
    return t
