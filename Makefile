# Targets named in the README. `make test` is what CI runs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest processes for `make test` (pytest-xdist; 0 runs the suite in this process).
# Three on two cores: much of the suite waits on servers, subprocesses and real time, and
# work stealing keeps every process busy to the end (the suite in 0.80-0.82 of the time of
# two processes that split it up front).
TEST_WORKERS ?= 3
# Every dependency of `.[dev]`, pinned with hashes: what `make install` and CI install.
LOCK := requirements/dev.lock
# Lock files compile for every platform and Python >= 3.11 (pyproject's requires-python).
COMPILE = $(VENV)/bin/uv pip compile pyproject.toml --universal --python-version 3.11 \
	--generate-hashes --custom-compile-command 'make lock'

.PHONY: install lock demo serve test test-e2e kube-e2e-binaries test-extras lint fmt bench docs docs-serve clean

install: $(STAMP)

# uv (the lock's own version, from PyPI) installs the lock: 10 s where pip took 40. Its
# modules and stoker's are compiled at install, as pip compiles them: where the environment
# sets PYTHONDONTWRITEBYTECODE (containers, CI), every process (each CLI call, each local
# worker) compiled what it imported again, twice the start-up time of `stoker version`.
$(STAMP): pyproject.toml $(LOCK)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$$(grep -o '^uv==[^ ]*' $(LOCK))"
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) --require-hashes -r $(LOCK)
	$(VENV)/bin/uv pip install -q --python $(PY) --no-deps --no-build-isolation -e .
	$(PY) -m compileall -q src > /dev/null
	touch $(STAMP)

# Recompiles the lock files from pyproject's ranges (after changing a dependency); add
# --upgrade-package NAME (or --upgrade) through UV_ARGS to move pins forward.
lock:
	test -x $(VENV)/bin/uv || { python3 -m venv $(VENV) && $(PY) -m pip install -q uv; }
	$(COMPILE) $(UV_ARGS) --extra dev -o requirements/dev.lock
	$(COMPILE) $(UV_ARGS) --extra all -o requirements/all.lock

# The README's tour on a server of its own (python -m stoker.demo).
demo: install
	$(PY) -m stoker.demo

serve: install
	$(VENV)/bin/stoker serve

lint: install
	$(VENV)/bin/ruff check src tests benchmarks noxfile.py
	$(VENV)/bin/ruff format --check src tests benchmarks noxfile.py
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal

# Every extra on its own (noxfile.py): the wheel and sdist built and checked, each extra
# installed into a fresh virtualenv (uv, its cache) and running what it is for.
test-extras: install
	$(VENV)/bin/nox $(NOX_ARGS)

# The tier against a real kube-apiserver and kube-scheduler (tests/e2e_kubernetes), alone,
# in one process: it shares one cluster. Builds the binaries first when they are not cached.
test-e2e: install kube-e2e-binaries
	$(PY) -m pytest -n 0 -m e2e_kubernetes tests/e2e_kubernetes

kube-e2e-binaries:
	bash tests/e2e_kubernetes/cluster/build.sh

fmt: install
	$(VENV)/bin/ruff format src tests benchmarks
	$(VENV)/bin/ruff check --fix src tests benchmarks

# The benchmarks that need nothing but this machine; BENCH_ARGS=--all adds PostgreSQL's.
bench: install
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

# The documentation site (mkdocs.yml) into site/, in strict mode with every link checked.
# First regenerates the API reference (docs/api.md, docs/openapi.json) from the routes;
# the configuration, CLI and metrics references are generated during the build.
docs: install
	$(PY) -m stoker.api.reference docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --clean

# The site on http://127.0.0.1:8000, rebuilt on every change (DOCS_ADDR=host:port).
DOCS_ADDR ?= 127.0.0.1:8000
docs-serve: install
	$(PY) -m stoker.api.reference docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --strict --dev-addr $(DOCS_ADDR)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis .nox site
