"""The benchmark harness: registry, bytes model, targets, and a CPU smoke run of ``ropekit bench`` end to end.

The smoke run uses the Triton interpreter and tiny shapes; its numbers are not performance figures and the output
says so. A small stand-in for transformers' ``apply_rotary_pos_emb`` (same calling convention and formula) lets
the run exercise the peer code path and check its cos/sin layout against ropekit's output.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
try:
    import ropekit.bench  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(ROOT / "src"))
from helpers import INTERPRETED  # noqa: E402
from ropekit.bench import cases as bench_cases  # noqa: E402
from ropekit.bench import cli, impls, inputs, prologue, report, run, timing  # noqa: E402
from ropekit.bench import env as bench_env  # noqa: E402
from ropekit.bench import targets as bench_targets  # noqa: E402

REGISTRY = ROOT / "src" / "ropekit" / "bench" / "registry.py"  # shipped with the package
REQUIRED_FIELDS = ("gpu", "date", "torch", "triton", "ropekit", "commit", "case", "mode", "impl", "tokens", "bytes",
                   "median_us", "gbps", "ratio_vs_copy")

_STAND_IN_LLAMA = '''
import torch


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
'''

_STAND_IN_COHERE = '''
import torch


def rotate_half(x):
    even, odd = x[..., ::2], x[..., 1::2]
    return torch.stack([-odd, even], dim=-1).flatten(-2)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    dtype = q.dtype
    q, k = q.float(), k.float()
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos + rotate_half(q) * sin).to(dtype), (k * cos + rotate_half(k) * sin).to(dtype)
'''


def _stand_in_transformers(root: Path) -> Path:
    """A package named ``transformers`` with the two functions the harness imports."""
    pkg = root / "transformers"
    files = {
        "__init__.py": '__version__ = "stand-in"\n',
        "models/__init__.py": "",
        "models/llama/__init__.py": "",
        "models/llama/modeling_llama.py": _STAND_IN_LLAMA,
        "models/cohere/__init__.py": "",
        "models/cohere/modeling_cohere.py": _STAND_IN_COHERE,
    }
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


# ---------------------------------------------------------------------------------------------------------------
# Registry, bytes model, targets (in process, no kernels)
# ---------------------------------------------------------------------------------------------------------------

def test_registry_presets_expand():
    registry = bench_cases.load_registry(str(REGISTRY))
    for preset in registry["PRESETS"]:
        cases = bench_cases.expand_preset(registry, preset)
        assert cases, preset
        pairs = [(c.name, m) for c in cases for m in c.modes]
        assert len(pairs) == len(set(pairs)), f"{preset}: a (case, mode) pair runs twice"
    full = bench_cases.expand_preset(registry, "full")
    assert {c.model for c in full} >= {"llama3-8b", "llama3-70b", "mha16-d64", "hd256", "mla-rope"}
    assert {c.dtype for c in full} == {"fp32", "fp16", "bf16"}
    layouts = {c.model: c.section_layout for c in full + bench_cases.expand_preset(registry, "smoke")
               if c.positions == "mrope"}
    assert layouts == {"qwen2-vl-7b": "contiguous", "qwen3-vl-8b": "interleaved", "tiny": "contiguous",
                       "tiny-interleaved": "interleaved", "wan2.2-5b": "contiguous", "wan2.1-14b": "contiguous",
                       "tiny-dit": "contiguous"}
    assert {c.style for c in full} == {"neox", "interleaved"}
    assert {c.positions for c in full} == set(bench_cases.POSITION_KINDS)
    # every mode but the CPU one, which runs on its own (--preset cpu)
    assert {m for c in full for m in c.modes} == set(bench_cases.MODES) - {bench_cases.CPU_MODE}
    cpu = bench_cases.expand_preset(registry, "cpu")
    assert {c.modes for c in cpu} == {(bench_cases.CPU_MODE,)}
    assert {(c.dtype, c.positions, c.batch, c.seqlen) for c in cpu} == {
        (d, p, b, s) for d in ("bf16", "fp32") for p in ("ids", "offset")
        for b, s in ((1, 1), (8, 1), (32, 1), (256, 1), (2, 4096))}
    assert {(c.hq, c.hk, c.head_dim) for c in cpu} == {(32, 8, 128)}
    prefill = [c.tokens for c in full if "fwd" in c.modes]
    assert min(prefill) == 2048 and max(prefill) == 131072
    decode = [c.tokens for c in full if "decode" in c.modes]
    assert min(decode) == 1 and max(decode) == 256
    mla = next(c for c in full if c.model == "mla-rope")
    assert (mla.head_dim, mla.rotary_dim, mla.rotary_at) == (192, 64, "back")
    # The attention prologue: Llama-3-8B and Qwen3-8B (with its qk_norm), bf16 and fp8 caches.
    kv_decode = [c for c in full if "kv-decode" in c.modes]
    assert {c.model for c in kv_decode} == {"llama3-8b", "qwen3-8b"} and {c.cache for c in kv_decode} == {"bf16", "fp8"}
    assert {c.tokens for c in kv_decode} == {1, 2, 4, 8, 16, 32, 64, 128, 256}
    assert all(c.seqlen == 1 and c.positions == "batch" and (c.hq, c.hk, c.head_dim) == (32, 8, 128)
               for c in kv_decode)
    kv_prefill = [c for c in full if "kv-prefill" in c.modes]
    assert {c.tokens for c in kv_prefill} == {2048, 4096, 8192, 16384, 32768} and {c.batch for c in kv_prefill} == {1}
    assert {c.cache for c in kv_prefill} == {"bf16", "fp8"} and {c.positions for c in kv_prefill} == {"offset"}
    norm = [c for c in full if "norm-fwdbwd" in c.modes]
    assert {c.model for c in norm} == {"qwen3-8b"} and all(c.qk_norm and c.cache is None for c in norm)
    assert {c.tokens for c in norm} == {4 * 4096, 8 * 4096, 16 * 4096}
    assert next(c for c in kv_decode if c.model == "qwen3-8b").qk_norm
    assert not next(c for c in kv_decode if c.model == "llama3-8b").qk_norm
    assert len({c.name for c in kv_decode}) == len(kv_decode)  # the cache dtype is part of the name
    # The MLA prologue: DeepSeek-V3 at 16 and 128 heads, 128 + 64 rope columns, latent 512, bf16 and fp8 caches.
    mla_decode = [c for c in full if "mla-decode" in c.modes]
    assert {c.hq for c in mla_decode} == {16, 128} and {c.cache for c in mla_decode} == {"bf16", "fp8"}
    assert all((c.head_dim, c.rotary_dim, c.rotary_at, c.latent_dim, c.dtype) == (192, 64, "back", 512, "bf16")
               and c.seqlen == 1 and c.positions == "batch" for c in mla_decode)
    assert {c.tokens for c in mla_decode} == {1, 2, 4, 8, 16, 32, 64, 128, 256}
    mla_prefill = [c for c in full if "mla-prefill" in c.modes]
    assert {c.tokens for c in mla_prefill} == {2048, 4096, 8192, 16384, 32768}
    assert {c.cache for c in mla_prefill} == {"bf16", "fp8"} and {c.latent_dim for c in mla_prefill} == {512}
    assert all(c.latent_dim is None for c in full if not set(c.modes) & set(bench_cases.MLA_MODES))
    # RoPE fused into attention: GQA D128, MHA D64 and MLA (v head dim 128), causal and not, in "full" and alone.
    attn = [c for c in full if c.modes == bench_cases.ATTN_MODES]
    assert attn == bench_cases.expand_preset(registry, "attention")
    assert {c.model for c in attn} == {"llama3-8b", "mha16-d64", "mla-rope"}
    assert {c.causal for c in attn} == {True, False}
    assert {(c.batch, c.seqlen) for c in attn} == {(8, 1024), (4, 4096), (1, 16384)} and len(attn) == 18
    assert all(c.cache is None and c.positions == "range" and c.dtype == "bf16" for c in attn)
    assert all(c.causal is None for c in full if c not in attn)
    mla_attn = next(c for c in attn if c.model == "mla-rope")
    assert (mla_attn.head_dim, mla_attn.value_dim, mla_attn.rotary_dim, mla_attn.rotary_at) == (192, 128, 64, "back")
    assert next(c for c in attn if c.model == "llama3-8b").value_dim == 128
    assert len({c.name for c in attn}) == len(attn)  # the mask is part of the name
    assert {c.name.split("/")[4] for c in attn} == {"causal", "noncausal"}


@pytest.mark.parametrize("group, error", [
    ({"modes": ["kv-decode", "decode"]}, "group of their own"),
    ({"modes": ["decode"], "caches": ["fp8"]}, "KV modes"),
    ({"caches": ["fp16"]}, "caches are bf16 or fp8"),
    ({"caches": ["int8"]}, "unknown cache dtype"),
    ({"sizes": [[1, 4]]}, "one token per sequence"),
    ({"positions": ["thd"], "modes": ["kv-prefill"]}, "KV modes take positions"),
    ({"models": ["tiny"], "modes": ["norm-fwdbwd"], "caches": None}, "needs a model with qk_norm"),
    ({"modes": ["mla-decode", "kv-decode"]}, "group of their own"),
    ({"modes": ["mla-decode"]}, "need a model with latent_dim"),
    ({"models": ["tiny-latent"], "modes": ["mla-prefill"], "positions": ["thd"]}, "KV modes take positions"),
    ({"models": ["tiny-latent"], "modes": ["mla-decode"], "sizes": [[1, 4]]}, "mla-decode is one token"),
])
def test_registry_rejects_bad_prologue_groups(group, error):
    registry = bench_cases.load_registry(str(REGISTRY))
    base = {"name": "g", "models": ["tiny-qknorm"], "dtypes": ["bf16"], "styles": ["neox"], "positions": ["batch"],
            "caches": ["bf16", "fp8"], "sizes": [[2, 1]], "modes": ["kv-decode"]}
    registry = dict(registry, PRESETS={"p": [dict(base, **group)]})
    with pytest.raises(ValueError, match=error):
        bench_cases.expand_preset(registry, "p")


@pytest.mark.parametrize("group, error", [
    ({"modes": ["attn-fwd", "fwd"]}, "group of their own"),
    ({"modes": ["fwd"]}, "'causal' applies to the attention modes"),
    ({"causal": [1]}, "list of distinct booleans"),
    ({"causal": []}, "list of distinct booleans"),
    ({"positions": ["thd"]}, "attention modes take positions"),
])
def test_registry_rejects_bad_attention_groups(group, error):
    registry = bench_cases.load_registry(str(REGISTRY))
    base = {"name": "g", "models": ["tiny-mla"], "dtypes": ["bf16"], "styles": ["neox"], "positions": ["range"],
            "causal": [True], "sizes": [[1, 64]], "modes": ["attn-fwd", "attn-fwdbwd"]}
    registry = dict(registry, PRESETS={"p": [dict(base, **group)]})
    with pytest.raises(ValueError, match=error):
        bench_cases.expand_preset(registry, "p")
    registry["PRESETS"]["p"] = [{k: v for k, v in base.items() if k != "causal"}]  # default: both masks
    assert [c.causal for c in bench_cases.expand_preset(registry, "p")] == [False, True]


@pytest.mark.parametrize("model, error", [
    ({"section_layout": "interleave"}, "section_layout must be one of"),
    ({"sections": [6, 5, 4]}, "must sum to rotary_dim / 2 = 16"),
])
def test_registry_rejects_bad_multi_axis_models(model, error):
    registry = bench_cases.load_registry(str(REGISTRY))
    models = dict(registry["MODELS"], bad=dict(registry["MODELS"]["tiny-interleaved"], **model))
    group = {"name": "g", "models": ["bad"], "dtypes": ["bf16"], "styles": ["neox"], "positions": ["mrope"],
             "sizes": [[2, 16]], "modes": ["fwd"]}
    registry = dict(registry, MODELS=models, PRESETS={"p": [group]})
    with pytest.raises(ValueError, match=error):
        bench_cases.expand_preset(registry, "p")
    registry["MODELS"]["bad"] = registry["MODELS"]["tiny-interleaved"]  # the same group with a good model builds
    assert [c.section_layout for c in bench_cases.expand_preset(registry, "p")] == ["interleaved"]


def _targets():
    return bench_targets.targets_from_registry(bench_cases.load_registry(str(REGISTRY)))


def _mode_bytes(case, mode):
    """The bytes of ``case`` in ``mode`` (the CPU mode: as the fwd mode's, as its rows say)."""
    nbytes = inputs.case_bytes(case)
    return nbytes.get(mode, nbytes["fwd"])


def test_quick_preset_has_a_case_for_every_target():
    """quick has a case for every target but the attention modes' and the CPU mode's, which have presets of their
    own."""
    registry = bench_cases.load_registry(str(REGISTRY))
    env = {k: "x" for k in ("gpu", "date", "torch", "triton", "ropekit", "commit", "label")}
    for target in _targets():
        preset = "attention" if target.mode in bench_cases.ATTN_MODES else \
            "cpu" if target.mode == bench_cases.CPU_MODE else "quick"
        cases = bench_cases.expand_preset(registry, preset)
        rows = [run._row(env, c, m, target.impl, _mode_bytes(c, m), impls.BASELINE.get(m, "hf"))
                for c in cases for m in c.modes]
        assert any(r["mode"] == target.mode and target.select(r) for r in rows), target.key
    assert not any(set(c.modes) & set(bench_cases.ATTN_MODES) for c in bench_cases.expand_preset(registry, "quick"))


def test_select_cases_filters_and_shards():
    registry = bench_cases.load_registry(str(REGISTRY))
    cases = bench_cases.expand_preset(registry, "full")
    only = bench_cases.select_cases(cases, groups="decode", pattern=None, modes=None, shard=None)
    assert only and all(c.group == "decode" for c in only)
    rx = bench_cases.select_cases(cases, groups=None, pattern=r"^llama3-70b/", modes="fwd", shard=None)
    assert rx and all(c.model == "llama3-70b" and c.modes == ("fwd",) for c in rx)
    shards = [bench_cases.select_cases(cases, groups=None, pattern=None, modes=None, shard=f"{i}/3") for i in (1, 2, 3)]
    assert sorted(c.name + c.group for s in shards for c in s) == sorted(c.name + c.group for c in cases)
    with pytest.raises(ValueError, match="shard"):
        bench_cases.select_cases(cases, groups=None, pattern=None, modes=None, shard="4/3")
    with pytest.raises(ValueError, match="mode"):
        bench_cases.select_cases(cases, groups=None, pattern=None, modes="fwd,backwards", shard=None)


@pytest.mark.parametrize("positions, cache, qk_norm", [("batch", "fp8", True), ("offset", "bf16", False),
                                                     ("ids", "bf16", True), ("range", None, True)])
def test_prologue_bytes_model_matches_the_tensors(positions, cache, qk_norm):
    import torch

    seqlen = 1 if positions == "batch" else 8
    modes = ("norm-fwdbwd",) if cache is None else ("kv-prefill",)
    case = bench_cases.Case(group="t", family="t", model="tiny-qknorm", hq=4, hk=2, head_dim=32, rotary_dim=32,
                            rotary_at="front", base=10000.0, dtype="bf16", style="neox", positions=positions, batch=3,
                            seqlen=seqlen, modes=modes, qk_norm=qk_norm, cache=cache)
    inp = inputs.make_inputs(case, torch.device("cpu"))
    assert inputs.bytes_model(inp) == inputs.case_bytes(case)
    nbytes = inputs.bytes_model(inp)
    T = 3 * seqlen
    q, k = T * 4 * 32 * 2, T * 2 * 32 * 2
    if cache is None:
        assert nbytes["norm-fwdbwd"] >= 5 * (q + k) and inp.v is None and inp.k_cache is None
        return
    cache_elem = 1 if cache == "fp8" else 2
    assert nbytes["kv-prefill"] == nbytes["kv-decode"] >= 2 * q + 2 * k + 2 * k // 2 * cache_elem
    # q, k, v: views of one packed QKV buffer; the caches hold every position; the index names each token's row
    assert inp.q.data_ptr() + 4 * 32 * 2 == inp.k.data_ptr() and inp.v.stride() == inp.q.stride()
    assert inp.k_cache.shape[0] == 3 and inp.k_cache.shape[1] > int(inp.pos_grid.max())
    assert inp.k_cache.dtype == bench_cases.CACHE_DTYPES[cache] and (inp.cache_scale is not None) == (cache == "fp8")
    assert (inp.q_weight is not None) == qk_norm
    seq, pos = inp.cache_index
    assert seq.tolist() == [b for b in range(3) for _ in range(seqlen)]
    assert pos.tolist() == inp.pos_grid.reshape(-1).tolist()


@pytest.mark.parametrize("positions, cache", [("batch", "fp8"), ("offset", "bf16"), ("ids", "bf16")])
def test_mla_bytes_model_matches_the_tensors(positions, cache):
    """The MLA modes' inputs: q, and k_pe and kv_c as views of one packed latent buffer; a paged cache with room for
    every position, each token at its own slot; the bytes model counts exactly what the tensors hold."""
    import torch

    seqlen = 1 if positions == "batch" else 8
    case = bench_cases.Case(group="t", family="t", model="tiny-latent", hq=3, hk=1, head_dim=24, rotary_dim=8,
                            rotary_at="back", base=10000.0, dtype="bf16", style="interleaved", positions=positions,
                            batch=3, seqlen=seqlen, modes=("mla-prefill",), cache=cache, latent_dim=32)
    inp = inputs.make_inputs(case, torch.device("cpu"))
    nbytes = inputs.bytes_model(inp)
    expected = inputs.case_bytes(case)
    assert {m: nbytes[m] for m in bench_cases.MLA_MODES} == {m: expected[m] for m in bench_cases.MLA_MODES}
    assert nbytes["mla-decode"] == nbytes["mla-prefill"]
    T, cache_elem = 3 * seqlen, bench_cases.CACHE_DTYPES[cache].itemsize
    pos = {"batch": 3 * 8, "ids": T * 8}.get(positions, 0)
    assert nbytes["mla-prefill"] == (2 * inp.q.numel() * 2 + (inp.kv_c.numel() + inp.k.numel()) * (2 + cache_elem)
                                     + inp.slot_mapping.numel() * 8 + pos + 4 * 4 + (4 if cache == "fp8" else 0))
    assert inp.k.shape == (3, seqlen, 1, 8) and inp.kv_c.shape == (3, seqlen, 32)
    assert inp.kv_c.data_ptr() + 32 * 2 == inp.k.data_ptr() and inp.v is None and inp.k_cache is None
    assert inp.mla_cache.shape[1:] == (bench_cases.MLA_PAGE_SIZE, 40)
    assert inp.mla_cache.dtype == bench_cases.CACHE_DTYPES[cache]
    slots = inp.slot_mapping.reshape(-1)
    assert len(set(slots.tolist())) == T and 0 <= int(slots.min()) and int(slots.max()) < inp.mla_cache.shape[0] * 64
    assert (slots % 64).tolist() == (inp.pos_grid.reshape(-1) % 64).tolist()


def test_host_training_steps_differentiate_what_each_op_takes():
    # The host mode runs without autograd; a step turns it on and returns the gradients of its own leaves: q and k
    # for apply_rope's, q, k and both weights for qk_norm_rope's. A model without the norm has no qk_norm step.
    import torch

    from ropekit.bench.base import Unsupported

    case = bench_cases.Case(group="t", family="t", model="tiny", hq=4, hk=2, head_dim=16, rotary_dim=16,
                            rotary_at="front", base=10000.0, dtype="fp32", style="neox", positions="range",
                            batch=1, seqlen=2, modes=("host",), qk_norm=True)
    inp = inputs.make_inputs(case, torch.device("cpu"))
    with torch.no_grad():
        step = {n: prologue.build_prologue(n, inp, "host").run() for n in prologue.STEP_IMPLS}
    assert [g.shape for g in step["ropekit-step"]] == [inp.q.shape, inp.k.shape]
    assert [g.shape for g in step["ropekit-qk-norm-step"]] == [inp.q.shape, inp.k.shape, (16,), (16,)]
    plain = inputs.make_inputs(dataclasses.replace(case, qk_norm=False), torch.device("cpu"))
    with pytest.raises(Unsupported, match="qk_norm"):
        prologue.build_prologue("ropekit-qk-norm-step", plain, "host")


@pytest.mark.parametrize("positions", bench_cases.POSITION_KINDS)
def test_bytes_model_matches_the_tensors(positions):
    import torch

    case = bench_cases.Case(group="t", family="t", model="tiny", hq=4, hk=2, head_dim=32, rotary_dim=32,
                            rotary_at="front", base=10000.0, dtype="bf16", style="neox", positions=positions, batch=3,
                            seqlen=8, modes=("fwd",), sections=(4, 6, 6) if positions == "mrope" else None)
    inp = inputs.make_inputs(case, torch.device("cpu"))
    qk = 3 * 8 * (4 + 2) * 32 * 2
    assert inputs.bytes_model(inp) == inputs.case_bytes(case)
    assert inputs.bytes_model(inp)["fwd"] >= 2 * qk
    assert inputs.bytes_model(inp)["fwdbwd"] == 2 * inputs.bytes_model(inp)["fwd"]
    assert int(inp.pos_grid.max()) < inp.cos_tab.shape[0]
    if positions == "thd":
        assert inp.q.shape == (24, 4, 32) and int(inp.cu_seqlens[-1]) == 24
        assert len(set(inputs.varlen_lengths(3, 8))) > 1


def _attention_case(causal=True, hq=4, hk=2, head_dim=48, v_head_dim=32, batch=2, seqlen=16, positions="range"):
    return bench_cases.Case(group="t", family="t", model="tiny-mla", hq=hq, hk=hk, head_dim=head_dim, rotary_dim=16,
                            rotary_at="back", base=10000.0, dtype="bf16", style="neox", positions=positions,
                            batch=batch, seqlen=seqlen, modes=bench_cases.ATTN_MODES, causal=causal,
                            v_head_dim=v_head_dim)


def test_attention_flops_follow_the_formula():
    """flops = 2 B Hq S^2 (D + Dv), half of it with the causal mask; fwd+bwd 3.5x the forward; none elsewhere."""
    B, Hq, S, D, Dv = 8, 32, 1024, 128, 128
    full = _attention_case(causal=False, hq=Hq, hk=8, head_dim=D, v_head_dim=Dv, batch=B, seqlen=S)
    fwd = 2 * B * Hq * S * S * (D + Dv)
    assert inputs.attention_flops(full) == {"attn-fwd": fwd, "attn-fwdbwd": 3.5 * fwd}
    causal = inputs.attention_flops(_attention_case(causal=True, hq=Hq, hk=8, head_dim=D, v_head_dim=Dv, batch=B,
                                                    seqlen=S))
    assert causal == {"attn-fwd": fwd // 2, "attn-fwdbwd": 3.5 * fwd / 2}
    mla = _attention_case(causal=False, hq=16, hk=16, head_dim=192, v_head_dim=128, batch=1, seqlen=16384)
    assert inputs.attention_flops(mla)["attn-fwd"] == 2 * 16 * 16384**2 * (192 + 128)
    assert inputs.attention_flops(dataclasses.replace(mla, v_head_dim=None))["attn-fwd"] == 2 * 16 * 16384**2 * 384
    assert inputs.attention_flops(dataclasses.replace(full, causal=None)) == {}  # not an attention case
    # the rows carry the count; the timed ones its rate: flops / (us * 1e-6) / 1e12
    env = {k: "x" for k in ("gpu", "date", "torch", "triton", "ropekit", "commit", "label")}
    row = run._row(env, full, "attn-fwdbwd", "ropekit", 1, "rope+sdpa-cudnn")
    assert row["flops"] == 3.5 * fwd and row["tflops"] == ""
    run._record(row, {}, "ropekit", 2000.0)
    assert float(row["tflops"]) == pytest.approx(3.5 * fwd / 2000e-6 / 1e12, rel=1e-3)
    plain = run._row(env, dataclasses.replace(full, causal=None), "fwd", "ropekit", 100, "copy")
    run._record(plain, {}, "ropekit", 1.0)
    assert plain["flops"] == plain["tflops"] == ""


@pytest.mark.parametrize("positions", ["range", "batch", "ids"])
def test_attention_inputs_and_bytes(positions):
    """The attention modes' tensors: fresh contiguous q [B, Hq, S, D], k [B, Hk, S, D] and v [B, Hk, S, Dv] (layout
    bhsd); the bytes model reads q, k, v and writes o once (fwd+bwd: three times that)."""
    import torch

    case = _attention_case(positions=positions)
    inp = inputs.make_inputs(case, torch.device("cpu"))
    assert inp.layout == "bhsd" and inp.rope_kwargs()["layout"] == "bhsd"
    assert (inp.q.shape, inp.k.shape, inp.v.shape) == ((2, 4, 16, 48), (2, 2, 16, 48), (2, 2, 16, 32))
    assert all(t.is_contiguous() and t.dtype == torch.bfloat16 for t in (inp.q, inp.k, inp.v))
    assert inputs.bytes_model(inp) == inputs.case_bytes(case)
    qkvo = 2 * 16 * (4 * 48 + 2 * 48 + 2 * 32 + 4 * 32) * 2
    nbytes = inputs.bytes_model(inp)
    assert nbytes["attn-fwd"] >= qkvo and nbytes["attn-fwdbwd"] >= 3 * qkvo
    assert nbytes["attn-fwdbwd"] - 3 * qkvo == 2 * (nbytes["attn-fwd"] - qkvo)  # positions, inv_freq: twice


def test_attention_targets_divide_by_the_peer_named():
    def row(case, mode, impl, us):
        return dict(case=case, mode=mode, impl=impl, median_us=str(us), ratio_vs_copy="", tokens=8192)

    rows = [row("a", "attn-fwd", "ropekit", 90), row("a", "attn-fwd", "rope+flex", 100),
            row("a", "attn-fwd", "rope+sdpa-flash", 80), row("a", "attn-fwd", "rope+sdpa-cudnn", 95),
            row("a", "attn-fwd", "sdpa-cudnn", 60), row("b", "attn-fwd", "ropekit", 50),
            row("b", "attn-fwd", "rope+flex", 40), row("c", "attn-fwdbwd", "ropekit", 300),
            row("c", "attn-fwdbwd", "rope+flex", 330)]  # "c" has no flash row (D != Dv): not counted there
    results = {t["target"]: t for t in bench_targets.evaluate_targets(rows, _targets())}
    flex = results["attn-fwd-vs-rope-flex"]
    assert (flex["worst"], flex["case"], flex["cases"], flex["ok"]) == (1.25, "b", 2, False)
    assert results["attn-fwd-vs-rope-flash"]["worst"] == pytest.approx(90 / 80)
    assert results["attn-fwd-vs-rope-cudnn"]["ok"] is True and results["attn-fwd-vs-cudnn"]["ok"] is False
    assert results["attn-fwdbwd-vs-rope-flex"]["ok"] is True and results["attn-fwdbwd-vs-rope-flash"]["ok"] is None
    assert {t.limit for t in _targets() if t.mode in bench_cases.ATTN_MODES} == {1.0}
    assert all(t.versus and t.text.split(":")[0] in ("required", "goal", "moonshot")
               for t in _targets() if t.mode in bench_cases.ATTN_MODES)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_modes_run_through_the_harness_on_cpu(causal):
    """Both attention modes of a tiny case on CPU, every implementation asked for: ropekit (rope_attention, its
    float64 reference path) and the SDPA rows (torch's default backend on CPU) are built, checked where they
    rotate and timed; flex is skipped with a reason, not a failure; tflops is the flops over the time."""
    import torch

    case = _attention_case(causal=causal, batch=1, seqlen=32)
    env = {k: "x" for k in ("gpu", "date", "torch", "triton", "ropekit", "commit", "label")}
    device = torch.device("cpu")
    timer = run.Timer(device)
    calls = []

    def cpu(fn):
        calls.append(fn())
        return 4.0

    timer._cpu = cpu
    rows = run.run_case(case, device, timer, None, env, None, lambda s: None)
    assert {r["mode"] for r in rows} == set(bench_cases.ATTN_MODES) and calls
    for mode in bench_cases.ATTN_MODES:
        by_impl = {r["impl"]: r for r in rows if r["mode"] == mode}
        assert set(by_impl) == {"rope+sdpa-cudnn", *impls.MODE_IMPLS[mode]}
        assert impls.BASELINE[mode] == "rope+sdpa-cudnn" and by_impl["rope+sdpa-cudnn"]["ratio_vs_copy"] == "1.0000"
        flops = inputs.attention_flops(case)[mode]
        for name in ("ropekit", "rope+sdpa-cudnn", "sdpa-cudnn", "sdpa-flash", "rope+sdpa-flash"):
            r = by_impl[name]
            assert r["median_us"] == "4.000" and "failed" not in r["note"] and "MISMATCH" not in r["note"], r
            assert r["flops"] == flops and float(r["tflops"]) == pytest.approx(flops / 4.0 / 1e6, rel=1e-3)
            assert r["case"].split("/")[4] == ("causal" if causal else "noncausal")
        assert by_impl["ropekit"]["max_rel_diff"] == "0.00e+00"
        for name in ("rope+sdpa-cudnn", "rope+sdpa-flash"):  # the same function: o, or dq, dk and dv
            assert float(by_impl[name]["max_rel_diff"]) < 1e-2, by_impl[name]
            assert "default backend" in by_impl[name]["note"]
        for name in ("sdpa-cudnn", "sdpa-flash"):  # attention alone computes another function: not checked
            assert by_impl[name]["max_rel_diff"] == "" and "no RoPE" in by_impl[name]["note"]
        for name in ("flex", "rope+flex"):
            assert by_impl[name]["note"].startswith("skipped: flex_attention is timed on CUDA only")
            assert not by_impl[name]["median_us"]
    meta = dict(env, label=bench_env.SMOKE_LABEL)
    table = report.format_table(rows, meta, [], markdown=True)
    assert report.ATTN_INTRO in table and "| case | mode | TFLOP | baseline ms | ropekit |" in table
    assert "baseline us" not in table  # no rows of the other modes: no empty grid for them


def test_targets_take_the_worst_qualifying_row():
    def row(case, mode, impl, us, ratio, **kw):
        base = dict(case=case, mode=mode, impl=impl, median_us=str(us), ratio_vs_copy=str(ratio), tokens=4096,
                    bytes=10**9, hq=32, hk=8, head_dim=128)
        return dict(base, **kw)

    rows = [row("a", "fwd", "ropekit", 101, 1.005), row("b", "fwd", "ropekit", 103, 1.03),
            row("a", "fwd", "ropekit-table", 100, 1.0), row("b", "fwd", "ropekit-table", 102, 1.02),
            row("d", "decode", "ropekit", 3, 0.9, tokens=1), row("d", "decode", "liger", 2.5, 0.75, tokens=1),
            row("a", "fwd", "helion", 110, 1.1)]
    results = {t["target"]: t for t in bench_targets.evaluate_targets(rows, _targets())}
    assert results["decode-vs-liger"]["worst"] == pytest.approx(3 / 2.5) and results["decode-vs-liger"]["ok"] is False
    assert results["fwd-vs-helion"]["worst"] == pytest.approx(101 / 110, abs=1e-4)
    assert results["fwd-vs-helion"]["cases"] == 1
    assert results["decode-vs-helion"]["ok"] is None  # no row of that mode
    assert results["fwd-large"]["worst"] == pytest.approx(1.03) and results["fwd-large"]["ok"] is False
    assert results["fwd-large"]["case"] == "b" and results["fwd-large"]["cases"] == 2
    assert results["fwd-cold"]["ok"] is True and results["fwd-cold"]["cases"] == 2  # 4096 tokens qualify
    assert results["exact-vs-table"]["worst"] == pytest.approx(101 / 100) and results["exact-vs-table"]["cases"] == 2
    assert results["decode"]["ok"] is True
    assert results["fwdbwd"]["ok"] is None and results["host"]["worst"] is None


def test_prologue_targets():
    def row(case, mode, impl, us, ratio, tokens, **kw):
        return dict(case=case, mode=mode, impl=impl, median_us=str(us), ratio_vs_copy=str(ratio), tokens=tokens,
                    bytes=10**6, hq=32, hk=8, head_dim=128, **kw)

    rows = [row("d1", "kv-decode", "ropekit-kv-write", 5, 1.05, 1), row("d1", "kv-decode", "unfused-kv", 20, 4.2, 1),
            row("d64", "kv-decode", "ropekit-kv-write", 6, 1.2, 64), row("d64", "kv-decode", "unfused-kv", 10, 2, 64),
            row("d256", "kv-decode", "ropekit-kv-write", 9, 2.0, 256),  # beyond 64 tokens: not counted
            row("p", "kv-prefill", "ropekit-kv-write", 100, 1.04, 8192),
            row("n4", "norm-fwdbwd", "ropekit-qk-norm", 300, 1.3, 16384),  # below 8x4096: the copy target skips it
            row("n4", "norm-fwdbwd", "unfused-compile", 400, 1.7, 16384),
            row("n8", "norm-fwdbwd", "ropekit-qk-norm", 500, 1.08, 32768),
            row("n8", "norm-fwdbwd", "unfused-compile", 450, 0.97, 32768),
            row("n2", "norm-fwdbwd", "ropekit-qk-norm-graph", 200, 1.5, 8192),  # below 4x4096: skipped
            row("n4", "norm-fwdbwd", "ropekit-qk-norm-graph", 250, 1.12, 16384)]
    results = {t["target"]: t for t in bench_targets.evaluate_targets(rows, _targets())}
    assert (results["qk-norm-fwdbwd-graph"]["worst"], results["qk-norm-fwdbwd-graph"]["cases"]) == (1.12, 1)
    assert (results["prologue-decode"]["worst"], results["prologue-decode"]["cases"]) == (1.2, 2)
    assert results["prologue-decode"]["ok"] is False and results["prologue-decode"]["case"] == "d64"
    vs = results["prologue-decode-vs-unfused"]  # fused / unfused <= 0.5: the unfused chain >= 2x slower
    assert vs["worst"] == pytest.approx(0.6) and vs["ok"] is False and vs["cases"] == 2
    assert results["prologue-prefill"]["ok"] is True
    assert (results["qk-norm-fwdbwd"]["worst"], results["qk-norm-fwdbwd"]["cases"]) == (1.08, 1)
    assert results["qk-norm-vs-compile"]["worst"] == pytest.approx(500 / 450, abs=1e-4)
    assert results["qk-norm-vs-compile"]["ok"] is False and results["qk-norm-vs-compile"]["cases"] == 2
    assert results["decode"]["ok"] is None  # the apply_rope targets ignore the prologue's rows


def test_targets_come_from_the_registry_data(tmp_path):
    registry = bench_cases.load_registry(str(REGISTRY))
    assert [t.key for t in _targets()] == [entry["key"] for entry in registry["TARGETS"]]
    assert {t.key for t in _targets()} == {"fwd-large", "fwd-cold", "fwdbwd", "decode", "host", "exact-vs-table",
                                           "decode-vs-liger", "fwd-vs-helion", "decode-vs-helion",
                                           "mrope-fwd", "mrope-decode", "prologue-decode",
                                           "prologue-decode-vs-unfused", "prologue-prefill", "prologue-decode-fp8q",
                                           "prologue-prefill-fp8q", "prologue-decode-paged",
                                           "prologue-prefill-paged", "fwd-fp8-dynamic", "qk-norm-fwdbwd",
                                           "qk-norm-fwdbwd-graph", "qk-norm-step-host",
                                           "hidden-norm-fwd", "hidden-norm-vs-compile",
                                           "qk-norm-vs-compile", "mla-decode", "mla-prefill", "prologue-step",
                                           "cpu-vs-hf", "cpu-first-layer-vs-hf", "cpu-first-layer-vs-hf-first-layer",
                                           *(f"attn-{m}-vs-{v}" for m in ("fwd", "fwdbwd")
                                             for v in ("rope-flex", "rope-flash", "rope-cudnn", "cudnn"))}
    # Another registry file with other targets: the harness evaluates those, nothing built in.
    text = REGISTRY.read_text() + textwrap.dedent('''
        TARGETS = [{"key": "tiny-fwd", "what": "fwd of tiny shapes", "limit": 2.0, "mode": "fwd",
                    "where": {"head_dim": [None, 32], "tokens": [16, 16]}}]
        ''')
    other = tmp_path / "registry.py"
    other.write_text(text)
    (target,) = bench_targets.targets_from_registry(bench_cases.load_registry(str(other)))
    assert (target.key, target.text, target.limit, target.mode, target.impl) == ("tiny-fwd", "fwd of tiny shapes",
                                                                                2.0, "fwd", "ropekit")
    row = dict(case="c", mode="fwd", impl="ropekit", median_us="3", ratio_vs_copy="1.5", tokens="16", head_dim="32")
    assert target.select(row) and not target.select(dict(row, tokens="17"))
    (result,) = bench_targets.evaluate_targets([row], [target])
    assert (result["target"], result["worst"], result["ok"], result["cases"]) == ("tiny-fwd", 1.5, True, 1)
    # an impl glob selects every impl it matches, and only those
    glob = dataclasses.replace(target, impl="ropekit-kv-*")
    rows = [dict(row, impl="ropekit-kv-write", ratio_vs_copy="1.2"), dict(row, impl="ropekit-kv-write-fp8q"),
            dict(row, impl="ropekit", ratio_vs_copy="9")]
    (result,) = bench_targets.evaluate_targets(rows, [glob])
    assert (result["worst"], result["cases"]) == (1.5, 2)
    with pytest.raises(ValueError, match="unknown fields"):
        bench_targets.targets_from_registry({"TARGETS": [{"key": "x", "what": "x", "limit": 1, "mode": "fwd",
                                                          "select": "bytes > 1"}]})


def test_the_registry_ships_with_the_package(tmp_path, monkeypatch, capsys):
    # Found from the package, not from the working directory: a folder with no checkout above it changes nothing,
    # and neither does another benchmarks/registry.py there.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "registry.py").write_text("MODELS = SIZES = PRESETS = TARGETS = {}\n")
    registry = bench_cases.load_registry()
    assert Path(registry["source"]).resolve() == REGISTRY.resolve() == bench_cases.REGISTRY_FILE.resolve()
    assert registry["PRESETS"] and registry["TARGETS"]
    assert cli.main(["--list", "--device", "cpu"]) == 0
    assert "registry.py" in capsys.readouterr().out


def test_missing_registry_names_the_option(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--list", "--device", "cpu", "--registry", str(tmp_path / "none.py")]) == 2
    assert "--registry" in capsys.readouterr().err
    # A package without its registry: an error naming --registry, not a file found elsewhere.
    monkeypatch.setattr(bench_cases, "REGISTRY_FILE", tmp_path / "registry.py")
    with pytest.raises(bench_cases.RegistryNotFound, match="--registry"):
        bench_cases.load_registry()
    assert cli.main(["--list", "--device", "cpu"]) == 2
    assert "--registry FILE" in capsys.readouterr().err


def _copy_and_ropekit_rows() -> list[dict]:
    """Two result rows (the copy and ropekit) of the smoke preset's first case, as a run writes them."""
    case = bench_cases.expand_preset(bench_cases.load_registry(str(REGISTRY)), "smoke")[0]
    env = {k: "x" for k in ("gpu", "date", "torch", "triton", "ropekit", "commit", "label")}
    return [run._row(env, case, "fwd", impl, 100, "copy") for impl in ("copy", "ropekit")]


def test_history_appends_rows_with_their_source(tmp_path):
    rows = _copy_and_ropekit_rows()
    history = tmp_path / "all_runs.csv"
    report.append_history(history, rows, "first.csv")
    report.append_history(history, rows[:1], "second.csv")
    with history.open(newline="") as f:
        got = list(csv.DictReader(f))
    assert [r["source"] for r in got] == ["first.csv", "first.csv", "second.csv"]
    assert list(got[0]) == [*report.ROW_FIELDS, "source"]
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="header"):
        report.append_history(bad, rows, "x.csv")


def test_xz_history_appends_one_stream_per_run_and_reads_them_back(tmp_path):
    import lzma

    rows = _copy_and_ropekit_rows()
    history = tmp_path / "all_runs.csv.xz"
    report.append_history(history, rows, "first.csv")
    first = history.read_bytes()
    report.append_history(history, rows[:1], "second.csv")
    assert history.read_bytes().startswith(first)  # appended: the first run's stream is untouched
    got = report.read_history(history)
    assert [(r["source"], r["impl"]) for r in got] == [("first.csv", "copy"), ("first.csv", "ropekit"),
                                                       ("second.csv", "copy")]
    assert lzma.decompress(history.read_bytes()).decode().count(",".join(report.HISTORY_FIELDS)) == 2


def test_results_history_has_the_harness_columns():
    """The kept history (xz, one stream per run) opens with the harness's columns, today's or an earlier
    harness's, and reads back whole (it was skipped while it looked for the name the history had before it was
    compressed)."""
    from ropekit.bench import summary

    path = ROOT / "benchmarks" / "results" / "all_runs.csv.xz"
    header = next(csv.reader(report.read_text(path).splitlines()[:1]))
    assert header in [list(report.HISTORY_FIELDS), *map(list, report.LEGACY_HISTORY_FIELDS)]
    rows = summary.read_history(path)
    assert rows and all(list(r) == list(report.HISTORY_FIELDS) for r in rows)
    assert all(r["gpu"] and r["case"] and r["mode"] and r["impl"] for r in rows)


def test_no_cuda_refuses_unless_the_smoke_run_is_asked_for(monkeypatch, capsys):
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: False)
    for argv in ([], ["--quick"], ["--preset", "full"]):
        assert cli.main(argv + ["--registry", str(REGISTRY)]) != 0
        err = capsys.readouterr().err
        assert cli.NO_CUDA_MESSAGE in err and "--preset smoke" in err
    # asked for explicitly, the CPU run goes ahead (an empty selection stops it just after the device check)
    for argv in (["--preset", "smoke"], ["--device", "cpu"]):
        assert cli.main(argv + ["--registry", str(REGISTRY), "--cases", "no-such-group"]) == 2
        assert capsys.readouterr().err.strip() == "no case selected"


def test_cpu_table_has_no_targets_and_gpu_table_has():
    env = {k: "x" for k in ("gpu", "date", "torch", "triton", "ropekit", "commit")}
    case = bench_cases.expand_preset(bench_cases.load_registry(str(REGISTRY)), "smoke")[0]
    row = dict(run._row(dict(env, label=bench_env.SMOKE_LABEL), case, "fwd", "ropekit", 100, "copy"),
               median_us="600", ratio_vs_copy="599")
    targets = bench_targets.evaluate_targets([row], _targets())
    smoke = report.format_table([row], dict(env, label=bench_env.SMOKE_LABEL), targets)
    assert report.NO_TARGETS_LINE in smoke and "Targets (worst" not in smoke and " NO " not in smoke
    perf = report.format_table([dict(row, label=bench_env.PERF_LABEL)], dict(env, label=bench_env.PERF_LABEL), targets)
    assert "Targets (worst" in perf and report.NO_TARGETS_LINE not in perf


def test_triton_rows_on_cpu_without_interpreter_say_why(monkeypatch):
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    case = bench_cases.expand_preset(bench_cases.load_registry(str(REGISTRY)), "smoke")[0]
    inp = inputs.make_inputs(case, torch.device("cpu"))
    why = "skipped: Triton launches need a CUDA GPU (on CPU: set TRITON_INTERPRET=1)"
    if impls.triton is None:
        why = "skipped: triton not importable"
    assert run._try_build(impls.build_baseline, "triton-launch", inp, inputs.bytes_model(inp)) == why
    assert run._try_build(impls.build, "ropekit-launcher", inp, "fwd", None) == why


def test_prologue_check_compares_q_and_the_cache_rows(monkeypatch):
    """An implementation that writes the right values into the wrong cache rows is flagged: the check fills the
    caches with NaN and reads the rows the tokens go to. fp8 rows may differ by one e4m3 step, q may not."""
    import torch

    registry = bench_cases.load_registry(str(REGISTRY))
    case = next(c for c in bench_cases.expand_preset(registry, "smoke") if c.group == "smoke-kv-decode")
    build_unfused = prologue._unfused_kv

    def wrong_rows(inp):
        b, p = inp.cache_index
        inp.cache_index = (b, p + 1)
        try:
            return build_unfused(inp)
        finally:
            inp.cache_index = (b, p)

    monkeypatch.setattr(prologue, "_unfused_kv", wrong_rows)
    env = {k: "x" for k in ("gpu", "date", "torch", "triton", "ropekit", "commit", "label")}
    device = torch.device("cpu")
    timer = run.Timer(device)
    timer._cpu = lambda fn: 1.0  # no timing needed
    rows = run.run_case(case, device, timer, None, env, ["ropekit-kv-write", "unfused-kv"], lambda s: None)
    by_impl = {r["impl"]: r for r in rows}
    assert by_impl["ropekit-kv-write"]["max_rel_diff"] == "0.00e+00"
    assert "MISMATCH vs ropekit-kv-write" in by_impl["unfused-kv"]["note"]
    assert float(by_impl["unfused-kv"]["max_rel_diff"]) == float("inf")
    ones = torch.ones(4)
    assert run._agreement([ones, ones * 1.1], [ones, ones], (None, prologue.FP8_MISMATCH)) == (pytest.approx(0.1), True)
    assert run._agreement([ones * 1.1, ones], [ones, ones], (None, prologue.FP8_MISMATCH))[1] is False
    assert run._agreement([ones, ones * 1.1], [ones, ones], None)[1] is False


# ---------------------------------------------------------------------------------------------------------------
# CPU smoke run, end to end
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """``ropekit bench --preset smoke`` on CPU under the Triton interpreter, in a fresh process (the interpreter
    must be chosen before Triton kernels are defined)."""
    tmp = tmp_path_factory.mktemp("bench")
    stand_in = _stand_in_transformers(tmp / "site")
    out = tmp / "out"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(stand_in), str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-m", "ropekit.cli", "bench", "--preset", "smoke", "--device", "cpu",
           "--impls", "ropekit*,hf,unfused-kv,unfused-eager,unfused-mla,gemm+*", "--out", str(out), "--commit", "test",
           "--history", str(tmp / "history.csv")]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out, seconds


def _one(out: Path, pattern: str) -> Path:
    found = sorted(out.glob(pattern))
    assert len(found) == 1, (pattern, found)
    return found[0]


def test_smoke_run_is_fast_and_labelled(smoke_run):
    proc, out, seconds = smoke_run
    assert seconds < 30, f"CPU smoke run took {seconds:.1f} s"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert bench_env.SMOKE_LABEL in lines[0]
    assert bench_env.SMOKE_LABEL in lines[-1]  # the short table comes last and ends with the label
    assert any(line.startswith("case ") and "ropekit" in line for line in lines)
    assert report.NO_TARGETS_LINE in lines and not any("Targets (worst" in line for line in lines)
    assert bench_env.SMOKE_LABEL in _one(out, "bench-*-cpu-smoke.md").read_text()


def test_smoke_csv_and_json_rows(smoke_run):
    _, out, _ = smoke_run
    with _one(out, "bench-*-cpu-smoke.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    data = json.loads(_one(out, "bench-*-cpu-smoke.json").read_text())
    assert len(data["rows"]) == len(rows) > 0
    with (out.parent / "history.csv").open(newline="") as f:  # --history: the same rows, appended
        history = list(csv.DictReader(f))
    assert [{k: r[k] for k in report.ROW_FIELDS} for r in history] == rows
    assert {r["source"] for r in history} == {_one(out, "bench-*-cpu-smoke.csv").name}
    assert data["meta"]["label"] == bench_env.SMOKE_LABEL and data["meta"]["commit"] == "test"
    # a GPU preset's run (here on CPU) has the targets of every mode but the CPU one (--preset cpu)
    assert {t["target"] for t in data["targets"]} == {t.key for t in _targets() if t.mode != bench_cases.CPU_MODE}
    for row in rows:
        assert set(REQUIRED_FIELDS) <= set(row)
        assert row["label"] == bench_env.SMOKE_LABEL
        assert row["gpu"].startswith("none (CPU") and row["commit"] == "test"
    modes = {r["mode"] for r in rows}
    assert modes == set(bench_cases.MODES) - {bench_cases.CPU_MODE}
    for (case, mode) in {(r["case"], r["mode"]) for r in rows}:
        group = {r["impl"]: r for r in rows if r["case"] == case and r["mode"] == mode}
        base = group[impls.BASELINE[mode]]
        assert float(base["median_us"]) > 0 and float(base["ratio_vs_copy"]) == 1.0
        rk = group[impls.REFERENCE.get(mode, "ropekit")]
        assert float(rk["median_us"]) > 0, rk
        assert float(rk["ratio_vs_copy"]) == pytest.approx(float(rk["median_us"]) / float(base["median_us"]),
                                                           rel=1e-2)
        if mode != "host":
            assert float(rk["gbps"]) == pytest.approx(int(rk["bytes"]) / float(rk["median_us"]) / 1e3, rel=1e-2)
        if mode in impls.REFERENCE:  # the prologue: the fused op, the unfused code, checked and timed
            extra = impls.EXTRA_BASELINES.get(mode, ())  # kv-step's floor: timed, not checked (a copy)
            assert set(group) == {impls.BASELINE[mode], *extra, *impls.MODE_IMPLS[mode]} - {"unfused-compile"}
            graphed = group.pop("ropekit-qk-norm-graph", None)  # a CUDA graph: a row that says why not on CPU
            assert graphed is None or (not graphed["median_us"] and "CUDA only" in graphed["note"]), graphed
            assert all(r["median_us"] and (r["max_rel_diff"] or r["impl"] in extra) for r in group.values()
                       if r is not base), group
        elif mode in bench_cases.ATTN_MODES:  # rope_attention and its baseline, apply_rope + SDPA: checked
            # and rope_attention's kernels launched directly, with and without the rotation: GPU rows, skipped here
            assert set(group) == {"rope+sdpa-cudnn", "ropekit", "ropekit-kernels", "ropekit-norope"}
            assert "/causal/" in case
            assert float(base["max_rel_diff"]) < 1e-2 and rk["max_rel_diff"] == "0.00e+00"
            for name in ("ropekit-kernels", "ropekit-norope"):
                assert not group[name]["median_us"] and "need CUDA" in group[name]["note"], group[name]
            for r in (base, rk):
                flops = int(r["flops"])
                assert flops == 2 * 4 * 64 * 64 * (48 + 32) // 2 * (1 if mode == "attn-fwd" else 3.5)
                assert float(r["tflops"]) == pytest.approx(flops / float(r["median_us"]) / 1e6, rel=1e-2)
        else:
            assert "ropekit-table" in group
            if "/mrope/" in case:  # the yardstick of the M-RoPE targets runs in every multi-axis case
                assert group["ropekit-1d"]["median_us"], group["ropekit-1d"]
    # Every timed implementation agrees with ropekit (the peer path's cos/sin layout, THD, partial rotary; the
    # prologue's q and cache rows, fp8 rows and float8 q within one e4m3 step).
    for row in rows:
        if row["max_rel_diff"]:
            fp8 = "/cache-fp8/" in row["case"] or "-fp8q" in row["impl"]
            assert float(row["max_rel_diff"]) < (prologue.FP8_MISMATCH if fp8 else 1e-2), row
            assert "MISMATCH" not in row["note"]
    assert {r["case"].split("/")[4] for r in rows if r["mode"] in bench_cases.KV_MODES} == {"cache-bf16", "cache-fp8"}
    hf = [r for r in rows if r["impl"] == "hf"]
    assert hf and all(r["median_us"] for r in hf), hf
    assert any("partial rotary" in r["note"] for r in hf)
    if importlib.util.find_spec("triton") is not None:  # the Triton kernel itself, interpreted
        launcher = [r for r in rows if r["impl"] == "ropekit-launcher"]
        assert launcher and all(r["median_us"] for r in launcher), launcher


def test_smoke_plots(smoke_run):
    pytest.importorskip("matplotlib")
    _, out, _ = smoke_run
    for mode in ("fwd", "fwdbwd", "decode", "kv-decode", "kv-prefill", "norm-fwdbwd", "attn-fwd", "attn-fwdbwd",
                 "mla-decode", "mla-prefill"):
        png = _one(out, f"bench-*-cpu-smoke-{mode}.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_from_json_merges_and_redraws(smoke_run, tmp_path, capsys):
    _, out, _ = smoke_run
    source = _one(out, "bench-*-cpu-smoke.json")
    assert cli.main(["--from-json", str(source), str(source), "--out", str(tmp_path), "--no-plot"]) == 0
    merged = json.loads(_one(tmp_path, "bench-*-merged.json").read_text())
    assert len(merged["rows"]) == 2 * len(json.loads(source.read_text())["rows"])
    assert bench_env.SMOKE_LABEL in capsys.readouterr().out.strip().splitlines()[-1]


def test_a_gpu_run_warms_up_on_its_first_case_without_recording_it(monkeypatch, capsys):
    """On a GPU the first case runs once before the recorded run and its rows are dropped (the first case of a run
    read up to 1.4x cold); on CPU nothing runs twice."""
    from types import SimpleNamespace

    from ropekit.bench import cli

    calls = []
    monkeypatch.setattr(cli, "run_case", lambda case, *args: calls.append(case) or [{"impl": "ropekit"}])
    monkeypatch.setattr(cli, "_recover", lambda device: None)
    case = SimpleNamespace(name="llama-3-8b/bf16/neox/ids/1x1")
    assert cli._warm_up(case, SimpleNamespace(type="cpu"), None, None, {}, None) is None and calls == []
    assert cli._warm_up(case, SimpleNamespace(type="cuda"), None, None, {}, None) is None and calls == [case]
    assert "warm-up: llama-3-8b/bf16/neox/ids/1x1 once, not recorded" in capsys.readouterr().out


def test_graphs_replayed_in_turn_start_on_a_held_gpu_in_alternating_order(monkeypatch):
    """Every timed interval starts behind a sleep kernel (the host's launch of its first replay stays out of it),
    odd rounds replay the graphs in reverse order, and each graph's time is the median over rounds per call."""
    log = []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing
            self.at = None

        def record(self):
            log.append("record")
            self.at = len(log)

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return float(end.at - self.at)  # milliseconds: one per logged step

    class Graph:
        def __init__(self, name):
            self.name = name

        def replay(self):
            log.append(self.name)

    monkeypatch.setattr(timing.torch.cuda, "Event", Event)
    monkeypatch.setattr(timing.torch.cuda, "_sleep", lambda cycles: log.append(("hold", cycles)))
    out = timing._replay_in_turn({"a": Graph("a"), "b": Graph("b")}, rounds=3, replays=2, calls=4)

    def interval(name):
        return [("hold", timing.HOLD_CYCLES), "record", name, name, "record"]

    assert log == [*interval("a"), *interval("b"), *interval("b"), *interval("a"), *interval("a"), *interval("b")]
    assert list(out) == ["a", "b"] and out == {"a": 375.0, "b": 375.0}  # 3 ms over 2 replays of 4 calls


@pytest.mark.parametrize("modes, impl, baselines", [(("decode", "host"), "ropekit", ("copy-q", "copy")),
                                                    (("kv-decode",), "ropekit-kv-write", ("copy-kv",)),
                                                    (("mla-decode",), "ropekit-mla-kv-write", ("copy-mla",))])
def test_decode_calls_cycle_over_input_sets(monkeypatch, modes, impl, baselines):
    """A graph mode's captured calls cycle over ``GRAPH_INPUT_SETS`` input sets (fresh tensors at other addresses),
    the checked set first, for the baselines and the implementations alike, each set called once before the
    capture and equally often in a graph: with one set per process a decode ratio read wherever its few-kB buffers
    happened to lie. Every set writes to the checked set's KV caches (gigabytes each at 256 sequences).

    Runs on the device where every implementation launches: CUDA where there is one, else the CPU, where
    tests/conftest.py runs the Triton kernels (``copy-kv``'s included) under the interpreter. CPU tensors on a
    CUDA machine would not do: Triton kernels are compiled for the GPU there, so ``copy-kv`` was skipped and never
    called at all."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    registry = bench_cases.load_registry(str(REGISTRY))
    case = next(c for c in bench_cases.expand_preset(registry, "smoke") if c.modes == modes)
    env = {k: "x" for k in ("gpu", "date", "torch", "triton", "ropekit", "commit", "label")}
    made, used = [], []
    real_make = run.make_inputs

    def make_inputs(case, device, seed=0, caches_of=None):
        made.append(real_make(case, device, seed, caches_of))
        return made[-1]

    def recorded(real):
        def build(name, inp, *args):
            bench = real(name, inp, *args)
            call = bench.run
            which = [id(m) for m in made].index(id(inp))
            bench.run = lambda: (used.append((name, which)), call())[1]
            return bench
        return build

    monkeypatch.setattr(run, "make_inputs", make_inputs)
    monkeypatch.setattr(run, "build", recorded(run.build))
    monkeypatch.setattr(run, "build_baseline", recorded(run.build_baseline))
    timer = run.Timer(device)
    timer.host = lambda fn: 1.0
    sets = run.GRAPH_INPUT_SETS

    def graphs(fns):
        for fn in fns.values():
            for _ in range(2 * sets):
                fn()
        return {name: 1.0 for name in fns}

    timer.graphs = graphs
    rows = run.run_case(case, device, timer, None, env, [impl], lambda s: None)
    assert not [r["note"] for r in rows if "failed" in r["note"] or "MISMATCH" in r["note"]]
    # every baseline and implementation of the graph mode was built and timed (a skipped one is never called)
    graph_rows = [r for r in rows if r["mode"] in run.GRAPH_MODES]
    assert {r["impl"] for r in graph_rows} == {*baselines, impl}
    assert all(r["median_us"] for r in graph_rows), [(r["impl"], r["note"]) for r in graph_rows]
    assert sets > 1 and timing.GRAPH_CALLS % sets == 0
    assert len(made) == sets and len({m.q.data_ptr() for m in made}) == sets
    assert all(m.q.device.type == device.type for m in made)
    for name in (*baselines, impl):  # each set once before any capture (lazy set-up), then the graph's calls
        assert [s for n, s in used if n == name] == list(range(sets)) * 3, name
    if modes == ("kv-decode",):
        assert all(m.k_cache is made[0].k_cache and m.v_cache is made[0].v_cache for m in made)
        assert len({m.cache_index[1].data_ptr() for m in made}) == sets
    if modes == ("mla-decode",):
        assert all(m.mla_cache is made[0].mla_cache for m in made)
        assert len({m.slot_mapping.data_ptr() for m in made}) == sets


def test_an_input_set_refuses_caches_too_short_for_its_positions():
    import torch

    registry = bench_cases.load_registry(str(REGISTRY))
    case = next(c for c in bench_cases.expand_preset(registry, "smoke") if c.modes == ("kv-decode",))
    first = inputs.make_inputs(case, torch.device("cpu"))
    assert inputs.make_inputs(case, torch.device("cpu"), 1, caches_of=first).k_cache is first.k_cache
    first.k_cache = first.k_cache[:, :1]
    with pytest.raises(ValueError, match="caches_of: its caches hold 1 rows"):
        inputs.make_inputs(case, torch.device("cpu"), 1, caches_of=first)


def test_one_compile_serves_every_input_set_of_a_case_and_mode(monkeypatch):
    """The torch.compile peers compile once per case and mode: the input sets of a graph mode rebuild them (closures
    included) without a reset in between, which would drop the others' compiles and recompile during capture."""
    import torch

    from ropekit.bench import base as bench_base

    resets, compiles = [], []
    monkeypatch.setattr(torch.compiler, "reset", lambda: resets.append(1))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiles.append(fn) or ("compiled", len(compiles)))
    monkeypatch.setattr(bench_base, "_COMPILED", {})  # the cache compiled_per_case keeps

    def closure(lo=2):
        def partial(q):
            return q[lo:]
        return partial

    first = impls.compiled_per_case(closure(), "case-a", "decode")
    assert all(impls.compiled_per_case(closure(), "case-a", "decode") is first for _ in range(4))
    assert (len(resets), len(compiles)) == (1, 1)
    assert impls.compiled_per_case(closure(lo=3), "case-a", "decode") != first  # closes over another value
    assert impls.compiled_per_case(closure(), "case-a", "fwd") != first
    assert impls.compiled_per_case(closure(), "case-b", "fwd") != first and (len(resets), len(compiles)) == (4, 4)
    impls.forget_compiles()  # as each case of a run starts: a rerun of the same case compiles again
    assert impls.compiled_per_case(closure(), "case-b", "fwd") and (len(resets), len(compiles)) == (5, 5)


def test_decode_implementations_are_timed_together_in_turn():
    """A decode case's implementations, baseline included, are timed in one ``Timer.graphs`` call (graphs replayed
    in turn, so clock drift spreads over all of them), after every one is built and checked; one that fails to
    time gets a note and no time while the others keep theirs. On CPU ``Timer.graphs`` times each with timeit."""
    import torch

    registry = bench_cases.load_registry(str(REGISTRY))
    case = next(c for c in bench_cases.expand_preset(registry, "smoke") if c.modes == ("decode", "host"))
    env = {k: "x" for k in ("gpu", "date", "torch", "triton", "ropekit", "commit", "label")}
    device = torch.device("cpu")
    timer = run.Timer(device)
    timer._cpu = lambda fn: fn() or 2.0
    timer.host = lambda fn: 1.0
    timed = timer.graphs({"a": lambda: None, "b": lambda: 1 / 0})
    assert timed["a"] == 2.0 and isinstance(timed["b"], ZeroDivisionError)

    seen = []

    def graphs(fns):
        seen.append(list(fns))
        return {name: (RuntimeError("capture failed") if name == "ropekit_" else 3.0) for name in fns}

    timer.graphs = graphs
    rows = run.run_case(case, device, timer, None, env, ["ropekit", "ropekit_"], lambda s: None)
    by_impl = {r["impl"]: r for r in rows if r["mode"] == "decode"}
    assert seen == [["copy-q", "copy", "ropekit", "ropekit_"]]  # the baseline and the extra one too
    assert by_impl["ropekit"]["median_us"] == "3.000" and by_impl["ropekit"]["ratio_vs_copy"] == "1.0000"
    assert by_impl["ropekit_"]["median_us"] == ""
    assert "failed: RuntimeError: capture failed" in by_impl["ropekit_"]["note"]


def test_base_run_gets_this_runs_arguments_but_not_its_outputs():
    from ropekit.bench.compare import base_argv

    argv = ["--preset", "smoke", "--base", "abc123", "--out=o", "--history", "h.csv", "--no-plot", "--cases", "x",
            "--impls", "ropekit", "--commit", "c"]
    assert base_argv(argv) == ["--preset", "smoke", "--cases", "x"]


def test_base_comparison_matches_rows_by_case_mode_and_impl():
    from ropekit.bench.compare import compare

    def row(impl, us, ratio, case="c/1x8"):
        return {"case": case, "mode": "fwd", "impl": impl, "median_us": us, "ratio_vs_copy": ratio}

    new = [row("copy", "10", "1.0"), row("ropekit", "12", "1.2"), row("ropekit", "5", "", case="only-here")]
    base = [row("copy", "8", "1.0"), row("ropekit", "8", "1.0")]
    lines = compare(new, base, "abc").splitlines()
    assert "base abc" in lines[0] and len(lines) == 4  # title, header, two matched rows; the unmatched one left out
    assert lines[3].split()[-6:] == ["12.00", "8.00", "1.500", "1.200", "1.000", "1.200"]
    assert "no row" in compare(new, [row("other", "1", "1")], "abc")


def test_base_directory_runs_in_a_child_process_and_is_compared(tmp_path):
    """``--base DIR``: the same case timed by the ropekit in DIR (here this checkout) in the same run, and the
    comparison table printed and written beside the results."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-m", "ropekit.cli", "bench", "--preset", "smoke", "--device", "cpu", "--cases",
           "smoke-back", "--impls", "ropekit", "--out", str(tmp_path), "--no-plot", "--commit", "test",
           "--base", str(ROOT)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = _one(tmp_path, "bench-*-cpu-smoke-vs-base.txt").read_text()
    assert f"against base {ROOT.name}" in table and "ropekit" in table
    assert _one(tmp_path / "base", "bench-*-cpu-smoke.json")


# ---------------------------------------------------------------------------------------------------------------
# This round's variants: rope_kv_write's paged formats, qk_norm_rope over the hidden with v, float8 apply_rope
# ---------------------------------------------------------------------------------------------------------------

def _cpu_rows(group: str, impl_globs: list[str] | None) -> list[dict]:
    """``run_case`` of every smoke case of ``group`` on CPU (kernels under the interpreter), timing stubbed."""
    import torch

    registry = bench_cases.load_registry(str(REGISTRY))
    env = {k: "x" for k in ("gpu", "date", "torch", "triton", "ropekit", "commit", "label")}
    device = torch.device("cpu")
    timer = run.Timer(device)

    def once(fn):  # one call, no timing
        fn()
        return 1.0

    timer._cpu = once
    rows = []
    for case in bench_cases.expand_preset(registry, "smoke"):
        if case.group == group:
            rows += run.run_case(case, device, timer, None, env, impl_globs, lambda s: None)
    assert rows, group
    return rows


PAGED = tuple(prologue.PAGED_KV_FORMATS)


@pytest.mark.parametrize("group", ["smoke-kv-decode", "smoke-kv-prefill"])
def test_paged_cache_formats_write_the_reference_rows(group):
    """rope_kv_write into paged_x, paged_hnd and page-table pages: q and every token's K/V rows, read back from the
    pages, equal rope_kv_write's bshd rows (bf16 and fp8 caches, decode and prefill), timed against copy-kv."""
    rows = _cpu_rows(group, ["ropekit-kv-write", *PAGED])
    by = {(r["case"], r["impl"]): r for r in rows}
    cases = {r["case"] for r in rows}
    for case in cases:
        copy = by[(case, "copy-kv")]
        assert copy["baseline"] == "copy-kv"
        if INTERPRETED:
            assert copy["median_us"]
        else:  # CPU tensors on a machine with a GPU: the Triton copy cannot run there, and its row says why
            assert not copy["median_us"] and "TRITON_INTERPRET=1" in copy["note"], copy
        for impl in PAGED:
            r = by[(case, impl)]
            assert r["median_us"] and r["max_rel_diff"] == "0.00e+00", r
            assert "MISMATCH" not in r["note"] and "failed" not in r["note"]
            assert r["bytes"] == by[(case, "ropekit-kv-write")]["bytes"]


def test_paged_formats_write_shuffled_pages_and_the_check_reads_them(monkeypatch):
    """The pages are the bshd caches' memory: a token's paged row is not its bshd row (the pages are shuffled), and
    a check reading the wrong row of a page flags the row as a mismatch."""
    import torch

    registry = bench_cases.load_registry(str(REGISTRY))
    case = next(c for c in bench_cases.expand_preset(registry, "smoke") if c.group == "smoke-kv-prefill")
    inp = inputs.make_inputs(case, torch.device("cpu"))
    for impl in PAGED:
        bench = prologue.build_prologue(impl, inp, "kv-prefill")
        _, k_rows, v_rows = bench.result()
        assert not (k_rows.isnan().any() or v_rows.isnan().any()), impl
        bshd_k, _ = inp.cache_rows()
        assert bshd_k.isnan().any(), impl  # the tokens' bshd rows were not where the pages put them
    real = prologue._paged_rows
    monkeypatch.setattr(prologue, "_paged_rows", lambda layout, k, v, page, row: real(
        layout, k, v, page, (row + 1) % prologue.PAGE_ROWS))
    rows = _cpu_rows("smoke-kv-prefill", ["ropekit-kv-write", *PAGED])
    for r in rows:
        if r["impl"] in PAGED:
            assert "MISMATCH vs ropekit-kv-write" in r["note"] and float(r["max_rel_diff"]) > 1, r


def test_hidden_norm_mode_checks_the_fused_op_against_the_unfused_code(monkeypatch):
    """qk_norm_rope(norm_over="hidden", v=v) against copy-qkv and the unfused PyTorch code (fp32 math): q, k and
    v's copy agree; an unfused code that rotates the other pairing is flagged."""
    rows = _cpu_rows("smoke-hidden-norm", None)
    by = {r["impl"]: r for r in rows}
    assert set(by) == {"copy-qkv", *impls.MODE_IMPLS["hidden-norm-fwd"]}
    assert by["ropekit-hidden-norm"]["max_rel_diff"] == "0.00e+00" and by["copy-qkv"]["median_us"]
    for name in ("unfused-eager", "unfused-compile"):
        assert by[name]["median_us"] and float(by[name]["max_rel_diff"]) < 1e-3, by[name]
    from ropekit.bench import hidden

    real = hidden._rotate_pairs
    monkeypatch.setattr(hidden, "_rotate_pairs", lambda x, interleaved: real(x, not interleaved))
    rows = _cpu_rows("smoke-hidden-norm", ["ropekit-hidden-norm", "unfused-eager"])
    wrong = next(r for r in rows if r["impl"] == "unfused-eager")
    assert "MISMATCH vs ropekit-hidden-norm" in wrong["note"], wrong


def test_hidden_norm_inputs_and_bytes():
    """The hidden-norm mode's inputs: q, k and v [B, S, H, D], weights [H * D]; the bytes model counts q, k and v
    read and written, the weights, the positions on three axes and inv_freq."""
    import torch

    registry = bench_cases.load_registry(str(REGISTRY))
    case = next(c for c in bench_cases.expand_preset(registry, "smoke") if c.group == "smoke-hidden-norm")
    assert case.hidden_norm and case.qk_norm and case.positions == "mrope"
    inp = inputs.make_inputs(case, torch.device("cpu"))
    assert inp.v.shape == inp.k.shape == (1, 16, 4, 32) and inp.q_weight.shape == inp.k_weight.shape == (4 * 32,)
    nbytes = inputs.bytes_model(inp)
    assert nbytes["hidden-norm-fwd"] == inputs.case_bytes(case)["hidden-norm-fwd"]
    assert nbytes["hidden-norm-fwd"] == 2 * 3 * 16 * 4 * 32 * 2 + 2 * 4 * 32 * 2 + 3 * 16 * 8 + 16 * 4
    full = [c for c in bench_cases.expand_preset(registry, "full") if "hidden-norm-fwd" in c.modes]
    assert {(c.hq, c.hk, c.head_dim) for c in full} == {(24, 24, 128), (40, 40, 128)}
    assert {c.tokens for c in full} == {4096, 8192, 16384} and {c.dtype for c in full} == {"bf16"}


@pytest.mark.parametrize("model, modes, error", [
    ("tiny-qknorm", ["hidden-norm-fwd"], "need a model with qk_norm 'hidden'"),
    ("tiny-dit", ["norm-fwdbwd"], "per-head norm only"),
])
def test_registry_rejects_bad_hidden_norm_groups(model, modes, error):
    registry = bench_cases.load_registry(str(REGISTRY))
    group = {"name": "g", "models": [model], "dtypes": ["bf16"], "styles": ["neox"], "positions": ["range"],
             "sizes": [[1, 8]], "modes": modes}
    with pytest.raises(ValueError, match=error):
        bench_cases.expand_preset(dict(registry, PRESETS={"p": [group]}), "p")


def test_fp8_dynamic_fwd_rows_and_their_copy():
    """apply_rope to float8 q and k with in-launch scales: a fwd row within one e4m3 step of ropekit's, beside
    copy-fp8out, a copy of its bytes (bf16 in, one byte out per element, a float32 scale per row)."""
    rows = _cpu_rows("smoke-neox", ["ropekit", impls.FP8_DYNAMIC])
    fwd = {r["impl"]: r for r in rows if r["mode"] == "fwd"}
    fp8 = fwd[impls.FP8_DYNAMIC]
    assert fp8["median_us"] and 0 < float(fp8["max_rel_diff"]) < prologue.FP8_MISMATCH and "MISMATCH" not in fp8["note"]
    registry = bench_cases.load_registry(str(REGISTRY))
    case = next(c for c in bench_cases.expand_preset(registry, "smoke") if c.group == "smoke-neox")
    q_elems, k_elems = case.tokens * case.hq * case.head_dim, case.tokens * case.hk * case.head_dim
    fp32 = 4
    expected = inputs.case_bytes(case)["fwd"] - (q_elems + k_elems) * (fp32 - 1) + 4 * case.tokens * (case.hq + case.hk)
    assert int(fwd["copy-fp8out"]["bytes"]) == expected and fwd["copy-fp8out"]["median_us"]
    assert not any(r["impl"] == impls.FP8_DYNAMIC for r in rows if r["mode"] == "fwdbwd")
    target = next(t for t in _targets() if t.key == "fwd-fp8-dynamic")
    (result,) = bench_targets.evaluate_targets(
        [dict(fwd[impls.FP8_DYNAMIC], median_us="105", tokens=4096), dict(fwd["copy-fp8out"], median_us="100")],
        [target])
    assert result["worst"] == pytest.approx(1.05) and result["ok"] is True


@pytest.mark.gpu
@pytest.mark.parametrize("group, impl_globs", [
    ("smoke-kv-decode", ["ropekit-kv-write", *PAGED]), ("smoke-kv-prefill", ["ropekit-kv-write", *PAGED]),
    ("smoke-hidden-norm", None), ("smoke-neox", ["ropekit", impls.FP8_DYNAMIC]),
])
def test_new_variant_rows_on_the_gpu(group, impl_globs):
    """The new rows on CUDA at tiny shapes, timed for real (kv-decode: CUDA-graph capture and replay over the input
    sets): every one checked against its mode's reference and timed, none failed."""
    import torch

    registry = bench_cases.load_registry(str(REGISTRY))
    env = {k: "x" for k in ("gpu", "date", "torch", "triton", "ropekit", "commit", "label")}
    device = torch.device("cuda")
    rows = []
    for case in bench_cases.expand_preset(registry, "smoke"):
        if case.group == group:
            rows += run.run_case(case, device, run.Timer(device), None, env, impl_globs, lambda s: None)
    new = {*PAGED, impls.FP8_DYNAMIC, *impls.MODE_IMPLS["hidden-norm-fwd"]}
    checked = [r for r in rows if r["impl"] in new and r["mode"] != "fwdbwd"]
    assert checked, group
    for r in rows:
        assert r["median_us"] and "failed" not in r["note"] and "MISMATCH" not in r["note"], r
    for r in checked:
        fp8 = "/cache-fp8/" in r["case"] or "-fp8q" in r["impl"]
        assert r["max_rel_diff"] and float(r["max_rel_diff"]) < (prologue.FP8_MISMATCH if fp8 else 1e-2), r
