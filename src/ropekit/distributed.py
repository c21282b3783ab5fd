"""Context parallelism: RoPE on sequence-sharded inputs, by the global position of every local token.

Long-context training shards each sequence over ``cp_size`` ranks. Two splits are in use:

* ``"contiguous"``: rank r holds tokens ``[r * L, (r + 1) * L)`` of every sequence (L = S / cp_size);
* ``"zigzag"`` (load-balanced, for causal attention): the sequence is cut into ``2 * cp_size`` chunks of L / 2
  tokens and rank r holds chunks r and ``2 * cp_size - 1 - r``, in that order -- TransformerEngine's
  ``cp_size``/``cp_rank`` semantics (its ``apply_rotary_pos_emb``), also used by Megatron and torchtitan.

For a rank's shard of a ``[B, S, ...]`` batch, :func:`cp_positions` gives the global position of each local
token; for a packed ``thd`` batch, :func:`cp_positions_packed` does so from the full batch's ``cu_seqlens`` (each
sequence split the same way). Both compute on the device without a host sync; pass the result as ``positions=``
to :func:`ropekit.apply_rope`. :func:`shard` / :func:`shard_packed` cut a full batch into one rank's shard, and
:func:`unshard` / :func:`unshard_packed` restore the order of shards gathered from every rank (e.g. after
``torch.distributed.all_gather``).

:func:`ropekit.apply_rope` also takes ``DTensor`` q and k (``torch.distributed.tensor``) that are replicated or
sharded along the batch, head or sequence dimension: it rotates each rank's local shard by the global positions of
its tokens and returns DTensors of the same placements, without communication (:func:`rotate_dtensor`). Per-token
positions ([B, S], multi-axis [A, B, S] or ``thd`` [A, T]) and tables are cut to each rank's tokens (the axis
dimension A is never sharded); tensor options may be plain tensors, replicated DTensors or, batch and sequence
first, DTensors sharded as q. A ``DTensor`` sequence shard is contiguous (``torch.chunk``); for a zigzag split,
shard with :func:`shard` and pass :func:`cp_positions` explicitly.

``torch.distributed`` is imported only when a DTensor is rotated.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from ropekit import _fastpath
from ropekit._spec import LAYOUTS, TENSOR_ARGS, Mode, RopeArgs

SPLITS = ("contiguous", "zigzag")

__all__ = ["SPLITS", "cp_positions", "cp_positions_packed", "shard", "shard_packed", "unshard", "unshard_packed",
           "rotate_dtensor"]


def _check_cp(cp_size, cp_rank, split: str) -> None:
    for name, value in (("cp_size", cp_size), ("cp_rank", cp_rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")
    if not isinstance(split, str) or split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def _check_offset(offset) -> None:
    """``offset`` (of :func:`cp_positions`): an int >= 0, or an integer tensor (kept on its device, not read)."""
    if isinstance(offset, Tensor):
        if offset.dtype.is_floating_point or offset.dtype.is_complex or offset.dtype == torch.bool:
            raise TypeError(f"offset must be an int or an integer tensor, got a {offset.dtype} tensor")
    elif isinstance(offset, torch.SymInt):  # traced with symbolic shapes: not read
        return
    elif not isinstance(offset, numbers.Integral) or isinstance(offset, bool):
        raise TypeError(f"offset must be an int (a KV-cache start), got {type(offset).__name__}")
    elif offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")


def _check_tensor_dim(x, dim) -> None:
    """``x`` is a tensor with a dimension ``dim`` (the sequence dimension of :func:`shard`)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim!r} is not a dimension of x (shape {tuple(x.shape)})")


def _chunks(cp_size: int, split: str) -> int:
    """How many equal chunks a sequence is cut into (one rank holds the whole sequence, whatever the split)."""
    return cp_size if split == "contiguous" or cp_size == 1 else 2 * cp_size


def _global_index(i: Tensor, length, cp_size: int, cp_rank: int, split: str) -> Tensor:
    """The index within its full sequence of local index ``i`` of a local sequence of ``length`` tokens (an int or
    a tensor like ``i``)."""
    if split == "contiguous" or cp_size == 1:
        return cp_rank * length + i
    half = length // 2
    return torch.where(i < half, cp_rank * half + i, cp_size * length - (cp_rank + 1) * half + (i - half))


def cp_positions(seqlen: int, cp_size: int, cp_rank: int, *, split: str = "zigzag", offset: int = 0,
                 device: torch.device | str | None = None) -> Tensor:
    """Global positions [seqlen] (int64) of the local tokens of rank ``cp_rank``'s shard of a ``[B, S, ...]`` batch,
    where ``seqlen`` = S / cp_size is the local sequence length and ``offset`` is added (a KV-cache start).

    The same for every batch row: pass ``positions=cp_positions(...)[None]`` ([1, S_local]) to
    :func:`ropekit.apply_rope`. ``"zigzag"`` needs an even ``seqlen`` (two chunks per rank)."""
    _check_cp(cp_size, cp_rank, split)
    if not isinstance(seqlen, int) or isinstance(seqlen, bool) or seqlen < 0:
        raise ValueError(f"seqlen (the local sequence length) must be an int >= 0, got {seqlen!r}")
    if split == "zigzag" and cp_size > 1 and seqlen % 2:
        raise ValueError(f"a zigzag shard holds two equal chunks: seqlen (local) must be even, got {seqlen}")
    _check_offset(offset)
    i = torch.arange(seqlen, dtype=torch.int64, device=device)
    return _global_index(i, seqlen, cp_size, cp_rank, split) + offset


def _packed_layout(cu_seqlens: Tensor, cp_size: int, cp_rank: int, split: str, num_tokens: int):
    """(sequence index, index within the full sequence) of each of a rank's ``num_tokens`` packed tokens."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError("cu_seqlens must be an int32 or int64 tensor (the full batch's sequence boundaries)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [num_seqs + 1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device.type == "cpu":  # readable without a sync: check what the device path cannot
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        unit = _chunks(cp_size, split)
        if bool((lengths % unit != 0).any()) or bool((lengths < 0).any()):
            raise ValueError(f"every sequence length must be a multiple of {unit} for the {split} split over "
                             f"{cp_size} ranks (pad the sequences, as TransformerEngine's cu_seqlens_padded); got "
                             f"lengths {lengths.tolist()[:8]}")
        if int(cu_seqlens[-1]) != num_tokens * cp_size:
            raise ValueError(f"the local shard has {num_tokens} tokens but cu_seqlens describes "
                             f"{int(cu_seqlens[-1])} = {cp_size} x {int(cu_seqlens[-1]) / cp_size:g}")
    local_cu = cu_seqlens.to(torch.int64) // cp_size
    t = torch.arange(num_tokens, dtype=torch.int64, device=cu_seqlens.device)
    seq = torch.searchsorted(local_cu[1:], t, right=True).clamp_(max=cu_seqlens.numel() - 2)
    start = local_cu[seq]
    length = local_cu[seq + 1] - start
    return seq, _global_index(t - start, length, cp_size, cp_rank, split)


def cp_positions_packed(cu_seqlens: Tensor, cp_size: int, cp_rank: int, *, num_tokens: int,
                        split: str = "zigzag", offsets: Tensor | None = None) -> Tensor:
    """Global positions [num_tokens] (int64, on ``cu_seqlens``' device) of rank ``cp_rank``'s shard of a packed
    batch whose full boundaries are ``cu_seqlens`` [num_seqs + 1] (TransformerEngine's ``cu_seqlens`` with
    context parallelism: the padded lengths, each a multiple of ``cp_size``, of ``2 * cp_size`` for zigzag).

    Each sequence is split like a ``[1, S, ...]`` batch; ``num_tokens`` is the local shard's token count
    (``q.shape[0]``, so that nothing is read back from the device). ``offsets`` [num_seqs] are added per sequence.
    Pass the result as ``positions=`` with ``layout="thd"`` (and no ``cu_seqlens``: the positions say everything)."""
    _check_cp(cp_size, cp_rank, split)
    seq, pos = _packed_layout(cu_seqlens, cp_size, cp_rank, split, num_tokens)
    if offsets is not None:
        if not isinstance(offsets, Tensor) or offsets.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"offsets must be an int32 or int64 tensor [num_seqs], one per sequence, got "
                            f"{offsets.dtype if isinstance(offsets, Tensor) else type(offsets).__name__}")
        if tuple(offsets.shape) != (cu_seqlens.numel() - 1,):
            raise ValueError(f"offsets must be [{cu_seqlens.numel() - 1}] (one per sequence of cu_seqlens), got "
                             f"shape {tuple(offsets.shape)}")
        pos = pos + offsets.to(torch.int64)[seq]
    return pos


def shard(x: Tensor, cp_size: int, cp_rank: int, *, split: str = "zigzag", dim: int = 1) -> Tensor:
    """Rank ``cp_rank``'s shard of a full batch ``x`` along its sequence dimension ``dim`` (1 for ``[B, S, ...]``,
    0 for ``[S, B, ...]``): a view for ``"contiguous"``, two chunks concatenated for ``"zigzag"``."""
    _check_cp(cp_size, cp_rank, split)
    _check_tensor_dim(x, dim)
    size = x.shape[dim]
    unit = _chunks(cp_size, split)
    if size % unit:
        raise ValueError(f"the sequence dimension ({size}) must be a multiple of {unit} for the {split} split over "
                         f"{cp_size} ranks")
    chunk = size // unit
    if split == "contiguous" or cp_size == 1:
        return x.narrow(dim, cp_rank * chunk, chunk)
    return torch.cat((x.narrow(dim, cp_rank * chunk, chunk), x.narrow(dim, (unit - 1 - cp_rank) * chunk, chunk)),
                     dim)


def _check_shards(shards) -> list[Tensor]:
    """``shards`` as a list of tensors, one per rank; raises naming the argument otherwise."""
    if isinstance(shards, Tensor) or not isinstance(shards, Sequence):
        raise TypeError(f"shards must be a list or tuple of tensors, one per rank in rank order (as all_gather "
                        f"fills), got {type(shards).__name__}")
    shards = list(shards)
    if not shards:
        raise ValueError("shards must hold one tensor per rank, got none")
    for r, part in enumerate(shards):
        if not isinstance(part, Tensor):
            raise TypeError(f"shards[{r}] must be a tensor, got {type(part).__name__}")
    return shards


def unshard(shards: Sequence[Tensor], *, split: str = "zigzag", dim: int = 1) -> Tensor:
    """The full batch from every rank's shard (in rank order, e.g. from ``all_gather``): the inverse of
    :func:`shard`. Differentiable. Every shard has the same length along ``dim`` (an even one for ``"zigzag"``
    over several ranks), as :func:`shard` cuts them."""
    shards = _check_shards(shards)
    cp_size = len(shards)
    _check_cp(cp_size, 0, split)
    sizes = [part.shape[dim] if -part.dim() <= dim < part.dim() else None for part in shards]
    for r, size in enumerate(sizes):
        if size is None:
            raise ValueError(f"dim={dim} is out of range for shards[{r}] of shape {tuple(shards[r].shape)}")
        if size != sizes[0]:
            raise ValueError(f"every rank's shard has the same length along dim={dim}: shards[0] has {sizes[0]}, "
                             f"shards[{r}] has {size}")
    if split == "zigzag" and cp_size > 1 and sizes[0] % 2:
        raise ValueError(f"a zigzag shard holds two equal chunks: its length along dim={dim} must be even, got "
                         f"{sizes[0]}")
    if split == "contiguous" or cp_size == 1:
        return torch.cat(list(shards), dim)
    halves = [s.chunk(2, dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def _packed_index(cu_seqlens: Tensor, cp_size: int, cp_rank: int, split: str, num_tokens: int) -> Tensor:
    """Index into the full packed batch of each of a rank's tokens."""
    seq, pos = _packed_layout(cu_seqlens, cp_size, cp_rank, split, num_tokens)
    return cu_seqlens.to(torch.int64)[seq] + pos


def shard_packed(x: Tensor, cu_seqlens: Tensor, cp_size: int, cp_rank: int, *, split: str = "zigzag") -> Tensor:
    """Rank ``cp_rank``'s shard [T / cp_size, ...] of a full packed batch ``x`` [T, ...] with boundaries
    ``cu_seqlens``: every sequence split as :func:`shard` splits one, the rank's pieces packed in sequence
    order (TransformerEngine's ``thd`` context-parallel layout). Computed on the device (no host sync)."""
    _check_cp(cp_size, cp_rank, split)
    _check_tensor_dim(x, 0)
    if x.shape[0] % cp_size:
        raise ValueError(f"the packed token count ({x.shape[0]}) must be a multiple of cp_size={cp_size}")
    index = _packed_index(cu_seqlens.to(x.device), cp_size, cp_rank, split, x.shape[0] // cp_size)
    return x.index_select(0, index)


def unshard_packed(shards: Sequence[Tensor], cu_seqlens: Tensor, *, split: str = "zigzag") -> Tensor:
    """The full packed batch from every rank's :func:`shard_packed` shard (in rank order). Differentiable."""
    shards = _check_shards(shards)
    cp_size = len(shards)
    _check_cp(cp_size, 0, split)
    first = shards[0]
    full = first.new_zeros((first.shape[0] * cp_size, *first.shape[1:]))
    cu = cu_seqlens.to(first.device)
    for rank, part in enumerate(shards):
        full = full.index_copy(0, _packed_index(cu, cp_size, rank, split, part.shape[0]), part)
    return full


# --------------------------------------------------------------------------------------------------- DTensor

# Which logical dimension each tensor dimension is, per layout.
_DIMS = {"bshd": ("batch", "seq", "head", "dim"), "bhsd": ("batch", "head", "seq", "dim"),
         "sbhd": ("seq", "batch", "head", "dim"), "thd": ("seq", "head", "dim")}


def is_dtensor(x) -> bool:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor`` (without importing torch.distributed)."""
    return type(x).__name__ == "DTensor" and hasattr(x, "device_mesh") and hasattr(x, "placements")


def _shard_ranges(x, logical: tuple) -> dict:
    """{logical dim: (start, length)} of this rank's piece of DTensor ``x`` along each sharded logical dim; raises
    for placements that a local rotation cannot serve."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = x.device_mesh
    ranges = {}
    for mesh_dim, placement in enumerate(x.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard):
            raise ValueError(f"apply_rope on a DTensor takes Replicate or Shard placements, got {placement} (reduce "
                             "a Partial tensor first)")
        name = logical[placement.dim % len(logical)]
        if name == "dim":
            raise ValueError("apply_rope on a DTensor cannot rotate a tensor sharded along head_dim: each rotation "
                             "pair needs both of its columns (shard along batch, heads or sequence)")
        if name in ranges:
            raise ValueError(f"apply_rope on a DTensor takes one mesh dimension per sharded tensor dimension; {name} "
                             "is sharded over several")
        size = x.shape[placement.dim]
        n, coordinate = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
        chunk = -(-size // n)  # torch.chunk's split, as DTensor's Shard uses
        start = min(coordinate * chunk, size)
        ranges[name] = (start, min(chunk, size - start))
    return ranges


def _local_argument(name: str, value, layout: str, ranges: dict, placements, multi_axis: bool = False):
    """A tensor option of a DTensor call as the local rotation needs it (``multi_axis``: the call has sections)."""
    if is_dtensor(value):
        if all(type(p).__name__ == "Replicate" for p in value.placements):
            return value.to_local()
        if name == "positions" and multi_axis:
            raise ValueError(f"positions are multi-axis (sections=) and a DTensor with placements {value.placements}; "
                             "their axis dimension comes first, so pass them replicated or as a plain tensor")
        if (tuple(value.placements) == tuple(placements) and layout in ("bshd", "thd")
                and name in ("cos", "sin", "angles", "positions")):
            return value.to_local()  # sharded the way q is, batch and sequence first: its piece lines up with q's
        raise ValueError(f"{name} is a DTensor with placements {value.placements}; pass it replicated, sharded as q "
                         f"({placements}), or as a plain tensor")
    return value


def rotate_dtensor(q, k, mode: Mode, args: RopeArgs):
    """:func:`ropekit.apply_rope` (and ``apply_rope_``, ``rope_backward``) on ``DTensor`` q and k: each rank rotates
    its local shard by the global positions of its tokens; the outputs are DTensors of q's and k's placements. No
    communication. In place, q's and k's local tensors are rotated in their own memory."""
    from torch.distributed.tensor import DTensor

    if k is not None and (not is_dtensor(k) or k.device_mesh != q.device_mesh or k.placements != q.placements):
        raise ValueError("with a DTensor q, k must be a DTensor on the same mesh with the same placements")
    layout = args.layout
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if q.dim() != len(_DIMS[layout]):
        raise ValueError(f"{mode.names[0]} must have {len(_DIMS[layout])} dims for layout {layout!r}, got shape "
                         f"{tuple(q.shape)}")
    ranges = _shard_ranges(q, _DIMS[layout])
    local = args._asdict()  # this rank's arguments, filled in below
    pieces = set()  # the arguments that arrived as DTensors sharded as q: already this rank's piece
    for name in TENSOR_ARGS:
        value = getattr(args, name)
        local[name] = _local_argument(name, value, layout, ranges, q.placements,
                                      multi_axis=args.sections is not None)
        if is_dtensor(value) and not all(type(p).__name__ == "Replicate" for p in value.placements):
            pieces.add(name)
    if "seq" in ranges or "batch" in ranges:
        _localise_positions(local, layout, ranges, pieces)
    q_local = q.to_local()
    k_local = None if k is None else k.to_local()
    outs = _fastpath.rotate(q_local, k_local, mode, RopeArgs(**local))
    if mode.inplace:
        return q if k is None else (q, k)
    outs = (outs,) if k is None else outs

    def wrap(out: Tensor, like) -> DTensor:
        stride = torch.empty(like.shape, device="meta").stride()  # the outputs are contiguous
        return DTensor.from_local(out, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                  stride=stride)

    wrapped = [wrap(out, x) for out, x in zip(outs, (q, k))]
    return wrapped[0] if k is None else tuple(wrapped)


def _localise_positions(local: dict, layout: str, ranges: dict, pieces: set) -> None:
    """Turn the call's positions and per-token tables (in ``local``: plain tensors, or DTensors' local tensors)
    into those of this rank's tokens: a contiguous sequence shard starting at token ``start`` holds positions
    ``start + s_local`` (plus any offsets). The options named in ``pieces`` are already this rank's piece."""
    if local["cu_seqlens"] is not None and "seq" in ranges:
        raise ValueError("apply_rope on a DTensor sharded along packed tokens does not take cu_seqlens: compute the "
                         "tokens' positions with ropekit.distributed.cp_positions_packed and pass positions=")
    start, length = ranges.get("seq", (0, None))
    b0, blen = ranges.get("batch", (0, None))

    def per_token(t: Tensor, seq_dim: int, batch: bool) -> Tensor:
        """The local piece of a per-token argument (a batch dimension just before ``seq_dim`` where ``batch``, 1
        broadcasts)."""
        if batch and blen is not None and t.shape[seq_dim - 1] != 1:
            t = t.narrow(seq_dim - 1, b0, blen)
        return t.narrow(seq_dim, start, length) if length is not None else t

    per_token_tables = False
    for name in ("cos", "sin", "angles"):  # [B|1, S, W] tables gathered per token follow the tokens
        t = local[name]
        if isinstance(t, Tensor) and t.dim() == 3:
            per_token_tables = True
            if name not in pieces:
                local[name] = per_token(t, 1, batch=True)
    positions = local["positions"]
    if positions is None or (isinstance(positions, int) and not isinstance(positions, bool)):
        if "seq" in ranges and not per_token_tables:
            local["positions"] = (positions or 0) + start
    elif isinstance(positions, Tensor) and "positions" not in pieces:
        if local["sections"] is not None:  # multi-axis: [A, B|1, S] or (thd) [A, T]; the axes are never sharded
            if positions.dim() == 3 and layout != "thd":
                local["positions"] = per_token(positions, 2, batch=True)
            elif positions.dim() == 2 and layout == "thd":
                local["positions"] = per_token(positions, 1, batch=False)
            # any other shape: validate names it, against the local shapes
        elif positions.dim() == 1 and layout != "thd":  # [B] per-sequence offsets
            p = positions.narrow(0, b0, blen) if blen is not None else positions
            local["positions"] = p + start
        elif positions.dim() == 1:  # [T] per-token positions of packed tokens
            local["positions"] = per_token(positions, 0, batch=False)
        elif positions.dim() == 2:  # [B|1, S] per-token positions
            local["positions"] = per_token(positions, 1, batch=True)
