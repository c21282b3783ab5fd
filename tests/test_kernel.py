"""The Triton kernel against the float64 reference.

Runs under ``TRITON_INTERPRET=1`` on CPU (CI) and compiled on CUDA. The launcher is called directly with
outputs poisoned with NaN, so any element it fails to write is caught.
"""

import pytest
import torch

import ropekit
from ropekit._spec import BACKWARD, FORWARD
from ropekit._validation import validate
from ropekit.reference import rope_reference
from ropekit.testing import assert_close_to_ref, make_qk, poisoned_like, tolerance
from ropekit.triton.launcher import launch_rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run_kernel(q, k, *, inplace=False, config=None, **kwargs):
    """(kernel outputs, float64 reference outputs) for one call; ``config`` overrides the launcher's block
    shape."""
    conjugate = kwargs.pop("conjugate", False)
    spec = validate(q, k, **kwargs, mode=BACKWARD if conjugate else FORWARD)
    on_cpu = [v.cpu() if isinstance(v, torch.Tensor) else v for v in spec]
    ref = rope_reference(q.cpu(), None if k is None else k.cpu(),
                         type(spec)(*on_cpu)._replace(out_dtype=torch.float64))
    if inplace:
        q_out, k_out = q, k
    else:
        q_out = poisoned_like(q)
        k_out = None if k is None else poisoned_like(k)
    launch_rope(q, k, q_out, k_out, spec, config=config)
    return ([q_out] if k is None else [q_out, k_out]), ref


def _freqs(P, R, dtype=torch.float32, full=False):
    inv_freq = 10000.0 ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    angles = torch.outer(torch.arange(P, dtype=torch.float64), inv_freq)
    if full:
        angles = torch.cat([angles, angles], -1)
    return angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE), angles.to(DEVICE)


def _dev(t):
    return t.to(DEVICE)


# (id, B, S, HQ, HK, D, dtype, kwargs); tensors in kwargs are created lazily (callables) on the test device.
CASES = [
    ("neox-base-offset", 2, 5, 4, 2, 16, torch.float32, dict(positions=3)),
    ("interleaved-base", 2, 5, 4, 2, 16, torch.float32, dict(style="interleaved", positions=7)),
    ("neox-bf16", 2, 6, 4, 2, 32, torch.bfloat16, dict(positions=100)),
    ("interleaved-fp16", 2, 6, 4, 2, 32, torch.float16, dict(style="interleaved", positions=100)),
    ("interleaved-bf16-back", 1, 4, 3, 1, 24, torch.bfloat16, dict(style="interleaved", rotary_dim=8,
                                                                    rotary_at="back")),
    ("bhsd", 2, 5, 4, 2, 16, torch.float32, dict(layout="bhsd", positions=2)),
    ("sbhd", 2, 5, 4, 2, 16, torch.float32, dict(layout="sbhd", positions=2)),
    ("thd", 1, 9, 4, 2, 16, torch.float32, dict(layout="thd")),
    ("per-seq-offsets", 3, 4, 2, 2, 16, torch.float32, dict(positions=lambda: _dev(torch.tensor([0, 9, 1000])))),
    ("per-token-int32", 2, 6, 3, 1, 16, torch.float32,
     dict(positions=lambda: _dev(torch.randint(0, 5000, (2, 6), dtype=torch.int32)))),
    ("per-token-broadcast", 2, 6, 3, 1, 16, torch.float32,
     dict(positions=lambda: _dev(torch.randperm(6)[None]))),
    ("thd-per-token", 1, 7, 2, 2, 16, torch.float32,
     dict(layout="thd", positions=lambda: _dev(torch.randint(0, 50, (7,))))),
    ("varlen", 1, 10, 3, 1, 16, torch.bfloat16,
     dict(layout="thd", cu_seqlens=lambda: _dev(torch.tensor([0, 3, 4, 4, 10], dtype=torch.int32)))),
    ("varlen-offsets", 1, 10, 3, 1, 16, torch.float32,
     dict(layout="thd", cu_seqlens=lambda: _dev(torch.tensor([0, 3, 4, 10])),
          positions=lambda: _dev(torch.tensor([7, 0, 20])))),
    ("table-half-fp32", 2, 5, 4, 2, 16, torch.float32,
     dict(positions=lambda: _dev(torch.randint(0, 40, (2, 5))), cos=lambda: _freqs(40, 16)[0],
          sin=lambda: _freqs(40, 16)[1])),
    ("table-half-bf16", 2, 5, 4, 2, 16, torch.bfloat16,
     dict(positions=3, cos=lambda: _freqs(40, 16, torch.bfloat16)[0],
          sin=lambda: _freqs(40, 16, torch.bfloat16)[1])),
    ("table-full-interleaved", 2, 5, 2, 2, 16, torch.float32,
     dict(style="interleaved", cos=lambda: _freqs(8, 16, full=True)[0].repeat_interleave(1, -1),
          sin=lambda: _freqs(8, 16, full=True)[1])),
    ("hf-per-token-unequal-halves", 2, 5, 4, 2, 16, torch.float16,
     dict(cos=lambda: _dev(torch.randn(2, 5, 16)), sin=lambda: _dev(torch.randn(2, 5, 16)))),
    ("hf-per-token-broadcast-batch", 2, 5, 4, 2, 16, torch.bfloat16,
     dict(cos=lambda: _dev(torch.randn(1, 5, 16)).to(torch.bfloat16),
          sin=lambda: _dev(torch.randn(1, 5, 16)).to(torch.bfloat16))),
    ("angles", 2, 5, 4, 2, 16, torch.float32, dict(positions=2, angles=lambda: _freqs(30, 16)[2] * 1000)),
    ("angles-full-back", 1, 5, 2, 2, 24, torch.float16,
     dict(angles=lambda: _freqs(5, 8, full=True)[2], rotary_dim=8, rotary_at="back")),
    ("partial-front-nonpow2", 2, 3, 3, 2, 20, torch.float32, dict(rotary_dim=12, q_scale=0.5)),
    ("partial-back-mla", 1, 4, 4, 1, 48, torch.bfloat16, dict(rotary_dim=16, rotary_at="back", q_scale=0.125)),
    ("scales", 2, 4, 4, 2, 16, torch.float32, dict(q_scale=0.125, k_scale=2.0, rotary_scale=1.3)),
    ("conjugate", 2, 4, 4, 2, 16, torch.bfloat16, dict(conjugate=True, positions=11, style="interleaved")),
    ("mqa", 2, 4, 8, 1, 16, torch.float32, dict()),
    ("odd-heads", 2, 3, 5, 3, 16, torch.float32, dict(positions=1)),
    ("head-dim-256", 1, 2, 2, 1, 256, torch.bfloat16, dict(positions=5)),
    ("head-dim-64-interleaved", 1, 3, 4, 2, 64, torch.float32, dict(style="interleaved")),
    ("rotary-dim-2", 1, 3, 2, 1, 8, torch.float32, dict(rotary_dim=2)),
    # head strides not divisible by 16: the kernel takes them in units of 8 / 4 elements (launcher.stride_unit)
    ("head-dim-72-bf16", 1, 6, 4, 2, 72, torch.bfloat16, dict(positions=9)),
    ("head-dim-72-fp32-bhsd", 2, 3, 3, 1, 72, torch.float32, dict(layout="bhsd", style="interleaved")),
]


def _materialise(kwargs):
    return {k: (v() if callable(v) else v) for k, v in kwargs.items()}


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_reference(case):
    _, B, S, HQ, HK, D, dtype, kwargs = case
    kwargs = _materialise(kwargs)
    q, k = make_qk(B, S, HQ, HK, D, dtype=dtype, device=DEVICE, layout=kwargs.get("layout", "bshd"))
    outs, refs = run_kernel(q, k, **kwargs)
    for out, ref in zip(outs, refs):
        assert_close_to_ref(out, ref, dtype)


@pytest.mark.interpreter
def test_q_only():
    q, _ = make_qk(2, 3, 4, 1, 16, device=DEVICE)
    (out,), (ref,) = run_kernel(q, None, positions=4)
    assert_close_to_ref(out, ref, torch.float32)


@pytest.mark.interpreter
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_in_place_partial_rotary(scale):
    q, k = make_qk(2, 3, 4, 2, 24, dtype=torch.bfloat16, device=DEVICE)
    q0 = q.clone()
    outs, refs = run_kernel(q, k, inplace=True, rotary_dim=8, q_scale=scale)
    assert outs[0] is q
    for out, ref in zip(outs, refs):
        assert_close_to_ref(out, ref, torch.bfloat16)
    if scale == 1.0:  # the untouched tail keeps its exact bits
        assert torch.equal(q[..., 8:], q0[..., 8:])


@pytest.mark.interpreter
def test_packed_qkv_views_are_rotated_without_copies():
    B, S, HQ, HK, D = 2, 5, 4, 2, 16
    qkv = torch.randn(B, S, HQ + 2 * HK, D, device=DEVICE)
    v_before = qkv[:, :, HQ + HK:].clone()
    q, k = qkv[:, :, :HQ], qkv[:, :, HQ:HQ + HK]
    assert not q.is_contiguous()
    want, refs = run_kernel(q.clone(), k.clone(), positions=3)
    outs, _ = run_kernel(q, k, inplace=True, positions=3)
    assert outs[0].data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qkv[:, :, :HQ], want[0], rtol=0, atol=0)
    torch.testing.assert_close(qkv[:, :, HQ:HQ + HK], want[1], rtol=0, atol=0)
    assert torch.equal(qkv[:, :, HQ + HK:], v_before)
    assert_close_to_ref(want[0], refs[0], torch.float32)


@pytest.mark.interpreter
def test_invalid_positions_become_nan_not_out_of_bounds():
    # Device path without check_positions: a position past the table marks its token NaN, other tokens exact.
    cos, sin, _ = _freqs(6, 16)
    q, k = make_qk(1, 4, 2, 1, 16, device=DEVICE)
    pos = _dev(torch.tensor([[0, 5, 6, 1]]))
    n = validate(q, k, positions=pos, cos=cos, sin=sin) if DEVICE == "cuda" else None
    if n is None:  # on CPU the API refuses; drive the launcher with what the API would pass on a device
        n = validate(q, k, positions=_dev(torch.tensor([[0, 5, 5, 1]])), cos=cos, sin=sin)
        n.positions.copy_(pos)
    q_out, k_out = poisoned_like(q), poisoned_like(k)
    launch_rope(q, k, q_out, k_out, n)
    assert torch.isnan(q_out[0, 2]).all() and torch.isnan(k_out[0, 2]).all()
    assert not torch.isnan(q_out[0, [0, 1, 3]]).any()


@pytest.mark.interpreter
def test_exact_angles_at_large_positions():
    # fp32 inputs, positions up to 2**24: the float64-formed, reduced angle keeps the error near 1e-7.
    D = 128
    q, k = make_qk(1, 8, 2, 1, D, device=DEVICE)
    pos = _dev(torch.tensor([[0, 1, 4095, 65537, 2**20 + 3, 2**23 - 1, 2**24 - 7, 2**24]]))
    outs, refs = run_kernel(q, k, positions=pos)
    scale = refs[0].abs().max().item()
    err = max((o.double().cpu() - r).abs().max().item() for o, r in zip(outs, refs))
    assert err <= 2e-6 * scale, err


@pytest.mark.interpreter
def test_conjugate_undoes_forward_in_kernel():
    q, k = make_qk(2, 4, 4, 2, 32, device=DEVICE)
    (qr, kr), _ = run_kernel(q, k, positions=123, style="interleaved")
    (qb, kb), _ = run_kernel(qr, kr, positions=123, style="interleaved", conjugate=True)
    torch.testing.assert_close(qb, q, **tolerance(torch.float32)._asdict())
    torch.testing.assert_close(kb, k, **tolerance(torch.float32)._asdict())


def test_launch_cache_key_covers_every_argument(monkeypatch):
    # The cached-launch key classifies each kernel's arguments by name; every runtime argument has one class.
    from ropekit.triton import launcher, prologue_launcher, runtime

    seen = {}
    monkeypatch.setattr(runtime, "run", lambda call: seen.setdefault(call.roles.fn, call.args))
    q, k = make_qk(1, 2, 2, 1, 8)
    run_kernel(q, k, positions=torch.tensor([[3, 4]]))
    w = torch.ones(8)
    prologue_launcher.launch_prologue(q, k, torch.empty_like(q), torch.empty_like(k), validate(q, k, positions=3),
                                      q_weight=w, k_weight=w)
    prologue_launcher.launch_norm_rope_bwd(q, q, k, k, validate(q, k, positions=3), w, w, 0.0, 1e-6)
    assert len(seen) == 3
    for roles in (launcher.ROPE, prologue_launcher.PROLOGUE, prologue_launcher.NORM_ROPE_BWD):
        args = seen[roles.fn]
        assert len(args) == len(roles.fn.arg_names) - len(roles.constexprs)
        assert all(isinstance(args[i], torch.Tensor) for i in roles.pointers)
        ints = {i for i, a in enumerate(args) if isinstance(a, int)}
        assert ints == set(roles.ints) | {roles.index["pos_offset"]}
        floats = {i for i, a in enumerate(args) if isinstance(a, float)}
        assert len(args) == len(ints) + len(floats) + len(roles.pointers)


def test_launch_cache_holds_one_entry_per_compiled_variant():
    # Keyed on what Triton specialises on, not on values: 100 sequence lengths of one class share one entry.
    from ropekit.triton import launcher

    def key(S):
        q, k = make_qk(1, S, 2, 1, 8)
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        grid, args, constexprs, nw = launcher.kernel_launch(q, k, qo, ko, validate(q, k, inv_freq=torch.ones(4)))
        return launcher.ROPE.key(args, constexprs, nw, None)

    assert len({key(S) for S in range(17, 400, 4)}) == 1  # odd lengths: no stride or count divisible by 16
    assert key(16) != key(17)


@pytest.mark.gpu
def test_launch_cache_holds_one_entry_per_variant_on_cuda():
    from ropekit.triton import runtime

    ropekit.apply_rope(torch.randn(1, 17, 4, 64, device="cuda"), positions=torch.randint(0, 9, (1, 17),
                                                                                          device="cuda"))
    before = len(runtime.compiled_kernels())
    for S in range(19, 400, 2):  # packed training with varying lengths: odd counts share one variant
        ids = torch.randint(0, 9, (1, S), device="cuda")
        ropekit.apply_rope(torch.randn(1, S, 4, 64, device="cuda"), positions=ids)
    assert len(runtime.compiled_kernels()) <= before + 2


def test_stride_unit_is_what_every_row_stride_shares_up_to_16_bytes():
    """1 where Triton already knows (every stride divisible by 16), else the largest power of two, at most 16
    bytes of the widest element, dividing every row stride (dims 0-2 of the [B, S, H, D] views) of every
    tensor."""
    from ropekit.triton.launcher import stride_unit

    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype)

    assert stride_unit(t(2, 5, 4, 128), t(2, 5, 4, 128)) == 1
    assert stride_unit(t(1, 6, 4, 72)) == 8  # head stride 72 = 8 * 9
    assert stride_unit(t(1, 6, 4, 72, dtype=torch.float32)) == 4  # 16 bytes of fp32
    assert stride_unit(t(1, 6, 4, 72), t(1, 6, 4, 72, dtype=torch.float32)) == 4  # bf16 in, fp32 out
    assert stride_unit(t(1, 6, 4, 36)) == 4
    assert stride_unit(t(1, 6, 4, 7, dtype=torch.float32)) == 1
    assert stride_unit(t(1, 64, 3, 16, 72)[:, :, 0]) == 8  # q of a fused qkv ([B, S, H, D]): tokens 3456 apart
    assert stride_unit(t(1, 6, 4, 72).expand(3, 6, 4, 72)) == 8  # a stride of 0 shares every unit


def test_block_config_shapes():
    """The heuristic's programs: one token of 8 heads at D 128 (2 KB), 64 B per thread; 16 B per thread for
    streaming calls on large grids and for decode grids, and half the heads per program for the smallest ones."""
    from ropekit.triton.heuristics import block_config

    sms4 = 4 * 132
    assert block_config(32768, 32, 8, 128, 2, sms4) == (1, 8, 8, 1)
    assert block_config(32768, 32, 8, 128, 2, sms4, stream=True) == (1, 8, 8, 4)
    assert block_config(32768, 32, 8, 128, 4, sms4, stream=True) == (1, 8, 8, 8)  # fp32: 4 KB, 16 B per thread
    assert block_config(256, 32, 8, 128, 2, sms4, stream=True) == (1, 8, 8, 1)  # small grid: no streaming shape
    assert block_config(16, 32, 8, 128, 2, sms4) == (1, 8, 8, 4)  # decode, 80 programs: 16 B per thread
    assert block_config(64, 64, 8, 128, 2, sms4) == (1, 8, 8, 4)  # 576 programs: still latency-bound
    # the smallest decode grids of 2-byte calls with angles from the kernel (small_grid: at most 88 programs with
    # half the heads): half the heads, same warps
    assert block_config(1, 32, 8, 128, 2, sms4, small_grid=True) == (1, 4, 4, 4)
    assert block_config(8, 32, 8, 128, 2, sms4, small_grid=True) == (1, 4, 4, 4)  # 80 programs
    assert block_config(9, 32, 8, 128, 2, sms4, small_grid=True) == (1, 8, 8, 4)  # 90 would be too many
    assert block_config(8, 28, 4, 128, 2, sms4, small_grid=True) == (1, 4, 4, 4)  # Qwen2-VL, 64 programs
    assert block_config(16, 28, 4, 128, 2, sms4, small_grid=True) == (1, 8, 4, 4)  # 128 programs
    assert block_config(1, 16, 8, 256, 2, sms4, small_grid=True) == (1, 2, 2, 4)
    assert block_config(1, 2, 1, 128, 2, sms4, small_grid=True) == (1, 2, 1, 1)  # already under half a tile
    assert block_config(1, 1, 1, 2048, 2, sms4, small_grid=True) == (1, 1, 1, 8)  # a head per program already
    assert block_config(27, 32, 8, 128, 2, sms4, pair_axes=True, small_grid=True) == (1, 8, 8, 2)  # fills the SMs
    bt, bq, bk, warps = block_config(16384, 16, 16, 64, 2, sms4)
    assert (bt, bq, bk) == (1, 16, 16) and warps == 1
    # full-width cos/sin tables: 16 B per thread and at least 8 heads per program (head_dim 256: 8, not 4)
    assert block_config(32768, 32, 8, 128, 2, sms4, full_table=True) == (1, 8, 8, 4)
    assert block_config(32768, 16, 8, 256, 2, sms4, full_table=True) == (1, 8, 8, 8)
    assert block_config(32768, 16, 16, 64, 2, sms4, full_table=True) == (1, 16, 16, 4)
    assert block_config(64, 16, 8, 256, 2, sms4, full_table=True) == (1, 4, 4, 4)  # decode keeps its shape
    # interleaved M-RoPE: 32 B per thread once a decode grid has a program on two thirds of the SMs (88 of 132),
    # or on every SM (132) up to 32 tokens in 2 bytes (a constant axis stride); 8 B below that where the small-grid
    # shape does not apply, neither past decode
    assert block_config(8, 32, 8, 128, 2, sms4, pair_axes=True, small_grid=True) == (1, 4, 4, 4)  # small grid
    assert block_config(8, 32, 8, 128, 2, sms4, pair_axes=True) == (1, 8, 8, 8)  # 40 programs, not small_grid
    assert block_config(9, 32, 8, 128, 2, sms4, pair_axes=True, small_grid=True) == (1, 8, 8, 8)  # 45 programs
    constant = dict(pair_axes=True, axis_stride_constant=True)  # what kernel_launch passes up to 32 tokens
    assert block_config(18, 32, 8, 128, 2, sms4, small_grid=True, **constant) == (1, 8, 8, 8)  # 90 programs
    assert block_config(18, 32, 8, 128, 2, sms4, pair_axes=True, small_grid=True) == (1, 8, 8, 2)  # runtime stride
    assert block_config(26, 32, 8, 128, 2, sms4, **constant) == (1, 8, 8, 8)  # 130 programs
    assert block_config(27, 32, 8, 128, 2, sms4, **constant) == (1, 8, 8, 2)  # 135 programs
    assert block_config(32, 32, 8, 128, 2, sms4, **constant) == (1, 8, 8, 2)  # 160 programs
    assert block_config(14, 64, 8, 128, 2, sms4, **constant) == (1, 8, 8, 8)  # 126 programs
    assert block_config(15, 64, 8, 128, 2, sms4, **constant) == (1, 8, 8, 2)  # 135 programs
    assert block_config(64, 8, 8, 128, 2, sms4, pair_axes=True) == (1, 8, 8, 2)  # 128 programs, runtime stride
    assert block_config(18, 32, 8, 128, 2, sms4, axis_stride_constant=True) == (1, 8, 8, 4)  # 1-D or contiguous
    assert block_config(17, 32, 8, 128, 4, sms4, **constant) == (1, 8, 8, 8)  # fp32 keeps the 88 programs
    assert block_config(18, 32, 8, 128, 4, sms4, **constant) == (1, 8, 8, 4)
    assert block_config(128, 32, 8, 128, 2, sms4, pair_axes=True) == (1, 8, 8, 2)
    assert block_config(256, 32, 8, 128, 2, sms4, pair_axes=True) == block_config(256, 32, 8, 128, 2, sms4)
    assert block_config(32, 32, 8, 128, 2, sms4) == (1, 8, 8, 4)  # the rule is M-RoPE's alone


@pytest.mark.parametrize("tokens, interleaved_warps", [(16, "more"), (24, "more"), (32, "fewer")])
def test_kernel_launch_gives_interleaved_sections_their_decode_shape(monkeypatch, tokens, interleaved_warps):
    """``kernel_launch`` asks for the interleaved-sections shape for interleaved M-RoPE only: on a 132-SM card,
    more warps than the contiguous and 1-D calls (which share theirs) at 16 and 24 decode tokens, fewer at 32."""
    from ropekit.triton import heuristics, launcher

    monkeypatch.setattr(heuristics, "num_programs_wanted", lambda device: 4 * 132)
    q, k = make_qk(tokens, 1, 32, 8, 128, dtype=torch.bfloat16)
    positions = torch.randint(0, 100, (3, tokens, 1))

    def warps(**kw):
        return launcher.kernel_launch(q, k, torch.empty_like(q), torch.empty_like(k), validate(q, k, **kw))[3]

    one_d = warps(positions=positions[0].clone())
    contiguous = warps(positions=positions, sections=(24, 20, 20))
    interleaved = warps(positions=positions, sections=(24, 20, 20), section_layout="interleaved")
    assert contiguous == one_d, (one_d, contiguous)
    assert (interleaved > contiguous if interleaved_warps == "more" else interleaved < contiguous), (contiguous,
                                                                                                    interleaved)


def test_kernel_launch_takes_the_small_grid_shape_for_2_byte_computed_angles(monkeypatch):
    """``kernel_launch`` halves the heads of one-token decode programs (heuristics.SMALL_GRID_SM_FRACTION) on a
    132-SM card for bf16/fp16 calls whose angles the kernel computes (1-D or multi-axis positions, inv_freq), not
    for fp32 or cos/sin tables, where it measured slower, nor for per-token angles (not measured)."""
    from ropekit.triton import heuristics, launcher

    monkeypatch.setattr(heuristics, "num_programs_wanted", lambda device: 4 * 132)
    positions = torch.randint(0, 100, (3, 1, 1))
    cos = torch.rand(1, 1, 128)

    def heads_and_warps(dtype, **kw):
        q, k = make_qk(1, 1, 32, 8, 128, dtype=dtype)
        _, _, named, warps = launcher.rope_arguments(q, k, torch.empty_like(q), torch.empty_like(k),
                                                     validate(q, k, **kw))
        return named["BLOCK_HQ"], named["BLOCK_HK"], warps

    for dtype in (torch.bfloat16, torch.float16):
        assert heads_and_warps(dtype, positions=positions[0]) == (4, 4, 4)
        assert heads_and_warps(dtype, positions=positions, sections=(24, 20, 20), section_layout="interleaved") \
            == (4, 4, 4)
        assert heads_and_warps(dtype, positions=positions[0], inv_freq=torch.rand(64)) == (4, 4, 4)
        assert heads_and_warps(dtype, cos=cos.to(dtype), sin=cos.to(dtype)) == (8, 8, 4)  # full-width tables
        assert heads_and_warps(dtype, cos=cos[..., :64].to(dtype), sin=cos[..., :64].to(dtype)) == (8, 8, 4)
        assert heads_and_warps(dtype, angles=torch.rand(1, 1, 64)) == (8, 8, 4)  # per-token angles, loaded
    assert heads_and_warps(torch.float32, positions=positions[0]) == (8, 8, 8)


SMALL_GRID_CASES = [
    ("1d-bf16", torch.bfloat16, dict(positions=lambda: _dev(torch.randint(0, 1 << 20, (1, 1))))),
    ("interleaved-fp16", torch.float16, dict(positions=lambda: _dev(torch.randint(0, 1 << 20, (3, 1, 1))),
                                             sections=(24, 20, 20), section_layout="interleaved")),
    ("contiguous-bf16", torch.bfloat16, dict(positions=lambda: _dev(torch.randint(0, 1 << 20, (3, 1, 1))),
                                             sections=(16, 24, 24))),
]


@pytest.mark.parametrize("case", SMALL_GRID_CASES, ids=[c[0] for c in SMALL_GRID_CASES])
def test_small_grid_shape_equals_the_8_head_shape(case):
    """The small-grid decode shape (4 heads a program, 2 pairs a thread) gives the 8-head shape's bits, and both
    match the float64 reference: one token of Qwen3-VL-8B's 32/8 heads, fresh inputs on each of two calls."""
    _, dtype, kwargs = case
    for _call in range(2):
        kw = _materialise(kwargs)
        q, k = make_qk(1, 1, 32, 8, 128, dtype=dtype, device=DEVICE)
        small, refs = run_kernel(q, k, config=(1, 4, 4, 4), base=5e6, **kw)
        wide, _ = run_kernel(q, k, config=(1, 8, 8, 4), base=5e6, **kw)
        for got, want, ref in zip(small, wide, refs):
            assert torch.equal(got, want)
            assert_close_to_ref(got, ref, dtype)


def test_norm_kernels_block_shapes_on_large_grids():
    """Norm launches on a CUDA device never take the streaming shape: qk_norm_rope's forward with range positions
    2 tokens x 16 heads x 4 warps, its backward 16 heads x 2 warps, cache writes and gathered positions the plain
    default (heuristics.norm_block_config); decode grids keep the latency shape."""
    from ropekit.triton import heuristics

    big = (16384, 32, 8, 128, 2, 4 * 132)
    assert heuristics.norm_block_config(*big, "forward") == (2, 16, 8, 4)
    assert heuristics.norm_block_config(*big, "backward") == (1, 16, 8, 2)
    assert heuristics.norm_block_config(*big, "default") == (1, 8, 8, 1)
    assert heuristics.block_config(*big, stream=True) == (1, 8, 8, 4)  # what a range-position launch would stream
    assert heuristics.norm_block_config(64, 32, 8, 128, 2, 4 * 132, "default") == (1, 8, 8, 4)  # latency-bound
    # pass-through columns: the default shapes, the backward with twice the warps (its third accumulator spills
    # registers at 32 elements per thread; test_compile_targets checks the spill count)
    assert heuristics.norm_block_config(*big, "forward", partial=True) == (1, 8, 8, 1)
    assert heuristics.norm_block_config(*big, "backward", partial=True) == (1, 8, 8, 2)


def test_full_table_block_rule_is_for_cuda_only():
    """CPU runs (the interpreter) keep the launcher's own large programs with full-width tables too."""
    from ropekit.triton import heuristics, kernel, launcher

    q, k = torch.randn(2, 5, 7, 256), torch.randn(2, 5, 2, 256)
    angles = torch.rand(5, 256)
    spec = validate(q, k, cos=angles.cos(), sin=angles.sin())  # full width: a value per column
    _, args, constexprs, _ = launcher.kernel_launch(q, k, torch.empty_like(q), torch.empty_like(k), spec)
    named = dict(zip(kernel.rope_kernel.arg_names, (*args, *constexprs)))
    plain = heuristics.block_config(10, 7, 2, 256, 4, 1, heuristics.INTERPRETER_TILE_BYTES)
    assert (named["BLOCK_T"], named["BLOCK_HQ"], named["BLOCK_HK"]) == plain[:3]


def test_prologue_launch_picks_its_block_shape_by_norm_cache_and_positions():
    """launch_prologue's choice on a CUDA device (prologue_launcher.prologue_block_config, evaluated for CPU tensors
    with an H100's programs wanted): the norm's shapes only with a norm, the larger forward shape only without a
    cache and with range positions, the latency shape for decode grids."""
    from ropekit.triton import prologue_launcher

    wanted = 4 * 132
    q, k = torch.empty(4, 4096, 32, 128, dtype=torch.bfloat16), torch.empty(4, 4096, 8, 128, dtype=torch.bfloat16)
    ranged = validate(q, k, base=1e6)
    gathered = validate(q, k, positions=torch.zeros(4, 4096, dtype=torch.long), base=1e6)

    def pick(spec, norm, cache, q=q, k=k):
        return prologue_launcher.prologue_block_config(q, k, spec, norm=norm, cache=cache, min_programs=wanted)

    assert pick(ranged, norm=True, cache=False) == (2, 16, 8, 4)
    assert pick(gathered, norm=True, cache=False) == (1, 8, 8, 1)
    assert pick(ranged, norm=True, cache=True) == (1, 8, 8, 1)  # not the streaming (1, 8, 8, 4)
    assert pick(ranged, norm=False, cache=True) is None  # the launcher decides (it may stream)
    qd, kd = q[:, :1], k[:, :1]  # decode: one token per sequence
    assert pick(validate(qd, kd, base=1e6), norm=True, cache=True, q=qd, k=kd) == (1, 4, 4, 4)


def _spec_for(q):
    """The spec of a full rotation of ``q`` with unit frequencies, built without validating ``q`` (whose batch
    dimension has no memory behind it)."""
    return validate(torch.zeros(1, 1, 1, 2), None, inv_freq=torch.ones(1))


def test_launcher_refuses_2_to_the_31_tokens_before_launching():
    q = torch.zeros(1, 1, 1, 2).expand(2**31, 1, 1, 2)  # no memory behind the batch dimension
    with pytest.raises(ValueError, match="2\\*\\*31"):
        launch_rope(q, None, q, None, _spec_for(q))


def test_token_blocks_past_grid_axis_limit_are_split_evenly(monkeypatch):
    # More token blocks than CUDA's second grid axis holds: they go over axes 1 and 2, wasting at most n_z - 1.
    from ropekit.triton import heuristics, runtime

    seen = {}
    monkeypatch.setattr(runtime, "run", lambda call: seen.update(grid=call.grid))
    for tokens in (65535, 65536, 131071, 200003):
        q = torch.zeros(1, 1, 1, 2).expand(tokens, 1, 1, 2)  # no memory behind the batch dimension
        launch_rope(q, None, q, None, _spec_for(q), config=(1, 1, 1, 1))
        n_heads, n_y, n_z = seen["grid"]
        assert n_heads == 1 and n_y <= heuristics.MAX_GRID_Y
        assert tokens <= n_y * n_z < tokens + n_z


@pytest.mark.gpu
def test_token_blocks_over_two_grid_axes_on_cuda():
    # One token per program and more tokens than grid axis 1 holds: programs on axis 2 rotate the right tokens,
    # and the ones past the end write nothing.
    T = 3 * 65535 + 7
    q = torch.randn(T, 1, 1, 8, device="cuda")
    pos = torch.randint(0, 1 << 16, (T, 1), device="cuda")
    spec = validate(q, None, positions=pos)
    out = torch.full((T + 64, 1, 1, 8), float("nan"), device="cuda")
    launch_rope(q, None, out[:T], None, spec, config=(1, 1, 1, 1))
    ref = rope_reference(q.cpu(), None, validate(q.cpu(), None, positions=pos.cpu())._replace(
        out_dtype=torch.float64))[0]
    assert_close_to_ref(out[:T], ref, torch.float32)
    assert torch.isnan(out[T:]).all()


PARTIAL_BLOCK_CASES = [
    ("per-seq-offsets", 5, 1, dict(positions=lambda: _dev(torch.tensor([3, 0, 70, 9, 1])))),
    ("per-token", 1, 7, dict(positions=lambda: _dev(torch.randint(0, 500, (1, 7), dtype=torch.int32)))),
    ("varlen", 1, 7, dict(layout="thd", cu_seqlens=lambda: _dev(torch.tensor([0, 2, 7], dtype=torch.int32)),
                          positions=lambda: _dev(torch.tensor([5, 40])))),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", PARTIAL_BLOCK_CASES, ids=[c[0] for c in PARTIAL_BLOCK_CASES])
def test_partial_token_blocks_match_reference(case):
    """Four tokens per program over 5 or 7 tokens: the last program's missing tokens load no positions (their
    indices run past the positions tensor) and store nothing. Under a memory checker with one allocation per
    tensor, any read past the positions is reported."""
    _, B, S, kwargs = case
    kwargs = _materialise(kwargs)
    q, k = make_qk(B, S, 4, 2, 16, device=DEVICE, layout=kwargs.get("layout", "bshd"))
    outs, refs = run_kernel(q, k, config=(4, 4, 2, 1), **kwargs)
    for out, ref in zip(outs, refs):
        assert_close_to_ref(out, ref, torch.float32)
