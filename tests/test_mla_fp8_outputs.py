"""``ropekit.mla_rope_kv_write(..., out_dtype=float8)``: float8 q (whole or split) and k_pe outputs for FP8
attention (FlashInfer's ``mla_rope_quantize_fp8``), beside the latent cache write.

Outputs hold ``value / scale`` rounded once to the float8 format and saturated to its largest finite value,
compared with the float64 oracle (the rotation written from its definition) on the CPU path, the kernel under the
Triton interpreter and CUDA; preallocated outputs start poisoned; three calls per signature with fresh data.
"""

from __future__ import annotations

import pytest
import torch

import ropekit
from helpers import INTERPRETED, ROUTE_BACKENDS, ROUTES, angles64, on_route, rotate64, same_bits
from ropekit.testing import assert_close_to_ref

CALLS = 3
T, H, D_NOPE, R, L = 5, 3, 16, 8, 24
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FORMATS = [pytest.param(torch.float8_e4m3fn, id="e4m3fn"), pytest.param(torch.float8_e5m2, id="e5m2")]


def _poisoned(shape, dtype, device) -> torch.Tensor:
    """float8 NaN everywhere (the byte 0x7F in both formats)."""
    return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(dtype)


def _oracle(q, k_pe, positions, style):
    ang = angles64(positions.cpu().long(), R)
    c, s = ang.cos(), ang.sin()
    return (rotate64(q.cpu().double(), c, s, style=style, rotary_dim=R, rotary_at="back"),
            rotate64(k_pe.cpu().double(), c, s, style=style))


def _quantised(x: torch.Tensor, dtype, scale: float) -> torch.Tensor:
    top = FP8_MAX[dtype]
    return (x / scale).clamp(-top, top)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("split_q", [False, True], ids=["whole-q", "split-q"])
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
def test_float8_outputs(route, fp8, split_q, scale_kind):
    backend = ROUTE_BACKENDS[route]
    with on_route(route) as device:
        for call in range(CALLS):
            q = torch.randn(T, H, D_NOPE + R, dtype=torch.bfloat16, device=device)
            k_pe = torch.randn(T, 1, R, dtype=torch.bfloat16, device=device)
            q[0, 0, 0] = 900.0 * FP8_MAX[fp8] / 448  # past the format's range at scale 1.5: saturates
            positions = torch.randint(0, 5000, (T,), device=device)
            q_scale_out, k_scale_out = 0.5 + call, 1.5
            if scale_kind == "tensor":
                scales = dict(q_out_scale=torch.tensor(q_scale_out, device=device),
                              k_out_scale=torch.tensor([k_scale_out], device=device))
            else:
                scales = dict(q_out_scale=q_scale_out, k_out_scale=k_scale_out)
            with torch.inference_mode():
                outs = ropekit.mla_rope_kv_write(q, k_pe, positions=positions, split_q=split_q, out_dtype=fp8,
                                                 style="interleaved", **scales)
            q_rot, k_rot = _oracle(q, k_pe, positions, "interleaved")
            want = [q_rot[..., :D_NOPE], q_rot[..., D_NOPE:]] if split_q else [q_rot]
            for out, ref in zip(outs[:-1], want):
                assert_close_to_ref(out, _quantised(ref, fp8, q_scale_out), fp8, backend)
            assert_close_to_ref(outs[-1], _quantised(k_rot, fp8, k_scale_out), fp8, backend)


@pytest.mark.parametrize("route", ROUTES)
def test_float8_q_pe_into_a_buffer_beside_a_cache_write(route):
    """float8 q_pe written into the columns of a preallocated float8 buffer (the rest stays poisoned), the latent
    cache written in the same call: the serving path of FP8 MLA attention."""
    fp8 = torch.float8_e4m3fn
    backend = ROUTE_BACKENDS[route]
    with on_route(route) as device:
        for _ in range(CALLS):
            q = torch.randn(T, H, D_NOPE + R, dtype=torch.bfloat16, device=device)
            k_pe = torch.randn(T, 1, R, dtype=torch.bfloat16, device=device)
            kv_c = torch.randn(T, L, dtype=torch.bfloat16, device=device)
            positions, slots = torch.randint(0, 99, (T,), device=device), torch.randperm(16)[:T].to(device)
            buffer = _poisoned((T, H, L + R), fp8, device)
            cache = _poisoned((4, 4, L + R), fp8, device)
            with torch.no_grad():
                q_nope, q_pe, k_out = ropekit.mla_rope_kv_write(
                    q, k_pe, kv_c, positions=positions, kv_cache=cache, slot_mapping=slots, kv_cache_scale=2.0,
                    split_q=True, q_out=(None, buffer[..., L:]), out_dtype=fp8, q_out_scale=0.25)
            q_rot, k_rot = _oracle(q, k_pe, positions, "neox")
            assert q_pe is not None and q_nope.dtype == fp8 and k_out.dtype == fp8
            assert_close_to_ref(buffer[..., L:], _quantised(q_rot[..., D_NOPE:], fp8, 0.25), fp8, backend)
            assert torch.isnan(buffer[..., :L].float()).all()
            assert_close_to_ref(q_nope, _quantised(q_rot[..., :D_NOPE], fp8, 0.25), fp8, backend)
            rows = cache.view(-1, L + R).cpu()
            for t, slot in enumerate(slots.tolist()):
                assert_close_to_ref(rows[slot, L:], _quantised(k_rot[t, 0], fp8, 2.0), fp8, backend)
                assert_close_to_ref(rows[slot, :L], _quantised(kv_c[t].cpu().double(), fp8, 2.0), fp8, backend)


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_kernel_and_cpu_routes_round_alike():
    """The interpreter's software rounding and the CPU path's torch conversion give the same float8 bits where the
    fp32 value is exactly representable by both (a bfloat16 input rotated by position 0 is unchanged)."""
    from ropekit.testing import kernels_on_cpu

    q = torch.randn(T, H, D_NOPE + R, dtype=torch.bfloat16)
    k_pe = torch.randn(T, 1, R, dtype=torch.bfloat16)
    kw = dict(positions=torch.zeros(T, dtype=torch.int64), out_dtype=torch.float8_e4m3fn, q_out_scale=0.5)
    with torch.no_grad():
        cpu = ropekit.mla_rope_kv_write(q, k_pe, **kw)
        with kernels_on_cpu():
            kernel = ropekit.mla_rope_kv_write(q, k_pe, **kw)
    assert all(same_bits(a, b) for a, b in zip(cpu, kernel))


def test_float8_output_checks():
    q = torch.randn(T, H, D_NOPE + R)
    k_pe = torch.randn(T, 1, R)
    pos = torch.arange(T)
    cases = (
        (dict(out_dtype=torch.float16), TypeError, "out_dtype must be None, torch.float8_e4m3fn"),
        (dict(q_out_scale=2.0), ValueError, "q_out_scale applies to float8 outputs only"),
        (dict(out_dtype=torch.float8_e4m3fn, k_out_scale=0.0), ValueError, "k_out_scale must be a finite float"),
        (dict(out_dtype=torch.float8_e4m3fn, q_out_scale=torch.ones(2)), ValueError, "q_out_scale must be a float"),
        (dict(out_dtype=torch.float8_e4m3fn, q_out=torch.empty(T, H, D_NOPE + R)), TypeError,
         "q_out must be a tensor of the outputs' dtype torch.float8_e4m3fn"),
    )
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            ropekit.mla_rope_kv_write(q, k_pe, positions=pos, **kwargs)
    with pytest.raises(RuntimeError, match="float8 outputs are not differentiable"):
        ropekit.mla_rope_kv_write(q.requires_grad_(True), k_pe, positions=pos, out_dtype=torch.float8_e4m3fn)


@pytest.mark.gpu
def test_cuda_graph_capture_with_device_scales():
    """With the cache's and the outputs' scales as device scalars the call needs no host sync: captured once in a
    CUDA graph, each replay rotates and writes the data then in the static inputs, with the scales then held."""
    fp8, device = torch.float8_e4m3fn, "cuda"
    q = torch.randn(T, H, D_NOPE + R, dtype=torch.bfloat16, device=device)
    k_pe = torch.randn(T, 1, R, dtype=torch.bfloat16, device=device)
    kv_c = torch.randn(T, L, dtype=torch.bfloat16, device=device)
    positions, slots = torch.zeros(T, dtype=torch.int64, device=device), torch.arange(T, device=device)
    cache = _poisoned((4, 4, L + R), fp8, device)
    cache_scale, q_scale_out = torch.ones((), device=device), torch.ones((), device=device)

    def step():
        return ropekit.mla_rope_kv_write(q, k_pe, kv_c, positions=positions, kv_cache=cache, slot_mapping=slots,
                                         kv_cache_scale=cache_scale, out_dtype=fp8, q_out_scale=q_scale_out,
                                         k_out_scale=q_scale_out)

    with torch.inference_mode():
        step()  # compiles the kernel outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            q_out, k_out = step()
        for call in range(CALLS):
            for x in (q, k_pe, kv_c):
                x.copy_(torch.randn_like(x))
            positions.copy_(torch.randint(0, 9999, (T,), device=device))
            slots.copy_(torch.randperm(16, device=device)[:T])
            cache_scale.fill_(0.5 + call)
            q_scale_out.fill_(2.0 + call)
            graph.replay()
            torch.cuda.synchronize()
            q_rot, k_rot = _oracle(q, k_pe, positions, "neox")
            assert_close_to_ref(q_out, _quantised(q_rot, fp8, 2.0 + call), fp8, "kernels")
            assert_close_to_ref(k_out, _quantised(k_rot, fp8, 2.0 + call), fp8, "kernels")
            rows = cache.view(-1, L + R).cpu()
            for t, slot in enumerate(slots.tolist()):
                assert_close_to_ref(rows[slot, L:], _quantised(k_rot[t, 0], fp8, 0.5 + call), fp8, "kernels")
                assert_close_to_ref(rows[slot, :L], _quantised(kv_c[t].cpu().double(), fp8, 0.5 + call), fp8,
                                    "kernels")
