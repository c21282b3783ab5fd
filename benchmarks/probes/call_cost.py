"""Host time per eager call through the public API only, so that the same script times two checkouts
(``PYTHONPATH=<checkout>/src python benchmarks/probes/call_cost.py``) in one session on one card.

Rows: repeated calls of one signature (served by the fast path from the third call on), and calls whose
signature is new every time (packed batches whose token count changes each step), which pay validation, the
launcher's argument building and whatever the fast path does on a miss. Figures are over several rounds,
microseconds per call, with ``x.add_(1)`` as the floor of any eager launch. Each row gives the median and the best
round; host time on a shared machine is noisy, so compare checkouts by interleaving runs.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import timeit


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=2000, help="calls per round (default 2000)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds; the median is reported (default 7)")
    parser.add_argument("--label", default="", help="printed before every row (e.g. the checkout's commit)")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> None:
    import torch

    import ropekit

    def per_call_us(fn) -> tuple[float, float]:
        """(median, best) over the rounds: the best round is the least disturbed by other work on the host."""
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        times = timeit.Timer(fn, setup=torch.cuda.synchronize).repeat(repeat=args.rounds, number=args.number)
        return statistics.median(times) / args.number * 1e6, min(times) / args.number * 1e6

    dev = torch.device("cuda")
    bf16 = torch.bfloat16
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=bf16)
    k = torch.randn(1, 1, 8, 128, device=dev, dtype=bf16)
    x = torch.zeros_like(q)
    pos = torch.tensor([[4095]], device=dev)
    cos = torch.randn(1, 1, 128, device=dev, dtype=bf16)
    sin = torch.randn(1, 1, 128, device=dev, dtype=bf16)
    ql, kl = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    # New signatures: packed tokens [T, H, D] with T cycling through more values than any cache holds.
    tokens = 4096
    qt = torch.randn(tokens, 32, 128, device=dev, dtype=bf16)
    kt = torch.randn(tokens, 8, 128, device=dev, dtype=bf16)
    lengths = itertools.cycle(range(1, tokens + 1))

    def fwd_bwd():
        outs = ropekit.apply_rope(ql, kl, positions=4095)
        return torch.autograd.grad(outs, (ql, kl), (gq, gk))

    def new_signature():
        t = next(lengths)
        return ropekit.apply_rope(qt[:t], kt[:t], layout="thd")

    def new_signature_in_place():
        t = next(lengths)
        return ropekit.apply_rope_(qt[:t], kt[:t], layout="thd")

    rows = [
        ("x.add_(1) (floor)", lambda: x.add_(1)),
        ("apply_rope(q, k, positions=int)", lambda: ropekit.apply_rope(q, k, positions=4095)),
        ("apply_rope_(q, k, positions=int)", lambda: ropekit.apply_rope_(q, k, positions=4095)),
        ("apply_rope(q, k, positions=tensor)", lambda: ropekit.apply_rope(q, k, positions=pos)),
        ("apply_rope(q, k, cos=, sin=) per token", lambda: ropekit.apply_rope(q, k, cos=cos, sin=sin)),
        ("apply_rope + autograd.grad", fwd_bwd),
        ("rope_backward(gq, gk, positions=int)", lambda: ropekit.rope_backward(gq, gk, positions=4095)),
        ("new signature every call, thd", new_signature),
        ("new signature every call, thd, in place", new_signature_in_place),
    ]
    print(f"{args.label} {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{args.label} {'call':<44} {'median':>8} {'best':>8}  (us per call)")
    for name, fn in rows:
        median, best = per_call_us(fn)
        print(f"{args.label} {name:<44} {median:8.2f} {best:8.2f}")


if __name__ == "__main__":
    main(parse_args())
