# Two commands a new user needs: `make demo` (the main job) and `make test` (the suite).
# Each sets up its own virtual environment; the constraints file pins the CPU build of torch.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint typecheck install clean

$(STAMP): pyproject.toml requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c requirements/constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/dcp-safe demo

test: $(STAMP)
	$(BIN)/ruff check dcp_safe tests examples benchmarks
	$(BIN)/ruff format --check dcp_safe tests examples benchmarks
	$(BIN)/mypy
	$(BIN)/python -m pytest

# Every test that starts no process, worker or S3 server: the answer in minutes, not the suite.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not multiproc and not s3 and not slow and not subprocess and not worker_process"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
