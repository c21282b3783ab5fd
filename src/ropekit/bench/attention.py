"""RoPE fused into attention: ``ropekit.rope_attention`` (modes ``attn-fwd``, ``attn-fwdbwd``) against torch's
``scaled_dot_product_attention`` (cuDNN and flash backends) and ``flex_attention``, each alone (attention without
any rotation: the time RoPE would take if it were free) and after ``ropekit.apply_rope`` (the unfused chain a
user writes today; ``rope+sdpa-cudnn`` is the modes' baseline).

Every implementation gets the case's tensors q [B, Hq, S, D], k [B, Hk, S, D] and v [B, Hk, S, Dv] (layout
"bhsd", contiguous), the same positions and frequencies, the default attention scale 1/sqrt(D), the case's mask
(causal or none) and GQA (``enable_gqa=True``). fwd+bwd: the forward on leaf copies of q, k and v, then
``torch.autograd.grad`` of all three with one fixed random gradient of o (nothing accumulates into ``.grad``).

The check against ``ropekit`` compares o (fwd) or the gradients of q, k and v (fwd+bwd) of every implementation
that rotates; attention alone computes another function and is not checked.

On CPU (the smoke run) ropekit takes its float64 reference path, ``sdpa-*`` run torch's default SDPA backend
(cuDNN and flash need CUDA; the note says so) and flex is skipped (its CPU compile builds C++ for minutes).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from .base import Bench, Unsupported, compiled_per_case
from .inputs import Inputs, _randn
from .timing import _sync

ATTN_BASELINE = "rope+sdpa-cudnn"  # the baseline of the attention modes (their ratio_vs_copy divides by it)
# The implementations timed besides the baseline (impls.MODE_IMPLS lists them for both attention modes).
ATTN_IMPLS = ("ropekit", "sdpa-cudnn", "sdpa-flash", "rope+sdpa-flash", "flex", "rope+flex", "ropekit-kernels",
              "ropekit-norope")
# ropekit-kernels: rope_attention's launches alone (angle rows, rotated copies, attention kernels), without the public
# call's checks and autograd -- the host's share of a call is ropekit's time minus this; ropekit-norope: the same
# kernels with the rotation switched off -- the rotation's share is ropekit-kernels minus this (CUDA only).
# torch.nn.attention.SDPBackend member of each SDPA implementation
SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION"}


def _causal_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """flex_attention's mask_mod of the causal mask (query i sees keys 0..i, as SDPA's ``is_causal``)."""
    return q_idx >= kv_idx


def _sdpa_refuses(which: str, inp: Inputs, grad: bool) -> str | None:
    """Why torch's SDPA backend ``which`` ("cudnn", "flash") would refuse the case's tensors (torch's own
    constraint checks, ``torch.backends.cuda.can_use_*_attention`` with ``debug=True``, whose warnings say why), or
    None where it takes them or the check is not available in this torch (the call then decides)."""
    check = getattr(torch.backends.cuda, f"can_use_{which}_attention", None)
    params_type = getattr(torch.backends.cuda, "SDPAParams", None)
    if check is None or params_type is None:
        return None
    q, k, v = (t.detach().requires_grad_(grad) for t in (inp.q, inp.k, inp.v))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            params = params_type(q, k, v, None, 0.0, bool(inp.case.causal), True)
            ok = check(params, True)
    except Exception:  # noqa: BLE001 - another torch's signature: the call itself says whether it runs
        return None
    if ok:
        return None
    reasons = [str(w.message).split(" (Triggered internally")[0].strip() for w in caught]
    return "; ".join(r for r in reasons if r) or "torch gives no reason"


def _sdpa(which: str, inp: Inputs, grad: bool) -> tuple[Callable[[Tensor, Tensor, Tensor], Tensor], str]:
    """``scaled_dot_product_attention`` restricted to backend ``which`` by ``sdpa_kernel`` (CPU: the default
    backend), and its note."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    causal = bool(inp.case.causal)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if inp.device.type != "cuda":
        def attend_default(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return sdpa(q, k, v, is_causal=causal, enable_gqa=True)

        return attend_default, f"SDPA, torch's default backend (a CPU run: {which} needs CUDA)"
    why = _sdpa_refuses(which, inp, grad)
    if why:
        raise Unsupported(f"SDPA's {which} backend refuses the case: {why}")
    backend = getattr(SDPBackend, SDPA_BACKENDS[which])

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with sdpa_kernel(backend):
            return sdpa(q, k, v, is_causal=causal, enable_gqa=True)

    return attend, f"SDPA, {which} backend only (sdpa_kernel), enable_gqa"


def _flex(inp: Inputs, mode: str) -> tuple[Callable[[Tensor, Tensor, Tensor], Tensor], str]:
    """``torch.compile(flex_attention)`` (static shapes; one compile per case and mode serves ``flex`` and
    ``rope+flex``) with the causal block mask made once, and its note."""
    c = inp.case
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as exc:
        raise Unsupported(f"flex_attention is not available in this torch: {exc}") from None
    if inp.device.type != "cuda":
        raise Unsupported("flex_attention is timed on CUDA only (on CPU its compile builds C++ for minutes)")
    if c.value_dim != c.head_dim:
        raise Unsupported(f"flex_attention is timed only where v's head dim equals q's (D {c.head_dim}, "
                          f"Dv {c.value_dim})")
    compiled = compiled_per_case(flex_attention, c.name, mode)
    mask = None
    if c.causal:
        mask = create_block_mask(_causal_mask, B=None, H=None, Q_LEN=c.seqlen, KV_LEN=c.seqlen, device=inp.device)

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return compiled(q, k, v, block_mask=mask, enable_gqa=True)

    return attend, ("torch.compile(flex_attention, static shapes), enable_gqa"
                    + (", causal block mask" if c.causal else ""))


def _attention_bench(inp: Inputs, mode: str, forward: Callable[[Tensor, Tensor, Tensor], Tensor], checked: bool,
                     note: str) -> Bench:
    """attn-fwd: ``forward(q, k, v)``; attn-fwdbwd: ``forward`` on leaf copies of q, k and v, then
    ``torch.autograd.grad`` of all three with a fixed random gradient of o. ``checked``: ``result`` gives o (fwd)
    or the three gradients for the check against ropekit."""
    if mode == "attn-fwd":
        def result_fwd() -> tuple[Tensor]:
            return (forward(inp.q, inp.k, inp.v),)

        return Bench(run=lambda: forward(inp.q, inp.k, inp.v), result=result_fwd if checked else None, note=note)
    c = inp.case
    (grad_o,) = _randn(inp.device, 1, (c.batch, c.hq, c.seqlen, c.value_dim), dtype=inp.dtype)

    def leaves() -> tuple[Tensor, Tensor, Tensor]:
        return tuple(t.detach().clone().requires_grad_(True) for t in (inp.q, inp.k, inp.v))

    timed = leaves()

    def run() -> tuple[Tensor, ...]:
        return torch.autograd.grad(forward(*timed), timed, grad_o)

    def result() -> tuple[Tensor, ...]:
        fresh = leaves()
        return tuple(torch.autograd.grad(forward(*fresh), fresh, grad_o.clone()))

    return Bench(run=run, result=result if checked else None, note=note)


def _kernel_launches(inp: Inputs, mode: str, rotate: bool) -> Bench:
    """rope_attention's kernels launched directly (``rotate=False``: the same kernels without the rotation): the
    forward (o, lse), and for attn-fwdbwd the forward then the backward (dq, dk, dv) with a fixed gradient of o."""
    import math

    from ropekit._spec import RopeArgs, to_canonical
    from ropekit.attention import _unit_rows
    from ropekit.triton.attention_launcher import Rotation, launch_backward, launch_forward

    c = inp.case
    if inp.device.type != "cuda":  # under the interpreter they would only slow the smoke run down
        raise Unsupported("the kernels' own rows need CUDA")
    kw = {key: value for key, value in inp.rope_kwargs().items() if key != "cu_seqlens"}
    args = RopeArgs(**kw)
    q, k, v = (to_canonical(t, args.layout) for t in (inp.q, inp.k, inp.v))
    B, S, HQ, D = q.shape
    o = torch.empty((B, S, HQ, v.shape[3]), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, HQ, S), dtype=torch.float32, device=q.device)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    (grad_o,) = _randn(inp.device, 1, tuple(o.shape), dtype=inp.dtype)
    qk_mult = 1.0 / math.sqrt(D) / math.log(2.0)
    causal = bool(c.causal)

    def run() -> None:
        table, (start, width, neox) = _unit_rows(inp.q, args)
        rot = Rotation(start, width, neox)
        launch_forward(q, k, v, table, o, lse, rot, 1.0, 1.0, qk_mult, causal, rotate=rotate)
        if mode == "attn-fwdbwd":
            launch_backward(grad_o, None, q, k, v, table, o, lse, *grads, rot, 1.0, 1.0, qk_mult, causal,
                            rotate=rotate)

    what = "rope_attention's kernels launched directly" + ("" if rotate else ", rotation off (another function)")
    return Bench(run=run, result=None, note=f"{what}; not checked")


def build_attention(name: str, inp: Inputs, mode: str) -> Bench:
    """``ropekit`` (rope_attention), the baseline ``rope+sdpa-cudnn`` and the peers of the attention modes."""
    import ropekit

    c = inp.case
    if c.causal is None or inp.v is None:
        raise Unsupported("attention modes only (the case has no v and no mask)")
    kw = {key: value for key, value in inp.rope_kwargs().items() if key != "cu_seqlens"}
    mask = "causal" if c.causal else "no mask"
    dims = "" if c.value_dim == c.head_dim else f"; D {c.head_dim}, Dv {c.value_dim}"
    if name == "ropekit":
        causal = bool(c.causal)

        def fused(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return ropekit.rope_attention(q, k, v, is_causal=causal, **kw)

        return _attention_bench(inp, mode, fused, True, f"rope_attention: RoPE(q), RoPE(k) and attention in one op; "
                                                         f"{mask}{dims}")
    if name in ("ropekit-kernels", "ropekit-norope"):
        return _kernel_launches(inp, mode, name == "ropekit-kernels")
    rotate = name.startswith("rope+")
    peer = name.removeprefix("rope+")
    if peer in ("sdpa-cudnn", "sdpa-flash"):
        attend, note = _sdpa(peer.removeprefix("sdpa-"), inp, mode == "attn-fwdbwd")
    elif peer == "flex":
        attend, note = _flex(inp, mode)
    else:
        raise ValueError(name)
    if rotate:
        def forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            q_rot, k_rot = ropekit.apply_rope(q, k, **kw)
            return attend(q_rot, k_rot, v)

        note = f"ropekit.apply_rope, then {note}"
    else:
        forward = attend
        note = f"attention alone, no RoPE (not checked: another function); {note}"
    bench = _attention_bench(inp, mode, forward, rotate, f"{note}; {mask}{dims}")
    if peer == "flex":  # compile (fwd+bwd: forward and backward) outside the timed region
        t0 = time.perf_counter()
        bench.run()
        _sync(inp.device)
        bench.note += f"; compiled in {time.perf_counter() - t0:.1f} s"
    return bench
