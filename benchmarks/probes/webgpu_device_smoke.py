"""WebGPU smoke run on a real device: adapter info, then the kernel checklist with its max errors.

    PYTHONPATH=src python benchmarks/probes/webgpu_device_smoke.py [--all-adapters]

Runs on wgpu's preferred adapter, or on every adapter wgpu enumerates with --all-adapters (e.g. a GPU's Vulkan
driver and llvmpipe side by side). A plain script (pytest does not collect it). Exit status: 0 all checks passed,
1 a check failed, 2 no wgpu or no adapter.
"""

# ruff: noqa: E402 - options are parsed before torch, Triton and ropekit load, so --help runs on any machine
from __future__ import annotations

import argparse


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-adapters", action="store_true", help="run on every adapter wgpu enumerates")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help exits here

import math
import sys
import time

import numpy as np
import torch

from ropekit import webgpu
from ropekit._spec import BACKWARD, FORWARD
from ropekit._validation import validate
from ropekit.frequencies import default_inv_freq
from ropekit.reference import rope_reference

CPU = torch.device("cpu")


def reference(x, *, style, inv_freq, pos_offset, conjugate=False):
    x4 = x.unsqueeze(0) if x.ndim == 3 else x
    spec = validate(x4, None, positions=pos_offset, inv_freq=inv_freq, style=style,
                    mode=BACKWARD if conjugate else FORWARD)
    out = rope_reference(x4, None, spec._replace(out_dtype=torch.float64))[0]
    return out.reshape(x.shape)


def max_error(out, ref) -> float:
    diff = (torch.as_tensor(out).to(torch.float64) - torch.as_tensor(ref).to(torch.float64)).abs()
    return torch.nan_to_num(diff, nan=math.inf).max().item()


class Report:
    def __init__(self):
        self.failed = 0

    def row(self, case: str, error: float, tolerance: float | None):
        if tolerance is None:
            verdict = "info"
        else:
            ok = error <= tolerance
            self.failed += not ok
            verdict = "ok" if ok else "FAIL"
        tol = "" if tolerance is None else f"{tolerance:9.1e}"
        print(f"  {verdict:4}  {error:9.2e} {tol:>9}  {case}")


def run_adapter(runner: webgpu.WebGPURunner, report: Report) -> None:
    adapter = runner.adapter
    print(f"\n=== {runner.description}")
    print(f"  info: {dict(adapter.info)}")
    print(f"  shader-f16: {'shader-f16' in adapter.features} (the packed f16 kernels do not need it)")
    print(f"  max storage binding {runner.max_binding_bytes} bytes, "
          f"{runner.max_workgroups_per_dimension} workgroups per dimension")
    print("  verdict  max_err  tolerance  case")
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype)

    # check_rows: what `ropekit check` reports.
    for r in webgpu.check_rows(runner):
        report.row(f"check: {r['case']}", r["max_error"], r["tolerance"])

    # Q and K share the angle of each (s, p); GQA in one dispatch.
    q = randn(2, 64, 8, 128)
    k = q[:, :, :2].clone()
    for angles in webgpu.ANGLE_MODES:
        q_out, k_out = runner.apply_rope(q, k, pos_offset=9, angles=angles)
        report.row(f"q and k identical angles, GQA 8/2 ({angles}), max |k_out - q_out[heads 0:2]|",
                   max_error(k_out, q_out[:, :, :2]), 0.0)

    # pos_offset equals the slice of a longer run.
    for angles in webgpu.ANGLE_MODES:
        full = runner.apply_rope(q, pos_offset=1000, angles=angles)
        part = runner.apply_rope(q[:, 40:], pos_offset=1040, angles=angles)
        report.row(f"pos_offset 1040 == slice of a run from 1000 ({angles})", max_error(part, full[:, 40:]), 0.0)

    # Bases and styles against the float64 reference; forward then backward returns the input.
    for base in (10000.0, 500000.0, 1e6):
        inv_freq = default_inv_freq(base, 128, CPU)
        for style in webgpu.STYLES:
            for angles in ("shader", "host"):
                out = runner.apply_rope(q, pos_offset=12345, base=base, style=style, angles=angles)
                report.row(f"reference, base {base:g}, {style}, {angles}",
                           max_error(out, reference(q, style=style, inv_freq=inv_freq, pos_offset=12345)), 5e-6)
        for angles in webgpu.ANGLE_MODES:
            out = runner.apply_rope(q, pos_offset=12345, base=base, angles=angles)
            back = runner.apply_rope(out, pos_offset=12345, base=base, angles=angles, conjugate=True)
            report.row(f"forward then backward, base {base:g}, {angles}", max_error(back, q), 5e-6)
    for dtype, tol in ((torch.float16, 2.0**-7), (torch.bfloat16, 2.0**-5)):
        x = q.to(dtype)
        for style in webgpu.STYLES:
            out = runner.apply_rope(x, pos_offset=777, style=style)
            ref = reference(x, style=style, inv_freq=default_inv_freq(10000.0, 128, CPU), pos_offset=777)
            report.row(f"reference, {str(dtype)[6:]}, {style}", max_error(out, ref), tol)

    # Angle error against position: unit pairs (1, 0) come out as (cos, sin) of every angle.
    S, D = 256, 128
    unit = np.zeros((S, 1, D), np.float32)
    unit[..., 0::2] = 1.0
    inv32 = default_inv_freq(500000.0, D, CPU).double()
    exact = 500000.0 ** -(torch.arange(0, D, 2, dtype=torch.float64) / D)
    print("  angle error |(cos, sin) - exact| over 256 positions from 2^k - 128 (base 500000, D 128):")
    print(f"  {'k':>4} {'shader':>10} {'host':>10} {'shader_base':>12}")
    for power in (8, 12, 16, 20, 24, 28, 31):
        offset = min(2**power - S // 2, 2**31 - S)  # the last window ends at the largest position
        theta = torch.arange(offset, offset + S, dtype=torch.float64)[:, None]
        errors = []
        for angles, freqs in (("shader", inv32), ("host", inv32), ("shader_base", exact)):
            out = torch.from_numpy(runner.apply_rope(unit, pos_offset=offset, base=500000.0, angles=angles,
                                                     style="interleaved"))
            angle = theta * freqs
            ref = torch.stack([angle.cos(), angle.sin()], -1).reshape(S, 1, D)
            errors.append(max_error(out, ref))
        print(f"  {power:>4} {errors[0]:10.2e} {errors[1]:10.2e} {errors[2]:12.2e}")
        if power <= 20:
            report.row(f"(cos, sin) error near 2^{power}, shader angles", errors[0], 1e-6)
            report.row(f"(cos, sin) error near 2^{power}, host table", errors[1], 1e-6)

    # More workgroups than one grid dimension allows: a quarter turn moves every element.
    for dtype, entry in ((np.float32, "rope_table"), (np.float16, "rope_table_f16")):
        H, D = 32, 128
        S = (65536 * 256) // (H * D // 2) + 1
        if S * H * D * np.dtype(dtype).itemsize > runner.max_binding_bytes:
            print(f"  skip  {entry} with >65535 workgroups: larger than one storage binding")
            continue
        x = randn(S, H, D).numpy().astype(dtype)
        table = np.zeros((S, D // 2, 2), np.float32)
        table[..., 1] = 1.0
        t0 = time.perf_counter()
        out = runner.dispatch(entry, x, cos_sin=table)
        elapsed = time.perf_counter() - t0
        wrong = np.count_nonzero(out[..., 0::2] != -x[..., 1::2]) + np.count_nonzero(out[..., 1::2] != x[..., 0::2])
        groups = webgpu.workgroup_grid(-(-S * H * D // 2 // 256), runner.max_workgroups_per_dimension)
        report.row(f"{entry} on a {groups[0]}x{groups[1]} grid ({elapsed:.2f} s): elements wrong", float(wrong),
                   0.0)

    # Inputs above one storage binding run in blocks, of heads (batch rows) when one token is too big: the same
    # bits as one dispatch. A lowered limit makes blocks of 7 of the 20 rows (2 x 8 q + 2 x 2 k heads) per token.
    q, k = randn(2, 64, 8, 128), randn(2, 64, 2, 128)
    whole = runner.apply_rope(q, k, pos_offset=4321)
    saved = runner.max_binding_bytes
    try:
        runner.max_binding_bytes = 7 * 128 * 4
        blocked = runner.apply_rope(q, k, pos_offset=4321)
    finally:
        runner.max_binding_bytes = saved
    report.row("blocks of 7 heads x 1 token == one dispatch",
               max(max_error(a, b) for a, b in zip(blocked, whole)), 0.0)

    # The kernels' own checks: odd head_dim is poisoned, not silently left unrotated.
    odd = runner.dispatch("rope_q", randn(4, 2, 7).numpy())
    report.row("odd head_dim: pairs written as NaN (count not NaN)",
               float(np.count_nonzero(~np.isnan(odd[..., :6]))), 0.0)

    # Device time per dispatch (data resident, read + write of every byte), and wall time of apply_rope.
    S, H, D = 4096, 40, 128  # Llama-3-8B q and k heads of one 4k sequence
    inv_freq = default_inv_freq(500000.0, D, CPU).numpy()
    table = np.zeros((S, D // 2, 2), np.float32)
    repeats = 3 if adapter.info.get("adapter_type") == "CPU" else 20  # software adapters take ~0.3 s a dispatch
    for dtype, suffix in ((np.float32, ""), (np.float16, "_f16")):
        x = randn(S, H, D).numpy().astype(dtype)
        if x.nbytes > runner.max_binding_bytes:
            continue
        for entry in ("rope_q" if not suffix else "rope_f16", f"rope_freq{suffix}", f"rope_table{suffix}",
                      f"rope_neox_freq{suffix}"):
            seconds = runner.kernel_seconds(entry, x, repeats=repeats, inv_freq=inv_freq, cos_sin=table)
            rate = 2 * x.nbytes / seconds / 1e9 if seconds > 0 else math.inf
            print(f"  time  {entry:22} [{S},{H},{D}] {np.dtype(dtype).name}: {seconds * 1e6:9.1f} us, "
                  f"{rate:7.1f} GB/s")
    q = randn(1, S, 32, D)
    k = randn(1, S, 8, D)
    runner.apply_rope(q, k)
    t0 = time.perf_counter()
    for _ in range(3):
        runner.apply_rope(q, k)
    print(f"  time  apply_rope q [1,{S},32,{D}] + k [1,{S},8,{D}] fp32: "
          f"{(time.perf_counter() - t0) / 3 * 1e3:.1f} ms per call, host copies and transfers included")


def main(args: argparse.Namespace) -> int:
    try:
        import wgpu
    except ImportError:
        print("wgpu is not installed: pip install 'ropekit[webgpu]'")
        return 2
    print(f"wgpu {wgpu.__version__}, torch {torch.__version__}, numpy {np.__version__}")
    try:
        if args.all_adapters:
            # The shared runner first: ropekit loads triton's native library before wgpu loads Mesa's LLVM
            # (the other order crashes a later `import triton`; see ropekit.webgpu._load_triton_native_first).
            webgpu.default_runner()
            runners = [webgpu.WebGPURunner(a) for a in wgpu.gpu.enumerate_adapters_sync()]
        else:
            runners = [webgpu.default_runner()]
    except RuntimeError as exc:
        print(exc)
        return 2
    if not runners:
        print("no WebGPU adapter")
        return 2
    report = Report()
    for runner in runners:
        run_adapter(runner, report)
    print(f"\n{report.failed} check(s) failed" if report.failed else "\nall checks passed")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
