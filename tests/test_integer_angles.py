"""The kernels' float64-free exact angles (``kernel.FREQ_INV_FREQ_INT``: the angle as a 64-bit integer fraction of
a turn), chosen on GPUs without fast float64: as exact as the float64 path up to the largest position, on every
route that forms angles in the kernel, and chosen by device capability."""

import pytest
import torch

import ropekit
from helpers import INTERPRETED
from ropekit._spec import BACKWARD
from ropekit._validation import validate
from ropekit.reference import rope_reference
from ropekit.testing import exact_angles, kernels_on_cpu, max_relative_error, max_relative_tolerance
from ropekit.triton import heuristics, kernel, launcher

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
FP32 = max_relative_tolerance(torch.float32, "triton-interpreter")


def _ref(q, k, **options):
    return rope_reference(q.double(), None if k is None else k.double(),
                          validate(q.double(), None if k is None else k.double(), **options))


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("top", [2**10, 2**24, 2**31 - 1])
def test_exact_to_the_largest_position(style, top):
    # The documented bound (2e-6 of the output scale) at positions up to 2**31 - 1, fp32 outputs.
    q, k = torch.randn(2, 8, 3, 64), torch.randn(2, 8, 1, 64)
    pos = torch.randint(0, top, (2, 8))
    pos[0, :2] = torch.tensor([top - 1, 0])
    with kernels_on_cpu(), exact_angles("integer"):
        out = ropekit.apply_rope(q, k, positions=pos, style=style, base=500000.0)
    assert max_relative_error(out, _ref(q, k, positions=pos, style=style, base=500000.0)) <= FP32


def test_every_kind_of_frequency():
    # Negative, zero, subnormal, tiny and above-one frequencies (positions where float64 products are exact, so
    # the reference is too): the integer path takes every float32 bit pattern.
    inv = torch.tensor([3.0, -1.5, 1e-30, 0.0, 2.0**-20, 123.456, -7e-3, 1.0, 200.0, 2.0**-60, 1e-38, -0.75])
    q = torch.randn(1, 5, 2, 24)
    pos = torch.tensor([[0, 1, 2**20, 777777, 5]])
    with kernels_on_cpu(), exact_angles("integer"):
        out = ropekit.apply_rope(q, positions=pos, inv_freq=inv)
    assert max_relative_error(out, _ref(q, None, positions=pos, inv_freq=inv)[0]) <= FP32


@pytest.mark.parametrize("one_position", [False, True], ids=["per-axis", "text-tokens"])
@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
def test_multi_axis_positions(layout, one_position):
    # distinct positions per axis (image tokens), and one position on every axis (text tokens)
    q = torch.randn(2, 8, 2, 64)
    pos = torch.randint(0, 2**24, (3, 2, 8))
    if one_position:
        pos = pos[:1].expand(3, 2, 8).contiguous()
    with kernels_on_cpu(), exact_angles("integer"):
        out = ropekit.apply_rope(q, positions=pos, sections=(8, 12, 12), section_layout=layout)
    ref = _ref(q, None, positions=pos, sections=(8, 12, 12), section_layout=layout)[0]
    assert max_relative_error(out, ref) <= FP32


def test_backward_in_place_and_plans_equal_the_float64_path():
    # The same calls through both methods: backward, in place, and repeated calls (plans from the second call)
    # agree with each other and with the reference; bf16 outputs within one rounding of each other.
    pos = torch.randint(0, 2**20, (2, 6))
    outs = {}
    for method in ("float64", "integer"):
        torch.manual_seed(1)
        with kernels_on_cpu(), exact_angles(method):
            results = []
            for _ in range(3):
                q, k = torch.randn(2, 6, 4, 32), torch.randn(2, 6, 2, 32)
                results.append(ropekit.rope_backward(q, k, positions=pos))
                qb, kb = q.bfloat16(), k.bfloat16()
                ropekit.apply_rope_(qb, kb, positions=pos)
                results.append((qb.float(), kb.float()))
            outs[method] = results
    for (a_q, a_k), (b_q, b_k) in zip(outs["float64"], outs["integer"]):
        assert max_relative_error((a_q, a_k), (b_q, b_k)) <= 2 * 2.0**-7  # one bf16 rounding each way, at most
    torch.manual_seed(1)
    q, k = torch.randn(2, 6, 4, 32), torch.randn(2, 6, 2, 32)
    ref = rope_reference(q.double(), k.double(), validate(q.double(), k.double(), positions=pos, mode=BACKWARD))
    assert max_relative_error(outs["integer"][0], ref) <= FP32


def test_the_choice_follows_the_device(monkeypatch):
    monkeypatch.setattr(ropekit._config, "exact_angles", None)
    assert not heuristics.integer_angles(torch.device("cpu"))  # the interpreter: float64, as measured
    monkeypatch.setattr(heuristics, "fast_float64", lambda index: False)
    assert heuristics.integer_angles(torch.device("cuda", 0))
    monkeypatch.setattr(heuristics, "fast_float64", lambda index: True)
    assert not heuristics.integer_angles(torch.device("cuda", 0))
    monkeypatch.setattr(ropekit._config, "exact_angles", "integer")
    assert heuristics.integer_angles(torch.device("cpu"))
    monkeypatch.setattr(ropekit._config, "exact_angles", "fp16")
    with pytest.raises(ValueError, match="exact_angles"):
        heuristics.integer_angles(torch.device("cpu"))


def test_float64_frequencies_keep_the_float64_path():
    # The integer path reads a float32 significand: float64 inv_freq keeps the float64 reduction.
    q = torch.randn(1, 4, 1, 16)
    spec = validate(q, None, positions=7, inv_freq=torch.rand(8, dtype=torch.float64))
    with exact_angles("integer"):
        launch = launcher.rope_arguments(q, None, torch.empty_like(q), None, spec)
    names = launch[2]
    assert names["FREQ_MODE"] == kernel.FREQ_INV_FREQ.value
