"""``qk_norm_rope(..., norm_over="hidden")``: the diffusion transformers' QK-norm over each token's whole hidden
dimension (WAN 2.x, FLUX.2: weight [H * D]) before a per-head multi-axis (frame/height/width) RoPE, with the V copy
they fuse, against a float64 oracle written from the definition, on every route; gradients, bad input, batch
invariance and torch.compile."""

from __future__ import annotations

import pytest
import torch

import ropekit
from helpers import ROUTE_BACKENDS, ROUTES, angles64, assert_close_to_ref, on_route, rotate64, same_bits

SECTIONS = (4, 2, 2)  # pairs turning with frame, height, width (D = 16: 8 pairs)


def _inputs(device, dtype, B=2, S=3, H=3, Hk=3, D=16, requires_grad=False):
    q = torch.randn(B, S, H, D, dtype=torch.float64).to(device=device, dtype=dtype)
    k = torch.randn(B, S, Hk, D, dtype=torch.float64).to(device=device, dtype=dtype)
    qw = (1.0 + 0.3 * torch.randn(H * D, dtype=torch.float64)).to(device=device, dtype=dtype)
    kw = (1.0 + 0.3 * torch.randn(Hk * D, dtype=torch.float64)).to(device=device, dtype=dtype)
    pos = torch.randint(0, 20, (3, B, S), device=device)  # [axes, B, S]: frame, height, width
    if requires_grad:
        for t in (q, k, qw, kw):
            t.requires_grad_(True)
    return q, k, qw, kw, pos


def _oracle(x, w, pos, eps=1e-6, weight_offset=0.0, rotary_dim=None, style="neox"):
    """float64: x / sqrt(mean(x**2 over the token's H * D values) + eps) * (w + offset), then each head rotated
    by the 3-axis angles (contiguous sections)."""
    x = x.cpu().double()
    B, S, H, D = x.shape
    ms = x.reshape(B, S, H * D).pow(2).mean(-1)[..., None, None]
    y = x * torch.rsqrt(ms + eps) * (w.cpu().double() + weight_offset).reshape(H, D)
    ang = angles64(pos, rotary_dim or D, sections=SECTIONS if rotary_dim is None else (2, 1, 1))
    return rotate64(y, ang.cos(), ang.sin(), style=style, rotary_dim=rotary_dim)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hk", [3, 1], ids=["mha", "gqa"])
def test_matches_the_float64_definition(route, dtype, Hk):
    with on_route(route) as device:
        q, k, qw, kw, pos = _inputs(device, dtype, Hk=Hk)
        v = torch.randn(2, 3, Hk, 16, dtype=torch.float32, device=device).transpose(1, 2).contiguous().transpose(1, 2)
        q_out, k_out, v_out = ropekit.qk_norm_rope(q, k, qw, kw, positions=pos, sections=SECTIONS,
                                                   norm_over="hidden", v=v)
    backend = ROUTE_BACKENDS[route]
    assert q_out.dtype == dtype and k_out.dtype == dtype and v_out.dtype == dtype
    assert_close_to_ref(q_out, _oracle(q, qw, pos), dtype, backend)
    assert_close_to_ref(k_out, _oracle(k, kw, pos), dtype, backend)
    assert v_out.is_contiguous() and v_out.shape == v.shape and v_out.data_ptr() != v.data_ptr()
    assert_close_to_ref(v_out, v.double(), dtype, backend)  # a cast: one rounding (the interpreter truncates)
    if dtype == torch.float32:
        assert torch.equal(v_out, v)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", ["stride0", "stride2"])
def test_v_with_a_strided_last_dim_is_copied_by_value(route, kind):
    """v may have any strides: an expand()ed last dim (stride 0) or every other column of a wider buffer (stride
    2) is copied value for value into a new contiguous tensor, and the buffer it views is left as it was."""
    with on_route(route) as device:
        q, k, qw, kw, pos = _inputs(device, torch.float32, Hk=1)
        if kind == "stride0":
            v = torch.randn(2, 3, 1, 1, device=device).expand(2, 3, 1, 16)
        else:
            v = torch.randn(2, 3, 1, 32, device=device)[..., ::2]
        base = v._base.clone()
        v_out = ropekit.qk_norm_rope(q, k, qw, kw, positions=pos, sections=SECTIONS, norm_over="hidden", v=v)[2]
    assert v_out.is_contiguous() and torch.equal(v_out, v) and torch.equal(v._base, base)


@pytest.mark.parametrize("route", ROUTES)
def test_partial_rotary_offset_and_interleaved(route):
    with on_route(route) as device:
        q, k, qw, kw, pos = _inputs(device, torch.float32)
        q_out, k_out = ropekit.qk_norm_rope(q, k, qw - 1.0, kw - 1.0, positions=pos, sections=(2, 1, 1),
                                            rotary_dim=8, weight_offset=1.0, eps=1e-5, style="interleaved",
                                            norm_over="hidden")
    for out, x, w in ((q_out, q, qw), (k_out, k, kw)):
        ref = _oracle(x, w - 1.0, pos, eps=1e-5, weight_offset=1.0, rotary_dim=8, style="interleaved")
        assert_close_to_ref(out, ref, torch.float32, ROUTE_BACKENDS[route])


def test_float64_inputs_give_the_float64_definition():
    q, k, qw, kw, pos = _inputs("cpu", torch.float64)
    q_out, k_out = ropekit.qk_norm_rope(q, k, qw, kw, positions=pos, sections=SECTIONS, norm_over="hidden")
    assert q_out.dtype == torch.float64
    torch.testing.assert_close(q_out, _oracle(q, qw, pos), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k_out, _oracle(k, kw, pos), rtol=1e-12, atol=1e-12)


def test_head_norm_with_v_copies_v_beside_the_per_head_op():
    q, k, _, _, pos = _inputs("cpu", torch.float32)
    qw, kw = torch.rand(16) + 0.5, torch.rand(16) + 0.5
    v = torch.randn_like(k, dtype=torch.float64)
    q_out, k_out, v_out = ropekit.qk_norm_rope(q, k, qw, kw, positions=pos, sections=SECTIONS, v=v)
    q_ref, k_ref = ropekit.qk_norm_rope(q, k, qw, kw, positions=pos, sections=SECTIONS)
    assert same_bits(q_out, q_ref) and same_bits(k_out, k_ref)
    assert v_out.dtype == torch.float32 and torch.equal(v_out, v.float())


@pytest.mark.parametrize("route", ROUTES)
def test_gradients_match_float64_autograd_of_the_definition(route):
    with on_route(route) as device:
        q, k, qw, kw, pos = _inputs(device, torch.float32, Hk=1, requires_grad=True)
        v = torch.randn(2, 3, 1, 16, device=device, requires_grad=True)
        q_out, k_out, v_out = ropekit.qk_norm_rope(q, k, qw, kw, positions=pos, sections=SECTIONS,
                                                   norm_over="hidden", v=v)
        gq, gk, gv = torch.randn_like(q_out), torch.randn_like(k_out), torch.randn_like(v_out)
        torch.autograd.backward((q_out, k_out, v_out), (gq, gk, gv))
    leaves = [t.detach().cpu().double().requires_grad_(True) for t in (q, k, qw, kw)]
    ref_q, ref_k = _oracle(leaves[0], leaves[2], pos), _oracle(leaves[1], leaves[3], pos)
    torch.autograd.backward((ref_q, ref_k), (gq.cpu().double(), gk.cpu().double()))
    for got, ref in zip((q, k, qw, kw), leaves):
        torch.testing.assert_close(got.grad.cpu().double(), ref.grad, rtol=1e-4, atol=1e-5)
    assert torch.equal(v.grad, gv)


@pytest.mark.parametrize("route", ROUTES)
def test_a_tokens_bits_do_not_depend_on_its_batch(route):
    with on_route(route) as device:
        q, k, qw, kw, pos = _inputs(device, torch.bfloat16, B=3, S=5, H=4, Hk=2)
        full = ropekit.qk_norm_rope(q, k, qw, kw, positions=pos, sections=SECTIONS, norm_over="hidden")
        b, s = 1, 3
        one = ropekit.qk_norm_rope(q[b:b + 1, s:s + 1].clone(), k[b:b + 1, s:s + 1].clone(), qw, kw,
                                   positions=pos[:, b:b + 1, s:s + 1].clone(), sections=SECTIONS, norm_over="hidden")
    for f, o in zip(full, one):
        assert same_bits(f[b:b + 1, s:s + 1], o)


def test_bad_input_names_the_argument():
    q, k, qw, kw, pos = _inputs("cpu", torch.float32)
    kwargs = dict(positions=pos, sections=SECTIONS)
    with pytest.raises(ValueError, match="q_weight"):
        ropekit.qk_norm_rope(q, k, qw[:16], kw, norm_over="hidden", **kwargs)
    with pytest.raises(ValueError, match="k_weight"):
        ropekit.qk_norm_rope(q, k, qw, kw[:-1], norm_over="hidden", **kwargs)
    with pytest.raises(ValueError, match="norm_over"):
        ropekit.qk_norm_rope(q, k, qw, kw, norm_over="token", **kwargs)
    with pytest.raises(ValueError, match="v must"):
        ropekit.qk_norm_rope(q, k, qw, kw, norm_over="hidden", v=k[:, :2], **kwargs)
    with pytest.raises(ValueError, match="out_dtype"):
        ropekit.qk_norm_rope(q, k, qw, kw, norm_over="hidden", out_dtype=torch.float8_e4m3fn, **kwargs)
    with pytest.raises(ValueError, match="eps"):
        ropekit.qk_norm_rope(q, k, qw, kw, norm_over="hidden", eps=0.0, **kwargs)
    with pytest.raises(ValueError, match="q_weight"):  # the per-head op still wants [D]
        ropekit.qk_norm_rope(q, k, qw, kw, v=k, **kwargs)


@pytest.mark.parametrize("route", ROUTES)
def test_compiles_fullgraph_to_the_eager_bits(route):
    torch._dynamo.reset()
    with on_route(route) as device:
        q, k, qw, kw, pos = _inputs(device, torch.float32, requires_grad=True)
        v = torch.randn_like(k)

        def f(q, k, qw, kw, pos, v):
            return ropekit.qk_norm_rope(q, k, qw, kw, positions=pos, sections=SECTIONS, norm_over="hidden", v=v)

        eager = f(q, k, qw, kw, pos, v)
        compiled = torch.compile(f, fullgraph=True)(q, k, qw, kw, pos, v)
        grads = torch.autograd.grad(compiled[0].sum() + compiled[1].sum(), (q, k, qw, kw))
        grads_eager = torch.autograd.grad(eager[0].sum() + eager[1].sum(), (q, k, qw, kw))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, grads_eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("route", ROUTES[1:])
def test_the_kernel_writes_every_element_of_poisoned_outputs(route):
    """One launch over NaN-filled outputs (q, k, v's copy; interleaved pairs, partial rotary, GQA) leaves no NaN
    and matches the torch path."""
    from ropekit._validation import validate
    from ropekit.triton.hidden_norm_launcher import launch_hidden_norm_rope

    with on_route(route) as device:
        q, k, qw, kw, pos = _inputs(device, torch.float32, H=5, Hk=2)
        v = torch.randn_like(k, dtype=torch.bfloat16)
        spec = validate(q, k, positions=pos, sections=(2, 1, 1), rotary_dim=8, style="interleaved")
        outs = [torch.full_like(q, float("nan")), torch.full_like(k, float("nan")),
                torch.full_like(v, float("nan"), dtype=torch.float32)]
        launch_hidden_norm_rope(q, k, outs[0], outs[1], spec, qw, kw, 0.0, 1e-6, v=v, v_out=outs[2])
    assert not any(o.isnan().any() for o in outs)
    want = ropekit.qk_norm_rope(q.cpu(), k.cpu(), qw.cpu(), kw.cpu(), positions=pos.cpu(), sections=(2, 1, 1),
                                rotary_dim=8, style="interleaved", norm_over="hidden", v=v.cpu())
    for got, ref in zip(outs, want):  # the torch path is itself within the table of the definition
        assert_close_to_ref(got, ref.double(), torch.float32, ROUTE_BACKENDS[route])


def test_warps_grow_with_the_hidden_size():
    from ropekit.triton.hidden_norm_launcher import hidden_num_warps, hidden_tokens_and_warps

    assert hidden_num_warps(4, 16) == 2 and hidden_num_warps(24, 128) == 4 and hidden_num_warps(40, 128) == 8
    # tokens per program fill a tile of HIDDEN_TILE_VALUES: FLUX's 24 heads pad to 32, WAN-14B's 40 to 64
    assert hidden_tokens_and_warps(32, 128) == (8, 8) and hidden_tokens_and_warps(64, 128) == (4, 8)
    assert hidden_tokens_and_warps(4, 16) == (8, 2)


@pytest.mark.parametrize("route", ROUTES[1:])
@pytest.mark.parametrize("tokens_and_warps", [(1, 4), (2, 4), (4, 2), None], ids=["t1", "t2", "t4", "default"])
def test_same_bits_whatever_tokens_a_program_takes(route, tokens_and_warps):
    """The launch shape (tokens a program holds, its warps) changes no bit of q, k or v's copy: each token's norm
    is its own fixed tree. Poisoned outputs; 7 tokens, so the last token block is partial for every shape."""
    from ropekit._validation import validate
    from ropekit.triton.hidden_norm_launcher import launch_hidden_norm_rope

    with on_route(route) as device:
        q, k, qw, kw, pos = _inputs(device, torch.bfloat16, B=1, S=7, H=3, Hk=2)
        v = torch.randn_like(k)
        spec = validate(q, k, positions=pos, sections=SECTIONS, style="interleaved")
        runs = []
        for shape in ((1, 4), tokens_and_warps):
            outs = [torch.full_like(t, float("nan")) for t in (q, k, v)]
            launch_hidden_norm_rope(q, k, outs[0], outs[1], spec, qw, kw, 0.0, 1e-6, v=v, v_out=outs[2],
                                    tokens_and_warps=shape)
            runs.append(outs)
    assert not any(o.isnan().any() for o in runs[1])
    for one, other in zip(*runs):
        assert same_bits(one, other)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [24, 40], ids=["flux-24x128", "wan14b-40x128"])
def test_model_hidden_sizes_on_cuda(heads):
    """FLUX's 3072 and WAN-14B's 5120 hidden sizes (D = 128, 3-D sections as WAN's 22/21/21 pairs) on the GPU:
    the float64 definition, gradients' finiteness, and one token's bits alone vs. inside the batch."""
    D, sections = 128, (22, 21, 21)
    q = torch.randn(2, 7, heads, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn_like(q)
    qw = (1.0 + 0.3 * torch.randn(heads * D, device="cuda")).to(torch.bfloat16)
    kw = (1.0 + 0.3 * torch.randn(heads * D, device="cuda")).to(torch.bfloat16)
    pos = torch.randint(0, 30, (3, 2, 7), device="cuda")
    q_out, k_out, v_out = ropekit.qk_norm_rope(q, k, qw, kw, positions=pos, sections=sections,
                                               norm_over="hidden", v=v)
    x = q.cpu().double()
    y = x * torch.rsqrt(x.reshape(2, 7, -1).pow(2).mean(-1)[..., None, None] + 1e-6) * qw.cpu().double().reshape(
        heads, D)
    ang = angles64(pos, D, sections=sections)
    assert_close_to_ref(q_out, rotate64(y, ang.cos(), ang.sin()), torch.bfloat16, "kernels")
    assert torch.equal(v_out, v)
    one = ropekit.qk_norm_rope(q[1:, 4:5].clone(), k[1:, 4:5].clone(), qw, kw, positions=pos[:, 1:, 4:5].clone(),
                               sections=sections, norm_over="hidden")
    assert same_bits(one[0], q_out[1:, 4:5]) and same_bits(one[1], k_out[1:, 4:5])
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    outs = ropekit.qk_norm_rope(qg, kg, qw, kw, positions=pos, sections=sections, norm_over="hidden")
    (outs[0].float().square().sum() + outs[1].float().sum()).backward()
    assert qg.grad.isfinite().all() and kg.grad.isfinite().all()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("layout", ["bhsd", "sbhd"])
def test_other_layouts_give_the_bshd_values(route, layout):
    """The norm spans a token's heads whichever axis holds them (bhsd: heads before the sequence); positions stay
    [A, B, S]."""
    perm = {"bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3)}[layout]
    with on_route(route) as device:
        q, k, qw, kw, pos = _inputs(device, torch.float32, Hk=1)
        want = ropekit.qk_norm_rope(q, k, qw, kw, positions=pos, sections=SECTIONS, norm_over="hidden")
        got = ropekit.qk_norm_rope(q.permute(perm).contiguous(), k.permute(perm).contiguous(), qw, kw,
                                   positions=pos, sections=SECTIONS, norm_over="hidden", layout=layout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.permute(perm), w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("route", ROUTES)
def test_double_backward_matches_float64_autograd(route):
    """The composed backward is itself differentiable (gradient penalties): d/dq of <dL/dq, u> against float64."""
    with on_route(route) as device:
        q, k, qw, kw, pos = _inputs(device, torch.float32, Hk=1, requires_grad=True)
        q_out, k_out = ropekit.qk_norm_rope(q, k, qw, kw, positions=pos, sections=SECTIONS, norm_over="hidden")
        gq, u = torch.randn_like(q_out), torch.randn_like(q)
        (dq,) = torch.autograd.grad(q_out, q, gq, create_graph=True)
        (ddq,) = torch.autograd.grad((dq * u).sum(), q)
    q64 = q.detach().cpu().double().requires_grad_(True)
    (dq64,) = torch.autograd.grad(_oracle(q64, qw.detach(), pos), q64, gq.cpu().double(), create_graph=True)
    (ddq64,) = torch.autograd.grad((dq64 * u.cpu().double()).sum(), q64)
    torch.testing.assert_close(ddq.cpu().double(), ddq64, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("route", ROUTES)
def test_packed_tokens_give_the_bshd_values(route):
    """thd: q [T, H, D] with positions [A, T]; the same values as one bshd batch row."""
    with on_route(route) as device:
        q, k, qw, kw, pos = _inputs(device, torch.bfloat16, B=1, S=5, Hk=1)
        v = torch.randn_like(k)
        want = ropekit.qk_norm_rope(q, k, qw, kw, positions=pos, sections=SECTIONS, norm_over="hidden", v=v)
        got = ropekit.qk_norm_rope(q[0], k[0], qw, kw, positions=pos[:, 0].contiguous(), sections=SECTIONS,
                                   norm_over="hidden", v=v[0], layout="thd")
    for g, w in zip(got, want):
        assert same_bits(g, w[0])
