"""M-RoPE decode past 16 tokens: runtime/constant axis stride x per-pair/per-axis loads, and the launcher's pick,
each over the 1-D call (replay / device). Run from the repository root:
``PYTHONPATH=src python <this file> 32:8i 18,20 [warps]`` (shapes in SHAPES; ``warps``: 4 and 8 warps with the
constant stride and either load instead of the stride/load grid)."""
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
    w = warps or w
    cx = list(cx)
    for k, v in over.items():
        cx[N.index(k)] = v
    return grid, args, tuple(cx), w

SHAPES = {"16:2c": (16, 2, "contiguous", (16, 24, 24)), "12:2c": (12, 2, "contiguous", (16, 24, 24)),
          "28:4c": (28, 4, "contiguous", (16, 24, 24)), "32:8i": (32, 8, "interleaved", (24, 20, 20)),
          "16:8i": (16, 8, "interleaved", (24, 20, 20)), "64:8i": (64, 8, "interleaved", (24, 20, 20))}

def main(name, tokens):
    hq, hk, layout, sections = SHAPES[name]
    print(torch.cuda.get_device_name(), triton.__version__, f"{hq}/{hk} {layout} {sections}", flush=True)
    for T in tokens:
        q = torch.randn(T, 1, hq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(T, 1, hk, 128, device="cuda", dtype=torch.bfloat16)
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        ids = torch.randint(0, 8192, (3, T, 1), device="cuda")
        ids1 = ids[0].clone()
        l1 = launcher.kernel_launch(q, k, qo, ko, validate(q, k, positions=ids1, base=1e6))
        lm = launcher.kernel_launch(q, k, qo, ko, validate(q, k, positions=ids, sections=sections,
                                                            section_layout=layout, base=1e6))
        sa = ids.stride(0)
        named = dict(zip(N, lm[2]))
        pick = f"{'c' if named['POS_AXIS_STRIDE'] else 'rt'}-{'axis' if named['POS_PER_AXIS'] else 'pair'}"
        launches = {"1-d": l1, "launcher": lm}
        if MODE == "warps":
            for w in (4, 8):
                for ld in ("pair", "axis"):
                    launches[f"{w}w-{ld}"] = variant(lm, w, POS_AXIS_STRIDE=sa, POS_PER_AXIS=ld == "axis")
        else:
            for st in ("rt", "c"):
                for ld in ("pair", "axis"):
                    launches[f"{st}-{ld}"] = variant(lm, POS_AXIS_STRIDE=sa if st == "c" else 0,
                                                      POS_PER_AXIS=ld == "axis")
        fns = {n: (lambda L=L: launcher._launch(*L, q.device)) for n, L in launches.items()}
        ref = None
        for n, f in fns.items():
            if n == "1-d":
                continue
            qo.fill_(float("nan"))
            ko.fill_(float("nan"))
            f()
            o = (qo.clone(), ko.clone())
            ref = ref or o
            assert all(torch.equal(a, b) for a, b in zip(o, ref)), n
        graphs = {n: capture_graph(f) for n, f in fns.items()}
        t = _replay_in_turn(graphs, 31, 10, GRAPH_CALLS)
        dev = {n: sum(kernel_us(f).values()) for n, f in fns.items()}
        print(f"T={T:<3d} {lm[3]}w bt{named['BLOCK_T']} h{named['BLOCK_HQ']}/{named['BLOCK_HK']} pick {pick:8s} "
              f"1-d {t['1-d']:.3f}us | " + "  ".join(
              f"{n} {t[n] / t['1-d']:.3f}/{dev[n] / dev['1-d']:.3f}" for n in fns if n != "1-d"), flush=True)

MODE = sys.argv[3] if len(sys.argv) > 3 else "stride"
if __name__ == "__main__":
    main(sys.argv[1], [int(x) for x in sys.argv[2].split(",")])
