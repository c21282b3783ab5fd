"""Differential test: the eager fast path (cached launch plans, ``ropekit._fastpath``) is the same function as the
full path, and both equal the float64 reference.

A seeded random grid over the options -- layouts, pairings, position modes, frequency sources, partial rotary,
scales, dtypes, packed-QKV views, in and out of place, with and without autograd, gradients in any layout, and
the explicit backward. Every configuration is called four times with fresh data and fresh argument tensors (the
first call notes its signature, the second records a plan, which serves the third and fourth), each result
compared with the float64 reference of the same call. On CPU (CI) the kernels and plans run under the Triton interpreter
(``ropekit.testing.kernels_on_cpu``) at small shapes; on a GPU (``-m gpu`` or the ``cuda`` ids) at real shapes.

Then, on CUDA only (marked ``gpu``): every kind of call replayed by a plan against the float64 reference, and the
calls a plan must hand back to the full path (offsets past a table, another alignment, a side stream).
"""

from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch

import ropekit
from helpers import KERNEL_ROUTES, on_route, reference_rope
from ropekit import _fastpath
from ropekit.testing import assert_close_to_ref, kernels_on_cpu, make_qk, tolerance

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", id="cpu-kernels",
                 marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
SHAPES = {"cpu": (2, 5, 3, 1, 16), "cuda": (2, 300, 32, 8, 128)}  # B, S, HQ, HK, D
NUM_CASES = {"cpu": 40, "cuda": int(os.environ.get("ROPEKIT_FAST_PATH_CASES", "80"))}
CALLS = 4  # per case, each with fresh data: the full path, the call that records the plan, two replays
GRAD_LAYOUTS = ("contiguous", "permuted", "transposed", "expanded", "sliced")


@contextlib.contextmanager
def device_mode(device: str):
    """Kernels and plans on ``device``: the interpreter on CPU, CUDA as is; plans start empty."""
    _fastpath.clear()
    with kernels_on_cpu() if device == "cpu" else contextlib.nullcontext():
        yield


def random_case(rng: random.Random, device: str) -> dict:
    """One configuration: the options that stay fixed over the three calls."""
    layout = rng.choice(["bshd", "bhsd", "sbhd", "thd"])
    pos_modes = ["none", "offset", "ids"] + (["varlen", "varlen-offset", "varlen-seqoff"] if layout == "thd"
                                             else ["seqoff", "ids-row"])
    case = dict(
        layout=layout,
        style=rng.choice(["neox", "interleaved"]),
        pos=rng.choice(pos_modes),
        freq=rng.choice(["base", "inv_freq", "table-half", "table-full", "table-bf16", "angles", "token-table"]),
        partial=rng.choice(["full", "full", "front", "back"]),
        scales=rng.choice([(1.0, 1.0, 1.0), (0.125, 2.0, 1.0), (1.0, 1.0, 1.3), (0.5, 0.75, 0.9)]),
        dtype=rng.choice([torch.float32, torch.bfloat16, torch.float16]),
        with_k=rng.random() < 0.85,
        packed=rng.random() < 0.5,
        mode=rng.choice(["out", "out", "grad", "grad", "inplace", "inplace-grad", "backward"]),
        grad_layout=rng.choice(GRAD_LAYOUTS),
    )
    if case["freq"] == "token-table":
        case["pos"] = "none"  # per-token rows are already gathered: no positions
    if case["mode"] == "inplace-grad" and device == "cpu" and rng.random() < 0.5:
        case["packed"] = True  # views of one buffer: one autograd Function per tensor
    return case


def _qk(case: dict, shape: tuple, device: str, requires_grad: bool):
    """q and k in the case's layout: separate tensors, or views of one packed QKV buffer."""
    B, S, HQ, HK, D = shape
    layout, dtype = case["layout"], case["dtype"]
    dims = {"bshd": (B, S, None, D), "bhsd": (B, None, S, D), "sbhd": (S, B, None, D), "thd": (B * S, None, D)}
    head_axis = dims[layout].index(None)

    def sized(h):
        return tuple(h if d is None else d for d in dims[layout])

    hk = HK if case["with_k"] else 0
    if case["packed"]:
        buf = torch.randn(sized(HQ + 2 * hk), dtype=torch.float64).to(device=device, dtype=dtype)
        leaf = buf.requires_grad_(requires_grad)
        if case["mode"] == "inplace-grad":
            buf = buf * 1  # in place needs a non-leaf
        q = buf.narrow(head_axis, 0, HQ)
        k = buf.narrow(head_axis, HQ, hk) if hk else None
        return q, k, [leaf]
    q = torch.randn(sized(HQ), dtype=torch.float64).to(device=device, dtype=dtype).requires_grad_(requires_grad)
    k = torch.randn(sized(HK), dtype=torch.float64).to(device=device, dtype=dtype).requires_grad_(requires_grad) \
        if hk else None
    leaves = [q] + ([k] if k is not None else [])
    if case["mode"] == "inplace-grad":
        q, k = q * 1, (k * 1 if k is not None else None)
    return q, k, leaves


def _kwargs(case: dict, shape: tuple, device: str, call: int) -> dict:
    """The call's keyword arguments, fresh tensors each call."""
    B, S, HQ, HK, D = shape
    T = B * S
    R = {"full": D, "front": D // 2, "back": D // 2}[case["partial"]]
    rows = S + T + 64  # tables cover every position the cases produce
    q_scale, k_scale, rotary_scale = case["scales"]
    kw: dict = dict(style=case["style"], layout=case["layout"], q_scale=q_scale, k_scale=k_scale,
                    rotary_scale=rotary_scale)
    if case["partial"] != "full":
        kw.update(rotary_dim=R, rotary_at=case["partial"])
    thd = case["layout"] == "thd"
    pos, g = case["pos"], torch.Generator().manual_seed(call)
    if pos == "offset":
        kw["positions"] = [0, 17, 63, 30][call]
    elif pos == "seqoff":
        kw["positions"] = torch.randint(0, 64, (B,), generator=g).to(device)
    elif pos in ("ids", "ids-row"):
        n = T if thd else S
        ids = torch.randint(0, rows, (1 if pos == "ids-row" or thd else B, n), generator=g)
        kw["positions"] = (ids[0] if thd else ids).to(device)
    elif pos.startswith("varlen"):
        cuts = sorted(torch.randint(0, T + 1, (3,), generator=g).tolist())
        cu = torch.tensor([0, *cuts, T], dtype=torch.int32)  # may hold empty sequences
        kw["cu_seqlens"] = cu.to(device)
        if pos == "varlen-offset":
            kw["positions"] = [5, 0, 40, 21][call]
        elif pos == "varlen-seqoff":
            kw["positions"] = torch.randint(0, 64, (cu.numel() - 1,), generator=g).to(device)
    freq = case["freq"]
    if freq == "base":
        kw["base"] = 500000.0
    elif freq == "inv_freq":
        kw["inv_freq"] = torch.rand(R // 2, generator=g).to(device)
    elif freq.startswith("table") or freq == "token-table":
        width = R if freq == "table-full" else R // 2
        shape_t = (1 if thd else B, T if thd else S, width) if freq == "token-table" else (rows, width)
        table_dtype = torch.bfloat16 if freq == "table-bf16" else torch.float32
        kw["cos"] = torch.randn(shape_t, generator=g).to(device=device, dtype=table_dtype)
        kw["sin"] = torch.randn(shape_t, generator=g).to(device=device, dtype=table_dtype)
    elif freq == "angles":
        kw["angles"] = (torch.rand(rows, R // 2, generator=g) * 100).to(device)
    return kw


def _grad_like(out: torch.Tensor, how: str, g: torch.Generator) -> torch.Tensor:
    """An upstream gradient for ``out`` in the layout autograd might hand over."""
    shape, dtype, device = out.shape, out.dtype, out.device
    if how == "contiguous":
        return torch.randn(shape, generator=g, dtype=torch.float64).to(device, dtype)
    if how == "permuted":  # other dims permuted, last dim contiguous: no copy needed
        perm = list(range(out.dim() - 1))[::-1] + [out.dim() - 1]
        return torch.randn([shape[p] for p in perm], generator=g, dtype=torch.float64).to(device, dtype).permute(
            *perm)
    if how == "transposed":  # last two dims swapped, as from q @ k.transpose(-2, -1)
        return torch.randn(*shape[:-2], shape[-1], shape[-2], generator=g, dtype=torch.float64).to(
            device, dtype).transpose(-1, -2)
    if how == "expanded":  # out.sum().backward()
        return torch.randn((), generator=g, dtype=torch.float64).to(device, dtype).expand(shape)
    return torch.randn(*shape[:-1], 2 * shape[-1], generator=g, dtype=torch.float64).to(device, dtype)[..., ::2]


def _to_ref(x):
    return x.detach().to("cpu", torch.float64) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _ref_kwargs(kw: dict) -> dict:
    return {n: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for n, v in kw.items()}


def _check(out, ref, dtype, what):
    tol = tolerance(dtype)._asdict()
    assert out.dtype == dtype, (what, out.dtype)
    assert not torch.isnan(out).any(), f"{what}: NaN"
    torch.testing.assert_close(out.detach().cpu().double(), ref, **tol, msg=lambda m: f"{what}: {m}")


def run_case(case: dict, shape: tuple, device: str, call: int) -> None:
    """One call of ``case`` through the public API, checked against the float64 reference on CPU."""
    mode = case["mode"]
    grad = mode in ("grad", "inplace-grad")
    q, k, leaves = _qk(case, shape, device, requires_grad=grad)
    kw = _kwargs(case, shape, device, call)
    q_ref, k_ref = _to_ref(q), _to_ref(k)
    if grad:
        q_ref.requires_grad_(True)
        if k_ref is not None:
            k_ref.requires_grad_(True)
    ref_fn = ropekit.rope_backward if mode == "backward" else ropekit.apply_rope
    refs = ref_fn(q_ref, k_ref, **_ref_kwargs(kw))
    refs = (refs,) if k is None else refs

    if mode == "backward":
        outs = ropekit.rope_backward(q, k, **kw)
    elif mode.startswith("inplace"):
        outs = ropekit.apply_rope_(q, k, **kw)
        if mode == "inplace":  # the same tensors come back (with autograd: the same memory, new autograd views)
            assert (outs if k is None else outs[0]) is q and (k is None or outs[1] is k)
    else:
        outs = ropekit.apply_rope(q, k, **kw)
    outs = (outs,) if k is None else outs
    for name, out, ref in zip("qk", outs, refs):
        _check(out, ref.detach(), case["dtype"], f"{name} call {call}")
    if not grad:
        return
    g = torch.Generator().manual_seed(100 + call)
    grads = [_grad_like(o, case["grad_layout"], g) for o in outs]
    torch.autograd.backward(list(outs), grads)
    torch.autograd.backward(list(refs), [gr.detach().cpu().double() for gr in grads])
    if case["packed"]:  # one leaf: the packed buffer, whose q and k parts hold the gradients
        (leaf,) = leaves
        head_axis = {"bshd": 2, "bhsd": 1, "sbhd": 2, "thd": 1}[case["layout"]]
        HQ = q.shape[head_axis]
        got = [leaf.grad.narrow(head_axis, 0, HQ)]
        if k is not None:
            got.append(leaf.grad.narrow(head_axis, HQ, k.shape[head_axis]))
    else:
        got = [leaf.grad for leaf in leaves]
    for name, gr, ref_leaf in zip("qk", got, (q_ref, k_ref)):
        _check(gr, ref_leaf.grad, case["dtype"], f"d{name} call {call} ({case['grad_layout']} gradient)")


def _plannable(case: dict) -> bool:
    return case["mode"] != "inplace-grad"  # in place with autograd always takes the full path (mark_dirty)


@pytest.mark.parametrize("device", DEVICES)
def test_fast_path_equals_full_path_and_reference(device, plan_calls):
    rng = random.Random(20261126)
    shape = SHAPES[device]
    failures, expected_served = [], 0
    for index in range(NUM_CASES[device]):
        case = random_case(rng, device)
        plan_calls["served"] = 0
        with device_mode(device):
            try:
                for call in range(CALLS):
                    run_case(case, shape, device, call)
            except AssertionError as e:
                failures.append(f"case {index} {case}: {e}")
                continue
        if _plannable(case):
            expected_served += CALLS - 2
            if plan_calls["served"] < CALLS - 2:  # call 1 notes the signature, call 2 records its plan, the rest
                # replay it (with autograd, so do the backward calls)
                failures.append(f"case {index} {case}: plans served only {plan_calls['served']} calls")
    assert not failures, "\n".join(failures[:5]) + f"\n({len(failures)} failing cases)"
    assert expected_served > NUM_CASES[device]  # the grid exercised the fast path


@pytest.mark.parametrize("device", DEVICES)
def test_disabled_fast_path_serves_nothing_and_agrees(device, plan_calls):
    case = dict(layout="bshd", style="neox", pos="offset", freq="base", partial="full", scales=(1.0, 1.0, 1.0),
                dtype=torch.float32, with_k=True, packed=False, mode="out", grad_layout="contiguous")
    previous = ropekit.set_fast_path(False)
    try:
        with device_mode(device):
            for call in range(3):
                run_case(case, SHAPES[device], device, call)
    finally:
        ropekit.set_fast_path(previous)
    assert plan_calls["served"] == 0 and not _fastpath._PLANS


def test_fast_path_switch_from_environment():
    import subprocess
    import sys

    code = "import ropekit._config as c; print(c.fast_path)"
    for value, expected in (("1", "False"), ("0", "True"), ("", "True")):
        env = dict(os.environ, ROPEKIT_DISABLE_FAST_PATH=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == expected, (value, out.stdout, out.stderr)


@pytest.mark.parametrize("device", DEVICES)
def test_out_dtype_through_plans(device, plan_calls):
    """``out_dtype`` (the transformers drop-in's type promotion) gives the same outputs on the full path and on
    replayed plans, out of place, with autograd (gradients in the inputs' dtype) and in ``rope_backward``."""
    B, S, HQ, HK, D = SHAPES[device]
    with device_mode(device):
        for call in range(CALLS):
            q = torch.randn(B, S, HQ, D, device=device, dtype=torch.bfloat16)
            k = torch.randn(B, S, HK, D, device=device, dtype=torch.bfloat16)
            pos = 3 + call
            q_rot, k_rot = ropekit.apply_rope(q, k, positions=pos, out_dtype=torch.float32)
            ref_q, ref_k = ropekit.apply_rope(q.cpu().double(), k.cpu().double(), positions=pos)
            assert q_rot.dtype == k_rot.dtype == torch.float32
            _check(q_rot, ref_q, torch.float32, f"q call {call}")
            _check(k_rot, ref_k, torch.float32, f"k call {call}")
            leaf = q.clone().requires_grad_(True)
            out = ropekit.apply_rope(leaf, positions=pos, out_dtype=torch.float32)
            g = torch.randn_like(out)
            (dq,) = torch.autograd.grad(out, leaf, g)
            assert dq.dtype == torch.bfloat16
            want = ropekit.rope_backward(g.cpu().double(), positions=pos)
            _check(dq, want, torch.bfloat16, f"dq call {call}")
            back = ropekit.rope_backward(q, positions=pos, out_dtype=torch.float32)
            _check(back, ropekit.rope_backward(q.cpu().double(), positions=pos), torch.float32, f"backward {call}")
    assert plan_calls["served"] >= 3 * (CALLS - 2)


@pytest.mark.parametrize("device", DEVICES)
def test_sections_are_part_of_the_plan_signature(device, plan_calls):
    """Multi-axis calls of the same shapes that differ only in ``sections`` (or ``section_layout``) never share a
    plan: the pair -> axis map is compiled into the kernel (constexpr bounds), so a plan recorded for one would turn
    the other's pairs by the wrong axes. Each variant runs CALLS times (its plan serves the last two), then the first
    comes back and its own plan serves every call; every result is checked against the float64 reference."""
    B, S, HQ, HK, D = SHAPES[device]
    one, other = {"cpu": ((2, 3, 3), (3, 3, 2)), "cuda": ((16, 24, 24), (24, 24, 16))}[device]
    variants = [(one, "contiguous"), (other, "contiguous"), (one, "interleaved"), (one, "contiguous")]
    with device_mode(device):
        for index, (sections, section_layout) in enumerate(variants):
            for call in range(CALLS):
                q = torch.randn(B, S, HQ, D, dtype=torch.float64).to(device, torch.bfloat16)
                k = torch.randn(B, S, HK, D, dtype=torch.float64).to(device, torch.bfloat16)
                positions = torch.randint(0, 1 << 20, (3, B, S)).to(device)
                kw = dict(positions=positions, sections=sections, section_layout=section_layout)
                q_rot, k_rot = ropekit.apply_rope(q, k, **kw)
                ref_q, ref_k = ropekit.apply_rope(q.cpu().double(), k.cpu().double(), **_ref_kwargs(kw))
                what = f"{sections} {section_layout} call {call}"
                _check(q_rot, ref_q, torch.bfloat16, f"q {what}")
                _check(k_rot, ref_k, torch.bfloat16, f"k {what}")
            assert len(_fastpath._PLANS) == min(index + 1, 3)
    assert plan_calls["served"] == 3 * (CALLS - 2) + CALLS


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_calls_never_read_the_plan_dicts(device, monkeypatch):
    """torch.compile traces no plan lookup or recording (apply_rope, qk_norm_rope, rope_kv_write), with plans of a
    q-only and a q-and-k signature already made: dynamo would guard on the plan dicts' keys, which change with every
    new signature (torch 2.11 failed to build those guards once a q-only call's key, None for k, was among them)."""
    B, S, HQ, HK, D = SHAPES[device]
    with device_mode(device):
        q, k = (torch.randn(B, S, h, D, device=device) for h in (HQ, HK))
        positions = torch.randint(0, 1 << 20, (B, S), device=device)
        w_q, w_k = torch.rand(D, device=device), torch.rand(D, device=device)
        v = torch.randn(B, 1, HK, D, device=device)
        caches = [torch.zeros(B, 8, HK, D, device=device) for _ in range(2)]
        for _ in range(2):
            ropekit.apply_rope(q, positions=positions)
            ropekit.apply_rope(q, k, positions=positions)
            ropekit.qk_norm_rope(q, k, w_q, w_k, positions=positions)
            ropekit.rope_kv_write(q[:, :1], k[:, :1], v, *caches, positions=3)
        assert len(_fastpath._PLANS) == 2 and len(_fastpath._NORM_PLANS) == 1 and len(_fastpath._KV_PLANS) == 1

        def eager_only(fn):
            def plans(*args):
                if torch.compiler.is_compiling():
                    raise AssertionError(f"{fn.__name__} read a plan dict while compiling")
                return fn(*args)
            return plans

        from ropekit._fastpath import prologue, rope

        for module, name in ((rope, "_planned"), (rope, "_sighted"), (prologue, "_prologue_call")):
            monkeypatch.setattr(module, name, eager_only(getattr(module, name)))
        torch._dynamo.reset()
        rotate = torch.compile(lambda a, b, p: ropekit.apply_rope(a, b, positions=p), fullgraph=True, backend="eager")
        norm_rotate = torch.compile(lambda a, b, p: ropekit.qk_norm_rope(a, b, w_q, w_k, positions=p),
                                    fullgraph=True, backend="eager")
        write = torch.compile(lambda a, b, c, kc, vc: ropekit.rope_kv_write(a, b, c, kc, vc, positions=3),
                              fullgraph=True, backend="eager")
        for _ in range(2):
            q, k = (torch.randn(B, S, h, D, device=device) for h in (HQ, HK))
            want = ropekit.apply_rope(q.cpu().double(), k.cpu().double(), positions=positions.cpu())
            for got, exact in zip(rotate(q, k, positions), want):
                _check(got, exact, torch.float32, "compiled apply_rope")
            eager = ropekit.qk_norm_rope(q, k, w_q, w_k, positions=positions)
            for got, same in zip(norm_rotate(q, k, positions), eager):
                torch.testing.assert_close(got, same, rtol=0, atol=0)
            eager_caches = [c.clone() for c in caches]
            eager_q = ropekit.rope_kv_write(q[:, :1], k[:, :1], v, *eager_caches, positions=3)
            torch.testing.assert_close(write(q[:, :1], k[:, :1], v, *caches), eager_q, rtol=0, atol=0)
            for got, same in zip(caches, eager_caches):
                torch.testing.assert_close(got, same, rtol=0, atol=0)


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU-only runs)")
def test_a_plan_is_not_replayed_for_a_tensor_on_another_device_type():
    """Plans key each tensor's device by type and index: a meta tensor (index -1, as a CPU tensor's) of a signature
    planned with CPU positions goes to the full path, which names the argument, instead of a replay reading it."""
    with device_mode("cpu"):
        q = torch.randn(1, 4, 2, 8)
        for _ in range(3):  # note, record, replay
            ropekit.apply_rope(q, positions=torch.arange(4)[None])
        with pytest.raises(ValueError, match="positions"):
            ropekit.apply_rope(q, positions=torch.arange(4, device="meta")[None])


@pytest.mark.parametrize("mode", KERNEL_ROUTES)
def test_plan_cache_is_bounded_and_recent_plans_survive(mode, monkeypatch):
    from ropekit._fastpath import plans

    monkeypatch.setattr(plans, "_MAX_PLANS", 8)
    with on_route(mode, clear_plans=True) as device:
        hot = torch.randn(1, 2, 1, 8, device=device)
        for S in range(1, 30):
            ropekit.apply_rope(hot)  # used again and again: stays
            for _ in range(2):  # a signature's second call records its plan
                ropekit.apply_rope(torch.randn(1, S + 2, 1, 8, device=device))
            assert len(_fastpath._PLANS) <= 8
        assert len(_fastpath._PLANS) == 8
        served = []
        original = _fastpath.Plan.__call__
        monkeypatch.setattr(_fastpath.Plan, "__call__", lambda self, *a: served.append(1) or original(self, *a))
        ropekit.apply_rope(hot)
        assert served


# ------------------------------------------------------------------- CUDA: plans replayed at every kind of call
# Every case is called several times with fresh tensors (new data pointers, new values) and compared with the float64
# reference each time; the plan must be taken from the second call on, and anything a plan cannot replay (an offset
# past the table, a new alignment, a side stream) must still come out right or raise as before.

PLAN_SHAPE = (3, 7, 8, 2, 64)  # B, S, HQ, HK, D


def _plan_call(case: str, call: int):
    """(q, k, kwargs) for one call: fresh data, fresh argument tensors."""
    B, S, HQ, HK, D = PLAN_SHAPE
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


PLAN_CASES = ["default", "offset", "offset-bf16", "offset-fp16", "ids-bf16", "seqoff", "table", "hf-bf16",
              "angles", "invfreq", "partial-bf16", "thd-bf16", "strided-bf16", "q-only-offset"]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["out", "inplace", "backward", "autograd"])
@pytest.mark.parametrize("case", PLAN_CASES)
def test_plan_replays_match_reference(case, mode, plan_calls):
    calls = 5
    for call in range(calls):
        q, k, kw = _plan_call(case, call)
        if "q-only" in case:
            k = None
        cpu_kw = {key: (v.cpu() if isinstance(v, torch.Tensor) else v) for key, v in kw.items()}
        want = reference_rope(q.cpu(), None if k is None else k.cpu(), conjugate=mode == "backward", **cpu_kw)
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
            want = reference_rope(outs_cpu[0], outs_cpu[1] if k is not None else None, conjugate=True, **cpu_kw)
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


@pytest.mark.gpu
def test_planned_autograd_partial_grads_double_backward_and_version_check(plan_calls):
    B, S, HQ, HK, D = PLAN_SHAPE
    for _ in range(4):  # the first call notes the signature, the second records the plan, later ones replay it
        q, k = make_qk(B, S, HQ, HK, D, device="cuda")
        q.requires_grad_(True)
        k.requires_grad_(True)
        pos = torch.randint(0, 1000, (B, S), device="cuda")
        q_rot, k_rot = ropekit.apply_rope(q, k, positions=pos, k_scale=0.5)
        gk = torch.randn_like(k_rot)
        dq, dk = torch.autograd.grad((k_rot,), (q, k), (gk,), allow_unused=True)  # only k's output used
        assert dq is None or torch.count_nonzero(dq) == 0
        assert_close_to_ref(dk, reference_rope(gk.cpu(), None, positions=pos.cpu(), q_scale=0.5, conjugate=True)[0],
                            torch.float32)
        # double backward: d/dg of R^T g is R; the rotation is linear
        g = torch.randn_like(q_rot, requires_grad=True)
        q_rot, _ = ropekit.apply_rope(q, k, positions=pos)
        (dq,) = torch.autograd.grad((q_rot,), (q,), (g,), create_graph=True)
        v = torch.randn_like(dq)
        (dg,) = torch.autograd.grad((dq,), (g,), (v,))
        assert_close_to_ref(dg, reference_rope(v.cpu(), None, positions=pos.cpu())[0], torch.float32)
    assert plan_calls["served"] >= 2
    q_rot, k_rot = ropekit.apply_rope(q, k, positions=pos)
    pos.add_(1)  # positions changed in place after the forward: the backward would use the wrong ones
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad((q_rot, k_rot), (q, k), (torch.ones_like(q_rot), torch.ones_like(k_rot)))


@pytest.mark.gpu
def test_plan_falls_back_to_full_path_errors(plan_calls):
    B, S, HQ, HK, D = PLAN_SHAPE
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


@pytest.mark.gpu
def test_plan_respects_alignment_and_the_largest_position(plan_calls):
    B, S, HQ, _, D = PLAN_SHAPE
    buf = torch.randn(B * S * HQ * D + 8, device="cuda", dtype=torch.bfloat16)
    for start in (0, 0, 1, 1, 8):  # element 1 of a bf16 buffer is 2-byte aligned: a different specialisation
        q = buf[start:start + B * S * HQ * D].view(B, S, HQ, D)
        q.copy_(torch.randn_like(q))
        last = 2**31 - S - start  # positions up to 2**31 - 1 - start: in range
        got = ropekit.apply_rope(q, positions=last)
        assert_close_to_ref(got, reference_rope(q.cpu(), None, positions=last)[0], torch.bfloat16)
        with pytest.raises(ValueError, match="past the largest supported position"):
            ropekit.apply_rope(q, positions=2**31 - S + 1 + start)  # one position too far: raises, plan or not
    assert plan_calls["served"] == 1  # start 0 and 1 record their plans on their second call; 8 (aligned as 0)
    for start in (0, 1, 0, 1):
        q = buf[start:start + B * S * HQ * D].view(B, S, HQ, D)
        got = ropekit.apply_rope(q, positions=3)
        assert_close_to_ref(got, reference_rope(q.cpu(), None, positions=3)[0], torch.bfloat16)
    assert plan_calls["served"] == 5


@pytest.mark.gpu
def test_plan_launches_on_the_current_stream(plan_calls):
    _, _, HQ, HK, D = PLAN_SHAPE
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
