"""The dependency rule of docs/design.md: lower layers never import higher ones, and ``import ropekit`` needs no
triton.

Each check runs in a fresh Python process with a ``sys.meta_path`` finder installed first that refuses the
modules the imported one must not depend on. The process fails if the import fails or if anything tried to
import a refused module (even where the importer caught the ImportError), and names what did. torch is imported
first (under the finder, so that it sees the refused modules as missing); what it looks up itself is not counted.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

LEAVES = ("ropekit._config", "ropekit._memory", "ropekit._device_cache", "ropekit.frequencies")
SPEC = (*LEAVES, "ropekit._spec")  # the types
VALIDATION = (*SPEC, "ropekit._validation")
# Everything importable from ropekit, bottom to top; subpackages stand for all their modules.
ALL = (*VALIDATION, "ropekit.reference", "ropekit.triton", "ropekit.ops", "ropekit.autograd", "ropekit._fastpath",
       "ropekit.distributed",
       "ropekit.api", "ropekit.attention", "ropekit.mla", "ropekit.webgpu", "ropekit.modules", "ropekit.integrations",
       "ropekit.testing",
       "ropekit.check", "ropekit.plot", "ropekit.bench", "ropekit.cli")
TOP = ("ropekit.check", "ropekit.bench", "ropekit.cli")
ABOVE_API = ("ropekit.modules", "ropekit.integrations", "ropekit.testing", "ropekit.plot", *TOP)


def _except(*allowed: str) -> tuple[str, ...]:
    """Every ropekit module except ``allowed`` (and the packages that contain them)."""
    return tuple(m for m in ALL if m not in allowed)


# module -> ropekit modules (prefixes: a package covers its submodules) it must not import, directly or not.
# The package ``ropekit`` itself is always allowed: its __init__ imports its public names lazily.
RULES = {
    "ropekit._config": _except(*LEAVES),
    "ropekit._memory": _except(*LEAVES),
    "ropekit.frequencies": _except(*LEAVES),
    "ropekit._device_cache": _except(*LEAVES),
    "ropekit._spec": _except(*SPEC),
    "ropekit._validation": _except(*VALIDATION),
    "ropekit.reference": _except(*SPEC, "ropekit.reference"),
    "ropekit.triton.kernel": ALL,  # no ropekit module (ropekit.triton's __init__ and the kernel only)
    "ropekit.triton.runtime": ALL,  # the launch machinery knows no kernel and no spec
    "ropekit.triton.heuristics": _except(*LEAVES),  # device queries and block plans: the process switches only
    # kernels import only the rope kernel's building blocks: no launcher, runtime or heuristics
    "ropekit.triton.prologue_kernels": (*_except("ropekit.triton"), "ropekit.triton.launcher",
                                        "ropekit.triton.prologue_launcher", "ropekit.triton.runtime",
                                        "ropekit.triton.heuristics"),
    "ropekit.triton.launcher": (*_except(*SPEC, "ropekit.triton"), "ropekit.triton.prologue_launcher"),
    "ropekit.ops": ("ropekit.autograd", "ropekit._fastpath", "ropekit.distributed", "ropekit.api", "ropekit.webgpu",
                    *ABOVE_API),
    "ropekit.autograd": ("ropekit._fastpath", "ropekit.distributed", "ropekit.api", "ropekit.webgpu", *ABOVE_API),
    "ropekit._fastpath": ("ropekit.distributed", "ropekit.api", "ropekit.webgpu", *ABOVE_API),
    "ropekit.distributed": ("ropekit.api", "ropekit.webgpu", *ABOVE_API),
    "ropekit.api": ("ropekit.attention", *ABOVE_API),
    "ropekit.attention": ABOVE_API,
    "ropekit.triton.attention_kernels": (*_except("ropekit.triton"), "ropekit.triton.launcher",
                                         "ropekit.triton.prologue_launcher", "ropekit.triton.runtime",
                                         "ropekit.triton.heuristics"),
    # the MLA prologue: a public function on the ops, beside the API (no fast path, no launch plans yet)
    "ropekit.mla": ("ropekit._fastpath", "ropekit.distributed", "ropekit.api", "ropekit.attention", "ropekit.webgpu",
                    *ABOVE_API),
    "ropekit.triton.mla_kernels": (*_except("ropekit.triton"), "ropekit.triton.launcher",
                                   "ropekit.triton.prologue_launcher", "ropekit.triton.runtime",
                                   "ropekit.triton.heuristics", "ropekit.triton.mla_launcher"),
    "ropekit.triton.mla_launcher": (*_except(*SPEC, "ropekit.triton"), "ropekit.triton.prologue_launcher"),
    "ropekit.modules": TOP,
    "ropekit.integrations.transformers": TOP,
}

_FINDER = """
import sys

class Refuse:
    def __init__(self, blocked, allowed):
        self.blocked, self.allowed, self.refused = blocked, allowed, []

    def find_spec(self, name, path=None, target=None):
        if name in self.allowed:
            return None
        if any(name == b or name.startswith(b + ".") for b in self.blocked):
            self.refused.append(name)
            raise ModuleNotFoundError(f"{name} is refused by the dependency rule", name=name)
        return None

refuse = Refuse(BLOCKED, ALLOWED)
sys.meta_path.insert(0, refuse)
"""


# torch is imported under the finder, so that it sees the refused modules as missing, but what it looks up is
# torch's business, not ropekit's: CUDA builds of torch 2.14 ask importlib.util.find_spec("triton") during
# ``import torch`` (to register optional Triton implementations of some operators; nothing is imported), which
# the finder cannot tell from an import. What ropekit tries to import is recorded from here on.
_TORCH_FIRST = """
import torch
refuse.refused.clear()
"""


def _run(blocked: tuple[str, ...], body: str, allowed: tuple[str, ...] = ()) -> None:
    code = (f"BLOCKED, ALLOWED = {tuple(blocked)!r}, {tuple(allowed)!r}\n" + _FINDER + _TORCH_FIRST
            + textwrap.dedent(body)
            + 'if refuse.refused:\n    sys.exit(f"tried to import refused modules: {sorted(set(refuse.refused))}")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(SRC), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("module", sorted(RULES))
def test_module_imports_nothing_above_its_layer(module):
    # The packages on the way to the module (ropekit.triton for ropekit.triton.kernel) are not refused.
    parents = tuple(".".join(module.split(".")[:i]) for i in range(2, module.count(".") + 1))
    _run(RULES[module], f"import {module}\n", allowed=(module, *parents))


def test_import_ropekit_and_rotate_on_cpu_without_triton():
    _run(("triton",), """
        import torch
        import ropekit

        x = torch.randn(1, 4, 2, 8)
        for _ in range(2):  # the second call of a signature is where a launch plan would be recorded
            out = ropekit.apply_rope(x)
        assert out.shape == x.shape and not out.isnan().any()
        """)


@pytest.mark.parametrize("module", ["ropekit.check", "ropekit.testing"])
def test_module_imports_without_triton(module):
    _run(("triton",), f"import {module}\n")


def test_public_functions_share_the_options_of_rope_args():
    """apply_rope, apply_rope_ and rope_backward spell out RopeArgs' fields, in its order, with its defaults and
    annotations (the one place the keywords are written)."""
    import typing

    import ropekit
    from ropekit._spec import RopeArgs

    def options(fn):
        hints = typing.get_type_hints(fn)
        return [(p.name, p.default, hints[p.name]) for p in inspect.signature(fn).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY]

    fields = typing.get_type_hints(RopeArgs)
    want = [(name, default, fields[name]) for name, default in RopeArgs._field_defaults.items()]
    assert len(want) == len(RopeArgs._fields)
    for fn in (ropekit.apply_rope, ropekit.apply_rope_, ropekit.rope_backward):
        assert options(fn) == want, fn.__name__
