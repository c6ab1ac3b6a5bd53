#!/usr/bin/env bash
# GPU readiness check on one CUDA GPU, sized to finish within 8 minutes on an H200:
#   0. warm Triton's cache: build, on every core, the kernels the next steps launch
#      (scripts/compile_kernels.py --set gpu-check; otherwise autotuning compiles them one by one);
#   1. pytest -m gpu: the Triton kernels against SDPA and float64 references, a bf16-mixed
#      Lightning fit with all three monitors, and flex_attention training under the monitors
#      (score_mod and block mask; its backward exists on CUDA only), on CUDA;
#   2. benchmarks/attention.py: Triton forward and forward+backward TFLOP/s, with and without
#      statistics, against SDPA's flash backend (bf16, causal, N = 1k..16k, D = 64 and 128);
#   2b. benchmarks/rounding.py: what pv_rounding="unbiased" (the default) costs against "kernel";
#   3. benchmarks/overhead.py: training steps/s of a GPT-2-small-sized model, monitors vs none;
#      then --profile: a probe window against a plain one by engine and phase, host and device,
#      with the training thread's blocking reads and the runtime's synchronizing calls;
#   4. one markdown table of it all (scripts/gpu_report.py), the profile after it.
# Each step runs under `timeout`, so the whole stays within its budget (warm-up 110 s, tests
# 180 s, attention 130 s, rounding 40 s, overhead 75 s, profile 60 s); a step that fails or times out reads "n/a" or FAILED
# in the table, and the script exits non-zero.
#
# Usage: scripts/gpu_check.sh [--dry-run]
#   --dry-run: no GPU needed; collects the gpu tests, runs both benchmarks with --dry-run (NaN
#   timings) and prints the table, which checks the script's own logic on a CPU machine.
# Environment: PYTHON (default python3), GPU_CHECK_OUT (where the JSON goes; default a temp dir).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${GPU_CHECK_OUT:-$(mktemp -d)}
mkdir -p "$OUT"
DRY=()
if [[ "${1:-}" == "--dry-run" ]]; then
  DRY=(--dry-run)
elif [[ $# -gt 0 ]]; then
  echo "usage: $0 [--dry-run]" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1
start=$SECONDS
failed=0
step() { echo "== $1 (at $((SECONDS - start)) s)" >&2; }

step "0. warm Triton's cache"
if [[ ${#DRY[@]} -eq 0 ]]; then
  arch=$("$PY" -c 'import torch; a, b = torch.cuda.get_device_capability(); print(10 * a + b)')
  if [[ "$arch" == 90 || "$arch" == 80 ]]; then
    timeout 110 "$PY" scripts/compile_kernels.py --arch "$arch" --set gpu-check --jobs "$(nproc)" \
      --json "$OUT/builds.json" >"$OUT/builds.txt" 2>&1 \
      || echo "warning: the cache warm-up did not finish (see $OUT/builds.txt); going on" >&2
    tail -n 1 "$OUT/builds.txt" >&2
  else
    echo "sm_$arch: no prebuilt set for it; autotuning will compile as it goes" >&2
  fi
fi

step "1. pytest -m gpu"
if [[ ${#DRY[@]} -eq 0 ]]; then
  timeout 180 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests
else
  "$PY" -m pytest -m gpu --collect-only -q -p no:cacheprovider tests/gpu
fi
tests_rc=$?
[[ $tests_rc -ne 0 ]] && failed=1

step "2. attention benchmark"
timeout 130 "$PY" benchmarks/attention.py --device cuda --causal true --repeats 5 \
  --budget-s 100 --json "$OUT/attention.json" "${DRY[@]}" || failed=1

step "2b. the unbiased rounding's cost (pv_rounding unbiased / kernel, Triton, bf16)"
timeout 40 "$PY" benchmarks/rounding.py --device cuda --causal --lengths 1024 4096 --rounds 10 \
  "${DRY[@]}" | tee "$OUT/rounding.txt" || failed=1

step "3. monitor overhead"
timeout 75 "$PY" benchmarks/overhead.py --device cuda --model gpt2-small --precision bf16-mixed \
  --steps 60 --rounds 1 --warmup-steps 4 --json "$OUT/overhead.json" "${DRY[@]}" || failed=1
timeout 60 "$PY" benchmarks/overhead.py --profile --device cuda --model gpt2-small \
  --precision bf16-mixed --every 10 --steps 30 "${DRY[@]}" >"$OUT/profile.txt" 2>&1 || failed=1

step "4. report"
echo
"$PY" scripts/gpu_report.py --tests-rc "$tests_rc" --attention "$OUT/attention.json" \
  --overhead "$OUT/overhead.json"
echo
grep -v '^qkmonitor:' "$OUT/profile.txt" | tail -n 40
echo "(JSON in $OUT; $((SECONDS - start)) s in all)" >&2
exit $failed
