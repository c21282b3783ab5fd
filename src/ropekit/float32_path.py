"""The float32 torch path: ropekit's rotation for float16/bfloat16/float32 tensors on the CPU and on devices
without Triton kernels (MPS, XPU, ...). Angles are exact (formed in float64 on the host, as the kernels' are
exact), the rotation is float32 math with one rounding to the output's dtype: the kernels' precision, in a few
torch ops per call. float64 tensors keep the float64 reference (:mod:`ropekit.reference`), whose table builder
this path shares."""

from __future__ import annotations

import functools
import math
import threading
from collections import OrderedDict

import torch

from ropekit import _config
from ropekit._angle_tables import rotation_tables, token_positions
from ropekit._spec import MAX_POSITION, RopeSpec, to_canonical


def rope_float32(q: torch.Tensor, k: torch.Tensor | None, spec: RopeSpec) -> list[torch.Tensor]:
    """The rotation of :func:`ropekit.reference.rope_reference` with float32 math, into new tensors (in q's and
    k's layout and shape; ``spec.out_dtype``, None: each input's dtype); see :func:`rope_float32_into`."""
    outs = []
    for x in (q, k):
        if x is not None:
            outs.append(torch.empty(x.shape, dtype=x.dtype if spec.out_dtype is None else spec.out_dtype,
                                    device=x.device))
    rope_float32_into(q, k, outs[0], outs[1] if k is not None else None, spec)
    return outs


# Elements of one tensor rotated per step of :func:`_rotate_float32` per two of torch's threads: the step's float32
# working copy (1 MiB on two threads) and its half-width temporary stay in the cache between the few elementwise
# ops of the step, and each thread still gets enough elements that an op's split over threads pays (16 threads
# of an H200 host: 2x4096 tokens 2.0x faster in steps of 8 MiB than of 1 MiB).
_CHUNK_ELEMENTS = 1 << 18


def _block_elements(x: torch.Tensor) -> int:
    """Elements of ``x`` rotated per step: :data:`_CHUNK_ELEMENTS` per two threads torch uses -- but a 16-bit CPU
    tensor whose float32 copy and swapped copy fit this thread's workspace (:data:`WORKSPACE_ELEMENTS`) goes in
    one step (2 threads, 256 tokens of 32 heads: 0.39 ms against 0.47 ms in 1 MiB steps), and other 16-bit inputs
    below four such steps in :data:`_CHUNK_ELEMENTS` steps, whose two buffers the workspace holds: float32
    working copies in fresh memory page-fault on every call, which only large tensors amortize (16 threads, 256
    tokens of 32 heads in fresh memory: 1.06 ms in 1 MiB steps, 1.86 ms in one 4 MiB step)."""
    scaled = _CHUNK_ELEMENTS * max(1, torch.get_num_threads() // 2)
    if x.dtype != torch.float32:
        n = x.numel()
        if x.device.type == "cpu" and 2 * n <= WORKSPACE_ELEMENTS:
            return max(n, scaled)
        if n <= 4 * scaled:
            return _CHUNK_ELEMENTS
    return scaled


def rope_float32_into(q: torch.Tensor, k: torch.Tensor | None, q_out: torch.Tensor, k_out: torch.Tensor | None,
                      spec: RopeSpec) -> None:
    """Rotate ``q`` (and ``k``) as ``spec`` says into ``q_out`` (and ``k_out``) -- which may be the inputs
    themselves (in place) -- with float32 math: the CPU path for float16/bfloat16/float32 tensors, and the path of
    devices without Triton kernels or float64 (MPS, XPU, ...).

    Positions and angles are formed in float64 on the CPU, once per call at the size of positions x frequencies
    (one row for all sequences when they share their positions; exact at any position; reading device positions
    is a host sync), and their cos/sin rounded to float32 tables with the rotation's scales folded in
    (:func:`float32_tables`; on the CPU a call whose positions and frequencies hold the values of a recent call's
    -- the next layer of a model, which shares one positions tensor across its layers -- reuses its tables).
    The rotation then runs on the tensors' device in float32 torch ops, a block of tokens at a time, with one
    rounding to the output's dtype: the kernels' precision. ``q``/``k`` [in ``spec.layout``] of any strides;
    outputs of the inputs' shapes, any floating dtype (``spec.out_dtype`` is not read: the outputs' dtypes are
    the rotation's). Tokens without a valid position come out NaN, as on the kernels."""
    rotate_with_tables(q, k, q_out, k_out, float32_tables(q, k, spec)[0], spec)


def float32_tables(q: torch.Tensor, k: torch.Tensor | None, spec: RopeSpec) -> tuple[dict, bool]:
    """({scale: the float32 tables (C, T) of :func:`_float32_tables`}, whether every token's position is valid)
    for rotating ``q`` (and ``k``) as ``spec`` says: built, or on the CPU taken from :data:`RECENT_TABLES`."""
    B, S = to_canonical(q, spec.layout).shape[:2]
    D = q.shape[-1]
    scales = (spec.q_scale,) if k is None else (spec.q_scale, spec.k_scale)
    made = POSITION_TABLES.rows(spec, B, S, D, scales, q.device)
    if made is not None:
        return made, True
    found = RECENT_TABLES.get(spec, B, S, D, scales, q.device)
    if found is None:
        found = _tables_of(spec, B, S, D, scales, q.device)
        RECENT_TABLES.keep(spec, B, S, D, scales, q.device, *found)
    return found


def rotate_with_tables(q: torch.Tensor, k: torch.Tensor | None, q_out: torch.Tensor, k_out: torch.Tensor | None,
                       made: dict, spec: RopeSpec) -> None:
    """The rotation of :func:`rope_float32_into` with the tables ``made`` of :func:`float32_tables` (only the
    spec's scalars are read)."""
    layout, neox = spec.layout, spec.style == "neox"
    for x, out, scale in ((q, q_out, spec.q_scale), (k, k_out, spec.k_scale)):
        if x is not None:
            _rotate_float32(to_canonical(x, layout), to_canonical(out, layout), made[scale], spec.rotary_start,
                            spec.rotary_dim, neox, inplace=out is x)


def _inv_freq_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple:
    """The float64 ``(cos, cos, sin, sin)`` [Bt, S, R/2] of int64 positions ``pos`` [Bt, S] times ``inv_freq``: the
    angles of every 1-D ``inv_freq`` call, per call (:func:`_tables_of`) or per window (:class:`PositionTables`).
    rotation_tables' angles without reduced_angle: its fmod by the float64 2*pi is off by up to 2e-7 near position
    2**31 (and slow), while torch's float64 cos/sin are accurate at any such angle."""
    angle = torch.mul(pos.unsqueeze(-1), inv_freq.to(device=pos.device, dtype=torch.float64))
    cosine, sine = torch.cos(angle), torch.sin(angle)
    return cosine, cosine, sine, sine


def _tables_of(spec: RopeSpec, B: int, S: int, D: int, scales: tuple, device: torch.device) -> tuple[dict, bool]:
    """({scale: the float32 tables (C, T) of :func:`_float32_tables`}, whether every token's position is valid):
    q and k share their tables when their scales agree."""
    neox = spec.style == "neox"
    pos, valid = _float32_path_positions(spec, B, S)
    if spec.freq_mode == "inv_freq" and pos.dim() == 2:
        tables = _inv_freq_cos_sin(pos, spec.inv_freq)
    else:
        tables = rotation_tables(pos, half=spec.rotary_dim // 2, neox=neox, freq_mode=spec.freq_mode,
                                 inv_freq=spec.inv_freq, cos=spec.cos, sin=spec.sin,
                                 table_by_token=spec.table_by_token, sections=spec.sections,
                                 section_layout=spec.section_layout)
    if valid is not None:  # NaN cos/sin make the token's rotated columns NaN; its other columns by ``passed`` below
        tables = tuple(torch.where(valid[..., None], t, math.nan) for t in tables)
    made: dict[float, tuple] = {}
    for scale in scales:
        if scale not in made:
            passed = scale if valid is None else torch.where(valid, scale, math.nan)[:, :, None, None]
            made[scale] = _float32_tables(tables, scale * spec.rotary_scale, spec.conjugate, passed, D,
                                          spec.rotary_start, spec.rotary_dim, neox, device)
    return made, valid is None


class RecentTables:
    """The float32 tables of the last ``size`` CPU calls, each with its call's scalars (offset, layout, style, dims,
    scales, ...) and shape, and found again only when every tensor of the spec -- positions, frequencies -- holds
    the same values: compared by value (one ``torch.equal`` each), since a CPU tensor can change without autograd
    seeing it (through numpy). Calls with the same scalars and other positions each keep their own entry (a
    forward's layers and the next step's first layer, or two sets of positions taking turns). Calls whose spec
    tensors are large (position-indexed cos/sin tables) or whose tables would be are not kept."""

    def __init__(self, size: int = 4, max_spec_elements: int = 1 << 16, max_table_elements: int = 1 << 19):
        self.size, self.max_spec_elements, self.max_table_elements = size, max_spec_elements, max_table_elements
        self._entries: list = []  # (key, the spec's tensors, tables, all valid), the most recent last

    def clear(self) -> None:
        self._entries.clear()

    def _key(self, spec: RopeSpec, B: int, S: int, D: int, scales: tuple, device: torch.device):
        if device.type != "cpu" or not self.size or not _config.fast_path:
            return None
        return (spec.scalars, B, S, D, scales)

    def get(self, spec: RopeSpec, B: int, S: int, D: int, scales: tuple, device: torch.device):
        """(tables, all positions valid) of an earlier call with the same values, or None."""
        key = self._key(spec, B, S, D, scales, device)
        if key is None:
            return None
        tensors = spec.tensors
        for i in range(len(self._entries) - 1, -1, -1):
            entry = self._entries[i]
            if entry[0] == key and _same_values(entry[1], tensors):
                if i != len(self._entries) - 1:
                    self._entries.append(self._entries.pop(i))
                return entry[2], entry[3]
        return None

    def keep(self, spec: RopeSpec, B: int, S: int, D: int, scales: tuple, device: torch.device, made: dict,
             all_valid: bool) -> None:
        key = self._key(spec, B, S, D, scales, device)
        if key is None:
            return
        tensors = [t for t in spec.tensors if t is not None]
        if any(t.device.type != "cpu" for t in tensors) or \
                sum(t.numel() for t in tensors) > self.max_spec_elements or \
                sum(t.numel() for tables in made.values() for t in tables) > self.max_table_elements:
            return
        self._entries.append((key, tuple(None if t is None else t.clone() for t in spec.tensors), made, all_valid))
        del self._entries[:-self.size]


def _same_values(kept: tuple, tensors: tuple) -> bool:
    """Whether ``tensors`` (None or CPU tensors) hold the values of ``kept`` (None or copies), one by one."""
    for saved, t in zip(kept, tensors):
        if saved is None or t is None:
            if saved is not t:
                return False
        elif saved.shape != t.shape or saved.dtype != t.dtype or t.device.type != "cpu" or not torch.equal(saved, t):
            return False
    return True


class PositionTables:
    """The float32 tables of a window of positions per rotation (frequencies, scale, dims, style): a decode-sized
    CPU call with 1-D positions takes its tables as rows of them (a view for a run of positions, else one
    ``index_select`` each for ``C`` and ``T``) instead of forming cos/sin per call -- a decode step's first layer.

    Each row is built once, as :func:`_tables_of` builds it. A window starts at the first call's positions, at least
    twice their span and ``MIN_ROWS`` rows (0.15 ms at head_dim 128, two threads), and grows at least twofold towards
    later calls' positions: O(1) rows a decode step. Bounds: ``max_elements`` float32 values a window (16 MiB, 16384
    positions at head_dim 128), ``4 * max_elements`` and ``max_rotations`` windows in all. Nothing is rebuilt on
    every call when calls take turns: a call the window cannot grow to cover forms its own tables, and only
    ``RESTART_MISSES`` such calls in a row (a decode that moved on) start it afresh; a new window evicts only windows
    unused for ``2 * max_rotations`` lookups. Calls of more than ``max_tokens`` positions, spanning more than half a
    window, with a negative position, or with other frequency sources form their own tables. The frequencies are
    compared by value (their bits) on every call."""

    MIN_ROWS = 256
    RESTART_MISSES = 8

    def __init__(self, max_elements: int = 1 << 22, max_rotations: int = 8, max_tokens: int = 1024,
                 max_frequencies: int = 512):
        self.max_elements, self.max_rotations = max_elements, max_rotations
        self.max_tokens, self.max_frequencies = max_tokens, max_frequencies
        # rotation key -> [first position, C [1, rows, 1, D], T [1, rows, 1, R], calls missed in a row, last use]
        self._tables: OrderedDict = OrderedDict()
        self._uses = 0  # lookups so far: a window's last use says how recently it served
        self._lock = threading.Lock()

    def clear(self) -> None:
        self._tables.clear()

    def rows(self, spec: RopeSpec, B: int, S: int, D: int, scales: tuple, device: torch.device) -> dict | None:
        """{scale: (C, T)} of :func:`_float32_tables` for the call, as rows of the kept tables, or None where the
        call forms its own (see the class)."""
        inv_freq = spec.inv_freq
        if device.type != "cpu" or spec.freq_mode != "inv_freq" or spec.cu_seqlens is not None or \
                not self.max_elements or not _config.fast_path or inv_freq.device.type != "cpu" or \
                inv_freq.numel() > self.max_frequencies or torch.compiler.is_compiling():
            return None
        index = self._index(spec, B, S)
        if index is None:
            return None
        lo, hi, ids, Bt = index
        bits = inv_freq.view(torch.int64 if inv_freq.dtype == torch.float64 else torch.int32).tolist()
        rotation = (inv_freq.dtype, tuple(bits), spec.style, spec.conjugate, spec.rotary_scale, D,
                    spec.rotary_start, spec.rotary_dim)
        made = {}
        for scale in scales:
            if scale in made:
                continue
            kept = self._covering(rotation + (scale,), spec, scale, D, inv_freq, lo, hi)
            if kept is None:
                return None
            start, *tables = kept[:3]
            if ids is None:  # a run of consecutive positions from lo, shared by every sequence
                rows = tuple(t.narrow(1, lo - start, S) for t in tables)
                # decode-sized rows as tensors of their own: a plan keeps them (its last tables), and views would
                # keep the whole window alive after it moved on
                made[scale] = tuple(t.clone() for t in rows) if S * (D + spec.rotary_dim) <= OWN_ROWS_ELEMENTS \
                    else rows
            else:
                rows = ids - start if start else ids
                made[scale] = tuple(t.index_select(1, rows).view(Bt, S, 1, -1) for t in tables)
        return made

    def _index(self, spec: RopeSpec, B: int, S: int):
        """(the smallest position, the largest, None, 1) for a run of consecutive positions shared by every
        sequence, else (smallest, largest, int64 positions, sequences with their own rows); None where the call
        has more than ``max_tokens`` positions or a negative one."""
        if spec.positions is None and spec.seq_offsets is None:
            first = spec.pos_offset
            if S > self.max_tokens or first < 0 or S == 0:
                return None
            return first, first + S - 1, None, 1
        if spec.positions is not None:
            pos = spec.positions
            if pos.dim() != 2:  # multi-axis
                return None
            if pos.shape[0] > 1 and pos.stride(0) == 0:  # every sequence has the same positions: one row serves all
                pos = pos[:1]
        elif S == 1:  # decode with per-sequence offsets: the offsets are the positions
            pos = spec.seq_offsets.view(-1, 1)
        else:
            return None
        if pos.numel() > self.max_tokens or pos.numel() == 0:
            return None
        ids = pos.reshape(-1)
        values = ids.tolist()
        lo, hi = min(values), max(values)
        if lo < 0:
            return None
        if pos.shape[0] == 1 and values == list(range(lo, lo + len(values))):
            return lo, hi, None, 1
        return lo, hi, ids.to(torch.int64), pos.shape[0]

    def _covering(self, key, spec: RopeSpec, scale: float, D: int, inv_freq: torch.Tensor, lo: int, hi: int):
        """The kept [first position, C, T, ...] of ``key`` covering positions ``lo``..``hi`` (built, grown or
        started afresh here), or None where the call forms its own tables (see the class)."""
        with self._lock:
            self._uses += 1
            kept = self._tables.get(key)
            if kept is not None:
                kept[4] = self._uses
                if kept[0] <= lo and hi < kept[0] + kept[1].shape[1]:
                    self._tables.move_to_end(key)
                    kept[3] = 0
                    return kept
        cap = self.max_elements // (D + spec.rotary_dim)
        fresh = max(self.MIN_ROWS, 1 << (2 * (hi - lo) + 1).bit_length())  # at least twice the span
        if kept is not None:  # grow it: at least double, towards the side the call reached
            start, rows = kept[0], kept[1].shape[1]
            new_start, new_stop = min(start, lo), max(start + rows, hi + 1)
            grow = max(2 * rows, new_stop - new_start) - (new_stop - new_start)
            if hi >= start + rows:
                new_stop = min(new_stop + grow, MAX_POSITION + 1)
            else:
                new_start = max(new_start - grow, 0)
            if new_stop - new_start > cap:  # too wide: a miss, or after enough of them in a row, a fresh start
                kept[3] += 1
                if kept[3] < self.RESTART_MISSES or fresh > cap:
                    return None
                kept = None
        elif fresh > cap:
            return None
        if kept is None:
            new_start, new_stop = lo, min(lo + fresh, MAX_POSITION + 1)
        per_row = D + spec.rotary_dim
        if not self._room(key, (new_stop - new_start) * per_row):
            return None
        with torch.inference_mode(False):  # kept memory: never an inference tensor
            if kept is None:
                tables = self._built(spec, scale, D, inv_freq, new_start, new_stop)
            else:
                parts = [self._built(spec, scale, D, inv_freq, new_start, start)] if new_start < start else []
                parts.append(kept[1:3])
                if new_stop > start + rows:
                    parts.append(self._built(spec, scale, D, inv_freq, start + rows, new_stop))
                tables = tuple(torch.cat(column, 1) for column in zip(*parts))
        new = [new_start, *tables, 0, self._uses]
        with self._lock:  # calls on several threads share the tables
            self._tables[key] = new
            self._tables.move_to_end(key)
        return new

    def _room(self, key, elements: int) -> bool:
        """Whether ``key``'s window may take ``elements`` float32 values: within ``max_rotations`` windows and
        ``4 * max_elements`` values together, after evicting (least recently used first) only windows unused for
        ``2 * max_rotations`` lookups. Evicts them when it may."""
        with self._lock:
            others = [(k, e) for k, e in self._tables.items() if k != key]
            total = elements + sum(e[1].numel() + e[2].numel() for _, e in others)
            count = len(others) + 1
            evict = []
            for k, e in others:  # least recently used first
                if count <= self.max_rotations and total <= 4 * self.max_elements:
                    break
                if self._uses - e[4] < 2 * self.max_rotations:
                    return False  # still in use: the call forms its own tables instead
                evict.append(k)
                count -= 1
                total -= e[1].numel() + e[2].numel()
            if count > self.max_rotations or total > 4 * self.max_elements:
                return False
            for k in evict:
                del self._tables[k]
            return True

    @staticmethod
    def _built(spec: RopeSpec, scale: float, D: int, inv_freq: torch.Tensor, start: int, stop: int) -> tuple:
        """(C [1, rows, 1, D], T [1, rows, 1, R]) of positions ``start``..``stop - 1``, as :func:`_tables_of`."""
        tables = _inv_freq_cos_sin(torch.arange(start, stop, dtype=torch.int64)[None], inv_freq)
        return _float32_tables(tables, scale * spec.rotary_scale, spec.conjugate, scale, D, spec.rotary_start,
                               spec.rotary_dim, spec.style == "neox", torch.device("cpu"))


# Table elements up to which PositionTables hands out copies of a run of rows rather than views of its window: at
# least what a Float32Plan keeps (``Float32Plan.KEPT_TABLE_ELEMENTS``).
OWN_ROWS_ELEMENTS = 1 << 14

POSITION_TABLES = PositionTables()
"""The float32 path's per-position tables (:class:`PositionTables`); off with the fast path, or
``POSITION_TABLES.max_elements = 0``."""

RECENT_TABLES = RecentTables()
"""The float32 path's table cache (:class:`RecentTables`); off with the fast path (:func:`ropekit.set_fast_path`,
``ROPEKIT_DISABLE_FAST_PATH=1``) or ``RECENT_TABLES.size = 0``."""


def _float32_path_positions(spec: RopeSpec, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(int64 CPU positions of the canonical grid -- one row for all sequences when they share their positions
    and frequencies -- and None when every position is usable, else the per-token validity mask). An offset's
    range is known without a tensor op, a position tensor's is read by one aminmax; the mask is built only
    when some position is negative or past ``MAX_POSITION`` or a position-indexed table."""
    rows = None if spec.freq_mode == "inv_freq" or spec.table_by_token else spec.cos.shape[1]
    tables_by_sequence = spec.freq_mode != "inv_freq" and spec.cos.shape[0] != 1
    if spec.positions is None and spec.seq_offsets is None and spec.cu_seqlens is None:  # 0.. S-1 plus an offset
        first = spec.pos_offset
        pos = torch.arange(first, first + S, dtype=torch.int64)[None]
        pos = pos.expand(B, S) if tables_by_sequence else pos
        last = first + S - 1
        if S == 0 or (first >= 0 and last <= MAX_POSITION and (rows is None or last < rows)):
            return pos, None
    else:
        pos = token_positions(B, S, positions=spec.positions, seq_offsets=spec.seq_offsets,
                              pos_offset=spec.pos_offset, cu_seqlens=spec.cu_seqlens, device=torch.device("cpu"))
        if pos.dim() == 2 and pos.shape[0] > 1 and pos.stride(0) == 0 and not tables_by_sequence:
            pos = pos[:1]  # every sequence has the same positions and frequencies: one row of angles serves all
        if pos.numel() == 0:
            return pos, None
        lo, hi = (int(v) for v in torch.aminmax(pos))
        if lo >= 0 and hi <= MAX_POSITION and (rows is None or hi < rows):
            return pos, None
    valid = (pos >= 0) & (pos <= MAX_POSITION)
    if pos.dim() == 3:  # multi-axis: a token is valid when every axis is
        valid = valid.all(0)
    if rows is not None:
        valid &= pos < rows
    return pos, valid


# Tokens up to which :func:`_float32_tables` builds both tables in one product.
_ONE_PRODUCT_ROWS = 1024


@functools.lru_cache(maxsize=64)
def _table_factors(factor: float, conjugate: bool, neox: bool) -> torch.Tensor:
    """float64 factors of ``(cos, sin)`` into ``(C, T)`` per pair column (lo, hi): C ``(factor, factor)``, T
    ``(-factor, +factor)`` forward, ``(+factor, -factor)`` for the conjugate; [2, 2, 1] for ``neox`` (columns in
    halves), else [2, 1, 2]. A constant of its arguments, never written."""
    sines = [factor, -factor] if conjugate else [-factor, factor]
    factors = torch.tensor([[factor, factor], sines], dtype=torch.float64)
    return factors[:, :, None] if neox else factors[:, None, :]


def _paired(y: torch.Tensor, neox: bool) -> torch.Tensor:
    """``y``'s last dim [R] as pairs: [..., 2, R/2] (``neox``: lo half, hi half) or [..., R/2, 2] (interleaved)."""
    half = y.shape[-1] // 2
    return y.unflatten(-1, (2, half) if neox else (half, 2))


def _float32_tables(tables: tuple, factor: float, conjugate: bool, passed, D: int, rotary_start: int,
                    rotary_dim: int, neox: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 tables ``(C, T)`` of :func:`_rotate_float32` from the float64 ``(cos_lo, cos_hi, sin_lo,
    sin_hi)`` [Bt, S, R/2], each value rounded once with ``factor`` (the tensor's scale times ``rotary_scale``)
    folded in. ``C`` [Bt, S, 1, D] holds ``cos * factor`` at the rotary columns and ``passed`` (the scale, or
    [Bt, S, 1, 1] with NaN for invalid tokens) at the others. ``T`` [Bt, S, 1, R] holds each rotary column's
    signed sine: with ``swap(x)`` exchanging the lo and hi column of every pair, the rotation is
    ``x * C + swap(x) * T`` on the rotary columns: ``T = (-sin_lo, +sin_hi) * factor`` forward,
    ``(+sin_hi, -sin_lo) * factor`` for the conjugate (the transpose)."""
    c_lo, c_hi, s_lo, s_hi = tables
    Bt, S, half = c_lo.shape
    if c_lo is c_hi and s_lo is s_hi and rotary_dim == D and Bt * S <= _ONE_PRODUCT_ROWS:
        # one product rounds both tables: fewest ops for decode's few tokens (torch's float64 -> float32 store
        # in a product is slower per element than a copy, so many tokens take the copy and a half-size product)
        both = torch.empty(Bt, S, 1, 2, D, dtype=torch.float32, device=device)  # [.., (C, T), D]
        cos_sin = torch.stack((c_lo, s_lo), 2)  # [Bt, S, (cos, sin), R/2], float64
        if neox:  # [.., (C, T), (lo, hi), R/2]
            cos_sin, out = cos_sin.view(Bt, S, 1, 2, 1, half), both.view(Bt, S, 1, 2, 2, half)
        else:  # [.., (C, T), R/2, (lo, hi)]
            cos_sin, out = cos_sin.view(Bt, S, 1, 2, half, 1), both.view(Bt, S, 1, 2, half, 2)
        torch.mul(cos_sin, _table_factors(float(factor), conjugate, neox).to(device), out=out)
        return both.select(3, 0), both.select(3, 1)
    C = torch.empty(Bt, S, 1, D, dtype=torch.float32, device=device)
    T = torch.empty(Bt, S, 1, rotary_dim, dtype=torch.float32, device=device)
    axis = -2 if neox else -1  # the pair axis of _paired's views
    cp = _paired(C if rotary_dim == D else C.narrow(-1, rotary_start, rotary_dim), neox)
    tp = _paired(T, neox)
    # Each copy or product computes in float64 and rounds once into the float32 table.
    cosines = ((cp, c_lo.unsqueeze(2).unsqueeze(axis)),) if c_lo is c_hi else (
        (cp.select(axis, 0), c_lo[:, :, None, :]), (cp.select(axis, 1), c_hi[:, :, None, :]))
    for dst, src in cosines:
        if factor == 1.0:
            dst.copy_(src)
        else:
            torch.mul(src.expand(dst.shape), factor, out=dst)
    if s_lo is s_hi:  # the positive column rounded once (a copy, or a half-size product), the other its negation
        positive, negative = tp.unbind(axis) if conjugate else tp.unbind(axis)[::-1]
        if factor == 1.0:
            positive.copy_(s_lo[:, :, None, :])
        else:
            torch.mul(s_lo[:, :, None, :], factor, out=positive)
        torch.neg(positive, out=negative)  # exact
    else:  # T's lo column takes the pair's hi sine for the conjugate, its lo sine forward
        sines = ((s_hi, factor), (s_lo, -factor)) if conjugate else ((s_lo, -factor), (s_hi, factor))
        for i, (src, signed) in enumerate(sines):
            dst = tp.select(axis, i)
            torch.mul(src[:, :, None, :].expand(dst.shape), signed, out=dst)
    for cols in (slice(0, rotary_start), slice(rotary_start + rotary_dim, D)):
        if cols.start < cols.stop:
            if isinstance(passed, torch.Tensor):
                C[..., cols].copy_(passed.to(device))
            else:
                C[..., cols].fill_(passed)
    return C, T


def _swapped(x: torch.Tensor, neox: bool) -> torch.Tensor:
    """A new tensor of ``x``'s rotary columns [..., R] with the lo and hi column of every pair exchanged."""
    if neox:
        return torch.roll(x, x.shape[-1] // 2, -1)
    return _paired(x, False).flip(-1).flatten(-2)


# Float32 elements of one thread's workspace at most (8 MiB): a 16-bit tensor of up to 1M elements (256 decode tokens
# of 32 heads of 128) finds its float32 copy and swapped copy there. Larger calls allocate, as fresh memory is
# cheap next to their work.
WORKSPACE_ELEMENTS = 1 << 21
# Views of the workspace kept per thread (one set per call shape: q's and k's of a few decode batch sizes).
_WORKSPACE_VIEWS = 16


class _Workspace(threading.local):
    """One thread's reused float32 CPU memory for the temporaries of a rotation (the float32 copy of a 16-bit
    input, the swapped copy, a block's result), and views of it made once per call shape. Fresh float32
    temporaries of decode sizes cost a page fault per 4 KiB on every call (the allocator maps and unmaps them), as
    much as the rotation itself; kept memory does not. Per thread, so that calls on two threads never share it;
    only on the CPU, whose ops run before they return (a device's allocator caches its memory already, and its
    streams would make shared memory unsafe). What a rotation returns is never workspace memory."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        """Free this thread's workspace."""
        self.buffer: torch.Tensor | None = None  # flat float32, grown to the largest need up to the bound
        self.views: dict = {}

    def get(self, key, elements: int, build):
        """The views ``build(buffer)`` made for ``key`` (of the buffer's first ``elements``), kept per key; None
        beyond :data:`WORKSPACE_ELEMENTS`."""
        views = self.views.get(key)
        if views is not None:
            return views
        if elements > WORKSPACE_ELEMENTS:
            return None
        with torch.inference_mode(False):  # kept memory: never an inference tensor, which later calls could not write
            return self._make(key, elements, build)

    def _make(self, key, elements: int, build):
        if self.buffer is None or self.buffer.numel() < elements:
            self.buffer = torch.empty(elements, dtype=torch.float32)
            self.views.clear()  # views of the old buffer, which is then freed
        if len(self.views) >= _WORKSPACE_VIEWS:
            self.views.clear()
        views = self.views[key] = build(self.buffer)
        return views


_WORKSPACE = _Workspace()


def _rotation_views(shape: torch.Size, rotary_start: int, rotary_dim: int, neox: bool):
    """(float32 copy [shape], swapped [..., R], ((swapped lo, copy hi), (swapped hi, copy lo)) pair views) in this
    thread's workspace for a CPU rotation of a tensor of ``shape``, or None where it does not fit
    (:meth:`_Workspace.get`)."""
    n = math.prod(shape)
    r = n // shape[-1] * rotary_dim

    def build(buffer):
        src = buffer[:n].view(shape)
        swapped = buffer[n:n + r].view(*shape[:-1], rotary_dim)
        lo, hi = _pairs(src, rotary_start, rotary_dim, neox)
        s_lo, s_hi = _pairs(swapped, 0, rotary_dim, neox)
        return src, swapped, ((s_lo, hi), (s_hi, lo))

    return _WORKSPACE.get((shape, rotary_start, rotary_dim, neox), n + r, build)


def _swap_into(pairs) -> None:
    """Fill a swapped copy from its ``((swapped lo, src hi), (swapped hi, src lo))`` pair views: two copies that
    convert (a 16-bit source's) in passing, instead of a fresh ``torch.roll``/``flip``."""
    for dst, src in pairs:
        dst.copy_(src)


def fits_rotated_copy(x: torch.Tensor) -> bool:
    """Whether :func:`rotated_copy` takes ``x``: contiguous, and no larger than one block."""
    return x.is_contiguous() and x.numel() <= _block_elements(x)


def rotated_copy(x: torch.Tensor, tables: tuple, neox: bool) -> torch.Tensor:
    """``x`` (:func:`fits_rotated_copy`, in the canonical layout, every column rotary) rotated into a new
    contiguous tensor of its dtype with the tables ``(C, T)`` of :func:`_float32_tables` -- bit for bit
    :func:`_rotate_float32`'s result -- in the fewest torch ops (float32: the product, the swap, their sum; else
    the float32 copy, the swap and the product in this thread's workspace, then the rounding copy, which allocates
    the output)."""
    C, T = tables
    if x.dtype == torch.float32:
        out = torch.mul(x, C)
        out.addcmul_(_swapped(x, neox), T)
        return out
    views = _rotation_views(x.shape, 0, x.shape[-1], neox) if x.device.type == "cpu" else None
    if views is None:
        src = x.to(torch.float32)
        swapped = _swapped(src, neox)
    else:
        src, swapped, pairs = views
        src.copy_(x)
        _swap_into(pairs)
    torch.mul(src, C, out=src)
    src.addcmul_(swapped, T)
    return src.to(x.dtype)


# Elements of q and k together up to which :func:`rotated_copies` takes them: there per-op host time is much of a
# call (2 threads, 32 + 8 heads of 128: 1 token 25 against 34 us, 16 tokens 69 against 78 us); at 32 tokens the two
# rotations one by one measured faster (88 against 131 us).
_JOINT_ELEMENTS = 1 << 17


def rotated_copies(q: torch.Tensor, k: torch.Tensor, q_tables: tuple, k_tables: tuple, neox: bool):
    """``(rotated_copy(q, q_tables, neox), rotated_copy(k, k_tables, neox))`` bit for bit, for 16-bit CPU inputs of
    one dtype and head size, and few elements (:data:`_JOINT_ELEMENTS`): q's then k's float32 copy side by side in
    this thread's workspace, so that one swap serves both and, for a single token with one table (which
    broadcasts over every head), one product and one sum: fewer ops where per-op host time is much of a call.
    Else None (the caller rotates them one by one). Outputs are new contiguous tensors of the inputs' dtype."""
    nq, nk, D = q.numel(), k.numel(), q.shape[-1]
    n = nq + nk
    if q.dtype != k.dtype or q.dtype == torch.float32 or q.device.type != "cpu" or k.device.type != "cpu" or \
            k.shape[-1] != D or n > _JOINT_ELEMENTS:
        return None
    one_token = q.shape[:2] == k.shape[:2] == (1, 1)

    def build(buffer):
        flat, flat_swapped = buffer[:n], buffer[n:2 * n]
        # q's rows then k's; for one token as [1, 1, Hq + Hk, D], which the tables broadcast over
        src, swapped = (t.view(1, 1, -1, D) if one_token else t.view(-1, D) for t in (flat, flat_swapped))
        lo, hi = _pairs(src, 0, D, neox)
        s_lo, s_hi = _pairs(swapped, 0, D, neox)
        parts = tuple((flat[a:b].view(x.shape), flat_swapped[a:b].view(x.shape))
                      for x, a, b in ((q, 0, nq), (k, nq, n)))
        return src, swapped, ((s_lo, hi), (s_hi, lo)), parts

    views = _WORKSPACE.get(("joint", q.shape, k.shape, neox), 2 * n, build)
    if views is None:
        return None
    src, swapped, pairs, ((q_src, q_swapped), (k_src, k_swapped)) = views
    q_src.copy_(q)
    k_src.copy_(k)
    _swap_into(pairs)
    if q_tables is k_tables and one_token:  # one table row serves every head
        C, T = q_tables
        torch.mul(src, C, out=src)
        src.addcmul_(swapped, T)
    else:
        for x_src, x_swapped, (C, T) in ((q_src, q_swapped, q_tables), (k_src, k_swapped, k_tables)):
            torch.mul(x_src, C, out=x_src)
            x_src.addcmul_(x_swapped, T)
    return q_src.to(q.dtype), k_src.to(k.dtype)


def _rotate_float32(x: torch.Tensor, out: torch.Tensor, tables: tuple, rotary_start: int, rotary_dim: int,
                    neox: bool, *, inplace: bool) -> None:
    """``out = rotate(x)`` on canonical [B, S, H, D] views (``out`` may be ``x``: ``inplace``) in float32 with the
    tables ``(C, T)`` of :func:`_float32_tables`: ``x * C``, plus ``swap(x) * T`` on the rotary columns, then one
    rounding to ``out``'s dtype. A call that fits one block (decode sizes) takes three to six torch ops, so that
    per-call host time stays low; larger calls go a block of tokens at a time through two reused float32 buffers
    (the working copy and the result) that stay in the cache, and float32 out of place writes straight into
    ``out``. On the CPU the float32 temporaries are this thread's workspace (:class:`_Workspace`)."""
    C, T = tables
    B, S, H, D = x.shape
    block = _block_elements(x)
    cpu = x.device.type == "cpu"
    if B * S * H * D <= block:  # one block: few ops on float32 operands (mixed-dtype ops are slow)
        if S == 0:
            return
        # a 16-bit input's float32 copy and swapped copy in the workspace (float32 swaps its input: one roll)
        views = _rotation_views(x.shape, rotary_start, rotary_dim, neox) if cpu and x.dtype != torch.float32 \
            else None
        if views is not None:
            src, swapped, pairs = views
            src.copy_(x)
            _swap_into(pairs)
        else:
            src = x if x.dtype == torch.float32 else x.to(torch.float32)
            swapped = _swapped(src if rotary_dim == D else src.narrow(-1, rotary_start, rotary_dim), neox)
        # the products land in a float32 tensor already at hand (out, or src when it is a copy), so that the call
        # allocates at most two float32 temporaries
        dst = out if out.dtype == torch.float32 else src if src is not x else torch.empty_like(src)
        torch.mul(src, C, out=dst)  # in place (dst is src, or out is x) is fine: swapped was read already
        (dst if rotary_dim == D else dst.narrow(-1, rotary_start, rotary_dim)).addcmul_(swapped, T)
        if dst is not out:
            out.copy_(dst)  # the one rounding to the output's dtype
        return
    # Blocks of s_step tokens of b_step sequences: all sequences at once unless one token of each is too much.
    s_step = max(1, min(S, block // (B * H * D)))
    b_step = B if s_step > 1 else max(1, min(B, block // (H * D)))
    direct = x.dtype == torch.float32 and out.dtype == torch.float32 and not inplace
    copy_in = x.dtype != torch.float32
    work = copy = None
    if not direct:  # the result buffer, and the working copy of a 16-bit input
        shape, step = (b_step, s_step, H, D), b_step * s_step * H * D
        buffers = _WORKSPACE.get(("blocks", shape), 2 * step, lambda buffer: (
            buffer[:step].view(shape), buffer[step:2 * step].view(shape))) if cpu else None
        if buffers is None:
            buffers = [torch.empty(shape, dtype=torch.float32, device=x.device) for _ in range(1 + copy_in)]
        work, copy = buffers[0], buffers[1] if copy_in else None
    t_lo, t_hi = _pairs(T, 0, rotary_dim, neox)
    tables = (C, t_lo, t_hi)  # below: the full buffers' pair views, made once (views cost host time)
    copy_pairs = _pairs(copy, rotary_start, rotary_dim, neox) if copy_in else None
    work_pairs = _pairs(work, rotary_start, rotary_dim, neox) if work is not None else None
    for b0 in range(0, B, b_step):
        nb = min(b_step, B - b0)
        for s0 in range(0, S, s_step):
            n = min(s_step, S - s0)
            full = nb == b_step and n == s_step  # the buffers need no narrowing
            xs, os_ = _block(x, b0, nb, s0, n), _block(out, b0, nb, s0, n)
            c, ta, tb = (_block(t, b0 if t.shape[0] > 1 else 0, min(nb, t.shape[0]), s0, n) for t in tables)
            if copy_in:
                xs = (copy if full else _block(copy, 0, nb, 0, n)).copy_(xs)
                lo, hi = copy_pairs if full else _pairs(xs, rotary_start, rotary_dim, neox)
            else:
                lo, hi = _pairs(xs, rotary_start, rotary_dim, neox)
            if direct:
                res = os_
                rlo, rhi = _pairs(res, rotary_start, rotary_dim, neox)
            else:
                res = work if full else _block(work, 0, nb, 0, n)
                rlo, rhi = work_pairs if full else _pairs(res, rotary_start, rotary_dim, neox)
            torch.mul(xs, c, out=res)
            rlo.addcmul_(hi, ta)
            rhi.addcmul_(lo, tb)
            if not direct:
                os_.copy_(res)  # the one rounding to the output's dtype (in place: after the block is read)


def _block(t: torch.Tensor, b0: int, nb: int, s0: int, n: int) -> torch.Tensor:
    """``t[b0:b0 + nb, s0:s0 + n]``, narrowing only the dims the block does not cover whole."""
    t = t if nb == t.shape[0] else t.narrow(0, b0, nb)
    return t if n == t.shape[1] else t.narrow(1, s0, n)


def _pairs(y: torch.Tensor, rotary_start: int, rotary_dim: int, neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) views of the rotary part of ``y``'s last dim: halves for ``neox``, even/odd columns else."""
    half = rotary_dim // 2
    if neox:
        return y.narrow(-1, rotary_start, half), y.narrow(-1, rotary_start + half, half)
    rot = y.narrow(-1, rotary_start, rotary_dim)
    return rot[..., 0::2], rot[..., 1::2]
