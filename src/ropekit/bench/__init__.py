"""``ropekit bench``: time ropekit against a copy of the same bytes (the limit) and against peer implementations.

For every case of a preset (model shape x dtype x pairing style x positions x size, see ``ropekit/bench/registry.py``)
and every mode it asks for, one run times:

* a baseline: ``copy`` (one ``copy_`` moving the case's bytes, a device-to-device memcpy), ``copy-4pass``
  (fwd+bwd: one copy of twice the bytes), ``copy-q`` (decode: one copy of q only), ``add_`` (host: one
  ``x.add_(1)`` call);
* ropekit: ``apply_rope`` with exact in-kernel angles (``ropekit``), with fp32 cos/sin tables (``ropekit-table``),
  in place (``ropekit_``), the raw launcher with preallocated outputs (``ropekit-launcher``) and the transformers
  drop-in (``ropekit-hf``);
* the peers that are present: transformers' ``apply_rotary_pos_emb`` eager (``hf``) and under ``torch.compile``
  (``hf-compile``), Liger's ``liger_rotary_pos_emb`` (``liger``), flash-attn's Triton ``apply_rotary``
  (``flash-attn``), our own Helion NeoX kernel (``helion``, forward: modes ``fwd`` and ``decode``).
  An absent peer, or one that cannot do a case, gets a row saying why;
* the attention prologue: ``rope_kv_write`` (``ropekit-kv-write``; modes ``kv-decode`` under graph replay and
  ``kv-prefill`` with a cold L2) against ``copy-kv`` (one Triton kernel moving the bytes it must move) and the
  unfused chain (``unfused-kv``: torch ``rms_norm``, ``apply_rope``, the cache scatter by indexing), and
  ``qk_norm_rope`` fwd+bwd (``ropekit-qk-norm``, mode ``norm-fwdbwd``) against ``copy-5pass`` and the unfused
  PyTorch code eager and compiled (``unfused-eager``, ``unfused-compile``);
* the MLA prologue: ``mla_rope_kv_write`` (``ropekit-mla-kv-write``, with a float8 q ``-fp8q``; modes
  ``mla-decode`` under graph replay and ``mla-prefill`` with a cold L2, a paged latent cache) against ``copy-mla``
  (one Triton kernel moving its bytes) and the unfused chain (``unfused-mla``: ``apply_rope``, ``torch.cat``, the
  cache scatter by indexing);
* RoPE fused into attention: ``rope_attention`` (``ropekit`` in modes ``attn-fwd`` and ``attn-fwdbwd``) against
  ``ropekit.apply_rope`` followed by torch's SDPA on its cuDNN backend (``rope+sdpa-cudnn``, these modes' baseline)
  or flash backend (``rope+sdpa-flash``) or by ``torch.compile(flex_attention)`` (``rope+flex``), and the same
  attention without any rotation (``sdpa-cudnn``, ``sdpa-flash``, ``flex``: RoPE for free). Their rows also carry
  the attention's ``flops`` and ``tflops``.

Modes: ``fwd`` (``triton.testing.do_bench``, which zeroes a 256 MB buffer before every call, so every call starts
with a cold L2), ``fwdbwd`` (forward + ``torch.autograd.grad``), ``decode`` (many calls captured in one CUDA
graph per implementation, the case's graphs replayed in turn, time per call), ``host`` (``time.perf_counter``
around many eager calls with no sync inside the loop), ``attn-fwd`` and ``attn-fwdbwd`` (as ``fwd`` and ``fwdbwd``,
of attention over q [B, Hq, S, D], k [B, Hk, S, D], v [B, Hk, S, Dv], causal or not). Times are medians.

Before timing, every implementation's output (fwdbwd: its gradients; KV modes: q and the written cache rows;
attention: o, or the gradients of q, k and v, where it rotates) is compared with ropekit's: ``max_rel_diff`` is
``max|out - ropekit| / max|ropekit|``; above :data:`run.MISMATCH` (fp8 cache rows: :data:`prologue.FP8_MISMATCH`)
the row's note says ``MISMATCH``.

On a machine without CUDA the GPU presets run on CPU tensors (the Triton launcher needs ``TRITON_INTERPRET=1``)
with a ``timeit`` timer: a smoke run of the harness, labelled :data:`env.SMOKE_LABEL` everywhere, never a
performance figure. The ``cpu`` preset is the CPU's own performance run: ``apply_rope``'s float32 path against
transformers' ``apply_rotary_pos_emb`` on CPU tensors (:mod:`.cpu`), labelled :data:`env.CPU_PERF_LABEL`, its card
the CPU and torch's thread count.

Output: CSV, JSON and Markdown files with one row per (case, mode, impl), PNG plots (GB/s against tokens, one
line per implementation) and a short table printed last; with ``--history FILE`` the rows are also appended to an
append-only CSV.

Modules, one concern each: :mod:`.cases` (registry, case expansion and selection), :mod:`.env` (the environment
stamp), :mod:`.inputs` (tensors and the bytes model), :mod:`.peers` (importing the peers), :mod:`.impls` (baselines,
ropekit and peer builders), :mod:`.prologue` (the attention prologue's builders and the ``copy-kv`` kernel),
:mod:`.attention` (RoPE fused into attention and its SDPA and flex_attention peers),
:mod:`.timing` (timers), :mod:`.run` (the run loop), :mod:`.targets` (targets from the
registry and their evaluation), :mod:`.report` (CSV, JSON, Markdown, history, the table), :mod:`.plots` (PNGs),
:mod:`.cli` (options and :func:`main`).
"""

from .cli import main

__all__ = ["main"]
