"""Implementation builders: the baselines, ropekit's entry points and the peers, each prepared as a :class:`Bench`
(what is timed, and fresh outputs for the check against ropekit). The attention prologue's (KV modes,
norm-fwdbwd) are in :mod:`.prologue`, the MLA prologue's (MLA modes) in :mod:`.mla`, the diffusion transformers'
(hidden-norm-fwd) in :mod:`.hidden` and those of RoPE fused into attention (attn-fwd, attn-fwdbwd) in
:mod:`.attention`, which :func:`build` dispatches to; what they all build on is in :mod:`.base`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._triton import tl, triton
from .attention import ATTN_BASELINE, ATTN_IMPLS, build_attention
from .base import Bench, Unsupported, _flat_copy, _grad_outputs, _need_triton_device, compiled_per_case
from .base import forget_compiles as forget_compiles  # the run loop calls it through this module
from .cases import ATTN_MODES, HIDDEN_NORM_MODES
from .hidden import HIDDEN_NORM_IMPLS, build_copy_qkv, build_hidden
from .inputs import Inputs
from .mla import MLA_IMPLS, build_copy_mla, build_mla
from .peers import Peers
from .prologue import (
    KV_STEP_BASELINES,
    KV_STEP_IMPLS,
    PROLOGUE_IMPLS,
    PROLOGUE_KV_IMPLS,
    PROLOGUE_NORM_IMPLS,
    STEP_IMPLS,
    build_copy_5pass,
    build_copy_kv,
    build_kv_step,
    build_prologue,
)
from .timing import _sync

# The baseline each mode's ratio_vs_copy divides by, and extra reference rows timed in that mode.
BASELINE = {"fwd": "copy", "fwdbwd": "copy-4pass", "decode": "copy-q", "host": "add_", "kv-decode": "copy-kv",
            "kv-prefill": "copy-kv", "norm-fwdbwd": "copy-5pass", "attn-fwd": ATTN_BASELINE,
            "attn-fwdbwd": ATTN_BASELINE, "mla-decode": "copy-mla", "mla-prefill": "copy-mla",
            "hidden-norm-fwd": "copy-qkv", "kv-step": KV_STEP_BASELINES[0]}
# fwd's "copy-fp8out" moves the bytes of apply_rope with float8 outputs and in-launch scales ("ropekit-fp8qk-dynamic")
EXTRA_BASELINES = {"fwd": ("copy-fp8out",), "decode": ("copy",), "host": ("triton-launch",),
                   "kv-step": KV_STEP_BASELINES[1:]}
FP8_DYNAMIC = "ropekit-fp8qk-dynamic"  # apply_rope to float8 q and k, a scale per (token, head) from the launch
ROPEKIT_IMPLS = ("ropekit", "ropekit-table", "ropekit_", "ropekit-launcher", "ropekit-hf", "ropekit-1d", FP8_DYNAMIC)
_UNQUANTISED = ROPEKIT_IMPLS[:-1]
PEER_IMPLS = ("hf", "hf-compile", "liger", "flash-attn")
FORWARD_PEER_IMPLS = ("helion",)  # forward only: our own Helion kernels (.helion_peers)
MODE_IMPLS = {
    "fwd": ("ropekit", "ropekit-table", "ropekit_", "ropekit-hf", "ropekit-1d", FP8_DYNAMIC) + PEER_IMPLS
    + FORWARD_PEER_IMPLS,
    "fwdbwd": ("ropekit", "ropekit-table", "ropekit-hf") + PEER_IMPLS,
    "decode": _UNQUANTISED + PEER_IMPLS + FORWARD_PEER_IMPLS,
    "host": _UNQUANTISED + PEER_IMPLS + STEP_IMPLS,
    "kv-decode": PROLOGUE_KV_IMPLS,
    "kv-prefill": PROLOGUE_KV_IMPLS,
    "norm-fwdbwd": PROLOGUE_NORM_IMPLS,
    "attn-fwd": ATTN_IMPLS,
    "attn-fwdbwd": ATTN_IMPLS,
    "mla-decode": MLA_IMPLS,
    "mla-prefill": MLA_IMPLS,
    "hidden-norm-fwd": HIDDEN_NORM_IMPLS,
    "kv-step": KV_STEP_IMPLS,
}
# The implementation every other one of a mode is checked against (its outputs are the reference).
REFERENCE = {"kv-decode": "ropekit-kv-write", "kv-prefill": "ropekit-kv-write", "norm-fwdbwd": "ropekit-qk-norm",
             "mla-decode": "ropekit-mla-kv-write", "mla-prefill": "ropekit-mla-kv-write",
             "hidden-norm-fwd": "ropekit-hidden-norm", "kv-step": KV_STEP_IMPLS[0]}


def build_baseline(name: str, inp: Inputs, nbytes: dict[str, int], mode: str | None = None) -> Bench:
    """The baseline ``name`` of ``mode`` (the copies need only the bytes; the attention modes' baseline times the
    same work as the implementations, forward or forward and backward)."""
    if name == ATTN_BASELINE:
        return build_attention(name, inp, mode)
    if name in KV_STEP_BASELINES:
        return build_kv_step(name, inp)
    if name == "copy":
        return _flat_copy(inp, nbytes["fwd"])
    if name == "copy-4pass":
        b = _flat_copy(inp, nbytes["fwdbwd"])
        b.note = "ideal fwd+bwd: one copy of 4 passes over q and k"
        return b
    if name == "copy-q":
        q_out = torch.empty_like(inp.q)
        return Bench(run=lambda: q_out.copy_(inp.q), bytes=2 * inp.q.numel() * inp.q.element_size(),
                     note="one copy_ of q alone (a device-to-device memcpy)")
    if name == "copy-mla":
        return build_copy_mla(inp)
    if name == "copy-qkv":
        return build_copy_qkv(inp, nbytes)
    if name == "copy-fp8out":
        return _copy_fp8_out(inp, nbytes)
    if name in ("copy-kv", "copy-5pass"):
        return build_copy_kv(inp) if name == "copy-kv" else build_copy_5pass(inp, nbytes)
    if name == "add_":
        x = torch.zeros_like(inp.q)
        return Bench(run=lambda: x.add_(1), note="x.add_(1), x shaped like q")
    if name == "triton-launch":
        if _empty_kernel is None:
            raise Unsupported("triton not importable")
        _need_triton_device(inp.device)
        x = torch.zeros(1, device=inp.device)

        def launch() -> None:
            _empty_kernel[(1,)](x, 3, 5, 7, 9, 11, 13, 15, 17, 19)

        return Bench(run=launch, note="a bare kernel[grid](...) launch with 10 arguments")
    raise ValueError(name)


def _copy_fp8_out(inp: Inputs, nbytes: dict[str, int]) -> Bench:
    """One copy of what apply_rope with float8 outputs and dynamic scales moves: fwd's bytes less a byte of each
    output element below the input dtype's, plus a float32 scale per (token, head) of q and k."""
    rows = inp.q.numel() // inp.q.shape[-1] + inp.k.numel() // inp.k.shape[-1]
    outputs = (inp.q.numel() + inp.k.numel()) * (inp.q.element_size() - 1)
    b = _flat_copy(inp, nbytes["fwd"] - outputs + 4 * rows)
    b.note = "one copy of the bytes of apply_rope with float8 q and k and a float32 scale per (token, head)"
    return b


def _fp8_dynamic(inp: Inputs, kw: dict[str, Any]) -> Bench:
    """apply_rope to float8_e4m3fn q and k with per-(token, head) scales computed in the launch; the check
    dequantises them (times their scales) and holds them to one e4m3 step of ropekit's."""
    import ropekit

    from .prologue import FP8, FP8_MISMATCH

    def call() -> tuple[Tensor, ...]:
        return ropekit.apply_rope(inp.q, inp.k, out_dtype=FP8, q_out_scale="dynamic", **kw)

    def result() -> tuple[Tensor, Tensor]:
        q8, k8, q_scales, k_scales = call()
        return q8.float() * q_scales.unsqueeze(-1), k8.float() * k_scales.unsqueeze(-1)

    return Bench(run=call, result=result, tolerances=(FP8_MISMATCH, FP8_MISMATCH),
                 note=f"float8_e4m3fn q and k, a scale per (token, head) from the same launch (within one e4m3 step: "
                      f"max_rel_diff <= {FP8_MISMATCH})")


def _leaves(inp: Inputs) -> tuple[Tensor, Tensor]:
    return inp.q.detach().clone().requires_grad_(True), inp.k.detach().clone().requires_grad_(True)


def _autograd_bench(inp: Inputs, forward: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
                    grads_in_hf_layout: bool = False) -> Bench:
    """fwd+bwd: ``forward`` on leaf copies of q and k, then ``torch.autograd.grad`` with preallocated output
    gradients (no accumulation into ``.grad``)."""
    q_l, k_l = _leaves(inp)
    gq, gk = _grad_outputs(inp)
    if grads_in_hf_layout:
        gq, gk = inp.to_hf(gq), inp.to_hf(gk)

    def run() -> tuple[Tensor, Tensor]:
        outs = forward(q_l, k_l)
        return torch.autograd.grad(outs, (q_l, k_l), (gq, gk))

    def result() -> tuple[Tensor, Tensor]:
        # Fresh leaves and gradient copies: some peers write into their inputs or incoming gradients.
        ql, kl = _leaves(inp)
        outs = forward(ql, kl)
        return tuple(torch.autograd.grad(outs, (ql, kl), (gq.clone(), gk.clone())))

    return Bench(run=run, result=result)


def build_ropekit(name: str, inp: Inputs, mode: str, peers: Peers) -> Bench:
    """ropekit's entry points."""
    import ropekit

    c = inp.case
    kw = inp.rope_kwargs()
    mrope = c.positions == "mrope"
    if name == "ropekit-1d":  # the yardstick of multi-axis calls: the same call with one axis's positions
        if not mrope:
            raise Unsupported("only for multi-axis cases: the same call with axis 0's per-token positions")
        kw = {key: v for key, v in kw.items() if key not in ("sections", "section_layout")}
        kw["positions"] = inp.pos_grid
        fn = lambda: ropekit.apply_rope(inp.q, inp.k, **kw)  # noqa: E731
        return Bench(run=fn, result=None, note="1-D per-token positions (axis 0), same shapes")
    if name == "ropekit-table":
        if mrope:
            raise Unsupported("cos/sin tables are indexed by one position per token")
        kw = dict(kw, base=10000.0, cos=inp.cos_tab, sin=inp.sin_tab)
    if name in ("ropekit", "ropekit-table"):
        note = "exact in-kernel angles" if name == "ropekit" else "fp32 cos/sin tables [P, R/2]"
        if mode == "fwdbwd":
            b = _autograd_bench(inp, lambda q, k: ropekit.apply_rope(q, k, **kw))
            b.note = note
            return b
        fn = lambda: ropekit.apply_rope(inp.q, inp.k, **kw)  # noqa: E731
        return Bench(run=fn, result=fn, note=note)
    if name == "ropekit_":
        q2, k2 = inp.q.clone(), inp.k.clone()

        def result() -> tuple[Tensor, Tensor]:
            return ropekit.apply_rope_(inp.q.clone(), inp.k.clone(), **kw)

        return Bench(run=lambda: ropekit.apply_rope_(q2, k2, **kw), result=result, note="in place")
    if name == "ropekit-launcher":
        return build_launcher(inp)
    if name == FP8_DYNAMIC:
        if mode != "fwd":
            raise Unsupported("float8 outputs are inference only: the fwd mode")
        return _fp8_dynamic(inp, kw)
    if name == "ropekit-hf":
        if peers.ropekit_hf is None:
            raise Unsupported(peers.missing.get("ropekit-hf", "absent"))
        if c.style != "neox" or c.rotary_dim != c.head_dim:
            raise Unsupported("the transformers drop-in takes transformers' full-width NeoX cos/sin")
        return _hf_style_bench(inp, mode, peers.ropekit_hf, note="transformers drop-in, cos/sin as transformers")
    raise ValueError(name)


def build_launcher(inp: Inputs) -> Bench:
    """``ropekit-launcher``: the raw Triton launcher with preallocated outputs (no validation or dispatch). The one
    place the harness calls ropekit below its public API."""
    c = inp.case
    if triton is None:
        raise Unsupported("triton not importable")
    _need_triton_device(inp.device)
    from ropekit._validation import validate
    from ropekit.triton.launcher import launch_rope

    spec = validate(inp.q, inp.k, positions=inp.positions, inv_freq=inp.inv_freq, style=c.style, layout=inp.layout,
                    rotary_dim=c.rotary_dim, rotary_at="back" if inp.rotary_start else "front",
                    cu_seqlens=inp.cu_seqlens, sections=c.sections if c.positions == "mrope" else None,
                    section_layout=c.section_layout if c.positions == "mrope" else "contiguous")
    q_out, k_out = torch.empty_like(inp.q), torch.empty_like(inp.k)

    def launch() -> None:
        launch_rope(inp.q, inp.k, q_out, k_out, spec)

    def result() -> tuple[Tensor, Tensor]:
        qo, ko = torch.empty_like(inp.q), torch.empty_like(inp.k)
        launch_rope(inp.q, inp.k, qo, ko, spec)
        return qo, ko

    return Bench(run=launch, result=result, note="raw launcher, preallocated outputs, exact angles")


def _hf_function(inp: Inputs, peers: Peers) -> tuple[Callable, str]:
    """transformers' function for the case's pairing, wrapped for a partial rotary span the way transformers'
    models do it (slice, rotate, concatenate)."""
    c = inp.case
    if c.style == "neox":
        fn, note = peers.hf_neox, "Llama apply_rotary_pos_emb"
        if fn is None:
            raise Unsupported(peers.missing.get("hf", "absent"))
    else:
        fn, note = peers.hf_interleaved, "Cohere apply_rotary_pos_emb (interleaved pairing, fp32 math)"
        if fn is None:
            raise Unsupported(peers.missing.get("hf (interleaved)", peers.missing.get("hf", "absent")))
    if c.rotary_dim == c.head_dim:
        return fn, note
    lo = inp.rotary_start
    hi = lo + c.rotary_dim

    def partial(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        qr, kr = fn(q[..., lo:hi], k[..., lo:hi], cos, sin)
        return (torch.cat([q[..., :lo], qr, q[..., hi:]], dim=-1),
                torch.cat([k[..., :lo], kr, k[..., hi:]], dim=-1))

    return partial, note + "; partial rotary by slice + cat"


def _hf_style_bench(inp: Inputs, mode: str, fn: Callable, note: str, inplace: bool = False) -> Bench:
    """A function with transformers' calling convention: q/k [B, H, S, D] views of the case tensors, cos/sin
    [Bc, S, R] in the input dtype."""
    cos, sin = inp.hf_tables()
    if mode == "fwdbwd":
        b = _autograd_bench(inp, lambda q, k: fn(inp.to_hf(q), inp.to_hf(k), cos, sin), grads_in_hf_layout=True)
        b.note = note
        return b

    def result() -> tuple[Tensor, Tensor]:
        qo, ko = fn(inp.to_hf(inp.q.clone()), inp.to_hf(inp.k.clone()), cos, sin)
        return inp.from_hf(qo), inp.from_hf(ko)

    if inplace:  # rotate private copies over and over
        q2, k2 = inp.to_hf(inp.q.clone()), inp.to_hf(inp.k.clone())
    else:
        q2, k2 = inp.to_hf(inp.q), inp.to_hf(inp.k)
    return Bench(run=lambda: fn(q2, k2, cos, sin), result=result, note=note)


class _FlashRotaryFn(torch.autograd.Function):
    """Autograd around flash-attn's ``apply_rotary`` as its own layer does it: the backward is the same call with
    ``conjugate=True``."""

    @staticmethod
    def forward(ctx, x, apply_rotary, kwargs):  # noqa: D102
        ctx.apply_rotary, ctx.kwargs = apply_rotary, kwargs
        return apply_rotary(x, **kwargs)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return ctx.apply_rotary(grad, **ctx.kwargs, conjugate=True), None, None


def build_peer(name: str, inp: Inputs, mode: str, peers: Peers) -> Bench:
    """The peers, called with the same tensors (as views in their own layouts) and the same positions."""
    c = inp.case
    if name in ("hf", "hf-compile"):
        fn, note = _hf_function(inp, peers)
        if name == "hf-compile":
            fn = compiled_per_case(fn, c.name, mode)
            note = "torch.compile(fullgraph, static shapes) of " + note
        bench = _hf_style_bench(inp, mode, fn, note)
        if name == "hf-compile":  # compile outside the timed region
            t0 = time.perf_counter()
            bench.run()
            _sync(inp.device)
            bench.note += f"; compiled in {time.perf_counter() - t0:.1f} s"
        return bench
    if name == "liger" and c.positions == "mrope":
        if peers.liger_mrope is None:
            raise Unsupported(peers.missing.get("liger (M-RoPE)", "absent"))
        if c.section_layout != "contiguous":
            raise Unsupported("Liger's M-RoPE takes Qwen2-VL's contiguous sections only")
        cos3, sin3 = inp.hf_axis_tables()
        sections = list(c.sections)
        return _hf_style_bench(inp, mode, lambda q, k, cos, sin: peers.liger_mrope(q, k, cos3, sin3, sections),
                               "Qwen2-VL M-RoPE, per-axis cos/sin and mrope_section; in place", inplace=True)
    if name == "liger":
        if peers.liger is None:
            raise Unsupported(peers.missing.get("liger", "absent"))
        if c.style != "neox":
            raise Unsupported("Liger rotates NeoX pairs only")
        if c.rotary_at != "front":
            raise Unsupported("Liger rotates the leading columns only (no rotary_at='back')")
        return _hf_style_bench(inp, mode, peers.liger, "in place (writes into the caller's q/k); cos/sin as "
                               "transformers", inplace=True)
    if name == "flash-attn":
        if peers.flash is None:
            raise Unsupported(peers.missing.get("flash-attn", "absent"))
        if c.positions in ("ids", "mrope"):
            raise Unsupported("flash-attn's rotary takes offsets, not per-token position ids")
        if c.rotary_at != "front":
            raise Unsupported("flash-attn rotates the leading columns only (no rotary_at='back')")
        if c.head_dim > 256:
            raise Unsupported("flash-attn's rotary supports head_dim <= 256")
        offsets: Any = 0
        if isinstance(inp.positions, int):
            offsets = inp.positions
        elif c.positions == "batch":
            offsets = inp.positions
        kw = dict(cos=inp.cos_tab.to(inp.dtype), sin=inp.sin_tab.to(inp.dtype), seqlen_offsets=offsets,
                  cu_seqlens=inp.cu_seqlens, max_seqlen=inp.max_seqlen if inp.cu_seqlens is not None else None,
                  interleaved=c.style == "interleaved")
        apply_rotary = peers.flash
        note = "two launches (q, then k); cos/sin [P, R/2] in the input dtype"
        if mode == "fwdbwd":
            b = _autograd_bench(inp, lambda q, k: (_FlashRotaryFn.apply(q, apply_rotary, kw),
                                                   _FlashRotaryFn.apply(k, apply_rotary, kw)))
            b.note = note + "; autograd wrapper as flash-attn's layer (backward: conjugate=True)"
            return b
        fn = lambda: (apply_rotary(inp.q, **kw), apply_rotary(inp.k, **kw))  # noqa: E731
        return Bench(run=fn, result=fn, note=note)
    if name == "helion":
        return _helion_bench(inp, peers)
    raise ValueError(name)


def _helion_bench(inp: Inputs, peers: Peers) -> Bench:
    """Our own Helion NeoX kernel (q and k in one launch, fixed config); cos/sin gathered per token before timing,
    as the transformers-style peers get their tables."""
    c = inp.case
    if peers.helion is None:
        raise Unsupported(peers.missing.get("helion", "absent"))
    if c.style != "neox" or c.rotary_at != "front" or inp.cos_tab.shape[-1] * 2 != c.head_dim:
        raise Unsupported("the Helion peer rotates whole heads in NeoX pairs only")
    if inp.layout != "bshd" or c.positions == "mrope" or not (inp.q.is_contiguous() and inp.k.is_contiguous()):
        raise Unsupported("the Helion peer takes contiguous bshd q/k and one position per token")
    rows = inp.pos_grid.reshape(-1).to(inp.cos_tab.device)
    if rows.numel() * c.hq * c.head_dim != inp.q.numel():
        raise Unsupported("the Helion peer needs one position per token of q")
    cos, sin = inp.cos_tab[rows].contiguous(), inp.sin_tab[rows].contiguous()
    fn = lambda: peers.helion.helion_apply_rope(inp.q, inp.k, cos, sin)  # noqa: E731
    fn()  # compile outside the timed region
    _sync(inp.device)
    return Bench(run=fn, result=fn, note="one launch, fixed config; cos/sin [B*S, D/2] fp32 per token, gathered "
                 "before timing")


def build(name: str, inp: Inputs, mode: str, peers: Peers) -> Bench:
    if mode in ATTN_MODES:  # "ropekit" there is rope_attention
        return build_attention(name, inp, mode)
    if mode in HIDDEN_NORM_MODES:  # its unfused-* are the hidden norm's
        return build_hidden(name, inp, mode)
    if name in MLA_IMPLS:
        return build_mla(name, inp)
    if name in KV_STEP_IMPLS:
        return build_kv_step(name, inp)
    if name in PROLOGUE_IMPLS:
        return build_prologue(name, inp, mode)
    if name in ROPEKIT_IMPLS:
        return build_ropekit(name, inp, mode, peers)
    return build_peer(name, inp, mode, peers)


if triton is not None:
    @triton.jit
    def _empty_kernel(x_ptr, a0, a1, a2, a3, a4, a5, a6, a7, a8):
        """Does nothing (the store never runs): the price of a bare ``kernel[grid](...)`` launch."""
        if tl.program_id(0) < 0:
            tl.store(x_ptr, a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8)
else:  # pragma: no cover
    _empty_kernel = None
