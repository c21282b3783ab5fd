"""Attention-prologue probe on a CUDA GPU: ``ropekit.rope_kv_write`` (RoPE + K/V cache write, with the per-head
RMSNorm for Qwen3) and ``ropekit.qk_norm_rope`` fwd+bwd, each against a one-kernel copy of the bytes it must move
and against the unfused chain a user has today, all in one run.

* decode (CUDA-graph replay, 1-256 tokens, one per sequence, bf16 and fp8 caches) and prefill (cold L2, 2k-32k
  tokens of one sequence at an offset): ``rope_kv_write`` against ``copy`` (a Triton kernel reading q, k, v and
  writing q and the K/V cache rows: the bytes the fused op must move, in one launch) and ``unfused`` (torch
  ``rms_norm`` x2 (Qwen3) + ``ropekit.apply_rope`` + the cache scatter by indexing, fp8 conversion included);
* ``qk_norm_rope`` forward + backward (Qwen3-8B, 4k-32k tokens) against the ideal bytes (one copy of 2.5 times
  q and k: the forward reads and writes them, the backward reads the gradient and the input and writes the input
  gradient) and ``torch.compile`` of the unfused PyTorch code (rms_norm + transformers' rotate_half RoPE).

    python benchmarks/probes/prologue_probe.py [--decode 1,16,64,256] [--prefill 2048,8192,32768]
"""

# ruff: noqa: E402 - options are parsed before torch, Triton and ropekit load, so --help runs on any machine
from __future__ import annotations

import argparse


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decode", default="1,4,16,64,256", help="comma-separated decode token counts")
    parser.add_argument("--prefill", default="2048,8192,32768", help="comma-separated prefill token counts")
    parser.add_argument("--train", default="4096,16384,32768", help="qk_norm_rope fwd+bwd token counts")
    parser.add_argument("--skip-compile", action="store_true", help="no torch.compile baseline (faster)")
    parser.add_argument("--sweep-batch", type=int, default=4,
                        help="with --sweep: sequences of 4096 tokens in the qk_norm_rope forward/backward sweep")
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="instead: rope_kv_write prefill of 8192 tokens at several block shapes, bf16 and fp8 "
                             "caches, positions as an int offset and as a per-token tensor (the launcher's shape "
                             "differs between the two)")
    parser.add_argument("--norm-sweep", action="store_true",
                        help="instead: only qk_norm_rope's forward and backward block shapes (--sweep-batch x4096), "
                             "positions as a range and per token")
    parser.add_argument("--decode-gap", action="store_true",
                        help="instead: where decode time goes against the copy (CUDA-graph replay and kernel device "
                             "time): rope_kv_write by default, with 2 rotated columns, with an int offset and with "
                             "tables, the copy, and the copy with the prologue kernel's argument count; plain RoPE "
                             "of q and k with exact angles and tables against Liger")
    parser.add_argument("--sweep", action="store_true",
                        help="instead: each kernel's device time (profiler), the host time per eager call, and a "
                             "block-shape sweep of the raw launchers (decode 1/64 tokens, qk_norm_rope fwd and bwd)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help exits here

import torch
import triton
import triton.language as tl
import triton.testing
from _graphs import graph_us_interleaved, kernel_us

import ropekit
from ropekit.frequencies import default_inv_freq

MODELS = {"llama3-8b": dict(hq=32, hk=8, norm=False, base=500000.0),
          "qwen3-8b": dict(hq=32, hk=8, norm=True, base=1000000.0)}
D = 128
MAX_SEQ = 40960
FP8 = torch.float8_e4m3fn


@triton.jit
def _copy_rows_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, pos_ptr, S, q_st, k_st, c_sb, c_ss,
                      QW: tl.constexpr, KW: tl.constexpr, QB: tl.constexpr, KB: tl.constexpr):
    """One program per token: q's row to q_out, k's and v's rows to the caches' row [b, pos] (bshd)."""
    t = tl.program_id(0)
    b = t // S
    pos = tl.load(pos_ptr + t).to(tl.int64)
    iq = tl.arange(0, QB)
    x = tl.load(q_ptr + t.to(tl.int64) * q_st + iq, mask=iq < QW)
    tl.store(qo_ptr + t.to(tl.int64) * QW + iq, x, mask=iq < QW)
    ik = tl.arange(0, KB)
    row = b.to(tl.int64) * c_sb + pos * c_ss
    kx = tl.load(k_ptr + t.to(tl.int64) * k_st + ik, mask=ik < KW)
    vx = tl.load(v_ptr + t.to(tl.int64) * k_st + ik, mask=ik < KW)
    tl.store(kc_ptr + row + ik, kx.to(kc_ptr.dtype.element_ty), mask=ik < KW)
    tl.store(vc_ptr + row + ik, vx.to(vc_ptr.dtype.element_ty), mask=ik < KW)


@triton.jit
def _copy_head_blocks_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, pos_ptr, S, q_st, k_st, c_sb, c_ss,
                             N_QB: tl.constexpr, N_KB: tl.constexpr, BH: tl.constexpr, D: tl.constexpr):
    """copy_rows on rope_kv_write's decode grid: program (hb, t) copies BH heads of q, of k or of v of token t."""
    hb = tl.program_id(0)
    t = tl.program_id(1)
    b = t // S
    pos = tl.load(pos_ptr + t).to(tl.int64)
    t64 = t.to(tl.int64)
    i = tl.arange(0, BH * D)
    if hb < N_QB:
        x = tl.load(q_ptr + t64 * q_st + hb * BH * D + i)
        tl.store(qo_ptr + t64 * (N_QB * BH * D) + hb * BH * D + i, x)
    else:
        row = b.to(tl.int64) * c_sb + pos * c_ss
        if hb < N_QB + N_KB:
            h0 = (hb - N_QB) * BH * D
            x = tl.load(k_ptr + t64 * k_st + h0 + i)
            tl.store(kc_ptr + row + h0 + i, x.to(kc_ptr.dtype.element_ty))
        else:
            h0 = (hb - N_QB - N_KB) * BH * D
            x = tl.load(v_ptr + t64 * k_st + h0 + i)
            tl.store(vc_ptr + row + h0 + i, x.to(vc_ptr.dtype.element_ty))


def copy_head_blocks(q, k, v, q_out, k_cache, v_cache, pos, S, heads: int = 4):
    """The copy on rope_kv_write's decode grid (one token, ``heads`` heads per program, 4 warps): as many programs
    as the fused op, none of its arithmetic."""
    T, HQ, _ = q.shape
    HK = k.shape[1]
    n_qb, n_kb = HQ // heads, HK // heads
    _copy_head_blocks_kernel[(n_qb + 2 * n_kb, T)](q, k, v, q_out, k_cache, v_cache, pos, S, q.stride(0), k.stride(0),
                                                   k_cache.stride(0), k_cache.stride(1), N_QB=n_qb, N_KB=n_kb,
                                                   BH=heads, D=D, num_warps=4)


def copy_rows(q, k, v, q_out, k_cache, v_cache, pos, S):
    T, HQ, _ = q.shape
    HK = k.shape[1]
    _copy_rows_kernel[(T,)](q, k, v, q_out, k_cache, v_cache, pos, S, q.stride(0), k.stride(0), k_cache.stride(0),
                            k_cache.stride(1), QW=HQ * D, KW=HK * D, QB=triton.next_power_of_2(HQ * D),
                            KB=triton.next_power_of_2(HK * D), num_warps=4)


# The copy with unused arguments, as many (and of the same kinds) as prologue_kernel's 62 after Triton's
# specialisation: 20 pointers, 36 ints, 6 floats. A kernel's arguments reach the GPU with every launch, so their
# size is a launch cost the profiler's kernel time does not show. Triton reads a kernel's source from its file, so
# the signature is written out once into a module beside the probe's other temporary files.
_PAD_PTRS, _PAD_INTS, _PAD_FLOATS = 13, 30, 6


def _padded_copy_kernel():
    import importlib.util
    import tempfile
    from pathlib import Path

    pads = ([f"p{i}" for i in range(_PAD_PTRS)] + [f"i{i}" for i in range(_PAD_INTS)]
            + [f"f{i}" for i in range(_PAD_FLOATS)])
    source = (
        "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
        f"def padded_copy(q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, pos_ptr, S, q_st, k_st, c_sb, c_ss, "
        f"{', '.join(pads)}, QW: tl.constexpr, KW: tl.constexpr, QB: tl.constexpr, KB: tl.constexpr):\n"
        "    t = tl.program_id(0)\n    b = t // S\n    pos = tl.load(pos_ptr + t).to(tl.int64)\n"
        "    iq = tl.arange(0, QB)\n    x = tl.load(q_ptr + t.to(tl.int64) * q_st + iq, mask=iq < QW)\n"
        "    tl.store(qo_ptr + t.to(tl.int64) * QW + iq, x, mask=iq < QW)\n    ik = tl.arange(0, KB)\n"
        "    row = b.to(tl.int64) * c_sb + pos * c_ss\n"
        "    kx = tl.load(k_ptr + t.to(tl.int64) * k_st + ik, mask=ik < KW)\n"
        "    vx = tl.load(v_ptr + t.to(tl.int64) * k_st + ik, mask=ik < KW)\n"
        "    tl.store(kc_ptr + row + ik, kx.to(kc_ptr.dtype.element_ty), mask=ik < KW)\n"
        "    tl.store(vc_ptr + row + ik, vx.to(vc_ptr.dtype.element_ty), mask=ik < KW)\n")
    path = Path(tempfile.mkdtemp()) / "padded_copy.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("padded_copy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.padded_copy


def padded_copy_rows(kernel, q, k, v, q_out, k_cache, v_cache, pos, S):
    """copy_rows through the padded kernel: distinct values, so that Triton specialises none of them away."""
    T, HQ, _ = q.shape
    HK = k.shape[1]
    pads = [q] * _PAD_PTRS + [3 + 2 * i for i in range(_PAD_INTS)] + [0.5 + i for i in range(_PAD_FLOATS)]
    kernel[(T,)](q, k, v, q_out, k_cache, v_cache, pos, S, q.stride(0), k.stride(0), k_cache.stride(0),
                 k_cache.stride(1), *pads, QW=HQ * D, KW=HK * D, QB=triton.next_power_of_2(HQ * D),
                 KB=triton.next_power_of_2(HK * D), num_warps=4)


def _inputs(T: int, B: int, m: dict, cache_dtype):
    """q, k, v [T, H, D] bf16 (views of one packed QKV buffer), caches [B, MAX_SEQ, Hkv, D], positions [T]."""
    hq, hk = m["hq"], m["hk"]
    qkv = torch.randn(T, (hq + 2 * hk) * D, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.view(T, hq + 2 * hk, D).split([hq, hk, hk], dim=1)
    S = T // B
    rows = MAX_SEQ if B == 1 else 4096
    k_cache = torch.zeros(B, rows, hk, D, device="cuda", dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    if B == T:  # decode: one token per sequence at its own length
        pos = torch.randint(0, rows, (T,), device="cuda")
    else:
        pos = (torch.arange(T, device="cuda") % S) + 1000
    qw = torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5
    kw = torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5
    return q, k, v, k_cache, v_cache, pos, qw, kw, S


def _calls(T: int, B: int, m: dict, cache_dtype) -> dict:
    q, k, v, k_cache, v_cache, pos, qw, kw, S = _inputs(T, B, m, cache_dtype)
    fp8 = cache_dtype == FP8
    scale = torch.tensor(0.05, device="cuda") if fp8 else None
    norm = dict(q_weight=qw, k_weight=kw) if m["norm"] else {}
    q_out = torch.empty(q.shape, device="cuda", dtype=q.dtype)
    batch = torch.arange(T, device="cuda") // S
    hk = k.shape[1]

    def fused():
        if B == T:
            return ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=pos, base=m["base"],
                                         k_cache_scale=scale, v_cache_scale=scale, **norm)
        return ropekit.rope_kv_write(q.view(B, S, -1, D), k.view(B, S, hk, D), v.view(B, S, hk, D), k_cache,
                                     v_cache, positions=pos.view(B, S), base=m["base"], k_cache_scale=scale,
                                     v_cache_scale=scale, **norm)

    def unfused():
        qq, kk = q, k
        if m["norm"]:
            qq = torch.nn.functional.rms_norm(q, (D,), qw, 1e-6)
            kk = torch.nn.functional.rms_norm(k, (D,), kw, 1e-6)
        q_rot, k_rot = ropekit.apply_rope(qq, kk, positions=pos, layout="thd", base=m["base"])
        if fp8:
            k_cache[batch, pos] = (k_rot.float() / scale).clamp(-448, 448).to(FP8)
            v_cache[batch, pos] = (v.float() / scale).clamp(-448, 448).to(FP8)
        else:
            k_cache[batch, pos] = k_rot
            v_cache[batch, pos] = v
        return q_rot

    return {"copy": lambda: copy_rows(q, k, v, q_out, k_cache, v_cache, pos, S), "rope_kv_write": fused,
            "unfused": unfused}


def _cold_us(fns: dict) -> dict:
    best = {n: float("inf") for n in fns}
    for _ in range(3):  # interleaved rounds, best of each
        for n, fn in fns.items():
            best[n] = min(best[n], triton.testing.do_bench(fn, rep=100) * 1e3)
    return best


def _row(label: str, times: dict) -> None:
    base = times["copy"]
    cells = "  ".join(f"{n} {t:7.2f} us ({t / base:5.2f}x)" for n, t in times.items())
    print(f"{label:<34} {cells}", flush=True)


def _hf_rope(x, cos, sin):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _unfused_norm_rope(q, k, qw, kw, cos, sin):
    qn = torch.nn.functional.rms_norm(q, (D,), qw, 1e-6)
    kn = torch.nn.functional.rms_norm(k, (D,), kw, 1e-6)
    return _hf_rope(qn, cos, sin), _hf_rope(kn, cos, sin)


def train(T: int, compile_baseline: bool) -> None:
    m = MODELS["qwen3-8b"]
    B, S = T // 4096, 4096
    q = torch.randn(B, S, m["hq"], D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, S, m["hk"], D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    qw = torch.rand(D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kw = torch.rand(D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    nbytes = (q.numel() + k.numel()) * 2
    src = torch.empty(int(nbytes * 2.5) // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    pos = torch.arange(S, device="cuda")
    inv = default_inv_freq(m["base"], D, torch.device("cuda"))
    emb = torch.cat([pos[:, None].double() * inv.double()] * 2, dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16)[None, :, None], emb.sin().to(torch.bfloat16)[None, :, None]

    def fused():
        out = ropekit.qk_norm_rope(q, k, qw, kw, eps=1e-6, base=m["base"])
        torch.autograd.grad(out, (q, k, qw, kw), (gq, gk))

    fns = {"copy": lambda: dst.copy_(src), "qk_norm_rope": fused}
    if compile_baseline:
        compiled = torch.compile(_unfused_norm_rope, fullgraph=True, dynamic=False)

        def unfused_compiled():
            out = compiled(q, k, qw, kw, cos, sin)
            torch.autograd.grad(out, (q, k, qw, kw), (gq, gk))

        unfused_compiled()
        fns["compile(unfused)"] = unfused_compiled
    _row(f"qk_norm_rope fwd+bwd {B}x{S}", _cold_us(fns))
    # Where a step's time goes: each kernel's device time (profiler), the host time to enqueue one step (no
    # synchronisation), and steps back to back without the cold-L2 flush between them.
    kernels = kernel_us(fused)
    print(f"  kernels (us): { {n: round(t, 1) for n, t in kernels.items()} } sum {sum(kernels.values()):.1f}; host "
          f"enqueue {_enqueue_us(fused):.1f} us/step; back to back {_back_to_back_us(fused):.1f} us/step", flush=True)


def _back_to_back_us(fn, steps: int = 20) -> float:
    """Median of 5 timings of ``steps`` calls enqueued back to back (CUDA events), per call."""
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / steps)
    return sorted(times)[2]


def _enqueue_us(fn, steps: int = 20) -> float:
    """Host time to enqueue one call (best of 5 runs of ``steps`` calls, timed before synchronising)."""
    return _host_us(fn, steps, wait=False)


def _host_us(fn, calls: int = 200, wait: bool = True) -> float:
    """Best of 5 runs of ``calls`` calls, per call: wall time until the GPU is done (``wait``), or until the host
    has enqueued them."""
    import time

    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if wait:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def sweep(batch: int) -> None:
    """Device time per kernel, host time per call, and block shapes of the raw launchers."""
    from ropekit._cache_validation import validate_kv_write
    from ropekit._spec import CacheArgs, RopeArgs
    from ropekit._validation import validate_args
    from ropekit.triton.prologue_launcher import launch_prologue

    decode_shapes = [(1, bh, min(bh, 8), nw) for bh in (2, 4, 8) for nw in (1, 2, 4)]
    shapes = [(bt, bh, min(bh, 8), nw) for bt in (1, 2, 4) for bh in (8, 16) for nw in (2, 4, 8)]
    for name, m in MODELS.items():
        for T, B in ((1, 1), (64, 64), (8192, 1)):
            q, k, v, k_cache, v_cache, pos, qw, kw, S = _inputs(T, B, m, torch.bfloat16)
            if B == 1 and T > 1:  # prefill: one sequence of T tokens
                q, k, v, pos = q.view(1, T, -1, D), k.view(1, T, -1, D), v.view(1, T, -1, D), pos.view(1, T)
            norm = dict(q_weight=qw, k_weight=kw) if m["norm"] else {}
            q4, k4, v4, rope_args, cache = validate_kv_write(q, k, CacheArgs(v, k_cache, v_cache),
                                                             RopeArgs(positions=pos, base=m["base"]))
            spec = validate_args(q4, k4, rope_args)
            q_out = torch.empty(q4.shape, device="cuda", dtype=q.dtype)
            raw = {cfg: (lambda c=cfg: launch_prologue(q4, k4, q_out, None, spec, v=v4, cache=cache, config=c,
                                                       **norm))
                   for cfg in [None] + (decode_shapes if T <= 256 else shapes)}

            def public():
                return ropekit.rope_kv_write(q, k, v, k_cache, v_cache, positions=pos, base=m["base"], **norm)

            def checks():
                _, _, _, checked, _ = validate_kv_write(q, k, CacheArgs(v, k_cache, v_cache),
                                                        RopeArgs(positions=pos, base=m["base"]))
                return validate_args(q4, k4, checked)

            print(f"{name} rope_kv_write T={T}: kernels {kernel_us(public)}  host us/call: public "
                  f"{_host_us(public):.1f}, validation {_host_us(checks):.1f}, raw launch {_host_us(raw[None]):.1f}",
                  flush=True)
            # the same launch with angles from a cos/sin table (no in-kernel angle math), and the bytes' copy
            inv = default_inv_freq(m["base"], D, torch.device("cuda"))
            angles = torch.outer(torch.arange(k_cache.shape[1], device="cuda", dtype=torch.float64), inv.double())
            spec_table = validate_args(q4, k4, rope_args._replace(cos=angles.cos().float(),
                                                                  sin=angles.sin().float(), base=10000.0))
            reference = {"table": lambda: launch_prologue(q4, k4, q_out, None, spec_table, v=v4, cache=cache,
                                                          **norm)}
            if T == B:
                reference["copy-kv"] = lambda: copy_rows(q, k, v, q_out.view(q.shape), k_cache, v_cache, pos, S)
            timed = graph_us_interleaved({**raw, **reference}) if T <= 256 else _cold_us({**raw, **reference})
            best = sorted(((c, t) for c, t in timed.items() if c not in reference), key=lambda kv: kv[1])[:4]
            print(f"  default {timed[None]:.2f} us, " + ", ".join(f"{n} {timed[n]:.2f} us" for n in reference)
                  + f"; fastest {[(c, round(t, 2)) for c, t in best]}", flush=True)
    norm_sweep(batch, per_token=False)


def norm_sweep(batch: int, per_token: bool) -> None:
    """qk_norm_rope's forward and backward kernels by block shape (raw launchers, cold L2), positions 0..4095 per
    sequence as a range or as a per-token tensor."""
    from ropekit._validation import validate
    from ropekit.triton.prologue_launcher import launch_norm_rope_bwd, launch_prologue

    shapes = [(bt, bh, min(bh, 8), nw) for bt in (1, 2, 4) for bh in (8, 16) for nw in (1, 2, 4, 8)]
    m = MODELS["qwen3-8b"]
    q = torch.randn(batch, 4096, m["hq"], D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, 4096, m["hk"], D, device="cuda", dtype=torch.bfloat16)
    qw = torch.rand(D, device="cuda", dtype=torch.bfloat16)
    kw = torch.rand(D, device="cuda", dtype=torch.bfloat16)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    ids = torch.arange(4096, device="cuda").expand(batch, 4096).contiguous() if per_token else None
    print(f"qk_norm_rope, positions {'per token' if per_token else 'as a range'}:", flush=True)
    spec = validate(q, k, positions=ids, base=m["base"])
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    fwd = {cfg: (lambda c=cfg: launch_prologue(q, k, qo, ko, spec, q_weight=qw, k_weight=kw, config=c))
           for cfg in [None] + shapes}
    bwd = {cfg: (lambda c=cfg: launch_norm_rope_bwd(gq, q, gk, k, spec, qw, kw, 0.0, 1e-6, config=c))
           for cfg in [None] + shapes}
    src = torch.empty((q.numel() + k.numel()), device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    from ropekit.triton import heuristics, runtime

    fwd[None]()
    bwd[None]()
    for key, compiled in runtime.compiled_kernels().items():
        print(f"  {key[0].fn.__name__} {key[-3]}: {getattr(compiled, 'n_regs', '?')} registers, "
              f"{getattr(compiled, 'n_spills', '?')} spills", flush=True)
    default_programs = heuristics.BWD_PROGRAMS_PER_SM
    by_programs = {}
    for per_sm in (1, 2, 4, 8, 16, 32, 128):
        heuristics.BWD_PROGRAMS_PER_SM = per_sm
        by_programs[per_sm] = _cold_us({"bwd": bwd[None]})["bwd"]
    heuristics.BWD_PROGRAMS_PER_SM = default_programs
    print(f"  bwd {batch}x4096 by BWD_PROGRAMS_PER_SM: { {k: round(v, 1) for k, v in by_programs.items()} }",
          flush=True)
    for label, fns in ((f"qk_norm_rope fwd {batch}x4096", fwd), (f"qk_norm_rope bwd {batch}x4096", bwd)):
        print(f"{label}: kernels {kernel_us(fns[None])}  host {_host_us(fns[None], 50):.1f} us/call", flush=True)
        timed = _cold_us({"copy": lambda: dst.copy_(src), **fns})
        ranked = sorted(((c, t) for c, t in timed.items() if c != "copy"), key=lambda kv: kv[1])
        print(f"  copy {timed['copy']:.1f} default {timed[None]:.1f} us; by shape:", flush=True)
        for i in range(0, len(ranked), 6):
            print("    " + "  ".join(f"{c} {t:.1f}" for c, t in ranked[i:i + 6]), flush=True)


def _replay_and_device(fns: dict) -> dict:
    """{name: (us per call in graph replay, kernel device us per call)} of each entry, replays interleaved."""
    replay = graph_us_interleaved(fns)
    return {n: (replay[n], sum(kernel_us(fn).values())) for n, fn in fns.items()}


def _gap_row(label: str, timed: dict, base: str) -> None:
    cells = "  ".join(f"{n} {r:.2f}/{d:.2f} ({r / timed[base][0]:.3f}x)" for n, (r, d) in timed.items())
    print(f"{label:<22} {cells}", flush=True)


def decode_gap(tokens: list[int]) -> None:
    """Decode in CUDA-graph replay, raw launchers: per-call time / kernel device time (us), and the per-call time
    over the copy's (rope_kv_write) or over ropekit's default (plain RoPE).

    rope_kv_write: the default launch; the same launch rotating only 2 of 128 columns (the rest passed through:
    the same grid, loads and stores, almost no rotation math); positions as an int offset (no position load
    before the angles); cos/sin tables gathered by position (no angle math); the copy; the copy with the prologue
    kernel's argument count; the copy on the prologue's decode grid (``copy-grid``: 4 heads per program, as many
    programs, none of the arithmetic). Plain RoPE of q and k: the default, cos/sin tables, and Liger (where
    installed), each also with per-token tables as Liger is given them (no position load in the call)."""
    from ropekit._cache_validation import validate_kv_write
    from ropekit._spec import CacheArgs, RopeArgs
    from ropekit._validation import validate, validate_args
    from ropekit.triton.launcher import launch_rope
    from ropekit.triton.prologue_launcher import launch_prologue

    padded = _padded_copy_kernel()
    print("rope_kv_write decode: replay/device us (replay x copy)", flush=True)
    for name, m in MODELS.items():
        inv = default_inv_freq(m["base"], D, torch.device("cuda"))
        angles = torch.outer(torch.arange(MAX_SEQ, device="cuda", dtype=torch.float64), inv.double())
        cos, sin = angles.cos().float(), angles.sin().float()
        for cache_dtype in (torch.bfloat16, FP8):
            for T in tokens:
                q, k, v, k_cache, v_cache, pos, qw, kw, S = _inputs(T, T, m, cache_dtype)
                scale = torch.tensor(0.05, device="cuda") if cache_dtype == FP8 else None
                norm = dict(q_weight=qw, k_weight=kw) if m["norm"] else {}
                q_out = torch.empty(q.shape, device="cuda", dtype=q.dtype)
                q_out4 = q_out.view(T, 1, -1, D)
                fns = {}
                for label, positions, rope in (("default", pos, {}), ("rotary2", pos, dict(rotary_dim=2)),
                                               ("offset", 1000, {}), ("table", pos, dict(cos=cos, sin=sin))):
                    q4, k4, v4, rope_args, cache = validate_kv_write(
                        q, k, CacheArgs(v, k_cache, v_cache, k_cache_scale=scale, v_cache_scale=scale),
                        RopeArgs(positions=positions))
                    rope = rope if "cos" in rope else dict(rope, base=m["base"])
                    spec = validate_args(q4, k4, rope_args._replace(**rope))
                    fns[label] = (lambda a=(q4, k4, q_out4), s=spec, v4=v4, c=cache:
                                  launch_prologue(*a, None, s, v=v4, cache=c, **norm))
                fns["copy"] = lambda: copy_rows(q, k, v, q_out, k_cache, v_cache, pos, S)
                fns["copy+args"] = lambda: padded_copy_rows(padded, q, k, v, q_out, k_cache, v_cache, pos, S)
                fns["copy-grid"] = lambda: copy_head_blocks(q, k, v, q_out, k_cache, v_cache, pos, S)
                tag = "fp8" if cache_dtype == FP8 else "bf16"
                _gap_row(f"{name} {tag} {T}", _replay_and_device(fns), "copy")
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError as exc:
        liger_rotary_pos_emb = None
        print(f"(no Liger: {exc})")
    print("plain RoPE of q and k, decode (Llama-3-8B): replay/device us (replay x the default)", flush=True)
    m = MODELS["llama3-8b"]
    inv = default_inv_freq(m["base"], D, torch.device("cuda"))
    angles = torch.outer(torch.arange(MAX_SEQ, device="cuda", dtype=torch.float64), inv.double())
    for T in tokens:
        q, k, _, _, _, pos, _, _, _ = _inputs(T, T, m, torch.bfloat16)
        q4, k4 = q.view(T, 1, -1, D), k.view(T, 1, -1, D)
        qo, ko = torch.empty(q4.shape, device="cuda", dtype=q.dtype), torch.empty(k4.shape, device="cuda",
                                                                                  dtype=q.dtype)
        ang = angles[pos]  # [T, D/2]: each token's angles, gathered by the caller (not timed)
        hf_cos = torch.cat([ang.cos(), ang.cos()], -1).to(torch.bfloat16)[:, None, :]  # [T, 1, D], transformers'
        hf_sin = torch.cat([ang.sin(), ang.sin()], -1).to(torch.bfloat16)[:, None, :]
        specs = {"default": validate(q4, k4, positions=pos.view(T, 1), base=m["base"]),
                 "table": validate(q4, k4, positions=pos.view(T, 1), cos=angles.cos().float(),
                                   sin=angles.sin().float()),
                 "bf16 table": validate(q4, k4, positions=pos.view(T, 1), cos=angles.cos().bfloat16(),
                                        sin=angles.sin().bfloat16()),
                 # per-token tables, as Liger is given: no position load inside the call
                 "token table": validate(q4, k4, cos=ang.cos().float()[:, None, :], sin=ang.sin().float()[:, None, :]),
                 "hf token table": validate(q4, k4, cos=hf_cos, sin=hf_sin)}
        fns = {label: (lambda s=spec: launch_rope(q4, k4, qo, ko, s)) for label, spec in specs.items()}
        if liger_rotary_pos_emb is not None:
            qh, kh = q4.transpose(1, 2).clone(), k4.transpose(1, 2).clone()  # [T, H, 1, D], rotated in place
            fns["liger"] = lambda: liger_rotary_pos_emb(qh, kh, hf_cos, hf_sin)
        _gap_row(f"llama3-8b rope {T}", _replay_and_device(fns), "default")


def prefill_sweep(T: int = 8192) -> None:
    """rope_kv_write prefill (one sequence of T tokens at offset 1000) by block shape, raw launcher, cold L2."""
    from ropekit._cache_validation import validate_kv_write
    from ropekit._spec import CacheArgs, RopeArgs
    from ropekit._validation import validate_args
    from ropekit.triton.prologue_launcher import launch_prologue

    shapes = [None, (1, 8, 8, 1), (1, 8, 8, 4), (2, 8, 8, 2), (1, 16, 8, 2), (2, 16, 8, 4), (4, 8, 8, 4)]
    for name, m in MODELS.items():
        for cache_dtype in (torch.bfloat16, FP8):
            q, k, v, k_cache, v_cache, pos, qw, kw, S = _inputs(T, 1, m, cache_dtype)
            q, k, v = q.view(1, T, -1, D), k.view(1, T, -1, D), v.view(1, T, -1, D)
            scale = torch.tensor(0.05, device="cuda") if cache_dtype == FP8 else None
            norm = dict(q_weight=qw, k_weight=kw) if m["norm"] else {}
            for label, positions in (("int offset", 1000), ("per-token", pos.view(1, T))):
                q4, k4, v4, rope_args, cache = validate_kv_write(
                    q, k, CacheArgs(v, k_cache, v_cache, k_cache_scale=scale, v_cache_scale=scale),
                    RopeArgs(positions=positions, base=m["base"]))
                spec = validate_args(q4, k4, rope_args)
                q_out = torch.empty(q4.shape, device="cuda", dtype=q.dtype)
                fns = {cfg: (lambda c=cfg: launch_prologue(q4, k4, q_out, None, spec, v=v4, cache=cache, config=c,
                                                           **norm)) for cfg in shapes}
                fns["copy"] = lambda: copy_rows(q.view(T, -1, D), k.view(T, -1, D), v.view(T, -1, D),
                                                q_out.view(T, -1, D), k_cache, v_cache, pos, S)
                timed = _cold_us(fns)
                cells = "  ".join(f"{c}: {t / timed['copy']:.3f}" for c, t in timed.items() if c != "copy")
                print(f"{name} {'fp8' if scale is not None else 'bf16'} {label}: copy {timed['copy']:.1f} us; "
                      f"x copy {cells}", flush=True)


def main(args: argparse.Namespace) -> None:
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    if args.prefill_sweep:
        prefill_sweep()
        return
    if args.norm_sweep:
        for per_token in (False, True):
            norm_sweep(args.sweep_batch, per_token)
        return
    if args.sweep:
        sweep(args.sweep_batch)
        return
    if args.decode_gap:
        decode_gap([int(x) for x in args.decode.split(",")])
        return
    print("times: median (decode: per call in CUDA-graph replay; else best of 3 cold-L2 medians); ratio vs copy")
    for name, m in MODELS.items():
        for cache_dtype in (torch.bfloat16, FP8):
            tag = f"{name} {'fp8' if cache_dtype == FP8 else 'bf16'}"
            for T in (int(x) for x in args.decode.split(",")):
                _row(f"{tag} decode {T}", graph_us_interleaved(_calls(T, T, m, cache_dtype)))
            for T in (int(x) for x in args.prefill.split(",")):
                calls = _calls(T, 1, m, cache_dtype)
                _row(f"{tag} prefill {T}", _cold_us(calls))
                # The kernels' device time (profiler, warm L2) and the host time to enqueue one call: a cold-L2
                # timing hides host time only up to the flush between calls (256 MB, about 80 us on an H100).
                device = {n: round(sum(kernel_us(calls[n]).values()), 1) for n in ("copy", "rope_kv_write")}
                print(f"  kernel device us {device}; rope_kv_write host enqueue "
                      f"{_enqueue_us(calls['rope_kv_write']):.1f} us/call", flush=True)
    for T in (int(x) for x in args.train.split(",")):
        train(T, not args.skip_compile)


if __name__ == "__main__":
    main(ARGS)
