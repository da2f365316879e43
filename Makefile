# Two commands do all the set-up: `make train` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install train test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install "$(TORCH_SPEC)"
	$(BIN)/pip install -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(BIN)/python -m recipes.lm runs/lm --preset cpu

test: $(STAMP)
	$(BIN)/ruff check .
	WANDB_MODE=offline WANDB_SILENT=true $(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python -m benchmarks.overhead
	$(BIN)/python -m benchmarks.lm_throughput --preset tiny
	$(BIN)/python -m benchmarks.lm_throughput --preset cpu --steps 5
	$(BIN)/python -m benchmarks.checkpoint

clean:
	rm -rf $(VENV) runs
