#!/usr/bin/env bash
# On a machine with a CUDA GPU, from a checkout of this repository: every GPU figure in one run, under 8
# minutes, as JSON (and a PNG) in $OUT (default ./gpu-results). Needs python3 with torch (CUDA), pillow,
# numpy, psutil, rich, nvidia-ml-py and matplotlib; trainfast itself runs from src/ (no install).
#   bash benchmarks/gpu.sh
# Each part has its own time limit and a failure in one does not stop the others. The variables
# SUITE_ARGS / BENCH_ARGS / DEMO_ARGS replace each part's arguments and LIMIT_SCALE multiplies the limits
# (the CPU smoke test uses them).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRAINFAST_CACHE="${TRAINFAST_CACHE:-/tmp/trainfast-cache}"  # outside $OUT: only results come back
status=0
part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$(( $2 * ${LIMIT_SCALE:-1} )); shift 2
  local started=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 40
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - started))s"
  [ "$rc" -eq 0 ] || status=1
}
part env 30 "$PY" -m trainfast env --json
"$PY" -m trainfast env --json > "$OUT/env.json" 2>/dev/null || true
# shellcheck disable=SC2086  # the *_ARGS variables are word lists on purpose
part gpu_suite 210 "$PY" benchmarks/gpu_suite.py --json "$OUT/gpu_suite.json" ${SUITE_ARGS:-}
# shellcheck disable=SC2086
part bench 150 "$PY" -m trainfast bench --quick --json "$OUT/bench.json" --plot "$OUT/bench.png" \
  --markdown "$OUT/bench.md" ${BENCH_ARGS:-}
# shellcheck disable=SC2086
part demo 90 "$PY" -m trainfast demo --quick --json "$OUT/demo.json" ${DEMO_ARGS:-}
echo "results in $OUT:"; ls -la "$OUT"
exit $status
