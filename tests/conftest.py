"""Test set-up: without CUDA, Triton kernels run under the CPU interpreter (set before triton is imported)."""

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different but reproducible stream per test (crc32, not hash(): str hashes change from run to run):
    # inputs are fresh random data, never zeros, and a failure can be replayed.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    # the float32 path's tables of earlier tests must not stand in for a test's own (some patch how they are built)
    from ropekit.float32_path import POSITION_TABLES, RECENT_TABLES

    RECENT_TABLES.clear()
    POSITION_TABLES.clear()


@pytest.fixture
def plan_calls(monkeypatch):
    """Counts eager calls that a launch plan served (returned outputs rather than handing back to the full path);
    plans start empty."""
    from ropekit import _fastpath

    counter = {"served": 0}
    original = _fastpath.Plan.__call__

    def counting(self, *args):
        out = original(self, *args)
        counter["served"] += out is not None
        return out

    monkeypatch.setattr(_fastpath.Plan, "__call__", counting)
    _fastpath.clear()
    return counter


@pytest.fixture
def rope_calls(monkeypatch):
    """The ``style`` of every rotation a patched transformers model sent through ropekit (a test that never reached
    ropekit proves nothing)."""
    from ropekit.integrations import patching

    calls = []
    original = patching.apply_rope

    def spy(*args, **kwargs):
        calls.append(kwargs.get("style"))
        return original(*args, **kwargs)

    monkeypatch.setattr(patching, "apply_rope", spy)
    return calls
