"""Contiguous M-RoPE decode past 16 tokens: variants of the launch (constant axis stride, per-axis loads, twice the
warps) against the 1-D call, replay / device time. Run from the repository root:
``PYTHONPATH=src python <this file> 16:2 17,18,20`` (heads 16:2, 28:4 or 12:2)."""
import sys

import torch
import triton

sys.path.insert(0, "benchmarks/probes")
from _graphs import kernel_us

from ropekit._spec import validate
from ropekit.bench.timing import GRAPH_CALLS, _replay_in_turn, capture_graph
from ropekit.triton import launcher

N = launcher._CONSTEXPR_NAMES
def variant(launch, warps=None, **over):
    grid, args, cx, w = launch
    cx = list(cx)
    for k, v in over.items():
        cx[N.index(k)] = v
    return grid, args, tuple(cx), warps or w

def main(shape, tokens):
    hq, hk, sections = shape
    print(torch.cuda.get_device_name(), triton.__version__, f"{hq}/{hk} contiguous {sections}")
    for T in tokens:
        q = torch.randn(T, 1, hq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(T, 1, hk, 128, device="cuda", dtype=torch.bfloat16)
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        ids = torch.randint(0, 8192, (3, T, 1), device="cuda")
        ids1 = ids[0].clone()
        s1 = validate(q, k, positions=ids1, base=1e6)
        sm = validate(q, k, positions=ids, sections=sections, base=1e6)
        l1 = launcher.kernel_launch(q, k, qo, ko, s1)
        lm = launcher.kernel_launch(q, k, qo, ko, sm)
        sa = ids.stride(0)
        w = lm[3]
        launches = {
            "1-d": l1, "1-d 2xw": variant(l1, 2 * l1[3]),
            "base": lm, "const": variant(lm, POS_AXIS_STRIDE=sa),
            "const+axis": variant(lm, POS_AXIS_STRIDE=sa, POS_PER_AXIS=True),
            "2xw": variant(lm, 2 * w), "2xw const+axis": variant(lm, 2 * w, POS_AXIS_STRIDE=sa, POS_PER_AXIS=True),
            "2xw const": variant(lm, 2 * w, POS_AXIS_STRIDE=sa),
        }
        fns = {n: (lambda L=L: launcher._launch(*L, q.device)) for n, L in launches.items()}
        ref = None
        for n, f in fns.items():
            if n.startswith("1-d"):
                continue
            qo.fill_(float("nan"))
            ko.fill_(float("nan"))
            f()
            o = (qo.clone(), ko.clone())
            if ref is None:
                ref = o
            assert all(torch.equal(a, b) for a, b in zip(o, ref)), n
        graphs = {n: capture_graph(f) for n, f in fns.items()}
        t = _replay_in_turn(graphs, 31, 10, GRAPH_CALLS)
        dev = {n: sum(kernel_us(f).values()) for n, f in fns.items()}
        base = t["1-d"]
        print(f"T={T:<3d} warps {w} 1-d {base:.3f}us | " + "  ".join(
            f"{n} {t[n] / base:.3f}/{dev[n] / dev['1-d']:.3f}" for n in fns if n != "1-d"), flush=True)

if __name__ == "__main__":
    shapes = {"16:2": (16, 2, (16, 24, 24)), "28:4": (28, 4, (16, 24, 24)), "12:2": (12, 2, (16, 24, 24))}
    main(shapes[sys.argv[1]], [int(x) for x in sys.argv[2].split(",")])
