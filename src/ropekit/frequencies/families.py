"""What ropekit knows per model family, in one table: :data:`MODEL_FAMILIES`, keyed by ``config.model_type``.

Two readers: :func:`~ropekit.frequencies.from_hf_config` takes a family's defaults for what its config leaves out
(pairing, rotary fraction, M-RoPE sections, a legacy rope type), and :mod:`ropekit.integrations.patching` takes the
families it can patch and the functions it replaces in each. A family not listed has the defaults of
:class:`ModelFamily`: NeoX pairing, the whole head rotated, 1-D positions, and no patching. Adding a model is
adding a row here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

__all__ = ["MODEL_FAMILIES", "ModelFamily", "family_of"]


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """The facts of one model family that its config does not state.

    Attributes
    ----------
    pairing : str
        How the family's attention pairs columns: ``"neox"`` (i, i + R/2) or ``"interleaved"`` (2i, 2i+1, as GLM,
        GPT-J, CodeGen and DeepSeek-V2/V3). ``from_hf_config``'s default ``style``.
    interleave_key : str or None
        A config key that, set to ``False``, turns an interleaved pairing into NeoX (DeepSeek-V3's
        ``rope_interleave``, which chooses between its two rotation functions).
    partial_rotary_factor : float
        The rotated fraction of a head when the config gives none (GPT-NeoX 0.25, GLM 0.5).
    default_rope_reads_partial : bool
        Whether the family's rotary module applies a config's ``partial_rotary_factor`` with the default rope type
        (False: it rotates the whole head whatever the config says, as Llama's and most families' in transformers).
    mrope_section : tuple of int or None
        Vision-language families whose text rotation is M-RoPE (time, height, width positions): the pairs per axis
        their rotary module takes when the config gives no ``mrope_section``.
    mrope_interleaved : bool
        M-RoPE's axes take interleaved pairs (Qwen3-VL) rather than contiguous sections (Qwen2-VL).
    legacy_yarn_is_longrope : bool
        A legacy ``rope_type`` of ``"yarn"`` in the family's configs means LongRoPE (transformers renames it).
    patched_functions : Mapping[str, str]
        The functions of the family's modeling module (``transformers.models.<model_type>.modeling_<model_type>``)
        that :func:`ropekit.integrations.patching.patch` replaces, each with how it pairs columns; empty: the family
        cannot be patched. Kinds: ``"neox"`` (``rotate_half`` pairs (i, i + R/2) with R the cos width; columns past
        R pass through: Phi-3, NeoX), ``"interleaved"`` (pairs (2i, 2i+1) with angle i, R the cos width, the tail
        passes through: GLM), ``"interleaved_to_halves"`` (pairs (2i, 2i+1), output laid out as [rotated evens,
        rotated odds]: DeepSeek-V3), ``"vision"`` (a vision tower's 2-D axial rotation of its patches' (h, w) ids,
        ``apply_rotary_pos_emb_vision``). The tables a function reads are the family's ``rotary_tables`` (Cohere's
        ``"interleaved"`` reads repeated pairs, GPT-OSS's ``"neox"`` one column per pair, Llama 4's
        ``"interleaved"`` ``apply_rotary_emb(xq, xk, freqs_cis)`` a complex ``freqs_cis``, with q, k [B, S, H, D]).
    rotation_dtype : str
        The dtype of the patched functions' outputs: ``"promote"`` (q's promoted with the tables', as Llama's
        ``q * cos``) or ``"q"`` (q's and k's own: the function casts back, as OLMo, ERNIE 4.5, Cohere and Llama 4).
    rotary_tables : str
        What the family's rotary-embedding module returns, which a patched module returns too (the values built
        only if read): ``"halves"`` (cos, sin ``cat(a, a)`` in the hidden states' dtype), ``"halves_float32"`` (the
        same, kept float32: OLMo, ERNIE 4.5), ``"pairs"`` (``repeat_interleave(a, 2)``: Cohere), ``"half"``
        (one column per pair: GPT-OSS) or ``"complex"`` (one complex64 ``freqs_cis`` = ``scaling * exp(i a)``:
        Llama 4). A module whose ``forward`` takes a ``layer_type`` (Gemma 3, OLMo 3, ...) gets one frequency set
        per layer type (its ``config.rope_parameters[layer_type]``).
    """

    pairing: str = "neox"
    interleave_key: str | None = None
    partial_rotary_factor: float = 1.0
    default_rope_reads_partial: bool = True
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    legacy_yarn_is_longrope: bool = False
    patched_functions: Mapping[str, str] = dataclasses.field(default_factory=dict)
    rotary_tables: str = "halves"
    rotation_dtype: str = "promote"


_NEOX = {"apply_rotary_pos_emb": "neox"}
_PATCHED = ModelFamily(patched_functions=_NEOX)
# transformers families whose modeling module copies Llama's rotary module (or Gemma 3's, one frequency set per
# layer type) and whose apply_rotary_pos_emb is Llama's rotate_half rotation of the whole head, or GPT-NeoX's of
# the first cos.shape[-1] columns with the rest passed through (the "neox" kind covers both)
_NEOX_FAMILIES = (
    "afmoe", "apertus", "arcee", "bitnet", "cwm", "exaone4", "exaone_moe", "falcon", "gemma", "gemma2", "gemma3",
    "glm4_moe", "granite", "granitemoe", "granitemoeshared", "jetmoe", "lfm2", "ministral3", "mixtral", "nemotron",
    "olmoe", "persimmon", "phi", "qwen2_moe", "qwen3_moe", "qwen3_next", "seed_oss", "smollm3", "stablelm",
    "starcoder2", "vaultgemma",
)
_NEOX_AND_VISION = {"apply_rotary_pos_emb": "neox", "apply_rotary_pos_emb_vision": "vision"}

#: ``config.model_type`` -> :class:`ModelFamily`.
MODEL_FAMILIES: dict[str, ModelFamily] = {
    "llama": ModelFamily(patched_functions=_NEOX),
    "mistral": ModelFamily(patched_functions=_NEOX),
    "qwen2": ModelFamily(patched_functions=_NEOX),
    "qwen3": ModelFamily(patched_functions=_NEOX),
    "phi3": ModelFamily(legacy_yarn_is_longrope=True, patched_functions=_NEOX),
    "phi4_multimodal": ModelFamily(legacy_yarn_is_longrope=True),
    "gpt_neox": ModelFamily(partial_rotary_factor=0.25, patched_functions=_NEOX),
    "gptj": ModelFamily(pairing="interleaved"),
    "codegen": ModelFamily(pairing="interleaved"),
    "glm": ModelFamily(pairing="interleaved", partial_rotary_factor=0.5,
                       patched_functions={"apply_rotary_pos_emb": "interleaved"}),
    "glm4": ModelFamily(pairing="interleaved", partial_rotary_factor=0.5,
                        patched_functions={"apply_rotary_pos_emb": "interleaved"}),
    "deepseek_v2": ModelFamily(pairing="interleaved"),
    "deepseek_v3": ModelFamily(pairing="interleaved", interleave_key="rope_interleave",
                               patched_functions={"apply_rotary_pos_emb": "neox",
                                                  "apply_rotary_pos_emb_interleave": "interleaved_to_halves"}),
    # Vision-language models: the language model's M-RoPE (positions [3, B, S]) and the vision tower's 2-D axial
    # rotation (apply_rotary_pos_emb_vision, (h, w) ids [N, 2]). Qwen2.5-VL's tower reorders its cos/sin tables for
    # window attention after its rotary module returns them, so its rotation keeps transformers' function.
    "qwen2_vl": ModelFamily(mrope_section=(16, 24, 24), patched_functions=_NEOX_AND_VISION),
    "qwen2_5_vl": ModelFamily(mrope_section=(16, 24, 24), patched_functions=_NEOX),
    "qwen3_vl": ModelFamily(mrope_section=(24, 20, 20), mrope_interleaved=True, patched_functions=_NEOX_AND_VISION),
    "qwen3_vl_moe": ModelFamily(mrope_section=(24, 20, 20), mrope_interleaved=True),
    # float32 tables, outputs cast back to q's dtype; OLMo-2's QK-norm (over all heads) is the model's own code
    **{name: ModelFamily(rotary_tables="halves_float32", rotation_dtype="q", patched_functions=_NEOX)
       for name in ("olmo", "olmo2", "olmo3")},
    **{name: ModelFamily(pairing="interleaved", rotary_tables="halves_float32", rotation_dtype="q",
                         patched_functions={"apply_rotary_pos_emb": "interleaved"})
       for name in ("ernie4_5", "ernie4_5_moe")},
    **{name: ModelFamily(pairing="interleaved", rotary_tables="pairs", rotation_dtype="q",
                         patched_functions={"apply_rotary_pos_emb": "interleaved"})
       for name in ("cohere", "cohere2")},
    "gpt_oss": ModelFamily(rotary_tables="half", patched_functions=_NEOX),
    # Llama 4's text model: model_type "llama4_text", found under "llama4" (family_of drops "_text")
    "llama4": ModelFamily(pairing="interleaved", rotary_tables="complex", rotation_dtype="q",
                          patched_functions={"apply_rotary_emb": "interleaved"}),
}
for _name in _NEOX_FAMILIES:
    MODEL_FAMILIES.setdefault(_name, _PATCHED)
# families whose rotary module's default rope rotates the whole head, a config's partial_rotary_factor
# notwithstanding (their apply_rotary_pos_emb rotates every column); test_partial_rotary_factor_as_each_family_reads_it
# holds this list to the installed transformers
_DEFAULT_ROPE_WHOLE_HEAD = (
    "afmoe", "apertus", "arcee", "bitnet", "cohere", "cohere2", "cwm", "deepseek_v3", "ernie4_5", "ernie4_5_moe",
    "exaone4", "exaone_moe", "falcon", "gemma", "gemma2", "gemma3", "gpt_oss", "granite", "granitemoe",
    "granitemoeshared", "jetmoe", "lfm2", "llama", "llama4", "ministral3", "mistral", "mixtral", "olmo", "olmo2",
    "olmo3", "olmoe", "qwen2", "qwen2_5_vl", "qwen2_moe", "qwen2_vl", "qwen3", "qwen3_moe", "qwen3_vl", "seed_oss",
    "smollm3", "starcoder2", "vaultgemma",
)
for _name in _DEFAULT_ROPE_WHOLE_HEAD:
    MODEL_FAMILIES[_name] = dataclasses.replace(MODEL_FAMILIES[_name], default_rope_reads_partial=False)
del _name


def family_of(model_type: str | None) -> ModelFamily | None:
    """The family of a config's ``model_type``, or None. A vision-language model's text config (``qwen2_vl_text``)
    belongs to its model's family."""
    if model_type is None:
        return None
    return MODEL_FAMILIES.get(model_type) or MODEL_FAMILIES.get(model_type.removesuffix("_text"))
