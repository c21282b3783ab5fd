# Everyday commands. They run from the source tree (PYTHONPATH=src), so they work without installing ropekit;
# the tools come from `pip install -e ".[dev]"` (see CONTRIBUTING.md). `make` alone lists the targets.

PYTHON ?= python
export PYTHONPATH := src$(if $(PYTHONPATH),:$(PYTHONPATH))

.DEFAULT_GOAL := help
.PHONY: help test lint gpu bench check ci

help:  ## list the targets
	@awk -F ':.*## ' '/^[a-z]+:.*## / {printf "  make %-6s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

test:  ## the test suite (on CPU the Triton kernels run under the interpreter)
	$(PYTHON) -m pytest -q

lint:  ## ruff, with the rules of pyproject.toml (CI pins the version in .ci/constraints.txt)
	ruff check .

gpu:  ## the whole test suite and `ropekit check`, on a CUDA machine (logs in out/gpu-suite)
	bash benchmarks/probes/gpu_suite.sh tests check

bench:  ## the quick benchmark preset (needs CUDA)
	$(PYTHON) -m ropekit.cli bench --quick

check:  ## every capability against the float64 reference, on CUDA if present, else CPU
	$(PYTHON) -m ropekit.cli check

ci:  ## what CI does: lint, then the README commands in fresh virtual environments, newest and oldest versions
	bash .ci/run
