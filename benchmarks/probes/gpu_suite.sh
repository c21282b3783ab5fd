#!/usr/bin/env bash
# The GPU side of a change, in one command on a CUDA machine: tests, a memory-checker run of the kernel tests,
# `ropekit check`, host-time breakdown, kernel timings, and optionally `ropekit bench`. Logs go to $LOGS (default out/gpu-suite).
#
#   bash benchmarks/probes/gpu_suite.sh [tests] [memcheck] [check] [host] [tune] [bench:<ropekit bench args>]
#   (default: tests check host tune)
#
# Peers for the benchmark (Liger, flash-attn's rotary file) are optional; see benchmarks/README.md.
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repository root (this file is benchmarks/probes/gpu_suite.sh)
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOGS=${LOGS:-out/gpu-suite}
mkdir -p "$LOGS"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests check host tune)
status=0
for step in "${steps[@]}"; do
  echo "=== $step"
  case "$step" in
    tests)
      # the whole suite: most test files hold GPU tests, and a hand-kept list of files misses new ones
      python -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$LOGS/tests.log" | tail -12
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    memcheck)  # kernel, API, fast-path (eager plans), multi-axis and prologue-op tests and the training steps under
      # compute-sanitizer, one allocation per tensor so that a read or write past any tensor is reported
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 5 \
        python -m pytest -q -p no:cacheprovider tests/test_kernel.py tests/test_api.py tests/test_spec_checks.py \
        tests/test_fast_path.py tests/test_multi_axis.py tests/test_prologue_qk_norm_rope.py \
        tests/test_prologue_kv_write.py tests/test_prologue_ops.py tests/test_prologue_fast_path.py \
        tests/test_loops.py::test_training_steps_past_the_first \
        tests/test_loops.py::test_transformers_drop_in_then_eager_attention_for_several_steps \
        -k "cuda or not cpu" 2>&1 \
        | tee "$LOGS/memcheck.log" | tail -4
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    check) python -m ropekit.cli check 2>&1 | tee "$LOGS/check.log" | tail -4 ;;
    host) python benchmarks/probes/host_time.py 2>&1 | tee "$LOGS/host.log" ;;
    tune) python benchmarks/probes/tune.py --tiles 16384 --sweep 0 2>&1 | tee "$LOGS/tune.log" ;;
    bench:*) read -r -a bench_args <<< "${step#bench:}"
      python -m ropekit.cli bench "${bench_args[@]}" 2>&1 | tee "$LOGS/bench.log" | tail -60 ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
