"""The Helion peers of the benchmark: listed and reported missing cleanly without helion; where helion imports,
each kernel against the float64 reference (on a GPU, and on CPU through Helion's eager reference mode)."""

import importlib.util
import os

import pytest
import torch

from ropekit.bench.impls import MODE_IMPLS
from ropekit.bench.peers import load_peers
from ropekit.reference import rms_norm_reference, rotate, rotation_tables
from ropekit.testing import assert_close_to_ref

HAS_HELION = importlib.util.find_spec("helion") is not None
EPS = 1e-6


def test_helion_listed_forward_only():
    assert "helion" in MODE_IMPLS["fwd"] and "helion" in MODE_IMPLS["decode"]
    assert "helion" not in MODE_IMPLS["fwdbwd"]  # the kernels have no backward


@pytest.mark.skipif(HAS_HELION, reason="helion is installed")
def test_helion_missing_is_reported():
    peers = load_peers({"helion"}, None)
    assert peers.helion is None and "helion" not in peers.versions
    assert "helion not importable" in peers.missing["helion"]


def _inputs(dtype, device, B=2, S=4, HQ=4, HK=2, D=16):
    q = torch.randn(B, S, HQ, D, dtype=dtype, device=device)
    k = torch.randn(B, S, HK, D, dtype=dtype, device=device)
    pos = torch.randint(0, 64, (B, S), device=device)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64, device=device) / D)
    angle = pos.reshape(-1, 1).double() * inv_freq
    cos, sin = angle.cos().float().contiguous(), angle.sin().float().contiguous()
    tables = rotation_tables(pos, half=D // 2, neox=True, freq_mode="inv_freq", inv_freq=inv_freq)
    return q, k, cos, sin, tables


def _reference(x, tables):
    return rotate(x.double(), tables, rotary_dim=x.shape[-1], rotary_start=0, neox=True)


def _check_helion(helion_peers, dtype, device, backend):
    q, k, cos, sin, tables = _inputs(dtype, device)
    qo, ko = helion_peers.helion_apply_rope(q, k, cos, sin)
    assert_close_to_ref(qo, _reference(q, tables), dtype, backend)
    assert_close_to_ref(ko, _reference(k, tables), dtype, backend)
    qw = torch.randn(q.shape[-1], dtype=dtype, device=device)
    kw = torch.randn(q.shape[-1], dtype=dtype, device=device)
    qo, ko = helion_peers.helion_qk_norm_rope(q, k, qw, kw, cos, sin, EPS)
    assert_close_to_ref(qo, _reference(rms_norm_reference(q, qw, 0.0, EPS), tables), dtype, backend)
    assert_close_to_ref(ko, _reference(rms_norm_reference(k, kw, 0.0, EPS), tables), dtype, backend)


def _eager_helion_peers(monkeypatch):
    """Helion's eager reference mode (HELION_INTERPRET=1) runs the kernel bodies on CPU tensors; it refuses to start
    beside the Triton interpreter, and reads the setting when a kernel is decorated: a private copy of the module,
    loaded with the Triton interpreter off for this test alone."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("HELION_INTERPRET", "1")
    import ropekit.bench

    path = os.path.join(os.path.dirname(ropekit.bench.__file__), "helion_peers.py")
    spec = importlib.util.spec_from_file_location("ropekit_test_helion_peers_eager", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not HAS_HELION, reason="needs helion")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_helion_peers_cpu_reference_mode(dtype, monkeypatch):
    _check_helion(_eager_helion_peers(monkeypatch), dtype, "cpu", "kernels")


@pytest.mark.skipif(not HAS_HELION, reason="needs helion")
def test_helion_bench_row_gathers_each_tokens_angles(monkeypatch):
    """The bench's helion row on the smoke decode case (a position per sequence): its outputs against the float64
    reference at the case's own positions."""
    from ropekit.bench import cases as bench_cases
    from ropekit.bench.impls import build_peer
    from ropekit.bench.inputs import make_inputs
    from ropekit.bench.peers import Peers

    registry = bench_cases.load_registry(os.path.join(os.path.dirname(bench_cases.__file__), "registry.py"))
    case = next(c for c in bench_cases.expand_preset(registry, "smoke")
                if "decode" in c.modes and c.positions == "batch" and c.style == "neox")
    inp = make_inputs(case, torch.device("cpu"))
    qo, ko = build_peer("helion", inp, "decode", Peers(helion=_eager_helion_peers(monkeypatch))).result()
    tables = rotation_tables(inp.pos_grid, half=case.head_dim // 2, neox=True, freq_mode="inv_freq",
                             inv_freq=inp.inv_freq)
    assert_close_to_ref(qo, _reference(inp.q, tables), inp.dtype, "kernels")
    assert_close_to_ref(ko, _reference(inp.k, tables), inp.dtype, "kernels")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HELION, reason="needs helion")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_helion_peers_gpu(dtype):
    from ropekit.bench import helion_peers

    _check_helion(helion_peers, dtype, "cuda", "cuda")
