"""The attention prologue's implementations: ``rope_kv_write`` (RoPE, the optional per-head RMSNorm and the K/V
cache write in one launch) and ``qk_norm_rope`` fwd+bwd, their baselines (a one-kernel copy of the bytes the fused
op must move; one copy of 5 passes over q and k) and the unfused code a user has today.

KV modes (``kv-decode``, ``kv-prefill``): every implementation writes into the case's caches; the check against
``ropekit-kv-write`` compares the returned q and the cache rows the tokens go to (the caches are filled with NaN
first, so a row left unwritten counts as a mismatch).

``kv-step``: the QKV projection GEMM, then the prologue, in one CUDA graph (:func:`build_kv_step`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from ._triton import tl, triton
from .base import Bench, Unsupported, _flat_copy, _grad_outputs, _need_triton_device, compiled_per_case
from .inputs import NORM_EPS, Inputs
from .timing import _sync, capture_graph

# fp8 cache rows agree within one e4m3 step: a value rounded from bf16 (the unfused chain) and from fp32 (the
# fused op) may land on neighbouring steps, and a step is up to 1/8 of a value (3 mantissa bits).
FP8_MISMATCH = 0.13
FP8 = torch.float8_e4m3fn

# The implementations built here (impls.MODE_IMPLS lists them with the others): rope_kv_write and the unfused chain
# (KV modes), qk_norm_rope and the unfused PyTorch code (norm-fwdbwd).
# rope_kv_write into paged caches: the impl's cache layout, found by slot_mapping or by FlashInfer's page table.
PAGED_KV_FORMATS = {"ropekit-kv-write-paged-x": ("paged_x", "slots"),
                    "ropekit-kv-write-paged-hnd": ("paged_hnd", "slots"),
                    "ropekit-kv-write-page-table": ("paged", "page-table")}
PAGE_ROWS = 16  # rows per page of the paged formats (vLLM's default block_size)
PROLOGUE_KV_IMPLS = ("ropekit-kv-write", "ropekit-kv-write-fp8q", "ropekit-kv-write-fp8q-dynamic", *PAGED_KV_FORMATS,
                     "unfused-kv")
# ropekit-qk-norm-graph: the same step captured in a CUDA graph, so its kernels without the eager host time
PROLOGUE_NORM_IMPLS = ("ropekit-qk-norm", "ropekit-qk-norm-graph", "unfused-eager", "unfused-compile")
# host mode: one training step (fwd, then autograd.grad) of qk_norm_rope, and of apply_rope with the same rope args
STEP_IMPLS = ("ropekit-qk-norm-step", "ropekit-step")
# kv-step: the QKV projection GEMM, then the prologue. "gemm" is its baseline and "gemm+copy-kv" its floor.
KV_STEP_IMPLS = ("gemm+ropekit-kv-write", "gemm+ropekit-kv-write-pdl", "gemm+unfused-kv")
KV_STEP_BASELINES = ("gemm", "gemm+copy-kv")
# With the hidden-norm mode's fused op (built by .hidden): the implementations the short table has columns for.
PROLOGUE_IMPLS = PROLOGUE_KV_IMPLS + PROLOGUE_NORM_IMPLS + ("ropekit-hidden-norm",) + KV_STEP_IMPLS + STEP_IMPLS


# ---------------------------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------------------------

def build_copy_kv(inp: Inputs) -> Bench:
    """``copy-kv``: one Triton kernel moving the bytes ``rope_kv_write`` must move: read q, k and v (the same
    strided views), write q to a preallocated output and k and v to the cache rows of each token (cast to the
    cache dtype, no scale), reading the same position data. One program per token."""
    if triton is None:
        raise Unsupported("triton not importable")
    _need_triton_device(inp.device)
    c = inp.case
    q, k, v = inp.q, inp.k, inp.v
    if q.stride(0) != c.seqlen * q.stride(1) or k.stride() != v.stride():
        raise Unsupported("copy-kv reads q, k and v as views of one packed [B, S, W] buffer")
    q_out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    pos = inp.positions
    if isinstance(pos, Tensor):
        pos_kind, pos_ptr, offset = (1 if c.positions == "batch" else 2), pos, 0
    else:
        pos_kind, pos_ptr, offset = 0, inp.cache_index[1], int(pos or 0)  # pointer unused
    kc, vc = inp.k_cache, inp.v_cache
    qw, kw = c.hq * c.head_dim, c.hk * c.head_dim
    grid = (c.tokens,)

    def launch() -> None:
        _copy_kv_kernel[grid](q, k, v, q_out, kc, vc, pos_ptr, offset, c.seqlen, q.stride(1), k.stride(1),
                              kc.stride(0), kc.stride(1), QW=qw, KW=kw, QB=triton.next_power_of_2(qw),
                              KB=triton.next_power_of_2(kw), POS_KIND=pos_kind, num_warps=4)

    pos_bytes = pos.numel() * pos.element_size() if isinstance(pos, Tensor) else 0
    nbytes = 2 * q.numel() * q.element_size() + 2 * k.numel() * (k.element_size() + kc.element_size()) + pos_bytes
    return Bench(run=launch, bytes=nbytes, note="one Triton kernel: q to a buffer, k and v to the cache rows (a "
                                                "cast, no norm, rotation or scale)")


def build_copy_5pass(inp: Inputs, nbytes: dict[str, int]) -> Bench:
    b = _flat_copy(inp, nbytes["norm-fwdbwd"])
    b.note = "ideal qk_norm_rope fwd+bwd: one copy of 5 passes over q and k"
    return b


# ---------------------------------------------------------------------------------------------------------------
# rope_kv_write and the unfused chain (KV modes)
# ---------------------------------------------------------------------------------------------------------------

def _kv_bench(inp: Inputs, call: Callable[[], Tensor], note: str) -> Bench:
    """``call`` writes the case's caches and returns q; the check reads q and the cache rows of the tokens."""
    fp8 = inp.cache_scale is not None

    def result() -> tuple[Tensor, ...]:
        inp.k_cache.fill_(float("nan"))
        inp.v_cache.fill_(float("nan"))
        q_out = call()
        return (q_out.reshape(inp.case.tokens, inp.case.hq, inp.case.head_dim), *inp.cache_rows())

    return Bench(run=call, result=result, note=note, tolerances=(None, FP8_MISMATCH, FP8_MISMATCH) if fp8 else None)


def _fp8_q_kv_bench(inp: Inputs, dynamic: bool) -> Bench:
    """rope_kv_write with a float8_e4m3fn q for FP8 attention: a static 0-d scale (calibrated once from the bf16
    op's q: its amax over 448), or per-(token, head) scales computed in the same launch. The check dequantises q
    (times its scale) and holds it, like fp8 cache rows, to one e4m3 step."""
    import ropekit

    q, k, v, kw = inp.kv_call()
    if dynamic:
        scale = "dynamic"
    else:
        calibration = ropekit.rope_kv_write(q, k, v, inp.k_cache, inp.v_cache, **kw)
        scale = (calibration.float().abs().amax() / 448.0).clamp_min(1e-12).reshape(())

    def call() -> Tensor:
        return ropekit.rope_kv_write(q, k, v, inp.k_cache, inp.v_cache, out_dtype=FP8, q_out_scale=scale, **kw)

    def result() -> tuple[Tensor, ...]:
        inp.k_cache.fill_(float("nan"))
        inp.v_cache.fill_(float("nan"))
        out = call()
        q8, q_scale = out if dynamic else (out, scale)
        c = inp.case
        if dynamic:
            q_scale = q_scale.reshape(*q_scale.shape, 1)
        q_deq = (q8.float() * q_scale).reshape(c.tokens, c.hq, c.head_dim)
        return (q_deq, *inp.cache_rows())

    fp8_cache = inp.cache_scale is not None
    how = "per-(token, head) scales computed in the launch" if dynamic else "a static 0-d tensor scale"
    return Bench(run=call, result=result, note=f"one launch, float8_e4m3fn q with {how} (q within one e4m3 step: "
                                               f"max_rel_diff <= {FP8_MISMATCH}); " + _kv_note(inp),
                 tolerances=(FP8_MISMATCH, FP8_MISMATCH if fp8_cache else None, FP8_MISMATCH if fp8_cache else None))


def _paged_caches(inp: Inputs, layout: str) -> tuple[Tensor, Tensor]:
    """The case's bshd caches' memory seen as pages of ``layout``: the same bytes, so the paged rows' writes cost
    what the bshd rows' do bar their addresses, and graph modes' input sets share them (as they share the caches).
    "paged" [N, 16, Hkv, D]; "paged_hnd" [N, Hkv, 16, D]; "paged_x" keys [N, Hkv, D/x, 16, x] (x = 16 bytes / the
    cache element) and values [N, Hkv, D, 16]."""
    kc, vc = inp.k_cache, inp.v_cache
    B, L, H, D = kc.shape
    n = B * L // PAGE_ROWS
    if layout == "paged":
        return kc.view(n, PAGE_ROWS, H, D), vc.view(n, PAGE_ROWS, H, D)
    if layout == "paged_hnd":
        return kc.view(n, H, PAGE_ROWS, D), vc.view(n, H, PAGE_ROWS, D)
    x = 16 // kc.element_size()
    return kc.view(n, H, D // x, PAGE_ROWS, x), vc.view(n, H, D, PAGE_ROWS)


def _paged_rows(layout: str, k_pages: Tensor, v_pages: Tensor, page: Tensor, row: Tensor) -> tuple[Tensor, Tensor]:
    """Each token's K and V rows [T, Hkv, D] at (page, row) of caches in ``layout``."""
    if layout == "paged":
        return k_pages[page, row], v_pages[page, row]
    if layout == "paged_hnd":
        return k_pages[page, :, row], v_pages[page, :, row]
    k = k_pages[page, :, :, row]  # [T, Hkv, D/x, x]
    return k.reshape(*k.shape[:2], -1), v_pages[page, :, :, row]


def _paged_kv_bench(inp: Inputs, name: str) -> Bench:
    """rope_kv_write into shuffled 16-row pages (each sequence owns its pages in a random order over the cache)
    of the layout ``PAGED_KV_FORMATS[name]`` names, found by slot_mapping or through FlashInfer's page table
    (kv_indices, kv_indptr, kv_last_page_len: each sequence's pages up to its last token). The check reads each
    token's rows back from the pages, so they compare with ``ropekit-kv-write``'s bshd rows."""
    import ropekit

    layout, find = PAGED_KV_FORMATS[name]
    c = inp.case
    k_pages, v_pages = _paged_caches(inp, layout)
    q, k, v, kw = inp.kv_call()
    B, max_len = inp.k_cache.shape[:2]
    gen = torch.Generator().manual_seed(int(inp.pos_grid.sum()))  # another input set: other pages
    pages = torch.randperm(B * max_len // PAGE_ROWS, generator=gen).view(B, -1)
    grid = inp.pos_grid.cpu()  # [B, S]
    page = pages.gather(1, grid // PAGE_ROWS)
    row = (grid % PAGE_ROWS).reshape(-1).to(inp.device)
    if find == "slots":
        slots = (page * PAGE_ROWS + grid % PAGE_ROWS).to(inp.device)
        kw.update(slot_mapping=slots.reshape(-1) if q.dim() == 3 else slots)
    else:
        used = grid[:, -1] // PAGE_ROWS + 1  # positions grow along a sequence: its last token's page is its last
        indices = torch.cat([pages[b, :n] for b, n in enumerate(used.tolist())])
        indptr = torch.cat([used.new_zeros(1), used.cumsum(0)])
        kw.update(kv_indices=indices.to(inp.device, torch.int32), kv_indptr=indptr.to(inp.device, torch.int32),
                  kv_last_page_len=(grid[:, -1] % PAGE_ROWS + 1).to(inp.device, torch.int32))
    page = page.reshape(-1).to(inp.device)

    def call() -> Tensor:
        return ropekit.rope_kv_write(q, k, v, k_pages, v_pages, cache_layout=layout, **kw)

    def result() -> tuple[Tensor, ...]:
        k_pages.fill_(float("nan"))
        v_pages.fill_(float("nan"))
        q_out = call().reshape(c.tokens, c.hq, c.head_dim)
        rows = _paged_rows(layout, k_pages, v_pages, page, row)
        if inp.cache_scale is not None:
            rows = tuple(r.float() * inp.cache_scale for r in rows)
        return (q_out, *rows)

    fp8 = inp.cache_scale is not None
    how = "slot_mapping" if find == "slots" else "FlashInfer's page table (kv_indices, kv_indptr, kv_last_page_len)"
    return Bench(run=call, result=result, tolerances=(None, FP8_MISMATCH, FP8_MISMATCH) if fp8 else None,
                 note=f"one launch into {layout} pages of {PAGE_ROWS} rows found by {how}; "
                      + _kv_note(inp).replace("bshd ", ""))


def _unfused_kv(inp: Inputs) -> Callable[[], Tensor]:
    """torch ``rms_norm`` of q and k (models with qk_norm), ``ropekit.apply_rope``, then the cache scatter by
    advanced indexing (fp8: ``(x.float() / scale).clamp(-448, 448)`` converted to e4m3)."""
    import ropekit

    c = inp.case
    kw = inp.rope_kwargs()
    T, D = c.tokens, c.head_dim
    b, p = inp.cache_index
    q, k, v, kc, vc, scale = inp.q, inp.k, inp.v, inp.k_cache, inp.v_cache, inp.cache_scale
    v_rows = v.reshape(T, c.hk, D)  # a view: v's rows are equally spaced in the packed buffer

    def store(cache: Tensor, x: Tensor) -> None:
        if scale is not None:
            x = (x.float() / scale).clamp(-448, 448).to(FP8)
        cache[b, p] = x

    def call() -> Tensor:
        qq, kk = q, k
        if inp.q_weight is not None:
            qq = torch.nn.functional.rms_norm(q, (D,), inp.q_weight, NORM_EPS)
            kk = torch.nn.functional.rms_norm(k, (D,), inp.k_weight, NORM_EPS)
        q_rot, k_rot = ropekit.apply_rope(qq, kk, **kw)
        store(kc, k_rot.reshape(T, c.hk, D))
        store(vc, v_rows)
        return q_rot

    return call


def _kv_note(inp: Inputs) -> str:
    c = inp.case
    cache = (f"fp8 e4m3 caches, 0-d tensor scale (rows agree within one e4m3 step: max_rel_diff <= "
             f"{FP8_MISMATCH})") if c.cache == "fp8" else f"{c.cache} caches"
    return f"bshd {cache}" + ("; per-head RMSNorm" if c.qk_norm else "")


# ---------------------------------------------------------------------------------------------------------------
# The decode step: QKV projection GEMM, then the prologue (kv-step)
# ---------------------------------------------------------------------------------------------------------------

def _qkv_projection(inp: Inputs) -> Callable[[], Tensor]:
    """``torch.mm(x, W_qkv, out=qkv)``: x [T, Hq * D] (the hidden state; 4096 for Llama-3-8B and Qwen3-8B) and
    W_qkv [Hq * D, (Hq + 2 Hk) * D] in the case's dtype, seeded by the input set (every implementation of a set
    computes the same q, k and v), written into the packed buffer the case's q, k and v are views of."""
    c = inp.case
    width = (c.hq + 2 * c.hk) * c.head_dim
    k_at = inp.q.data_ptr() + c.hq * c.head_dim * inp.q.element_size()
    if inp.v is None or inp.q.stride()[:2] != (c.seqlen * width, width) or inp.k.data_ptr() != k_at:
        raise Unsupported("kv-step writes q, k and v as views of one packed [T, (Hq + 2 Hk) D] buffer")
    qkv = inp.q.as_strided((c.tokens, width), (width, 1))  # q's storage from its first element: the whole buffer
    gen = torch.Generator(device=inp.device).manual_seed(int(inp.pos_grid.sum()))  # another input set: others
    hidden = c.hq * c.head_dim
    x = torch.randn(c.tokens, hidden, generator=gen, device=inp.device, dtype=inp.dtype)
    w = torch.randn(hidden, width, generator=gen, device=inp.device, dtype=inp.dtype) / hidden ** 0.5  # N(0, 1) out
    return lambda: torch.mm(x, w, out=qkv)


def build_kv_step(name: str, inp: Inputs) -> Bench:
    """``kv-step``: the QKV projection GEMM (:func:`_qkv_projection`) alone (``gemm``, the baseline), or followed
    by ``rope_kv_write`` (``-pdl``: with ``ropekit._config.pdl_launches``), the copy of its bytes (``copy-kv``, the
    floor) or the unfused chain. The check runs the whole step."""
    if inp.k_cache is None:
        raise Unsupported("KV modes only (the case has no caches)")
    pdl = name.endswith("-pdl")
    if pdl and inp.device.type == "cuda":
        from ropekit.triton import runtime

        if not runtime.pdl_supported(inp.device):
            raise Unsupported("programmatic dependent launch needs compute capability 9.0+ and a Triton with "
                              "launch_pdl")
    gemm = _qkv_projection(inp)
    if name == "gemm":
        c = inp.case
        hidden, width = c.hq * c.head_dim, (c.hq + 2 * c.hk) * c.head_dim
        return Bench(run=gemm, bytes=(c.tokens * hidden + hidden * width + c.tokens * width) * inp.q.element_size(),
                     note=f"torch.mm(x, W_qkv, out=qkv): x [T, {hidden}], W_qkv [{hidden}, {width}], into the "
                          "buffer q, k and v are views of")
    prologue = build_prologue(name.removeprefix("gemm+").removesuffix("-pdl"), inp, "kv-decode") \
        if name != "gemm+copy-kv" else build_copy_kv(inp)

    def step():
        gemm()
        if not pdl:
            return prologue.run()
        from ropekit import _config

        previous, _config.pdl_launches = _config.pdl_launches, True
        try:
            return prologue.run()
        finally:
            _config.pdl_launches = previous

    def result() -> tuple[Tensor, ...]:
        inp.k_cache.fill_(float("nan"))
        inp.v_cache.fill_(float("nan"))
        q_out = step()
        return (q_out.reshape(inp.case.tokens, inp.case.hq, inp.case.head_dim), *inp.cache_rows())

    how = ("; launched with PDL (ropekit._config.pdl_launches)" if inp.device.type == "cuda"
           else "; PDL asked for (ignored off CUDA)") if pdl else ""
    return Bench(run=step, result=None if name == "gemm+copy-kv" else result, tolerances=prologue.tolerances,
                 note=f"the QKV GEMM, then {prologue.note}{how}")


# ---------------------------------------------------------------------------------------------------------------
# qk_norm_rope fwd+bwd and the unfused PyTorch code (norm-fwdbwd)
# ---------------------------------------------------------------------------------------------------------------

def _norm_leaves(inp: Inputs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(t.detach().clone().requires_grad_(True) for t in (inp.q, inp.k, inp.q_weight, inp.k_weight))


def _norm_autograd_bench(inp: Inputs, forward: Callable[..., tuple[Tensor, Tensor]], note: str) -> Bench:
    """fwd+bwd: ``forward(q, k, q_weight, k_weight)`` on leaf copies, then ``torch.autograd.grad`` of all four with
    preallocated output gradients (nothing accumulates into ``.grad``)."""
    leaves = _norm_leaves(inp)
    gq, gk = _grad_outputs(inp)

    def run() -> tuple[Tensor, ...]:
        return torch.autograd.grad(forward(*leaves), leaves, (gq, gk))

    def result() -> tuple[Tensor, ...]:
        fresh = _norm_leaves(inp)
        return tuple(torch.autograd.grad(forward(*fresh), fresh, (gq.clone(), gk.clone())))

    return Bench(run=run, result=result, note=note)


def _training_step(name: str, inp: Inputs) -> Bench:
    """Host mode: a training step's host time (the mode runs without autograd; the step turns it on). apply_rope's
    step rotates the same q and k with the same rope arguments, without the norm: what the norm's step adds."""
    import ropekit

    kw = inp.rope_kwargs()
    q, k, qw, kwt = _norm_leaves(inp)
    grads = _grad_outputs(inp)
    if name == "ropekit-step":
        forward, leaves = (lambda: ropekit.apply_rope(q, k, **kw)), (q, k)
        note = "apply_rope, then torch.autograd.grad of q and k (same rope arguments)"
    else:
        forward, leaves = (lambda: ropekit.qk_norm_rope(q, k, qw, kwt, eps=NORM_EPS, **kw)), (q, k, qw, kwt)
        note = "qk_norm_rope, then torch.autograd.grad of q, k and both weights"

    def run() -> tuple[Tensor, ...]:
        with torch.enable_grad():
            return torch.autograd.grad(forward(), leaves, grads)

    return Bench(run=run, result=None, note=note)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def unfused_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
                      eps: float = NORM_EPS) -> tuple[Tensor, Tensor]:
    """Qwen3's attention prologue in PyTorch: ``rms_norm`` per head, then transformers' rotate_half RoPE with
    cos/sin tables [Bc, S, 1, D] (bshd)."""
    D = q.shape[-1]
    qn = torch.nn.functional.rms_norm(q, (D,), q_weight, eps)
    kn = torch.nn.functional.rms_norm(k, (D,), k_weight, eps)
    return qn * cos + _rotate_half(qn) * sin, kn * cos + _rotate_half(kn) * sin


# ---------------------------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------------------------

def build_prologue(name: str, inp: Inputs, mode: str) -> Bench:
    import ropekit

    c = inp.case
    if name in PROLOGUE_KV_IMPLS:
        if inp.k_cache is None:
            raise Unsupported("KV modes only (the case has no caches)")
        if name == "ropekit-kv-write":
            q, k, v, kw = inp.kv_call()
            return _kv_bench(inp, lambda: ropekit.rope_kv_write(q, k, v, inp.k_cache, inp.v_cache, **kw),
                             "one launch; " + _kv_note(inp))
        if name.startswith("ropekit-kv-write-fp8q"):
            return _fp8_q_kv_bench(inp, dynamic=name.endswith("dynamic"))
        if name in PAGED_KV_FORMATS:
            return _paged_kv_bench(inp, name)
        return _kv_bench(inp, _unfused_kv(inp), ("torch rms_norm x2 + " if c.qk_norm else "")
                         + "ropekit.apply_rope + cache scatter by indexing; " + _kv_note(inp))
    if inp.q_weight is None:
        raise Unsupported("qk_norm_rope needs a model with qk_norm")
    if name in STEP_IMPLS:
        return _training_step(name, inp)
    if name in ("ropekit-qk-norm", "ropekit-qk-norm-graph"):
        if name == "ropekit-qk-norm-graph" and inp.device.type != "cuda":
            raise Unsupported("CUDA graphs: CUDA only")
        kw = inp.rope_kwargs()
        bench = _norm_autograd_bench(
            inp, lambda q, k, qw, kwt: ropekit.qk_norm_rope(q, k, qw, kwt, eps=NORM_EPS, **kw),
            "qk_norm_rope through autograd (gradients of q, k and both weights)")
        if name == "ropekit-qk-norm":
            return bench
        graph = capture_graph(bench.run, calls=1)
        # the eager step is host-bound below about 8x4096 tokens on a shared host: this row is its kernels alone
        return Bench(run=graph.replay, result=bench.result, note=bench.note + ", one step replayed from a CUDA graph")
    if name in ("unfused-eager", "unfused-compile"):
        if c.style != "neox" or c.rotary_dim != c.head_dim or inp.layout != "bshd" or c.positions == "mrope":
            raise Unsupported("the unfused code rotates full-width NeoX (rotate_half) pairs of bshd tensors")
        cos, sin = (t.unsqueeze(2) for t in inp.hf_tables())  # [Bc, S, 1, D] in the input dtype
        fn = unfused_norm_rope
        note = "torch rms_norm x2 + transformers-style rotate_half RoPE, cos/sin [Bc, S, 1, D] in the input dtype"
        if name == "unfused-compile":
            fn = compiled_per_case(unfused_norm_rope, c.name, mode)
            note = "torch.compile(fullgraph, static shapes) of " + note
        bench = _norm_autograd_bench(inp, lambda q, k, qw, kwt: fn(q, k, qw, kwt, cos, sin), note)
        if name == "unfused-compile":  # compile the forward and the backward outside the timed region
            t0 = time.perf_counter()
            bench.run()
            _sync(inp.device)
            bench.note += f"; compiled in {time.perf_counter() - t0:.1f} s"
        return bench
    raise ValueError(name)


if triton is not None:
    @triton.jit
    def _copy_kv_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, pos_ptr, pos_offset, S, q_st, kv_st, c_sb,
                        c_ss, QW: tl.constexpr, KW: tl.constexpr, QB: tl.constexpr, KB: tl.constexpr,
                        POS_KIND: tl.constexpr):
        """One program per token t = b * S + s: q's row to q_out, k's and v's rows to the caches' row [b, pos]
        (bshd). POS_KIND 0: pos = pos_offset + s; 1: pos_ptr[b] + s (per-sequence offsets); 2: pos_ptr[t]."""
        t = tl.program_id(0)
        b = t // S
        s = t % S
        if POS_KIND == 0:
            pos = (pos_offset + s).to(tl.int64)
        elif POS_KIND == 1:
            pos = tl.load(pos_ptr + b).to(tl.int64) + s
        else:
            pos = tl.load(pos_ptr + t).to(tl.int64)
        t64 = t.to(tl.int64)
        iq = tl.arange(0, QB)
        x = tl.load(q_ptr + t64 * q_st + iq, mask=iq < QW)
        tl.store(qo_ptr + t64 * QW + iq, x, mask=iq < QW)
        ik = tl.arange(0, KB)
        row = b.to(tl.int64) * c_sb + pos * c_ss
        kx = tl.load(k_ptr + t64 * kv_st + ik, mask=ik < KW)
        vx = tl.load(v_ptr + t64 * kv_st + ik, mask=ik < KW)
        tl.store(kc_ptr + row + ik, kx.to(kc_ptr.dtype.element_ty), mask=ik < KW)
        tl.store(vc_ptr + row + ik, vx.to(vc_ptr.dtype.element_ty), mask=ik < KW)
else:  # pragma: no cover
    _copy_kv_kernel = None
