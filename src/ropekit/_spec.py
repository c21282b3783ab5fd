"""The one description of a rotation: layouts, pairings, the argument bundles the public API hands down
(:class:`RopeArgs`, :class:`NormSpec`, :class:`CacheArgs`) and the validated specs every layer below receives
(:class:`RopeSpec`, :class:`CacheSpec`): the registered ops (whose schema is generated from the spec's fields),
autograd, the fast path, the launchers, the float64 reference and the WebGPU adapter.

Types and constants only; :mod:`ropekit._validation` turns arguments into specs. This module imports nothing of
ropekit but the device cache.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ropekit._device_cache import device_cache

LAYOUTS = ("bshd", "bhsd", "sbhd", "thd")
ROTARY_AT = ("front", "back")
BACKENDS = ("auto", "webgpu")
FREQ_MODES = ("inv_freq", "table", "angles")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int32, torch.int64)

MAX_POSITION = 2**31 - 1
"""The largest position ropekit rotates: in-kernel angles are within ~5e-7 rad of exact up to here (about 1e-7
below 2**24). Larger positions raise on the host where their values are known; elsewhere the tokens come out NaN."""

Positions = int | Tensor | None


def layout_ndim(layout: str) -> int:
    return 3 if layout == "thd" else 4


def layout_shape(layout: str) -> str:
    return {"bshd": "[B, S, H, D]", "bhsd": "[B, H, S, D]", "sbhd": "[S, B, H, D]", "thd": "[T, H, D]"}[layout]


def to_canonical(x: Tensor, layout: str) -> Tensor:
    """A [B, S, H, D] view of ``x`` given in ``layout`` (``thd`` becomes [1, T, H, D]); never a copy."""
    if layout == "bshd":
        return x
    if layout == "bhsd":
        return x.permute(0, 2, 1, 3)
    if layout == "sbhd":
        return x.permute(1, 0, 2, 3)
    if layout == "thd":
        return x.unsqueeze(0)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


class RopeSpec(NamedTuple):
    """A validated rotation of ``q`` (and ``k``), in the normalised form every backend takes.

    The fields are the arguments of ``ropekit::rope`` after q and k, in schema order (:func:`op_schema`); adding
    an option means adding a field here and its check in :func:`validate`.

    * positions: ``positions`` [B, S] per-token ids, or ``seq_offsets`` [B] added to each sequence's 0..S-1 (to the
      index inside each ``cu_seqlens`` sequence with packed tokens), or the int ``pos_offset``. Multi-axis positions
      (M-RoPE): ``positions`` [A, B, S], one row of ids per axis, ``sections`` (n_0, ..., n_{A-1}) pairs per axis
      (at most 4 axes; None for 1-D positions) and ``section_layout`` which pairs each axis turns
      (:func:`pair_axis_map`). Through the dispatcher ``sections`` arrives as a list.
    * frequencies: ``freq_mode`` "inv_freq" (``inv_freq`` [R/2], angles formed in the kernel), "table"
      (``cos``/``sin`` [Bt, rows, W]) or "angles" (raw angles in ``cos`` [Bt, rows, W]); W is R/2 or R; rows are
      positions, or the tokens' ``s`` when ``table_by_token``.
    * ``rotary_dim`` R columns from ``rotary_start`` are rotated; ``conjugate`` rotates by -theta (the backward).
    * outputs have dtype ``out_dtype`` (None: each input's dtype).
    """

    positions: Tensor | None
    seq_offsets: Tensor | None
    cu_seqlens: Tensor | None
    inv_freq: Tensor | None
    cos: Tensor | None
    sin: Tensor | None
    pos_offset: int
    sections: tuple[int, ...] | None
    section_layout: str
    layout: str
    style: str
    freq_mode: str
    rotary_dim: int
    rotary_start: int
    table_by_token: bool
    q_scale: float
    k_scale: float
    rotary_scale: float
    conjugate: bool
    out_dtype: torch.dtype | None

    @property
    def tensors(self) -> tuple:
        """The tensor fields (positions .. sin), in order."""
        return self[:NUM_TENSOR_FIELDS]

    @property
    def scalars(self) -> tuple:
        """The non-tensor fields (pos_offset .. out_dtype), in order."""
        return self[NUM_TENSOR_FIELDS:]

    @classmethod
    def from_parts(cls, tensors: tuple, scalars: tuple) -> RopeSpec:
        return cls(*tensors, *scalars)


NUM_TENSOR_FIELDS = 6
TENSOR_FIELDS = RopeSpec._fields[:NUM_TENSOR_FIELDS]
_SCHEMA_TYPES = {Tensor | None: "Tensor?", int: "int", str: "str", float: "float", bool: "bool",
                 torch.dtype | None: "ScalarType?", tuple[int, ...] | None: "int[]?"}


def op_schema(inplace: bool, inputs: str = "", returns: str = "Tensor[]") -> str:
    """The ``torch.library`` schema of ``ropekit::rope`` (out of place: returns the outputs) or ``ropekit::rope_``
    (writes q and k), generated from :class:`RopeSpec`'s fields; ``inputs`` replaces q and k by other leading
    arguments (the prologue ops), which return ``returns``."""
    hints = typing.get_type_hints(RopeSpec)
    fields = ", ".join(f"{_SCHEMA_TYPES[hints[name]]} {name}" for name in RopeSpec._fields)
    if inputs:
        return f"({inputs}, {fields}) -> {returns}"
    if inplace:
        return f"(Tensor(a!) q, Tensor(b!)? k, {fields}) -> ()"
    return f"(Tensor q, Tensor? k, {fields}) -> Tensor[]"


class Mode(NamedTuple):
    """How a public function rotates: in place or not, forward or conjugate, and what errors call its inputs."""

    inplace: bool
    conjugate: bool
    names: tuple[str, str]

    def gradient(self) -> Mode:
        """The rotation that gives this one's input gradients: the conjugate, out of place."""
        return Mode(False, not self.conjugate, ("grad of q_rot", "grad of k_rot"))


FORWARD = Mode(False, False, ("q", "k"))
FORWARD_INPLACE = Mode(True, False, ("q", "k"))
BACKWARD = Mode(False, True, ("dq_rot", "dk_rot"))


class RopeArgs(NamedTuple):
    """The keyword arguments of :func:`ropekit.apply_rope`, :func:`ropekit.apply_rope_` and
    :func:`ropekit.rope_backward` (and the rotation keywords of the prologue's functions), as the public API hands
    them down: the one place their names, order and defaults are written. The public signatures spell the same
    keywords out (for ``help()`` and editors); a test holds them to these fields. Layers below read fields by
    name; :func:`validate_args` turns them into a :class:`RopeSpec`."""

    positions: Positions = None
    inv_freq: Tensor | None = None
    base: float = 10000.0
    cos: Tensor | None = None
    sin: Tensor | None = None
    angles: Tensor | None = None
    style: str = "neox"
    layout: str = "bshd"
    rotary_dim: int | None = None
    rotary_at: str = "front"
    q_scale: float = 1.0
    k_scale: float = 1.0
    rotary_scale: float = 1.0
    cu_seqlens: Tensor | None = None
    sections: Sequence[int] | None = None
    section_layout: str = "contiguous"
    check_positions: bool = False
    out_dtype: torch.dtype | None = None
    backend: str = "auto"
    q_out_scale: str | None = None


TENSOR_ARGS = ("positions", "inv_freq", "cos", "sin", "angles", "cu_seqlens")
"""The :class:`RopeArgs` fields that may hold tensors."""


class NormSpec(NamedTuple):
    """Per-head RMSNorm before the rotation (:func:`ropekit.qk_norm_rope`, :func:`ropekit.rope_kv_write`):
    ``x / sqrt(mean(x**2) + eps) * (weight + weight_offset)``. As given by the caller, or (from
    :func:`validate_norm`) checked, with Python-float ``weight_offset`` and ``eps``."""

    q_weight: Tensor | None
    k_weight: Tensor | None
    weight_offset: float = 0.0
    eps: float = 1e-6

    @property
    def present(self) -> bool:
        return self.q_weight is not None


class CacheArgs(NamedTuple):
    """:func:`ropekit.rope_kv_write`'s value and cache arguments as the caller gave them; validation turns them into
    a :class:`CacheSpec`."""

    v: Tensor
    k_cache: Tensor
    v_cache: Tensor
    slot_mapping: Tensor | None = None
    cache_layout: str = "bshd"
    k_cache_scale: float | Tensor | None = None
    v_cache_scale: float | Tensor | None = None
    kv_indices: Tensor | None = None
    kv_indptr: Tensor | None = None
    kv_last_page_len: Tensor | None = None
    batch_indices: Tensor | None = None


SECTION_LAYOUTS = ("contiguous", "interleaved")
MAX_AXES = 4
"""The most position axes (sections) the kernel takes: it forms each pair's axis from one compile-time bound per
axis past the first (``ropekit.triton.launcher.axis_constexprs``)."""


def pair_axis_map(sections: tuple[int, ...], section_layout: str) -> list[int]:
    """The axis whose position turns each rotary pair (M-RoPE).

    ``"contiguous"`` (Qwen2-VL, Qwen2.5-VL ``mrope_section``): pairs ``0..n_0-1`` take axis 0, the next ``n_1``
    axis 1, and so on. ``"interleaved"`` (Qwen3-VL): pair i takes axis ``a = i % A`` for ``a >= 1`` while
    ``i < A * n_a``, and axis 0 otherwise -- transformers' Qwen3-VL rotary embedding's layout (T H W T H W ... T T;
    where ``A * n_a`` passes the last pair, axis a simply gets fewer pairs, as there)."""
    if section_layout == "contiguous":
        return [axis for axis, n in enumerate(sections) for _ in range(n)]
    A = len(sections)
    half = sum(sections)
    axes = [0] * half
    for a in range(1, A):
        for i in range(a, min(A * sections[a], half), A):  # transformers' strided slice stops at the last pair
            axes[i] = a
    return axes


@device_cache(maxsize=64)
def pair_axis_tensor(sections: tuple[int, ...], section_layout: str, device: torch.device) -> Tensor:
    """:func:`pair_axis_map` as an int32 tensor on ``device``, cached (the 64 most recently used) in eager mode so
    that repeated calls allocate nothing."""
    return torch.tensor(pair_axis_map(sections, section_layout), dtype=torch.int32).to(device)


def needs_grad(q: Tensor, k: Tensor | None) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))



CACHE_LAYOUTS = ("bshd", "bhsd", "paged", "paged_hnd", "paged_x")
PAGED_LAYOUTS = ("paged", "paged_hnd", "paged_x")
"""The paged caches, addressed by ``slot_mapping`` or by FlashInfer's page table (``kv_indptr``...): "paged"
[num_blocks, block_size, H, D] (NHD), "paged_hnd" [num_blocks, H, block_size, D] and "paged_x" (vLLM's
paged-attention layout: keys [num_blocks, H, D/x, block_size, x], values [num_blocks, H, D, block_size])."""
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_CACHE_DTYPES = FP8_DTYPES
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
"""The largest finite value of each float8 format: stores saturate to it."""


class OutScales(NamedTuple):
    """The prologue's extra outputs as the caller asks for them: the float8 output scales (``RopeArgs.out_dtype``
    names the float8 dtype): None (1.0), a Python float, a float tensor of one element, or ``"dynamic"``; and
    whether rope_kv_write also returns the rotated k (``return_k``)."""

    q_out_scale: float | Tensor | str | None = None
    k_out_scale: float | Tensor | str | None = None
    return_k: bool = False

    @property
    def given(self) -> bool:
        return self.q_out_scale is not None or self.k_out_scale is not None


class OutQuant(NamedTuple):
    """float8 outputs of the prologue's functions (the rotated q, and qk_norm_rope's k), validated
    (:func:`ropekit._validation.validate_out_quant`): ``dtype`` and the scales (stored = value / scale), floats or
    one-element float32 device tensors, or ``dynamic``: each (token, head) row is scaled by its own
    ``max |row| / fp8 max``, returned beside the output."""

    dtype: torch.dtype
    q_scale: float | Tensor | None = None
    k_scale: float | Tensor | None = None
    dynamic: bool = False


class CacheSpec(NamedTuple):
    """Where :func:`ropekit.rope_kv_write` puts k and v, validated.

    * ``k_cache``/``v_cache`` as given, in ``layout``: "bshd" [B, rows, H, D], "bhsd" [B, H, rows, D] (token
      (b, pos) goes to row pos of batch entry b), "paged" [num_blocks, block_size, H, D], "paged_hnd" [num_blocks,
      H, block_size, D] or "paged_x" (keys [num_blocks, H, D/x, block_size, x], values [num_blocks, H, D,
      block_size]): token t goes to slot ``slots[b, s]`` (-1, or any slot outside, skips it), or, with the page
      table, to the page and row its request and position name (below).
    * ``cache_batch``: packed tokens' batch entries ([T] int64, from ``cu_seqlens``), else None (the token's own).
    * ``slots``: [B, S] view of ``slot_mapping`` (paged only).
    * ``k_scale``/``v_scale``: float8 caches' scales (stored = value / scale): Python floats, one-element float32
      device tensors (read by the kernel: graph capture), or per-head [Hkv] float32 tensors; 1.0 for other caches.
    * the page table (paged caches, instead of ``slots``): ``kv_indptr`` [R + 1], ``kv_indices`` and
      ``kv_last_page_len`` [R] (dense int tensors), ``batch_indices`` [B, S] (or None: each token's own sequence,
      ``cache_batch`` or b): token (b, s) of request r at position p goes to page ``kv_indices[kv_indptr[r] + p //
      block_size]``, row ``p % block_size``, where that page is one of r's and p is below r's length ``(pages - 1)
      * block_size + kv_last_page_len[r]``; any other token writes nothing.
    """

    k_cache: Tensor
    v_cache: Tensor
    layout: str
    cache_batch: Tensor | None
    slots: Tensor | None
    k_scale: float | Tensor
    v_scale: float | Tensor
    kv_indices: Tensor | None = None
    kv_indptr: Tensor | None = None
    kv_last_page_len: Tensor | None = None
    batch_indices: Tensor | None = None

    @property
    def paged(self) -> bool:
        return self.layout in PAGED_LAYOUTS

    @property
    def page_table(self) -> bool:
        """Addressed by FlashInfer's page table rather than by slots."""
        return self.kv_indptr is not None

    def views(self) -> tuple[Tensor, Tensor]:
        """The caches as [B | num_blocks, rows | block_size, H, D] views (no copy); "paged_x" keys as [num_blocks,
        block_size, H, D/x, x] (a column d is at (d // x, d % x)) and values with strided columns."""
        if self.layout in ("bhsd", "paged_hnd"):
            return self.k_cache.transpose(1, 2), self.v_cache.transpose(1, 2)
        if self.layout == "paged_x":
            return self.k_cache.permute(0, 3, 1, 2, 4), self.v_cache.permute(0, 3, 1, 2)
        return self.k_cache, self.v_cache

    @property
    def rows(self) -> int:
        """Rows per batch entry, or slots in all (paged)."""
        kv = self.views()[0]
        return kv.shape[0] * kv.shape[1] if self.paged else kv.shape[1]

    @property
    def block_size(self) -> int:
        return self.views()[0].shape[1] if self.paged else 1
