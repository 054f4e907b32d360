# Two commands do everything: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs docs-tables bench bench-run bench-check clean

# Installation prints pip's own progress (a few minutes on a fresh machine).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "Installing into $(VENV): torch (CPU build) first, then thinwire and its tools"
	# The CPU build of torch, pinned exactly: any looser spec pulls CUDA wheels.
	$(BIN)/python -m pip install --progress-bar on torch==2.13.0
	$(BIN)/python -m pip install --progress-bar on -e '.[dev]'
	# Fashion-MNIST for the fashion-convnet workload, where root or password-less sudo can
	# install it; never fatal (the workload then says what is missing).
	@[ -d /usr/share/datasets/fashion-mnist ] || \
	  ( [ "$$(id -u)" = 0 ] && apt-get install -y -q dataset-fashion-mnist ) || \
	  sudo -n apt-get install -y -q dataset-fashion-mnist || \
	  echo "note: dataset-fashion-mnist not installed; the fashion-convnet workload is skipped"
	touch $(STAMP)

# The smallest language model (0.12M parameters, Shakespeare's lines), where 4 workers reach
# the target in about half a lone worker's steps: dense against SparseLoCo, about 2 minutes.
DEMO := --workload text-lm --width 64 --workers 4 --steps 400 --target 3.5 \
	--schemes dense,diloco+sparseloco

demo: $(STAMP)
	$(BIN)/thinwire compare $(DEMO)

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy src/thinwire
	$(BIN)/lint-imports --no-cache

# The user guide and the API reference (mkdocstrings reads the docstrings) into site/:
# offline, and any warning (a broken link, a page left out of the nav) fails the build.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

# The guide's option tables, from the registries and the configs' own fields and comments
# (after a scheme, boundary or option changes; tests/test_docs.py fails until they are
# regenerated). The dAD engine's and the update rules' tables are kept by hand.
OPTIONS := docs/snippets/options
docs-tables: $(STAMP)
	$(BIN)/thinwire schemes --markdown --kind scheme > $(OPTIONS)/schemes.md
	$(BIN)/thinwire schemes --markdown --kind push > $(OPTIONS)/pushes.md
	$(BIN)/thinwire schemes --markdown --kind boundary > $(OPTIONS)/boundaries.md

# `make bench` regenerates docs/results.md from the newest results/ files; `make bench-run`
# measures first. The shaped-link benchmark needs root (network namespaces, tc).
SUDO ?= $(shell [ "$$(id -u)" = 0 ] || echo sudo)

bench: $(STAMP)
	@echo "Regenerating docs/results.md from results/ (else the data shipped in docs/data/)."
	@echo "To measure first: make bench-run"
	@echo "  (runs $(BIN)/python -m benchmarks.overhead, then, as root,"
	@echo "   $(BIN)/python -m benchmarks.netem: needs ip and tc (iproute2), ~10 min on 2 cores)"
	$(BIN)/python -m benchmarks.report

bench-run: $(STAMP)
	$(BIN)/python -m benchmarks.overhead
	$(SUDO) $(BIN)/python -m benchmarks.netem
	$(BIN)/python -m benchmarks.report

# The benchmarks' own tests (pure parts of the harness; no root, no namespaces). Kept out of
# `make test` because tests/ never imports benchmarks/.
bench-check: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider --rootdir . -o pythonpath="src ." benchmarks/tests

clean:
	rm -rf $(VENV) runs site .pytest_cache
