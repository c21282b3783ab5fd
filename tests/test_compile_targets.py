"""The Triton kernel compiles for NVIDIA Hopper (sm_90) and AMD CDNA3 (gfx942) with the installed Triton, on a
machine without a GPU.

The interpreter runs the kernel's Python, not Triton's compiler: what only compilation sees (a global value Triton
refuses, an op it cannot lower, a register spill, inline assembly for the wrong target) would otherwise reach users
first. Triton ships ptxas and its AMD linker, so the whole pipeline down to the cubin / hsaco runs here. Each target
gets the constexprs the launcher would choose on that GPU (``heuristics.fast_trig``: the NVIDIA-only hardware sin/cos
is off on ROCm). A few specialisations are compiled, spanning the constexpr branches, in a subprocess without
``TRITON_INTERPRET`` (under it, ``triton.jit`` builds interpreter functions instead).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import GPU_TARGETS, compile_for_target
from ropekit._spec import BACKWARD, FORWARD
from ropekit._validation import validate
from ropekit.triton import heuristics as H
from ropekit.triton import kernel as K
from ropekit.triton import launcher as L
from ropekit.triton import runtime as R

triton = pytest.importorskip("triton")


def _compile_for(target: str, q, k, config, **api_kwargs):
    """Compile the specialisation the launcher would launch for these (CPU) tensors on ``target``, as the GPU's
    JIT would: 16-byte aligned pointers and ints divisible by 16 marked so, FAST_TRIG as the launcher picks it."""
    _, hip_version = GPU_TARGETS[target]

    conjugate = api_kwargs.pop("conjugate", False)
    angles_method = api_kwargs.pop("exact_angles", "float64")  # the integer-turn path of GPUs with slow float64
    spec = validate(q, k, **api_kwargs, mode=BACKWARD if conjugate else FORWARD)
    out_k = None if k is None else torch.empty_like(k)
    from ropekit import _config

    previous, _config.exact_angles = _config.exact_angles, angles_method
    try:
        _, args, constexprs, num_warps = L.kernel_launch(q, k, torch.empty_like(q), out_k, spec, config=config)
    finally:
        _config.exact_angles = previous
    consts = dict(zip(L.ROPE.constexprs, constexprs), FAST_TRIG=H.fast_trig("cuda", hip_version))
    return compile_for_target(target, K.rope_kernel, args, consts, num_warps)


def _compile_prologue(target: str, case: str):
    """Compile the attention prologue's forward (norm + RoPE + paged fp8 cache write, or bshd bf16) or its
    backward for ``target``, with the launch its launcher builds for small CPU tensors; ``*-large``: qk_norm_rope's
    forward and backward at the block shapes their launchers pick for large grids on a GPU."""
    from ropekit._cache_validation import validate_kv_write
    from ropekit._spec import CacheArgs, RopeArgs
    from ropekit._validation import validate_args
    from ropekit.triton import prologue_launcher as P

    seen = {}

    def capture(call):
        seen.update(fn=call.roles.fn, args=call.args, consts=dict(zip(call.roles.constexprs, call.constexprs)),
                    num_warps=call.num_warps)

    original, R.run = R.run, capture
    try:
        q, k, v = torch.randn(4, 8, 128, dtype=torch.bfloat16), *(torch.randn(4, 2, 128, dtype=torch.bfloat16)
                                                                 for _ in range(2))
        w = torch.rand(128, dtype=torch.bfloat16)
        if case == "bwd":
            q4, k4 = q.view(1, 4, 8, 128), k.view(1, 4, 2, 128)
            P.launch_norm_rope_bwd(q4, q4, k4, k4, validate(q4, k4, positions=3), w, w, 0.0, 1e-6)
        elif "-large" in case:
            q4, k4 = torch.randn(1, 8, 32, 128, dtype=torch.bfloat16), torch.randn(1, 8, 8, 128, dtype=torch.bfloat16)
            shape = (1 << 14, 32, 8, 128, 2, 4 * 132)
            if case.startswith("bwd-large"):
                partial = case.endswith("partial")  # rotary 64 of 128 columns, at the back: a third accumulator
                spec = validate(q4, k4, rotary_dim=64, rotary_at="back") if partial else validate(q4, k4)
                config = H.norm_block_config(*shape, "backward", partial=partial)
                P.launch_norm_rope_bwd(q4, q4, k4, k4, spec, w, w, 0.0, 1e-6, config=config)
            else:
                config = H.norm_block_config(*shape, "forward")
                P.launch_prologue(q4, k4, torch.empty_like(q4), torch.empty_like(k4), validate(q4, k4),
                                  q_weight=w, k_weight=w, config=config)
        else:
            fp8 = case == "paged-fp8"
            dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
            caches = [torch.zeros((4, 16, 2, 128) if fp8 else (4, 64, 2, 128), dtype=dtype) for _ in range(2)]
            slots = torch.tensor([3, -1, 9, 60]) if fp8 else None
            q4, k4, v4, rope_args, cache = validate_kv_write(
                q, k, CacheArgs(v, *caches, slot_mapping=slots, cache_layout="paged" if fp8 else "bshd",
                                k_cache_scale=torch.tensor(0.5) if fp8 else None,
                                v_cache_scale=2.0 if fp8 else None),
                RopeArgs(positions=torch.tensor([1, 2, 3, 4])))
            spec = validate_args(q4, k4, rope_args)
            P.launch_prologue(q4, k4, torch.empty_like(q4), None, spec, v=v4, cache=cache, q_weight=w, k_weight=w)
    finally:
        R.run = original
    consts = dict(seen["consts"], FAST_TRIG=H.fast_trig("cuda", GPU_TARGETS[target][1]))
    if "ROUND_FP8" in consts:
        consts["ROUND_FP8"] = False  # the GPU's own conversion (the software rounding is the interpreter's)
    return compile_for_target(target, seen["fn"], seen["args"], consts, seen["num_warps"])


SPECIALISATIONS = [
    # (id, q shape [B, S, H, D], HK, dtype, config, api kwargs)
    ("decode-exact-neox-bf16", (4, 1, 32, 128), 8, torch.bfloat16, None, dict(positions=torch.arange(4))),
    ("prefill-table-interleaved-fp16", (2, 64, 8, 64), 2, torch.float16, (1, 8, 2, 1),
     dict(style="interleaved", cos=torch.rand(64, 32), sin=torch.rand(64, 32))),
    ("varlen-angles-partial-back-fp32", (1, 40, 4, 96), 1, torch.float32, (2, 4, 1, 2),
     dict(layout="thd", cu_seqlens=torch.tensor([0, 7, 40], dtype=torch.int32), rotary_dim=32,
          rotary_at="back", angles=torch.rand(64, 16), q_scale=0.5)),
    ("q-only-per-token-conjugate", (2, 16, 4, 128), 0, torch.bfloat16, (4, 4, 1, 4),
     dict(positions=torch.randint(0, 99, (2, 16)), conjugate=True)),
    ("mrope-interleaved-bf16", (2, 16, 16, 128), 4, torch.bfloat16, None,
     dict(positions=torch.randint(0, 99, (3, 2, 16)), sections=(24, 20, 20), section_layout="interleaved")),
    ("mrope-contiguous-decode-bf16", (8, 1, 28, 128), 4, torch.bfloat16, None,
     dict(positions=torch.randint(0, 99, (3, 8, 1)), sections=(16, 24, 24))),
    ("integer-angles-decode-bf16", (4, 1, 32, 128), 8, torch.bfloat16, None,
     dict(positions=torch.arange(4), exact_angles="integer")),
    ("integer-angles-mrope-prefill-fp16", (2, 32, 8, 128), 2, torch.float16, None,
     dict(positions=torch.randint(0, 99, (3, 2, 32)), sections=(16, 24, 24), exact_angles="integer")),
    # a vision tower's 2-D RoPE at head_dim 72 (head stride not divisible by 16): accesses must stay vectors
    ("vision-2d-d72-bf16-vectorised", (1, 64, 16, 72), 16, torch.bfloat16, None,
     dict(layout="thd", positions=torch.randint(0, 64, (2, 64)), sections=(18, 18), inv_freq=torch.rand(36))),
    # head stride 8 = one unit of 8: the stride argument is 1, which Triton makes a constant
    ("head-dim-8-unit-stride-bf16", (2, 4, 4, 8), 2, torch.bfloat16, None, dict(positions=torch.arange(2))),
]


PROLOGUE_CASES = ["paged-fp8", "bshd-bf16", "bwd", "norm-fwd-large", "bwd-large", "bwd-large-partial"]


def _compile_case(target: str, case) -> str:
    """'ok', or why the case did not compile to a binary (cubin without local memory / hsaco) for ``target``."""
    try:
        if isinstance(case, str):
            compiled = _compile_prologue(target, case)
        else:
            _, shape, hk, dtype, config, kwargs = case
            q = torch.randn(*shape, dtype=dtype)
            if kwargs.get("layout") == "thd":
                q = q[0]
            k = None if hk == 0 else torch.randn(*q.shape[:-2], hk, q.shape[-1], dtype=dtype)
            compiled = _compile_for(target, q, k, config, **dict(kwargs))
    except Exception as exc:  # noqa: BLE001 - reported to the test in the parent process
        return f"{type(exc).__name__}: {str(exc)[:500]}"
    if target == "gfx942":
        return "ok" if compiled.asm.get("hsaco") else "no hsaco"
    if not compiled.asm.get("cubin"):
        return "no cubin"
    if "ld.local" in compiled.asm["ptx"]:
        return "spills to local memory"
    if not isinstance(case, str) and case[0].endswith("-vectorised") and ".U16" in compiled.asm["sass"]:
        return "2-byte scalar loads or stores (LDG/STG .U16)"
    ptxas = find_ptxas()
    if ptxas is None:
        return NO_PTXAS
    try:
        spilled = _ptxas_spill_bytes(ptxas, compiled.asm["ptx"])
    except RuntimeError as exc:
        return f"{ptxas}: {exc}"
    if spilled:  # register spills appear only in ptxas's allocation, not in the PTX
        return f"ptxas spills {spilled} bytes to local memory"
    return "ok"


NO_PTXAS = ("compiled, but no ptxas to count register spills: set TRITON_PTXAS_PATH, or install a triton that "
            "ships one (triton/backends/nvidia/bin), or put one on PATH")


def find_ptxas() -> str | None:
    """The ptxas Triton compiles with, found by public means only: ``TRITON_PTXAS_PATH``, else the one the triton
    package ships (a file in its directory), else ``ptxas`` on PATH; None where there is none."""
    import shutil

    name = "ptxas.exe" if sys.platform == "win32" else "ptxas"
    shipped = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    for path in (os.environ.get("TRITON_PTXAS_PATH"), shipped, shutil.which("ptxas")):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def _ptxas_spill_bytes(ptxas: str, ptx: str) -> int:
    """Bytes of register spill stores ``ptxas`` reports for ``ptx`` (sm_90a); RuntimeError where it fails."""
    import re
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(tmp, "kernel.cubin")],
                              capture_output=True, text=True, timeout=120)
    if done.returncode != 0:  # a count of nothing would read as no spills
        raise RuntimeError(f"exit {done.returncode}: {done.stderr[-500:]}")
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", done.stdout + done.stderr))


def _assert_compiled(result: str) -> None:
    """A case's result from the compile subprocess: 'ok', a skip where only the spill count could not be taken."""
    if result == NO_PTXAS:
        pytest.skip(result)
    assert result == "ok"


@pytest.fixture(scope="module")
def compile_results():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"the compile subprocess failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("target", sorted(GPU_TARGETS))
@pytest.mark.parametrize("case", SPECIALISATIONS, ids=[c[0] for c in SPECIALISATIONS])
def test_kernel_compiles_for_each_target(case, target, compile_results):
    _assert_compiled(compile_results[f"{target}/{case[0]}"])


@pytest.mark.parametrize("target", sorted(GPU_TARGETS))
@pytest.mark.parametrize("case", PROLOGUE_CASES)
def test_prologue_kernels_compile_for_each_target(case, target, compile_results):
    _assert_compiled(compile_results[f"{target}/prologue-{case}"])


def test_hardware_sin_cos_only_on_nvidia():
    assert H.fast_trig("cuda", None)  # CUDA build of torch, NVIDIA GPU
    assert not H.fast_trig("cuda", "6.2")  # ROCm build: its GPUs are "cuda" devices too
    assert not H.fast_trig("cpu", None)  # the interpreter


if __name__ == "__main__":
    results = {f"{target}/{case[0]}": _compile_case(target, case) for target in GPU_TARGETS for case in SPECIALISATIONS}
    results.update({f"{target}/prologue-{case}": _compile_case(target, case) for target in GPU_TARGETS
                    for case in PROLOGUE_CASES})
    print(json.dumps(results))
