"""The float64 reference (ropekit's CPU path) against RoPE written out in other conventions, and RoPE's
mathematical properties.

Each formula is written out here independently of ropekit (loops, 2x2 rotation matrices, even/odd or
real/imaginary halves, cuDNN's raw angles), in float64, and compared within the float64 tolerance of
:data:`ropekit.testing.TOLERANCES`.
"""

import math

import pytest
import torch

import ropekit
from ropekit.testing import tolerance

F64 = tolerance(torch.float64, "cpu")._asdict()


def _interleaved_by_loops(x_shd: torch.Tensor, pos_offset: int, base: float) -> torch.Tensor:
    """x [S, H, D]; pair (2i, 2i+1) rotated by (s + pos_offset) * base^(-2i/D), one element at a time."""
    S, H, D = x_shd.shape
    out = x_shd.clone()
    for s in range(S):
        for i in range(D // 2):
            angle = (s + pos_offset) * base ** (-2 * i / D)
            c, sn = math.cos(angle), math.sin(angle)
            q0, q1 = x_shd[s, :, 2 * i], x_shd[s, :, 2 * i + 1]
            out[s, :, 2 * i] = q0 * c - q1 * sn
            out[s, :, 2 * i + 1] = q0 * sn + q1 * c
    return out


@pytest.mark.parametrize("base", [10000.0, 500000.0, 1e6])
def test_interleaved_matches_loop_formula_with_pos_offset_and_gqa(base):
    S, HQ, HK, D, offset = 7, 6, 2, 16, 11
    q = torch.randn(S, HQ, D, dtype=torch.float64)
    k = torch.randn(S, HK, D, dtype=torch.float64)
    # fp64 inv_freq so that the comparison isolates the rotation, not fp32 rounding of base**x
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    q_rot, k_rot = ropekit.apply_rope(q, k, positions=offset, inv_freq=inv_freq, style="interleaved", layout="thd")
    torch.testing.assert_close(q_rot, _interleaved_by_loops(q, offset, base), **F64)
    torch.testing.assert_close(k_rot, _interleaved_by_loops(k, offset, base), **F64)


def test_backward_matches_loop_formula_of_inverse_rotation():
    S, H, D = 5, 3, 8
    g = torch.randn(S, H, D, dtype=torch.float64)
    inv_freq = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    got = ropekit.rope_backward(g, positions=2, inv_freq=inv_freq, style="interleaved", layout="thd")
    want = g.clone()
    for s in range(S):
        for i in range(D // 2):
            a = (s + 2) * inv_freq[i].item()
            c, sn = math.cos(a), math.sin(a)
            g0, g1 = g[s, :, 2 * i], g[s, :, 2 * i + 1]
            want[s, :, 2 * i] = g0 * c + g1 * sn
            want[s, :, 2 * i + 1] = g1 * c - g0 * sn
    torch.testing.assert_close(got, want, **F64)


def test_even_odd_stack_formula_matches_angles_mode():
    # x [batch, seq, dim], x1 = even dims, x2 = odd dims, stacked (x1 c - x2 s, x1 s + x2 c).
    batch, S, D = 3, 6, 10
    x = torch.randn(batch, S, D, dtype=torch.float64)
    theta = torch.randn(S, D // 2, dtype=torch.float64) * 4
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = torch.cos(theta), torch.sin(theta)
    want = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    got = ropekit.apply_rope(x.unsqueeze(2), angles=theta, style="interleaved").squeeze(2)
    torch.testing.assert_close(got, want, **F64)


def test_single_vector_matches_2x2_rotation_matrices():
    # One vector q at position m, viewed as (d/2, 2) pairs, each multiplied by [[c, -s], [s, c]].
    d, m = 12, 37
    q = torch.randn(d, dtype=torch.float64)
    thetas = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    a = m * thetas
    rot = torch.stack([torch.stack([a.cos(), -a.sin()], 1), torch.stack([a.sin(), a.cos()], 1)], 1)
    want = torch.einsum("bij,bj->bi", rot, q.view(-1, 2)).flatten()
    got = ropekit.apply_rope(q.view(1, 1, 1, d), positions=m, inv_freq=thetas, style="interleaved").flatten()
    torch.testing.assert_close(got, want, **F64)


def test_rope_dim_at_back_with_output_scale_matches_cudnn_formula():
    # cuDNN's convention: BHSD, raw angles [S, rope_dim] (duplicated halves), last rope_dim dims rotated (NeoX),
    # leading dims scaled pass-through, whole output times output_scale; backward = -theta, same scale.
    B, H, S, D, R, alpha = 2, 3, 5, 12, 8, 0.125
    x = torch.randn(B, H, S, D, dtype=torch.float64)
    half_angles = torch.rand(S, R // 2, dtype=torch.float64) * 20
    freqs = torch.cat([half_angles, half_angles], dim=-1)
    nope, rot = x[..., : D - R], x[..., D - R:]
    lo, hi = rot[..., : R // 2], rot[..., R // 2:]
    c, s = half_angles.cos(), half_angles.sin()
    want = alpha * torch.cat([nope, lo * c - hi * s, hi * c + lo * s], dim=-1)
    got = ropekit.apply_rope(x, angles=freqs, layout="bhsd", rotary_dim=R, rotary_at="back", q_scale=alpha)
    torch.testing.assert_close(got, want, **F64)
    dy = torch.randn_like(x)
    dx = ropekit.rope_backward(dy, angles=freqs, layout="bhsd", rotary_dim=R, rotary_at="back", q_scale=alpha)
    # <dy, f(x)> == <f^T(dy), x> for the linear map f
    torch.testing.assert_close((dy * got).sum(), (dx * x).sum(), **F64)


def test_neox_real_imag_halves_formula_with_offset():
    # X [N, S, H, D], halves (real, imag), freqs 10000^(-i/(D/2)), positions offset..offset+S-1.
    N, S, H, D, offset = 2, 9, 3, 16, 5
    X = torch.randn(N, S, H, D, dtype=torch.float64)
    half = D // 2
    pos = torch.arange(offset, offset + S, dtype=torch.float64)
    freqs = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = torch.outer(pos, freqs)
    c, s = angles.cos().reshape(1, S, 1, half), angles.sin().reshape(1, S, 1, half)
    real, imag = X[..., :half], X[..., half:]
    want = torch.cat([real * c - imag * s, imag * c + real * s], dim=-1)
    got = ropekit.apply_rope(X, positions=offset, inv_freq=freqs, style="neox")
    torch.testing.assert_close(got, want, **F64)


# ---------------------------------------------------------------------------------------------------- properties

@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_conjugate_undoes_forward_and_norms_preserved(style):
    q = torch.randn(2, 7, 3, 16, dtype=torch.float64)
    rot = ropekit.apply_rope(q, positions=torch.tensor([4, 1000]), style=style)
    back = ropekit.rope_backward(rot, positions=torch.tensor([4, 1000]), style=style)
    torch.testing.assert_close(back, q, **F64)
    if style == "neox":
        pairs_in = q[..., :8] ** 2 + q[..., 8:] ** 2
        pairs_out = rot[..., :8] ** 2 + rot[..., 8:] ** 2
    else:
        pairs_in = q[..., 0::2] ** 2 + q[..., 1::2] ** 2
        pairs_out = rot[..., 0::2] ** 2 + rot[..., 1::2] ** 2
    torch.testing.assert_close(pairs_out, pairs_in, **F64)
    assert not torch.allclose(rot, q)  # it did rotate


@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_dot_product_depends_only_on_position_difference(style):
    D = 32
    q = torch.randn(1, 1, 1, D, dtype=torch.float64)
    k = torch.randn(1, 1, 1, D, dtype=torch.float64)

    def dot(m, n):
        qm = ropekit.apply_rope(q, positions=m, style=style)
        kn = ropekit.apply_rope(k, positions=n, style=style)
        return (qm * kn).sum().item()

    for m, n in [(3, 1), (100, 40), (7, 7)]:
        for shift in (1, 17, 4096):
            assert dot(m + shift, n + shift) == pytest.approx(dot(m, n), rel=1e-9, abs=1e-9)
    assert dot(5, 1) != pytest.approx(dot(5, 2), rel=1e-3)


def test_offset_run_equals_slice_of_full_run():
    q = torch.randn(2, 20, 4, 16, dtype=torch.float64)
    full = ropekit.apply_rope(q)
    part = ropekit.apply_rope(q[:, 6:], positions=6)
    torch.testing.assert_close(part, full[:, 6:], rtol=0, atol=0)


def test_batch_invariance_and_per_sequence_offsets():
    q = torch.randn(3, 5, 2, 8, dtype=torch.float64)
    offsets = torch.tensor([0, 9, 2])
    both = ropekit.apply_rope(q, positions=offsets)
    for b in range(3):
        alone = ropekit.apply_rope(q[b:b + 1], positions=int(offsets[b]))
        torch.testing.assert_close(both[b:b + 1], alone, rtol=0, atol=0)


def test_varlen_equals_separate_sequences():
    lengths = [3, 1, 6]
    cu = torch.tensor([0, 3, 4, 10])
    x = torch.randn(10, 4, 16, dtype=torch.float64)
    offsets = torch.tensor([5, 0, 2])
    packed = ropekit.apply_rope(x, layout="thd", cu_seqlens=cu, positions=offsets)
    plain = ropekit.apply_rope(x, layout="thd", cu_seqlens=cu)
    for i, n in enumerate(lengths):
        seg = x[cu[i]:cu[i + 1]]
        assert seg.shape[0] == n
        torch.testing.assert_close(packed[cu[i]:cu[i + 1]], ropekit.apply_rope(seg, layout="thd",
                                                                               positions=int(offsets[i])))
        torch.testing.assert_close(plain[cu[i]:cu[i + 1]], ropekit.apply_rope(seg, layout="thd"))


def test_per_token_positions_any_order_equal_gather_of_full_run():
    q = torch.randn(2, 16, 3, 8, dtype=torch.float64)
    perm = torch.stack([torch.randperm(16), torch.randperm(16)])
    full = ropekit.apply_rope(q)
    # Token (b, s) placed at position perm[b, s]: same as rotating the token at that position in a full run.
    gathered = ropekit.apply_rope(torch.gather(q, 1, perm[..., None, None].expand(2, 16, 3, 8)), positions=perm)
    want = torch.gather(full, 1, perm[..., None, None].expand(2, 16, 3, 8))
    torch.testing.assert_close(gathered, want, rtol=0, atol=0)


def test_layouts_agree():
    x = torch.randn(2, 6, 3, 8, dtype=torch.float64)  # bshd
    want = ropekit.apply_rope(x, positions=3)
    torch.testing.assert_close(ropekit.apply_rope(x.permute(0, 2, 1, 3), layout="bhsd", positions=3),
                               want.permute(0, 2, 1, 3), rtol=0, atol=0)
    torch.testing.assert_close(ropekit.apply_rope(x.permute(1, 0, 2, 3), layout="sbhd", positions=3),
                               want.permute(1, 0, 2, 3), rtol=0, atol=0)
    torch.testing.assert_close(ropekit.apply_rope(x[1], layout="thd", positions=3), want[1], rtol=0, atol=0)


@pytest.mark.parametrize("rotary_at", ["front", "back"])
def test_partial_rotary_passes_the_rest_through_scaled(rotary_at):
    x = torch.randn(2, 5, 3, 24, dtype=torch.float64)
    out = ropekit.apply_rope(x, rotary_dim=8, rotary_at=rotary_at, q_scale=0.5, positions=3)
    rot, keep = (slice(0, 8), slice(8, 24)) if rotary_at == "front" else (slice(16, 24), slice(0, 16))
    torch.testing.assert_close(out[..., keep], 0.5 * x[..., keep], rtol=0, atol=0)
    torch.testing.assert_close(out[..., rot], 0.5 * ropekit.apply_rope(x[..., rot].contiguous(), positions=3),
                               **F64)


def test_tables_inv_freq_and_angles_agree():
    D, P = 16, 40
    inv_freq = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.outer(torch.arange(P, dtype=torch.float64), inv_freq)
    x = torch.randn(2, 8, 3, D, dtype=torch.float64)
    a = ropekit.apply_rope(x, positions=20, inv_freq=inv_freq)
    b = ropekit.apply_rope(x, positions=20, cos=angles.cos(), sin=angles.sin())
    c = ropekit.apply_rope(x, positions=20, angles=angles)
    d = ropekit.apply_rope(x, positions=20, cos=torch.cat([angles.cos()] * 2, -1), sin=torch.cat([angles.sin()] * 2,
                                                                                                  -1))
    for other in (b, c, d):
        torch.testing.assert_close(other, a, **F64)


def test_rotary_scale_scales_only_rotated_columns():
    x = torch.randn(1, 4, 2, 16, dtype=torch.float64)
    out = ropekit.apply_rope(x, rotary_dim=8, rotary_scale=1.5)
    plain = ropekit.apply_rope(x, rotary_dim=8)
    torch.testing.assert_close(out[..., :8], 1.5 * plain[..., :8], **F64)
    torch.testing.assert_close(out[..., 8:], x[..., 8:], rtol=0, atol=0)
