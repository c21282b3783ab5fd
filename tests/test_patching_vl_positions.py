"""The patched M-RoPE rotary modules of Qwen2-VL, Qwen2.5-VL and Qwen3-VL take every position-id shape the
original module takes, with its meaning: the original broadcasts the ids to three axes (``expand(3, -1, -1)``,
transformers 5.19 on; earlier versions refuse 2-D ids, and those cases skip there), so [B, S], [1, S], [1, B, S],
[1, 1, S], [3, 1, S] and [3, B, S] all work, and the shapes it refuses are refused."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import INTERPRETED, VL_SECTIONS, tiny_vl_model  # noqa: E402
from ropekit.integrations.patching import patch, unpatch  # noqa: E402
from ropekit.testing import kernels_on_cpu  # noqa: E402

B, S = 2, 7
ACCEPTED = [(B, S), (1, S), (1, B, S), (1, 1, S), (3, 1, S), (3, B, S)]
REFUSED = [(S,), (2, B, S), (4, B, S), (1, 1, B, S)]


@pytest.fixture(scope="module", params=sorted(VL_SECTIONS))
def vl(request):
    """(model, its language model's rotary module, the family's modeling module): one tiny model per family."""
    model = tiny_vl_model(request.param)
    modeling = importlib.import_module(f"transformers.models.{request.param}.modeling_{request.param}")
    return model, model.model.language_model.rotary_emb, modeling


@pytest.mark.parametrize("shape", ACCEPTED, ids=lambda s: "x".join(map(str, s)))
def test_patched_rotary_takes_the_position_shapes_of_the_original(vl, shape, rope_calls):
    model, rotary, modeling = vl
    head_dim = model.config.text_config.head_dim
    x = torch.randn(B, S, model.config.text_config.hidden_size)
    ids = torch.randint(0, 64, shape)  # every axis different where the shape has three
    q, k = torch.randn(B, 4, S, head_dim), torch.randn(B, 2, S, head_dim)
    original_rotation = modeling.apply_rotary_pos_emb
    try:
        want_cos, want_sin = rotary(x, ids)
    except (RuntimeError, IndexError) as exc:  # transformers before 5.19 did not broadcast 2-D ids to the axes
        pytest.skip(f"this transformers {transformers.__version__} module refuses ids of shape {shape}: {exc}")
    want_q, want_k = original_rotation(q, k, want_cos, want_sin)
    patch(model)
    try:
        cos, sin = rotary(x, ids)
        with kernels_on_cpu() if INTERPRETED else contextlib.nullcontext():
            got_q, got_k = modeling.apply_rotary_pos_emb(q, k, cos, sin)
        assert cos.shape == want_cos.shape and sin.shape == want_sin.shape
        # (transformers rounds the angles to float32: ids below 64 keep that under 1e-5)
        torch.testing.assert_close(torch.stack([cos, sin]), torch.stack([want_cos, want_sin]), rtol=0, atol=1e-5)
    finally:
        unpatch(model)
    assert len(rope_calls) == 1  # the rotation ran through ropekit, not transformers' function
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", REFUSED, ids=lambda s: "x".join(map(str, s)))
def test_patched_rotary_refuses_what_the_original_refuses(vl, shape):
    model, rotary, _ = vl
    x = torch.randn(B, S, model.config.text_config.hidden_size)
    ids = torch.randint(0, 300, shape)
    with pytest.raises((RuntimeError, IndexError)):  # IndexError: transformers before 5.19
        rotary(x, ids)
    patch(model)
    try:
        with pytest.raises(RuntimeError):
            rotary(x, ids)  # at the call, not at a later read of the tables
    finally:
        unpatch(model)
