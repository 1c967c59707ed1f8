#!/usr/bin/env bash
# On a machine with a CUDA GPU, from a checkout of this repository: the GPU acceptance tests and every GPU
# figure in one run, as JSON (and a PNG, a junit XML) in $OUT (default ./gpu-results). Needs python3 with torch
# (CUDA), pillow, numpy, psutil, rich, nvidia-ml-py and matplotlib, and pytest (+ pytest-timeout) for the tests
# (without pytest that part is skipped, saying so); trainfast itself runs from src/ (no install).
#   bash benchmarks/gpu.sh
#   WHEELS=/path/to/wheels bash benchmarks/gpu.sh    # offline: missing packages from a local wheel folder
# WHEELS: a folder of wheels (made with `pip download -d DIR PACKAGES` where there is internet); whatever of the
# above is missing is installed from it with `pip install --no-index --find-links "$WHEELS"`, before the parts
# start (that time is not in their limits). Without WHEELS a missing package stops the script, naming it.
# Without CUDA it stops at once (exit 2, one line on stderr): every GPU test would skip and no GPU figure would
# be measured. ALLOW_CPU=1 runs every part on the CPU anyway: the smoke test (tests/integration/
# test_gpu_script.py) does, with SUITE_ARGS='--device cpu --tiny' and LIMIT_SCALE=3.
# Each part has its own time limit and a failure in one does not stop the others. With env.json's,
# they add up to 570 s (9.5 minutes), the longest a run can take. The two that compile get the most: a cold
# torch.compile of a small model (inductor, nothing cached) takes 40-90 s on a GPU. gpu_tests runs tests/gpu
# (one test compiles: 140 s per test) and gpu_suite compiles its ConvNet after its precision and channels_last
# A/Bs.
# The variables SUITE_ARGS / BENCH_ARGS / DEMO_ARGS replace each part's arguments and LIMIT_SCALE multiplies the
# limits (the CPU smoke test uses them).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
fail() { echo "gpu.sh: $*" >&2; exit 2; }

# Packages, as "module:distribution". Looked up without importing them (find_spec): seconds, not a torch import.
REQUIRED="torch:torch numpy:numpy PIL:pillow psutil:psutil rich:rich pynvml:nvidia-ml-py matplotlib:matplotlib"
OPTIONAL="pytest:pytest pytest_timeout:pytest-timeout"
missing() {  # missing "module:dist ..." -> the distributions whose module $PY cannot find
  "$PY" - "$@" <<'EOF'
import importlib.util
import sys

def absent(module):
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True

print(" ".join(dist for module, _, dist in (pair.partition(":") for pair in sys.argv[1:]) if absent(module)))
EOF
}
command -v "$PY" >/dev/null 2>&1 || fail "PYTHON=$PY is not a command; give the python that has torch with CUDA"
# shellcheck disable=SC2086  # the package lists are word lists on purpose
need=$(missing $REQUIRED) || fail "$PY could not look for its packages; check that PYTHON=$PY runs"
# shellcheck disable=SC2086
want=$(missing $OPTIONAL) || want=""
if [ -n "${WHEELS:-}" ]; then
  [ -d "$WHEELS" ] || fail "WHEELS=$WHEELS is not a folder; give the folder that holds the wheels" \
    "(pip download -d DIR PACKAGES on a machine with internet)"
  if [ -n "$need" ]; then
    echo "== installing from $WHEELS: $need"
    # shellcheck disable=SC2086
    "$PY" -m pip install --no-index --find-links "$WHEELS" $need \
      || fail "pip could not install $need from WHEELS=$WHEELS (its error is above); add their wheels and" \
              "dependencies to that folder (pip download -d $WHEELS $need)"
    # shellcheck disable=SC2086
    need=$(missing $REQUIRED)
  fi
  if [ -n "$want" ]; then  # optional: without them the tests are skipped or unbounded per test, saying so
    echo "== installing from $WHEELS: $want"
    # shellcheck disable=SC2086
    "$PY" -m pip install --no-index --find-links "$WHEELS" $want \
      || echo "== could not install $want from $WHEELS; going on without"
  fi
fi
[ -z "$need" ] || fail "missing python packages for $PY: $need; install them (pip install $need), or give a" \
  "folder of their wheels: WHEELS=/path/to/wheels bash benchmarks/gpu.sh"

# CUDA, before anything slow. A driver too old or absent shows up as torch's warning: it goes into the line.
cuda=$(timeout 45 "$PY" - 2>/dev/null <<'EOF'
import sys
import warnings

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch
    ok = torch.cuda.is_available()
if ok:
    sys.exit(0)
if torch.version.cuda is None:
    print(f"torch {torch.__version__}, a CPU-only build")
else:
    why = [str(w.message).splitlines()[0] for w in caught if "CUDA" in str(w.message) or "driver" in str(w.message)]
    print(f"torch {torch.__version__} built for CUDA {torch.version.cuda}; {why[0] if why else 'no CUDA device visible'}")
sys.exit(3)
EOF
)
rc=$?
if [ $rc -ne 0 ]; then
  case $rc in
    3) why="CUDA is not available to $PY ($cuda)" ;;
    124) why="could not tell whether CUDA is available: importing torch in $PY took over 45 s" ;;
    *) why="could not tell whether CUDA is available: $PY failed to import torch (exit $rc)" ;;
  esac
  [ "${ALLOW_CPU:-0}" = 1 ] || fail "$why: no GPU test or figure would run. Run it where CUDA works, or" \
    "ALLOW_CPU=1 bash benchmarks/gpu.sh for the CPU smoke test (add SUITE_ARGS='--device cpu --tiny' LIMIT_SCALE=3)"
  echo "== ALLOW_CPU=1: $why; every part runs on the CPU (a smoke test: no GPU figure)"
fi

OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
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
# ("no tests collected") is no failure. `-o timeout=...` bounds each test where pytest-timeout is installed (140 s:
# the compile test's cold compile and its A/B steps); where it is not, pytest would stop at the unknown ini option
# under filterwarnings=error, hence the -W.
if "$PY" -c "import pytest" 2>/dev/null; then
  PART_OK=5 part gpu_tests 200 "$PY" -m pytest -m gpu tests/gpu -p no:cacheprovider -v -rA \
    -o timeout=$(( 140 * ${LIMIT_SCALE:-1} )) -W ignore::pytest.PytestConfigWarning --junitxml "$OUT/gpu_tests.xml"
else
  echo "== gpu_tests: skipped: pytest is not installed for $PY (pip install pytest, or WHEELS=..., then rerun)" \
    | tee "$OUT/gpu_tests.log"
fi
# shellcheck disable=SC2086  # the *_ARGS variables are word lists on purpose
part gpu_suite 160 "$PY" benchmarks/gpu_suite.py --json "$OUT/gpu_suite.json" ${SUITE_ARGS:-}
# shellcheck disable=SC2086
part bench 120 "$PY" -m trainfast bench --quick --json "$OUT/bench.json" --plot "$OUT/bench.png" \
  --markdown "$OUT/bench.md" ${BENCH_ARGS:-}
# shellcheck disable=SC2086
part demo 50 "$PY" -m trainfast demo --quick --json "$OUT/demo.json" ${DEMO_ARGS:-}
echo "results in $OUT:"; ls -la "$OUT"
exit $status
