#!/usr/bin/env bash
# Device check: the GPU-only checks in one run of at most 8 minutes on one H200, needing nothing
# but the repository (random-weight checkpoints of real shapes are written to a scratch dir).
#   OUT=/tmp/device_out bash scripts/device_check.sh      (--help: the parts, their time limits)
# Parts: random checkpoints; tests/pallas_kernels/offset_decode_test.py::KernelTest (compiled Pallas kernels) and the
# XLA-path fast-tier tests, concurrently; then alone: python -m experiments.bench_kernels
# (bandwidth, split sweep), python -m experiments.bench_decode at 8,192 tokens (135M, 1B shapes).
# At most 7 files land in $OUT (parts.json, *.xml, bench_kernels.*, decode.md, one .tar.gz).
# DEVICE_CHECK_ALLOW_CPU=1 is for testing this script only: tiny sizes and limits, any backend.
set -euo pipefail

OUT="${OUT:-./device_out}"
OUT="$(realpath -m "$OUT")"  # relative to where the script was started; created after the check
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
TINY="${DEVICE_CHECK_ALLOW_CPU:-0}"
ONLY="${ONLY:-}"  # comma-separated part-name prefixes to run (default: all)
export PYTHONUNBUFFERED=1
FAST_A="tests/certkv_jax/designs/framework_test.py"
FAST_B="tests/certkv_jax/attention/offset_test.py tests/certkv_jax/certificate/radius_test.py tests/certkv_jax/certificate/montecarlo_test.py"
FAST_C="tests/examples/gpt2_test.py tests/certkv_jax/designs/sampling_test.py tests/certkv_jax/designs/priority_sampling_test.py"
CKPT_ARGS=()
# The kernel's tiling sweep (block_k:num_splits:num_warps[:num_stages][:split]; bench_kernels
# --tilings) beside the default (experiments/results/gpu_h100: 64-key tiles, 16 splits at
# 64 rows, values as stored, 3 stages): the float32 value copy, 2 stages, 2 warps, more
# splits, 128-key tiles.
BK_TILINGS="${BK_TILINGS:-64:16:4,64:16:4:split,32:16:2:split,64:32:4:3:split,32:32:4:3:split,128:16:4:3:split}"
BK_ARGS=(--lengths=32768 --head_dims=128 --batch=64 --groups=4 --dtype=bfloat16
         --repeats=6 --splits=1,4 --tilings="$BK_TILINGS")
DECODE_DESIGNS="${DECODE_DESIGNS:-poisson_tail}"
DECODE_ARGS=(--contexts=8192 --designs="$DECODE_DESIGNS" --budgets=0.125 --evict_every=16
             --certificate=with --layer_loop=unrolled --noplain_prefill --repeats=6)
BATCH_135M="${BATCH_135M:-1}"
BATCH_1B="${BATCH_1B:-4}"
DECODE_DTYPES="${DECODE_DTYPES:-bfloat16}"  # float32,bfloat16 adds the float32 parts
# Time limits (seconds), sized from the first H200 runs (experiments/results/gpu_h200): there
# a compiled kernel test took up to 13 s, designs_test.py needed over 125 s, the kernel bench's
# first calls 33 s without a split sweep (the tiling sweep adds 12 kernel variants), and the
# 1B decode's first calls 47 s. Phase 1 runs concurrently (checkpoints on the CPU, tests on
# the GPU): at most max(L_CKPT_135M + L_CKPT_1B, L_KERNEL_TESTS, L_FAST) = 150 s. Phase 2 runs
# alone (it times): 125 + 95 + 95 = 315 s. With the backend check (<= 15 s) that is 480 s, and
# a part that runs over gets up to 10 s more to stop (SIGINT, then SIGKILL): so the whole run
# has a limit of its own, L_RUN (470 s), and each part's limit is cut to what is left of it,
# less those 10 s; a part with under 5 s left is not started (status no_time). Each float32
# decode part (DECODE_DTYPES) or batch (BATCH_135M=1,8) needs about one decode limit more of
# L_RUN. A timed-out benchmark that wrote its finished cells is "partial". Each limit can be
# set from the environment (L_FAST=200 ...).
if [[ "$TINY" == 1 ]]; then
  FAST_A="tests/certkv_jax/designs/priority_sampling_test.py" FAST_B="tests/certkv_jax/designs/sampling_test.py" FAST_C=""
  CKPT_ARGS=(--layers=2 --vocab=512)
  BK_ARGS=(--lengths=256 --head_dims=16 --batch=2 --repeats=2 --iters=2 --probe_mb=4
           --splits=1,2 --tilings=32:2:4:split)
  DECODE_ARGS=(--contexts=128 --designs=poisson_tail --budgets=0.25 --evict_every=4
               --n_sink=2 --window=4 --certificate=with --layer_loop=unrolled --noplain_prefill
               --repeats=3)
  BATCH_135M=1 BATCH_1B=1 DECODE_DTYPES=float32,bfloat16
  : "${L_CKPT_135M:=60}" "${L_CKPT_1B:=60}" "${L_KERNEL_TESTS:=60}" "${L_FAST:=120}"
  : "${L_BENCH_KERNELS:=90}" "${L_DECODE_135M:=150}" "${L_DECODE_1B:=150}" "${L_RUN:=900}"
fi
: "${L_CKPT_135M:=30}" "${L_CKPT_1B:=60}" "${L_KERNEL_TESTS:=150}" "${L_FAST:=150}"
: "${L_BENCH_KERNELS:=125}" "${L_DECODE_135M:=95}" "${L_DECODE_1B:=95}" "${L_RUN:=470}"
LAST_STATUS="" LAST_SECS=0 LAST_RC=0 LAST_LIMIT=0  # of the latest part run in the foreground

usage() {
  cat <<EOF
Usage: OUT=DIR [PYTHON=python3] [ONLY=part,...] [SCRATCH=DIR] [DECODE_DTYPES=...]
       [DECODE_DESIGNS=...] [BATCH_135M=...] [BATCH_1B=...] [BK_TILINGS=...]
       bash scripts/device_check.sh

Runs on a GPU (or TPU) only, in at most L_RUN=${L_RUN}s (and the packing after it), needing
nothing but the repository; refuses with one line and exit status 2 elsewhere. Parts, each
under its time limit, its result files written as it finishes; a failing part does not stop
the later ones but makes the exit status 1 (a benchmark stopped at its limit after finishing
a cell is "partial", not a failure):

 phase 1, concurrently (at most $L_FAST s):
  ckpt_135m      ${L_CKPT_135M}s   random-weight HF checkpoint of SmolLM2-135M's shape (scratch
                       dir), loaded back by models.hf_loader
  ckpt_1b        ${L_CKPT_1B}s   the same of a Llama-3.2-1B-like shape (5 GB; decode parts load it)
  kernel_tests   ${L_KERNEL_TESTS}s  tests/pallas_kernels/offset_decode_test.py::KernelTest, compiled kernels (junit xml)
  fast_tier_a/b/c ${L_FAST}s each  XLA-path fast-tier tests, -m "not slow" (junit xml, merged):
                 $FAST_A
                 $FAST_B
                 $FAST_C
 phase 2, one at a time:
  bench_kernels  ${L_BENCH_KERNELS}s   python -m experiments.bench_kernels ${BK_ARGS[*]}
  decode_135m_bfloat16, decode_135m_float32   ${L_DECODE_135M}s each  (batches $BATCH_135M)
  decode_1b_bfloat16, decode_1b_float32       ${L_DECODE_1B}s each  (batch $BATCH_1B)
                 for each dtype of DECODE_DTYPES ($DECODE_DTYPES; float32,bfloat16 adds the
                 float32 parts, about ${L_DECODE_135M}s + ${L_DECODE_1B}s more)
                 python -m experiments.bench_decode ${DECODE_ARGS[*]}
                 (and --model, --batches, --dtype, --max_seconds=half the limit it gets)

Writes under OUT (default ./device_out; at most 7 files, no folders): parts.json (seconds, rc,
status, limit of each part), kernel_tests.xml, fast_tier.xml, bench_kernels.md/.json, decode.md
(the decode reports) and device_check.tar.gz (every log, the decode benchmarks' outputs, the
per-group junit files, the checkpoints' config.json; never their weights). The checkpoints
(about 6 GB) go to SCRATCH (default: a new temporary dir, removed at the end).
ONLY=bench_kernels,decode_1b runs those parts (a decode part also makes its checkpoint);
L_CKPT_135M, L_CKPT_1B, L_KERNEL_TESTS, L_FAST, L_BENCH_KERNELS, L_DECODE_135M, L_DECODE_1B
set the parts' limits (seconds); L_RUN the whole run's: each part's limit is cut to what is left
of it less 10 s (the time a part gets to stop), and a part with under 5 s left is not started
(status no_time, a failure). Raise L_RUN with the float32 decode parts or more batches.
DEVICE_CHECK_ALLOW_CPU=1: for testing this script only, on any backend at tiny sizes.
EOF
}

case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  "") ;;
  *) usage >&2; echo "device_check.sh: unknown argument ${1}" >&2; exit 2 ;;
esac

ORDER=(ckpt_135m ckpt_1b kernel_tests fast_tier_a fast_tier_b fast_tier_c bench_kernels
       decode_135m_float32 decode_135m_bfloat16 decode_1b_float32 decode_1b_bfloat16)

bad_setting() {  # bad_setting MESSAGE: one line, exit status 2 (nothing run, nothing written)
  echo "device_check.sh: $1" >&2
  exit 2
}
for v in L_CKPT_135M L_CKPT_1B L_KERNEL_TESTS L_FAST L_BENCH_KERNELS L_DECODE_135M L_DECODE_1B \
         L_RUN; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || bad_setting "$v must be a whole number of seconds > 0, got '${!v}'"
done
for v in BATCH_135M BATCH_1B; do  # comma-separated batch sizes
  [[ "${!v}" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || \
    bad_setting "$v must be batch sizes > 0, comma-separated, got '${!v}'"
done
for d in ${DECODE_DTYPES//,/ }; do
  [[ "$d" == float32 || "$d" == bfloat16 ]] || \
    bad_setting "DECODE_DTYPES must list float32 and/or bfloat16, got '$DECODE_DTYPES'"
done
for p in ${ONLY//,/ }; do  # a prefix that names no part would run nothing
  match=0
  for name in "${ORDER[@]}"; do [[ "$name" == "$p"* ]] && match=1; done
  (( match )) || bad_setting "ONLY: '$p' names no part (parts: ${ORDER[*]})"
done

want() {  # want NAME: whether ONLY selects part NAME (by prefix)
  [[ -z "$ONLY" ]] && return 0
  local p
  for p in ${ONLY//,/ }; do
    [[ "$1" == "$p"* ]] && return 0
  done
  return 1
}

T_ALL=$(date +%s)
BACKEND="$(timeout 15 "$PYTHON" -c 'import jax; print(jax.default_backend())' 2>/dev/null \
  || true)"
if [[ "$BACKEND" != gpu && "$BACKEND" != tpu && "$TINY" != 1 ]]; then
  echo "device_check.sh: refusing to run: jax.default_backend() is '${BACKEND:-unknown}'," \
    "not gpu or tpu (the compiled kernels and the timings need one)" >&2
  exit 2
fi

mkdir -p "$OUT"
if [[ -z "${SCRATCH:-}" ]]; then
  SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/device_check.XXXXXX")"
  trap 'rm -rf "$SCRATCH"' EXIT
fi
WORK="$SCRATCH/work"
CKPT="$SCRATCH/ckpt"
# A SCRATCH or OUT given again (a warm machine keeps /tmp) must not pass off an earlier
# run's results as this one's: its work dir and our files in OUT go (the checkpoints stay).
rm -rf "$WORK"
rm -f "$OUT"/{parts.json,kernel_tests.xml,fast_tier.xml,bench_kernels.md,bench_kernels.json} \
  "$OUT"/{decode.md,device_check.tar.gz}
mkdir -p "$WORK/logs" "$WORK/parts" "$WORK/junit" "$WORK/decode" "$CKPT"

write_parts() {  # $OUT/parts.json from the parts finished so far (atomic rename)
  local name sep="" tmp="$OUT/.parts.json.$BASHPID"
  {
    printf '{"_run": {"backend": "%s", "tiny": %s, "seconds": %d}' "$BACKEND" \
      "$([[ "$TINY" == 1 ]] && echo true || echo false)" $(( $(date +%s) - T_ALL ))
    for name in "${ORDER[@]}"; do
      if [[ -f "$WORK/parts/$name.json" ]]; then
        printf ',\n "%s": %s' "$name" "$(cat "$WORK/parts/$name.json")"
      fi
    done
    printf '}\n'
  } > "$tmp"
  mv -f "$tmp" "$OUT/parts.json"
}

record() {  # record NAME SECONDS RC STATUS LIMIT [NOTE]
  printf '{"seconds": %d, "rc": %d, "status": "%s", "limit": %d, "note": "%s"}' \
    "$2" "$3" "$4" "$5" "${6:-}" > "$WORK/parts/$1.json"
  write_parts
}

run_left() {  # seconds left of L_RUN for a part, less the 10 s it may take to stop
  echo $(( T_ALL + L_RUN - $(date +%s) - 10 ))
}

# part NAME LIMIT CMD...: runs CMD under LIMIT cut to what is left of L_RUN, its output in
# $WORK/logs/NAME.log; records its seconds, rc and status; always returns 0. At the limit
# CMD gets SIGINT (pytest then still writes its junit file of the tests run so far),
# SIGKILL 10 s later.
part() {
  local name=$1 limit=$2 t0 rc=0 status=ok secs left
  shift 2
  left=$(run_left)
  if (( left < 5 )); then
    echo "=== [$name] not started: ${left}s left of L_RUN=${L_RUN}s"
    record "$name" 0 0 no_time 0 "not started: the run's limit L_RUN=${L_RUN}s was spent"
    LAST_STATUS=no_time LAST_SECS=0 LAST_RC=0 LAST_LIMIT=0
    return 0
  fi
  if (( left < limit )); then limit=$left; fi
  echo "=== [$name] start (limit ${limit}s):$(printf ' %q' "$@")"
  t0=$(date +%s)
  timeout -s INT -k 10 "$limit" "$@" > "$WORK/logs/$name.log" 2>&1 || rc=$?
  if (( rc == 124 || rc == 137 )); then
    status=timeout
  elif (( rc != 0 )); then
    status=failed
  fi
  secs=$(( $(date +%s) - t0 ))
  echo "=== [$name] $status (rc $rc) in ${secs}s"
  if [[ "$status" != ok ]]; then
    tail -n 15 "$WORK/logs/$name.log" | sed "s/^/  [$name] /"
  fi
  record "$name" "$secs" "$rc" "$status" "$limit"
  LAST_STATUS=$status LAST_SECS=$secs LAST_RC=$rc LAST_LIMIT=$limit  # for partial_if
}

partial_if() {  # partial_if NAME FILE: the timed-out part NAME (just run) wrote FILE
  if [[ "$LAST_STATUS" == timeout && -f "$2" ]]; then
    record "$1" "$LAST_SECS" "$LAST_RC" partial "$LAST_LIMIT" \
      "stopped at its limit; $(basename "$2") holds its finished cells"
  fi
}

skip() {  # skip NAME WHY
  echo "=== [$1] skipped: $2"
  record "$1" 0 0 skipped 0 "$2"
}

publish() {  # copies the finished results to $OUT and repacks the archive
  local f
  [[ -f "$WORK/junit/kernel_tests.xml" ]] && cp -f "$WORK/junit/kernel_tests.xml" "$OUT/"
  for f in bench_kernels.md bench_kernels.json; do
    [[ -f "$WORK/$f" ]] && cp -f "$WORK/$f" "$OUT/"
  done
  if compgen -G "$WORK/decode/*/report.md" > /dev/null; then
    for f in "${ORDER[@]}"; do
      f="$WORK/decode/$f/report.md"
      if [[ -f "$f" ]]; then
        printf '# %s\n\n' "$(basename "$(dirname "$f")")"
        cat "$f"
        printf '\n'
      fi
    done > "$OUT/.decode.md.tmp"
    mv -f "$OUT/.decode.md.tmp" "$OUT/decode.md"
  fi
  for f in "$CKPT"/*/config.json; do
    [[ -f "$f" ]] && cp -f "$f" "$WORK/config_$(basename "$(dirname "$f")").json"
  done
  tar -czf "$OUT/.device_check.tar.gz.tmp" -C "$WORK" . && \
    mv -f "$OUT/.device_check.tar.gz.tmp" "$OUT/device_check.tar.gz"
  write_parts
}

merge_fast_tier() {  # $OUT/fast_tier.xml: the groups' junit files in one <testsuites>
  "$PYTHON" - "$OUT/fast_tier.xml" "$WORK/junit" "$@" <<'EOF'
import os, sys, xml.etree.ElementTree as ET
out, directory, groups = sys.argv[1], sys.argv[2], sys.argv[3:]
root = ET.Element("testsuites")
for g in groups:
  path = os.path.join(directory, g + ".xml")
  if os.path.exists(path):
    tree = ET.parse(path).getroot()
    suites = [tree] if tree.tag == "testsuite" else list(tree)
    for s in suites:
      s.set("name", g)
      root.append(s)
  else:  # killed at its limit or crashed: pytest wrote nothing
    s = ET.SubElement(root, "testsuite", name=g, tests="1", errors="1", failures="0")
    case = ET.SubElement(s, "testcase", classname=g, name="junit_missing")
    ET.SubElement(case, "error", message=f"no junit xml from {g}: see logs/{g}.log")
ET.ElementTree(root).write(out + ".tmp", encoding="utf-8", xml_declaration=True)
os.replace(out + ".tmp", out)
EOF
}

ckpt() {  # ckpt NAME SHAPE LIMIT [--check]: the 1B shape is checked by its decode parts' load
  part "$1" "$3" env JAX_PLATFORMS=cpu "$PYTHON" scripts/make_random_checkpoint.py \
    --shape="$2" --out="$CKPT/$2" "${@:4}" "${CKPT_ARGS[@]}"
}

decode() {  # decode NAME SHAPE DTYPE BATCHES LIMIT
  local name=$1 shape=$2 dtype=$3 batches=$4 limit=$5
  if ! want "$name"; then return 0; fi
  if [[ ! -f "$CKPT/$shape/config.json" ]]; then
    skip "$name" "no checkpoint $shape (see ckpt parts)"
    return 0
  fi
  local left
  # The benchmark stops itself at half of the limit the part gets: cut here as part() would,
  # 2 s early so that part() (a clock tick later) keeps this limit.
  left=$(( $(run_left) - 2 ))
  if (( left < limit )); then limit=$(( left > 0 ? left : 0 )); fi
  part "$name" "$limit" "$PYTHON" -m experiments.bench_decode --model="$CKPT/$shape" \
    --out="$WORK/decode/$name" --batches="$batches" "${DECODE_ARGS[@]}" --dtype="$dtype" \
    --max_seconds=$(( limit > 3 ? limit / 2 : 1 ))
  partial_if "$name" "$WORK/decode/$name/summary.json"
  publish
}

echo "=== device check: backend $BACKEND, commit $(git rev-parse --short HEAD 2>/dev/null \
  || echo '?'), OUT=$OUT, SCRATCH=$SCRATCH"

# Phase 1: checkpoints (CPU) beside the correctness tests (GPU; no timing), memory not
# preallocated so that the processes share the device.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
(
  for size in 135m 1b; do  # a checkpoint when it or one of its decode parts is wanted
    if want "ckpt_$size" || want "decode_${size}_float32" || want "decode_${size}_bfloat16"; then
      if [[ $size == 135m ]]; then
        ckpt ckpt_135m smollm2-135m "$L_CKPT_135M" --check
      else
        ckpt ckpt_1b llama-1b "$L_CKPT_1B"
      fi
    fi
  done
) &
if want kernel_tests; then
  part kernel_tests "$L_KERNEL_TESTS" "$PYTHON" -m pytest -q -rs -p no:cacheprovider \
    tests/pallas_kernels/offset_decode_test.py::KernelTest --junitxml="$WORK/junit/kernel_tests.xml" &
fi
FAST_GROUPS=()
for g in a b c; do
  files_var="FAST_${g^^}"
  if [[ -n "${!files_var}" ]] && want "fast_tier_$g"; then
    FAST_GROUPS+=("fast_tier_$g")
    # shellcheck disable=SC2086  # the file lists split on spaces
    part "fast_tier_$g" "$L_FAST" "$PYTHON" -m pytest -q -rs -p no:cacheprovider -m "not slow" \
      ${!files_var} --junitxml="$WORK/junit/fast_tier_$g.xml" &
  fi
done
wait
unset XLA_PYTHON_CLIENT_PREALLOCATE
if (( ${#FAST_GROUPS[@]} )); then
  merge_fast_tier "${FAST_GROUPS[@]}" || echo "=== merging the fast-tier junit files failed"
fi
publish

# Phase 2, one at a time: the timings.
if want bench_kernels; then
  part bench_kernels "$L_BENCH_KERNELS" "$PYTHON" -m experiments.bench_kernels "${BK_ARGS[@]}" \
    --out="$WORK/bench_kernels.md"
  partial_if bench_kernels "$WORK/bench_kernels.json"
  publish
fi
for dtype in ${DECODE_DTYPES//,/ }; do
  decode "decode_135m_$dtype" smollm2-135m "$dtype" "$BATCH_135M" "$L_DECODE_135M"
done
for dtype in ${DECODE_DTYPES//,/ }; do
  decode "decode_1b_$dtype" llama-1b "$dtype" "$BATCH_1B" "$L_DECODE_1B"
done
publish

FAILED=0
for f in "$WORK"/parts/*.json; do
  [[ -f "$f" ]] || continue
  if ! grep -qE '"status": "(ok|skipped|partial)"' "$f"; then
    FAILED=1
  fi
done
echo "=== all parts in $(( $(date +%s) - T_ALL ))s; failed: $FAILED; outputs under $OUT:"
ls -la "$OUT"
exit "$FAILED"
