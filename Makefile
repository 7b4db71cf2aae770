# Two entry points for a fresh machine: `make demo` and `make test` (both set up first).
# The interpreter the venv is made from: the faster of `python3` and the system's /usr/bin/python3
# (3.11 or later, able to make a venv with pip), by a fixed pure-Python loop timed in each. A
# CPython built without profile-guided and link-time optimisation (pyenv's default build) ran
# this project's Python-bound work 20-40% slower than the distribution's build of 3.11 on the same
# machine: `import torch` and the project 5.5 s against 3.4, an export of the small recipe 18 s
# against 14. PYTHON=... chooses one.
PICK_PYTHON := for candidate in python3 /usr/bin/python3; do $$candidate -c 'import ensurepip, sys, time, venv; \
	assert sys.version_info >= (3, 11); start = time.perf_counter(); sum(i * i for i in range(3_000_000)); \
	print(time.perf_counter() - start, sys.executable)' 2>/dev/null; done | sort -g | head -n 1 | cut -d " " -f 2
PYTHON ?= $(or $(shell $(PICK_PYTHON)),python3)
VENV ?= .venv
TORCH ?= torch==2.13.0
# The FlashInfer whose DeepSeek V4.1 records the caches follow (runtime/formats/dsv41.py's
# FLASHINFER_PIN; a test checks). The cuda extra does not pin it: the tests load its reference
# encoder, so it is installed here, without its CUDA-only dependencies.
FLASHINFER ?= flashinfer-python==0.7.4
UV_PIN ?= uv==0.13.9
BIN := $(VENV)/bin
STAMP := $(VENV)/.b12x-installed

.PHONY: setup compile demo test test-fast bench clean

# torch comes from pip (the index it is configured with); the rest from uv, which installs what
# torch's presence leaves to do in seconds where pip took a minute. Nothing in the venv is
# byte-compiled up front (all of it took 30-45 s of the two cores, most of it modules no process
# imports): the commands below run with PYTHONDONTWRITEBYTECODE emptied (`WRITE_BYTECODE`), so
# even where it is set (as on many CI machines) the first process to import torch, sympy or
# transformers writes their bytecode and every later one reads it (`import torch` compiled:
# 1.7 s instead of 4).
UV := $(BIN)/uv pip install -q --python $(BIN)/python
SOURCES := b12x-toolchain exporter passes runtime recipes benchmarks tests
COMPILE := $(BIN)/python -m compileall -q -j 0
WRITE_BYTECODE := PYTHONDONTWRITEBYTECODE=

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-compile "$(TORCH)" "$(UV_PIN)"
	$(UV) --no-deps "$(FLASHINFER)"
	$(UV) -e '.[dev]'
	touch $(STAMP)

# This project's own modules, compiled before each run for the same reason (seconds; files
# already compiled are skipped).
compile: setup
	$(COMPILE) $(SOURCES) > /dev/null

setup: $(STAMP)

# The shipped trained model: exported from its release-layout checkpoint (its tokenizer goes
# into the package), then one text prompt decoded speculatively and again without the drafter.
DEMO_RUN := --prompts examples/demo_prompt.jsonl --max-new-tokens 64 --threads 1

demo: compile
	$(WRITE_BYTECODE) $(BIN)/b12x export --recipe dsv41-mini --checkpoint checkpoints/dsv41-mini --out out
	$(WRITE_BYTECODE) $(BIN)/b12x run out/dsv41-mini.b12x $(DEMO_RUN)
	$(WRITE_BYTECODE) $(BIN)/b12x run out/dsv41-mini.b12x $(DEMO_RUN) --greedy

# One torch thread per process: the suite's tensors are tiny, and the two cores go to two
# pytest workers instead (pytest-xdist; a module's tests stay on one worker, so its
# module-scoped exports run once; tests/conftest.py shares the session's exports). A third
# worker was measured slower (18:10 against 17:05 for `.ci/run`): the suite is CPU-bound.
WORKERS ?= 2
# PYTHONDONTWRITEBYTECODE emptied for the run: pytest then keeps the test modules it rewrites
# for its assertions (collection in each worker takes 8 s instead of 16), and a module compiled
# by one process (torch's among them) is read by the next. --no-loadscope-reorder: the workers take modules in the
# order tests/conftest.py gives them (longest first); xdist would otherwise order them by how
# many tests each has, leaving a long module of few tests for last (15:06 against 16:34).
PYTEST := OMP_NUM_THREADS=1 $(WRITE_BYTECODE) $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

# The slowest tests are listed after every run, so a test that grows slow shows up in CI's log.
test: compile
	$(PYTEST) --durations=15

# The inner loop (a developer convenience, not what CI runs): the tests that need no
# exported package and no child process, in under three minutes.
test-fast: compile
	$(PYTEST) -m "not slow and not exports"

bench: setup
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf out benchmarks/results .pytest_cache
