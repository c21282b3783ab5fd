"""Host time per eager call on a CUDA GPU, broken into its parts, against ``x.add_(1)`` measured in the same run.

Decode shape (Llama-3-8B: 32/8 heads, D 128, bf16, one token). Each row is the median over rounds of many calls
with no synchronisation inside a round, as ``ropekit bench``'s host mode measures.

    python benchmarks/probes/host_time.py [--profile] [--only TEXT] [--number N] [--rounds R]

The qk_norm_rope rows time its training step (weights that require grad, positions [B, S], inv_freq given) against
apply_rope's with the same rope arguments and a Python autograd Function over the same four inputs; the "no launch"
floors are what autograd alone costs each step: a Function that launches nothing, saves what the op saves and
returns gradients of the op's shapes (so an op's own host time is its row minus its floor).
"""

# ruff: noqa: E402 - options are parsed before torch, Triton and ropekit load, so --help runs on any machine
from __future__ import annotations

import argparse


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of the fwd+bwd call")
    parser.add_argument("--only", default="", help="time only the rows whose name contains one of these "
                        "|-separated texts (case-insensitive; the first row, the baseline, always runs)")
    parser.add_argument("--number", type=int, default=2000, help="calls per round (default 2000)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds; the median is reported (default 9)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help exits here

import statistics
import timeit

import torch

import ropekit
from ropekit import _fastpath
from ropekit._spec import FORWARD, RopeArgs
from ropekit.triton.runtime import current_raw_stream, launch_hooks_idle


def per_call_us(fn, number: int = 2000, rounds: int = 9) -> tuple[float, float]:
    """(median, best) µs per call over the rounds: on a shared host the best round is the least disturbed one."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = timeit.Timer(fn, setup=torch.cuda.synchronize).repeat(repeat=rounds, number=number)
    return statistics.median(times) / number * 1e6, min(times) / number * 1e6


def _patched_rotary_rows(dev: torch.device) -> list:
    """A one-layer Llama's rotary forward at a decode step: transformers' own, and patched (lazy tables: nothing
    built unless read), with the table build a patched forward used to do every time. Needs transformers."""
    try:
        import transformers

        from ropekit.integrations import patching
    except ImportError as exc:
        print(f"(no transformers: {exc})")
        return []
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=4096, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=32, num_key_value_heads=8)
    hf = transformers.LlamaForCausalLM(config).to(dev, torch.bfloat16)
    patched = patching.patch(transformers.LlamaForCausalLM(config).to(dev, torch.bfloat16))
    h = torch.zeros(1, 1, 4096, device=dev, dtype=torch.bfloat16)
    ids = torch.tensor([[4095]], device=dev)
    rope = patching._ropekit_module(patched)
    f, _, inv = rope._choose(None, dev)
    return [
        ("transformers' rotary forward (decode)", lambda: hf.model.rotary_emb(h, ids)),
        ("patched rotary forward (lazy tables)", lambda: patched.model.rotary_emb(h, ids)),
        ("  part: the tables it does not build",
         lambda: patching._eager_tables(ids, inv, f.attention_scaling, None, "contiguous", h.dtype)),
    ]


def main(args: argparse.Namespace) -> None:
    dev = torch.device("cuda")
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 1, 8, 128, device=dev, dtype=torch.bfloat16)
    x = torch.zeros_like(q)
    pos = torch.tensor([[4095]], device=dev)
    cos = torch.randn(1, 1, 128, device=dev, dtype=torch.bfloat16)
    sin = torch.randn(1, 1, 128, device=dev, dtype=torch.bfloat16)
    ropekit.apply_rope(q, k, positions=4095)  # compile (the warm-up of each timed row records its plan)
    ropekit.apply_rope_(q, k, positions=4095)
    ropekit.apply_rope(q, k, positions=pos)
    ropekit.apply_rope(q, k, cos=cos, sin=sin)
    ropekit.apply_rope(q, k, positions=4095)  # the second call of a signature records its plan
    # the public call's arguments, defaults but for the position
    rope_args = RopeArgs(positions=4095)
    key, ptrs = _fastpath.signature(q, k, FORWARD, rope_args)
    plan = _fastpath._PLANS[key]
    launch = plan.launch
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    qp, kp, qop, kop = q.data_ptr(), k.data_ptr(), qo.data_ptr(), ko.data_ptr()
    tables = tuple(ptrs[i] if i >= 0 else plan.const_handles[~i] for i in plan.slots)  # as Plan.__call__ does

    ql, kl = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def fwd_bwd():
        outs = ropekit.apply_rope(ql, kl, positions=4095)
        return torch.autograd.grad(outs, (ql, kl), (gq, gk))

    xl = torch.randn_like(q).requires_grad_(True)

    def floor_fwd_bwd():
        return torch.autograd.grad((xl * 2,), (xl,), (gq,))

    class Twice(torch.autograd.Function):  # the least a Python autograd Function over q and k can cost
        @staticmethod
        def forward(ctx, a, b):
            return a * 2, b * 2

        @staticmethod
        def backward(ctx, ga, gb):
            return ga * 2, gb * 2

    def floor_function():
        return torch.autograd.grad(Twice.apply(ql, kl), (ql, kl), (gq, gk))

    # qk_norm_rope's training step (the performance issue's item 1): its host time against apply_rope's
    qw = (torch.rand(128, device=dev, dtype=torch.bfloat16) + 0.5).requires_grad_(True)
    kw = (torch.rand(128, device=dev, dtype=torch.bfloat16) + 0.5).requires_grad_(True)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device=dev, dtype=torch.float32) / 128))
    pos_bs = torch.arange(1, device=dev)[None]

    def norm_fwd_bwd():
        outs = ropekit.qk_norm_rope(ql, kl, qw, kw, eps=1e-6, positions=pos_bs, inv_freq=inv_freq)
        return torch.autograd.grad(outs, (ql, kl, qw, kw), (gq, gk))

    def norm_fwd_bwd_frozen():
        outs = ropekit.qk_norm_rope(ql, kl, qw.detach(), kw.detach(), eps=1e-6, positions=pos_bs, inv_freq=inv_freq)
        return torch.autograd.grad(outs, (ql, kl), (gq, gk))

    def rope_fwd_bwd_same_args():
        outs = ropekit.apply_rope(ql, kl, positions=pos_bs, inv_freq=inv_freq)
        return torch.autograd.grad(outs, (ql, kl), (gq, gk))

    class TwiceWithWeights(torch.autograd.Function):  # the least a Function over q, k and two weights can cost
        @staticmethod
        def forward(ctx, a, b, wa, wb):
            return a * 2, b * 2

        @staticmethod
        def backward(ctx, ga, gb):
            return ga * 2, gb * 2, torch.zeros_like(qw), torch.zeros_like(kw)

    def floor_function_weights():
        return torch.autograd.grad(TwiceWithWeights.apply(ql, kl, qw, kw), (ql, kl, qw, kw), (gq, gk))

    # The autograd machinery each op's step needs, launching nothing: apply_rope's saves only its rope tensors and
    # returns two gradients; qk_norm_rope's also saves q, k and both weights, and returns four.
    class RopeShaped(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(pos_bs, inv_freq)
            return torch.empty_like(a), torch.empty_like(b)

        @staticmethod
        def backward(ctx, ga, gb):
            ctx.saved_tensors  # noqa: B018 -- the unpack (version checks) a real backward pays
            return torch.empty_like(ga), torch.empty_like(gb)

    class NormRopeShaped(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, wa, wb):
            ctx.save_for_backward(a, b, wa, wb, pos_bs, inv_freq)
            return torch.empty_like(a), torch.empty_like(b)

        @staticmethod
        def backward(ctx, ga, gb):
            a, b, wa, wb, *_ = ctx.saved_tensors
            return torch.empty_like(a), torch.empty_like(b), torch.empty_like(wa), torch.empty_like(wb)

    def floor_rope_shaped():
        return torch.autograd.grad(RopeShaped.apply(ql, kl), (ql, kl), (gq, gk))

    def floor_norm_shaped():
        return torch.autograd.grad(NormRopeShaped.apply(ql, kl, qw, kw), (ql, kl, qw, kw), (gq, gk))

    rows = [
        ("x.add_(1) (baseline)", lambda: x.add_(1)),
        ("apply_rope(q, k, positions=int)", lambda: ropekit.apply_rope(q, k, positions=4095)),
        ("apply_rope_(q, k, positions=int)", lambda: ropekit.apply_rope_(q, k, positions=4095)),
        ("apply_rope(q, k, positions=tensor)", lambda: ropekit.apply_rope(q, k, positions=pos)),
        ("apply_rope(q, k, cos=, sin=) per-token", lambda: ropekit.apply_rope(q, k, cos=cos, sin=sin)),
        ("apply_rope + autograd.grad (fwd+bwd)", fwd_bwd),
        ("  floor: autograd.grad of x * 2", floor_fwd_bwd),
        ("  floor: Python autograd.Function, q and k", floor_function),
        ("  backward part: rope_backward(gq, gk, positions=int)",
         lambda: ropekit.rope_backward(gq, gk, positions=4095)),
        ("  forward only, inputs require grad", lambda: ropekit.apply_rope(ql, kl, positions=4095)),
        ("qk_norm_rope + autograd.grad, weights with grad", norm_fwd_bwd),
        ("  the same, weights without grad", norm_fwd_bwd_frozen),
        ("  apply_rope + autograd.grad, the same rope args", rope_fwd_bwd_same_args),
        ("  floor: Python autograd.Function, q, k, weights", floor_function_weights),
        ("  floor: no launch, apply_rope's saves and grads", floor_rope_shaped),
        ("  floor: no launch, qk_norm_rope's saves and grads", floor_norm_shaped),
        ("  forward only: qk_norm_rope, inputs require grad",
         lambda: ropekit.qk_norm_rope(ql, kl, qw, kw, eps=1e-6, positions=pos_bs, inv_freq=inv_freq)),
        ("  forward only: apply_rope, the same rope args",
         lambda: ropekit.apply_rope(ql, kl, positions=pos_bs, inv_freq=inv_freq)),
        ("  part: signature (key + pointers)", lambda: _fastpath.signature(q, k, FORWARD, rope_args)),
        ("  part: plan lookup", lambda: _fastpath._PLANS.get(key)),
        ("  part: torch.empty(shape, dtype, device)",
         lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device)),
        ("  part: bound launch (Triton's launcher)", lambda: launch(qp, qop, kp, kop, *tables, 4095)),
        ("  part: current raw stream", lambda: current_raw_stream(0)),
        ("  part: Triton launch-hook check", launch_hooks_idle),
        ("  part: torch.compiler.is_compiling()", torch.compiler.is_compiling),
    ]
    rows += _patched_rotary_rows(dev)
    base = None
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'call':<50} {'us/call':>8} {'best':>8} {'x add_':>7}")
    for i, (name, fn) in enumerate(rows):
        if i and not any(part in name.lower() for part in args.only.lower().split("|")):
            continue
        us, best = per_call_us(fn, args.number, args.rounds)
        base = base or us
        print(f"{name:<50} {us:>8.2f} {best:>8.2f} {us / base:>7.2f}")
    if args.profile:
        import cProfile
        import pstats

        for name, step in (("apply_rope fwd+bwd", fwd_bwd), ("qk_norm_rope fwd+bwd", norm_fwd_bwd)):
            print(f"--- cProfile of {name}, 2000 steps")
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(2000):
                step()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            pstats.Stats(prof).sort_stats("cumulative").print_stats("ropekit", 25)


if __name__ == "__main__":
    main(ARGS)
