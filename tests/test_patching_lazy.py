"""Lazy cos/sin tables of a patched model: a forward (and backward) that rotates with ropekit builds no table; a
table that is read is built once per (cos, sin) pair, bit for bit the table the eager patched forward returned, and
behaves as a plain tensor (copies, pickling, autograd, torch.compile); while compiling or tracing, tables are
plain."""

from __future__ import annotations

import copy
import importlib
import io
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import (  # noqa: E402
    COMMON,
    FAMILIES,
    VL_SECTIONS,
    forward_backward,
    no_patch_leaks,  # noqa: F401  (autouse: no test leaves a module-level function patched)
    rel_err,
    tiny_model,
    tiny_vl_model,
)
from ropekit._spec import pair_axis_tensor  # noqa: E402
from ropekit.integrations import patching  # noqa: E402
from ropekit.integrations.patching import patch, unpatch  # noqa: E402
from ropekit.modules import hf_tables  # noqa: E402

ALL_FAMILIES = FAMILIES + sorted(VL_SECTIONS)
LAYERS = COMMON["num_hidden_layers"]


@pytest.fixture
def builds(monkeypatch):
    """Counts the table builds (calls of ``hf_tables`` from the patching module)."""
    calls = []
    original = patching.hf_tables

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(patching, "hf_tables", spy)
    return calls


def _modeling(model_type: str):
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def _rotary(model, model_type: str):
    return patching._rotary_modules(model, _modeling(model_type).__name__)[0]


def _model_and_inputs(model_type: str, n: int):
    """A tiny model of the family and ``n`` fresh batches of inputs (M-RoPE positions for the VL families)."""
    if model_type in VL_SECTIONS:
        model = tiny_vl_model(model_type)
        batches = [dict(input_ids=torch.randint(0, 128, (2, 12)),
                        position_ids=torch.stack([torch.arange(12).expand(2, 12), torch.randint(0, 40, (2, 12)),
                                                  torch.randint(0, 40, (2, 12))])) for _ in range(n)]
    else:
        model = tiny_model(model_type)
        batches = [dict(input_ids=torch.randint(0, 128, (2, 24))) for _ in range(n)]
    return model, batches


def _forward_backward(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch, labels=batch["input_ids"])
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().float(), grads


def _old_eager_tables(model, x, position_ids):
    """The tables the patched forward built before tables were lazy: the same ``hf_tables`` call, then ``x.dtype``
    (call after the forward, which committed the frequencies it chose)."""
    rope = patching._ropekit_module(model)
    seq_len = int(position_ids.max()) + 1 if rope.frequencies.is_dynamic else None
    f, _, inv = rope._choose(seq_len, x.device)
    pair_axis = None if f.sections is None else pair_axis_tensor(f.sections, f.section_layout, position_ids.device)
    cos, sin = hf_tables(position_ids, inv, f.attention_scaling, pair_axis=pair_axis)  # not the spied one
    return cos.to(x.dtype), sin.to(x.dtype)


def _rotary_inputs(model_type: str, dtype=torch.float32):
    if model_type in VL_SECTIONS:
        x = torch.randn(2, 12, 128, dtype=dtype)
        position_ids = torch.stack([torch.arange(12).expand(2, 12), torch.randint(0, 40, (2, 12)),
                                    torch.randint(0, 40, (2, 12))])
    else:
        x = torch.randn(2, 24, 64, dtype=dtype)
        position_ids = torch.arange(3, 27).expand(2, 24)
    return x, position_ids


@pytest.mark.parametrize("model_type", ALL_FAMILIES)
def test_patched_forward_backward_builds_no_table(model_type, builds, rope_calls):
    """Several forwards and backwards with fresh inputs (plans and caches engage from the second call): no cos/sin
    table is built, every layer rotates with ropekit, and logits and gradients are the unpatched model's."""
    model, batches = _model_and_inputs(model_type, 3)
    refs = [_forward_backward(model, batch) for batch in batches]
    builds.clear()
    patch(model, prologue=False)  # the rotation alone (test_patching_fused.py: the fused forwards build none either)
    try:
        got = [_forward_backward(model, batch) for batch in batches]
    finally:
        unpatch(model)
    assert builds == []
    assert len(rope_calls) == LAYERS * len(batches)
    for (logits, grads), (ref_logits, ref_grads) in zip(got, refs):
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            assert rel_err(g, ref_grads[name]) < 1e-5, name


def test_generate_and_gradient_checkpointing_build_no_table(builds, rope_calls):
    model = tiny_model("llama")
    ids = torch.randint(2, 128, (2, 12))
    kwargs = dict(max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    ref = model.generate(ids, **kwargs)
    ckpt = tiny_model("qwen3")
    ckpt.gradient_checkpointing_enable()
    ckpt.train()
    ref_logits, _ = forward_backward(ckpt, ids)
    builds.clear()
    patch(model)
    patch(ckpt, prologue=False)
    try:
        out = model.generate(ids, **kwargs)
        logits, _ = forward_backward(ckpt, ids)
    finally:
        unpatch(model)
        unpatch(ckpt)
    assert torch.equal(out, ref)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert builds == []
    assert len(rope_calls) == (6 + 2) * LAYERS  # prefill + 5 decode steps; checkpointed forward + recomputation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model_type", ALL_FAMILIES)
def test_read_tables_are_the_eager_tables(model_type, dtype, builds):
    """The patched rotary module called directly: the tables have transformers' shape, dtype, device and strides,
    are built on the first read (one build for cos and sin together) and equal, bit for bit, the tables the patched
    forward used to build eagerly."""
    model = tiny_vl_model(model_type) if model_type in VL_SECTIONS else tiny_model(model_type)
    rotary = _rotary(model, model_type)
    x, position_ids = _rotary_inputs(model_type, dtype)
    hf_cos, hf_sin = rotary(x, position_ids)  # transformers' own
    patch(model)
    try:
        builds.clear()
        cos, sin = rotary(x, position_ids)
        assert type(cos) is patching._LazyTable and type(sin) is patching._LazyTable
        assert builds == []
        for lazy, hf in ((cos, hf_cos), (sin, hf_sin)):
            assert (lazy.shape, lazy.dtype, lazy.device, lazy.stride()) == (hf.shape, hf.dtype, hf.device,
                                                                             hf.stride())
            assert lazy.is_contiguous() and not lazy.requires_grad
        assert cos.shape[-1] == getattr(cos, patching._PLAN_ATTR).width
        assert builds == []  # metadata needs no build
        cos_value = cos * 1
        assert len(builds) == 1
        sin_value = sin * 1
        assert len(builds) == 1  # one build for the pair
        assert torch.equal(cos * 1, cos_value) and len(builds) == 1  # reused
        want_cos, want_sin = _old_eager_tables(model, x, position_ids)
        assert torch.equal(cos_value, want_cos) and torch.equal(sin_value, want_sin)
        assert cos_value.stride() == want_cos.stride() == hf_cos.stride()
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(cos_value, hf_cos, **tol)
        torch.testing.assert_close(sin_value, hf_sin, **tol)
    finally:
        unpatch(model)


@pytest.mark.parametrize("case", ["unsqueeze_dim=0", "sliced cos", "k of another dtype"])
def test_fallback_reads_the_tables_and_equals_the_original(case, builds, rope_calls):
    """Calls the dispatcher's plan does not cover go to transformers' function, which reads (so builds) the lazy
    tables: the result is the original function's on the eagerly built tables, exactly."""
    model = tiny_model("llama")
    modeling = _modeling("llama")
    original = modeling.apply_rotary_pos_emb
    x, position_ids = _rotary_inputs("llama")
    patch(model)
    try:
        cos, sin = model.model.rotary_emb(x, position_ids)
        eager_cos, eager_sin = _old_eager_tables(model, x, position_ids)
        builds.clear()
        q, k = torch.randn(2, 4, 24, 16), torch.randn(2, 2, 24, 16)
        if case == "unsqueeze_dim=0":
            q, k = q.transpose(0, 1), k.transpose(0, 1)  # [H, B, S, D]: cos [1, B, S, D] broadcasts
            got = modeling.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)
            want = original(q, k, eager_cos, eager_sin, unsqueeze_dim=0)
        elif case == "sliced cos":
            q, k = q[..., :8].contiguous(), k[..., :8].contiguous()
            got = modeling.apply_rotary_pos_emb(q, k, cos[..., :8], sin[..., :8])
            want = original(q, k, eager_cos[..., :8], eager_sin[..., :8])
        else:
            k = k.double()
            got = modeling.apply_rotary_pos_emb(q, k, cos, sin)
            want = original(q, k, eager_cos, eager_sin)
    finally:
        unpatch(model)
    assert rope_calls == []
    assert len(builds) == 1
    for g, w in zip(got, want):
        assert type(g) is torch.Tensor and g.dtype == w.dtype
        assert torch.equal(g, w)


def test_position_ids_changed_in_place_before_the_read_raise(builds):
    """The tables keep the position ids by reference: changing them in place before the first read is an error;
    after the read it changes nothing; inference tensors (no version counter) are copied."""
    model = tiny_model("qwen3")
    x, _ = _rotary_inputs("qwen3")
    patch(model)
    try:
        position_ids = torch.arange(24).expand(2, 24).clone()
        cos, sin = model.model.rotary_emb(x, position_ids)
        position_ids.add_(5)
        with pytest.raises(RuntimeError, match="position ids given to the patched rotary embedding were changed in "
                                               "place"):
            cos + 0
        with pytest.raises(RuntimeError, match="changed in place"):
            torch.cat([sin, sin])
        assert builds == []

        position_ids = torch.arange(24).expand(2, 24).clone()
        cos, sin = model.model.rotary_emb(x, position_ids)
        want = _old_eager_tables(model, x, position_ids)
        _ = sin.sum()  # built now
        position_ids.add_(5)
        assert torch.equal(cos * 1, want[0]) and torch.equal(sin * 1, want[1])

        with torch.inference_mode():
            position_ids = torch.arange(24).expand(2, 24).clone()
            want = _old_eager_tables(model, x, position_ids)
            cos, sin = model.model.rotary_emb(x, position_ids)
            assert type(cos) is patching._LazyTable
            position_ids.add_(5)
            assert torch.equal(cos * 1, want[0]) and torch.equal(sin * 1, want[1])
    finally:
        unpatch(model)


@pytest.fixture
def phi3_tables(builds):
    """One rotary forward of a patched tiny Phi-3 (partial rotary): its lazy (cos, sin), unread, and the tables the
    eager build gave for the same call."""
    model = tiny_model("phi3")
    x, position_ids = _rotary_inputs("phi3")
    patch(model)
    try:
        cos, sin = model.model.rotary_emb(x, position_ids)
        yield cos, sin, _old_eager_tables(model, x, position_ids)
    finally:
        unpatch(model)


def test_lazy_table_behaves_as_a_plain_tensor(builds, phi3_tables):
    """Copies, pickling, repr and everyday ops give plain tensors with the table's values (a conversion with nothing
    to do gives the table itself, as for a plain tensor); autograd goes through ops that combine a table with a
    tensor that requires grad."""
    cos, sin, (want_cos, want_sin) = phi3_tables
    assert type(cos) is patching._LazyTable and builds == []
    buffer = io.BytesIO()
    torch.save({"cos": cos, "sin": sin}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert len(builds) == 1
    results = {
        "deepcopy": copy.deepcopy(cos),
        "copy": copy.copy(cos),
        "pickle": pickle.loads(pickle.dumps(cos)),
        "torch.load": loaded["cos"],
        "clone": cos.clone(),
        "detach": cos.detach(),
        "contiguous": cos.contiguous(),
        "view": cos.view(cos.shape),
        "index": cos[:, :],
    }
    for name, value in results.items():
        assert type(value) is torch.Tensor, name
        assert torch.equal(value, want_cos), name
    assert torch.equal(loaded["sin"], want_sin)
    assert cos.float() is cos and cos.to("cpu") is cos and cos.cpu() is cos  # nothing to do: itself, as torch
    assert repr(cos) == repr(want_cos) and str(sin) == str(want_sin)
    as_double = cos.to(torch.float64)
    assert type(as_double) is torch.Tensor and torch.equal(as_double, want_cos.double())
    assert torch.equal(cos.unsqueeze(1), want_cos.unsqueeze(1))
    assert torch.equal(cos[1, 3:7, ::2], want_cos[1, 3:7, ::2])
    plain = torch.randn(2, 3, cos.shape[-1])
    assert torch.equal(torch.cat([cos, plain], dim=1), torch.cat([want_cos, plain], dim=1))
    assert (cos.cpu().numpy() == want_cos.numpy()).all() and (cos.numpy() == want_cos.numpy()).all()
    assert cos.tolist() == want_cos.tolist()
    assert cos.data_ptr() != 0 and cos.data_ptr() == cos.data_ptr()  # the built table's memory
    q = torch.randn(2, 3, 24, cos.shape[-1], requires_grad=True)
    out = q * cos.unsqueeze(1) + q.flip(-1) * sin.unsqueeze(1)
    out.backward(torch.ones_like(out))
    assert type(out) is torch.Tensor
    assert torch.equal(q.grad, (want_cos.unsqueeze(1) + want_sin.unsqueeze(1).flip(-1)).expand_as(q))
    assert len(builds) == 1


def test_lazy_table_as_input_of_a_compiled_function(builds):
    model = tiny_model("llama")
    x, position_ids = _rotary_inputs("llama")
    patch(model)
    torch._dynamo.reset()
    try:
        @torch.compile(backend="aot_eager")
        def rotate(q, cos, sin):
            return q * cos.unsqueeze(1) + q.flip(-1) * sin.unsqueeze(1)

        for shift in (0, 7):  # the second call runs the compiled code
            cos, sin = model.model.rotary_emb(x, position_ids + shift)
            assert type(cos) is patching._LazyTable
            want_cos, want_sin = _old_eager_tables(model, x, position_ids + shift)
            q = torch.randn(2, 4, 24, 16, requires_grad=True)
            out = rotate(q, cos, sin)
            assert torch.equal(out, q * want_cos.unsqueeze(1) + q.flip(-1) * want_sin.unsqueeze(1))
            out.sum().backward()
            torch.testing.assert_close(q.grad, (want_cos.unsqueeze(1) + want_sin.unsqueeze(1).flip(-1)).expand_as(q))
    finally:
        unpatch(model)
        torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
def test_tables_are_plain_while_tracing(builds):
    """Under torch.jit.trace or a dispatch mode (fake tensors, make_fx, ...) the tables are built as before:
    plain tensors, one build."""
    model = tiny_model("llama")
    x, position_ids = _rotary_inputs("llama")
    patch(model)
    try:
        want_cos, _ = _old_eager_tables(model, x, position_ids)
        builds.clear()

        class PassThrough(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        with PassThrough():
            cos, _ = model.model.rotary_emb(x, position_ids)
        assert type(cos) is torch.Tensor and torch.equal(cos, want_cos) and len(builds) == 1

        traced = torch.jit.trace(lambda x, p: model.model.rotary_emb(x, p)[0] * 1, (x, position_ids),
                                 check_trace=False)
        assert len(builds) == 2  # built (plain) while tracing
        assert torch.equal(traced(x, position_ids), want_cos)
    finally:
        unpatch(model)


def _send_to_device(obj, device):
    """What accelerate's device-map hooks do to a layer's inputs: every tensor ``.to(device, non_blocking=...)``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_send_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {key: _send_to_device(value, device) for key, value in obj.items()}
    return obj


def test_no_op_conversions_return_the_table_itself(builds, rope_calls):
    """As for a plain tensor, a conversion with nothing to do (``.to`` the table's own device or dtype, ``.float()``
    of a float32 table, ``.cpu()`` of a CPU one) returns the table itself: still lazy and still carrying its plan, so
    a model whose layers get their inputs through device-map hooks (accelerate's ``send_to_device``) keeps rotating
    with ropekit and builds no table. A conversion that converts gives a plain tensor."""
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (2, 24))
    ref_logits, ref_grads = forward_backward(model, ids)
    x, position_ids = _rotary_inputs("llama")
    patch(model)
    try:
        cos, sin = model.model.rotary_emb(x, position_ids)
        same = {
            "to(device)": cos.to(cos.device),
            "to(device, non_blocking)": cos.to("cpu", non_blocking=True),
            "to(dtype)": cos.to(torch.float32),
            "to(device, dtype)": cos.to("cpu", torch.float32),
            "to(other)": cos.to(torch.zeros(1)),
            "to(memory_format)": cos.to(memory_format=torch.preserve_format),
            "float": cos.float(),
            "cpu": cos.cpu(),
            "type(dtype)": cos.type(torch.FloatTensor),
            "type_as": cos.type_as(torch.zeros(1)),
        }
        for name, value in same.items():
            assert value is cos, name
        assert hasattr(cos.to(cos.device), patching._PLAN_ATTR) and builds == []
        assert cos.type() == "torch.FloatTensor" and builds == []
        want_cos, _ = _old_eager_tables(model, x, position_ids)
        for name, value in {"to(float64)": cos.to(torch.float64), "to(copy=True)": cos.to("cpu", copy=True),
                            "double": cos.double(), "half": cos.half()}.items():
            assert type(value) is torch.Tensor, name
            assert torch.equal(value, want_cos.to(value.dtype)), name

        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda module, args, kwargs: (_send_to_device(args, "cpu"),
                                                                          _send_to_device(kwargs, "cpu")),
                                            with_kwargs=True)
        builds.clear()
        logits, grads = forward_backward(model, ids)
    finally:
        unpatch(model)
    assert len(rope_calls) == LAYERS and builds == []
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < 1e-5, name


def test_a_table_that_requires_grad_reads_as_a_plain_leaf(builds, phi3_tables):
    """After ``requires_grad_()`` the table is a leaf of the caller's graph, and its memory and copies behave as a
    plain leaf's: ``data_ptr``/``untyped_storage`` are the built table's, ``tolist`` works, ``numpy`` refuses as
    torch does (unless forced), and copies, pickles and repr keep ``requires_grad``."""
    cos, _, (want_cos, _) = phi3_tables
    assert cos.requires_grad_() is cos and cos.requires_grad and cos.is_leaf
    assert cos.float() is cos and cos.contiguous() is cos  # torch's "return self", the leaf itself
    built = cos._builder.tables()[0]
    assert cos.data_ptr() == built.data_ptr() != 0
    assert cos.untyped_storage().data_ptr() == built.untyped_storage().data_ptr()
    assert cos.tolist() == want_cos.tolist()
    with pytest.raises(RuntimeError, match="requires grad"):
        cos.numpy()
    assert (cos.numpy(force=True) == want_cos.numpy()).all()
    for name, value in {"deepcopy": copy.deepcopy(cos), "pickle": pickle.loads(pickle.dumps(cos))}.items():
        assert type(value) is torch.Tensor and value.requires_grad and value.is_leaf, name
        assert torch.equal(value.detach(), want_cos), name
    assert "requires_grad=True" in repr(cos)
    q = torch.randn(cos.shape)
    (q * cos).sum().backward()
    assert torch.equal(cos.grad, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_dynamic_ntk_tables_read_late_use_their_own_forward_frequencies(dtype, builds):
    """Dynamic NTK chooses the frequencies per call: tables read only after later forwards changed the module's
    frequencies (longer positions, then back to short ones: a reset) are still those of their own forward,
    transformers' values, with [B, S] and [1, S] position ids."""
    config = dict(rope_theta=10000.0, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    model, hf = tiny_model("llama", **config), tiny_model("llama", **config)
    x = torch.randn(2, 8, 64, dtype=dtype)
    calls = [torch.arange(8).expand(2, 8), torch.arange(100, 108).expand(2, 8), torch.arange(8)[None],
             torch.arange(200, 208)[None]]
    want = [hf.model.rotary_emb(x, p) for p in calls]
    patch(model)
    try:
        got = [model.model.rotary_emb(x, p) for p in calls]
        assert builds == []
        for (cos, sin), (hf_cos, hf_sin) in zip(reversed(got), reversed(want)):
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
            assert cos.shape == hf_cos.shape and cos.dtype == hf_cos.dtype
            torch.testing.assert_close(cos, hf_cos, **tol)
            torch.testing.assert_close(sin, hf_sin, **tol)
        assert len(builds) == len(calls)
    finally:
        unpatch(model)
