# distributed-llm-lab: `make help` lists every target.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help venv run test test-slow browser-deps multihost-deps ray-deps test-multihost gpu-check lint format bench readme-check lock clean

help: ## List every target with its one-line description
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-15s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned, so no dependency can pull a multi-GB CUDA build instead.
	$(PY) -m pip install --quiet -c constraints.txt "torch==2.13.0"
	# every other package at the version the README's figures were measured with
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

venv: $(STAMP) ## Create .venv and install the project (editable) with its dev tools

run: $(STAMP) ## The lab tour: every experiment briefly on offline defaults, a small sweep, a report
	$(PY) -m labtools.tour

# `make test` runs its files on TEST_WORKERS processes (pytest-xdist; a file stays on one worker,
# so its module fixtures are built once): 2 by default, the cores CI has; TEST_WORKERS=0 runs
# it in this one process (pdb, -x, reading one test's output in order).
TEST_WORKERS ?= 2

test: $(STAMP) ## Run the test suite (fast tests; `slow` and `multihost` excluded) on TEST_WORKERS=2 processes, its 15 slowest last
	$(PY) -m pytest -m "not slow and not multihost" -q -n $(TEST_WORKERS) --dist loadfile --durations=15 --durations-min=1

test-slow: $(STAMP) browser-deps ## Run only the slow tests (minutes; the report's browser test needs chromium)
	$(PY) -m pytest -m "slow" -q -rs

browser-deps: ## Install headless Chromium for the report's browser test (root, Debian; else it is skipped, saying why)
	@if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then \
	  echo "browser-deps: chromium is installed"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    chromium >/dev/null && echo "browser-deps: installed"; \
	else echo "browser-deps: not root or no apt-get: the report's browser test will be skipped, saying why"; fi

multihost-deps: ## Install what the multi-host tests need (root, Debian): WireGuard tools, wireguard-go, nftables
	@if command -v wg >/dev/null && command -v nft >/dev/null && command -v wireguard-go >/dev/null; then \
	  echo "multihost-deps: wg, wireguard-go and nft are installed"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    wireguard-tools wireguard-go nftables >/dev/null && echo "multihost-deps: installed"; \
	else echo "multihost-deps: not root or no apt-get: the overlay's tests will be skipped, saying why"; fi

ray-deps: $(STAMP) ## Install the optional Ray extra (run_matrix's cells as Ray tasks; ~40 s, ~300 MB)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[ray]"

test-multihost: $(STAMP) multihost-deps ## The modules across network namespaces (root, iproute2; else skipped, saying why)
	$(PY) -m pytest -m multihost -q -rs tests/multihost

gpu-check: $(STAMP) ## On a CUDA GPU: the cuda tests, then every bench on it (without one: says so)
	$(PY) -m labtools.gpu_check

lint: $(STAMP) ## ruff (style, imports) and mypy (types)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .

format: $(STAMP) ## Rewrite code in the project's style (ruff format + autofixes)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(STAMP) ## Run every benchmark in bench/ (tables to stdout, JSON to bench/results/)
	@set -e; for script in bench/*_bench.py; do echo "== $$script"; $(PY) $$script; done

readme-check: $(STAMP) ## Check every tagged bench figure against bench/results, then replay every command of README.md and docs/*.md (quick settings)
	$(PY) -m labtools.readme_check

lock: ## Rewrite constraints.txt from what .venv has now (after a deliberate upgrade)
	@test -x $(PY) || { echo "no $(VENV) yet: run make venv first"; exit 1; }
	@{ sed -n '/^#/p' constraints.txt; $(PY) -m pip freeze --exclude-editable \
	   | grep -v ' @ ' | sed -E 's/^(torch==[0-9.]+)\+[a-z0-9.]+$$/\1/'; } > constraints.txt.new
	@mv constraints.txt.new constraints.txt && touch $(STAMP)
	@echo "constraints.txt: $$(grep -c == constraints.txt) pins"

clean: ## Remove caches, run outputs and the virtualenv (not the tiny-model cache)
	rm -rf $(VENV) outputs multirun reports wandb .pytest_cache .mypy_cache .ruff_cache .hypothesis *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
