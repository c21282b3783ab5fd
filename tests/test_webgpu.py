"""WebGPU backend: the WGSL kernels through wgpu, against the float64 reference.

The public route, ``ropekit.apply_rope(..., backend="webgpu")``, is tested for what users see: the same
validation, defaults and results as the default backend, and a ValueError naming every option the kernels do not
implement. The ABI (``runner.dispatch``) and the angle paths (``runner.apply_rope(..., angles=...)``, the
backend's low-level interface) are tested through the runner.

Runs on whatever adapter wgpu finds (CI: llvmpipe over OpenGL, or lavapipe with mesa-vulkan-drivers); skips
without wgpu or an adapter. Inputs are fresh N(0, 1) values; kernels rotate in place, so coverage is checked with
rotations that move every element (a quarter turn) and a sentinel tail past the data.
"""

import importlib.util
import math
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

wgpu = pytest.importorskip("wgpu", reason="the WebGPU backend needs wgpu: pip install 'ropekit[webgpu]'")

import ropekit  # noqa: E402
import ropekit.webgpu as webgpu  # noqa: E402
from helpers import assert_close_to_ref  # noqa: E402
from ropekit._spec import BACKWARD, FORWARD, RopeSpec  # noqa: E402
from ropekit._validation import validate  # noqa: E402
from ropekit.frequencies import STYLES, default_inv_freq  # noqa: E402
from ropekit.reference import rope_reference  # noqa: E402
from ropekit.webgpu.adapter import unsupported  # noqa: E402

# max |out - ref| <= atol + rtol * |ref|. f32 kernels: exact angles, polynomial sin/cos (~1e-7), f32 stores.
# f16: one rounding at the store (pack2x16float may round either way: one ulp). bf16: f32 result rounded by torch.
TOL = {
    torch.float32: dict(rtol=1e-6, atol=2e-6),
    torch.float16: dict(rtol=2.0**-10, atol=1e-5),
    torch.bfloat16: dict(rtol=2.0**-8, atol=1e-5),
}
# Frequencies computed in the shader (rope_q / rope_k): ~1 f32 ulp off the exact ones, so the angle error grows
# as position * freq * 2**-23; these tests keep positions below 128.
BASE_KERNEL_TOL = {torch.float32: dict(rtol=0.0, atol=2e-4)}
ABI_ENTRY_POINTS = ("rope_q", "rope_k", "rope_q_backward", "rope_k_backward")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def runner():
    try:
        return webgpu.default_runner()
    except RuntimeError as exc:
        pytest.skip(f"no WebGPU adapter: {exc}")


def exact_inv_freq(base, D):
    return base ** -(torch.arange(0, D, 2, dtype=torch.float64) / D)


def reference(x, *, style, inv_freq, pos_offset=0, conjugate=False):
    """float64 rotation of x ([S, H, D] or [B, S, H, D])."""
    x4 = x.unsqueeze(0) if x.ndim == 3 else x
    spec = validate(x4, None, positions=pos_offset, inv_freq=inv_freq, style=style,
                    mode=BACKWARD if conjugate else FORWARD)
    out = rope_reference(x4, None, spec._replace(out_dtype=torch.float64))[0]
    return out.reshape(x.shape)


def abi_dispatch(entry, x, *, pos_offset, base, tail=512):
    """Run a base kernel exactly as a WebGPU program written against the ABI would: the shipped file compiled as
    is, an explicit bind-group layout (0: storage, 1: uniform, 2: uniform), ceil(S*H*D/2 / 256) workgroups.
    The data buffer carries ``tail`` sentinel floats past the tensor; returns (rotated [S, H, D], tail)."""
    device = webgpu.default_runner().device
    source = webgpu.shader_source()
    module = device.create_shader_module(code=source)
    compute = wgpu.ShaderStage.COMPUTE
    bind_layout = device.create_bind_group_layout(entries=[
        {"binding": 0, "visibility": compute, "buffer": {"type": wgpu.BufferBindingType.storage}},
        {"binding": 1, "visibility": compute, "buffer": {"type": wgpu.BufferBindingType.uniform}},
        {"binding": 2, "visibility": compute, "buffer": {"type": wgpu.BufferBindingType.uniform}},
    ])
    pipe = device.create_compute_pipeline(
        layout=device.create_pipeline_layout(bind_group_layouts=[bind_layout]),
        compute={"module": module, "entry_point": entry})
    S, H, D = x.shape
    sentinel = np.full(tail, 12345.0, np.float32)
    data = device.create_buffer_with_data(data=np.concatenate([x.ravel(), sentinel]).tobytes(),
                                          usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    dims = device.create_buffer_with_data(data=np.array([S, H, D, pos_offset], np.uint32).tobytes(),
                                          usage=wgpu.BufferUsage.UNIFORM)
    params = device.create_buffer_with_data(data=np.array([base, 0, 0, 0], np.float32).tobytes(),
                                            usage=wgpu.BufferUsage.UNIFORM)
    group = device.create_bind_group(layout=bind_layout, entries=[
        {"binding": i, "resource": {"buffer": b}} for i, b in enumerate((data, dims, params))])
    encoder = device.create_command_encoder()
    cpass = encoder.begin_compute_pass()
    cpass.set_pipeline(pipe)
    cpass.set_bind_group(0, group)
    cpass.dispatch_workgroups(math.ceil(S * H * (D // 2) / 256))
    cpass.end()
    device.queue.submit([encoder.finish()])
    out = np.frombuffer(device.queue.read_buffer(data), np.float32)
    return out[:x.size].reshape(x.shape), out[x.size:]


# ---------------------------------------------------------------------------------------------------------------
# The shipped shader and its ABI


def test_shader_file_declares_the_abi():
    source = webgpu.shader_source()
    assert re.search(r"@binding\(0\)\s+var<storage,\s*read_write>\s+\w+\s*:\s*array<f32>", source)
    assert re.search(r"@binding\(1\)\s+var<uniform>\s+\w+\s*:\s*vec4<u32>", source)
    assert re.search(r"@binding\(2\)\s+var<uniform>\s+\w+\s*:\s*vec4<f32>", source)
    declared = re.findall(r"@compute @workgroup_size\(256\)\s*fn (\w+)\(", source)
    assert set(ABI_ENTRY_POINTS) <= set(declared)
    expected = {webgpu.entry_point(style=st, source=so, packed_f16=f16, conjugate=c)
                for st in STYLES for so in ("base", "freq", "table") for f16 in (False, True)
                for c in (False, True)}
    assert expected | {"rope_k", "rope_k_backward"} == set(declared)


@pytest.mark.parametrize("base", [10000.0, 500000.0, 1e6])
def test_rope_q_and_rope_k_through_the_abi(runner, base):
    # GQA: 8 query heads, 2 key heads; positions 40..76; the last workgroup of each dispatch is partly idle.
    S, D, offset = 37, 48, 40
    q = torch.randn(S, 8, D)
    k = torch.randn(S, 2, D)
    q_out, q_tail = abi_dispatch("rope_q", q.numpy(), pos_offset=offset, base=base)
    k_out, k_tail = abi_dispatch("rope_k", k.numpy(), pos_offset=offset, base=base)
    assert (q_tail == 12345.0).all() and (k_tail == 12345.0).all(), "a kernel wrote past the tensor"
    inv_freq = exact_inv_freq(base, D)
    for x, out in ((q, q_out), (k, k_out)):
        assert_close_to_ref(torch.from_numpy(out), reference(x, style="interleaved", inv_freq=inv_freq,
                                                             pos_offset=offset), torch.float32, BASE_KERNEL_TOL)
    # Backward twins undo the forward.
    q_back, _ = abi_dispatch("rope_q_backward", q_out, pos_offset=offset, base=base)
    k_back, _ = abi_dispatch("rope_k_backward", k_out, pos_offset=offset, base=base)
    torch.testing.assert_close(torch.from_numpy(q_back), q, rtol=0, atol=2e-6)
    torch.testing.assert_close(torch.from_numpy(k_back), k, rtol=0, atol=2e-6)


def test_q_and_k_share_the_angle_of_each_position_and_pair(runner):
    S, D = 32, 64
    q = torch.randn(S, 6, D)
    k = q[:, 1:4].clone()  # the same vectors as three of q's heads
    # The ABI kernels: bit-identical rotations of identical vectors.
    q_out, _ = abi_dispatch("rope_q", q.numpy(), pos_offset=7, base=10000.0)
    k_out, _ = abi_dispatch("rope_k", k.numpy(), pos_offset=7, base=10000.0)
    assert np.array_equal(k_out, q_out[:, 1:4])
    # q and k are rotated in one dispatch; q.k then depends only on the distance between positions.
    for angles in webgpu.ANGLE_MODES:
        q_rot, k_rot = runner.apply_rope(q, k, pos_offset=7, angles=angles)
        assert torch.equal(k_rot, q_rot[:, 1:4])
    q_far, k_far = ropekit.apply_rope(q, k, positions=7 + 123456, layout="thd", backend="webgpu")
    q_rot, k_rot = ropekit.apply_rope(q, k, positions=7, layout="thd", backend="webgpu")
    scores = torch.einsum("shd,thd->hst", q_rot[:, 1:4].double(), k_rot.double())
    scores_far = torch.einsum("shd,thd->hst", q_far[:, 1:4].double(), k_far.double())
    torch.testing.assert_close(scores_far, scores, rtol=0, atol=5e-5)


# ---------------------------------------------------------------------------------------------------------------
# Each angle path against the float64 reference (runner.apply_rope: the low-level interface)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("angles", ["shader", "host"])
@pytest.mark.parametrize("base", [10000.0, 500000.0, 1e6])
def test_matches_reference_with_gqa(runner, style, angles, base):
    B, S, D = 2, 24, 64
    q = torch.randn(B, S, 8, D)
    for hk in (1, 2, 8):
        k = torch.randn(B, S, hk, D)
        q_out, k_out = runner.apply_rope(q, k, pos_offset=3, base=base, style=style, angles=angles)
        inv_freq = default_inv_freq(base, D, CPU)
        assert_close_to_ref(q_out, reference(q, style=style, inv_freq=inv_freq, pos_offset=3), torch.float32, TOL)
        assert_close_to_ref(k_out, reference(k, style=style, inv_freq=inv_freq, pos_offset=3), torch.float32, TOL)


@pytest.mark.parametrize("angles", ["shader", "host"])
def test_long_context_positions_stay_exact(runner, angles):
    # Tokens straddling 2**k for k up to 20 (and far beyond for in-shader angles), up to ropekit's last position.
    D, S = 128, 16
    inv_freq = default_inv_freq(500000.0, D, CPU)
    powers = (4, 8, 12, 16, 20) + ((24, 28, 30) if angles == "shader" else ())
    offsets = [2**power - S // 2 for power in powers] + ([2**31 - S] if angles == "shader" else [])
    for offset in offsets:
        x = torch.randn(S, 2, D)
        out = runner.apply_rope(x, pos_offset=offset, base=500000.0, style="neox", angles=angles)
        assert_close_to_ref(out, reference(x, style="neox", inv_freq=inv_freq, pos_offset=offset), torch.float32,
                            TOL)


@pytest.mark.parametrize("style", STYLES)
def test_given_inv_freq_is_used(runner, style):
    D = 32
    inv_freq = torch.rand(D // 2) * 2.0  # a scaled table, some frequencies above 1
    x = torch.randn(2, 20, 3, D)
    ref = reference(x, style=style, inv_freq=inv_freq, pos_offset=99991)
    for angles in ("shader", "host"):
        out = runner.apply_rope(x, pos_offset=99991, inv_freq=inv_freq, style=style, angles=angles)
        assert_close_to_ref(out, ref, torch.float32, TOL)
    public = ropekit.apply_rope(x, positions=99991, inv_freq=inv_freq, style=style, backend="webgpu")
    assert torch.equal(public, runner.apply_rope(x, pos_offset=99991, inv_freq=inv_freq, style=style))


@pytest.mark.parametrize("style", STYLES)
def test_cos_sin_and_angle_tables(runner, style):
    # [P, D/2] and transformers' full-width [P, D] tables indexed by position; [1, S, D] rows already gathered per
    # token (transformers' cos/sin for one sequence); raw angles, the same three ways.
    S, D, offset = 12, 16, 30
    inv_freq = default_inv_freq(10000.0, D, CPU)
    theta = torch.arange(64, dtype=torch.float64)[:, None] * inv_freq.double()
    full = torch.cat([theta, theta], -1) if style == "neox" else theta.repeat_interleave(2, -1)
    x = torch.randn(S, 4, D)
    ref = reference(x, style=style, inv_freq=inv_freq, pos_offset=offset)
    for table, positions in ((theta, offset), (full, offset), (full[offset:offset + S][None], None)):
        for kwargs in (dict(cos=table.cos().float(), sin=table.sin().float()), dict(angles=table.float())):
            out = ropekit.apply_rope(x, positions=positions, style=style, layout="thd", backend="webgpu", **kwargs)
            assert_close_to_ref(out, ref, torch.float32, TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("style, D", [("interleaved", 64), ("neox", 64), ("neox", 6)])
def test_half_precision_inputs(runner, dtype, style, D):
    # fp16 stays packed on the device (neox needs D % 4 == 0, else it is rotated in f32); bf16 goes through f32.
    x = torch.randn(2, 16, 4, D).to(dtype)
    out = ropekit.apply_rope(x, positions=1000, style=style, backend="webgpu")
    ref = reference(x, style=style, inv_freq=default_inv_freq(10000.0, D, CPU), pos_offset=1000)
    assert_close_to_ref(out, ref, dtype, TOL)
    inplace = x.clone()
    assert ropekit.apply_rope_(inplace, positions=1000, style=style, backend="webgpu") is inplace
    assert torch.equal(inplace, out)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("angles", webgpu.ANGLE_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_undoes_forward(runner, style, angles, dtype):
    x = torch.randn(3, 20, 4, 32).to(dtype)
    y = runner.apply_rope(x, pos_offset=50000, style=style, angles=angles)
    back = runner.apply_rope(y, pos_offset=50000, style=style, angles=angles, conjugate=True)
    if dtype == torch.float32:
        torch.testing.assert_close(back, x, rtol=0, atol=4e-6)
    else:  # two f16 roundings, each up to an ulp of the pair's norm (< 8 here)
        torch.testing.assert_close(back, x, rtol=0, atol=2.0**-7)
    ref = reference(y, style=style, inv_freq=default_inv_freq(10000.0, 32, CPU), pos_offset=50000, conjugate=True)
    if angles != "shader_base":
        assert_close_to_ref(back, ref, dtype, TOL)
    if angles == "shader":  # the public route's path
        assert torch.equal(ropekit.rope_backward(y, positions=50000, style=style, backend="webgpu"), back)


@pytest.mark.parametrize("angles", webgpu.ANGLE_MODES)
def test_pos_offset_equals_a_slice_of_a_longer_run(runner, angles):
    x = torch.randn(1, 64, 3, 32)
    q, k = x[:, :, :2], x[:, :, 2:]
    q_full, k_full = runner.apply_rope(q, k, pos_offset=1000, angles=angles)
    q_part, k_part = runner.apply_rope(q[:, 40:], k[:, 40:], pos_offset=1040, angles=angles)
    assert torch.equal(q_part, q_full[:, 40:]) and torch.equal(k_part, k_full[:, 40:])


# ---------------------------------------------------------------------------------------------------------------
# Coverage, grids, slicing, the kernels' own checks


def quarter_turn_table(S, D):
    cos_sin = np.zeros((S, D // 2, 2), np.float32)
    cos_sin[..., 1] = 1.0  # cos 0, sin 1: lo' = -hi, hi' = lo, so every element changes
    return cos_sin


@pytest.mark.parametrize("entry", ["rope_table", "rope_neox_table", "rope_table_f16", "rope_neox_table_f16"])
def test_every_element_is_written_on_a_2d_grid_and_in_slices(runner, entry):
    S, H, D = 37, 3, 24  # 37 * 3 * 12 pairs: 6 workgroups (3 for neox_f16)
    dtype = np.float16 if entry.endswith("f16") else np.float32
    x = torch.randn(S, H, D).numpy().astype(dtype)
    lo, hi = (slice(None, D // 2), slice(D // 2, None)) if "neox" in entry else (slice(0, None, 2),
                                                                                   slice(1, None, 2))
    expected = np.empty_like(x)
    expected[..., lo], expected[..., hi] = -x[..., hi], x[..., lo]
    table = quarter_turn_table(S, D)
    units = S * H * D // (4 if entry == "rope_neox_table_f16" else 2)
    square = math.isqrt(math.ceil(units / 256) - 1) + 1  # sides of a near-square 2-D grid (two rows at least)
    assert webgpu.workgroup_grid(math.ceil(units / 256), square)[1] >= 2
    saved = runner.max_workgroups_per_dimension, runner.max_binding_bytes
    try:
        # Whole tokens in slices of 5; then bindings smaller than one token: blocks of 2 heads (and 1 token).
        for per_dim, binding_bytes in ((saved[0], saved[1]), (square, saved[1]), (saved[0], 5 * H * D * x.itemsize),
                                       (saved[0], 2 * D * x.itemsize)):
            runner.max_workgroups_per_dimension, runner.max_binding_bytes = per_dim, binding_bytes
            assert np.array_equal(runner.dispatch(entry, x, cos_sin=table), expected), (per_dim, binding_bytes)
    finally:
        runner.max_workgroups_per_dimension, runner.max_binding_bytes = saved


def test_more_than_65535_workgroups(runner):
    # 2**24 + 2048 packed pairs: 65544 workgroups of 256, beyond one grid dimension on every adapter.
    S, H, D = 8193, 32, 128
    x = torch.randn(S, H, D).half().numpy()
    out = runner.dispatch("rope_table_f16", x, cos_sin=quarter_turn_table(S, D))
    assert np.array_equal(out[..., 0::2], -x[..., 1::2]) and np.array_equal(out[..., 1::2], x[..., 0::2])


@pytest.mark.parametrize("n", [1, 255, 65535, 65536, 3 * 65535 + 1, 65535**2])
def test_workgroup_grid(n):
    x, y = webgpu.workgroup_grid(n, 65535)
    assert x <= 65535 and y <= 65535 and x * y >= n and x * y - n < y


def test_kernels_poison_what_they_cannot_rotate(runner):
    x = torch.randn(4, 2, 8).numpy()
    # Odd head_dim: the kernel cannot pair the columns, so it writes NaN instead of skipping the last one silently.
    odd = torch.randn(4, 2, 7).numpy()
    assert np.isnan(runner.dispatch("rope_q", odd)[..., :6]).all()
    # Positions past the end of a cos/sin table, and a frequency table too short for head_dim.
    out = runner.dispatch("rope_table", x, pos_offset=2, cos_sin=quarter_turn_table(4, 8))
    assert np.isnan(out[2:]).all() and not np.isnan(out[:2]).any()
    out = runner.dispatch("rope_freq", x, inv_freq=np.ones(2, np.float32))
    assert np.isnan(out[..., 4:]).all() and not np.isnan(out[..., :4]).any()
    # Empty tables (a binding cannot be empty): every pair is poisoned, none rotated by a stand-in 0.
    assert np.isnan(runner.dispatch("rope_freq", x, inv_freq=np.zeros(0, np.float32))).all()
    assert np.isnan(runner.dispatch("rope_table", x, cos_sin=np.zeros((0, 4, 2), np.float32))).all()


# ---------------------------------------------------------------------------------------------------------------
# The public route: ropekit.apply_rope(..., backend="webgpu")


def test_defaults_agree_with_the_default_backend(runner):
    # Only q, k and positions: NeoX pairs, base 10000, every column rotated, on both backends and on the runner.
    q, k = torch.randn(2, 9, 4, 16), torch.randn(2, 9, 2, 16)
    got = ropekit.apply_rope(q, k, positions=77, backend="webgpu")
    want = ropekit.apply_rope(q, k, positions=77, out_dtype=torch.float64)
    neox = reference(q, style="neox", inv_freq=default_inv_freq(10000.0, 16, CPU), pos_offset=77)
    for out, ref in ((got[0], want[0]), (got[1], want[1]), (got[0], neox)):
        assert_close_to_ref(out, ref, torch.float32, TOL)
    assert_close_to_ref(ropekit.apply_rope(q, backend="webgpu"), ropekit.apply_rope(q, out_dtype=torch.float64),
                        torch.float32, TOL)
    q_low, k_low = runner.apply_rope(q, k, pos_offset=77)
    assert torch.equal(q_low, got[0]) and torch.equal(k_low, got[1])


@pytest.mark.parametrize("style", STYLES)
def test_public_api_backend_webgpu_matches_the_default_backend(runner, style):
    q = torch.randn(2, 9, 4, 16)
    k = torch.randn(2, 9, 2, 16)
    got_q, got_k = ropekit.apply_rope(q, k, positions=77, base=500000.0, style=style, backend="webgpu")
    want_q, want_k = ropekit.apply_rope(q.double(), k.double(), positions=77, base=500000.0, style=style)
    torch.testing.assert_close(got_q.double(), want_q, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(got_k.double(), want_k, rtol=1e-6, atol=2e-6)
    back = ropekit.rope_backward(got_q, positions=77, base=500000.0, style=style, backend="webgpu")
    torch.testing.assert_close(back, q, rtol=1e-5, atol=1e-5)
    x = q.clone()
    assert ropekit.apply_rope_(x, positions=77, base=500000.0, style=style, backend="webgpu") is x
    torch.testing.assert_close(x, got_q, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_views_in_place_thd_and_dtypes(runner, dtype):
    # q and k as views of a packed QKV buffer, rotated out of place and in place (v untouched); thd tokens.
    qkv = torch.randn(2, 9, 8 * 16).to(dtype)
    q, k, v = qkv.view(2, 9, 8, 16).split([4, 2, 2], dim=2)
    v_before = v.clone()
    got_q, got_k = ropekit.apply_rope(q, k, positions=300, backend="webgpu")
    ref_q, ref_k = ropekit.apply_rope(q, k, positions=300, out_dtype=torch.float64)
    assert_close_to_ref(got_q, ref_q, dtype, TOL)
    assert_close_to_ref(got_k, ref_k, dtype, TOL)
    out_q, out_k = ropekit.apply_rope_(q, k, positions=300, backend="webgpu")
    assert out_q is q and out_k is k and torch.equal(q, got_q) and torch.equal(k, got_k)
    assert torch.equal(v, v_before)
    tokens = torch.randn(9, 4, 16).to(dtype)
    assert torch.equal(ropekit.apply_rope(tokens, positions=300, layout="thd", backend="webgpu"),
                       ropekit.apply_rope(tokens[None], positions=300, backend="webgpu")[0])


def test_numpy_arrays_through_the_runner(runner):
    q = torch.randn(2, 10, 4, 16)
    k = torch.randn(2, 10, 1, 16)
    q_copy, k_copy = q.clone(), k.clone()
    q_out, k_out = ropekit.apply_rope(q, k, positions=5, backend="webgpu")
    assert torch.equal(q, q_copy) and torch.equal(k, k_copy)
    assert isinstance(q_out, torch.Tensor) and q_out.shape == q.shape and k_out.shape == k.shape
    out_np = runner.apply_rope(q[0].numpy(), pos_offset=5)
    assert isinstance(out_np, np.ndarray) and out_np.dtype == np.float32 and out_np.shape == (10, 4, 16)
    assert np.array_equal(out_np, q_out[0].numpy())
    half = runner.apply_rope(q[0].half().numpy())
    assert isinstance(half, np.ndarray) and half.dtype == np.float16


def _q():
    return torch.randn(2, 4, 3, 16)


def _k():
    return torch.randn(2, 4, 1, 16)


def _inference_q():
    with torch.inference_mode():
        return _q()


# Calls every backend must refuse alike (validate): (function, make (args, kwargs), the exception).
BAD_CALLS = {
    "q not a tensor": (ropekit.apply_rope, lambda: ((_q().numpy(),), {}), TypeError),
    "q of integers": (ropekit.apply_rope, lambda: ((_q().int(),), {}), TypeError),
    "k of another dtype": (ropekit.apply_rope, lambda: ((_q(), _k().half()), {}), TypeError),
    "q with 3 dims for bshd": (ropekit.apply_rope, lambda: ((_q()[0],), {}), ValueError),
    "k of another head_dim": (ropekit.apply_rope, lambda: ((_q(), _k()[..., :8]), {}), ValueError),
    "odd head_dim": (ropekit.apply_rope, lambda: ((_q()[..., :15],), {}), ValueError),
    "strided last dim": (ropekit.apply_rope, lambda: ((_q()[..., ::2],), {}), ValueError),
    "unknown style": (ropekit.apply_rope, lambda: ((_q(),), dict(style="gptj")), ValueError),
    "unknown layout": (ropekit.apply_rope, lambda: ((_q(),), dict(layout="hsd")), ValueError),
    "base 1": (ropekit.apply_rope, lambda: ((_q(),), dict(base=1.0)), ValueError),
    "base not a number": (ropekit.apply_rope, lambda: ((_q(),), dict(base="1e4")), ValueError),
    "positions < 0": (ropekit.apply_rope, lambda: ((_q(),), dict(positions=-1)), ValueError),
    "positions past 2**31 - 1": (ropekit.apply_rope, lambda: ((_q(),), dict(positions=2**31 - 2)), ValueError),
    "positions a float": (ropekit.apply_rope, lambda: ((_q(),), dict(positions=1.5)), TypeError),
    "inv_freq too short": (ropekit.apply_rope, lambda: ((_q(),), dict(inv_freq=torch.ones(3), rotary_dim=16)),
                           ValueError),
    "inv_freq of integers": (ropekit.apply_rope, lambda: ((_q(),), dict(inv_freq=torch.ones(8, dtype=torch.int32))),
                             TypeError),
    "inv_freq and cos/sin": (ropekit.apply_rope, lambda: ((_q(),), dict(inv_freq=torch.ones(8), cos=torch.ones(9, 8),
                                                                        sin=torch.ones(9, 8))), ValueError),
    "cos without sin": (ropekit.apply_rope, lambda: ((_q(),), dict(cos=torch.ones(9, 8))), ValueError),
    "table too short": (ropekit.apply_rope, lambda: ((_q(),), dict(cos=torch.ones(5, 8), sin=torch.ones(5, 8),
                                                                   positions=2)), IndexError),
    "rotary_dim not an int": (ropekit.apply_rope, lambda: ((_q(),), dict(rotary_dim=8.0)), TypeError),
    "odd rotary_dim": (ropekit.apply_rope, lambda: ((_q(),), dict(rotary_dim=7)), ValueError),
    "q_scale NaN": (ropekit.apply_rope, lambda: ((_q(),), dict(q_scale=math.nan)), TypeError),
    "out_dtype of integers": (ropekit.apply_rope, lambda: ((_q(),), dict(out_dtype=torch.int32)), TypeError),
    "cu_seqlens with bshd": (ropekit.apply_rope, lambda: ((_q(),), dict(cu_seqlens=torch.tensor([0, 4]))),
                             ValueError),
    "dq_rot not a tensor": (ropekit.rope_backward, lambda: (([1.0],), {}), TypeError),
    "in place: expanded q": (ropekit.apply_rope_, lambda: ((_q()[:, :, :1].expand(2, 4, 3, 16),), {}), ValueError),
    "in place: another out_dtype": (ropekit.apply_rope_, lambda: ((_q(),), dict(out_dtype=torch.float64)),
                                    ValueError),
    "in place: q and k share memory": (ropekit.apply_rope_, lambda: ((lambda q: (q, q[:, :, :1]))(_q()), {}),
                                       ValueError),
    "in place: a leaf that requires grad": (ropekit.apply_rope_, lambda: ((_q().requires_grad_(),), {}),
                                            RuntimeError),
    "in place: an inference tensor": (ropekit.apply_rope_, lambda: ((_inference_q(),), {}), RuntimeError),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_inputs_raise_the_same_exception_on_both_backends(case):
    fn, make, error = BAD_CALLS[case]
    messages = []
    for backend in ("auto", "webgpu"):
        args, kwargs = make()
        with pytest.raises(error) as info:
            fn(*args, backend=backend, **kwargs)
        assert info.type is error, (backend, info.value)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


# What the kernels do not implement, refused by name before anything is written: make (q, k, kwargs), the words.
UNSUPPORTED = {
    "per-sequence offsets": (lambda: (_q(), None, dict(positions=torch.tensor([1, 2]))), "a positions tensor"),
    "per-token positions": (lambda: (_q(), None, dict(positions=torch.arange(4)[None])), "a positions tensor"),
    "multi-axis positions": (lambda: (_q(), None, dict(positions=torch.arange(8).view(2, 1, 4), sections=(4, 4))),
                             "multi-axis positions"),
    "cu_seqlens": (lambda: (torch.randn(4, 3, 16), None, dict(layout="thd", cu_seqlens=torch.tensor([0, 1, 4]))),
                   "cu_seqlens"),
    "layout bhsd": (lambda: (_q(), None, dict(layout="bhsd")), "layout='bhsd'"),
    "layout sbhd": (lambda: (_q(), None, dict(layout="sbhd")), "layout='sbhd'"),
    "partial rotary": (lambda: (_q(), None, dict(rotary_dim=8)), "rotary_dim < head_dim"),
    "rotary_at back": (lambda: (_q(), None, dict(rotary_dim=8, rotary_at="back")), "rotary_dim < head_dim"),
    "q_scale": (lambda: (_q(), None, dict(q_scale=0.5)), "q_scale/k_scale/rotary_scale"),
    "k_scale": (lambda: (_q(), _k(), dict(k_scale=0.5)), "q_scale/k_scale/rotary_scale"),
    "rotary_scale": (lambda: (_q(), None, dict(rotary_scale=1.5)), "q_scale/k_scale/rotary_scale"),
    "per-token cos/sin of several batch rows": (
        lambda: (_q(), None, dict(cos=torch.rand(2, 4, 8), sin=torch.rand(2, 4, 8))),
        "per-token cos rows with a batch dimension > 1"),
    "per-token angles of several batch rows": (lambda: (_q(), None, dict(angles=torch.rand(2, 4, 8))),
                                               "per-token angles rows with a batch dimension > 1"),
    "out_dtype": (lambda: (_q(), None, dict(out_dtype=torch.float64)), "out_dtype other than the inputs' dtype"),
    "float64 inputs": (lambda: (_q().double(), None, {}), "dtype torch.float64"),
    "tensors off the CPU": (lambda: (_q().to("meta"), None, {}), "tensors on meta"),
    "q requires grad": (lambda: (_q().requires_grad_(), None, {}), "autograd (q requires grad"),
    "k requires grad": (lambda: (_q(), _k().requires_grad_(), {}), "autograd (k requires grad"),
    "inv_freq requires grad": (lambda: (_q(), None, dict(inv_freq=torch.rand(8).requires_grad_())),
                               "autograd (inv_freq requires grad"),
    "cos requires grad": (lambda: (_q(), None, dict(cos=torch.rand(9, 8).requires_grad_(), sin=torch.rand(9, 8))),
                          "autograd (cos requires grad"),
    "full-width cos/sin whose halves differ": (lambda: (_q(), None, dict(cos=torch.rand(9, 16), sin=torch.rand(9, 16))),
                                               "full-width cos table whose neox halves differ"),
    "|inv_freq| >= 2**24": (lambda: (_q(), None, dict(inv_freq=torch.tensor([2.0**24] + [1.0] * 7))),
                            "inv_freq[0] = 16777216.0 (as float32): the WebGPU kernels need finite frequencies"),
}
# Every RopeSpec field is either carried out by the kernels or refused by a case above (a new field lands here).
SUPPORTED_FIELDS = {"inv_freq", "cos", "sin", "pos_offset", "style", "freq_mode", "conjugate"}
REFUSED_FIELDS = {"positions": "per-token positions", "seq_offsets": "per-sequence offsets",
                  "cu_seqlens": "cu_seqlens", "layout": "layout bhsd", "rotary_dim": "partial rotary",
                  "rotary_start": "rotary_at back", "table_by_token": "per-token cos/sin of several batch rows",
                  "q_scale": "q_scale", "k_scale": "k_scale", "rotary_scale": "rotary_scale",
                  "out_dtype": "out_dtype", "sections": "multi-axis positions",
                  "section_layout": "multi-axis positions"}


def test_every_spec_field_is_supported_or_refused():
    assert SUPPORTED_FIELDS | set(REFUSED_FIELDS) == set(RopeSpec._fields)
    assert not SUPPORTED_FIELDS & set(REFUSED_FIELDS) and set(REFUSED_FIELDS.values()) <= set(UNSUPPORTED)
    q, k = _q(), _k()
    assert unsupported(q, k, validate(q, k, positions=7)) == []


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_every_unsupported_option_is_refused_by_name(case):
    make, words = UNSUPPORTED[case]
    q, k, kwargs = make()
    with pytest.raises(ValueError, match=re.escape(words)):
        ropekit.apply_rope(q, k, backend="webgpu", **kwargs)
    # In place too, with q and k untouched (where validate lets an in-place call through at all).
    if q.device.type != "cpu" or "out_dtype" in kwargs or any(x.requires_grad for x in (q, k) if x is not None):
        return
    before = [x.clone() for x in (q, k) if x is not None]
    with pytest.raises(ValueError, match=re.escape(words)):
        ropekit.apply_rope_(q, k, backend="webgpu", **kwargs)
    assert all(torch.equal(x, b) for x, b in zip((q, k), before))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(angles="fast"), ValueError, "angles must be one of"),
    (dict(inv_freq=torch.ones(8), angles="shader_base"), ValueError, "leave inv_freq, cos and sin unset"),
    (dict(base=1e39, angles="shader_base"), ValueError, "float32's largest value"),
    (dict(base=0.5, angles="shader_base"), ValueError, "base must be a finite real number > 1"),
    (dict(pos_offset=-1), ValueError, "must be >= 0"),
    (dict(pos_offset=1.5), TypeError, "positions must be None, an int offset"),
    (dict(style="gptj"), ValueError, "style must be one of"),
    (dict(cos=torch.ones(2, 8), sin=torch.ones(2, 8), pos_offset=2), IndexError, "the cos/sin table has 2 rows"),
])
def test_runner_arguments_are_validated_as_apply_rope_does(runner, kwargs, error, message):
    with pytest.raises(error, match=message):
        runner.apply_rope(torch.randn(4, 2, 16), **kwargs)


def test_empty_inputs_unknown_kernels_and_timing(runner):
    q_out, k_out = ropekit.apply_rope(torch.randn(2, 0, 3, 8), torch.randn(2, 0, 1, 8), backend="webgpu")
    assert q_out.shape == (2, 0, 3, 8) and k_out.shape == (2, 0, 1, 8)
    with pytest.raises(ValueError, match="entry must name a kernel"):
        runner.dispatch("rope_v", np.ones((1, 1, 2), np.float32))
    with pytest.raises(ValueError, match="inv_freq .* is required by rope_freq"):
        runner.dispatch("rope_freq", np.ones((1, 1, 2), np.float32))
    with pytest.raises(ValueError, match="float16 array for rope_f16"):
        runner.dispatch("rope_f16", np.ones((1, 1, 2), np.float32))
    assert runner.kernel_seconds("rope_q", torch.randn(8, 2, 16).numpy(), repeats=3) >= 0.0


def test_check_rows_and_adapter_info(runner):
    info = webgpu.adapter_info()
    assert isinstance(info, str) and info
    rows = webgpu.check_rows()
    assert rows and all(set(r) == {"backend", "device", "case", "max_error", "tolerance", "passed"} for r in rows)
    failed = [r for r in rows if not r["passed"]]
    assert not failed, failed
    assert all(r["backend"] == "webgpu" and r["device"] == info for r in rows)


# ---------------------------------------------------------------------------------------------------------------
# Frequency range, autograd, inputs above one storage binding


@pytest.mark.parametrize("angles", ["shader", "host"])
def test_frequencies_the_kernels_cannot_rotate_raise(runner, angles):
    # The shader refuses |inv_freq| >= 2**24 (and NaN/inf) by writing NaN; the host must say so instead.
    q = torch.randn(1, 4, 2, 8)
    for bad in (2.0**24, -(2.0**25), 1e30, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"inv_freq\[2\] = .*\|inv_freq\| < 2\*\*24"):
            runner.apply_rope(q, inv_freq=torch.tensor([1.0, 0.5, bad, 0.25]), angles=angles)
    # Rounded to float32 it reaches 2**24: refused where the shader uses float32, fine in float64 host tables.
    near = torch.tensor([1.0, 0.5, 16777215.9, 0.25], dtype=torch.float64)
    if angles == "shader":
        with pytest.raises(ValueError, match="as float32"):
            runner.apply_rope(q, inv_freq=near, angles=angles)
    # The largest accepted float32 frequency rotates exactly (positions kept small: float64 reference angles).
    largest = torch.tensor([16777215.0, -16777215.0, 3.0, 2.0**-100])
    out = runner.apply_rope(q, inv_freq=largest, angles=angles)
    assert_close_to_ref(out, reference(q, style="neox", inv_freq=largest), torch.float32, TOL)


def test_the_largest_bases_the_shader_takes(runner):
    # angles="shader_base" uses base as f32 in the shader: up to float32's largest value.
    q = torch.randn(4, 2, 64)
    for base in (1e38, 3e38):
        assert not torch.isnan(runner.apply_rope(q, base=base, angles="shader_base")).any()


def test_abi_inputs_that_require_grad_raise_instead_of_detaching(runner):
    # (The public route's refusals are cases of UNSUPPORTED.) dispatch and kernel_seconds name their arguments.
    q = torch.randn(4, 2, 8)
    theta = torch.arange(4, dtype=torch.float32)[:, None] * default_inv_freq(10000.0, 8, CPU)
    calls = {
        "x": (lambda t: webgpu.dispatch("rope_q", t), q),
        "cos_sin": (lambda t: runner.kernel_seconds("rope_table", q.numpy(), cos_sin=t, repeats=2),
                    torch.stack([theta.cos(), theta.sin()], -1)),
    }
    for name, (call, value) in calls.items():
        with pytest.raises(ValueError, match=f"{name} requires grad.*does not support autograd"):
            call(value.clone().requires_grad_())
    # Without grad mode nothing can be expected to flow back: the tensor is simply read.
    with torch.no_grad():
        assert torch.equal(ropekit.apply_rope(q.clone().requires_grad_(), layout="thd", backend="webgpu"),
                           ropekit.apply_rope(q, layout="thd", backend="webgpu"))
        assert np.array_equal(webgpu.dispatch("rope_q", q.clone().requires_grad_()),
                              webgpu.dispatch("rope_q", q.numpy()))


@pytest.mark.parametrize("style, dtype, angles", [
    ("interleaved", torch.float32, "shader"), ("neox", torch.float32, "host"), ("neox", torch.float16, "shader"),
    ("interleaved", torch.float32, "shader_base"),
])
def test_inputs_above_the_binding_limit_run_in_blocks(runner, style, dtype, angles):
    # q and k are stacked as [S, B*HQ + B*HK = 18 rows, D]. A binding smaller than one token forces blocks of rows
    # (heads of batch rows) and of tokens; each block's positions (and host-table rows) must follow.
    B, S, HQ, HK, D, offset = 3, 7, 4, 2, 16, 100  # positions below 128: shader_base stays within its tolerance
    q, k = (torch.randn(B, S, h, D).to(dtype) for h in (HQ, HK))
    head_bytes = D * q.element_size()
    blocked = []
    saved = runner.max_binding_bytes
    try:
        for limit in (3 * head_bytes, 40 * head_bytes):  # 3 rows of 1 token; 2 whole tokens (36 rows)
            runner.max_binding_bytes = limit
            blocked.append(runner.apply_rope(q, k, pos_offset=offset, style=style, angles=angles))
    finally:
        runner.max_binding_bytes = saved
    q_whole, k_whole = runner.apply_rope(q, k, pos_offset=offset, style=style, angles=angles)
    for q_out, k_out in blocked:
        assert torch.equal(q_out, q_whole) and torch.equal(k_out, k_whole)
    want_q, want_k = ropekit.apply_rope(q.double(), k.double(), positions=offset, style=style)
    tol = BASE_KERNEL_TOL if angles == "shader_base" else TOL
    assert_close_to_ref(blocked[0][0], want_q, dtype, tol)
    assert_close_to_ref(blocked[0][1], want_k, dtype, tol)


def test_one_token_larger_than_the_default_binding_limit(runner):
    # [B, 1, H, D] decode step of 128 MiB + 32 KiB: more than wgpu's default 128 MiB storage binding in one token.
    heads = runner.max_binding_bytes // (1024 * 4) + 8
    x = torch.randn(1, 1, heads, 1024)
    out = ropekit.apply_rope(x, positions=5, backend="webgpu")
    assert torch.isfinite(out).all()
    for first in (0, runner.max_binding_bytes // (1024 * 4) - 4, heads - 4):  # both sides of the block boundary
        part = x[:, :, first:first + 8]
        assert torch.equal(out[:, :, first:first + 8], ropekit.apply_rope(part, positions=5, backend="webgpu"))
    ref = reference(x[:, :, -8:], style="neox", inv_freq=default_inv_freq(10000.0, 1024, CPU), pos_offset=5)
    assert_close_to_ref(out[:, :, -8:], ref, torch.float32, TOL)


# ---------------------------------------------------------------------------------------------------------------
# Native libraries: Mesa's LLVM (loaded when wgpu creates an adapter) and triton's LLVM in one process

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton installed")
ADD_ONE_KERNEL = """
import triton, triton.language as tl

@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + 1, mask=offsets < n)

ones = torch.zeros(8)
add_one[(1,)](ones, 8, BLOCK=8)
assert ones.tolist() == [1.0] * 8
"""
WEBGPU_CALL = """
import ropekit
assert ropekit.apply_rope(torch.randn(1, 4, 2, 8), positions=3, backend="webgpu").isfinite().all()
"""
ORDERS = {
    "webgpu, then import triton and run a kernel": WEBGPU_CALL + ADD_ONE_KERNEL,
    "import wgpu, then webgpu, then triton": "import wgpu\n" + WEBGPU_CALL + ADD_ONE_KERNEL,
    "a triton kernel, then webgpu": ADD_ONE_KERNEL + WEBGPU_CALL,
    "webgpu, then transformers' LlamaForCausalLM": WEBGPU_CALL + "from transformers import LlamaForCausalLM\n",
}


def run_fresh(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, after ``import torch``; Triton kernels run in its CPU interpreter."""
    return subprocess.run([sys.executable, "-c", "import torch\n" + code], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "TRITON_INTERPRET": "1"})


@needs_triton
@pytest.mark.parametrize("order", list(ORDERS))
def test_webgpu_and_triton_load_in_any_order(runner, order):
    # The crash was a SIGSEGV (exit -11 here, 139 in a shell) in libtriton.so's static constructors.
    if "transformers" in order and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers")
    result = run_fresh(ORDERS[order])
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-3000:]}"


@needs_triton
def test_an_adapter_created_before_ropekit_warns_instead_of_crashing(runner):
    # Mesa's LLVM is global before ropekit can load triton's: ropekit must not load it then (that crashes at once).
    result = run_fresh(textwrap.dedent("""
        import warnings, wgpu
        adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
        from ropekit import webgpu
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            webgpu.WebGPURunner(adapter)
        assert any("import triton" in str(w.message) for w in caught), [str(w.message) for w in caught]
    """))
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-3000:]}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_webgpu_runs_without_triton(runner):
    # triton unavailable (as if not installed): nothing of it is loaded, and WebGPU works.
    block_triton = 'import sys\nsys.modules["triton"] = None  # import raises ImportError, find_spec finds nothing\n'
    result = run_fresh(block_triton + WEBGPU_CALL + textwrap.dedent("""
        assert "libtriton" not in open("/proc/self/maps").read()
        try:
            import triton
        except ImportError:
            pass
        else:
            raise AssertionError("triton was importable")
    """))
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-3000:]}"
