# Quick start: `make demo` (the main job on the embedded demo model) and `make test`.
# Both set themselves up first (.ci/bootstrap.sh): virtual environment, packages, extension.
VENV ?= .venv
OUT ?= out/demo
PYTEST_ARGS ?=

.PHONY: setup demo test test-quick bench results
setup:
	bash .ci/bootstrap.sh

demo: setup
	$(VENV)/bin/pullback demo --out $(OUT)

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# The quick loop while developing: everything but the tests marked slow in python_tests/conftest.py.
test-quick: setup
	$(VENV)/bin/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/python benchmarks/bench_ops.py

# Regenerate the generated pages of docs/results/ with the reduced settings a 2-core machine affords.
results: setup
	$(VENV)/bin/python benchmarks/bench_prune.py --threads 2 --results-page
	$(VENV)/bin/python benchmarks/bench_metric.py --quick --threads 2 --results-page
	$(VENV)/bin/python benchmarks/bench_diagnose.py --quick --threads 2 --results-page
