"""Registry and cases: load the registry (plain data: the package's ``registry.py``, or the file ``--registry``
names) and expand a preset into :class:`Case` s."""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib.util
import re
from pathlib import Path
from typing import Any

import torch

from ropekit._spec import SECTION_LAYOUTS

# The registry ropekit ships: next to this file, so an installed package has it too.
REGISTRY_FILE = Path(__file__).with_name("registry.py")
REGISTRY_KEYS = ("MODELS", "SIZES", "PRESETS", "TARGETS")

MODES = ("fwd", "fwdbwd", "decode", "host", "kv-decode", "kv-prefill", "norm-fwdbwd", "attn-fwd", "attn-fwdbwd",
         "mla-decode", "mla-prefill", "hidden-norm-fwd", "kv-step", "cpu")
# apply_rope on CPU tensors (the float32 path) against transformers' apply_rotary_pos_emb (ropekit.bench.cpu): timed
# on the host whatever --device says, in a run of its own (--preset cpu)
CPU_MODE = "cpu"
CPU_POSITION_KINDS = ("ids", "offset")  # the positions a model hands apply_rope: [B, S] ids or an int offset
# rope_kv_write: the case has K/V caches (its ``cache`` dtype); kv-step: after the QKV projection GEMM
KV_MODES = ("kv-decode", "kv-prefill", "kv-step")
MLA_MODES = ("mla-decode", "mla-prefill")  # mla_rope_kv_write: the case has a paged latent cache (its ``cache``)
CACHE_MODES = KV_MODES + MLA_MODES  # the modes whose groups cross ``caches``
DECODE_CACHE_MODES = ("kv-decode", "mla-decode", "kv-step")  # one token per sequence, at its own position
MLA_PAGE_SIZE = 64  # the MLA modes' paged cache: rows per page (block_size)
# qk_norm_rope(norm_over="hidden", v=...): the case's model normalises each token's whole hidden (``qk_norm`` "hidden")
HIDDEN_NORM_MODES = ("hidden-norm-fwd",)
ATTN_MODES = ("attn-fwd", "attn-fwdbwd")  # rope_attention: the case has v and a mask (its ``causal`` flag)
GRAD_MODES = ("fwdbwd", "norm-fwdbwd", "attn-fwdbwd")  # timed with autograd on
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CACHE_DTYPES = {**DTYPES, "fp8": torch.float8_e4m3fn}  # a KV cache holds the inputs' dtype or fp8 e4m3
LAYOUTS = ("bshd", "bhsd")  # the rotation modes' q/k layouts (a group's "layout"; default "bshd")
LAYOUT_MODES = ("fwd", "fwdbwd", "decode")  # the modes that take a group's layout
POSITION_KINDS = ("range", "offset", "batch", "ids", "thd", "mrope")
KV_POSITION_KINDS = ("range", "offset", "batch", "ids")  # what rope_kv_write's bshd cache rows are indexed by
ATTN_POSITION_KINDS = ("range", "offset", "batch", "ids", "mrope")  # rope_attention takes no packed sequences
POSITION_OFFSET = 1000  # the int offset of positions="offset"
MAX_CACHE_LEN = 4096  # per-sequence offsets of positions="batch" are drawn from [0, MAX_CACHE_LEN)


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
    impls: tuple[str, ...] | None = None
    sections: tuple[int, ...] | None = None  # M-RoPE pairs per axis (the model's), for positions="mrope"
    section_layout: str = "contiguous"  # the model's pair -> axis layout: "contiguous" (Qwen2-VL), "interleaved"
    qk_norm: bool = False  # the model normalises q and k per head before the rotation (Qwen3)
    hidden_norm: bool = False  # qk_norm over each token's whole hidden H * D instead of per head (WAN 2.x, FLUX.2)
    cache: str | None = None  # KV modes: the caches' dtype (a CACHE_DTYPES name); None for the other modes
    causal: bool | None = None  # attention modes: the causal mask or none; None for the other modes
    v_head_dim: int | None = None  # the model's v head dim where it differs from head_dim (MLA); None: head_dim
    latent_dim: int | None = None  # MLA models: the latent kv_c's width (D_latent); head_dim = D_nope + D_rope
    layout: str = "bshd"  # the rotation modes' q/k layout: "bshd", or "bhsd" (head-major, contiguous [B, H, S, D])

    @property
    def tokens(self) -> int:
        return self.batch * self.seqlen

    @property
    def value_dim(self) -> int:
        """v's head dim in the attention modes (Dv)."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def _stem(self) -> str:
        stem = f"{self.model}/{self.dtype}/{self.style}/{self.positions}"
        if self.layout != "bshd":
            stem = f"{stem}/{self.layout}"
        if self.cache is not None:
            stem = f"{stem}/cache-{self.cache}"
        if self.causal is not None:
            stem = f"{stem}/{'causal' if self.causal else 'noncausal'}"
        return stem

    @property
    def name(self) -> str:
        return f"{self._stem}/{self.batch}x{self.seqlen}"

    @property
    def series(self) -> str:
        """The plot line group: the name without the size."""
        return f"{self._stem}/{self.family}"


# A file that only a source checkout of ropekit has (an installed package has no src/ folder).
_CHECKOUT_MARKER = Path("src") / "ropekit" / "__init__.py"


def find_repo_root() -> Path | None:
    """The source checkout of ropekit, for the git commit stamped on rows and the peers' files under ``.peers/``:
    the one holding this file, else the working directory or one of its parents; None for an install used outside
    a checkout. (The registry is not looked for here: it ships with the package.)"""
    here = Path(__file__).resolve()  # src/ropekit/bench/cases.py
    for base in [here.parents[3], Path.cwd(), *Path.cwd().parents]:
        if (base / _CHECKOUT_MARKER).is_file():
            return base
    return None


class RegistryNotFound(FileNotFoundError):
    """No registry file: the one ``--registry FILE`` names does not exist (or the package lacks its own)."""


def load_registry(path: str | None = None) -> dict[str, Any]:
    """MODELS, SIZES, PRESETS and TARGETS from the file ``path``, else from the registry shipped with the package
    (:data:`REGISTRY_FILE`), found from the package itself, never from the working directory. The result has a
    ``source`` key naming the file. Raises :class:`RegistryNotFound` when there is no such file."""
    if path is None:
        file = REGISTRY_FILE
        if not file.is_file():
            raise RegistryNotFound(f"the registry shipped with ropekit is missing ({file}); pass --registry FILE")
    else:
        file = Path(path)
        if not file.is_file():
            raise RegistryNotFound(f"registry file not found: {file} (--registry)")
    spec = importlib.util.spec_from_file_location("ropekit_bench_registry", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [key for key in REGISTRY_KEYS if not hasattr(module, key)]
    if missing:
        raise ValueError(f"registry {file} lacks {', '.join(missing)}")
    registry = {key: getattr(module, key) for key in REGISTRY_KEYS}
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
        _check_cpu_group(group, modes)
        kv = _check_cache_group(group, modes)
        masks = _check_attn_group(group, modes)
        for model_name in group["models"]:
            model = registry["MODELS"][model_name]
            if set(modes) & set(MLA_MODES) and not model.get("latent_dim"):
                raise ValueError(f"group {group['name']!r}: the MLA modes {MLA_MODES} need a model with latent_dim; "
                                 f"{model_name!r} has none")
            if "norm-fwdbwd" in modes and not model.get("qk_norm"):
                raise ValueError(f"group {group['name']!r}: mode 'norm-fwdbwd' needs a model with qk_norm; "
                                 f"{model_name!r} has none")
            hidden = model.get("qk_norm") == "hidden"
            if set(modes) & set(HIDDEN_NORM_MODES) and not hidden:
                raise ValueError(f"group {group['name']!r}: the modes {HIDDEN_NORM_MODES} need a model with qk_norm "
                                 f"'hidden'; {model_name!r} has {model.get('qk_norm')!r}")
            if hidden and set(modes) & {"norm-fwdbwd", *CACHE_MODES}:
                raise ValueError(f"group {group['name']!r}: {model_name!r} normalises the whole hidden (qk_norm "
                                 f"'hidden'), which norm-fwdbwd and the cache modes do not (per-head norm only)")
            for dtype in group["dtypes"]:
                if dtype not in DTYPES:
                    raise ValueError(f"group {group['name']!r}: unknown dtype {dtype!r}")
                caches = (group.get("caches") or [dtype]) if kv else [None]
                for cache, causal in ((cache, causal) for cache in caches for causal in masks):
                    if kv and cache not in (dtype, "fp8"):
                        raise ValueError(f"group {group['name']!r}: a {dtype} case's caches are {dtype} or fp8, "
                                         f"not {cache!r}")
                    for style in group["styles"]:
                        for positions in group["positions"]:
                            if positions not in POSITION_KINDS:
                                raise ValueError(f"group {group['name']!r}: unknown positions {positions!r}")
                            for batch, seqlen in sizes:
                                case = Case(
                                    group=group["name"], family=family, model=model_name, hq=model["hq"],
                                    hk=model["hk"], head_dim=model["head_dim"],
                                    rotary_dim=model.get("rotary_dim", model["head_dim"]),
                                    rotary_at=model.get("rotary_at", "front"), base=float(model["base"]),
                                    dtype=dtype, style=style, positions=positions, batch=int(batch),
                                    seqlen=int(seqlen), modes=modes,
                                    impls=tuple(group["impls"]) if group.get("impls") else None,
                                    sections=tuple(model["sections"]) if model.get("sections") else None,
                                    section_layout=model.get("section_layout", "contiguous"),
                                    qk_norm=bool(model.get("qk_norm", False)), hidden_norm=hidden,
                                    cache=cache, causal=causal,
                                    v_head_dim=model.get("v_head_dim"),
                                    latent_dim=model.get("latent_dim") if kv == "mla" else None,
                                    layout=group.get("layout", "bshd"))
                                _check_case(group["name"], case)
                                fresh = tuple(m for m in modes if (case.name, m) not in seen)
                                seen.update((case.name, m) for m in fresh)
                                if fresh:
                                    cases.append(dataclasses.replace(case, modes=fresh))
    return cases


def _check_cpu_group(group: dict[str, Any], modes: tuple[str, ...]) -> None:
    """The CPU mode goes in a group of its own (its cases run on the host, in a run of their own), with the
    positions a model hands apply_rope."""
    if CPU_MODE not in modes:
        return
    if modes != (CPU_MODE,):
        raise ValueError(f"group {group['name']!r}: mode {CPU_MODE!r} goes in a group of its own")
    wrong = [p for p in group["positions"] if p not in CPU_POSITION_KINDS]
    if wrong:
        raise ValueError(f"group {group['name']!r}: mode {CPU_MODE!r} takes positions {CPU_POSITION_KINDS}, "
                         f"not {wrong[0]!r}")


def _check_cache_group(group: dict[str, Any], modes: tuple[str, ...]) -> str | None:
    """Which cache the group writes: "kv" (rope_kv_write, the KV modes), "mla" (mla_rope_kv_write, the MLA modes)
    or None. Each kind goes in a group of its own: its cases carry a cache dtype, which the other modes would ignore
    and run twice."""
    kv = [m for m in modes if m in KV_MODES]
    mla = [m for m in modes if m in MLA_MODES]
    if kv and len(kv) != len(modes):
        raise ValueError(f"group {group['name']!r}: KV modes {KV_MODES} go in a group of their own")
    if mla and len(mla) != len(modes):
        raise ValueError(f"group {group['name']!r}: MLA modes {MLA_MODES} go in a group of their own")
    if group.get("caches") and not (kv or mla):
        raise ValueError(f"group {group['name']!r}: 'caches' applies to the KV modes {KV_MODES} and the MLA modes "
                         f"{MLA_MODES} only")
    for cache in group.get("caches") or ():
        if cache not in CACHE_DTYPES:
            raise ValueError(f"group {group['name']!r}: unknown cache dtype {cache!r} ({sorted(CACHE_DTYPES)})")
    return "kv" if kv else "mla" if mla else None


def _check_attn_group(group: dict[str, Any], modes: tuple[str, ...]) -> list[bool | None]:
    """The masks the group's cases cross: ``causal`` (default both) for a group of the attention modes, which go in
    a group of their own (their cases have v and a mask, which the other modes would ignore and run twice); else
    ``[None]``."""
    attn = [m for m in modes if m in ATTN_MODES]
    if attn and len(attn) != len(modes):
        raise ValueError(f"group {group['name']!r}: attention modes {ATTN_MODES} go in a group of their own")
    if "causal" in group and not attn:
        raise ValueError(f"group {group['name']!r}: 'causal' applies to the attention modes {ATTN_MODES} only")
    if not attn:
        return [None]
    masks = list(group.get("causal", [False, True]))
    if not masks or not all(isinstance(m, bool) for m in masks) or len(set(masks)) != len(masks):
        raise ValueError(f"group {group['name']!r}: 'causal' is a list of distinct booleans, got {masks!r}")
    return masks


def _check_case(group: str, case: Case) -> None:
    if case.layout not in LAYOUTS:
        raise ValueError(f"group {group!r}: layout must be one of {LAYOUTS}, got {case.layout!r}")
    if case.layout != "bshd" and (set(case.modes) - set(LAYOUT_MODES) or case.positions in ("thd", "mrope")):
        raise ValueError(f"group {group!r}: layout {case.layout!r} is for the modes {LAYOUT_MODES} with positions "
                         f"other than 'thd' and 'mrope'")
    if case.positions == "mrope" and case.sections is None:
        raise ValueError(f"group {group!r}: positions 'mrope' needs a model with sections; {case.model!r} has none")
    if case.section_layout not in SECTION_LAYOUTS:
        raise ValueError(f"model {case.model!r}: section_layout must be one of {SECTION_LAYOUTS}, "
                         f"got {case.section_layout!r}")
    if case.sections is not None and sum(case.sections) != case.rotary_dim // 2:
        raise ValueError(f"model {case.model!r}: sections {case.sections} must sum to rotary_dim / 2 = "
                         f"{case.rotary_dim // 2} (pairs per axis)")
    if case.cache is not None and case.positions not in KV_POSITION_KINDS:
        raise ValueError(f"group {group!r}: KV modes take positions {KV_POSITION_KINDS}, not {case.positions!r}")
    if case.causal is not None and case.positions not in ATTN_POSITION_KINDS:
        raise ValueError(f"group {group!r}: attention modes take positions {ATTN_POSITION_KINDS}, not "
                         f"{case.positions!r}")
    if case.v_head_dim is not None and case.v_head_dim <= 0:
        raise ValueError(f"model {case.model!r}: v_head_dim must be positive, got {case.v_head_dim}")
    if case.latent_dim is not None and (case.rotary_at != "back" or case.rotary_dim >= case.head_dim):
        raise ValueError(f"model {case.model!r}: the MLA modes rotate q's last rotary_dim columns (rotary_at 'back', "
                         f"rotary_dim < head_dim = D_nope + D_rope)")
    decode = [m for m in case.modes if m in DECODE_CACHE_MODES]
    if decode and (case.seqlen != 1 or case.positions != "batch"):
        raise ValueError(f"group {group!r}: {decode[0]} is one token per sequence at its own position (positions "
                         f"'batch', sizes [B, 1]), not {case.positions!r} {case.batch}x{case.seqlen}")


def select_cases(cases: list[Case], *, groups: str | None, pattern: str | None, modes: str | None,
                 shard: str | None) -> list[Case]:
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
