"""The MLA prologue kernel compiles for NVIDIA Hopper (sm_90) and AMD CDNA3 (gfx942) with the installed Triton, on a
machine without a GPU, to a binary without register spills.

The interpreter runs the kernel's Python, not Triton's compiler (see test_compile_targets.py, which does the same for
the other kernels). The launch the launcher builds for small CPU tensors is captured instead of run, and compiled
in a subprocess without ``TRITON_INTERPRET``, with the constexprs the launcher picks on each GPU: the hardware
sin/cos on NVIDIA only, the GPU's own float8 conversion, and both exact-angle reductions.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import GPU_TARGETS, compile_for_target

pytest.importorskip("triton")

# (case id, cache dtype or None, split caches, split q and broadcast k, exact-angle method, output dtype or None)
CASES = [
    ("paged-bf16-one-cache", torch.bfloat16, False, False, "float64", None),
    ("paged-e4m3-split-caches-split-q", torch.float8_e4m3fn, True, True, "integer", None),
    ("paged-e5m2-one-cache", torch.float8_e5m2, False, False, "float64", None),
    ("no-cache-broadcast-k", None, False, True, "integer", None),
    ("e4m3-outputs-tensor-scales-e4m3-cache", torch.float8_e4m3fn, False, True, "float64", torch.float8_e4m3fn),
    ("e5m2-outputs", None, False, False, "float64", torch.float8_e5m2),
]


def _captured_launch(cache_dtype, split_caches: bool, split_q: bool, method: str, out_dtype):
    """(kernel, runtime args, constexprs by name, num_warps) of a DeepSeek-shaped call (16 heads, 128 + 64
    columns, latent 512), captured before it runs."""
    import ropekit
    from ropekit import _config
    from ropekit.triton import runtime

    seen = {}

    def capture(call):
        seen.update(fn=call.roles.fn, args=call.args, consts=dict(zip(call.roles.constexprs, call.constexprs)),
                    num_warps=call.num_warps)

    saved = runtime.run, _config.kernels_on_cpu, _config.exact_angles
    runtime.run, _config.kernels_on_cpu, _config.exact_angles = capture, True, method
    try:
        T = 8
        q = torch.randn(T, 16, 192, dtype=torch.bfloat16)
        k_pe, kv_c = torch.randn(T, 1, 64, dtype=torch.bfloat16), torch.randn(T, 512, dtype=torch.bfloat16)
        kw = {}
        if cache_dtype is not None:
            cache = ((torch.zeros(4, 16, 512, dtype=cache_dtype), torch.zeros(4, 16, 64, dtype=cache_dtype))
                     if split_caches else torch.zeros(4, 16, 576, dtype=cache_dtype))
            kw = dict(kv_cache=cache, slot_mapping=torch.arange(T), kv_cache_scale=torch.tensor(0.5)
                      if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else None)
        if out_dtype is not None:  # tensor scales beside a cache: the kernel reads them (graph capture)
            kw.update(out_dtype=out_dtype, q_out_scale=torch.tensor(2.0) if kw else 2.0)
        with torch.no_grad():
            ropekit.mla_rope_kv_write(q, k_pe, kv_c if "kv_cache" in kw else None, positions=torch.arange(T),
                                      split_q=split_q, broadcast_k=split_q, style="interleaved", **kw)
    finally:
        runtime.run, _config.kernels_on_cpu, _config.exact_angles = saved
    return seen


def _compile(target: str, seen: dict):
    """Compile the captured launch for ``target`` as the GPU's JIT would (``helpers.compile_for_target``), with the
    target's trigonometry and the GPU's own float8 conversion."""
    from ropekit.triton import heuristics

    consts = dict(seen["consts"], FAST_TRIG=heuristics.fast_trig("cuda", GPU_TARGETS[target][1]), ROUND_FP8=False)
    return compile_for_target(target, seen["fn"], seen["args"], consts, seen["num_warps"])


def _result(target: str, case) -> str:
    """'ok', or why the case did not compile to a binary without local memory for ``target``."""
    try:
        compiled = _compile(target, _captured_launch(*case[1:]))
    except Exception as exc:  # noqa: BLE001 - reported to the test in the parent process
        return f"{type(exc).__name__}: {str(exc)[:500]}"
    if target == "gfx942":
        return "ok" if compiled.asm.get("hsaco") else "no hsaco"
    if not compiled.asm.get("cubin"):
        return "no cubin"
    return "spills to local memory" if "ld.local" in compiled.asm["ptx"] else "ok"


@pytest.fixture(scope="module")
def compile_results():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"the compile subprocess failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("target", sorted(GPU_TARGETS))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_mla_kernel_compiles_for_each_target(case, target, compile_results):
    assert compile_results[f"{target}/{case[0]}"] == "ok"


if __name__ == "__main__":
    print(json.dumps({f"{target}/{case[0]}": _result(target, case) for target in GPU_TARGETS for case in CASES}))
