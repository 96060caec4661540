# Every target creates or reuses .venv, so each works on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Explicit torch pin: on the project machines it resolves to a local CPU build;
# an unpinned torch would pull gigabytes of CUDA wheels.
TORCH  ?= torch==2.13.0

.PHONY: setup demo simulate test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

## The embedded default main job: a whole network on loopback (a bootstrap server and 4 training
## nodes as processes) trains gemma-tiny on real text; every version is quorum-certified.
demo: $(STAMP)
	$(BIN)/p2pdiloco demo --nodes 4 --rounds 5

## DiLoCo beside a data-parallel baseline in one process (no network).
## Short-run outer momentum 0.5 and H=20: see docs/adr/0006-short-run-outer-momentum.md.
simulate: $(STAMP)
	$(BIN)/p2pdiloco simulate --model gemma-tiny --learners 4 --inner-steps 20 --rounds 10 --outer-momentum 0.5

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=15

lint: $(STAMP)
	$(BIN)/ruff check p2pdiloco tests bench
	$(BIN)/ruff format --check p2pdiloco tests bench
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/codec.py --threads 1
	$(BIN)/python bench/aggregate.py
	$(BIN)/python bench/loss_parity.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
