"""WebGPU backend: the WGSL kernels through wgpu, against the float64 reference.

Runs on whatever adapter wgpu finds (CI: llvmpipe over OpenGL, or lavapipe with mesa-vulkan-drivers); skips
without wgpu or an adapter. Inputs are fresh N(0, 1) values; kernels rotate in place, so coverage is checked with
rotations that move every element (a quarter turn) and a sentinel tail past the data.
"""

import math
import re

import numpy as np
import pytest
import torch

wgpu = pytest.importorskip("wgpu", reason="the WebGPU backend needs wgpu: pip install 'ropekit[webgpu]'")

import ropekit.webgpu as webgpu  # noqa: E402
from helpers import assert_close_to_ref  # noqa: E402
from ropekit.api import default_inv_freq  # noqa: E402
from ropekit.reference import rope_reference  # noqa: E402

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


@pytest.fixture(scope="module")
def runner():
    try:
        return webgpu.default_runner()
    except RuntimeError as exc:
        pytest.skip(f"no WebGPU adapter: {exc}")


def exact_inv_freq(base, D):
    return base ** -(torch.arange(0, D, 2, dtype=torch.float64) / D)


def reference(x, *, style="interleaved", inv_freq, pos_offset=0, conjugate=False):
    """float64 rotation of x ([S, H, D] or [B, S, H, D])."""
    x4 = x.unsqueeze(0) if x.ndim == 3 else x
    out = rope_reference(x4, None, layout="bshd", style=style, freq_mode="inv_freq", rotary_dim=x.shape[-1],
                         rotary_start=0, inv_freq=inv_freq, pos_offset=pos_offset, conjugate=conjugate,
                         out_dtype=torch.float64)[0]
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
                for st in webgpu.STYLES for so in ("base", "freq", "table") for f16 in (False, True)
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
    assert_close_to_ref(torch.from_numpy(q_out), reference(q, inv_freq=inv_freq, pos_offset=offset),
                        torch.float32, BASE_KERNEL_TOL)
    assert_close_to_ref(torch.from_numpy(k_out), reference(k, inv_freq=inv_freq, pos_offset=offset),
                        torch.float32, BASE_KERNEL_TOL)
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
    # apply_rope rotates q and k in one dispatch; q.k then depends only on the distance between positions.
    for angles in webgpu.ANGLE_MODES:
        q_rot, k_rot = webgpu.apply_rope(q, k, pos_offset=7, angles=angles)
        assert torch.equal(k_rot, q_rot[:, 1:4])
    q_far, k_far = webgpu.apply_rope(q, k, pos_offset=7 + 123456)
    q_rot, k_rot = webgpu.apply_rope(q, k, pos_offset=7)
    scores = torch.einsum("shd,thd->hst", q_rot[:, 1:4].double(), k_rot.double())
    scores_far = torch.einsum("shd,thd->hst", q_far[:, 1:4].double(), k_far.double())
    torch.testing.assert_close(scores_far, scores, rtol=0, atol=5e-5)


# ---------------------------------------------------------------------------------------------------------------
# apply_rope against the float64 reference


@pytest.mark.parametrize("style", webgpu.STYLES)
@pytest.mark.parametrize("angles", ["shader", "host"])
@pytest.mark.parametrize("base", [10000.0, 500000.0, 1e6])
def test_matches_reference_with_gqa(runner, style, angles, base):
    B, S, D = 2, 24, 64
    q = torch.randn(B, S, 8, D)
    for hk in (1, 2, 8):
        k = torch.randn(B, S, hk, D)
        q_out, k_out = webgpu.apply_rope(q, k, pos_offset=3, base=base, style=style, angles=angles)
        inv_freq = default_inv_freq(base, D, torch.device("cpu"))
        assert_close_to_ref(q_out, reference(q, style=style, inv_freq=inv_freq, pos_offset=3), torch.float32, TOL)
        assert_close_to_ref(k_out, reference(k, style=style, inv_freq=inv_freq, pos_offset=3), torch.float32, TOL)


@pytest.mark.parametrize("angles", ["shader", "host"])
def test_long_context_positions_stay_exact(runner, angles):
    # Tokens straddling 2**k for k up to 20 (and far beyond for in-shader angles, which are exact below 2**32).
    D, S = 128, 16
    inv_freq = default_inv_freq(500000.0, D, torch.device("cpu"))
    powers = (4, 8, 12, 16, 20) + ((24, 28, 31) if angles == "shader" else ())
    for power in powers:
        offset = 2**power - S // 2
        x = torch.randn(S, 2, D)
        out = webgpu.apply_rope(x, pos_offset=offset, base=500000.0, style="neox", angles=angles)
        assert_close_to_ref(out, reference(x, style="neox", inv_freq=inv_freq, pos_offset=offset), torch.float32,
                            TOL)


@pytest.mark.parametrize("style", webgpu.STYLES)
def test_given_inv_freq_is_used(runner, style):
    D = 32
    inv_freq = torch.rand(D // 2) * 2.0  # a scaled table, some frequencies above 1
    x = torch.randn(2, 20, 3, D)
    ref = reference(x, style=style, inv_freq=inv_freq, pos_offset=99991)
    for angles in ("shader", "host"):
        out = webgpu.apply_rope(x, pos_offset=99991, inv_freq=inv_freq, style=style, angles=angles)
        assert_close_to_ref(out, ref, torch.float32, TOL)


@pytest.mark.parametrize("style", webgpu.STYLES)
def test_cos_sin_tables_of_transformers_shape(runner, style):
    S, D, offset = 12, 16, 30
    inv_freq = default_inv_freq(10000.0, D, torch.device("cpu"))
    theta = torch.arange(64, dtype=torch.float64)[:, None] * inv_freq.double()
    full = torch.cat([theta, theta], -1) if style == "neox" else theta.repeat_interleave(2, -1)
    x = torch.randn(S, 4, D)
    ref = reference(x, style=style, inv_freq=inv_freq, pos_offset=offset)
    for cos, sin in ((theta.cos(), theta.sin()), (full.cos()[None], full.sin()[None])):
        out = webgpu.apply_rope(x, cos=cos.float(), sin=sin.float(), pos_offset=offset, style=style)
        assert_close_to_ref(out, ref, torch.float32, TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("style, D", [("interleaved", 64), ("neox", 64), ("neox", 6)])
def test_half_precision_inputs(runner, dtype, style, D):
    # fp16 stays packed on the device (neox needs D % 4 == 0, else it is rotated in f32); bf16 goes through f32.
    x = torch.randn(2, 16, 4, D).to(dtype)
    out = webgpu.apply_rope(x, pos_offset=1000, style=style)
    ref = reference(x, style=style, inv_freq=default_inv_freq(10000.0, D, torch.device("cpu")), pos_offset=1000)
    assert_close_to_ref(out, ref, dtype, TOL)


@pytest.mark.parametrize("style", webgpu.STYLES)
@pytest.mark.parametrize("angles", webgpu.ANGLE_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_undoes_forward(runner, style, angles, dtype):
    x = torch.randn(3, 20, 4, 32).to(dtype)
    y = webgpu.apply_rope(x, pos_offset=50000, style=style, angles=angles)
    back = webgpu.apply_rope(y, pos_offset=50000, style=style, angles=angles, conjugate=True)
    if dtype == torch.float32:
        torch.testing.assert_close(back, x, rtol=0, atol=4e-6)
    else:  # two f16 roundings, each up to an ulp of the pair's norm (< 8 here)
        torch.testing.assert_close(back, x, rtol=0, atol=2.0**-7)
    ref = reference(y, style=style, inv_freq=default_inv_freq(10000.0, 32, torch.device("cpu")),
                    pos_offset=50000, conjugate=True)
    if angles != "shader_base":
        assert_close_to_ref(back, ref, dtype, TOL)


@pytest.mark.parametrize("angles", webgpu.ANGLE_MODES)
def test_pos_offset_equals_a_slice_of_a_longer_run(runner, angles):
    x = torch.randn(1, 64, 3, 32)
    q, k = x[:, :, :2], x[:, :, 2:]
    q_full, k_full = webgpu.apply_rope(q, k, pos_offset=1000, angles=angles)
    q_part, k_part = webgpu.apply_rope(q[:, 40:], k[:, 40:], pos_offset=1040, angles=angles)
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
        for per_dim, binding_bytes in ((saved[0], saved[1]), (square, saved[1]), (saved[0], 5 * H * D * x.itemsize)):
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


# ---------------------------------------------------------------------------------------------------------------
# Host API: types, shapes, errors


def test_types_shapes_and_inputs_untouched(runner):
    q = torch.randn(2, 10, 4, 16)
    k = torch.randn(2, 10, 1, 16)
    q_copy, k_copy = q.clone(), k.clone()
    q_out, k_out = webgpu.apply_rope(q, k, pos_offset=5)
    assert torch.equal(q, q_copy) and torch.equal(k, k_copy)
    assert isinstance(q_out, torch.Tensor) and q_out.shape == q.shape and k_out.shape == k.shape
    out_np = webgpu.apply_rope(q[0].numpy(), pos_offset=5)
    assert isinstance(out_np, np.ndarray) and out_np.dtype == np.float32 and out_np.shape == (10, 4, 16)
    assert np.array_equal(out_np, q_out[0].numpy())
    half = webgpu.apply_rope(q[0].half().numpy())
    assert isinstance(half, np.ndarray) and half.dtype == np.float16


@pytest.mark.parametrize("kwargs, message", [
    (dict(q=torch.randn(4, 2, 7)), "even head_dim"),
    (dict(q=torch.randn(4, 8)), "3 or 4 dimensions"),
    (dict(q=torch.randn(4, 2, 8, dtype=torch.float64)), "float32, float16 or bfloat16"),
    (dict(q=torch.randn(4, 2, 8), k=torch.randn(5, 2, 8)), "k must match q"),
    (dict(q=torch.randn(4, 2, 8), k=torch.randn(4, 2, 8).numpy()), "same kind of array"),
    (dict(q=torch.randn(4, 2, 8), style="gptj"), "style must be one of"),
    (dict(q=torch.randn(4, 2, 8), angles="fast"), "angles must be one of"),
    (dict(q=torch.randn(4, 2, 8), pos_offset=-1), "pos_offset"),
    (dict(q=torch.randn(4, 2, 8), pos_offset=2**32 - 2), "pos_offset"),
    (dict(q=torch.randn(4, 2, 8), inv_freq=torch.ones(3)), "inv_freq must have head_dim/2 = 4"),
    (dict(q=torch.randn(4, 2, 8), inv_freq=torch.ones(4), angles="shader_base"), "leave inv_freq unset"),
    (dict(q=torch.randn(4, 2, 8), cos=torch.ones(4, 4)), "cos and sin must be given together"),
    (dict(q=torch.randn(4, 2, 8), cos=torch.ones(5, 4), sin=torch.ones(5, 4), pos_offset=2), "has 5 rows"),
    (dict(q=torch.randn(4, 2, 8), cos=torch.rand(4, 8), sin=torch.rand(4, 8)), "repeat its"),
    (dict(q=torch.randn(4, 2, 8), base=0.0), "base must be"),
])
def test_invalid_arguments_raise(runner, kwargs, message):
    with pytest.raises(ValueError, match=message):
        webgpu.apply_rope(**kwargs)


def test_empty_inputs_unknown_kernels_and_timing(runner):
    q_out, k_out = webgpu.apply_rope(torch.randn(2, 0, 3, 8), torch.randn(2, 0, 1, 8))
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


# ------------------------------------------------------------------------ ropekit.apply_rope(..., backend="webgpu")

@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_public_api_backend_webgpu_matches_the_default_backend(runner, style):
    import ropekit

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


@pytest.mark.parametrize("kwargs, match", [
    (dict(positions=torch.tensor([1, 2])), "positions tensor"),
    (dict(rotary_dim=8), "rotary_dim < head_dim"),
    (dict(q_scale=0.5), "q_scale"),
    (dict(layout="bhsd"), "layout='bhsd'"),
    (dict(backend="metal"), "backend must be"),
])
def test_public_api_backend_webgpu_refuses_what_it_cannot_do(kwargs, match):
    import ropekit

    q = torch.randn(2, 4, 3, 16)
    before = q.clone()
    with pytest.raises(ValueError, match=match):
        ropekit.apply_rope_(q, **{"backend": "webgpu", **kwargs})
    assert torch.equal(q, before)
