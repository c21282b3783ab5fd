"""Programmatic dependent launch (PDL) of the prologue's forward kernel (``ropekit._config.pdl_launches``) and the
bench's ``kv-step`` mode (the QKV projection GEMM, then the prologue, in one CUDA graph).

PDL changes when a kernel may start, never what it computes: on a GPU its results must be the same bits as a
plain launch's, eagerly and under graph capture; on CPU (the interpreter) the switch must change nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import ropekit
from helpers import INTERPRETED
from ropekit import _config, _fastpath
from ropekit.testing import kernels_on_cpu
from ropekit.triton import prologue_launcher, runtime


@pytest.fixture
def pdl_switch(monkeypatch):
    """Sets ``_config.pdl_launches`` for the test (restored after)."""

    def switch(on: bool) -> None:
        monkeypatch.setattr(_config, "pdl_launches", on)

    return switch


def _kv_inputs(device: str, tokens: int = 3, hq: int = 4, hk: int = 2, d: int = 16):
    """q, k, v [T, H, D] as views of one packed qkv buffer (what a QKV projection writes), bshd caches filled
    with NaN, per-sequence positions."""
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, device=device, dtype=torch.bfloat16)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=1)
    q, k, v = q.view(tokens, hq, d), k.view(tokens, hk, d), v.view(tokens, hk, d)
    caches = [torch.full((tokens, 8, hk, d), float("nan"), device=device, dtype=torch.bfloat16) for _ in range(2)]
    positions = torch.randint(0, 8, (tokens,), device=device)
    return q, k, v, caches, positions, qkv


def _norm_inputs(device: str):
    q = torch.randn(2, 3, 4, 16, device=device, dtype=torch.bfloat16)
    k = torch.randn(2, 3, 2, 16, device=device, dtype=torch.bfloat16)
    weights = [torch.rand(16, device=device, dtype=torch.bfloat16) + 0.5 for _ in range(2)]
    return q, k, *weights


def test_the_prologue_kernel_names_its_pdl_constexpr():
    assert prologue_launcher.PROLOGUE.constexprs[prologue_launcher.PROLOGUE.pdl_at] == "PDL"
    assert prologue_launcher.NORM_ROPE_BWD.pdl_at is None  # only the forward waits for the previous grid
    assert not runtime.pdl_supported(torch.device("cpu"))


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_the_switch_changes_nothing_under_the_interpreter(pdl_switch):
    q, k, v, caches, positions, _ = _kv_inputs("cpu")
    with kernels_on_cpu(), torch.no_grad():
        ref_caches = [c.clone() for c in caches]
        pdl_switch(False)
        ref = ropekit.rope_kv_write(q, k, v, *ref_caches, positions=positions)
        pdl_switch(True)
        for _ in range(3):  # what would record a plan and replay it with the switch off
            out = ropekit.rope_kv_write(q, k, v, *caches, positions=positions)
            assert torch.equal(out, ref)
            for a, b in zip(caches, ref_caches):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        nq, nk, qw, kw = _norm_inputs("cpu")
        got = ropekit.qk_norm_rope(nq, nk, qw, kw)
        pdl_switch(False)
        want = ropekit.qk_norm_rope(nq, nk, qw, kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_plans_are_neither_recorded_nor_replayed_while_the_switch_is_on(pdl_switch, monkeypatch):
    served = []
    replay = _fastpath.KvPlan.__call__

    def counting(self, *args):
        out = replay(self, *args)
        served.extend([1] if out is not None else [])
        return out

    monkeypatch.setattr(_fastpath.KvPlan, "__call__", counting)
    q, k, v, caches, positions, _ = _kv_inputs("cpu")
    with kernels_on_cpu(), torch.no_grad():
        _fastpath.clear()
        pdl_switch(True)
        for _ in range(3):
            ropekit.rope_kv_write(q, k, v, *caches, positions=positions)
        assert len(_fastpath._KV_PLANS) == 0
        pdl_switch(False)
        for _ in range(3):  # recorded on the second call, served on the third
            ropekit.rope_kv_write(q, k, v, *caches, positions=positions)
        assert len(_fastpath._KV_PLANS) == 1 and len(served) == 1
        pdl_switch(True)  # a plan recorded without PDL must not serve a call that asks for it
        ropekit.rope_kv_write(q, k, v, *caches, positions=positions)
        assert len(served) == 1


# Run without the interpreter: rope_kv_write's launch for CPU tensors (captured, not run), compiled for sm_90 with
# PDL on and off; prints whether each PTX waits on the previous grid.
_COMPILE_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from helpers import compile_for_target
from ropekit._cache_validation import validate_kv_write
from ropekit._spec import CacheArgs, RopeArgs
from ropekit._validation import validate_args
from ropekit.triton import heuristics, prologue_launcher as P, runtime as R
seen = {}
R.run = lambda call: seen.update(fn=call.roles.fn, args=call.args, warps=call.num_warps,
                                 consts=dict(zip(call.roles.constexprs, call.constexprs)))
q, k, v = (torch.randn(4, h, 128, dtype=torch.bfloat16) for h in (8, 2, 2))
caches = [torch.zeros(4, 64, 2, 128, dtype=torch.bfloat16) for _ in range(2)]
q4, k4, v4, args, cache = validate_kv_write(q, k, CacheArgs(v, *caches), RopeArgs(positions=torch.tensor([1, 2, 3, 4])))
P.launch_prologue(q4, k4, torch.empty_like(q4), None, validate_args(q4, k4, args), v=v4, cache=cache)
for pdl in (False, True):
    consts = dict(seen["consts"], FAST_TRIG=heuristics.fast_trig("cuda", None), PDL=pdl)
    ptx = compile_for_target("sm90", seen["fn"], seen["args"], consts, seen["warps"]).asm["ptx"]
    print(pdl, "griddepcontrol.wait" in ptx)
"""


def test_the_pdl_kernel_compiles_for_sm90_and_waits_only_with_the_flag():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, tests], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "False", "True", "True"]


def _pdl_device() -> torch.device:
    device = torch.device("cuda")
    if not runtime.pdl_supported(device):
        pytest.skip("PDL needs compute capability 9.0+ and a Triton with launch_pdl")
    return device


def _both(fn, pdl_switch, graph: bool):
    """``fn()``'s outputs, switch off then on, eager or replayed from a CUDA graph."""
    results = []
    for on in (False, True):
        pdl_switch(on)
        if graph:
            fn()  # compile and warm up outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs = fn()
            g.replay()
        else:
            outs = fn()
        torch.cuda.synchronize()
        results.append([t.clone() for t in outs])
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_pdl_rope_kv_write_gives_the_same_bits(pdl_switch, graph):
    device = _pdl_device()
    q, k, v, caches, positions, qkv = _kv_inputs(str(device), tokens=64, hq=32, hk=8, d=128)
    # a GEMM before the prologue writes its inputs (q, k, v: views of qkv), as a decode step's QKV projection does
    x = torch.randn(64, 256, device=device, dtype=torch.bfloat16)
    w = torch.randn(256, qkv.shape[1], device=device, dtype=torch.bfloat16) / 16

    def step():
        torch.mm(x, w, out=qkv)
        for c in caches:
            c.fill_(float("nan"))
        out = ropekit.rope_kv_write(q, k, v, *caches, positions=positions)
        return [out, *caches]

    with torch.no_grad():
        plain, pdl = _both(step, pdl_switch, graph)
    for a, b in zip(plain, pdl):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    flags = {key[-4][prologue_launcher.PROLOGUE.pdl_at] for key in runtime.compiled_kernels()
             if key[0] is prologue_launcher.PROLOGUE.fn}
    assert flags == {False, True}
    assert any(getattr(c.metadata, "launch_pdl", False) for key, c in runtime.compiled_kernels().items()
               if key[0] is prologue_launcher.PROLOGUE.fn)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_pdl_qk_norm_rope_forward_gives_the_same_bits(pdl_switch, graph):
    device = _pdl_device()
    q, k, qw, kw = _norm_inputs(str(device))
    src = [torch.randn_like(t) for t in (q, k)]

    def step():
        q.copy_(src[0])  # the previous kernel on the stream writes the prologue's inputs
        k.copy_(src[1])
        return list(ropekit.qk_norm_rope(q, k, qw, kw))

    with torch.no_grad():
        plain, pdl = _both(step, pdl_switch, graph)
    for a, b in zip(plain, pdl):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


# --- the bench's kv-step mode -----------------------------------------------------------------------------------

def _registry():
    from ropekit.bench import cases as bench_cases

    return bench_cases.load_registry()


def _step_case(preset: str = "smoke"):
    from ropekit.bench import cases as bench_cases

    return next(c for c in bench_cases.expand_preset(_registry(), preset) if c.modes == ("kv-step",))


def test_kv_step_is_a_graph_mode_with_its_baseline_floor_and_cases():
    from ropekit.bench import cases as bench_cases
    from ropekit.bench import impls, run

    assert "kv-step" in bench_cases.MODES and "kv-step" in run.GRAPH_MODES
    assert impls.BASELINE["kv-step"] == "gemm" and impls.EXTRA_BASELINES["kv-step"] == ("gemm+copy-kv",)
    assert impls.REFERENCE["kv-step"] == "gemm+ropekit-kv-write"
    assert set(impls.MODE_IMPLS["kv-step"]) == {"gemm+ropekit-kv-write", "gemm+ropekit-kv-write-pdl",
                                                "gemm+unfused-kv"}
    full = [c for c in bench_cases.expand_preset(_registry(), "full") if "kv-step" in c.modes]
    assert {c.model for c in full} == {"llama3-8b", "qwen3-8b"} and {c.cache for c in full} == {"bf16"}
    assert {c.tokens for c in full} == {1, 2, 4, 8, 16, 32, 64, 128, 256}
    assert all(c.seqlen == 1 and c.positions == "batch" and (c.hq, c.hk, c.head_dim) == (32, 8, 128)
               and c.hq * c.head_dim == 4096 for c in full)


def test_kv_step_bytes_add_the_projection_to_the_prologue():
    from ropekit.bench import inputs

    case = _step_case("full")
    nbytes = inputs.case_bytes(case)
    gemm = (case.tokens * 4096 + 4096 * 6144 + case.tokens * 6144) * 2
    assert inputs.qkv_gemm_bytes(case) == gemm
    assert nbytes["kv-step"] == nbytes["kv-decode"] + gemm


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_kv_step_runs_the_gemm_then_the_prologue_on_its_output():
    """The step's q and cache rows are rope_kv_write's of the GEMM's q, k and v (the same bits), and the GEMM
    alone writes the packed buffer the prologue reads."""
    from ropekit.bench import impls, inputs

    case = _step_case()
    inp = inputs.make_inputs(case, torch.device("cpu"))
    q, k, v, kw = inp.kv_call()
    before = [t.clone() for t in (q, k, v)]
    impls.build_baseline("gemm", inp, inputs.bytes_model(inp), "kv-step").run()
    assert not any(torch.equal(t, b) for t, b in zip((q, k, v), before))  # the GEMM wrote q, k and v's buffer
    qkv = [t.clone() for t in (q, k, v)]
    with kernels_on_cpu(), torch.no_grad():
        caches = [torch.full_like(c, float("nan")) for c in (inp.k_cache, inp.v_cache)]
        want = ropekit.rope_kv_write(*qkv, *caches, **kw)
        for name in ("gemm+ropekit-kv-write", "gemm+ropekit-kv-write-pdl"):
            for t, b in zip((q, k, v), before):  # the step's own GEMM must write them again
                t.copy_(b)
            got = impls.build(name, inp, "kv-step", None).result()
            b, p = inp.cache_index
            assert torch.equal(got[0], want.reshape(got[0].shape)), name
            assert torch.equal(got[1], caches[0][b, p]) and torch.equal(got[2], caches[1][b, p]), name
    assert _config.pdl_launches is False  # the -pdl step sets the switch for its call only


def test_kv_step_refuses_a_case_without_caches():
    from ropekit.bench import base, inputs, prologue
    from ropekit.bench import cases as bench_cases

    case = next(c for c in bench_cases.expand_preset(_registry(), "smoke") if c.modes == ("decode", "host"))
    inp = inputs.make_inputs(case, torch.device("cpu"))
    for name in ("gemm", "gemm+ropekit-kv-write-pdl"):
        with pytest.raises(base.Unsupported, match="KV modes"):
            prologue.build_kv_step(name, inp)


def test_kv_step_target_reads_the_step_against_the_gemm_and_the_copy():
    from ropekit.bench import targets

    target = next(t for t in targets.targets_from_registry(_registry()) if t.key == "prologue-step")
    shape = dict(case="m", mode="kv-step", tokens=64, hq=32, hk=8, head_dim=128, source="s")
    rows = [dict(shape, impl=name, median_us=us, ratio_vs_copy=us / 10)
            for name, us in (("gemm", 10.0), ("gemm+copy-kv", 12.0), ("gemm+ropekit-kv-write", 13.8))]
    (result,) = targets.evaluate_targets(rows, [target])
    assert result["worst"] == pytest.approx(1.15) and result["ok"] is False and target.limit == 1.10


@pytest.mark.gpu
def test_kv_step_rows_on_the_gpu():
    """kv-step on CUDA at the smoke case: every row captured in a CUDA graph and timed, the fused steps checked
    (the PDL one's the same bits), none failed."""
    from ropekit.bench import run

    env = {k: "x" for k in ("gpu", "date", "torch", "triton", "ropekit", "commit", "label")}
    device = torch.device("cuda")
    rows = run.run_case(_step_case(), device, run.Timer(device), None, env, None, lambda s: None)
    by_impl = {r["impl"]: r for r in rows}
    assert set(by_impl) == {"gemm", "gemm+copy-kv", "gemm+ropekit-kv-write", "gemm+ropekit-kv-write-pdl",
                            "gemm+unfused-kv"}
    for r in rows:
        skipped = r["impl"].endswith("-pdl") and not runtime.pdl_supported(device)
        assert skipped or (r["median_us"] and "failed" not in r["note"] and "MISMATCH" not in r["note"]), r
    if runtime.pdl_supported(device):
        assert by_impl["gemm+ropekit-kv-write-pdl"]["max_rel_diff"] == "0.00e+00"
