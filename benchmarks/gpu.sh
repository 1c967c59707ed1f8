#!/usr/bin/env bash
# On a machine with a CUDA GPU, from a checkout of this repository: the GPU acceptance tests and every GPU
# figure in one run, under 8 minutes, as JSON (and a PNG, a junit XML) in $OUT (default ./gpu-results). Needs
# python3 with torch (CUDA), pillow, numpy, psutil, rich, nvidia-ml-py and matplotlib, and pytest for the
# tests (without pytest that part is skipped, saying so); trainfast itself runs from src/ (no install).
#   bash benchmarks/gpu.sh
# Each part has its own time limit (with env.json's, they add up to 480 s) and a failure in one does not stop
# the others. The variables SUITE_ARGS / BENCH_ARGS / DEMO_ARGS replace each part's arguments and LIMIT_SCALE
# multiplies the limits (the CPU smoke test uses them).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRAINFAST_CACHE="${TRAINFAST_CACHE:-/tmp/trainfast-cache}"  # outside $OUT: only results come back
status=0
part() {  # part NAME SECONDS COMMAND...   (exit codes in $PART_OK also count as success, besides 0)
  local name=$1 limit=$(( $2 * ${LIMIT_SCALE:-1} )); shift 2
  local started=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 40
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - started))s"
  case " 0 ${PART_OK:-} " in *" $rc "*) ;; *) status=1 ;; esac
}
part env 30 "$PY" -m trainfast env --json
# torch is warm by now: a few seconds
timeout $(( 10 * ${LIMIT_SCALE:-1} )) "$PY" -m trainfast env --json > "$OUT/env.json" 2>/dev/null || true
# The GPU acceptance tests (tests/gpu, each marked `gpu`; they skip with the reason where CUDA is absent). Exit 5
# ("no tests collected") is no failure. `-o timeout=90` bounds each test where pytest-timeout is installed; where
# it is not, pytest would stop at the unknown ini option under filterwarnings=error, hence the -W.
if "$PY" -c "import pytest" 2>/dev/null; then
  PART_OK=5 part gpu_tests 100 "$PY" -m pytest -m gpu tests/gpu -p no:cacheprovider -v -rA -o timeout=90 \
    -W ignore::pytest.PytestConfigWarning --junitxml "$OUT/gpu_tests.xml"
else
  echo "== gpu_tests: skipped: pytest is not installed for $PY (pip install pytest, then rerun)" \
    | tee "$OUT/gpu_tests.log"
fi
# shellcheck disable=SC2086  # the *_ARGS variables are word lists on purpose
part gpu_suite 155 "$PY" benchmarks/gpu_suite.py --json "$OUT/gpu_suite.json" ${SUITE_ARGS:-}
# shellcheck disable=SC2086
part bench 130 "$PY" -m trainfast bench --quick --json "$OUT/bench.json" --plot "$OUT/bench.png" \
  --markdown "$OUT/bench.md" ${BENCH_ARGS:-}
# shellcheck disable=SC2086
part demo 55 "$PY" -m trainfast demo --quick --json "$OUT/demo.json" ${DEMO_ARGS:-}
echo "results in $OUT:"; ls -la "$OUT"
exit $status
