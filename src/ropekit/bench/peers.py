"""Peers: the other implementations (transformers, Liger, flash-attn's Triton rotary) and ropekit's transformers
drop-in, imported only when asked for; each one is optional."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .cases import find_repo_root

FLASH_ROTARY_PATH = Path(".peers") / "flash_attn_rotary.py"


@dataclasses.dataclass
class Peers:
    """Peer functions that could be imported; ``missing`` says why the others are absent."""

    hf_neox: Callable | None = None  # transformers' Llama apply_rotary_pos_emb (rotate_half pairing)
    hf_interleaved: Callable | None = None  # transformers' Cohere apply_rotary_pos_emb (interleaved pairing)
    liger: Callable | None = None
    liger_mrope: Callable | None = None  # Liger's Qwen2-VL M-RoPE (per-axis cos/sin and mrope_section)
    flash: Callable | None = None  # flash-attn's apply_rotary
    ropekit_hf: Callable | None = None
    helion: Any = None  # our own Helion kernels (the module .helion_peers), when helion imports
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    missing: dict[str, str] = dataclasses.field(default_factory=dict)


def load_peers(wanted: set[str], flash_path: str | None) -> Peers:
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
        try:
            from liger_kernel.transformers.qwen2vl_mrope import liger_multimodal_rotary_pos_emb

            peers.liger_mrope = liger_multimodal_rotary_pos_emb
        except ImportError as exc:
            peers.missing["liger (M-RoPE)"] = f"Liger's Qwen2-VL M-RoPE not importable: {exc}"
    if "flash-attn" in wanted:
        peers.flash, peers.versions["flash-attn"], why = _load_flash_rotary(flash_path)
        if peers.flash is None:
            peers.missing["flash-attn"] = why
            del peers.versions["flash-attn"]
    if "helion" in wanted:
        try:  # the kernels compile on first call; a failure there is the bench row's, not the import's
            peers.helion = importlib.import_module(".helion_peers", __package__)
            peers.versions["helion"] = _dist_version("helion")
        except Exception as exc:  # noqa: BLE001 - an optional peer that fails to import is reported missing
            peers.missing["helion"] = f"helion not importable: {type(exc).__name__}: {exc}"
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


def _load_flash_rotary(explicit: str | None) -> tuple[Callable | None, str, str]:
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
