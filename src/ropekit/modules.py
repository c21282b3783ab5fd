"""``RotaryEmbedding``: a ``torch.nn.Module`` that rotates queries and keys through :func:`ropekit.apply_rope`.

It is built from a :class:`~ropekit.frequencies.RopeFrequencies`, a transformers config (object or dict), or a
rotary dimension plus :func:`~ropekit.frequencies.rope_frequencies` keywords. The kernel forms each angle from
the fp32 ``inv_freq`` and the integer position itself (in float64, reduced exactly), so the module never builds
a table, let alone a bf16 one.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ropekit._spec import LAYOUTS, layout_ndim, pair_axis_tensor, to_canonical
from ropekit.api import apply_rope
from ropekit.frequencies import RopeFrequencies, _integer, _length_arg, _positions_arg, from_hf_config, rope_frequencies

__all__ = ["RotaryEmbedding", "hf_tables"]


def hf_tables(positions: Tensor, inv_freq: Tensor, scale: float = 1.0, *, full: bool = True,
              dtype: torch.dtype = torch.float32, pair_axis: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin ``[*positions.shape, W]`` on ``positions``' device, times ``scale``: ``W = 2 * len(inv_freq)``
    in transformers' ``cat(angles, angles)`` layout when ``full``, else one column per pair.

    The angle ``position * inv_freq`` is formed in float64 (exact below 2**29 positions for float32
    ``inv_freq``) and its cos/sin taken in float64, then rounded once to ``dtype``. Multi-axis positions
    [A, *shape] with ``pair_axis`` [R/2] (M-RoPE) give tables ``[*shape, W]``: pair i turns by the position of
    axis ``pair_axis[i]``, the merged tables of transformers' vision-language rotary modules.
    """
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(positions.device, torch.float64)
    if pair_axis is not None:
        index = pair_axis.to(positions.device, torch.int64).expand(1, *angles.shape[1:])
        angles = angles.gather(0, index)[0]
    cos, sin = (torch.cos(angles) * scale).to(dtype), (torch.sin(angles) * scale).to(dtype)
    if full:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return cos, sin


class RotaryEmbedding(nn.Module):
    """Rotary position embedding of one attention layer (or of a whole model: it holds no per-layer state).

    Parameters
    ----------
    source : RopeFrequencies, transformers config, Mapping, or int
        The frequencies; a config goes through :func:`ropekit.from_hf_config` (``layer_type``/``style`` are
        forwarded), an int is a ``rotary_dim`` for :func:`ropekit.frequencies.rope_frequencies` (``**kwargs``
        forwarded: ``base``, ``rope_type``, ``factor``, ``freq_scale``, ...).

    Buffers
    -------
    inv_freq : float32 [rotary_dim // 2], not saved in the state dict: the set in force. ``dynamic`` and
        ``longrope`` replace it per call the way transformers' rotary module does (see :meth:`update`).

    A call's frequencies are a function of the call and of the state before it; the new state is stored (under
    a lock) only once the call succeeded, so a call that raises changes nothing and threads sharing a module each
    rotate with the frequencies their own call selected.

    Notes
    -----
    ``attention_scaling`` (YaRN, LongRoPE) multiplies cos and sin, as transformers applies it: the rotated
    columns are scaled, pass-through columns are not.
    """

    inv_freq: Tensor

    def __init__(self, source: RopeFrequencies | Mapping[str, Any] | Any | int, *, layer_type: str | None = None,
                 style: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        if isinstance(source, (bool, Tensor)) or not (isinstance(source, (RopeFrequencies, Mapping, numbers.Integral))
                                                      or hasattr(source, "__dict__")):
            raise TypeError("source must be a RopeFrequencies, a transformers config, a Mapping or an int rotary_dim, "
                            f"got {type(source).__name__}")
        if isinstance(source, RopeFrequencies):
            if layer_type is not None or style is not None or kwargs:
                raise ValueError("layer_type, style and frequency keywords apply to configs and ints, not to a "
                                 "RopeFrequencies (build it with the settings you want)")
            freqs = source
        elif isinstance(source, numbers.Integral):
            if layer_type is not None:
                raise ValueError("layer_type applies to configs only")
            freqs = rope_frequencies(source, style=style or "neox", **kwargs)
        else:
            if kwargs:
                raise ValueError(f"unexpected keywords {sorted(kwargs)} for a config source; only layer_type, "
                                 "style are read")
            freqs = from_hf_config(source, layer_type=layer_type, style=style)
        self._initial = freqs
        self._current = freqs
        # transformers' dynamic-NTK state: the largest length seen since the last reset
        self._cached_len = freqs.max_position_embeddings
        self.register_buffer("inv_freq", freqs.inv_freq.clone(), persistent=False)
        self._lock = threading.Lock()  # guards (_current, _cached_len, inv_freq) as one state

    def __getstate__(self) -> dict[str, Any]:  # a lock cannot be copied or pickled: a copy gets a new one
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._lock = threading.Lock()

    # ---- construction helpers ---------------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: Any, *, layer_type: str | None = None, style: str | None = None
                       ) -> RotaryEmbedding:
        """``RotaryEmbedding(config, layer_type=..., style=...)``."""
        return cls(config, layer_type=layer_type, style=style)

    # ---- properties ------------------------------------------------------------------------------------------

    @property
    def frequencies(self) -> RopeFrequencies:
        """The :class:`RopeFrequencies` in force (changes with the sequence length for dynamic/longrope)."""
        return self._current

    @property
    def max_seq_len_cached(self) -> int | None:
        """``dynamic``: the largest sequence length seen since the last reset (transformers' attribute)."""
        return self._cached_len

    @property
    def attention_scaling(self) -> float:
        return self._current.attention_scaling

    @property
    def rotary_dim(self) -> int:
        return self._current.rotary_dim

    @property
    def head_dim(self) -> int:
        return self._current.head_dim

    @property
    def style(self) -> str:
        return self._current.style

    def extra_repr(self) -> str:
        f = self._current
        return (f"rope_type={f.rope_type!r}, rotary_dim={f.rotary_dim}, head_dim={f.head_dim}, style={f.style!r}, "
                f"base={f.base}, attention_scaling={f.attention_scaling:.6g}")

    # ---- frequency selection ---------------------------------------------------------------------------------

    def update(self, seq_len: int) -> RopeFrequencies:
        """Select the frequencies for a call whose largest position is ``seq_len - 1``, as transformers'
        ``dynamic_rope_update`` does, store them as the state in force, and return them.

        * ``dynamic``: recomputed when ``seq_len`` exceeds the largest length seen so far (which starts at
          ``max_position_embeddings``); reset to the original set when a sequence shorter than
          ``max_position_embeddings`` follows a longer one. Lengths in between keep the grown set -- exactly
          transformers' behaviour, state included (and its values: the grown set is computed as transformers'
          module computes it, from a tensor length).
        * ``longrope``: long factors above ``original_max_position_embeddings``, short ones otherwise.
        * other types: nothing changes.
        """
        seq_len = _length_arg(seq_len, "seq_len")
        f, cached, inv = self._choose(seq_len if self._initial.is_dynamic else None, self.inv_freq.device)
        self._commit(f, cached, inv)
        return f

    def _next(self, f: RopeFrequencies, cached: int | None, seq_len: int) -> tuple[RopeFrequencies, int | None]:
        """transformers' transition: the set and the cached length after a call of length ``seq_len``, from the
        set ``f`` and cached length before it."""
        f0 = self._initial
        if f0.rope_type == "longrope":
            if seq_len <= f0.original_max_position_embeddings:
                return f0, cached
            return (f if f.seq_len is not None else f0.for_seq_len(seq_len)), cached
        original = f0.max_position_embeddings
        if seq_len > cached:  # growth; transformers' module passes the length as a tensor
            return f0.for_seq_len(torch.tensor(seq_len)), seq_len
        if seq_len < original and cached > original:  # reset
            return f0, original
        return f, cached

    def _choose(self, seq_len: int | None, device: torch.device) -> tuple[RopeFrequencies, int | None, Tensor]:
        """``(frequencies, cached length after the call, float32 inv_freq on device)`` for a call of length
        ``seq_len`` (None: keep the set in force). Reads the state once, changes nothing."""
        if self._initial.is_dynamic:
            with self._lock:
                f, cached, buf = self._current, self._cached_len, self.inv_freq
            new, cached = (f, cached) if seq_len is None else self._next(f, cached, seq_len)
        else:  # the set never changes: no lock (keeps torch.compile happy)
            new = f = self._current
            cached, buf = self._cached_len, self.inv_freq
        if new is f and buf.dtype == torch.float32 and buf.device == device:
            return new, cached, buf
        # a new set, another device, or a module-wide .to(dtype) cast the buffer: from the float32 values
        return new, cached, new.inv_freq.to(device)

    def _commit(self, f: RopeFrequencies, cached: int | None, inv: Tensor) -> None:
        """Store the state a successful call selected."""
        if f is self._current and cached == self._cached_len and inv is self.inv_freq:
            return
        with self._lock:
            self._current, self._cached_len = f, cached
            self.inv_freq = inv

    @staticmethod
    def seq_len_of(q: Tensor, positions: None | int | Tensor, layout: str,
                   cu_seqlens: Tensor | None = None) -> int:
        """The sequence length transformers would use for these positions: largest position + 1. Reads
        tensor values (a host sync for CUDA tensors)."""
        if not isinstance(q, Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        if layout not in LAYOUTS or q.dim() != layout_ndim(layout):
            raise ValueError(f"layout must be one of {LAYOUTS} and match q's dimensions, got layout {layout!r} for q "
                             f"of shape {tuple(q.shape)}")
        if cu_seqlens is not None and not isinstance(cu_seqlens, Tensor):
            raise TypeError(f"cu_seqlens must be None or an integer tensor, got {type(cu_seqlens).__name__}")
        if positions is not None and (isinstance(positions, bool) or not isinstance(positions, (numbers.Integral,
                                                                                                Tensor))):
            raise TypeError(f"positions must be None, an int offset or an integer tensor, got "
                            f"{type(positions).__name__}")
        B, S = to_canonical(q, layout).shape[:2]
        if isinstance(positions, Tensor):
            if positions.numel() == 0:
                return 0
            num_seqs = cu_seqlens.numel() - 1 if cu_seqlens is not None else B
            if positions.dim() == 1 and positions.shape[0] == num_seqs and (cu_seqlens is not None
                                                                            or layout != "thd"):
                lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(positions.device) if cu_seqlens is not None else S
                return int((positions.to(torch.int64) + lengths).max())  # per-sequence offset + length
            return int(positions.max()) + 1
        offset = 0 if positions is None else _integer(positions, "positions", arg=True, minimum=0)
        if cu_seqlens is not None and cu_seqlens.numel() > 1:
            return offset + int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return offset + S

    # ---- application -----------------------------------------------------------------------------------------

    def forward(self, q: Tensor, k: Tensor | None = None, *, positions: None | int | Tensor = None,
                layout: str = "bshd", cu_seqlens: Tensor | None = None, seq_len: int | None = None,
                q_scale: float = 1.0, k_scale: float = 1.0) -> Tensor | tuple[Tensor, Tensor]:
        """Rotate ``q`` (and ``k``); returns new tensors like :func:`ropekit.apply_rope`.

        Parameters
        ----------
        q, k : Tensor
            In ``layout`` (``"bshd"`` [B, S, H, D], ``"bhsd"``, ``"sbhd"``, ``"thd"`` [T, H, D]); head_dim may
            exceed ``rotary_dim`` (the tail passes through). Gradients flow to both.
        positions : None, int or Tensor
            As for :func:`ropekit.apply_rope`: None (0..S-1), an int offset, [B] offsets, or per-token ids; for a
            multi-axis (M-RoPE) embedding, [A, B, S] ids (``thd``: [A, T]), one row per axis.
        cu_seqlens : Tensor, optional
            Packed-sequence boundaries for ``layout="thd"``.
        seq_len : int, optional
            For ``dynamic``/``longrope``: the length that selects the frequencies (default: largest position
            + 1, read from ``positions`` -- a host sync on CUDA; pass it to avoid one). Ignored otherwise.
        q_scale, k_scale : float
            Multiply the whole output of q / k.
        """
        if not isinstance(q, Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        n = None
        if self._initial.is_dynamic:
            n = self.seq_len_of(q, positions, layout, cu_seqlens) if seq_len is None else _length_arg(seq_len,
                                                                                                      "seq_len")
        f, cached, inv = self._choose(n, q.device)
        if q.dim() and q.shape[-1] < f.rotary_dim:
            raise ValueError(f"q head_dim {q.shape[-1]} is smaller than this embedding's rotary_dim {f.rotary_dim}")
        multi_axis = {} if f.sections is None else dict(sections=f.sections, section_layout=f.section_layout)
        out = apply_rope(q, k, positions=positions, inv_freq=inv, style=f.style, layout=layout,
                         rotary_dim=f.rotary_dim, rotary_at=f.rotary_at, rotary_scale=float(f.attention_scaling),
                         q_scale=q_scale, k_scale=k_scale, cu_seqlens=cu_seqlens, **multi_axis)
        self._commit(f, cached, inv)  # only now: a call that raised leaves the state as it was
        return out

    def cos_sin(self, positions: Tensor, dtype: torch.dtype = torch.float32, *, full: bool = True,
                seq_len: int | None = None) -> tuple[Tensor, Tensor]:
        """transformers-style ``(cos, sin)`` tables ``[*positions.shape, rotary_dim]`` on ``positions``' device,
        times ``attention_scaling``, for code that needs tables (``full=False``: one column per pair). A multi-axis
        (M-RoPE) embedding takes [A, *shape] positions and gives the merged ``[*shape, rotary_dim]`` tables of
        transformers' vision-language rotary modules.

        Like transformers' rotary module, a ``dynamic``/``longrope`` embedding first selects its frequencies
        from ``seq_len`` (default: ``positions.max() + 1``; empty positions keep the set in force). Values are
        computed in float64 and rounded once to ``dtype``; keep ``dtype=torch.float32`` for anything that feeds a
        rotation.
        """
        positions = _positions_arg(positions)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        n = None
        if self._initial.is_dynamic:
            if seq_len is not None:
                n = _length_arg(seq_len, "seq_len")
            elif positions.numel():
                n = int(positions.max()) + 1
        f, cached, inv = self._choose(n, positions.device)
        pair_axis = None
        if f.sections is not None:
            pair_axis = pair_axis_tensor(f.sections, f.section_layout, positions.device)
        tables = hf_tables(positions, inv, f.attention_scaling, full=full, dtype=dtype, pair_axis=pair_axis)
        self._commit(f, cached, inv)
        return tables
