"""End to end: what a patched transformers model gains, measured in one run (``python -m ropekit.bench.e2e``).

Per model config (``--models``, default Qwen3 and Llama, ~0.5 B random-weight parameters each) one child process
builds the model once and gives every variant a copy of the same weights: ``sdpa`` (transformers unpatched, torch's
SDPA), ``ropekit`` (:func:`ropekit.patch`: ropekit's rotation and the fused prologue where the family has one),
``ropekit-attention`` (``patch(model, attention=True)``: also ``rope_attention`` where it is exact), and where
``liger_kernel`` imports and has the family's ``apply_liger_kernel_to_<model>``: ``liger-rope`` (Liger's RoPE only,
its other fusions off: like with like) and ``liger`` (its default patch set: RMSNorm, SwiGLU, fused linear
cross-entropy and RoPE). A variant that patches the modeling module (ropekit's dispatcher, Liger's functions) has
that module's attributes set only while it runs; the others run with transformers' own. Measured:

* ``train``: one training step -- forward with labels, backward, fused AdamW -- of a ``batch x seq`` token batch
  (bf16 weights, ``use_cache=False`` as training scripts pass);
* ``decode`` / ``decode-graph``: greedy decoding into transformers' ``StaticCache``, the time per generated token
  after a prefill at each batch size, run eagerly and captured in one CUDA graph per step (the capture that
  torch.compile's ``reduce-overhead`` mode makes, without its compiler); the first sequence's tokens are compared
  with ``sdpa``'s.

Noise control: the variants take turns, ``A B C A B C ...`` over ``--rounds`` rounds of a few steps each, so a drift
of the machine (clocks, another process) falls on all of them. A row's time is the median of its rounds' medians and
its spread half their range; its ratio to ``sdpa`` is the median of the per-round ratios (each round's pair ran
back to back), and the verdict says ``faster`` / ``within noise`` / ``SLOWER`` against half the range of those
ratios (at least :data:`MIN_NOISE`). ``host_ms`` is the CPU time spent issuing one step (the Python call returns
before the GPU finishes unless something in it synchronises): where it is as long as ``ms`` the step is bound by the
host, and a patched model that is slower there loses on the host, not on the GPU. After the timed steps, two more
eager decode steps per variant are counted (``--no-host-profile`` skips it): Python function calls (cProfile),
top-level aten ops and kernels run (torch.profiler), which say where a host-side loss comes from.

No run outlasts its limits: each is planned from one probe step of every variant to fit ``--budget`` seconds
(steps per round reduced first, then rounds, to at least :data:`MIN_ROUNDS`), and the parent kills a model's child
that passes ``--timeout`` seconds, keeping the rows it had reported. The plan and elapsed times are printed. The
parent prints one table per model and, with ``--csv``, appends the rows to a CSV. ``--tiny`` shrinks the configs to
a smoke test that runs on CPU (its timings are not performance figures).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import dataclasses
import importlib
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

VARIANTS = ("sdpa", "ropekit", "ropekit-attention", "liger-rope", "liger")
BASELINE = "sdpa"
#: the smallest noise a verdict allows for: a ratio within 1 % of 1.0 is never called faster or slower
MIN_NOISE = 0.01
#: the fewest rounds a measurement is cut to when its budget is short (two give no middle, three a median)
MIN_ROUNDS = 3

# ~0.5 B parameters each (embeddings tied); transformers' own defaults for everything not named
CONFIGS = {
    "qwen3": ("Qwen3Config", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=24,
                                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                  tie_word_embeddings=True, max_position_embeddings=8192)),
    "llama": ("LlamaConfig", dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                  num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                                  tie_word_embeddings=True, max_position_embeddings=8192)),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512)

_MISSING = object()


# ------------------------------------------------------------------------------------------ verdict and statistics


def verdict(ratio: float, spread: float, floor: float = MIN_NOISE) -> str:
    """``"faster"``, ``"within noise"`` or ``"SLOWER"``: a ratio (patched time / unpatched time) against its noise,
    ``spread`` (half the range of the per-round ratios) or ``floor``, whichever is larger; ``"-"`` without a
    ratio."""
    if not (math.isfinite(ratio) and math.isfinite(spread)):
        return "-"
    noise = max(spread, floor)
    if ratio < 1.0 - noise:
        return "faster"
    if ratio > 1.0 + noise:
        return "SLOWER"
    return "within noise"


def summarise(round_ms: dict[str, list[float]], baseline: str = BASELINE) -> dict[str, dict[str, float | str]]:
    """Per variant, from its per-round median times (ms; the variants' rounds interleaved, round ``i`` of each run
    back to back): ``ms`` the median of the rounds, ``spread`` half their range relative to it, and against
    ``baseline`` (when it has as many rounds): ``ratio`` the median of the per-round ratios, ``ratio_spread`` half
    their range, and the :func:`verdict`."""
    base = round_ms.get(baseline)
    out: dict[str, dict[str, float | str]] = {}
    for name, times in round_ms.items():
        ms = statistics.median(times)
        row: dict[str, float | str] = dict(ms=ms, spread=(max(times) - min(times)) / 2 / ms if ms else math.nan,
                                           ratio=math.nan, ratio_spread=math.nan)
        if base and len(base) == len(times):
            ratios = [t / b for t, b in zip(times, base)]
            row.update(ratio=statistics.median(ratios), ratio_spread=(max(ratios) - min(ratios)) / 2)
        row["verdict"] = verdict(row["ratio"], row["ratio_spread"]) if name != baseline else "-"
        out[name] = row
    return out


# ------------------------------------------------------------------------------------------------- the variants


class _Modeling:
    """A transformers modeling module's attributes and its classes' ``forward``: what a variant changed there, set
    around each of its measurements and put back to transformers' own after."""

    def __init__(self, module):
        self.module = module
        self.pristine = self._state()

    def _state(self) -> dict:
        state: dict = {("attr", name): value for name, value in vars(self.module).items()
                       if not name.startswith("__")}
        for value in vars(self.module).values():
            if isinstance(value, type) and value.__module__ == self.module.__name__ and "forward" in vars(value):
                state[(value, "forward")] = vars(value)["forward"]
        return state

    def changes(self) -> dict:
        """What differs from transformers' own now."""
        return {key: value for key, value in self._state().items() if self.pristine.get(key, _MISSING) is not value}

    def _put(self, key, value) -> None:
        target, name = (self.module, key[1]) if key[0] == "attr" else key
        if value is _MISSING:
            with contextlib.suppress(AttributeError):
                delattr(target, name)
        else:
            setattr(target, name, value)

    def set(self, changes: dict) -> None:
        for key, value in changes.items():
            self._put(key, value)

    def restore(self, changes: dict) -> None:
        for key in changes:
            self._put(key, self.pristine.get(key, _MISSING))


@dataclasses.dataclass
class Variant:
    name: str
    model: Any
    modeling: _Modeling
    changes: dict

    @contextlib.contextmanager
    def active(self):
        """The modeling module as this variant needs it, for the duration."""
        self.modeling.set(self.changes)
        try:
            yield
        finally:
            self.modeling.restore(self.changes)


def unavailable(variant: str, model: str) -> str | None:
    """Why ``variant`` cannot run for config ``model`` here, or None."""
    if variant not in VARIANTS:
        return f"unknown variant (choose from {', '.join(VARIANTS)})"
    if variant.startswith("liger"):
        try:
            liger = importlib.import_module("liger_kernel.transformers")
        except ImportError as exc:
            return f"liger_kernel not importable ({exc})"
        if not hasattr(liger, f"apply_liger_kernel_to_{model}"):
            return f"Liger has no apply_liger_kernel_to_{model}"
    return None


def _apply(variant: str, model, name: str) -> None:
    if variant.startswith("ropekit"):
        from ropekit.integrations.transformers import patch

        patch(model, attention=variant == "ropekit-attention")
    elif variant.startswith("liger"):
        apply = getattr(importlib.import_module("liger_kernel.transformers"), f"apply_liger_kernel_to_{name}")
        if variant == "liger-rope":
            apply(rope=True, rms_norm=False, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=False,
                  model=model)
        else:
            apply(model=model)


def build_variants(name: str, variants: list[str], device: torch.device, dtype: torch.dtype, tiny: bool,
                   log: Callable[[str], None]) -> tuple[list[Variant], dict[str, str]]:
    """One random-weight model of config ``name`` and a copy of it per variant with the variant applied; the
    variants that failed to apply, with why."""
    import transformers

    cls_name, sizes = CONFIGS[name]
    config = getattr(transformers, cls_name)(**{**sizes, **(TINY if tiny else {})})
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).to(device)
    log(f"{name}: {sum(p.numel() for p in base.parameters()) / 1e6:.1f} M parameters, {dtype}, {device}")
    modeling = _Modeling(importlib.import_module(type(base).__module__))
    built, failed = [], {}
    for variant in variants:
        model = base if variant == BASELINE else copy.deepcopy(base)
        try:
            _apply(variant, model, name)
            built.append(Variant(variant, model, modeling, modeling.changes()))
        except Exception as exc:  # noqa: BLE001 -- reported in the table, not hidden
            failed[variant] = _describe(exc)
        finally:
            modeling.restore(modeling.changes())
    return built, failed


def release(variants: list[Variant]) -> None:
    """Unpatch the ropekit variants (their module-level dispatchers are reference counted) and leave the modeling
    module as transformers made it."""
    from ropekit.integrations.transformers import unpatch

    for v in variants:
        if v.name.startswith("ropekit"):
            with v.active():
                unpatch(v.model)
    if variants:
        modeling = variants[0].modeling
        modeling.restore(modeling.changes())


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"


# ----------------------------------------------------------------------------------------------------- timing


class _Clock:
    """A callable's (elapsed ms, host ms): CUDA events around it on a GPU (the wall clock elsewhere), and the CPU
    time until the call returned, before any synchronisation."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> tuple[float, float]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t = time.perf_counter()
            fn()
            host = (time.perf_counter() - t) * 1e3
            end.record()
            end.synchronize()
            return start.elapsed_time(end), host
        t = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t) * 1e3
        return ms, ms


@dataclasses.dataclass
class Plan:
    rounds: int
    steps: int
    seconds: float  # the planned time of the timed steps


def plan(probe_s: float, rounds: int, max_steps: int, budget_s: float) -> Plan:
    """Rounds and steps per round whose timed steps fit ``budget_s``, from ``probe_s``, the time of one step of every
    variant: ``max_steps`` per round reduced first, then the rounds (to :data:`MIN_ROUNDS`, at least one step)."""
    probe_s = max(probe_s, 1e-9)
    steps = max(1, min(max_steps, int(budget_s / (rounds * probe_s))))
    n_rounds = rounds if steps * rounds * probe_s <= budget_s else max(MIN_ROUNDS, min(rounds, int(budget_s / probe_s)))
    return Plan(n_rounds, steps, n_rounds * steps * probe_s)


def interleave(label: str, steps: dict[str, Callable[[], Any]], variants: dict[str, Variant], clock: _Clock,
               args, max_steps: int, log: Callable[[str], None], errors: dict[str, str],
               after: dict[str, Callable[[], Any]] | None = None) -> dict[str, list[list[tuple[float, float]]]]:
    """Time every variant's ``steps[name]`` in turns: one probe step each, then the planned rounds, each variant's
    steps of a round back to back (``after[name]`` called after each step, outside the timing). A variant whose step
    raises leaves the measurement (its error in ``errors``). Returns per variant, per round, the (ms, host ms) of its
    steps."""
    after = after or {}

    def timed(name: str) -> tuple[float, float]:
        result = clock(steps[name])
        if name in after:
            after[name]()
        return result

    probe: dict[str, float] = {}
    for name in steps:
        try:
            with variants[name].active():
                probe[name] = timed(name)[0]
        except Exception as exc:  # noqa: BLE001 -- the variant's row says why
            errors[name] = _describe(exc)
    p = plan(sum(probe.values()) / 1e3, args.rounds, max_steps, args.budget)
    log(f"{label}: {len(probe)} variants x {p.rounds} rounds x {p.steps} steps, planned {p.seconds:.1f} s")
    started = time.perf_counter()
    times: dict[str, list[list[tuple[float, float]]]] = {name: [] for name in probe}
    for _ in range(p.rounds):
        for name in list(times):
            try:
                with variants[name].active():
                    times[name].append([timed(name) for _ in range(p.steps)])
            except Exception as exc:  # noqa: BLE001
                errors[name] = _describe(exc)
                del times[name]
    log(f"{label}: timed in {time.perf_counter() - started:.1f} s")
    return times


def _rows(kind: str, batch: int, seq: int, times: dict[str, list[list[tuple[float, float]]]], errors: dict[str, str],
          tokens: dict[str, list[int]] | None = None, profiles: dict[str, dict] | None = None) -> list[dict]:
    stats = summarise({name: [statistics.median(ms for ms, _ in r) for r in rounds] for name, rounds in times.items()})
    rows = []
    for name, s in stats.items():
        rounds = times[name]
        same = ""
        if tokens is not None and BASELINE in tokens and name in tokens:
            ref = tokens[BASELINE]
            same = f"{sum(a == b for a, b in zip(tokens[name], ref))}/{len(ref)}"
        per_s = batch * (seq if kind == "train" else 1) / s["ms"] * 1e3
        rows.append(dict(variant=name, kind=kind, batch=batch, seq=seq, ms=s["ms"], spread=s["spread"],
                         host_ms=statistics.median(h for r in rounds for _, h in r), tokens_per_s=per_s,
                         rounds=len(rounds), steps=len(rounds[0]), vs_sdpa=s["ratio"],
                         vs_sdpa_spread=s["ratio_spread"], verdict=s["verdict"], same_tokens=same,
                         **(profiles or {}).get(name, {}), error=""))
    for name, error in errors.items():
        rows.append(dict(variant=name, kind=kind, batch=batch, seq=seq, error=error))
    return rows


# ------------------------------------------------------------------------------------------------- measurements


def measure_training(variants: dict[str, Variant], args, device: torch.device, clock: _Clock,
                     log: Callable[[str], None]) -> list[dict]:
    """The ``train`` rows: a step of forward with labels, backward and AdamW per variant, in turns."""
    ids = torch.randint(0, next(iter(variants.values())).model.config.vocab_size, (args.batch, args.seq),
                        device=device)
    steps, errors = {}, {}
    for name, v in variants.items():
        v.model.train()
        opt = torch.optim.AdamW(v.model.parameters(), lr=1e-5, fused=device.type == "cuda")

        def step(model=v.model, opt=opt):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        try:
            with v.active():
                for _ in range(2):  # compilation and the optimizer's state out of the timing
                    step()
            steps[name] = step
        except Exception as exc:  # noqa: BLE001
            errors[name] = _describe(exc)
    times = interleave(f"train {args.batch}x{args.seq}", steps, variants, clock, args, args.train_steps, log, errors)
    steps.clear()  # the optimizers' state goes with the closures
    for v in variants.values():
        v.model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return _rows("train", args.batch, args.seq, times, errors)


class _Decoder:
    """One variant's greedy decoding into a StaticCache at one batch size: the prefill and two warm-up steps at
    construction; ``advance()`` generates the next token (one CUDA graph replay with ``graph``)."""

    def __init__(self, model, batch: int, prompt: int, capacity: int, graph: bool, device: torch.device):
        from transformers import StaticCache

        model.eval()
        g = torch.Generator(device="cpu").manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=g).to(device)
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        self.tokens: list[int] = []
        with torch.inference_mode():
            logits = model(input_ids=ids, past_key_values=self.cache, use_cache=True,
                           cache_position=torch.arange(prompt, device=device)).logits
            self.tok = logits[:, -1:].argmax(-1)
            self.position = torch.tensor([prompt], device=device)
            self.record()

            def step():
                out = model(input_ids=self.tok, past_key_values=self.cache, use_cache=True,
                            cache_position=self.position, position_ids=self.position.expand(batch, 1)).logits
                return out[:, -1:].argmax(-1)

            if graph:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):  # warm-up writes at this position; the replays write it again
                        step()
                torch.cuda.current_stream().wait_stream(side)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self.next_tok = step()
            else:
                self.graph, self.step = None, step
                for _ in range(2):
                    self.advance()
                    self.record()

    def record(self) -> None:
        """Keep the first sequence's current token (after a timed step: it reads the GPU)."""
        self.tokens.append(int(self.tok[0, 0]))

    def advance(self) -> None:
        with torch.inference_mode():
            if self.graph is not None:
                self.graph.replay()
                self.tok.copy_(self.next_tok)
            else:
                self.tok.copy_(self.step())
            self.position.add_(1)


def measure_decoding(variants: dict[str, Variant], args, batch: int, graph: bool, device: torch.device,
                     clock: _Clock, log: Callable[[str], None]) -> list[dict]:
    """The ``decode`` (or ``decode-graph``) rows at one batch size: a generated token per step, in turns."""
    kind = "decode-graph" if graph else "decode"
    capacity = args.prompt + 2 + 1 + args.rounds * args.decode_steps + 2 * PROFILED_STEPS + 8
    decoders, errors = {}, {}
    for name, v in variants.items():
        try:
            with v.active():
                decoders[name] = _Decoder(v.model, batch, args.prompt, capacity, graph, device)
        except Exception as exc:  # noqa: BLE001
            errors[name] = _describe(exc)
    times = interleave(f"{kind} batch {batch}", {n: d.advance for n, d in decoders.items()}, variants, clock, args,
                       args.decode_steps, log, errors, after={n: d.record for n, d in decoders.items()})
    tokens = {name: d.tokens for name, d in decoders.items()}
    profiles = {}
    if not graph and args.host_profile:
        for name in times:
            with variants[name].active():
                profiles[name] = host_profile(decoders[name].advance, device)
    decoders.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return _rows(kind, batch, args.prompt, times, errors, tokens, profiles)


PROFILED_STEPS = 2


def host_profile(step: Callable[[], Any], device: torch.device) -> dict[str, float]:
    """What one step asks of the host, averaged over :data:`PROFILED_STEPS` steps after the timed ones: Python
    function calls (cProfile), top-level aten ops and, on a GPU, kernels run (torch.profiler). Empty where the
    profiler fails (the timings stand without it)."""
    import cProfile
    import pstats

    try:
        calls = cProfile.Profile()
        calls.enable()
        for _ in range(PROFILED_STEPS):
            step()
        calls.disable()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(PROFILED_STEPS):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        events = prof.events()
    except Exception:  # noqa: BLE001 -- a profiler that cannot run here costs the counts only
        return {}

    def top_level_aten(e) -> bool:
        return e.name.startswith("aten::") and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))

    return dict(py_calls=sum(c[1] for c in pstats.Stats(calls).stats.values()) / PROFILED_STEPS,
                aten_ops=sum(map(top_level_aten, events)) / PROFILED_STEPS,
                kernels=sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events) / PROFILED_STEPS)


def run_model(name: str, args, emit: Callable[[dict], None]) -> None:
    """Every measurement of config ``name``: ``emit`` gets ``{"log": line}`` and ``{"rows": [...]}`` messages as
    they come (a killed run keeps what it reported)."""
    started = time.perf_counter()

    def log(line: str) -> None:
        emit({"log": f"[{time.perf_counter() - started:6.1f} s] {line}"})

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    wanted = []
    for variant in args.variants:
        reason = unavailable(variant, name)
        if reason:
            log(f"{variant}: skipped ({reason})")
        else:
            wanted.append(variant)
    built, failed = build_variants(name, wanted, device, dtype, args.tiny, log)
    if failed:
        emit({"rows": [dict(variant=v, kind="setup", batch="", seq="", error=e) for v, e in failed.items()]})
    variants = {v.name: v for v in built}
    clock = _Clock(device)
    try:
        emit({"rows": measure_training(variants, args, device, clock, log)})
        # the graphs first: the eager measurements end with the profiler, which captures had better not follow
        for graph in (True, False) if device.type == "cuda" else (False,):
            for batch in args.decode_batches:
                emit({"rows": measure_decoding(variants, args, batch, graph, device, clock, log)})
    finally:
        release(built)
    log(f"{name}: done")


# ---------------------------------------------------------------------------------------------------- the parent


def _run_child(name: str, argv: list[str], timeout: float, emit: Callable[[dict], None]) -> None:
    """``run_model`` in a child process of its own, its messages passed on as they come; killed after
    ``timeout`` seconds (then a ``run`` row says so)."""
    cmd = [sys.executable, "-m", "ropekit.bench.e2e", *argv, "--child", name]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tail: list[str] = []

    def drain_stderr():
        for line in proc.stderr:
            tail[:] = (tail + [line])[-40:]

    def drain_stdout():
        for line in proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                message = {"log": line.rstrip()}
            emit(message)

    readers = [threading.Thread(target=drain_stdout, daemon=True), threading.Thread(target=drain_stderr, daemon=True)]
    for t in readers:
        t.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = None
    for t in readers:
        t.join(timeout=10)
    if rc is None:
        emit({"rows": [dict(variant="-", kind="run", batch="", seq="", error=f"timed out after {timeout:g} s")]})
    elif rc:
        emit({"log": f"{name}: child failed (exit {rc})\n" + "".join(tail)})
        error = f"exit {rc}: {''.join(tail[-2:])[:200]}"
        emit({"rows": [dict(variant="-", kind="run", batch="", seq="", error=error)]})


def _table(model: str, rows: list[dict], env: dict, args) -> list[dict]:
    """Print time, spread, host time, throughput, ratio to sdpa and verdict per row; return the rows for the CSV."""
    print(f"\n{model} ({'tiny' if args.tiny else '~0.5B'}), {env['gpu']}; train {args.batch}x{args.seq} tokens, "
          f"decode prompt {args.prompt}; median of rounds (+- half their range)")
    print(f"{'kind':<13}{'batch':>6} {'variant':<18}{'ms':>10}{'+-%':>6}{'host ms':>9}{'tok/s':>10}{'vs sdpa':>9}"
          f"{'+-':>7}  {'verdict':<13}{'same tokens':<12}per step: Python calls / aten ops / kernels")
    out = []
    for r in rows:
        if r.get("error"):
            print(f"{r['kind']:<13}{r['batch']!s:>6} {r['variant']:<18}failed: {r['error']}")
        else:
            print(f"{r['kind']:<13}{r['batch']:>6} {r['variant']:<18}{r['ms']:>10.3f}{r['spread'] * 100:>6.1f}"
                  f"{r['host_ms']:>9.3f}{r['tokens_per_s']:>10.0f}{r['vs_sdpa']:>9.3f}{r['vs_sdpa_spread']:>7.3f}  "
                  f"{r['verdict']:<13}{r['same_tokens']:<12}{_counts(r)}")
        out.append({**dict(date=env["date"], commit=env["commit"], torch=env["torch"], model=model, device=env["gpu"]),
                    **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, "tiny": args.tiny})
    slower = [r for r in rows if r.get("verdict") == "SLOWER" and r["variant"].startswith("ropekit")]
    named = ", ".join(f"{r['variant']} {r['kind']} batch {r['batch']}" for r in slower)
    print(f"ropekit never slower than sdpa: {'no: ' + named if slower else 'yes'}")
    return out


def _counts(row: dict) -> str:
    if "py_calls" not in row:
        return ""
    return f"{row['py_calls']:.0f} / {row['aten_ops']:.0f} / {row['kernels']:.0f}"


#: the CSV's columns (older files, written before the spread and verdict columns, are rewritten with them blank)
CSV_FIELDS = ("date", "commit", "torch", "model", "device", "variant", "kind", "batch", "seq", "ms", "spread",
              "host_ms", "py_calls", "aten_ops", "kernels", "tokens_per_s", "rounds", "steps", "vs_sdpa",
              "vs_sdpa_spread", "verdict", "same_tokens", "tiny", "error")


def append_csv(path: Path, rows: list[dict]) -> None:
    """Append ``rows`` to the CSV at ``path`` (its existing rows kept, under :data:`CSV_FIELDS`; xz-compressed
    where the name ends in .xz, as the kept ``benchmarks/results/e2e.csv.xz``)."""
    from .report import open_text

    old: list[dict] = []
    header: list[str] = []
    if path.is_file():
        with open_text(path, "r") as f:
            reader = csv.DictReader(f)
            old, header = list(reader), list(reader.fieldnames or [])
    fields = list(CSV_FIELDS) + [f for f in header if f not in CSV_FIELDS]
    if header == fields:
        with open_text(path, "a") as f:
            csv.DictWriter(f, fieldnames=fields, restval="").writerows(rows)
        return
    with open_text(path, "w") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(old + rows)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ropekit.bench.e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", "--model", default="qwen3,llama", help="comma-separated, from " + ", ".join(CONFIGS))
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from " + ", ".join(VARIANTS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--decode-batches", default="1,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5, help="rounds of turns (each variant's steps once per round)")
    p.add_argument("--train-steps", type=int, default=3, help="most training steps per variant and round")
    p.add_argument("--decode-steps", type=int, default=8, help="most decode steps per variant and round")
    p.add_argument("--budget", type=float, default=8.0,
                   help="seconds of timed steps per measurement (all variants); steps, then rounds, cut to fit")
    p.add_argument("--timeout", type=float, default=200.0, help="seconds per model before its process is killed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny configs: a smoke test of the harness (CPU)")
    p.add_argument("--no-host-profile", dest="host_profile", action="store_false",
                   help="skip counting each eager decode step's Python calls, aten ops and kernels")
    p.add_argument("--in-process", action="store_true", help="no child process per model (no --timeout)")
    p.add_argument("--csv", type=Path, help="append the rows to this CSV (benchmarks/results/e2e.csv.xz feeds "
                                             "BENCHMARKS.md)")
    p.add_argument("--commit", help="the commit to stamp on the rows (default: git's, where there is a checkout)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # the child's one model
    return p


def _parse(argv: list[str] | None):
    args = _parser().parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.variants = [v for v in args.variants.split(",") if v]
    args.decode_batches = [int(b) for b in str(args.decode_batches).split(",") if b]
    if BASELINE not in args.variants:
        args.variants.insert(0, BASELINE)  # every ratio is to it
    unknown = [m for m in args.models if m not in CONFIGS]
    if unknown:
        raise SystemExit(f"e2e: unknown model(s) {unknown}; choose from {sorted(CONFIGS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if args.child:  # one model, a JSON message per line on stdout
        run_model(args.child, args, lambda m: print(json.dumps(m), flush=True))
        return 0
    from .env import environment

    env = environment(torch.device(args.device), args.commit)
    started = time.perf_counter()
    n_measurements = 1 + len(args.decode_batches) * (2 if args.device.startswith("cuda") else 1)
    print(f"e2e: models {', '.join(args.models)}; variants {', '.join(args.variants)}; per model {n_measurements} "
          f"measurements of at most {args.budget:.0f} s timed each (+ build, compile and warm-up), killed after "
          f"{args.timeout:.0f} s", flush=True)
    all_rows: list[dict] = []
    for model in args.models:
        rows: list[dict] = []

        def emit(message: dict, model=model, rows=rows) -> None:
            if "log" in message:
                print(f"[{time.perf_counter() - started:6.1f} s] {model}: {message['log']}", flush=True)
            rows.extend(message.get("rows", []))

        if args.in_process:
            run_model(model, args, emit)
        else:
            _run_child(model, argv, args.timeout, emit)
        all_rows += _table(model, rows, env, args)
    print(f"\ne2e: {time.perf_counter() - started:.1f} s in all", flush=True)
    if args.csv and all_rows:
        append_csv(args.csv, all_rows)
    return 0 if any(not r.get("error") for r in all_rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
