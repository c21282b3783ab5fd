"""``ropekit bench``: time ropekit against a copy of the same bytes (the limit) and against peer implementations.

For every case of a preset (model shape x dtype x pairing style x positions x size, see ``benchmarks/registry.py``)
and every mode it asks for, one run times:

* a baseline: ``copy`` (one ``copy_`` moving the case's bytes, a device-to-device memcpy), ``copy-4pass``
  (fwd+bwd: one copy of twice the bytes), ``copy-q`` (decode: one copy of q only), ``add_`` (host: one
  ``x.add_(1)`` call);
* ropekit: ``apply_rope`` with exact in-kernel angles (``ropekit``), with fp32 cos/sin tables (``ropekit-table``),
  in place (``ropekit_``), the raw launcher with preallocated outputs (``ropekit-launcher``) and the transformers
  drop-in (``ropekit-hf``);
* the peers that are present: transformers' ``apply_rotary_pos_emb`` eager (``hf``) and under ``torch.compile``
  (``hf-compile``), Liger's ``liger_rotary_pos_emb`` (``liger``), flash-attn's Triton ``apply_rotary``
  (``flash-attn``). An absent peer, or one that cannot do a case, gets a row saying why.

Modes: ``fwd`` (``triton.testing.do_bench``, which zeroes a 256 MB buffer before every call, so every call starts
with a cold L2), ``fwdbwd`` (forward + ``torch.autograd.grad``), ``decode`` (``do_bench_cudagraph``: many calls
captured in one CUDA graph, time per call), ``host`` (``time.perf_counter`` around many eager calls with no sync
inside the loop). Times are medians.

Before timing, every implementation's output (fwdbwd: its gradients) is compared with ropekit's: ``max_rel_diff``
is ``max|out - ropekit| / max|ropekit|``; above :data:`MISMATCH` the row's note says ``MISMATCH``.

On a machine without CUDA the same code runs on CPU tensors (ropekit's float64 reference path; the Triton launcher
needs ``TRITON_INTERPRET=1``) with a ``timeit`` timer: a smoke run of the harness, labelled
:data:`SMOKE_LABEL` everywhere, never a performance figure.

Output: CSV, JSON and Markdown files with one row per (case, mode, impl), PNG plots (GB/s against tokens, one
line per implementation) and a short table printed last.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as _dt
import fnmatch
import hashlib
import importlib
import importlib.util
import json
import math
import platform
import re
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

try:  # Triton is optional on CPU-only installs; on CUDA it ships with torch.
    import triton
    import triton.language as tl
    import triton.testing as triton_testing
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = triton_testing = None

SMOKE_LABEL = "CPU smoke — not a performance figure"
NO_TARGETS_LINE = "Targets not evaluated: CPU timings are not performance figures (targets need a CUDA GPU)."
NO_CUDA_MESSAGE = ("ropekit bench: benchmarks need a CUDA GPU, and torch sees none here. To smoke-test the harness "
                   "on CPU instead (timings are not performance figures): ropekit bench --preset smoke "
                   "(or --device cpu)")
PERF_LABEL = "performance"
MISMATCH = 0.05  # max|out - ropekit| / max|ropekit| above which a row is flagged
REGISTRY_PATH = Path("benchmarks") / "registry.py"
FLASH_ROTARY_PATH = Path(".peers") / "flash_attn_rotary.py"
MODES = ("fwd", "fwdbwd", "decode", "host")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
POSITION_KINDS = ("range", "offset", "batch", "ids", "thd")
POSITION_OFFSET = 1000  # the int offset of positions="offset"
MAX_CACHE_LEN = 4096  # per-sequence offsets of positions="batch" are drawn from [0, MAX_CACHE_LEN)

# The baseline each mode's ratio_vs_copy divides by, and extra reference rows timed in that mode.
BASELINE = {"fwd": "copy", "fwdbwd": "copy-4pass", "decode": "copy-q", "host": "add_"}
EXTRA_BASELINES = {"decode": ("copy",), "host": ("triton-launch",)}
ROPEKIT_IMPLS = ("ropekit", "ropekit-table", "ropekit_", "ropekit-launcher", "ropekit-hf")
PEER_IMPLS = ("hf", "hf-compile", "liger", "flash-attn")
MODE_IMPLS = {
    "fwd": ("ropekit", "ropekit-table", "ropekit_", "ropekit-hf") + PEER_IMPLS,
    "fwdbwd": ("ropekit", "ropekit-table", "ropekit-hf") + PEER_IMPLS,
    "decode": ROPEKIT_IMPLS + PEER_IMPLS,
    "host": ROPEKIT_IMPLS + PEER_IMPLS,
}

ROW_FIELDS = (
    "gpu", "date", "torch", "triton", "ropekit", "commit", "case", "mode", "impl", "tokens", "bytes", "median_us",
    "gbps", "ratio_vs_copy", "baseline", "model", "dtype", "style", "positions", "batch", "seqlen", "hq", "hk",
    "head_dim", "rotary_dim", "rotary_at", "max_rel_diff", "label", "note", "impl_version",
)

# A small registry for installs without the repository's benchmarks/ folder (same format as the file).
BUILTIN_REGISTRY: dict[str, Any] = {
    "MODELS": {
        "llama3-8b": {"hq": 32, "hk": 8, "head_dim": 128, "base": 500000.0, "about": "Llama-3-8B"},
        "tiny": {"hq": 4, "hk": 2, "head_dim": 32, "base": 10000.0, "about": "CPU smoke only"},
    },
    "SIZES": {"decode": [[1, 1], [64, 1]]},
    "PRESETS": {
        "quick": [
            {"name": "fwd-large", "models": ["llama3-8b"], "dtypes": ["bf16"], "styles": ["neox"],
             "positions": ["range"], "sizes": [[8, 4096]], "modes": ["fwd"]},
            {"name": "fwd-cold", "models": ["llama3-8b"], "dtypes": ["bf16"], "styles": ["neox"],
             "positions": ["range"], "sizes": [[1, 2048], [4, 4096]], "modes": ["fwd"]},
            {"name": "fwdbwd", "models": ["llama3-8b"], "dtypes": ["bf16"], "styles": ["neox"],
             "positions": ["range"], "sizes": [[4, 4096]], "modes": ["fwdbwd"]},
            {"name": "decode", "models": ["llama3-8b"], "dtypes": ["bf16"], "styles": ["neox"],
             "positions": ["batch"], "sizes": "decode", "modes": ["decode"]},
            {"name": "host", "models": ["llama3-8b"], "dtypes": ["bf16"], "styles": ["neox"],
             "positions": ["batch"], "sizes": [[1, 1]], "modes": ["host"]},
        ],
        "smoke": [
            {"name": "smoke", "models": ["tiny"], "dtypes": ["fp32"], "styles": ["neox"], "positions": ["range"],
             "sizes": [[1, 16]], "modes": ["fwd", "fwdbwd"]},
            {"name": "smoke-decode", "models": ["tiny"], "dtypes": ["fp32"], "styles": ["neox"],
             "positions": ["batch"], "sizes": [[2, 1]], "modes": ["decode", "host"]},
        ],
    },
}


# ----------------------------------------------------------------------------------------------------------------
# Registry and cases
# ----------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One problem: a model's attention shape at one dtype, pairing, position kind and size."""

    group: str  # the preset group that asked for it
    family: str  # the size family (SIZES name or the group name); cases of a series differ only in size
    model: str
    hq: int
    hk: int
    head_dim: int
    rotary_dim: int
    rotary_at: str
    base: float
    dtype: str
    style: str
    positions: str
    batch: int
    seqlen: int
    modes: tuple[str, ...]
    impls: Optional[tuple[str, ...]] = None

    @property
    def tokens(self) -> int:
        return self.batch * self.seqlen

    @property
    def name(self) -> str:
        return f"{self.model}/{self.dtype}/{self.style}/{self.positions}/{self.batch}x{self.seqlen}"

    @property
    def series(self) -> str:
        """The plot line group: the name without the size."""
        return f"{self.model}/{self.dtype}/{self.style}/{self.positions}/{self.family}"


def find_repo_root() -> Optional[Path]:
    """The repository root holding ``benchmarks/registry.py``: above this file, else the working directory or one of
    its parents; None for an install without the repository."""
    here = Path(__file__).resolve()
    for base in [here.parents[2], Path.cwd(), *Path.cwd().parents]:
        if (base / REGISTRY_PATH).is_file():
            return base
    return None


def load_registry(path: Optional[str] = None) -> dict[str, Any]:
    """MODELS, SIZES and PRESETS from ``path``, else from the repository's ``benchmarks/registry.py``, else the
    built-in fallback. The result has a ``source`` key naming where it came from."""
    if path is None:
        root = find_repo_root()
        if root is None:
            return dict(BUILTIN_REGISTRY, source="built-in")
        file = root / REGISTRY_PATH
    else:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"registry file not found: {file}")
    spec = importlib.util.spec_from_file_location("ropekit_bench_registry", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    registry = {key: getattr(module, key) for key in ("MODELS", "SIZES", "PRESETS")}
    return dict(registry, source=str(file))


def expand_preset(registry: dict[str, Any], preset: str) -> list[Case]:
    """Every case of ``preset``, group by group; a (case, mode) pair that an earlier group asked for is not
    repeated."""
    presets = registry["PRESETS"]
    if preset not in presets:
        raise ValueError(f"unknown preset {preset!r}; the registry has {sorted(presets)}")
    cases: list[Case] = []
    seen: set[tuple[str, str]] = set()  # (case name, mode) pairs already asked for by an earlier group
    for group in presets[preset]:
        sizes = group["sizes"]
        family = sizes if isinstance(sizes, str) else group["name"]
        if isinstance(sizes, str):
            sizes = registry["SIZES"][sizes]
        modes = tuple(group["modes"])
        for mode in modes:
            if mode not in MODES:
                raise ValueError(f"group {group['name']!r}: unknown mode {mode!r} (modes: {MODES})")
        for model_name in group["models"]:
            model = registry["MODELS"][model_name]
            for dtype in group["dtypes"]:
                if dtype not in DTYPES:
                    raise ValueError(f"group {group['name']!r}: unknown dtype {dtype!r}")
                for style in group["styles"]:
                    for positions in group["positions"]:
                        if positions not in POSITION_KINDS:
                            raise ValueError(f"group {group['name']!r}: unknown positions {positions!r}")
                        for batch, seqlen in sizes:
                            case = Case(
                                group=group["name"], family=family, model=model_name, hq=model["hq"],
                                hk=model["hk"], head_dim=model["head_dim"],
                                rotary_dim=model.get("rotary_dim", model["head_dim"]),
                                rotary_at=model.get("rotary_at", "front"), base=float(model["base"]), dtype=dtype,
                                style=style, positions=positions, batch=int(batch), seqlen=int(seqlen), modes=modes,
                                impls=tuple(group["impls"]) if group.get("impls") else None)
                            fresh = tuple(m for m in modes if (case.name, m) not in seen)
                            seen.update((case.name, m) for m in fresh)
                            if fresh:
                                cases.append(dataclasses.replace(case, modes=fresh))
    return cases


def select_cases(cases: list[Case], *, groups: Optional[str], pattern: Optional[str], modes: Optional[str],
                 shard: Optional[str]) -> list[Case]:
    """Cases whose group matches one of the comma-separated ``groups`` globs, whose name matches the ``pattern``
    regex, restricted to ``modes``; then shard ``I/N`` (1-based) of the rest."""
    if groups:
        globs = [g.strip() for g in groups.split(",") if g.strip()]
        cases = [c for c in cases if any(fnmatch.fnmatch(c.group, g) or fnmatch.fnmatch(c.name, g) for g in globs)]
    if pattern:
        rx = re.compile(pattern)
        cases = [c for c in cases if rx.search(c.name)]
    if modes:
        wanted = [m.strip() for m in modes.split(",") if m.strip()]
        for m in wanted:
            if m not in MODES:
                raise ValueError(f"unknown mode {m!r}; modes are {MODES}")
        cases = [dataclasses.replace(c, modes=tuple(m for m in c.modes if m in wanted)) for c in cases]
        cases = [c for c in cases if c.modes]
    if shard:
        match = re.fullmatch(r"(\d+)/(\d+)", shard)
        if not match or not 1 <= int(match.group(1)) <= int(match.group(2)):
            raise ValueError(f"--shard must be I/N with 1 <= I <= N, got {shard!r}")
        i, n = int(match.group(1)), int(match.group(2))
        cases = cases[i - 1::n]
    return cases


# ----------------------------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------------------------

def _git_commit(root: Optional[Path]) -> str:
    if root is None:
        return "unknown"
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: torch.device, commit: Optional[str]) -> dict[str, Any]:
    """GPU, date, versions and commit stamped on every row."""
    from ropekit._version import __version__

    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    else:
        gpu = f"none (CPU {platform.machine()})"
    return {
        "gpu": gpu,
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "torch": torch.__version__,
        "triton": getattr(triton, "__version__", "absent"),
        "ropekit": __version__,
        "commit": commit or _git_commit(find_repo_root()),
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
        "label": PERF_LABEL if device.type == "cuda" else SMOKE_LABEL,
    }


# ----------------------------------------------------------------------------------------------------------------
# Peers
# ----------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Peers:
    """Peer functions that could be imported; ``missing`` says why the others are absent."""

    hf_neox: Optional[Callable] = None  # transformers' Llama apply_rotary_pos_emb (rotate_half pairing)
    hf_interleaved: Optional[Callable] = None  # transformers' Cohere apply_rotary_pos_emb (interleaved pairing)
    liger: Optional[Callable] = None
    flash: Optional[Callable] = None  # flash-attn's apply_rotary
    ropekit_hf: Optional[Callable] = None
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    missing: dict[str, str] = dataclasses.field(default_factory=dict)


def load_peers(wanted: set[str], flash_path: Optional[str]) -> Peers:
    """Import the peers among ``wanted`` implementation names; each one is optional."""
    peers = Peers()
    if wanted & {"hf", "hf-compile"}:
        try:
            import transformers
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_llama

            peers.hf_neox = hf_llama
            peers.versions["transformers"] = transformers.__version__
            try:
                from transformers.models.cohere.modeling_cohere import apply_rotary_pos_emb as hf_cohere

                peers.hf_interleaved = hf_cohere
            except ImportError as exc:
                peers.missing["hf (interleaved)"] = f"transformers' Cohere function not importable: {exc}"
        except ImportError as exc:
            peers.missing["hf"] = f"transformers not importable: {exc}"
    if "liger" in wanted:
        try:
            from liger_kernel.transformers.rope import liger_rotary_pos_emb

            peers.liger = liger_rotary_pos_emb
            peers.versions["liger"] = _dist_version("liger-kernel")
        except ImportError as exc:
            peers.missing["liger"] = f"liger_kernel not importable: {exc}"
    if "flash-attn" in wanted:
        peers.flash, peers.versions["flash-attn"], why = _load_flash_rotary(flash_path)
        if peers.flash is None:
            peers.missing["flash-attn"] = why
            del peers.versions["flash-attn"]
    if "ropekit-hf" in wanted:
        try:
            from ropekit.integrations.transformers import apply_rotary_pos_emb as ropekit_hf

            peers.ropekit_hf = ropekit_hf
        except ImportError as exc:
            peers.missing["ropekit-hf"] = f"ropekit.integrations.transformers not importable: {exc}"
    return peers


def _dist_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - a version string is best effort
        return "unknown"


def _load_flash_rotary(explicit: Optional[str]) -> tuple[Optional[Callable], str, str]:
    """flash-attn's Triton ``apply_rotary``: from a file (``--flash-attn-rotary``, else ``.peers/`` of the
    repository or working directory), else from an installed flash_attn. Returns (fn, version, why-absent)."""
    candidates = [Path(explicit)] if explicit else []
    root = find_repo_root()
    for base in ([root] if root else []) + [Path.cwd()]:
        candidates.append(base / FLASH_ROTARY_PATH)
    for file in candidates:
        if file.is_file():
            try:
                spec = importlib.util.spec_from_file_location("ropekit_bench_flash_rotary", file)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            except Exception as exc:  # noqa: BLE001 - a peer that fails to load is skipped
                return None, "", f"loading {file.name} failed: {type(exc).__name__}: {exc}"
            digest = hashlib.sha256(file.read_bytes()).hexdigest()[:12]
            return module.apply_rotary, f"file {file.name} sha256 {digest}", ""
    try:
        module = importlib.import_module("flash_attn.ops.triton.rotary")
        return module.apply_rotary, _dist_version("flash-attn"), ""
    except Exception as exc:  # noqa: BLE001
        return None, "", (f"no {FLASH_ROTARY_PATH} and flash_attn not importable ({type(exc).__name__}); "
                          "pass --flash-attn-rotary FILE")


# ----------------------------------------------------------------------------------------------------------------
# Inputs and the bytes model
# ----------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Inputs:
    """The tensors of one case, built once and shared by every implementation."""

    case: Case
    device: torch.device
    dtype: torch.dtype
    layout: str  # "bshd" or "thd"
    q: Tensor
    k: Tensor
    positions: Any  # what apply_rope's ``positions`` gets: None, an int or a tensor
    cu_seqlens: Optional[Tensor]
    max_seqlen: int
    pos_grid: Tensor  # int64 position of every token, [B, S] ([1, T] for thd)
    inv_freq: Tensor  # fp32 [R/2], the frequencies every implementation uses
    cos_tab: Tensor  # fp32 [P, R/2] indexed by position
    sin_tab: Tensor
    _hf: Optional[tuple[Tensor, Tensor]] = None

    @property
    def rotary_start(self) -> int:
        c = self.case
        return 0 if c.rotary_at == "front" else c.head_dim - c.rotary_dim

    def rope_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``apply_rope`` for this case (exact in-kernel angles)."""
        c = self.case
        return dict(positions=self.positions, base=c.base, style=c.style, layout=self.layout,
                    rotary_dim=c.rotary_dim, rotary_at=c.rotary_at, cu_seqlens=self.cu_seqlens)

    def hf_tables(self) -> tuple[Tensor, Tensor]:
        """transformers' convention: cos/sin [Bc, S, R] (thd: [1, T, R]) in the input dtype, gathered per token,
        duplicated halves for neox and repeat-interleaved for the interleaved pairing. Bc = 1 where every
        sequence has the same positions (what a model's rotary embedding returns for position_ids [1, S])."""
        if self._hf is None:
            grid = self.pos_grid
            if self.case.positions in ("range", "offset"):
                grid = grid[:1]
            angle = grid.to(torch.float64)[..., None] * self.inv_freq.to(torch.float64)
            if self.case.style == "neox":
                angle = torch.cat([angle, angle], dim=-1)
            else:
                angle = torch.repeat_interleave(angle, 2, dim=-1)
            self._hf = (torch.cos(angle).to(self.dtype), torch.sin(angle).to(self.dtype))
        return self._hf

    def to_hf(self, x: Tensor) -> Tensor:
        """A [B, H, S, D] view (thd: [1, H, T, D]) of a tensor in the case layout; no copy."""
        return (x.unsqueeze(0) if self.layout == "thd" else x).transpose(1, 2)

    def from_hf(self, x: Tensor) -> Tensor:
        """The inverse of :meth:`to_hf`."""
        y = x.transpose(1, 2)
        return y[0] if self.layout == "thd" else y


def varlen_lengths(batch: int, seqlen: int) -> list[int]:
    """``batch`` unequal sequence lengths summing to ``batch * seqlen``: pairs of 1.5 S and 0.5 S."""
    lengths = [seqlen] * batch
    for i in range(0, batch - 1, 2):
        lengths[i] = seqlen + seqlen // 2
        lengths[i + 1] = seqlen - seqlen // 2
    return lengths


def make_inputs(case: Case, device: torch.device, seed: int = 0) -> Inputs:
    """Random q/k and the case's positions, tables and frequencies (fp32 ``inv_freq`` as ropekit's default)."""
    gen = torch.Generator().manual_seed(seed)  # positions, on the host
    dtype = DTYPES[case.dtype]
    B, S, D, R = case.batch, case.seqlen, case.head_dim, case.rotary_dim
    layout = "thd" if case.positions == "thd" else "bshd"
    lead = (B * S,) if layout == "thd" else (B, S)
    q, k = _randn(device, seed, (*lead, case.hq, D), (*lead, case.hk, D), dtype=dtype)
    base_pos = torch.arange(S, dtype=torch.int64)
    cu_seqlens, max_seqlen, positions = None, S, None
    if case.positions == "range":
        grid = base_pos.expand(B, S)
    elif case.positions == "offset":
        positions = POSITION_OFFSET
        grid = (base_pos + POSITION_OFFSET).expand(B, S)
    elif case.positions == "batch":
        offsets = torch.randint(0, MAX_CACHE_LEN, (B,), generator=gen, dtype=torch.int64)
        grid = base_pos[None, :] + offsets[:, None]
        positions = offsets.to(device)
    elif case.positions == "ids":
        offsets = torch.randint(0, MAX_CACHE_LEN, (B,), generator=gen, dtype=torch.int64)
        grid = base_pos[None, :] + offsets[:, None]
        positions = grid.contiguous().to(device)
    else:  # thd
        lengths = varlen_lengths(B, S)
        cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        grid = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])[None, :]
        cu_seqlens = cu.to(device=device, dtype=torch.int32)
        max_seqlen = max(lengths)
    rows = int(grid.max()) + 1 if grid.numel() else 1
    exponent = torch.arange(0, R, 2, dtype=torch.int64).to(torch.float32) / R
    inv_freq = 1.0 / (case.base ** exponent)
    angle = torch.arange(rows, dtype=torch.float64)[:, None] * inv_freq.to(torch.float64)
    return Inputs(case=case, device=device, dtype=dtype, layout=layout, q=q, k=k, positions=positions,
                  cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, pos_grid=grid.contiguous().to(device),
                  inv_freq=inv_freq.to(device), cos_tab=torch.cos(angle).to(torch.float32).to(device),
                  sin_tab=torch.sin(angle).to(torch.float32).to(device))


def case_bytes(case: Case) -> dict[str, int]:
    """:func:`bytes_model` from the case alone (no tensors): what ``--list`` prints and the tests check."""
    elem = DTYPES[case.dtype].itemsize
    qk = case.tokens * (case.hq + case.hk) * case.head_dim * elem
    extra = (case.rotary_dim // 2) * 4
    if case.positions == "batch":
        extra += case.batch * 8
    elif case.positions == "ids":
        extra += case.tokens * 8
    elif case.positions == "thd":
        extra += (case.batch + 1) * 4
    fwd = 2 * qk + extra
    return {"fwd": fwd, "fwdbwd": 2 * fwd, "decode": fwd, "host": fwd}


def _randn(device: torch.device, seed: int, *shapes: tuple[int, ...], dtype: torch.dtype) -> list[Tensor]:
    """Standard normal tensors drawn on ``device`` (drawing gigabytes on the host would take seconds)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(shape, generator=gen, device=device, dtype=dtype) for shape in shapes]


def bytes_model(inp: Inputs) -> dict[str, int]:
    """Bytes each mode must move at the least (the same figure for every implementation of a case):

    * ``fwd``: q and k read once and written once, plus the position data ropekit reads (offsets, position ids or
      cu_seqlens) and the fp32 ``inv_freq``; exact angles need no table.
    * ``fwdbwd``: twice that (the backward reads the output gradients and writes the input gradients).
    * ``decode``, ``host``: as ``fwd``.
    """
    qk = (inp.q.numel() + inp.k.numel()) * inp.q.element_size()
    extra = inp.inv_freq.numel() * inp.inv_freq.element_size()
    for t in (inp.positions, inp.cu_seqlens):
        if isinstance(t, Tensor):
            extra += t.numel() * t.element_size()
    fwd = 2 * qk + extra
    return {"fwd": fwd, "fwdbwd": 2 * fwd, "decode": fwd, "host": fwd}


# ----------------------------------------------------------------------------------------------------------------
# Implementations
# ----------------------------------------------------------------------------------------------------------------

class Unsupported(Exception):
    """An implementation that cannot do a case (the message says why); the row is kept with the reason."""


@dataclasses.dataclass
class Bench:
    """A prepared implementation: ``run`` is what is timed; ``result`` gives fresh outputs (fwdbwd: gradients) in
    the case layout for the check against ropekit."""

    run: Callable[[], Any]
    result: Optional[Callable[[], tuple[Tensor, ...]]] = None
    bytes: Optional[int] = None  # baselines move their own bytes
    note: str = ""


def _flat_copy(inp: Inputs, nbytes: int) -> Bench:
    """One ``copy_`` moving ``nbytes`` (half read, half written) between preallocated contiguous buffers: torch
    issues it as a device-to-device memcpy."""
    elem = inp.q.element_size()
    n = max(1, math.ceil(nbytes / (2 * elem)))
    src = torch.empty(n, dtype=inp.dtype, device=inp.device).normal_()
    dst = torch.empty_like(src)
    return Bench(run=lambda: dst.copy_(src), bytes=2 * n * elem)


def build_baseline(name: str, inp: Inputs, nbytes: dict[str, int]) -> Bench:
    if name == "copy":
        return _flat_copy(inp, nbytes["fwd"])
    if name == "copy-4pass":
        b = _flat_copy(inp, nbytes["fwdbwd"])
        b.note = "ideal fwd+bwd: one copy of 4 passes over q and k"
        return b
    if name == "copy-q":
        q_out = torch.empty_like(inp.q)
        return Bench(run=lambda: q_out.copy_(inp.q), bytes=2 * inp.q.numel() * inp.q.element_size(),
                     note="one copy_ of q alone (a device-to-device memcpy)")
    if name == "add_":
        x = torch.zeros_like(inp.q)
        return Bench(run=lambda: x.add_(1), note="x.add_(1), x shaped like q")
    if name == "triton-launch":
        if _empty_kernel is None:
            raise Unsupported("triton not importable")
        _need_triton_device(inp.device)
        x = torch.zeros(1, device=inp.device)

        def launch() -> None:
            _empty_kernel[(1,)](x, 3, 5, 7, 9, 11, 13, 15, 17, 19)

        return Bench(run=launch, note="a bare kernel[grid](...) launch with 10 arguments")
    raise ValueError(name)


def _grad_outputs(inp: Inputs) -> tuple[Tensor, Tensor]:
    gq, gk = _randn(inp.device, 1, tuple(inp.q.shape), tuple(inp.k.shape), dtype=inp.dtype)
    return gq, gk


def _leaves(inp: Inputs) -> tuple[Tensor, Tensor]:
    return inp.q.detach().clone().requires_grad_(True), inp.k.detach().clone().requires_grad_(True)


def _autograd_bench(inp: Inputs, forward: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
                    grads_in_hf_layout: bool = False) -> Bench:
    """fwd+bwd: ``forward`` on leaf copies of q and k, then ``torch.autograd.grad`` with preallocated output
    gradients (no accumulation into ``.grad``)."""
    q_l, k_l = _leaves(inp)
    gq, gk = _grad_outputs(inp)
    if grads_in_hf_layout:
        gq, gk = inp.to_hf(gq), inp.to_hf(gk)

    def run() -> tuple[Tensor, Tensor]:
        outs = forward(q_l, k_l)
        return torch.autograd.grad(outs, (q_l, k_l), (gq, gk))

    def result() -> tuple[Tensor, Tensor]:
        # Fresh leaves and gradient copies: some peers write into their inputs or incoming gradients.
        ql, kl = _leaves(inp)
        outs = forward(ql, kl)
        return tuple(torch.autograd.grad(outs, (ql, kl), (gq.clone(), gk.clone())))

    return Bench(run=run, result=result)


def build_ropekit(name: str, inp: Inputs, mode: str, peers: Peers) -> Bench:
    """ropekit's entry points."""
    import ropekit

    c = inp.case
    kw = inp.rope_kwargs()
    if name == "ropekit-table":
        kw = dict(kw, base=10000.0, cos=inp.cos_tab, sin=inp.sin_tab)
    if name in ("ropekit", "ropekit-table"):
        note = "exact in-kernel angles" if name == "ropekit" else "fp32 cos/sin tables [P, R/2]"
        if mode == "fwdbwd":
            b = _autograd_bench(inp, lambda q, k: ropekit.apply_rope(q, k, **kw))
            b.note = note
            return b
        fn = lambda: ropekit.apply_rope(inp.q, inp.k, **kw)  # noqa: E731
        return Bench(run=fn, result=fn, note=note)
    if name == "ropekit_":
        q2, k2 = inp.q.clone(), inp.k.clone()

        def result() -> tuple[Tensor, Tensor]:
            return ropekit.apply_rope_(inp.q.clone(), inp.k.clone(), **kw)

        return Bench(run=lambda: ropekit.apply_rope_(q2, k2, **kw), result=result, note="in place")
    if name == "ropekit-launcher":
        if triton is None:
            raise Unsupported("triton not importable")
        _need_triton_device(inp.device)
        from ropekit.triton.launcher import launch_rope

        lkw: dict[str, Any] = dict(layout=inp.layout, style=c.style, freq_mode="inv_freq", rotary_dim=c.rotary_dim,
                                   rotary_start=inp.rotary_start, inv_freq=inp.inv_freq, cu_seqlens=inp.cu_seqlens)
        if isinstance(inp.positions, int):
            lkw["pos_offset"] = inp.positions
        elif c.positions == "batch":
            lkw["seq_offsets"] = inp.positions
        elif c.positions == "ids":
            lkw["positions"] = inp.positions
        q_out, k_out = torch.empty_like(inp.q), torch.empty_like(inp.k)

        def launch() -> None:
            launch_rope(inp.q, inp.k, q_out, k_out, **lkw)

        def result() -> tuple[Tensor, Tensor]:
            qo, ko = torch.empty_like(inp.q), torch.empty_like(inp.k)
            launch_rope(inp.q, inp.k, qo, ko, **lkw)
            return qo, ko

        return Bench(run=launch, result=result, note="raw launcher, preallocated outputs, exact angles")
    if name == "ropekit-hf":
        if peers.ropekit_hf is None:
            raise Unsupported(peers.missing.get("ropekit-hf", "absent"))
        if c.style != "neox" or c.rotary_dim != c.head_dim:
            raise Unsupported("the transformers drop-in takes transformers' full-width NeoX cos/sin")
        return _hf_style_bench(inp, mode, peers.ropekit_hf, note="transformers drop-in, cos/sin as transformers")
    raise ValueError(name)


def _hf_function(inp: Inputs, peers: Peers) -> tuple[Callable, str]:
    """transformers' function for the case's pairing, wrapped for a partial rotary span the way transformers'
    models do it (slice, rotate, concatenate)."""
    c = inp.case
    if c.style == "neox":
        fn, note = peers.hf_neox, "Llama apply_rotary_pos_emb"
        if fn is None:
            raise Unsupported(peers.missing.get("hf", "absent"))
    else:
        fn, note = peers.hf_interleaved, "Cohere apply_rotary_pos_emb (interleaved pairing, fp32 math)"
        if fn is None:
            raise Unsupported(peers.missing.get("hf (interleaved)", peers.missing.get("hf", "absent")))
    if c.rotary_dim == c.head_dim:
        return fn, note
    lo = inp.rotary_start
    hi = lo + c.rotary_dim

    def partial(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        qr, kr = fn(q[..., lo:hi], k[..., lo:hi], cos, sin)
        return (torch.cat([q[..., :lo], qr, q[..., hi:]], dim=-1),
                torch.cat([k[..., :lo], kr, k[..., hi:]], dim=-1))

    return partial, note + "; partial rotary by slice + cat"


def _hf_style_bench(inp: Inputs, mode: str, fn: Callable, note: str, inplace: bool = False) -> Bench:
    """A function with transformers' calling convention: q/k [B, H, S, D] views of the case tensors, cos/sin
    [Bc, S, R] in the input dtype."""
    cos, sin = inp.hf_tables()
    if mode == "fwdbwd":
        b = _autograd_bench(inp, lambda q, k: fn(inp.to_hf(q), inp.to_hf(k), cos, sin), grads_in_hf_layout=True)
        b.note = note
        return b

    def result() -> tuple[Tensor, Tensor]:
        qo, ko = fn(inp.to_hf(inp.q.clone()), inp.to_hf(inp.k.clone()), cos, sin)
        return inp.from_hf(qo), inp.from_hf(ko)

    if inplace:  # rotate private copies over and over
        q2, k2 = inp.to_hf(inp.q.clone()), inp.to_hf(inp.k.clone())
    else:
        q2, k2 = inp.to_hf(inp.q), inp.to_hf(inp.k)
    return Bench(run=lambda: fn(q2, k2, cos, sin), result=result, note=note)


class _FlashRotaryFn(torch.autograd.Function):
    """Autograd around flash-attn's ``apply_rotary`` as its own layer does it: the backward is the same call with
    ``conjugate=True``."""

    @staticmethod
    def forward(ctx, x, apply_rotary, kwargs):  # noqa: D102
        ctx.apply_rotary, ctx.kwargs = apply_rotary, kwargs
        return apply_rotary(x, **kwargs)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return ctx.apply_rotary(grad, **ctx.kwargs, conjugate=True), None, None


def build_peer(name: str, inp: Inputs, mode: str, peers: Peers) -> Bench:
    """The peers, called with the same tensors (as views in their own layouts) and the same positions."""
    c = inp.case
    if name in ("hf", "hf-compile"):
        fn, note = _hf_function(inp, peers)
        if name == "hf-compile":
            torch.compiler.reset()  # a fresh, shape-specialised compile per case
            fn = torch.compile(fn, dynamic=False, fullgraph=True)
            note = "torch.compile(fullgraph, static shapes) of " + note
        bench = _hf_style_bench(inp, mode, fn, note)
        if name == "hf-compile":  # compile outside the timed region
            t0 = time.perf_counter()
            bench.run()
            _sync(inp.device)
            bench.note += f"; compiled in {time.perf_counter() - t0:.1f} s"
        return bench
    if name == "liger":
        if peers.liger is None:
            raise Unsupported(peers.missing.get("liger", "absent"))
        if c.style != "neox":
            raise Unsupported("Liger rotates NeoX pairs only")
        if c.rotary_at != "front":
            raise Unsupported("Liger rotates the leading columns only (no rotary_at='back')")
        return _hf_style_bench(inp, mode, peers.liger, "in place (writes into the caller's q/k); cos/sin as "
                               "transformers", inplace=True)
    if name == "flash-attn":
        if peers.flash is None:
            raise Unsupported(peers.missing.get("flash-attn", "absent"))
        if c.positions == "ids":
            raise Unsupported("flash-attn's rotary takes offsets, not per-token position ids")
        if c.rotary_at != "front":
            raise Unsupported("flash-attn rotates the leading columns only (no rotary_at='back')")
        if c.head_dim > 256:
            raise Unsupported("flash-attn's rotary supports head_dim <= 256")
        offsets: Any = 0
        if isinstance(inp.positions, int):
            offsets = inp.positions
        elif c.positions == "batch":
            offsets = inp.positions
        kw = dict(cos=inp.cos_tab.to(inp.dtype), sin=inp.sin_tab.to(inp.dtype), seqlen_offsets=offsets,
                  cu_seqlens=inp.cu_seqlens, max_seqlen=inp.max_seqlen if inp.cu_seqlens is not None else None,
                  interleaved=c.style == "interleaved")
        apply_rotary = peers.flash
        note = "two launches (q, then k); cos/sin [P, R/2] in the input dtype"
        if mode == "fwdbwd":
            b = _autograd_bench(inp, lambda q, k: (_FlashRotaryFn.apply(q, apply_rotary, kw),
                                                   _FlashRotaryFn.apply(k, apply_rotary, kw)))
            b.note = note + "; autograd wrapper as flash-attn's layer (backward: conjugate=True)"
            return b
        fn = lambda: (apply_rotary(inp.q, **kw), apply_rotary(inp.k, **kw))  # noqa: E731
        return Bench(run=fn, result=fn, note=note)
    raise ValueError(name)


def _need_triton_device(device: torch.device) -> None:
    # Without a driver a launch fails with "0 active drivers": say what would make it run instead.
    if device.type != "cuda" and not _interpreting():
        raise Unsupported("Triton launches need a CUDA GPU (on CPU: set TRITON_INTERPRET=1)")


def build(name: str, inp: Inputs, mode: str, peers: Peers) -> Bench:
    if name in ROPEKIT_IMPLS:
        return build_ropekit(name, inp, mode, peers)
    return build_peer(name, inp, mode, peers)


if triton is not None:
    @triton.jit
    def _empty_kernel(x_ptr, a0, a1, a2, a3, a4, a5, a6, a7, a8):
        """Does nothing (the store never runs): the price of a bare ``kernel[grid](...)`` launch."""
        if tl.program_id(0) < 0:
            tl.store(x_ptr, a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8)
else:  # pragma: no cover
    _empty_kernel = None


# ----------------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Timer:
    """Medians in microseconds. CUDA: ``do_bench`` (cold L2) and ``do_bench_cudagraph``; CPU: ``timeit``."""

    device: torch.device
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    graph_rep_ms: float = 50.0
    host_rounds: int = 7
    host_round_s: float = 0.05
    host_warm_calls: int = 20

    def kernel(self, fn: Callable[[], Any]) -> float:
        if self.device.type == "cuda":
            return 1e3 * triton_testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")
        return self._cpu(fn)

    def graph(self, fn: Callable[[], Any]) -> float:
        if self.device.type == "cuda":
            return 1e3 * triton_testing.do_bench_cudagraph(fn, rep=self.graph_rep_ms, return_mode="median")
        return self._cpu(fn)

    def host(self, fn: Callable[[], Any]) -> float:
        """Host time per eager call: many calls, no sync inside the loop, a sync between rounds (untimed)."""
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else (lambda: None)
        n = self.host_warm_calls
        for _ in range(n):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per_call = max((time.perf_counter() - t0) / n, 1e-7)
        sync()
        number = int(min(5000, max(1, self.host_round_s / per_call)))
        rounds = timeit.Timer(fn, setup=sync).repeat(repeat=self.host_rounds, number=number)
        sync()
        return 1e6 * statistics.median(rounds) / number

    def _cpu(self, fn: Callable[[], Any]) -> float:
        """CPU smoke timing: a warm call, then the median of three."""
        fn()
        return 1e6 * statistics.median(timeit.Timer(fn).repeat(repeat=3, number=1))


# ----------------------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------------------

def _rel_diff(outs: Sequence[Tensor], refs: Sequence[Tensor]) -> float:
    worst = 0.0
    for out, ref in zip(outs, refs):
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        diff = float(torch.sub(out.to(ref.dtype), ref).abs().max()) if ref.numel() else 0.0
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def run_case(case: Case, device: torch.device, timer: Timer, peers: Peers, env: dict[str, Any],
             impl_globs: Optional[list[str]], log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every mode of ``case``: baselines first, then ropekit and the peers; one row each. Each implementation is
    built, checked against ropekit's output, timed and freed before the next one (memory stays at the inputs,
    ropekit's reference output and one implementation)."""
    rows: list[dict[str, Any]] = []
    inp = make_inputs(case, device)
    nbytes = bytes_model(inp)
    for mode in case.modes:
        names = [n for n in MODE_IMPLS[mode] if (case.impls is None or n in case.impls)
                 and (impl_globs is None or any(fnmatch.fnmatch(n, g) for g in impl_globs))]
        order = [(n, True) for n in (BASELINE[mode], *EXTRA_BASELINES.get(mode, ()))] + [(n, False) for n in names]
        mode_rows: list[dict[str, Any]] = []
        times: dict[str, float] = {}
        # fwd/decode/host run without autograd, as inference does; fwd+bwd with it. torch.compile warms up in
        # the same grad mode as the calls it times.
        with torch.enable_grad() if mode == "fwdbwd" else torch.no_grad():
            refs = None
            if "ropekit" in names:
                ref_bench = _try_build(build, "ropekit", inp, mode, peers)
                if isinstance(ref_bench, Bench):
                    got = _try_build(ref_bench.result)
                    refs = tuple(t.detach() for t in got) if isinstance(got, (tuple, list)) else None
                del ref_bench
            for name, is_baseline in order:
                row = _row(env, case, mode, name, nbytes[mode], BASELINE[mode])
                row["impl_version"] = _impl_version(name, peers, env)
                mode_rows.append(row)
                bench = (_try_build(build_baseline, name, inp, nbytes) if is_baseline
                         else _try_build(build, name, inp, mode, peers))
                if isinstance(bench, str):
                    row["note"] = bench
                    continue
                row["note"] = bench.note
                if bench.bytes is not None:
                    row["bytes"] = bench.bytes
                try:
                    if refs is not None and bench.result is not None:
                        diff = 0.0 if name == "ropekit" else _rel_diff([t.detach() for t in bench.result()], refs)
                        row["max_rel_diff"] = f"{diff:.2e}"
                        if not diff <= MISMATCH:
                            row["note"] = f"MISMATCH vs ropekit; {row['note']}"
                    us = _time(timer, mode, bench.run)
                except Exception as exc:  # noqa: BLE001 - one failing implementation must not stop the run
                    row["note"] = f"failed: {_first_line(exc)}; {row['note']}"
                    continue
                finally:
                    del bench
                    _recover(device)
                times[name] = us
                row["median_us"] = f"{us:.3f}"
                if mode != "host":
                    row["gbps"] = f"{row['bytes'] / us / 1e3:.4g}"
            del refs
        base = times.get(BASELINE[mode])
        for row in mode_rows:
            if row["impl"] in times and base:
                row["ratio_vs_copy"] = f"{times[row['impl']] / base:.4f}"
            if device.type != "cuda" and mode == "decode":
                row["note"] = "; ".join(x for x in ("eager (no CUDA graph on CPU)", row["note"]) if x)
        rows += mode_rows
        log(f"  {mode:7s} " + ", ".join(f"{n} {t:.1f}" for n, t in times.items()) + " (us)")
    return rows


def _impl_version(name: str, peers: Peers, env: dict[str, Any]) -> str:
    if name.startswith("ropekit"):
        return f"ropekit {env['ropekit']}"
    if name in ("hf", "hf-compile"):
        return f"transformers {peers.versions.get('transformers', '')}".strip()
    if name in ("liger", "flash-attn"):
        return peers.versions.get(name, "")
    return f"torch {env['torch']}" if name != "triton-launch" else f"triton {env['triton']}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def _try_build(make: Callable[..., Any], *args: Any) -> Any:
    """``make(*args)``, or a string saying why not."""
    try:
        return make(*args)
    except Unsupported as exc:
        return f"skipped: {exc}"
    except Exception as exc:  # noqa: BLE001
        return f"failed: {_first_line(exc)}"


def _time(timer: Timer, mode: str, fn: Callable[[], Any]) -> float:
    if mode == "decode":
        return timer.graph(fn)
    if mode == "host":
        return timer.host(fn)
    return timer.kernel(fn)


def _recover(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _row(env: dict[str, Any], case: Case, mode: str, impl: str, nbytes: int, baseline: str) -> dict[str, Any]:
    return {
        "gpu": env["gpu"], "date": env["date"], "torch": env["torch"], "triton": env["triton"],
        "ropekit": env["ropekit"], "commit": env["commit"], "case": case.name, "mode": mode, "impl": impl,
        "tokens": case.tokens, "bytes": nbytes, "median_us": "", "gbps": "", "ratio_vs_copy": "",
        "baseline": baseline, "model": case.model, "dtype": case.dtype, "style": case.style,
        "positions": case.positions, "batch": case.batch, "seqlen": case.seqlen, "hq": case.hq, "hk": case.hk,
        "head_dim": case.head_dim, "rotary_dim": case.rotary_dim, "rotary_at": case.rotary_at,
        "max_rel_diff": "", "label": env["label"], "note": "", "impl_version": "", "series": case.series,
    }


# ----------------------------------------------------------------------------------------------------------------
# Targets
# ----------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Target:
    """A goal on a ratio: the worst ratio over the qualifying rows must not exceed ``limit``."""

    key: str
    text: str
    limit: float
    mode: str
    select: Callable[[dict[str, Any]], bool]
    impl: str = "ropekit"
    versus: Optional[str] = None  # divide by this impl's time in the same (case, mode) instead of the baseline


TARGETS = (
    Target("fwd-large", "fwd, >= 100 MB moved, vs copy", 1.01, "fwd", lambda r: int(r["bytes"]) >= 100_000_000),
    Target("fwd-cold", "fwd, 2k-16k tokens, cold L2, vs copy", 1.05, "fwd",
           lambda r: 2048 <= int(r["tokens"]) <= 16384),
    Target("fwdbwd", "fwd+bwd via autograd vs ideal 4-pass copy", 1.10, "fwdbwd", lambda r: True),
    Target("decode", "decode 1-64 tokens, 32/8 heads D128, graph replay, vs copy of q", 1.00, "decode",
           lambda r: int(r["tokens"]) <= 64 and int(r["hq"]) == 32 and int(r["hk"]) == 8
           and int(r["head_dim"]) == 128),
    Target("host", "eager host time per call vs x.add_(1)", 1.00, "host", lambda r: True),
    Target("exact-vs-table", "fwd, >= 100 MB, exact in-kernel angles vs fp32 table path", 1.02, "fwd",
           lambda r: int(r["bytes"]) >= 100_000_000, versus="ropekit-table"),
)


def evaluate_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The worst ratio of each target over the rows that qualify (``None`` when no row does)."""
    by_key = {(r["case"], r["mode"], r["impl"]): r for r in rows}
    results = []
    for t in TARGETS:
        worst: Optional[tuple[float, str]] = None
        n = 0
        for r in rows:
            if r["mode"] != t.mode or r["impl"] != t.impl or not r["median_us"] or not t.select(r):
                continue
            if t.versus is None:
                if not r["ratio_vs_copy"]:
                    continue
                ratio = float(r["ratio_vs_copy"])
            else:
                other = by_key.get((r["case"], r["mode"], t.versus))
                if other is None or not other["median_us"]:
                    continue
                ratio = float(r["median_us"]) / float(other["median_us"])
            n += 1
            if worst is None or ratio > worst[0]:
                worst = (ratio, r["case"])
        results.append({
            "target": t.key, "what": t.text, "limit": t.limit, "worst": None if worst is None else round(worst[0], 4),
            "case": "" if worst is None else worst[1], "cases": n,
            "ok": None if worst is None else worst[0] <= t.limit,
        })
    return results


# ----------------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------------

def write_results(stem: Path, rows: list[dict[str, Any]], meta: dict[str, Any],
                  targets: list[dict[str, Any]]) -> list[Path]:
    """``stem``.csv (one row per case x mode x impl), ``stem``.json (meta, rows, targets), ``stem``.md (the short
    table)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    csv_path, json_path, md_path = (stem.with_suffix(s) for s in (".csv", ".json", ".md"))
    with csv_path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=ROW_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    with json_path.open("w", encoding="utf-8") as f:
        json.dump({"meta": meta, "rows": [{k: r.get(k, "") for k in (*ROW_FIELDS, "series")} for r in rows],
                   "targets": targets}, f, indent=1)
    md_path.write_text(format_table(rows, meta, targets, markdown=True), encoding="utf-8")
    return [csv_path, json_path, md_path]


def plot_results(stem: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[Path]:
    """One PNG per mode (fwd, fwdbwd, decode): a panel per series, GB/s against tokens, one line per
    implementation (the baseline dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for mode in ("fwd", "fwdbwd", "decode"):
        mrows = [r for r in rows if r["mode"] == mode and r["gbps"]]
        if not mrows:
            continue
        series = list(dict.fromkeys(r["series"] for r in mrows))
        ncols = min(3, len(series))
        nrows = math.ceil(len(series) / ncols)
        # constrained layout keeps the figure title clear of the panels' titles (tight_layout ignores it)
        fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 3.8 * nrows), squeeze=False,
                                 layout="constrained")
        for ax, name in zip(axes.flat, series):
            srows = [r for r in mrows if r["series"] == name]
            for impl in dict.fromkeys(r["impl"] for r in srows):
                pts = sorted((int(r["tokens"]), float(r["gbps"])) for r in srows if r["impl"] == impl)
                is_base = impl in (BASELINE[mode], *EXTRA_BASELINES.get(mode, ()))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=impl,
                        linestyle="--" if is_base else "-", color="black" if impl == BASELINE[mode] else None)
            ax.set_xscale("log", base=2)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("tokens")
            ax.set_ylabel("GB/s (useful bytes)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(series):]:
            ax.set_visible(False)
        title = f"ropekit bench, {mode}: {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, " \
                f"ropekit {meta['ropekit']} @ {meta['commit']}, {meta['date']}"
        if meta["label"] != PERF_LABEL:
            title = f"{meta['label']}\n{title}"
        fig.suptitle(title, fontsize=9)
        path = Path(f"{stem}-{mode}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def format_table(rows: list[dict[str, Any]], meta: dict[str, Any], targets: list[dict[str, Any]],
                 markdown: bool = False) -> str:
    """The short table: a line per (case, mode) with the mode's baseline time, then a column per implementation
    with its ratio to that baseline (Markdown: time and ratio), then the targets."""
    order = [*ROPEKIT_IMPLS, *PEER_IMPLS, *(n for v in EXTRA_BASELINES.values() for n in v)]
    timed = {r["impl"] for r in rows if r["median_us"]}
    impls = [i for i in order if i in timed]  # "copy" is also decode's reference row
    header = ["case", "mode", "tokens", "MB", "baseline us", *impls, "exact/table"]
    lines_data = []
    groups: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["case"], r["mode"]), {})[r["impl"]] = r
    for (case, mode), by_impl in groups.items():
        base = by_impl.get(BASELINE[mode])
        first = base or next(iter(by_impl.values()))
        mb = f"{int(first['bytes']) / 1e6:.1f}" if mode != "host" else "-"
        base_cell = f"{BASELINE[mode]} {float(base['median_us']):.1f}" if base and base["median_us"] else \
            f"{BASELINE[mode]} -"
        cells = [case, mode, str(first["tokens"]), mb, base_cell]
        for impl in impls:
            r = by_impl.get(impl)
            if r is None or not r["median_us"]:
                cells.append("-")
            elif not r["ratio_vs_copy"]:
                cells.append(f"{float(r['median_us']):.1f}us")
            elif markdown:
                cells.append(f"{float(r['median_us']):.1f} ({float(r['ratio_vs_copy']):.3f}x)")
            else:
                cells.append(f"{float(r['ratio_vs_copy']):.3f}x")
        a, b = by_impl.get("ropekit"), by_impl.get("ropekit-table")
        cells.append(f"{float(a['median_us']) / float(b['median_us']):.3f}"
                     if a and b and a["median_us"] and b["median_us"] else "-")
        lines_data.append(cells)
    t_header = ["target", "limit", "worst", "ok", "cases", "worst case"]
    t_rows = [[t["what"], f"{t['limit']:.2f}", "-" if t["worst"] is None else f"{t['worst']:.3f}",
               "not run" if t["ok"] is None else ("yes" if t["ok"] else "NO"), str(t["cases"]), t["case"]]
              for t in targets]
    head = (f"{meta['gpu']} | torch {meta['torch']} | triton {meta['triton']} | ropekit {meta['ropekit']} @ "
            f"{meta['commit']} | {meta['date']}")
    intro = ("baseline us = median microseconds of the mode's baseline (fwd: copy of the same bytes; fwdbwd: "
             "copy-4pass; decode: copy-q; host: add_); Nx = time / baseline time; exact/table = ropekit / "
             "ropekit-table")
    label = f"**{meta['label']}**" if markdown else f"*** {meta['label']} ***"
    out = [label] if meta["label"] != PERF_LABEL else []
    out += [head, intro, ""]
    out += _grid(header, lines_data, markdown)
    if meta["label"] == PERF_LABEL:
        out += ["", "Targets (worst ratio over the qualifying ropekit rows):", ""]
        out += _grid(t_header, t_rows, markdown)
    else:  # ratios of CPU timings against targets set for a GPU mean nothing (they read "NO (300x)")
        out += ["", NO_TARGETS_LINE]
    if meta["label"] != PERF_LABEL:
        out += ["", label]
    return "\n".join(out) + "\n"


def _grid(header: list[str], data: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return lines + ["| " + " | ".join(row) + " |" for row in data]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *data)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*row) for row in data]


def skip_notes(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (impl, reason) for skipped, failed or mismatching rows."""
    seen: dict[tuple[str, str], int] = {}
    for r in rows:
        note = r["note"]
        if note.startswith(("skipped", "failed")) or "MISMATCH" in note:
            key = (r["impl"], note.split("; compiled")[0])
            seen[key] = seen.get(key, 0) + 1
    return [f"  {impl}: {note} ({n} row{'s' if n > 1 else ''})" for (impl, note), n in seen.items()]


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ropekit bench",
        description="Time ropekit against a copy of the same bytes and against the peer implementations present "
                    "(transformers eager and torch.compile, Liger, flash-attn's Triton rotary). Needs a CUDA GPU; "
                    "--preset smoke or --device cpu runs a CPU smoke run of the harness instead (set "
                    "TRITON_INTERPRET=1 for the Triton rows), not a performance figure.")
    p.add_argument("--preset", help="registry preset (default: quick on CUDA, smoke with --device cpu)")
    p.add_argument("--quick", action="store_const", const="quick", dest="preset", help="same as --preset quick")
    p.add_argument("--full", action="store_const", const="full", dest="preset", help="same as --preset full")
    p.add_argument("--cases", help="comma-separated globs on group names (or case names) of the preset")
    p.add_argument("--filter", help="regex on case names, e.g. 'llama3-8b/bf16/neox/range'")
    p.add_argument("--modes", help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--impls", help="comma-separated globs on implementation names, e.g. 'ropekit*,hf'; baselines "
                                   "always run")
    p.add_argument("--shard", help="run shard I/N of the selected cases (e.g. 2/4)")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("--registry", help="registry file (default: benchmarks/registry.py of the repository)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--out", default="out/bench", help="output directory (default: out/bench)")
    p.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True,
                   help="write PNG plots (needs matplotlib; default on)")
    p.add_argument("--flash-attn-rotary", help="flash-attn's rotary.py to load (default: .peers/flash_attn_rotary.py)")
    p.add_argument("--commit", help="commit id to stamp when the checkout has no git metadata")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time per measurement (ms)")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up time (ms)")
    p.add_argument("--time-budget", type=float, help="seconds after which no new case starts (results so far are "
                                                      "written)")
    p.add_argument("--from-json", nargs="+", metavar="FILE",
                   help="no timing: merge the rows of earlier JSON results and redo the table, targets and plots")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``ropekit bench``."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    out_dir = Path(args.out)
    if args.from_json:
        return _replot(args.from_json, out_dir, args.plot)

    if args.device is None and args.preset != "smoke" and not args.list and not torch.cuda.is_available():
        # a CPU run is a smoke test of the harness: only when asked for, never in place of a benchmark
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu", file=sys.stderr)
        return 2
    registry = load_registry(args.registry)
    preset = args.preset or ("quick" if device.type == "cuda" else "smoke")
    cases = select_cases(expand_preset(registry, preset), groups=args.cases, pattern=args.filter, modes=args.modes,
                         shard=args.shard)
    if args.list:
        for c in cases:
            print(f"{c.group:24s} {c.name:44s} {case_bytes(c)['fwd'] / 1e6:9.1f} MB  {','.join(c.modes)}")
        print(f"{len(cases)} cases from {registry['source']}, preset {preset}")
        return 0
    if not cases:
        print("no case selected", file=sys.stderr)
        return 2

    env = environment(device, args.commit)
    impl_globs = [g.strip() for g in args.impls.split(",") if g.strip()] if args.impls else None
    wanted = {n for names in MODE_IMPLS.values() for n in names
              if impl_globs is None or any(fnmatch.fnmatch(n, g) for g in impl_globs)}
    peers = load_peers(wanted, args.flash_attn_rotary)
    meta = dict(env, preset=preset, registry=registry["source"], peers=peers.versions, peers_missing=peers.missing,
                argv=list(sys.argv[1:] if argv is None else argv), mismatch_threshold=MISMATCH)
    if device.type == "cuda":
        dynamo_config = importlib.import_module("torch._dynamo").config
        for knob in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
            if hasattr(dynamo_config, knob):
                setattr(dynamo_config, knob, max(getattr(dynamo_config, knob), 256))
        timer = Timer(device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    else:
        timer = Timer(device, host_rounds=3, host_round_s=0.005, host_warm_calls=2)
        print(f"{SMOKE_LABEL}: running on CPU tensors"
              + ("" if _interpreting() else " (set TRITON_INTERPRET=1 to run the Triton launcher too)"))

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    kind = "cpu-smoke" if device.type != "cuda" else preset
    stem = out_dir / f"bench-{stamp}-{kind}" if not args.shard else \
        out_dir / f"bench-{stamp}-{kind}-shard{args.shard.replace('/', 'of')}"
    print(f"{len(cases)} cases, preset {preset}, registry {registry['source']}; peers: "
          + (", ".join(f"{k} {v}" for k, v in peers.versions.items()) or "none"))
    for name, why in peers.missing.items():
        print(f"  absent: {name}: {why}")

    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for i, case in enumerate(cases, 1):
        if args.time_budget is not None and time.perf_counter() - t_start > args.time_budget:
            print(f"time budget reached: {len(cases) - i + 1} cases not run")
            break
        print(f"[{i}/{len(cases)}] {case.name} ({','.join(case.modes)})", flush=True)
        try:
            rows += run_case(case, device, timer, peers, env, impl_globs, lambda s: print(s, flush=True))
        except torch.cuda.OutOfMemoryError as exc:  # making the inputs themselves
            print(f"  out of memory, case skipped: {str(exc).splitlines()[0]}")
        _recover(device)  # the case's inputs are gone: give their memory back
        targets = evaluate_targets(rows)
        files = write_results(stem, rows, meta, targets)  # after every case: a killed run keeps its rows

    targets = evaluate_targets(rows)
    files = write_results(stem, rows, meta, targets)
    if args.plot:
        files += _try_plot(stem, rows, meta)
    _report(rows, meta, targets, files, time.perf_counter() - t_start)
    return 0


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _try_plot(stem: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[Path]:
    try:
        return plot_results(stem, rows, meta)
    except ImportError:
        print("matplotlib not importable: no plot (pip install matplotlib)")
        return []


def _report(rows: list[dict[str, Any]], meta: dict[str, Any], targets: list[dict[str, Any]], files: list[Path],
            seconds: float) -> None:
    notes = skip_notes(rows)
    if notes:
        print("\nNot timed or flagged:")
        print("\n".join(notes))
    print(f"\nwrote ({seconds:.0f} s): " + ", ".join(str(f) for f in files))
    print()
    print(format_table(rows, meta, targets), end="")


def _replot(files: list[str], out_dir: Path, plot: bool) -> int:
    rows: list[dict[str, Any]] = []
    meta: Optional[dict[str, Any]] = None
    for name in files:
        data = json.loads(Path(name).read_text(encoding="utf-8"))
        meta = meta or data["meta"]
        for r in data["rows"]:
            r = {k: ("" if v is None else v) for k, v in r.items()}
            r.setdefault("series", r["case"].rsplit("/", 1)[0])
            rows.append(r)
    if not rows or meta is None:
        print("no rows", file=sys.stderr)
        return 2
    runs = {(r["gpu"], r["commit"], r["torch"], r["triton"]) for r in rows}
    if len(runs) > 1:
        print(f"warning: merging rows of {len(runs)} different GPUs/commits/versions; the header names the first "
              "file's: " + "; ".join(" ".join(str(x) for x in run) for run in sorted(runs)))
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    stem = out_dir / f"bench-{stamp}-merged"
    meta = dict(meta, merged_from=[str(f) for f in files])
    targets = evaluate_targets(rows)
    out = write_results(stem, rows, meta, targets)
    if plot:
        out += _try_plot(stem, rows, meta)
    _report(rows, meta, targets, out, 0.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
