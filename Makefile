# Quick start: `make demo` (the main job on the embedded demo model) and `make test`.
# Both set themselves up first (.ci/bootstrap.sh): virtual environment, packages, extension.
VENV ?= .venv
OUT ?= out/demo
PYTEST_ARGS ?=

.PHONY: setup demo test bench
setup:
	bash .ci/bootstrap.sh

demo: setup
	$(VENV)/bin/pullback demo --out $(OUT)

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/python benchmarks/bench_ops.py
