"""transformers configs: :func:`from_hf_config` reads a model's config (an object, a dict or a ``config.json``) into
the :class:`~ropekit.frequencies.RopeFrequencies` that model builds, and :func:`_read_config_json` is the one reader
of config paths. What depends on the model family (pairing, partial-rotary and M-RoPE defaults) comes from
:data:`ropekit.frequencies.families.MODEL_FAMILIES`.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ropekit.frequencies._checks import _integer, _real
from ropekit.frequencies.families import ModelFamily, family_of
from ropekit.frequencies.formulas import _TYPE_KEYS, _canonical_type
from ropekit.frequencies.frequency_set import RopeFrequencies, _build

__all__ = ["from_hf_config"]

_PER_LAYER_SCALARS = {"rope_type", "type", "rope_theta", "factor", "partial_rotary_factor"}


def from_hf_config(
    config: Any,
    *,
    layer_type: str | None = None,
    style: str | None = None,
    freq_scale: float = 1.0,
    freq_factors: torch.Tensor | Sequence[float] | None = None,
) -> RopeFrequencies:
    """The frequencies a transformers model builds from ``config``: ``inv_freq`` and ``attention_scaling`` equal
    transformers' bit for bit for every rope type (``arithmetic="transformers"``: the same float32 torch
    operations in the same order, on the CPU; see :meth:`RopeFrequencies.for_seq_len` for dynamic NTK and
    LongRoPE), unless ``freq_scale`` / ``freq_factors`` are used. ``inv_freq_float64`` holds the float64 values.

    Parameters
    ----------
    config : PretrainedConfig, Mapping, str or os.PathLike
        A transformers config object, a plain dict such as a parsed ``config.json``, or the path of a model's
        ``config.json`` (any JSON file of that form, or a folder holding ``config.json``: what ``ropekit plot
        --config`` takes; nothing is downloaded). Both spellings are read:
        transformers 5's ``rope_parameters`` (which carries ``rope_theta`` and ``partial_rotary_factor``) and the
        older ``rope_scaling`` with top-level ``rope_theta`` / ``partial_rotary_factor``. Also read:
        ``head_dim`` (or ``qk_rope_head_dim`` for MLA models, else ``hidden_size // num_attention_heads``),
        ``max_position_embeddings``, a top-level ``original_max_position_embeddings`` (Phi-3), GPT-NeoX's
        ``rotary_pct`` / ``rotary_emb_base``, GPT-J's absolute ``rotary_dim``, and ``model_type`` for the
        family's pairing and defaults. With the default rope type ``partial_rotary_factor`` applies only where
        the family's rotary module applies it (Phi, Phi-3, GPT-NeoX, GLM, StableLM, ...; Llama's and most others
        rotate the whole head whatever it says). transformers need not be installed.
    layer_type : str, optional
        For configs with one parameter set per layer type (Gemma 3: ``"sliding_attention"``,
        ``"full_attention"``), which set to use.
    style : str, optional
        Override the pairing; by default ``"interleaved"`` for GLM, GPT-J, CodeGen and DeepSeek-V2/V3
        (``rope_interleave``), else ``"neox"``.
    freq_scale, freq_factors
        ggml's knobs, applied on top (see :func:`rope_frequencies`).

    Raises
    ------
    ValueError
        Unknown ``rope_type``, missing keys (``factor``, ``short_factor``, ...), a bad value (0, negative, NaN or
        infinite factors, lengths or bases, wrong-typed config entries, factor lists of the wrong length), an odd
        rotary dimension, or a per-layer config without ``layer_type``; the message names the key. For a path: a
        file that is not a JSON object.
    OSError
        For a path: no such file (``FileNotFoundError``; a folder without ``config.json``), or it cannot be read.
    TypeError
        ``config`` is neither a config object, a Mapping nor a path, or an argument has the wrong type.
    """
    if isinstance(config, (str, os.PathLike)):
        config = _read_config_json(config)[1]
    get = _getter(config)
    text_config = get("text_config")
    if text_config is not None and get("hidden_size") is None and get("head_dim") is None:
        # a vision-language model's config: the language model's rotation lives in its text config
        return from_hf_config(text_config, layer_type=layer_type, style=style, freq_scale=freq_scale,
                              freq_factors=freq_factors)
    if layer_type is not None and not isinstance(layer_type, str):
        raise TypeError(f"layer_type must be a str, got {type(layer_type).__name__}")
    model_type = get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ValueError(f"config['model_type'] must be a str, got {model_type!r}")
    family = family_of(model_type) or ModelFamily()  # what the config leaves out
    key, rp = _first_key(get, "rope_parameters", "rope_scaling", falsy=True)
    rp = _mapping(rp or {}, key)
    if rp and _is_per_layer(rp):
        choices = sorted(k for k, v in rp.items() if v is not None)
        if layer_type is None:
            if len(choices) != 1:
                raise ValueError(f"this config has one rope parameter set per layer type {choices}; "
                                 "pass layer_type= to choose one")
            layer_type = choices[0]
        if rp.get(layer_type) is None:
            raise ValueError(f"layer_type {layer_type!r} has no rope parameters; the config has {choices}")
        rp = _mapping(rp[layer_type], f"{key}[{layer_type!r}]")
    # (a config with one parameter set uses it for every layer type, whatever layer_type says)

    raw_type = rp.get("rope_type") or rp.get("type") or "default"
    if raw_type == "yarn" and family.legacy_yarn_is_longrope:
        raw_type = "longrope"  # transformers renames these configs' legacy "yarn" to longrope
    rope_type = _canonical_type(raw_type, "rope_parameters['rope_type']")

    if rp.get("rope_theta") is not None:
        base = _real(rp["rope_theta"], "rope_parameters['rope_theta']", above=1.0)
    else:
        name, base = _first_key(get, "rope_theta", "rotary_emb_base")
        base = 10000.0 if base is None else _real(base, name, above=1.0)
    name, head_dim = _first_key(get, "qk_rope_head_dim", "head_dim", falsy=True)
    if head_dim:
        head_dim = _integer(head_dim, name)
    else:
        hidden_key, hidden = _first_key(get, "hidden_size", "n_embd", "d_model")
        heads_key, heads = _first_key(get, "num_attention_heads", "n_head")
        if not hidden or not heads:
            raise ValueError("config needs head_dim, or hidden_size and num_attention_heads, to size the rotation")
        head_dim = _integer(hidden, hidden_key) // _integer(heads, heads_key)
        if head_dim < 2:
            raise ValueError(f"{hidden_key} // {heads_key} = {hidden} // {heads} = {head_dim}: a head needs at least "
                             "2 columns to rotate")
    name, partial = _first_key(lambda k: rp.get(k), "partial_rotary_factor")
    if partial is None:
        name, partial = _first_key(get, "partial_rotary_factor", "rotary_pct")
    if partial is None:
        partial = family.partial_rotary_factor
    partial = _real(partial, name, above=0.0, closed=rope_type == "proportional", at_most=1.0)
    if rope_type == "default" and not family.default_rope_reads_partial:
        partial = 1.0  # as the family's rotary module: its default rope rotates the whole head
    if rope_type == "proportional":
        rotary_dim = how = head_dim
    elif get("rotary_dim") is not None:  # GPT-J / CodeGen: absolute width
        rotary_dim = _integer(get("rotary_dim"), "rotary_dim")
        how = f"rotary_dim = {rotary_dim}"
    else:
        rotary_dim = int(head_dim * partial)  # transformers truncates the same way
        how = f"int(head_dim * {name}) = int({head_dim} * {partial}) = {rotary_dim}"
    if rotary_dim % 2:
        raise ValueError(f"the rotary dimension {how} is odd; RoPE rotates pairs, so it must be even")
    if rotary_dim <= 0:
        raise ValueError(f"the rotary dimension {how} must be positive")

    name, max_pos = _first_key(get, "max_position_embeddings", "n_positions")
    if max_pos is not None:
        max_pos = _integer(max_pos, name)
    params = {k: rp[k] for k in _TYPE_KEYS[rope_type] if k in rp}
    if rope_type in ("yarn", "longrope", "llama3"):
        top = get("original_max_position_embeddings")
        if top is not None:  # Phi-3 keeps the pretraining length beside rope_scaling; it wins there too
            params["original_max_position_embeddings"] = _integer(top, "original_max_position_embeddings")
    if rope_type == "proportional":
        params["partial_rotary_factor"] = partial
    if style is None:
        style = family.pairing
        if family.interleave_key is not None and get(family.interleave_key) is False:
            style = "neox"
    freqs = _build(rope_type=rope_type, base=base, rotary_dim=rotary_dim, head_dim=head_dim, params=params,
                   max_pos=max_pos, style=style, rotary_at="front", freq_scale=freq_scale, freq_factors=freq_factors,
                   arithmetic="transformers")
    if rp.get("mrope_section") is not None or family.mrope_section is not None:  # M-RoPE: positions [3, B, S]
        sections = rp.get("mrope_section", family.mrope_section)
        if not isinstance(sections, Sequence) or isinstance(sections, str) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sections):
            raise ValueError(f"{key}['mrope_section'] must be a list of ints >= 0, got {sections!r}")
        if sum(sections) != rotary_dim // 2:
            raise ValueError(f"{key}['mrope_section'] {list(sections)} must sum to the rotary pairs "
                             f"{rotary_dim // 2}")
        interleaved = bool(rp.get("mrope_interleaved")) or family.mrope_interleaved
        freqs = dataclasses.replace(freqs, sections=tuple(sections),
                                    section_layout="interleaved" if interleaved else "contiguous")
    return freqs


def _is_per_layer(rp: Mapping[str, Any]) -> bool:
    return not (set(rp) & _PER_LAYER_SCALARS) and all(v is None or isinstance(v, Mapping) for v in rp.values())


def _read_config_json(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """``(the file read, its parsed JSON object)`` for the path of a model's config: a JSON file, or a folder
    holding ``config.json``. The one reader of config paths (:func:`from_hf_config`, ``ropekit plot --config``).

    Raises ``FileNotFoundError`` (naming the file looked for) or another ``OSError``, ``ValueError`` for a file
    that is not a JSON object, ``TypeError`` for a ``path`` that is neither a str nor an os.PathLike."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike (a config.json or its folder), got {type(path).__name__}")
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        what = "a model's config.json or the folder that holds it; nothing is downloaded"
        raise FileNotFoundError(2, f"no such config file ({what})", str(p))
    with open(p, encoding="utf-8") as fh:
        try:
            cfg = json.load(fh)
        except json.JSONDecodeError as err:
            raise ValueError(f"{p}: not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: expected a JSON object (a model's config), got a {type(cfg).__name__}")
    return p, cfg


def _getter(config: Any):
    if isinstance(config, Mapping):
        return config.get
    if hasattr(config, "to_dict") or hasattr(config, "__dict__"):
        return lambda key: getattr(config, key, None)
    raise TypeError(f"config must be a transformers PretrainedConfig or a Mapping (or the path of a config.json), "
                    f"got {type(config).__name__}")


def _first_key(get, *keys: str, falsy: bool = False) -> tuple[str, Any]:
    """``(key, value)`` of the first key that is set (not None; also not empty/zero when ``falsy``), else
    ``(keys[0], None)``."""
    for key in keys:
        value = get(key)
        if value is not None and not (falsy and isinstance(value, (Mapping, str, numbers.Number)) and not value):
            return key, value
    return keys[0], None


def _mapping(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a dict of rope parameters, got {value!r}")
    return dict(value)
