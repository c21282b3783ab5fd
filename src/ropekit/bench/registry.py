"""Shape registry of ``ropekit bench``: plain data, loaded by file path (no imports, no code).

It ships inside the package, so ``ropekit bench`` finds it wherever ropekit is installed and whatever the working
directory; ``--registry FILE`` runs another file of the same form instead (start from a copy of this one).

``MODELS``
    name -> attention shape: ``hq``/``hk`` query and key heads, ``head_dim``, ``rotary_dim`` (default: head_dim),
    ``rotary_at`` ("front" or "back"; default "front"), ``base`` (RoPE theta), ``sections`` (M-RoPE pairs per
    axis, for positions "mrope") and ``section_layout`` ("contiguous", the default, or "interleaved" as Qwen3-VL),
    ``qk_norm`` (True: per-head RMSNorm of q and k before the rotation, as Qwen3;
    the prologue modes normalise, and norm-fwdbwd needs it; "hidden": RMSNorm over each token's whole H * D, as
    WAN 2.x, which hidden-norm-fwd needs), ``v_head_dim`` (the attention modes' v head dim,
    as MLA's 128 beside a q/k head dim of 192; default: head_dim), ``latent_dim`` (MLA models: the latent kv_c's
    width; the MLA modes' q head is ``head_dim`` = D_nope + D_rope with the ``rotary_dim`` rope columns at the
    back, k_pe one shared head of ``rotary_dim``), ``about`` (one line).
``SIZES``
    name -> list of ``[batch, seqlen]`` pairs. Tokens = batch * seqlen. Decode sizes are ``[batch, 1]``: one new
    token for each of ``batch`` sequences, each at its own cache length.
``PRESETS``
    name -> list of groups. A group crosses ``models`` x ``dtypes`` x ``styles`` x ``positions`` x ``sizes`` and
    runs every resulting case in each of its ``modes``. ``sizes`` is a ``SIZES`` name or an explicit list. An
    optional ``impls`` list restricts the implementations (baselines always run). A group's ``name`` is what
    ``--cases`` selects. Groups of the KV modes (kv-decode, kv-prefill; no other modes in the group) also cross
    ``caches``: the K/V caches' dtype, the inputs' dtype or "fp8" (default: the inputs' dtype). Groups of the
    attention modes (attn-fwd, attn-fwdbwd; no other modes in the group) also cross ``causal``: a list of
    booleans (default ``[False, True]``); the case name says ``causal`` or ``noncausal``. Groups of the MLA modes
    (mla-decode, mla-prefill; no other modes in the group) cross ``caches`` as the KV modes' do. An optional
    ``layout`` ("bshd", the default, or "bhsd": contiguous head-major q/k) sets the layout of the fwd, fwdbwd and
    decode modes; the case name then says ``bhsd``.
``TARGETS``
    list of goals the printed table ends with (not in the CPU smoke run). Each is the worst ratio over the rows
    that qualify and must not exceed ``limit``: ``key`` (a short id), ``what`` (the line printed), ``limit``, ``mode``,
    ``impl`` (default "ropekit"), ``where`` (optional: column -> ``[low, high]``, inclusive, ``None`` for no bound;
    a row qualifies when every named column of it is in range; columns are those of the results CSV, e.g.
    ``bytes``, ``tokens``, ``hq``) and ``versus`` (optional: divide by that impl's time in the same case and mode
    instead of the mode's baseline).

Values:
    dtypes     "fp32", "fp16", "bf16"
    styles     "neox" (pairs i, i + R/2), "interleaved" (pairs 2i, 2i + 1)
    positions  "range"  0..S-1
               "offset" an int offset (1000) added to 0..S-1 (KV-cache continuation)
               "batch"  one offset per sequence, a [B] tensor (decode: the cache lengths)
               "ids"    per-token position ids, a [B, S] int64 tensor
               "thd"    packed varlen tokens [T, H, D] with cu_seqlens; B sequences of unequal lengths, T = B * S
               "mrope"  multi-axis positions [3, B, S] (time, height, width) with the model's ``sections``
    modes      "fwd"    forward, cold L2, one call
               "fwdbwd" forward + backward through autograd
               "decode" one call replayed from a CUDA graph
               "host"   eager host time per call (no sync inside the loop)
               attention prologue (ropekit.rope_kv_write into bshd caches [B, max_len, Hkv, D]; qk_norm_rope):
               "kv-decode"   rope_kv_write of one token per sequence ([B, H, D], positions "batch": each
                             sequence at a random position), replayed from a CUDA graph
               "kv-prefill"  rope_kv_write of [B, S, H, D] tokens (e.g. positions "offset"), cold L2, one call
               "norm-fwdbwd" qk_norm_rope forward + backward through autograd (gradients of q, k and both weights)
               "kv-step"     kv-decode after the QKV projection GEMM, one CUDA graph; baseline "gemm"; "-pdl":
                             a programmatic dependent launch (ropekit._config.pdl_launches)
               RoPE fused into attention (ropekit.rope_attention; q [B, Hq, S, D], k [B, Hk, S, D], v [B, Hk, S, Dv]
               in layout "bhsd"; positions other than "thd"), against torch's SDPA (cuDNN, flash) and
               flex_attention, each alone and after ropekit.apply_rope; baseline "rope+sdpa-cudnn":
               "attn-fwd"    the forward, cold L2, one call
               "attn-fwdbwd" forward + backward through autograd with a fixed random gradient of o (dq, dk, dv)
               Their rows carry ``flops`` (2 B Hq S^2 (D + Dv), half of it causal; fwd+bwd 3.5x) and ``tflops``.
               the MLA prologue (ropekit.mla_rope_kv_write: q [.., Hq, D_nope + D_rope], k_pe and kv_c views of
               one packed [.., latent_dim + D_rope] buffer, a paged latent cache [blocks, 64, latent_dim + D_rope]
               whose pages are shuffled over the sequences; "ropekit-mla-kv-write-fp8q": q as float8_e4m3fn),
               against "copy-mla" (one Triton kernel moving its bytes) and "unfused-mla" (apply_rope + torch.cat
               + scatter):
               "mla-decode"  one token per sequence (positions "batch"), replayed from a CUDA graph
               "mla-prefill" [B, S] tokens (e.g. positions "offset"), cold L2, one call
               the KV modes' cache formats: "ropekit-kv-write-paged-x" (vLLM's paged_x keys [blocks, Hkv, D/x,
               16, x] and values [blocks, Hkv, D, 16]), "-paged-hnd" ([blocks, Hkv, 16, D]) and "-page-table"
               (NHD pages [blocks, 16, Hkv, D] found through FlashInfer's kv_indices / kv_indptr /
               kv_last_page_len): each a view of the case's bshd caches' memory as shuffled 16-row pages
               the diffusion transformers' prologue (ropekit.qk_norm_rope(norm_over="hidden", v=v): RMSNorm over
               each token's H * D, the multi-axis rotation and v's copy; q, k, v [B, S, H, D] from separate
               projections), against "copy-qkv" (one copy of its bytes) and the unfused PyTorch code (eager and
               torch.compile):
               "hidden-norm-fwd" the forward, cold L2, one call
               "cpu"    ropekit.apply_rope on CPU tensors (the float32 path), in a group and a run of its own
                        (--preset cpu; positions "ids" or "offset"), against transformers' apply_rotary_pos_emb
                        (baseline "hf": cos/sin computed beforehand, untimed; q/k as [B, H, S, D] views); impls
                        "ropekit" (the positions of an earlier call: a later layer of a forward) and
                        "ropekit-first-layer" (positions new to every call: a forward's first layer); each time
                        the median of calls taken in turn (ropekit.bench.cpu)
    caches     "bf16", "fp16", "fp32" (the inputs' dtype), "fp8" (float8_e4m3fn with a 0-d fp32 tensor scale)
    causal     True (query i attends to keys 0..i, top-left aligned as SDPA's is_causal), False (no mask)
"""

MODELS = {
    "llama3-8b": {"hq": 32, "hk": 8, "head_dim": 128, "base": 500000.0,
                  "about": "Llama-3-8B: GQA 32 query / 8 key heads, D 128"},
    "llama3-70b": {"hq": 64, "hk": 8, "head_dim": 128, "base": 500000.0,
                   "about": "Llama-3-70B: GQA 64 / 8 heads, D 128"},
    "mha16-d64": {"hq": 16, "hk": 16, "head_dim": 64, "base": 10000.0,
                  "about": "multi-head attention, 16 / 16 heads, D 64 (GPT-2 / Pythia-1B class)"},
    "hd256": {"hq": 16, "hk": 8, "head_dim": 256, "base": 10000.0,
              "about": "head_dim 256, 16 / 8 heads (Gemma-2-9B class)"},
    "mla-rope": {"hq": 16, "hk": 16, "head_dim": 192, "rotary_dim": 64, "rotary_at": "back", "base": 10000.0,
                 "v_head_dim": 128,
                 "about": "MLA-style heads (DeepSeek-V2-Lite): D 192 = 128 pass-through + 64 rotated at the back, "
                          "v head dim 128"},
    "qwen3-8b": {"hq": 32, "hk": 8, "head_dim": 128, "base": 1000000.0, "qk_norm": True,
                 "about": "Qwen3-8B: GQA 32 / 8 heads, D 128, per-head RMSNorm of q and k before RoPE"},
    "qwen2-vl-7b": {"hq": 28, "hk": 4, "head_dim": 128, "base": 1000000.0, "sections": [16, 24, 24],
                    "about": "Qwen2-VL-7B's language model: GQA 28 / 4 heads, D 128, M-RoPE sections 16/24/24"},
    "qwen3-vl-8b": {"hq": 32, "hk": 8, "head_dim": 128, "base": 5000000.0, "sections": [24, 20, 20],
                    "section_layout": "interleaved",
                    "about": "Qwen3-VL-8B's language model: GQA 32 / 8 heads, D 128, interleaved M-RoPE 24/20/20"},
    "deepseek-v3": {"hq": 128, "hk": 1, "head_dim": 192, "rotary_dim": 64, "rotary_at": "back", "base": 10000.0,
                    "latent_dim": 512, "v_head_dim": 128,
                    "about": "DeepSeek-V3's MLA: 128 heads, q 128 + 64 rope columns, one shared k_pe 64, latent 512"},
    "deepseek-v3-tp8": {"hq": 16, "hk": 1, "head_dim": 192, "rotary_dim": 64, "rotary_at": "back",
                        "base": 10000.0, "latent_dim": 512, "v_head_dim": 128,
                        "about": "DeepSeek-V3's MLA on one of 8 tensor-parallel GPUs: 16 heads, latent 512"},
    # Tiny shapes for the CPU smoke run (Triton interpreter); not model shapes.
    "tiny": {"hq": 4, "hk": 2, "head_dim": 32, "base": 10000.0, "sections": [4, 6, 6], "about": "CPU smoke only"},
    "tiny-interleaved": {"hq": 4, "hk": 2, "head_dim": 32, "base": 10000.0, "sections": [6, 5, 5],
                         "section_layout": "interleaved", "about": "CPU smoke only: Qwen3-VL's section layout"},
    "tiny-back": {"hq": 2, "hk": 2, "head_dim": 32, "rotary_dim": 16, "rotary_at": "back", "base": 10000.0,
                  "about": "CPU smoke only: half the head rotated at the back"},
    "tiny-qknorm": {"hq": 4, "hk": 2, "head_dim": 32, "base": 1000000.0, "qk_norm": True,
                    "about": "CPU smoke only: per-head RMSNorm of q and k (a tiny Qwen3)"},
    "tiny-mla": {"hq": 4, "hk": 2, "head_dim": 48, "rotary_dim": 16, "rotary_at": "back", "v_head_dim": 32,
                 "base": 10000.0,
                 "about": "CPU smoke only: GQA 4 / 2 heads, D 48 rotated at the back (16), v head dim 32 (as MLA)"},
    "wan2.2-5b": {"hq": 24, "hk": 24, "head_dim": 128, "base": 10000.0, "sections": [22, 21, 21],
                  "qk_norm": "hidden",
                  "about": "WAN 2.2 TI2V-5B's DiT: 24 heads, D 128 (hidden 3072), QK RMSNorm over the hidden, "
                           "3-axis RoPE (frame, height, width: 22/21/21 pairs)"},
    "wan2.1-14b": {"hq": 40, "hk": 40, "head_dim": 128, "base": 10000.0, "sections": [22, 21, 21],
                   "qk_norm": "hidden",
                   "about": "WAN 2.1-14B's DiT: 40 heads, D 128 (hidden 5120), QK RMSNorm over the hidden, "
                            "3-axis RoPE"},
    "tiny-dit": {"hq": 4, "hk": 4, "head_dim": 32, "base": 10000.0, "sections": [6, 5, 5], "qk_norm": "hidden",
                 "about": "CPU smoke only: QK RMSNorm over the hidden (4 x 32) and 3-axis RoPE (a tiny WAN)"},
    "tiny-latent": {"hq": 3, "hk": 1, "head_dim": 24, "rotary_dim": 8, "rotary_at": "back", "base": 10000.0,
                    "latent_dim": 32, "about": "CPU smoke only: MLA prologue, 3 heads, 16 + 8 rope columns, latent 32"},
}

SIZES = {
    # prefill / training: 2k .. 128k tokens as batches of 4k-token sequences (2k: one sequence)
    "prefill": [[1, 2048], [1, 4096], [2, 4096], [4, 4096], [8, 4096], [16, 4096], [32, 4096]],
    # one long sequence: positions reach 128k (where fp32 angles go wrong)
    "long": [[1, 16384], [1, 32768], [1, 65536], [1, 131072]],
    # varied positions at two sizes
    "mid": [[4, 4096], [8, 4096]],
    # decode: 1..256 sequences, one token each
    "decode": [[1, 1], [2, 1], [4, 1], [8, 1], [16, 1], [32, 1], [64, 1], [128, 1], [256, 1]],
    # prefill of one sequence: 2k .. 32k tokens (the prologue's prefill, at an offset)
    "prefill-1seq": [[1, 2048], [1, 4096], [1, 8192], [1, 16384], [1, 32768]],
    # training batches of 4k-token sequences for qk_norm_rope fwd+bwd
    "train": [[4, 4096], [8, 4096], [16, 4096]],
    # RoPE fused into attention: 8k-16k tokens as 1k, 4k and 16k-token sequences (the S^2 work grows 16x per step)
    "attention": [[8, 1024], [4, 4096], [1, 16384]],
    # a diffusion transformer's video latents: 4k-16k tokens, one sequence
    "dit": [[1, 4096], [1, 8192], [1, 16384]],
    # the CPU mode: decode (1-256 sequences, one token each), then the prefill of two 4k-token sequences
    "cpu": [[1, 1], [8, 1], [32, 1], [256, 1], [2, 4096]],
}

_BF16_NEOX = {"dtypes": ["bf16"], "styles": ["neox"]}
# The attention prologue at Llama-3-8B and Qwen3-8B shapes (without and with the per-head norm).
_PROLOGUE = {"models": ["llama3-8b", "qwen3-8b"], **_BF16_NEOX}
# RoPE fused into attention at GQA D128, MHA D64 and MLA (D 192, rotary 64 at the back, v 128) shapes.
_ATTENTION = {"name": "attention", "models": ["llama3-8b", "mha16-d64", "mla-rope"], **_BF16_NEOX,
              "positions": ["range"], "causal": [False, True], "sizes": "attention",
              "modes": ["attn-fwd", "attn-fwdbwd"]}
# The MLA prologue at DeepSeek-V3 shapes (128 heads, and 16 as on one of 8 tensor-parallel GPUs); DeepSeek pairs
# interleaved columns.
_MLA = {"models": ["deepseek-v3-tp8", "deepseek-v3"], "dtypes": ["bf16"], "styles": ["interleaved"]}
# The diffusion transformers' prologue at WAN 2.x shapes: interleaved pairs (WAN rotates complex pairs), positions
# on three axes.
_DIT = {"models": ["wan2.2-5b", "wan2.1-14b"], "dtypes": ["bf16"], "styles": ["interleaved"], "positions": ["mrope"]}

PRESETS = {
    # One representative case per target (but the attention modes': preset "attention"); about 3-4 minutes on an
    # H100 (an estimate: 2-3 before the prologue's cases; most of it torch.compile of the peers).
    "quick": [
        {"name": "fwd-large", "models": ["llama3-8b"], **_BF16_NEOX, "positions": ["range"],
         "sizes": [[8, 4096]], "modes": ["fwd"]},
        {"name": "fwd-cold", "models": ["llama3-8b"], **_BF16_NEOX, "positions": ["range"],
         "sizes": [[1, 2048], [4, 4096]], "modes": ["fwd"]},
        {"name": "fwdbwd", "models": ["llama3-8b"], **_BF16_NEOX, "positions": ["range"],
         "sizes": [[4, 4096]], "modes": ["fwdbwd"]},
        {"name": "decode", "models": ["llama3-8b"], **_BF16_NEOX, "positions": ["batch"],
         "sizes": [[1, 1], [64, 1]], "modes": ["decode"]},
        {"name": "host", "models": ["llama3-8b"], **_BF16_NEOX, "positions": ["batch"],
         "sizes": [[1, 1]], "modes": ["host"]},
        {"name": "prologue-decode", "models": ["qwen3-8b"], **_BF16_NEOX, "positions": ["batch"],
         "caches": ["bf16"], "sizes": [[1, 1], [64, 1]], "modes": ["kv-decode"]},
        {"name": "prologue-prefill", "models": ["qwen3-8b"], **_BF16_NEOX, "positions": ["offset"],
         "caches": ["fp8"], "sizes": [[1, 8192]], "modes": ["kv-prefill"]},
        {"name": "prologue-step", "models": ["qwen3-8b"], **_BF16_NEOX, "positions": ["batch"],
         "caches": ["bf16"], "sizes": [[1, 1], [64, 1]], "modes": ["kv-step"]},
        {"name": "qk-norm-fwdbwd", "models": ["qwen3-8b"], **_BF16_NEOX, "positions": ["range"],
         "sizes": [[8, 4096]], "modes": ["norm-fwdbwd"]},
        {"name": "mla-prologue-decode", **_MLA, "positions": ["batch"], "caches": ["bf16"],
         "sizes": [[1, 1], [64, 1]], "modes": ["mla-decode"]},
        {"name": "mla-prologue-prefill", **_MLA, "positions": ["offset"], "caches": ["fp8"], "sizes": [[1, 8192]],
         "modes": ["mla-prefill"]},
        {"name": "hidden-norm-fwd", **_DIT, "sizes": [[1, 8192]], "modes": ["hidden-norm-fwd"]},
    ],
    # Everything the issue lists. Split it with --cases GROUP or --shard I/N to fit a time limit per command.
    "full": [
        {"name": "fwd-models", "models": ["llama3-8b", "llama3-70b", "mha16-d64", "hd256", "mla-rope"],
         **_BF16_NEOX, "positions": ["range"], "sizes": "prefill", "modes": ["fwd"]},
        {"name": "fwd-head-major", "models": ["llama3-8b"], **_BF16_NEOX, "positions": ["range"], "layout": "bhsd",
         "sizes": "prefill-1seq", "modes": ["fwd"]},
        {"name": "fwd-dtypes", "models": ["llama3-8b"], "dtypes": ["fp32", "fp16"], "styles": ["neox"],
         "positions": ["range"], "sizes": "prefill", "modes": ["fwd"]},
        {"name": "fwd-interleaved", "models": ["llama3-8b", "mha16-d64"], "dtypes": ["bf16"],
         "styles": ["interleaved"], "positions": ["range"], "sizes": "prefill", "modes": ["fwd"]},
        {"name": "fwd-positions", "models": ["llama3-8b"], "dtypes": ["bf16"], "styles": ["neox", "interleaved"],
         "positions": ["offset", "batch", "ids", "thd"], "sizes": "mid", "modes": ["fwd"]},
        {"name": "fwd-long", "models": ["llama3-8b"], **_BF16_NEOX, "positions": ["range"], "sizes": "long",
         "modes": ["fwd"]},
        {"name": "fwdbwd", "models": ["llama3-8b", "llama3-70b", "mha16-d64"], **_BF16_NEOX,
         "positions": ["range"], "sizes": "prefill", "modes": ["fwdbwd"]},
        {"name": "fwdbwd-fp32", "models": ["llama3-8b"], "dtypes": ["fp32"], "styles": ["neox"],
         "positions": ["range"], "sizes": "prefill", "modes": ["fwdbwd"]},
        {"name": "fwdbwd-thd", "models": ["llama3-8b"], **_BF16_NEOX, "positions": ["thd"], "sizes": "mid",
         "modes": ["fwdbwd"]},
        {"name": "decode", "models": ["llama3-8b", "llama3-70b"], **_BF16_NEOX, "positions": ["batch"],
         "sizes": "decode", "modes": ["decode"]},
        {"name": "mrope", "models": ["qwen2-vl-7b", "qwen3-vl-8b"], **_BF16_NEOX, "positions": ["mrope"],
         "sizes": "prefill", "modes": ["fwd"]},
        {"name": "mrope-decode", "models": ["qwen2-vl-7b", "qwen3-vl-8b"], **_BF16_NEOX, "positions": ["mrope"],
         "sizes": "decode", "modes": ["decode"]},
        {"name": "decode-fp16-interleaved", "models": ["llama3-8b"], "dtypes": ["fp16"], "styles": ["interleaved"],
         "positions": ["batch"], "sizes": "decode", "modes": ["decode"]},
        {"name": "host", "models": ["llama3-8b"], **_BF16_NEOX, "positions": ["batch"],
         "sizes": [[1, 1], [64, 1]], "modes": ["host"]},
        # a training step's host time, one token (a larger step's host time hides behind its kernels)
        {"name": "host-train", "models": ["qwen3-8b"], **_BF16_NEOX, "positions": ["range"], "sizes": [[1, 1]],
         "modes": ["host"], "impls": ["ropekit-qk-norm-step", "ropekit-step"]},
        # The attention prologue: rope_kv_write against a one-kernel copy of its bytes and the unfused chain.
        {"name": "prologue-decode", **_PROLOGUE, "positions": ["batch"], "caches": ["bf16", "fp8"],
         "sizes": "decode", "modes": ["kv-decode"]},
        {"name": "prologue-prefill", **_PROLOGUE, "positions": ["offset"], "caches": ["bf16", "fp8"],
         "sizes": "prefill-1seq", "modes": ["kv-prefill"]},
        # A decode step as the model runs it: the QKV projection GEMM, then rope_kv_write, in one CUDA graph.
        {"name": "prologue-step", **_PROLOGUE, "positions": ["batch"], "caches": ["bf16"], "sizes": "decode",
         "modes": ["kv-step"]},
        {"name": "qk-norm-fwdbwd", "models": ["qwen3-8b"], **_BF16_NEOX, "positions": ["range"], "sizes": "train",
         "modes": ["norm-fwdbwd"]},
        # The MLA prologue: mla_rope_kv_write against a one-kernel copy of its bytes and the unfused chain.
        {"name": "mla-prologue-decode", **_MLA, "positions": ["batch"], "caches": ["bf16", "fp8"], "sizes": "decode",
         "modes": ["mla-decode"]},
        {"name": "mla-prologue-prefill", **_MLA, "positions": ["offset"], "caches": ["bf16", "fp8"],
         "sizes": "prefill-1seq", "modes": ["mla-prefill"]},
        # The diffusion transformers' prologue: qk_norm_rope(norm_over="hidden", v=v) against a copy of its bytes.
        {"name": "hidden-norm-fwd", **_DIT, "sizes": "dit", "modes": ["hidden-norm-fwd"]},
        # RoPE fused into attention: rope_attention against SDPA (cuDNN, flash) and flex_attention.
        _ATTENTION,
    ],
    # RoPE fused into attention alone (the "attention" group of "full"): 18 cases x 2 modes, 7 implementations each.
    "attention": [_ATTENTION],
    # apply_rope on CPU tensors (the float32 path) against transformers' apply_rotary_pos_emb: a measurement of
    # the host, run on its own (ropekit bench --preset cpu); the rows name the CPU and torch's thread count.
    "cpu": [
        {"name": "cpu", "models": ["llama3-8b"], "dtypes": ["bf16", "fp32"], "styles": ["neox"],
         "positions": ["ids", "offset"], "sizes": "cpu", "modes": ["cpu"]},
    ],
    # CPU smoke run of the harness itself (TRITON_INTERPRET=1): tiny shapes, not a performance figure.
    "smoke": [
        {"name": "smoke-mrope", "models": ["tiny", "tiny-interleaved"], "dtypes": ["bf16"], "styles": ["neox"],
         "positions": ["mrope"], "sizes": [[2, 16]], "modes": ["fwd"]},
        {"name": "smoke-neox", "models": ["tiny"], "dtypes": ["fp32"], "styles": ["neox"],
         "positions": ["range"], "sizes": [[1, 16]], "modes": ["fwd", "fwdbwd"]},
        {"name": "smoke-head-major", "models": ["tiny"], "dtypes": ["bf16"], "styles": ["neox"], "layout": "bhsd",
         "positions": ["ids"], "sizes": [[2, 8]], "modes": ["fwd", "fwdbwd"]},
        {"name": "smoke-varlen", "models": ["tiny"], "dtypes": ["bf16"], "styles": ["interleaved"],
         "positions": ["thd"], "sizes": [[2, 8]], "modes": ["fwd"]},
        {"name": "smoke-back", "models": ["tiny-back"], "dtypes": ["fp16"], "styles": ["neox"],
         "positions": ["ids"], "sizes": [[2, 4]], "modes": ["fwd"]},
        {"name": "smoke-decode", "models": ["tiny"], "dtypes": ["fp32"], "styles": ["neox"],
         "positions": ["batch"], "sizes": [[2, 1]], "modes": ["decode", "host"]},
        {"name": "smoke-kv-decode", "models": ["tiny-qknorm"], "dtypes": ["bf16"], "styles": ["neox"],
         "positions": ["batch"], "caches": ["bf16", "fp8"], "sizes": [[3, 1]], "modes": ["kv-decode"]},
        {"name": "smoke-kv-step", "models": ["tiny-qknorm"], "dtypes": ["bf16"], "styles": ["neox"],
         "positions": ["batch"], "caches": ["bf16"], "sizes": [[3, 1]], "modes": ["kv-step"]},
        {"name": "smoke-kv-prefill", "models": ["tiny"], "dtypes": ["fp16"], "styles": ["neox"],
         "positions": ["offset"], "caches": ["fp8"], "sizes": [[1, 16]], "modes": ["kv-prefill"]},
        {"name": "smoke-qk-norm", "models": ["tiny-qknorm"], "dtypes": ["bf16"], "styles": ["neox"],
         "positions": ["range"], "sizes": [[2, 8]], "modes": ["norm-fwdbwd"]},
        {"name": "smoke-attention", "models": ["tiny-mla"], "dtypes": ["bf16"], "styles": ["neox"],
         "positions": ["range"], "causal": [True], "sizes": [[1, 64]], "modes": ["attn-fwd", "attn-fwdbwd"]},
        {"name": "smoke-mla-decode", "models": ["tiny-latent"], "dtypes": ["bf16"], "styles": ["interleaved"],
         "positions": ["batch"], "caches": ["bf16", "fp8"], "sizes": [[3, 1]], "modes": ["mla-decode"]},
        {"name": "smoke-mla-prefill", "models": ["tiny-latent"], "dtypes": ["fp16"], "styles": ["neox"],
         "positions": ["offset"], "caches": ["fp8"], "sizes": [[2, 8]], "modes": ["mla-prefill"]},
        {"name": "smoke-hidden-norm", "models": ["tiny-dit"], "dtypes": ["bf16"], "styles": ["interleaved"],
         "positions": ["mrope"], "sizes": [[1, 16]], "modes": ["hidden-norm-fwd"]},
    ],
}

TARGETS = [
    {"key": "fwd-large", "what": "fwd, >= 100 MB moved, vs copy", "limit": 1.01, "mode": "fwd",
     "where": {"bytes": [100_000_000, None]}},
    {"key": "fwd-cold", "what": "fwd, 2k-16k tokens, cold L2, vs copy", "limit": 1.05, "mode": "fwd",
     "where": {"tokens": [2048, 16384]}},
    {"key": "fwdbwd", "what": "fwd+bwd via autograd vs ideal 4-pass copy", "limit": 1.10, "mode": "fwdbwd"},
    {"key": "decode", "what": "decode 1-64 tokens, 32/8 heads D128, graph replay, vs copy of q", "limit": 1.00,
     "mode": "decode", "where": {"tokens": [None, 64], "hq": [32, 32], "hk": [8, 8], "head_dim": [128, 128]}},
    {"key": "host", "what": "eager host time per call vs x.add_(1)", "limit": 1.00, "mode": "host"},
    # Peers, each in the same run: Liger's decode (bf16 math, tables) and our own Helion kernel of apply_rope.
    {"key": "decode-vs-liger", "what": "decode (1-D or multi-axis positions), graph replay, vs Liger", "limit": 1.00,
     "mode": "decode", "versus": "liger"},
    {"key": "fwd-vs-helion", "what": "fwd vs a Helion kernel of apply_rope (per-token tables)", "limit": 1.00,
     "mode": "fwd", "versus": "helion"},
    {"key": "decode-vs-helion", "what": "decode, graph replay, vs a Helion kernel of apply_rope", "limit": 1.00,
     "mode": "decode", "versus": "helion"},
    {"key": "exact-vs-table", "what": "fwd, >= 100 MB, exact in-kernel angles vs fp32 table path", "limit": 1.02,
     "mode": "fwd", "where": {"bytes": [100_000_000, None]}, "versus": "ropekit-table"},
    {"key": "mrope-fwd", "what": "M-RoPE fwd, >= 100 MB, vs the same call with 1-D positions", "limit": 1.02,
     "mode": "fwd", "where": {"bytes": [100_000_000, None]}, "versus": "ropekit-1d"},
    {"key": "mrope-decode", "what": "M-RoPE decode (graph replay) vs the same call with 1-D positions",
     "limit": 1.02, "mode": "decode", "versus": "ropekit-1d"},
    # The attention prologue (rope_kv_write, qk_norm_rope). "unfused >= 2x slower" is written as fused / unfused.
    {"key": "prologue-decode", "what": "rope_kv_write decode 1-64 tokens, 32/8 heads D128, graph replay, vs copy-kv",
     "limit": 1.10, "mode": "kv-decode", "impl": "ropekit-kv-write",
     "where": {"tokens": [None, 64], "hq": [32, 32], "hk": [8, 8], "head_dim": [128, 128]}},
    {"key": "prologue-decode-vs-unfused",
     "what": "rope_kv_write decode 1-64 tokens, 32/8 heads D128, vs the unfused chain (<= 0.5: >= 2x faster)",
     "limit": 0.5, "mode": "kv-decode", "impl": "ropekit-kv-write", "versus": "unfused-kv",
     "where": {"tokens": [None, 64], "hq": [32, 32], "hk": [8, 8], "head_dim": [128, 128]}},
    {"key": "prologue-step",
     "what": "decode step (CUDA graph): QKV GEMM + rope_kv_write, 32/8 heads D128, vs GEMM + copy-kv",
     "limit": 1.10, "mode": "kv-step", "impl": "gemm+ropekit-kv-write", "versus": "gemm+copy-kv",
     "where": {"hq": [32, 32], "hk": [8, 8], "head_dim": [128, 128]}},
    {"key": "prologue-prefill", "what": "rope_kv_write prefill 2k-32k tokens, cold L2, vs copy-kv", "limit": 1.05,
     "mode": "kv-prefill", "impl": "ropekit-kv-write", "where": {"tokens": [2048, 32768]}},
    {"key": "prologue-decode-fp8q",
     "what": "rope_kv_write, float8 q (static or in-launch scales), decode 1-64 tokens, 32/8 heads D128, vs copy-kv",
     "limit": 1.10, "mode": "kv-decode", "impl": "ropekit-kv-write-fp8q*",
     "where": {"tokens": [None, 64], "hq": [32, 32], "hk": [8, 8], "head_dim": [128, 128]}},
    {"key": "prologue-prefill-fp8q", "what": "rope_kv_write, float8 q, prefill 2k-32k tokens, cold L2, vs copy-kv",
     "limit": 1.05, "mode": "kv-prefill", "impl": "ropekit-kv-write-fp8q*", "where": {"tokens": [2048, 32768]}},
    {"key": "prologue-decode-paged",
     "what": "rope_kv_write into paged_x, paged_hnd or page-table pages, decode 1-64 tokens, 32/8 heads D128, "
             "graph replay, vs copy-kv",
     "limit": 1.10, "mode": "kv-decode", "impl": "ropekit-kv-write-pag*",
     "where": {"tokens": [None, 64], "hq": [32, 32], "hk": [8, 8], "head_dim": [128, 128]}},
    {"key": "prologue-prefill-paged",
     "what": "rope_kv_write into paged_x, paged_hnd or page-table pages, prefill 2k-32k tokens, vs copy-kv",
     "limit": 1.05, "mode": "kv-prefill", "impl": "ropekit-kv-write-pag*", "where": {"tokens": [2048, 32768]}},
    {"key": "fwd-fp8-dynamic", "what": "fwd, float8 q and k with in-launch scales, 2k-16k tokens, vs copy of its bytes",
     "limit": 1.05, "mode": "fwd", "impl": "ropekit-fp8qk-dynamic", "versus": "copy-fp8out",
     "where": {"tokens": [2048, 16384]}},
    {"key": "qk-norm-fwdbwd", "what": "qk_norm_rope fwd+bwd, >= 8x4096 tokens, vs ideal 5-pass copy", "limit": 1.10,
     "mode": "norm-fwdbwd", "impl": "ropekit-qk-norm", "where": {"tokens": [32768, None]}},
    {"key": "qk-norm-fwdbwd-graph", "what": "qk_norm_rope fwd+bwd kernels (one step in a CUDA graph), >= 4x4096 "
     "tokens, vs ideal 5-pass copy", "limit": 1.10, "mode": "norm-fwdbwd", "impl": "ropekit-qk-norm-graph",
     "where": {"tokens": [16384, None]}},
    {"key": "qk-norm-step-host", "what": "qk_norm_rope training step's eager host time vs apply_rope's (same rope "
     "args)", "limit": 1.0, "mode": "host", "impl": "ropekit-qk-norm-step", "versus": "ropekit-step"},
    {"key": "qk-norm-vs-compile", "what": "qk_norm_rope fwd+bwd vs torch.compile of the unfused PyTorch code",
     "limit": 1.0, "mode": "norm-fwdbwd", "impl": "ropekit-qk-norm", "versus": "unfused-compile"},
    # The diffusion transformers' prologue (qk_norm_rope over the hidden, with v's copy).
    {"key": "hidden-norm-fwd", "what": "qk_norm_rope(norm_over='hidden', v) fwd, 4k-16k tokens, vs copy-qkv",
     "limit": 1.05, "mode": "hidden-norm-fwd", "impl": "ropekit-hidden-norm", "where": {"tokens": [4096, 16384]}},
    {"key": "hidden-norm-vs-compile",
     "what": "qk_norm_rope(norm_over='hidden', v) fwd vs torch.compile of the unfused PyTorch code",
     "limit": 1.0, "mode": "hidden-norm-fwd", "impl": "ropekit-hidden-norm", "versus": "unfused-compile"},
    # The MLA prologue (mla_rope_kv_write) against copy-mla, the one-kernel copy of its bytes.
    # Both q dtypes (the inputs' and float8): each must stay within the copy of the bf16 op's bytes.
    {"key": "mla-decode", "what": "mla_rope_kv_write (bf16 or float8 q) decode 1-256 tokens, DeepSeek-V3 16/128 "
     "heads, paged cache, graph replay, vs copy-mla", "limit": 1.10, "mode": "mla-decode",
     "impl": "ropekit-mla-kv-write*"},
    {"key": "mla-prefill", "what": "mla_rope_kv_write (bf16 or float8 q) prefill 2k-32k tokens, cold L2, vs copy-mla",
     "limit": 1.05, "mode": "mla-prefill", "impl": "ropekit-mla-kv-write*", "where": {"tokens": [2048, 32768]}},
    # RoPE fused into attention (rope_attention). Tiers in the text: required (ahead of the unfused chains a user
    # can write with flash or flex), goal (ahead of the unfused chain with cuDNN, the baseline), moonshot (RoPE for
    # free: as fast as cuDNN's attention without any rotation).
    {"key": "attn-fwd-vs-rope-flex", "what": "required: rope_attention fwd vs apply_rope + flex_attention",
     "limit": 1.0, "mode": "attn-fwd", "versus": "rope+flex"},
    {"key": "attn-fwd-vs-rope-flash", "what": "required: rope_attention fwd vs apply_rope + SDPA flash",
     "limit": 1.0, "mode": "attn-fwd", "versus": "rope+sdpa-flash"},
    {"key": "attn-fwd-vs-rope-cudnn", "what": "goal: rope_attention fwd vs apply_rope + SDPA cuDNN",
     "limit": 1.0, "mode": "attn-fwd", "versus": "rope+sdpa-cudnn"},
    {"key": "attn-fwd-vs-cudnn", "what": "moonshot: rope_attention fwd vs SDPA cuDNN without RoPE",
     "limit": 1.0, "mode": "attn-fwd", "versus": "sdpa-cudnn"},
    {"key": "attn-fwdbwd-vs-rope-flex", "what": "required: rope_attention fwd+bwd vs apply_rope + flex_attention",
     "limit": 1.0, "mode": "attn-fwdbwd", "versus": "rope+flex"},
    {"key": "attn-fwdbwd-vs-rope-flash", "what": "required: rope_attention fwd+bwd vs apply_rope + SDPA flash",
     "limit": 1.0, "mode": "attn-fwdbwd", "versus": "rope+sdpa-flash"},
    {"key": "attn-fwdbwd-vs-rope-cudnn", "what": "goal: rope_attention fwd+bwd vs apply_rope + SDPA cuDNN",
     "limit": 1.0, "mode": "attn-fwdbwd", "versus": "rope+sdpa-cudnn"},
    {"key": "attn-fwdbwd-vs-cudnn", "what": "moonshot: rope_attention fwd+bwd vs SDPA cuDNN without RoPE",
     "limit": 1.0, "mode": "attn-fwdbwd", "versus": "sdpa-cudnn"},
    # The CPU (--preset cpu): apply_rope's float32 path against transformers' apply_rotary_pos_emb (the baseline).
    {"key": "cpu-vs-hf", "what": "CPU: apply_rope, later layers (the positions of the calls before), vs "
     "transformers' apply_rotary_pos_emb", "limit": 1.0, "mode": "cpu", "impl": "ropekit"},
    {"key": "cpu-first-layer-vs-hf", "what": "CPU: apply_rope, first layer (new positions), vs transformers' "
     "apply_rotary_pos_emb alone", "limit": 1.0, "mode": "cpu", "impl": "ropekit-first-layer"},
    {"key": "cpu-first-layer-vs-hf-first-layer", "what": "CPU: apply_rope, first layer (new positions), vs "
     "transformers' first layer (its cos/sin timed too)", "limit": 1.0, "mode": "cpu", "impl": "ropekit-first-layer",
     "versus": "hf-first-layer"},
]
