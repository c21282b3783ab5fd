"""Eager fast path: a launch plan per call signature, so a repeated call costs a dictionary lookup and a launch.

A call's *signature* is everything validation and the kernel's specialisation depend on: every argument's type,
shape, strides, dtype, device and 16-byte alignment, and every other option, but not data pointers or an int
position offset. The first call of a signature goes through the full path (:func:`ropekit._validation.validate_args`,
:func:`ropekit.autograd.rotate`) and is noted; the second also records a :class:`Plan` holding the compiled kernel
bound to its grid and arguments (:class:`ropekit.triton.runtime.Replay`), so a signature seen once -- packed
sequences whose token count changes every step -- costs only the note. Later calls of a recorded signature skip
validation and argument building: they read the data pointers, allocate the outputs and launch. Calls that need
autograd (out of place) get plans of their own, replayed through :class:`PlannedRope`, whose backward is the
conjugate rotation through :func:`rotate` (itself replayed from a plan keyed by the gradients' layout).

What a plan re-checks per call is what can change within a signature: the int position offset (negative, past a
cos/sin table or past the largest position sends the call back to the full path, which raises or handles it), and
for in-place calls whether q and k share memory in a way the full path has not checked. In-place replays declare
their writes to autograd (version counters), as the full path does.

The attention prologue's calls get plans of the same kind, recorded from the launch their full path made:
``rope_kv_write`` (:class:`KvPlan`) and ``qk_norm_rope`` (:class:`NormPlan`, with its backward's launch replayed
per layout of the incoming gradients through :class:`PlannedNormRope`). ``rope_attention``'s calls
(:class:`AttentionPlan`) replay the sequence of launches their full path made -- the angle rows' rotation, k's
rotated copy, the attention kernel -- with the buffers the launchers allocated allocated afresh, and their backward
(:class:`ropekit._fastpath.attention.PlannedRopeAttention`) the backward's launches, per layout of the incoming
gradients.

The same code runs on CPU tensors under :func:`ropekit.testing.kernels_on_cpu` (the Triton interpreter), with
tensors instead of integer addresses as the kernel's pointer arguments, so CPU-only CI tests the fast path
against the full path. ``ROPEKIT_DISABLE_FAST_PATH=1`` or :func:`ropekit.set_fast_path` turns plans off.
"""

from ropekit._fastpath.attention import AttentionPlan, planned_attention
from ropekit._fastpath.plans import _ATTENTION_PLANS, _KV_PLANS, _NORM_PLANS, _PLANS, clear
from ropekit._fastpath.prologue import KvPlan, NormPlan, norm_rotate, write_kv
from ropekit._fastpath.rope import Plan, rotate, signature

__all__ = ["rotate", "norm_rotate", "write_kv", "planned_attention", "clear", "signature", "Plan", "KvPlan",
           "NormPlan", "AttentionPlan", "_PLANS", "_KV_PLANS", "_NORM_PLANS", "_ATTENTION_PLANS"]
