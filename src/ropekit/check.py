"""``ropekit check``: every capability against the float64 reference on the best available backend, as a table;
``ropekit env``: versions and devices.

Backends: ``cuda`` (the Triton kernels through the public API) when a GPU is present, else ``triton-interpreter``
(the same kernels on the CPU under ``TRITON_INTERPRET=1``, small shapes); ``cpu`` (the float64 path) for the
mathematical properties; ``webgpu`` when wgpu finds an adapter. A backend that cannot run here is listed after
the table with the reason and how to enable it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ropekit.testing import max_relative_error, max_relative_tolerance


@dataclass
class CheckRow:
    backend: str
    device: str
    case: str
    max_error: float  # max |out - ref| / max |ref| (ropekit.testing.max_relative_error)
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_error == self.max_error and self.max_error <= self.tolerance  # NaN fails


def _case_table(device: str, small: bool) -> list[tuple[str, torch.dtype, dict, Callable]]:
    """(name, dtype, shape dict, kwargs factory) for every capability."""
    dev = torch.device(device)
    S = 16 if small else 512
    P = 4 * S

    def table(dtype=torch.float32, full=False):
        inv = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
        ang = torch.outer(torch.arange(P, dtype=torch.float64), inv)
        if full:
            ang = torch.cat([ang, ang], -1)
        return ang

    def kw(**kwargs):
        return lambda: {k: (v() if callable(v) else v) for k, v in kwargs.items()}

    ids = lambda: torch.randint(0, 1 << 24, (2, S), device=dev)  # noqa: E731
    cases = [
        ("neox, base, positions 0..S-1", torch.bfloat16, kw()),
        ("interleaved, base", torch.bfloat16, kw(style="interleaved")),
        ("inv_freq fp32, int offset", torch.float32,
         kw(inv_freq=lambda: 500000.0 ** (-torch.arange(0, 64, 2, device=dev).float() / 64), positions=1000)),
        ("cos/sin fp32 table, per-token ids", torch.float16,
         kw(cos=lambda: table().cos().float().to(dev), sin=lambda: table().sin().float().to(dev),
            positions=lambda: torch.randint(0, P, (2, S), device=dev))),
        ("cos/sin bf16 table", torch.bfloat16,
         kw(cos=lambda: table().cos().bfloat16().to(dev), sin=lambda: table().sin().bfloat16().to(dev),
            positions=3)),
        ("raw angles (cuDNN), rope_dim at back", torch.bfloat16,
         kw(angles=lambda: table(full=True)[:, :32].to(dev), rotary_dim=32, rotary_at="back", q_scale=0.125)),
        ("HF per-token cos/sin [B,S,D]", torch.bfloat16,
         kw(cos=lambda: table(full=True)[:S].cos().expand(2, S, 64).to(dev),
            sin=lambda: table(full=True)[:S].sin().expand(2, S, 64).to(dev))),
        ("[B] per-sequence offsets", torch.float32, kw(positions=lambda: torch.tensor([5, 70000], device=dev))),
        ("per-token ids to 2^24, exact angles", torch.float32, kw(positions=ids)),
        ("layout bhsd", torch.float16, kw(layout="bhsd")),
        ("layout sbhd", torch.float16, kw(layout="sbhd")),
        ("layout thd + cu_seqlens (varlen)", torch.bfloat16,
         kw(layout="thd", cu_seqlens=lambda: torch.tensor([0, 3, S, 2 * S - 1, 2 * S], device=dev))),
        ("partial rotary front (GPT-NeoX 25%)", torch.float32, kw(rotary_dim=16)),
        ("q_scale/k_scale/rotary_scale", torch.bfloat16, kw(q_scale=0.125, k_scale=2.0, rotary_scale=1.2)),
        ("backward (conjugate rotation)", torch.float32, kw(_backward=True, positions=12345)),
        ("in place", torch.bfloat16, kw(_inplace=True, positions=7)),
        ("M-RoPE [3,B,S] positions, sections (Qwen2-VL)", torch.bfloat16,
         kw(positions=lambda: torch.randint(0, 1 << 20, (3, 2, S), device=dev), sections=(8, 12, 12))),
        ("M-RoPE interleaved (Qwen3-VL)", torch.float32,
         kw(positions=lambda: torch.randint(0, 1 << 24, (3, 2, S), device=dev), sections=(12, 10, 10),
            section_layout="interleaved")),
    ]
    return cases


def _run_case(backend: str, device: str, name: str, dtype: torch.dtype, make_kwargs: Callable,
              small: bool) -> CheckRow:
    import ropekit

    kwargs = make_kwargs()
    backward, inplace = kwargs.pop("_backward", False), kwargs.pop("_inplace", False)
    layout = kwargs.get("layout", "bshd")
    B, S, HQ, HK, D = 2, (16 if small else 512), 8, 2, 64
    q = torch.randn(B, S, HQ, D, dtype=torch.float64)
    k = torch.randn(B, S, HK, D, dtype=torch.float64)
    shape = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3)}
    if layout == "thd":
        q, k = q.reshape(B * S, HQ, D), k.reshape(B * S, HK, D)
    else:
        q, k = q.permute(*shape[layout]).contiguous(), k.permute(*shape[layout]).contiguous()
    q, k = q.to(dtype), k.to(dtype)
    cpu_kwargs = {key: (v.cpu() if isinstance(v, torch.Tensor) else v) for key, v in kwargs.items()}
    fn = ropekit.rope_backward if backward else ropekit.apply_rope
    ref_q, ref_k = fn(q.double(), k.double(), **cpu_kwargs)
    qd, kd = q.to(device), k.to(device)
    if backend == "triton-interpreter":
        from ropekit._spec import BACKWARD, FORWARD
        from ropekit._validation import validate
        from ropekit.triton.launcher import launch_rope

        spec = validate(qd, kd, **kwargs, mode=BACKWARD if backward else FORWARD)
        out_q, out_k = (qd, kd) if inplace else (torch.full_like(qd, float("nan")), torch.full_like(kd, float("nan")))
        launch_rope(qd, kd, out_q, out_k, spec)
    elif inplace:
        out_q, out_k = ropekit.apply_rope_(qd, kd, **kwargs)
    else:
        out_q, out_k = fn(qd, kd, **kwargs)
    err = max_relative_error((out_q, out_k), (ref_q, ref_k))
    return CheckRow(backend, device, name, err, max_relative_tolerance(dtype, backend))


def _prologue_rows(backend: str, device: str) -> list[CheckRow]:
    """The attention prologue against float64: ``qk_norm_rope`` (outputs and the gradients of q, k and both
    weights) and ``rope_kv_write`` (the returned q and the cache rows it writes: a head-major bf16 cache, a paged
    fp8 cache with a skipped slot)."""
    import contextlib

    import ropekit
    from ropekit.reference import rms_norm_reference
    from ropekit.testing import kernels_on_cpu

    route = kernels_on_cpu() if backend == "triton-interpreter" else contextlib.nullcontext()
    T, HQ, HK, D = 6, 8, 2, 64
    rows = []

    def tol(dtype):
        return max_relative_tolerance(dtype, backend)

    def normed_rotated(q, k, qw, kw, **rope):
        qn, kn = rms_norm_reference(q, qw, 0.0, 1e-6), rms_norm_reference(k, kw, 0.0, 1e-6)
        return ropekit.apply_rope(qn, kn, **rope)

    q, k = torch.randn(2, T, HQ, D, dtype=torch.float64), torch.randn(2, T, HK, D, dtype=torch.float64)
    qw, kw = torch.rand(D, dtype=torch.float64) + 0.5, torch.rand(D, dtype=torch.float64) + 0.5
    ids = torch.randint(0, 1 << 20, (2, T))
    leaves = [t.clone().requires_grad_() for t in (q, k, qw, kw)]
    ref = normed_rotated(*leaves, positions=ids, base=1e6)
    grads = [torch.randn_like(r) for r in ref]
    ref_grads = torch.autograd.grad(ref, leaves, grads)
    with route:
        dev = [t.to(device, torch.float32).requires_grad_() for t in (q, k, qw, kw)]
        out = ropekit.qk_norm_rope(*dev, eps=1e-6, positions=ids.to(device), base=1e6)
        got = torch.autograd.grad(out, dev, [g.to(device, torch.float32) for g in grads])
        rows.append(CheckRow(backend, device, "prologue: qk_norm_rope (Qwen3 QK-norm + RoPE)",
                             max_relative_error(out, ref), tol(torch.float32)))
        rows.append(CheckRow(backend, device, "prologue: qk_norm_rope gradients (q, k, both weights)",
                             max_relative_error(got, ref_grads), tol(torch.float32)))

        # bf16-representable inputs and weights: the reference then sees exactly what the kernel reads, and the
        # error measured is the kernel's own (input rounding alone can reach bf16's tolerance)
        qkv = torch.randn(T, (HQ + 2 * HK) * D).to(torch.bfloat16).double()
        qw, kw = qw.to(torch.bfloat16).double(), kw.to(torch.bfloat16).double()
        qd, kd, vd = qkv.view(T, HQ + 2 * HK, D).split([HQ, HK, HK], dim=1)
        pos = torch.randint(0, 100, (T,))
        rq, rk = normed_rotated(qd, kd, qw, kw, positions=pos, layout="thd", style="interleaved")
        caches = [torch.full((T, HK, 128, D), float("nan"), device=device, dtype=torch.bfloat16) for _ in range(2)]
        with torch.no_grad():
            got_q = ropekit.rope_kv_write(*(x.to(device, torch.bfloat16) for x in (qd, kd, vd)), *caches,
                                          positions=pos.to(device), cache_layout="bhsd", q_weight=qw.to(device),
                                          k_weight=kw.to(device), style="interleaved")
        t = torch.arange(T)
        rows.append(CheckRow(backend, device, "prologue: rope_kv_write decode into a bhsd cache",
                             max_relative_error((got_q, caches[0][t, :, pos], caches[1][t, :, pos]),
                                                (rq, rk, vd.to(torch.bfloat16))), tol(torch.bfloat16)))

        rq, rk = ropekit.apply_rope(qd, kd, positions=pos, layout="thd")
        slots = torch.tensor([9, -1, 0, 31, 4, 17])
        caches = [torch.zeros((4, 8, HK, D), device=device, dtype=torch.float8_e4m3fn) for _ in range(2)]
        with torch.no_grad():
            ropekit.rope_kv_write(*(x.to(device, torch.float32) for x in (qd, kd, vd)), *caches,
                                  positions=pos.to(device), slot_mapping=slots.to(device), cache_layout="paged",
                                  k_cache_scale=0.25, v_cache_scale=torch.tensor(0.5, device=device))
        kept = slots >= 0
        flat = [c.view(32, HK, D).float() for c in caches]
        written = (flat[0][slots[kept]], flat[1][slots[kept]])
        refs = (rk[kept] / 0.25, vd[kept] / 0.5)
        untouched = all(int(c.view(32, HK, D)[~torch.isin(torch.arange(32), slots)].float().abs().sum()) == 0
                        for c in caches)
        err = max_relative_error(written, refs) if untouched else float("inf")
        rows.append(CheckRow(backend, device, "prologue: rope_kv_write paged fp8 cache, slot -1 skipped", err,
                             tol(torch.float8_e4m3fn)))
    return rows


def _attention_rows(backend: str, device: str) -> list[CheckRow]:
    """``rope_attention`` against float64 (the rotation by the reference path, attention written out): GQA, causal,
    per-token positions, the scale folded into q with a base-2 softmax; the output and the gradients of q, k, v."""
    import contextlib
    import math

    import ropekit
    from ropekit.testing import kernels_on_cpu

    route = kernels_on_cpu() if backend == "triton-interpreter" else contextlib.nullcontext()
    B, S, HQ, HK, D = 2, 24, 4, 2, 32
    q, k, v = (torch.randn(B, S, h, D, dtype=torch.float64) for h in (HQ, HK, HK))
    ids = torch.randint(0, 1 << 20, (B, S))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    qr, kr = ropekit.apply_rope(*leaves[:2], positions=ids, base=1e6)
    g = HQ // HK
    scores = torch.einsum("bqhd,bkhd->bhqk", qr, kr.repeat_interleave(g, 2)) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), leaves[2].repeat_interleave(g, 2))
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, leaves, grad)
    with route:
        dev = [t.to(device, torch.float32).requires_grad_() for t in (q, k, v)]
        out = ropekit.rope_attention(*dev, is_causal=True, fold="q_log2", positions=ids.to(device), base=1e6)
        got = torch.autograd.grad(out, dev, grad.to(device, torch.float32))
    tol = max_relative_tolerance(torch.float32, backend)
    return [CheckRow(backend, device, "rope_attention: GQA, causal, ids, fold q_log2", max_relative_error(out, ref),
                     tol),
            CheckRow(backend, device, "rope_attention gradients (q, k, v)", max_relative_error(got, ref_grads), tol)]


def _property_rows() -> list[CheckRow]:
    """Properties of the float64 CPU path: conjugate undoes forward, pair norms kept, relative positions."""
    import ropekit

    q = torch.randn(2, 64, 4, 64, dtype=torch.float64)
    rot = ropekit.apply_rope(q, positions=123456)
    back = ropekit.rope_backward(rot, positions=123456)
    f64 = max_relative_tolerance(torch.float64, "cpu")
    rows = [CheckRow("cpu", "cpu", "property: conjugate undoes forward", max_relative_error(back, q), f64)]
    norms = lambda x: x[..., :32] ** 2 + x[..., 32:] ** 2  # noqa: E731
    rows.append(CheckRow("cpu", "cpu", "property: pair norms preserved", max_relative_error(norms(rot), norms(q)),
                         f64))
    a, b = torch.randn(1, 1, 1, 64, dtype=torch.float64), torch.randn(1, 1, 1, 64, dtype=torch.float64)
    dots = [(ropekit.apply_rope(a, positions=m + 10) * ropekit.apply_rope(b, positions=m)).sum()
            for m in (0, 1000, 2**20)]
    spread = max(abs((d - dots[0]).item()) for d in dots) / abs(dots[0].item())
    rows.append(CheckRow("cpu", "cpu", "property: q.k depends on position difference only", spread, 1e-9))
    return rows


@dataclass
class SkippedBackend:
    backend: str
    cases: int  # how many cases did not run
    reason: str  # why, and how to enable it


def _triton_missing() -> str | None:
    """Why the Triton cases cannot run here (None when they can)."""
    if importlib.util.find_spec("triton") is None:
        return 'triton is not installed; enable with: pip install "ropekit[triton]"'
    if not torch.cuda.is_available() and importlib.util.find_spec("numpy") is None:
        return 'the Triton interpreter needs numpy; enable with: pip install "ropekit[triton]"'
    return None


def _webgpu_runner():
    """(runner, None) when wgpu finds an adapter, else (None, why and how to enable it)."""
    if importlib.util.find_spec("wgpu") is None:
        return None, 'wgpu is not installed; enable with: pip install "ropekit[webgpu]"'
    try:
        from ropekit import webgpu

        return webgpu.default_runner(), None
    except ImportError as exc:  # numpy, or a broken wgpu install
        return None, f'{exc}; enable with: pip install "ropekit[webgpu]"'
    except RuntimeError as exc:  # its message already carries the hint for installing a software adapter
        return None, f"no wgpu adapter found: {exc}"


def run_all(small: bool | None = None) -> tuple[list[CheckRow], list[SkippedBackend]]:
    """All check rows for the backends available here, and the backends skipped (with the reason)."""
    if torch.cuda.is_available():
        backend, device = "cuda", "cuda"
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        backend, device = "triton-interpreter", "cpu"
    small = backend != "cuda" if small is None else small
    torch.manual_seed(0)
    rows: list[CheckRow] = []
    skipped: list[SkippedBackend] = []
    cases = _case_table(device, small)
    why = _triton_missing()
    if why is None:
        for name, dtype, make in cases:
            rows.append(_run_case(backend, device, name, dtype, make, small))
        rows += _prologue_rows(backend, device)
        rows += _attention_rows(backend, device)
    else:
        skipped.append(SkippedBackend(backend, len(cases) + _PROLOGUE_ROWS + _ATTENTION_ROWS, why))
    rows += _property_rows()
    runner, why = _webgpu_runner()
    if runner is None:
        skipped.append(SkippedBackend("webgpu", _webgpu_case_count(), why))
    else:
        from ropekit import webgpu

        rows += [CheckRow(r["backend"], r["device"], r["case"], r["max_error"], r["tolerance"])
                 for r in webgpu.check_rows(runner)]
    return rows, skipped


_PROLOGUE_ROWS = 4  # len(_prologue_rows(...))
_ATTENTION_ROWS = 2  # len(_attention_rows(...))
_WEBGPU_CASES = 7  # len(ropekit.webgpu._CHECK_CASES), for when that module cannot import (no numpy)


def _webgpu_case_count() -> int:
    try:
        from ropekit.webgpu import _CHECK_CASES
    except ImportError:
        return _WEBGPU_CASES
    return len(_CHECK_CASES)


def run_checks(small: bool | None = None) -> list[CheckRow]:
    """All check rows for the backends available here (:func:`run_all` also says what was skipped)."""
    return run_all(small)[0]


def _device_name(backend: str) -> str:
    if backend == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def format_table(rows: list[CheckRow], skipped: list[SkippedBackend]) -> list[str]:
    """The table, a line per skipped backend, and the summary line last."""
    cells = [(r.backend, _device_name(r.backend) if r.backend in ("cuda", "triton-interpreter") else r.device,
              r.case, f"{r.max_error:.2e}", f"{r.tolerance:.2e}", "pass" if r.passed else "FAIL") for r in rows]
    header = ("backend", "device", "case", "max error", "tolerance", "result")
    # every column as wide as its longest cell: device names (GPU, adapter) are never cut
    widths = [max(len(c) for c in col) for col in zip(header, *cells)]
    align = "<<<>><"
    lines = ["  ".join(f"{c:{a}{w}}" for c, a, w in zip(line, align, widths)).rstrip() for line in [header, *cells]]
    for s in skipped:
        lines.append(f"skipped {s.backend} ({s.cases} cases): {s.reason}")
    failed = sum(not r.passed for r in rows)
    n_skipped = sum(s.cases for s in skipped)
    lines.append(f"{len(rows) - failed} passed, {failed} failed" + (f", {n_skipped} skipped" if n_skipped else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ropekit check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="small shapes even on a GPU")
    args = parser.parse_args(argv)
    rows, skipped = run_all(small=True if args.small else None)
    print("\n".join(format_table(rows, skipped)))
    return 1 if any(not r.passed for r in rows) else 0


def env_main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="ropekit env", description="versions and devices").parse_args(argv)
    import ropekit

    print(f"ropekit      {ropekit.__version__}")
    print(f"python       {sys.version.split()[0]} ({platform.platform()})")
    for name in ("torch", "triton", "numpy", "transformers", "wgpu", "matplotlib"):
        try:
            version = importlib.import_module(name).__version__
        except ImportError:
            version = "not installed"
        print(f"{name:<12} {version}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"cuda:{i}       {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                  f"{p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
    else:
        print("cuda         not available (Triton kernels run only under TRITON_INTERPRET=1)")
    try:
        from ropekit import webgpu

        print(f"webgpu       {webgpu.adapter_info() or 'no adapter'}")
    except ImportError:
        print("webgpu       not available")
    return 0
