"""CUDA-only: the eager fast path (``ropekit._fastpath``) replays a launch plan per call signature.

Every case is called several times with fresh tensors (new data pointers, new values) and compared with the
float64 reference each time; the plan must be taken from the second call on, and anything a plan cannot replay
(an offset past the table, a new alignment, a side stream) must still come out right or raise as before.
"""

import pytest
import torch

import ropekit
from ropekit.testing import assert_close_to_ref, make_qk
from test_api import _ref

pytestmark = pytest.mark.gpu

B, S, HQ, HK, D = 3, 7, 8, 2, 64


def _fresh(case: str, call: int):
    """(q, k, kwargs) for one call: fresh data, fresh argument tensors."""
    dtype = {"fp16": torch.float16}.get(case.split("-")[-1], torch.bfloat16 if "bf16" in case else torch.float32)
    layout = "thd" if case.startswith("thd") else "bshd"
    q, k = make_qk(B, S, HQ, HK, D, dtype=dtype, device="cuda", layout=layout)
    R = 32 if "partial" in case else D
    pos_table = 64
    kw: dict = {}
    if "offset" in case:
        kw["positions"] = [0, 5, 17, 1, 2**20][call]
    if "ids" in case:
        kw["positions"] = torch.randint(0, 50, (B, S), device="cuda")
    if "seqoff" in case:
        kw["positions"] = torch.randint(0, 40, (B,), device="cuda")
    if "table" in case:
        kw["positions"] = [0, 3, 20, 57, 1][call]  # 57 + S = 64 rows: the last valid offset
        ang = torch.outer(torch.arange(pos_table, dtype=torch.float64), 1e-4 ** (torch.arange(0, R, 2) / R))
        kw["cos"], kw["sin"] = ang.cos().float().cuda(), ang.sin().float().cuda()
    if "hf" in case:  # transformers' per-token tables, duplicated halves
        ang = torch.randn(B, S, R // 2, dtype=torch.float64) * 100
        emb = torch.cat([ang, ang], -1)
        kw["cos"], kw["sin"] = emb.cos().to(dtype).cuda(), emb.sin().to(dtype).cuda()
    if "angles" in case:
        kw["angles"] = (torch.rand(pos_table, R // 2, device="cuda") * 1e4)
        kw["positions"] = torch.randint(0, pos_table, (B, S), device="cuda")
    if "invfreq" in case:
        kw["inv_freq"] = torch.rand(R // 2, device="cuda")
        kw["positions"] = call * 1000
    if "partial" in case:
        kw.update(rotary_dim=R, rotary_at="back", q_scale=0.25, k_scale=2.0, rotary_scale=0.9)
    if layout == "thd":
        kw["layout"] = "thd"
        kw["cu_seqlens"] = torch.tensor([0, 4, 4, B * S], device="cuda", dtype=torch.int32)
        kw["positions"] = torch.randint(0, 100, (3,), device="cuda")
    if "strided" in case:  # q and k as views into one packed projection
        packed = torch.randn(B, S, HQ + 2 * HK, D, device="cuda", dtype=dtype)
        q, k = packed[:, :, :HQ], packed[:, :, HQ:HQ + HK]
    return q, k, kw


CASES = ["default", "offset", "offset-bf16", "offset-fp16", "ids-bf16", "seqoff", "table", "hf-bf16", "angles",
         "invfreq", "partial-bf16", "thd-bf16", "strided-bf16", "q-only-offset"]


@pytest.mark.parametrize("mode", ["out", "inplace", "backward", "autograd"])
@pytest.mark.parametrize("case", CASES)
def test_plan_replays_match_reference(case, mode, plan_calls):
    calls = 5
    for call in range(calls):
        q, k, kw = _fresh(case, call)
        if "q-only" in case:
            k = None
        cpu_kw = {key: (v.cpu() if isinstance(v, torch.Tensor) else v) for key, v in kw.items()}
        want = _ref(q.cpu(), None if k is None else k.cpu(), conjugate=mode == "backward", **cpu_kw)
        if mode == "inplace":
            q_ptr = q.data_ptr()
            got = ropekit.apply_rope_(q, k, **kw)
            assert (got if k is None else got[0]) is q and q.data_ptr() == q_ptr
        elif mode == "backward":
            got = ropekit.rope_backward(q, k, **kw)
        elif mode == "autograd":  # grads through the planned autograd path equal the conjugate rotation
            leaves = [x.detach().clone().requires_grad_(True) for x in (q, k) if x is not None]
            outs = ropekit.apply_rope(*leaves, **kw) if k is not None else (ropekit.apply_rope(leaves[0], **kw),)
            assert all(o.requires_grad for o in outs)
            got = torch.autograd.grad(outs, leaves, [o.detach().clone() for o in outs])
            outs_cpu = [o.detach().cpu() for o in outs]
            want = _ref(outs_cpu[0], outs_cpu[1] if k is not None else None, conjugate=True, **cpu_kw)
            for g, x in zip(got, leaves):
                assert g.dtype == x.dtype and g.shape == x.shape
            want = (want[0],) if k is None else want
            got = got if k is not None else got[0]
        else:
            got = ropekit.apply_rope(q, k, **kw)
        got = (got,) if k is None else got
        for out, ref in zip(got, want):
            assert out.shape == ref.shape
            assert_close_to_ref(out, ref, q.dtype)
    assert plan_calls["served"] >= calls - 2  # the first call notes the signature, the second records the plan


def test_planned_autograd_partial_grads_double_backward_and_version_check(plan_calls):
    for _ in range(4):  # the first call notes the signature, the second records the plan, later ones replay it
        q, k = make_qk(B, S, HQ, HK, D, device="cuda")
        q.requires_grad_(True)
        k.requires_grad_(True)
        pos = torch.randint(0, 1000, (B, S), device="cuda")
        q_rot, k_rot = ropekit.apply_rope(q, k, positions=pos, k_scale=0.5)
        gk = torch.randn_like(k_rot)
        dq, dk = torch.autograd.grad((k_rot,), (q, k), (gk,), allow_unused=True)  # only k's output used
        assert dq is None or torch.count_nonzero(dq) == 0
        assert_close_to_ref(dk, _ref(gk.cpu(), None, positions=pos.cpu(), q_scale=0.5, conjugate=True)[0],
                            torch.float32)
        # double backward: d/dg of R^T g is R; the rotation is linear
        g = torch.randn_like(q_rot, requires_grad=True)
        q_rot, _ = ropekit.apply_rope(q, k, positions=pos)
        (dq,) = torch.autograd.grad((q_rot,), (q,), (g,), create_graph=True)
        v = torch.randn_like(dq)
        (dg,) = torch.autograd.grad((dq,), (g,), (v,))
        assert_close_to_ref(dg, _ref(v.cpu(), None, positions=pos.cpu())[0], torch.float32)
    assert plan_calls["served"] >= 2
    q_rot, k_rot = ropekit.apply_rope(q, k, positions=pos)
    pos.add_(1)  # positions changed in place after the forward: the backward would use the wrong ones
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad((q_rot, k_rot), (q, k), (torch.ones_like(q_rot), torch.ones_like(k_rot)))


def test_plan_falls_back_to_full_path_errors(plan_calls):
    table = torch.randn(16, D // 2, device="cuda")
    q, k = make_qk(B, S, HQ, HK, D, device="cuda")
    for _ in range(2):
        ropekit.apply_rope_(q, k, positions=9, cos=table, sin=table)  # 9 + 7 = 16 rows: fine, plan recorded
    before_q, before_k = q.clone(), k.clone()
    with pytest.raises(IndexError, match="table has 16 rows"):
        ropekit.apply_rope_(q, k, positions=10, cos=table, sin=table)
    with pytest.raises(ValueError, match=">= 0"):
        ropekit.apply_rope_(q, k, positions=-1, cos=table, sin=table)
    assert torch.equal(q, before_q) and torch.equal(k, before_k)  # nothing written on error
    with pytest.raises(ValueError, match="device"):
        ropekit.apply_rope(q, k, positions=torch.zeros(B, dtype=torch.long))  # CPU positions, CUDA q
    ropekit.apply_rope(q, k, positions=torch.zeros(B, dtype=torch.long, device="cuda"))
    with pytest.raises(ValueError, match="device"):
        ropekit.apply_rope(q, k, positions=torch.zeros(B, dtype=torch.long))
    assert plan_calls["served"] == 0


def test_plan_respects_alignment_and_the_largest_position(plan_calls):
    buf = torch.randn(B * S * HQ * D + 8, device="cuda", dtype=torch.bfloat16)
    for start in (0, 0, 1, 1, 8):  # element 1 of a bf16 buffer is 2-byte aligned: a different specialisation
        q = buf[start:start + B * S * HQ * D].view(B, S, HQ, D)
        q.copy_(torch.randn_like(q))
        last = 2**31 - S - start  # positions up to 2**31 - 1 - start: in range
        got = ropekit.apply_rope(q, positions=last)
        assert_close_to_ref(got, _ref(q.cpu(), None, positions=last)[0], torch.bfloat16)
        with pytest.raises(ValueError, match="past the largest supported position"):
            ropekit.apply_rope(q, positions=2**31 - S + 1 + start)  # one position too far: raises, plan or not
    assert plan_calls["served"] == 1  # start 0 and 1 record their plans on their second call; 8 (aligned as 0)
    for start in (0, 1, 0, 1):
        q = buf[start:start + B * S * HQ * D].view(B, S, HQ, D)
        got = ropekit.apply_rope(q, positions=3)
        assert_close_to_ref(got, _ref(q.cpu(), None, positions=3)[0], torch.bfloat16)
    assert plan_calls["served"] == 5


def test_plan_launches_on_the_current_stream(plan_calls):
    q, k = make_qk(64, 128, HQ, HK, D, device="cuda")
    ropekit.apply_rope(q, k, positions=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            q2 = q * 2  # produced on the side stream: a launch on another stream would race it
            out_q, _ = ropekit.apply_rope(q2, k, positions=1)
    torch.cuda.current_stream().wait_stream(side)
    want = ropekit.apply_rope(q * 2, k, positions=1)[0]
    torch.testing.assert_close(out_q, want, rtol=0, atol=0)
    assert plan_calls["served"] >= 3
