"""Context parallelism (``ropekit.distributed``): positions of sharded tokens, sharding helpers, DTensor inputs, and
two-process runs (gloo on CPU; NCCL where two GPUs exist) that must equal the single-process result, and shards
rotated by replayed launch plans.

The position maps are checked against TransformerEngine's definition, written out here independently: a rank's
shard of a sequence of local length L over cp ranks takes the frequency rows ``[r*L/2, (r+1)*L/2)`` and
``[cp*L - (r+1)*L/2, cp*L - r*L/2)`` (zigzag), or ``[r*L, (r+1)*L)`` (contiguous).
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import traceback

import pytest
import torch

import ropekit
from helpers import KERNEL_ROUTES, on_route
from ropekit import distributed as cp
from ropekit.testing import assert_close_to_ref, kernels_on_cpu

SPLITS = cp.SPLITS
TIMEOUT_S = 240


def te_rows(local_len: int, cp_size: int, cp_rank: int, split: str) -> torch.Tensor:
    """The rows of a full-length table a rank's shard uses, as TransformerEngine slices them."""
    rows = torch.arange(cp_size * local_len)
    if split == "contiguous" or cp_size == 1:
        return rows[cp_rank * local_len:(cp_rank + 1) * local_len]
    seg = local_len // 2
    full = cp_size * local_len
    return torch.cat([rows[cp_rank * seg:(cp_rank + 1) * seg], rows[full - (cp_rank + 1) * seg:full - cp_rank * seg]])


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_positions_follow_transformer_engine(split, cp_size):
    local_len = 12
    for rank in range(cp_size):
        assert torch.equal(cp.cp_positions(local_len, cp_size, rank, split=split),
                           te_rows(local_len, cp_size, rank, split))
        assert torch.equal(cp.cp_positions(local_len, cp_size, rank, split=split, offset=100),
                           te_rows(local_len, cp_size, rank, split) + 100)
    # every position of the full sequence is held by exactly one rank
    held = torch.cat([cp.cp_positions(local_len, cp_size, r, split=split) for r in range(cp_size)])
    assert torch.equal(held.sort().values, torch.arange(cp_size * local_len))


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_packed_positions_and_shards_follow_each_sequence(split, cp_size):
    lengths = [8, 24, 16, 0, 32]  # multiples of 2 * cp_size (for 4 ranks: of 8); an empty sequence too
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    T = cu[-1].item()
    offsets = torch.tensor([5, 0, 70, 3, 1])
    x = torch.arange(T)
    shards = []
    for rank in range(cp_size):
        want_pos, want_idx = [], []
        for n, (start, length) in enumerate(zip(cu[:-1].tolist(), lengths)):
            rows = te_rows(length // cp_size, cp_size, rank, split) if length else torch.zeros(0, dtype=torch.long)
            want_pos.append(rows + offsets[n])
            want_idx.append(rows + start)
        got = cp.cp_positions_packed(cu, cp_size, rank, num_tokens=T // cp_size, split=split, offsets=offsets)
        assert torch.equal(got, torch.cat(want_pos))
        part = cp.shard_packed(x, cu, cp_size, rank, split=split)
        assert torch.equal(part, torch.cat(want_idx))
        shards.append(part)
    assert torch.equal(cp.unshard_packed(shards, cu, split=split), x)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("dim", [0, 1])
def test_shard_unshard_round_trip(split, dim):
    x = torch.randn(16, 24, 3)
    for cp_size in (1, 2, 4):
        shards = [cp.shard(x, cp_size, r, split=split, dim=dim) for r in range(cp_size)]
        for r, s in enumerate(shards):
            rows = te_rows(x.shape[dim] // cp_size, cp_size, r, split)
            assert torch.equal(s, x.index_select(dim, rows))
        assert torch.equal(cp.unshard(shards, split=split, dim=dim), x)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="cp_rank"):
        cp.cp_positions(8, 2, 2)
    with pytest.raises(ValueError, match="cp_size"):
        cp.cp_positions(8, 0, 0)
    with pytest.raises(ValueError, match="split"):
        cp.cp_positions(8, 2, 0, split="ring")
    with pytest.raises(TypeError, match="cp_rank"):
        cp.cp_positions(8, 2, 1.0)
    with pytest.raises(ValueError, match="even"):
        cp.cp_positions(7, 2, 0)
    with pytest.raises(ValueError, match="multiple of 4"):
        cp.shard(torch.zeros(1, 10), 2, 0)
    with pytest.raises(ValueError, match="multiple of 4"):
        cp.cp_positions_packed(torch.tensor([0, 6, 12]), 2, 0, num_tokens=6)
    with pytest.raises(ValueError, match="local shard has 5 tokens"):
        cp.cp_positions_packed(torch.tensor([0, 8, 16]), 2, 0, num_tokens=5)


def test_offsets_and_inputs_are_checked_by_name():
    with pytest.raises(ValueError, match="offset"):
        cp.cp_positions(4, 2, 0, offset=-3)
    for bad in (2.5, True, "1"):
        with pytest.raises(TypeError, match="offset"):
            cp.cp_positions(4, 2, 0, offset=bad)
    with pytest.raises(TypeError, match="offset"):
        cp.cp_positions(4, 2, 0, offset=torch.tensor(1.0))
    # an integer tensor offset (a KV-cache start kept on the device) is added as it is
    assert torch.equal(cp.cp_positions(4, 2, 1, offset=torch.tensor(5)), cp.cp_positions(4, 2, 1, offset=5))
    cu = torch.tensor([0, 8, 16])
    with pytest.raises(ValueError, match=r"offsets.*\[2\]"):
        cp.cp_positions_packed(cu, 2, 0, num_tokens=8, offsets=torch.tensor([1]))
    with pytest.raises(TypeError, match="offsets"):
        cp.cp_positions_packed(cu, 2, 0, num_tokens=8, offsets=torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="offsets"):
        cp.cp_positions_packed(cu, 2, 0, num_tokens=8, offsets=[1, 2])
    with pytest.raises(ValueError, match="dim=2"):
        cp.shard(torch.zeros(2, 8), 2, 0, dim=2)
    with pytest.raises(TypeError, match="x must be a tensor"):
        cp.shard([1, 2, 3, 4], 2, 0, dim=0)
    with pytest.raises(TypeError, match="x must be a tensor"):
        cp.shard_packed([1, 2, 3, 4], cu, 2, 0)


def test_unshard_refuses_what_shard_cannot_produce():
    """unshard takes a list of per-rank shards of equal length along ``dim`` (even, for zigzag: two equal
    chunks); anything else would be reassembled in a wrong order without a word."""
    x = torch.randn(2, 12, 3)
    shards = [cp.shard(x, 2, r) for r in range(2)]
    for bad in (x, shards[0]):  # a tensor, not a list of shards
        with pytest.raises(TypeError, match="shards"):
            cp.unshard(bad)
        with pytest.raises(TypeError, match="shards"):
            cp.unshard_packed(bad, torch.tensor([0, 12]))
    with pytest.raises(TypeError, match=r"shards\[1\]"):
        cp.unshard([shards[0], shards[1].numpy()])
    with pytest.raises(ValueError, match="shards"):
        cp.unshard([])
    with pytest.raises(ValueError, match="shards"):
        cp.unshard_packed([], torch.tensor([0, 12]))
    with pytest.raises(ValueError, match="even"):  # zigzag shards of 3: not two equal chunks
        cp.unshard([torch.randn(2, 3, 3), torch.randn(2, 3, 3)])
    for split in SPLITS:
        with pytest.raises(ValueError, match=r"shards\[1\] has 6"):
            cp.unshard([torch.randn(2, 4, 3), torch.randn(2, 6, 3)], split=split)
        with pytest.raises(ValueError, match=r"shards\[1\] has 6"):
            cp.unshard([torch.randn(4, 2), torch.randn(6, 2)], split=split, dim=0)
    # what shard produces still round-trips, a one-rank zigzag of odd length too
    assert torch.equal(cp.unshard(shards), x)
    assert torch.equal(cp.unshard(tuple(cp.shard(x, 3, r, split="contiguous") for r in range(3)),
                                  split="contiguous"), x)
    odd = torch.randn(2, 5, 3)  # one rank holds the whole sequence, whatever its length (as cp_positions allows)
    assert torch.equal(cp.shard(odd, 1, 0), odd)
    assert torch.equal(cp.unshard([cp.shard(odd, 1, 0)]), odd)
    packed, cu = torch.randn(8, 3), torch.tensor([0, 3, 8])
    assert torch.equal(cp.shard_packed(packed, cu, 1, 0), packed)
    assert torch.equal(cp.cp_positions_packed(cu, 1, 0, num_tokens=8), torch.tensor([0, 1, 2, 0, 1, 2, 3, 4]))
    assert torch.equal(cp.unshard_packed([packed], cu), packed)


def test_rotating_a_shard_by_its_positions_equals_the_full_rotation():
    """Single process: the shard of a rotation is the rotation of the shard by cp_positions (the identity the
    distributed tests rely on), bshd and thd, both splits."""
    q = torch.randn(2, 16, 4, 32)
    full = ropekit.apply_rope(q, base=500000.0)
    cu = torch.tensor([0, 8, 24, 40])
    packed = torch.randn(40, 4, 32)
    full_packed = ropekit.apply_rope(packed, layout="thd", cu_seqlens=cu)
    for split in SPLITS:
        for rank in range(2):
            pos = cp.cp_positions(8, 2, rank, split=split)
            got = ropekit.apply_rope(cp.shard(q, 2, rank, split=split), positions=pos[None], base=500000.0)
            assert torch.equal(got, cp.shard(full, 2, rank, split=split))
            pos = cp.cp_positions_packed(cu, 2, rank, num_tokens=20, split=split)
            got = ropekit.apply_rope(cp.shard_packed(packed, cu, 2, rank, split=split), layout="thd", positions=pos)
            assert torch.equal(got, cp.shard_packed(full_packed, cu, 2, rank, split=split))


@pytest.mark.parametrize("route", KERNEL_ROUTES)
@pytest.mark.parametrize("split", SPLITS)
def test_shard_rotations_replayed_by_launch_plans_equal_the_full_rotation(route, split, plan_calls):
    """Single process, on the kernels (the interpreter on CPU, CUDA): every rank's shard rotated by its cp_positions,
    bshd and thd, call after call with fresh data, so that launch plans record and replay the shards' signatures
    (the ranks share them); outputs and gradients equal the shards of the float64 rotation of the full batch."""
    world, B, S, H, D = 2, 2, 16, 4, 32
    cu = torch.tensor([0, 8, 24, 40])
    T = 40
    calls = []
    for _call in range(2):  # fresh data per call; the float64 CPU path of the full batch is the reference
        q_full, g_full = torch.randn(B, S, H, D, dtype=torch.float64), torch.randn(B, S, H, D, dtype=torch.float64)
        p_full, pg_full = torch.randn(T, H, D, dtype=torch.float64), torch.randn(T, H, D, dtype=torch.float64)
        leaf = q_full.clone().requires_grad_(True)
        want_q = ropekit.apply_rope(leaf, base=500000.0)
        (want_dq,) = torch.autograd.grad(want_q, leaf, g_full)
        leaf = p_full.clone().requires_grad_(True)
        want_p = ropekit.apply_rope(leaf, layout="thd", cu_seqlens=cu)
        (want_dp,) = torch.autograd.grad(want_p, leaf, pg_full)
        calls.append((q_full, g_full, want_q.detach(), want_dq, p_full, pg_full, want_p.detach(), want_dp))
    with on_route(route, clear_plans=True) as device:
        for q_full, g_full, want_q, want_dq, p_full, pg_full, want_p, want_dp in calls:
            for rank in range(world):
                local = cp.shard(q_full, world, rank, split=split).to(device, torch.float32).requires_grad_(True)
                pos = cp.cp_positions(S // world, world, rank, split=split, device=device)
                got = ropekit.apply_rope(local, positions=pos[None], base=500000.0)
                g = cp.shard(g_full, world, rank, split=split).to(device, torch.float32)
                (dq,) = torch.autograd.grad(got, local, g)
                assert_close_to_ref(got, cp.shard(want_q, world, rank, split=split), torch.float32)
                assert_close_to_ref(dq, cp.shard(want_dq, world, rank, split=split), torch.float32)
                local = cp.shard_packed(p_full, cu, world, rank, split=split).to(device, torch.float32)
                local.requires_grad_(True)
                pos = cp.cp_positions_packed(cu.to(device), world, rank, num_tokens=T // world, split=split)
                got = ropekit.apply_rope(local, layout="thd", positions=pos)
                g = cp.shard_packed(pg_full, cu, world, rank, split=split).to(device, torch.float32)
                (dp,) = torch.autograd.grad(got, local, g)
                assert_close_to_ref(got, cp.shard_packed(want_p, cu, world, rank, split=split), torch.float32)
                assert_close_to_ref(dp, cp.shard_packed(want_dp, cu, world, rank, split=split), torch.float32)
    assert plan_calls["served"] >= 4  # each signature: noted on the first call, recorded on the second, then replayed


# --------------------------------------------------------------------------------------------- two processes


def _run_workers(check: str, backend: str, world_size: int = 2) -> None:
    """Run ``_worker(check)`` in ``world_size`` fresh processes joined in one process group; fail with the first
    worker's traceback, if a worker never reports, or after TIMEOUT_S."""
    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        errors = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(rank, world_size, backend, store, check, errors))
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(TIMEOUT_S)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        reports = {}
        while not errors.empty():
            rank, failure = errors.get()
            reports[rank] = failure
        assert not alive, f"{check}: workers still running after {TIMEOUT_S} s"
        failures = [f"rank {rank}: {failure}" for rank, failure in sorted(reports.items()) if failure]
        assert not failures, failures[0]
        assert sorted(reports) == list(range(world_size)), (
            f"{check}: only ranks {sorted(reports)} reported; exit codes {[p.exitcode for p in procs]}")


def _worker(rank: int, world_size: int, backend: str, store: str, check: str, errors) -> None:
    import torch.distributed as dist

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size)
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        CHECKS[check](rank, world_size, device)
        dist.barrier()  # no rank tears the group down while another still uses it
        dist.destroy_process_group()
    except BaseException:  # report every failure, assertion or not, with where it happened
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1) from None
    errors.put((rank, None))
    errors.close()
    errors.join_thread()  # the report is written before the process leaves
    # Leave without the interpreter's teardown: gloo's threads occasionally abort the process there ("terminate
    # called without an active exception") after everything above has passed.
    os._exit(0)


def _gathered(x: torch.Tensor) -> list[torch.Tensor]:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return parts


def _close(got, want, what, dtype=torch.float32):
    tol = dict(rtol=0, atol=0) if got.device.type == "cpu" and dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")


def _check_shards(rank: int, world: int, device: torch.device) -> None:
    """Every split, bshd and thd, forward and backward: each rank's rotation of its shard by its global positions
    equals the shard of the single-process rotation, and the gathered shards restore it."""
    gen = torch.Generator().manual_seed(1234)  # the same full batch on every rank
    B, S, HQ, HK, D = 2, 8 * world, 4, 2, 32
    q_full = torch.randn(B, S, HQ, D, generator=gen).to(device)
    k_full = torch.randn(B, S, HK, D, generator=gen).to(device)
    g_full = torch.randn(B, S, HQ, D, generator=gen).to(device)
    lengths = [4 * world, 12 * world, 8 * world]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    T = int(sum(lengths))
    p_full = torch.randn(T, HQ, D, generator=gen).to(device)
    pg_full = torch.randn(T, HQ, D, generator=gen).to(device)
    kernel_modes = [False] + ([True] if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" else [])
    for kernels in kernel_modes:
        with kernels_on_cpu() if kernels else contextlib.nullcontext():
            for split in SPLITS:
                what = f"{split}{' (kernels)' if kernels else ''}"
                # bshd: full rotation in this process, with autograd
                leaf = q_full.clone().requires_grad_(True)
                want_q, want_k = ropekit.apply_rope(leaf, k_full, base=500000.0)
                (want_dq,) = torch.autograd.grad(want_q, leaf, g_full)
                local_q = cp.shard(q_full, world, rank, split=split).clone().requires_grad_(True)
                local_k = cp.shard(k_full, world, rank, split=split)
                pos = cp.cp_positions(S // world, world, rank, split=split, device=device)
                got_q, got_k = ropekit.apply_rope(local_q, local_k, positions=pos[None], base=500000.0)
                _close(got_q, cp.shard(want_q.detach(), world, rank, split=split), f"bshd q {what}")
                _close(got_k, cp.shard(want_k, world, rank, split=split), f"bshd k {what}")
                (dq,) = torch.autograd.grad(got_q, local_q, cp.shard(g_full, world, rank, split=split))
                _close(dq, cp.shard(want_dq, world, rank, split=split), f"bshd dq {what}")
                _close(cp.unshard(_gathered(got_q.detach()), split=split), want_q.detach(), f"bshd gathered {what}")
                # thd: packed sequences, each split the same way
                leaf = p_full.clone().requires_grad_(True)
                want = ropekit.apply_rope(leaf, layout="thd", cu_seqlens=cu)
                (want_dp,) = torch.autograd.grad(want, leaf, pg_full)
                local = cp.shard_packed(p_full, cu, world, rank, split=split).requires_grad_(True)
                pos = cp.cp_positions_packed(cu, world, rank, num_tokens=T // world, split=split)
                got = ropekit.apply_rope(local, layout="thd", positions=pos)
                _close(got, cp.shard_packed(want.detach(), cu, world, rank, split=split), f"thd {what}")
                (dp,) = torch.autograd.grad(got, local, cp.shard_packed(pg_full, cu, world, rank, split=split))
                _close(dp, cp.shard_packed(want_dp, cu, world, rank, split=split), f"thd grad {what}")
                _close(cp.unshard_packed(_gathered(got.detach()), cu, split=split), want.detach(),
                       f"thd gathered {what}")


def _check_dtensor(rank: int, world: int, device: torch.device) -> None:
    """DTensor q and k sharded along the sequence, the batch or the heads, or replicated: the rotation is a DTensor
    of the same placements whose full tensor (and gradient) equals the single-process one; in place too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (world,))
    gen = torch.Generator().manual_seed(99)
    B, S, HQ, HK, D = 2 * world, 6 * world + 1, 2 * world, world, 16  # a sequence that does not split evenly
    q_full = torch.randn(B, S, HQ, D, generator=gen).to(device)
    k_full = torch.randn(B, S, HK, D, generator=gen).to(device)
    g_full = torch.randn(B, S, HQ, D, generator=gen).to(device)
    ids = torch.randint(0, 10_000, (B, S), generator=gen).to(device)
    table = torch.randn(S + 40, D // 2, generator=gen).to(device)
    angle = torch.rand(B, S, D // 2, generator=gen).to(device) * 6
    rows_cos, rows_sin = angle.cos(), angle.sin()  # [B, S, W] rows gathered per token
    cases = [
        ("bshd", [Shard(1)], dict(positions=None)),
        ("bshd", [Shard(1)], dict(positions=17)),
        ("bshd", [Shard(1)], dict(positions=ids)),
        ("bshd", [Shard(1)], dict(positions=torch.arange(B, device=device) * 3)),
        ("bshd", [Shard(1)], dict(positions=5, cos=table, sin=table.flip(0))),
        ("bshd", [Shard(0)], dict(positions=torch.arange(B, device=device) * 3)),
        ("bshd", [Shard(0)], dict(positions=ids, style="interleaved")),
        ("bshd", [Shard(2)], dict(positions=ids)),
        ("bshd", [Replicate()], dict(positions=ids, q_scale=0.5)),
        ("bhsd", [Shard(2)], dict(positions=ids)),
        ("sbhd", [Shard(0)], dict(positions=9)),
        # options that are DTensors themselves: replicated, or per-token rows sharded as q
        ("bshd", [Shard(1)], dict(positions=distribute_tensor(ids, mesh, [Replicate()]))),
        ("bshd", [Shard(0)], dict(positions=distribute_tensor(ids, mesh, [Replicate()]))),
        ("bshd", [Shard(1)], dict(cos=distribute_tensor(rows_cos, mesh, [Shard(1)]),
                                  sin=distribute_tensor(rows_sin, mesh, [Shard(1)]))),
        ("bshd", [Shard(1)], dict(cos=distribute_tensor(rows_cos, mesh, [Replicate()]),
                                  sin=distribute_tensor(rows_sin, mesh, [Replicate()]))),
    ]
    perm = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3)}
    for i, (layout, placements, kwargs) in enumerate(cases):
        what = f"case {i}: {layout} {placements} {sorted(kwargs)}"
        qf = q_full.permute(perm[layout]).contiguous()
        kf = k_full.permute(perm[layout]).contiguous()
        gf = g_full.permute(perm[layout]).contiguous()
        leaf = qf.clone().requires_grad_(True)
        plain = {n: v.full_tensor() if type(v).__name__ == "DTensor" else v for n, v in kwargs.items()}
        want_q, want_k = ropekit.apply_rope(leaf, kf, layout=layout, **plain)
        (want_dq,) = torch.autograd.grad(want_q, leaf, gf)
        qd = distribute_tensor(qf, mesh, placements).requires_grad_(True)
        kd = distribute_tensor(kf, mesh, placements)
        got_q, got_k = ropekit.apply_rope(qd, kd, layout=layout, **kwargs)
        assert type(got_q).__name__ == "DTensor" and got_q.placements == qd.placements, what
        _close(got_q.full_tensor(), want_q.detach(), f"q {what}")
        _close(got_k.full_tensor(), want_k, f"k {what}")
        (dq,) = torch.autograd.grad(got_q, qd, distribute_tensor(gf, mesh, placements))
        _close(dq.full_tensor(), want_dq, f"dq {what}")
        with torch.no_grad():  # in place: the local shards are rotated in their own memory
            qi, ki = distribute_tensor(qf, mesh, placements), distribute_tensor(kf, mesh, placements)
            out_q, out_k = ropekit.apply_rope_(qi, ki, layout=layout, **kwargs)
            assert out_q is qi and out_k is ki
            _close(qi.full_tensor(), want_q.detach(), f"in place q {what}")
    with pytest.raises(ValueError, match="head_dim"):
        ropekit.apply_rope(distribute_tensor(q_full, mesh, [Shard(3)]))
    # torch.compile traces the DTensor route: the same values and gradients (one output: a compiled function
    # whose unused DTensor outputs get no gradient needs them detached)
    step = torch.compile(lambda q, k: ropekit.apply_rope(q, k, positions=ids)[0], backend="aot_eager",
                         fullgraph=True)
    leaf = q_full.clone().requires_grad_(True)
    want_q, _ = ropekit.apply_rope(leaf, k_full, positions=ids)
    (want_dq,) = torch.autograd.grad(want_q, leaf, g_full)
    qd = distribute_tensor(q_full, mesh, [Shard(1)]).requires_grad_(True)
    got_q = step(qd, distribute_tensor(k_full, mesh, [Shard(1)]))
    _close(got_q.full_tensor(), want_q.detach(), "compiled q")
    (dq,) = torch.autograd.grad(got_q, qd, distribute_tensor(g_full, mesh, [Shard(1)]))
    _close(dq.full_tensor(), want_dq, "compiled dq")


def _check_dtensor_multi_axis(rank: int, world: int, device: torch.device) -> None:
    """Multi-axis (M-RoPE) positions [A, B, S] (or [A, 1, S]; thd [A, T]) with DTensor q and k sharded along the
    sequence or the batch: the axis dimension A is never sharded, and every rank rotates its tokens by their own
    rows of every axis -- the full tensor equals the unsharded call, forward, backward and in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (world,))
    gen = torch.Generator().manual_seed(4321)
    B, S, HQ, HK, D = 2 * world, 5 * world + 1, 2, 1, 16  # a sequence that does not split evenly
    sections = [2, 3, 3]
    A = len(sections)
    q_full = torch.randn(B, S, HQ, D, generator=gen).to(device)
    k_full = torch.randn(B, S, HK, D, generator=gen).to(device)
    g_full = torch.randn(B, S, HQ, D, generator=gen).to(device)
    ids = torch.randint(0, 5_000, (A, B, S), generator=gen).to(device)
    packed_ids = torch.randint(0, 5_000, (A, S), generator=gen).to(device)
    cases = [
        ("bshd", [Shard(1)], dict(positions=ids)),
        ("bshd", [Shard(1)], dict(positions=ids[:, :1])),
        ("bshd", [Shard(0)], dict(positions=ids)),
        ("bshd", [Shard(0)], dict(positions=ids[:, :1], section_layout="interleaved")),
        ("bhsd", [Shard(2)], dict(positions=ids)),
        ("bhsd", [Shard(0)], dict(positions=ids)),
        ("sbhd", [Shard(0)], dict(positions=ids, style="interleaved")),
        ("sbhd", [Shard(1)], dict(positions=ids)),
        ("thd", [Shard(0)], dict(positions=packed_ids)),
    ]
    perm = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3)}
    for layout, placements, kwargs in cases:
        what = f"{layout} {placements} {tuple(kwargs['positions'].shape)} {sorted(kwargs)}"
        if layout == "thd":
            qf, kf, gf = q_full[0].contiguous(), k_full[0].contiguous(), g_full[0].contiguous()
        else:
            qf, kf, gf = (t.permute(perm[layout]).contiguous() for t in (q_full, k_full, g_full))
        leaf = qf.clone().requires_grad_(True)
        want_q, want_k = ropekit.apply_rope(leaf, kf, layout=layout, sections=sections, **kwargs)
        (want_dq,) = torch.autograd.grad(want_q, leaf, gf)
        qd = distribute_tensor(qf, mesh, placements).requires_grad_(True)
        kd = distribute_tensor(kf, mesh, placements)
        got_q, got_k = ropekit.apply_rope(qd, kd, layout=layout, sections=sections, **kwargs)
        assert type(got_q).__name__ == "DTensor" and got_q.placements == qd.placements, what
        _close(got_q.full_tensor(), want_q.detach(), f"q {what}")
        _close(got_k.full_tensor(), want_k, f"k {what}")
        (dq,) = torch.autograd.grad(got_q, qd, distribute_tensor(gf, mesh, placements))
        _close(dq.full_tensor(), want_dq, f"dq {what}")
        with torch.no_grad():
            qi, ki = distribute_tensor(qf, mesh, placements), distribute_tensor(kf, mesh, placements)
            ropekit.apply_rope_(qi, ki, layout=layout, sections=sections, **kwargs)
            _close(qi.full_tensor(), want_q.detach(), f"in place q {what}")
            _close(ki.full_tensor(), want_k, f"in place k {what}")
    # multi-axis positions as a DTensor: their first dimension is the axes, so "sharded as q" would cut the axes
    qd = distribute_tensor(q_full, mesh, [Shard(1)])
    with pytest.raises(ValueError, match="positions are multi-axis"):
        ropekit.apply_rope(qd, positions=distribute_tensor(ids, mesh, [Shard(1)]), sections=sections)
    got = ropekit.apply_rope(qd, positions=distribute_tensor(ids, mesh, [Replicate()]), sections=sections)
    _close(got.full_tensor(), ropekit.apply_rope(q_full, positions=ids, sections=sections), "replicated positions")


def _check_llama(rank: int, world: int, device: torch.device, kv_heads: int = 2) -> None:
    """A tiny random Llama-style model whose attention all-gathers K and V over the ranks, on a zigzag shard:
    the same loss and the same (all-reduced) gradients as the whole sequence in one process. The gather is the
    README's (a DTensor's full tensor whose gradient is summed over the ranks), and it warns of nothing."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    torch.manual_seed(7)
    # float64 on CPU (the reference path: equal to rounding); float32 on CUDA, where the Triton kernels rotate and the
    # sharded attention sums in another order
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    rtol, atol = (1e-12, 1e-12) if dtype == torch.float64 else (2e-4, 1e-6)
    vocab, hidden, heads, head_dim, layers = 64, 64, 4, 16, 2
    S = 16 * world
    model = _TinyLlama(vocab, hidden, heads, kv_heads, head_dim, layers).to(device, dtype)
    ids = torch.randint(0, vocab, (2, S + 1), generator=torch.Generator().manual_seed(3)).to(device)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    positions = torch.arange(S, device=device)[None]

    loss_full = model(inputs, targets, positions, gather=None) / targets.numel()
    loss_full.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    split = "zigzag"
    local_inputs = cp.shard(inputs, world, rank, split=split)
    local_targets = cp.shard(targets, world, rank, split=split)
    local_pos = cp.cp_positions(S // world, world, rank, split=split, device=device)[None]

    mesh = init_device_mesh(device.type, (world,))

    def gather(x: torch.Tensor) -> torch.Tensor:  # [B, S_local, ...] -> [B, S, ...] in sequence order
        full = DTensor.from_local(x, mesh, [Shard(1)]).full_tensor(grad_placements=[Partial()])
        return cp.unshard(full.chunk(world, dim=1), split=split, dim=1)

    # Each rank's loss is its own tokens' share; K/V gradients reach the rank that owns them through the gather's
    # backward (a reduce-scatter), and the parameter gradients are summed over the ranks below.
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        loss_local = model(local_inputs, local_targets, local_pos, gather=gather) / targets.numel()
        loss_local.backward()
    loss = loss_local.detach().clone()
    dist.all_reduce(loss)
    torch.testing.assert_close(loss, loss_full.detach(), rtol=rtol, atol=0)
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, want[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


class _TinyLlama(torch.nn.Module):
    """Embedding, pre-norm attention (GQA, RoPE by ropekit at each token's global position) and MLP blocks, a
    head: enough of Llama for positions to matter everywhere."""

    def __init__(self, vocab, hidden, heads, kv_heads, head_dim, layers):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            block = torch.nn.ModuleDict(dict(
                norm1=torch.nn.RMSNorm(hidden), q=torch.nn.Linear(hidden, heads * head_dim, bias=False),
                k=torch.nn.Linear(hidden, kv_heads * head_dim, bias=False),
                v=torch.nn.Linear(hidden, kv_heads * head_dim, bias=False),
                o=torch.nn.Linear(heads * head_dim, hidden, bias=False), norm2=torch.nn.RMSNorm(hidden),
                up=torch.nn.Linear(hidden, 2 * hidden, bias=False),
                down=torch.nn.Linear(2 * hidden, hidden, bias=False)))
            self.blocks.append(block)
        self.norm = torch.nn.RMSNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, targets, positions, gather):
        B, S = ids.shape
        x = self.embed(ids)
        key_positions = positions if gather is None else gather(positions[..., None].expand(B, S, 1))[..., 0]
        mask = positions[:, :, None] >= key_positions[:, None, :]  # causal by global position
        for blk in self.blocks:
            h = blk["norm1"](x)
            q = blk["q"](h).view(B, S, self.heads, self.head_dim)
            k = blk["k"](h).view(B, S, self.kv_heads, self.head_dim)
            v = blk["v"](h).view(B, S, self.kv_heads, self.head_dim)
            q, k = ropekit.apply_rope(q, k, positions=positions.expand(B, S), base=10000.0)
            if gather is not None:
                k, v = gather(k), gather(v)
            rep = self.heads // self.kv_heads
            if rep > 1:  # (without GQA, the gathered keys meet the einsum directly, as in the README)
                k = k.repeat_interleave(rep, dim=2)
                v = v.repeat_interleave(rep, dim=2)
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim)
            scores = scores.masked_fill(~mask[:, None], float("-inf"))
            attn = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(B, S, -1)
            x = x + blk["o"](attn)
            x = x + blk["down"](torch.nn.functional.silu(blk["up"](blk["norm2"](x))))
        logits = self.head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                 reduction="sum")


CHECKS = {"shards": _check_shards, "dtensor": _check_dtensor, "dtensor_multi_axis": _check_dtensor_multi_axis,
          "llama": _check_llama, "llama_mha": lambda rank, world, device: _check_llama(rank, world, device, kv_heads=4)}
BACKENDS = [
    pytest.param("gloo", id="gloo"),
    pytest.param("nccl", id="nccl", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_two_ranks_equal_one_process(check, backend):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_backend_available(backend):
        pytest.skip(f"torch.distributed backend {backend} is not available")
    _run_workers(check, backend)


def test_torch_distributed_tensor_is_imported_only_for_dtensors():
    import subprocess
    import sys

    code = ("import sys, torch, ropekit, ropekit.distributed\n"
            "ropekit.apply_rope(torch.randn(1, 4, 2, 8))\n"
            "assert 'torch.distributed.tensor' not in sys.modules, 'imported eagerly'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
