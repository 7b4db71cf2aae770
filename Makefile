# Two entry points for a fresh machine: `make demo` and `make test` (both set up first).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.b12x-installed

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/b12x export --recipe dsv41-tiny --out out
	$(BIN)/b12x run out/dsv41-tiny.b12x --prompt-ids 1,2,3,4,5,6,7,8 --max-new-tokens 32

# One torch thread: the suite's tensors are tiny, and a second thread only adds contention
# on a two-core machine (several tests also run child processes side by side).
test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf out benchmarks/results .pytest_cache
