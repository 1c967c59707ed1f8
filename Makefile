# `make demo` and `make test` work on a fresh machine: they make .venv, install torch only if the venv
# lacks it (the CPU build here and in CI; a CUDA machine can install its own torch first), then the
# package with its extras.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: install bytecode demo test test-fast stress lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,plot]"
	touch $@

demo: install
	$(VENV)/bin/trainfast demo

# the whole suite, as CI runs it; the 25 slowest tests are listed so that growth is visible
test: install bytecode
	$(PY) -m pytest --durations=25

# the inner loop: the unit tests not marked slow (under 90 s on 2 cores; `make test` runs them all)
test-fast: install bytecode
	$(PY) -m pytest tests/unit -q -x -m "not slow"

# The package's bytecode, written even where PYTHONDONTWRITEBYTECODE is set: the suite starts ~150 Python
# processes that import trainfast (CLI runs, torchrun ranks, spawned loader workers), and each would otherwise
# compile it again (~0.2 s apiece).
bytecode: install
	$(PY) -m compileall -q src

# many-seed and full-size stress runs (the suite keeps a few seeds of each, and a smaller size)
stress: install
	TRAINFAST_RANK_SKEW_SEEDS=20 $(PY) -m pytest tests/integration/test_rank_skew.py
	TRAINFAST_STRESS=1 $(PY) -m pytest -m stress

lint: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
