# The two commands the README opens with live here, so CI and humans run the same thing.
VENV ?= .venv
PY := $(VENV)/bin/python
PACKAGES := admission gateway scheduler bench clients/python/kvgate_client

.PHONY: demo test lint typecheck unit redis-server promtool go gotest bench-core bench-performance

$(VENV)/.installed: pyproject.toml clients/python/pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,fast]'
	$(PY) -m pip install -q -e 'clients/python[openai]'
	touch $@

# Debian packages are installed with apt-get, through sudo unless make runs as root (then the
# venv stays the user's: `sudo make test` would leave a root-owned .venv).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
APT := $(SUDO) apt-get

# Tests start their own redis-server processes on free ports; install the binary when this
# machine lacks it. (On a host with systemd the package also starts a system Redis on 6379,
# which the tests and the demo never use.)
redis-server:
	@command -v redis-server >/dev/null || { $(APT) update -q && $(APT) install -y -q --no-install-recommends redis-server; }

# The dashboard test parses every panel's PromQL with promtool, which Debian ships in the
# 'prometheus' package (about 22 MB to download; on a host with systemd the package also
# starts a Prometheus server on :9090, which nothing here uses).
promtool:
	@command -v promtool >/dev/null || { $(APT) update -q && $(APT) install -y -q --no-install-recommends prometheus; }

# The Go client SDK (clients/go) and its end-to-end test need Debian's Go toolchain (1.19). The
# module has no dependencies: GOPROXY=off and GOTOOLCHAIN=local keep every go command off the
# network (the module proxy is not reachable from the build machines).
go:
	@command -v go >/dev/null || { $(APT) update -q && $(APT) install -y -q golang-go; }

GO_ENV := GOTOOLCHAIN=local GOPROXY=off GOFLAGS=
# Go keeps its build cache under $HOME; a CI runner without HOME gets one inside the checkout
# (exported, so the Python suite's `go build` of the examples finds it too).
ifeq ($(strip $(HOME)),)
export GOCACHE := $(CURDIR)/.cache/go-build
endif

# gofmt -l lists the files it would change: any output fails the target.
gotest: go
	@cd clients/go && out="$$(gofmt -l .)" && { test -z "$$out" || { echo "gofmt -l:"; echo "$$out"; exit 1; }; }
	cd clients/go && $(GO_ENV) go vet ./...
	cd clients/go && $(GO_ENV) go test -race ./...

lint: $(VENV)/.installed
	$(PY) -m ruff check .

typecheck: $(VENV)/.installed
	$(PY) -m mypy $(PACKAGES) tests

# -ra prints the reason of every skip, xfail and failure at the end. Everything the suite needs is
# installed by the prerequisites, so KVGATE_TEST_NO_SKIP=1 turns any skip into a failure: a test
# that cannot run here is a broken install step, not something to hide. Two workers
# (pytest-xdist): most tests wait on servers and timers, so the suite takes about half the wall
# time; the slow ones share one worker (tests/conftest.py), and each worker takes its servers'
# ports from a block of its own (bench/common/localredis.py).
unit: $(VENV)/.installed redis-server promtool go
	KVGATE_TEST_NO_SKIP=1 $(PY) -m pytest -q -ra -n 2 --dist loadgroup

test: lint typecheck gotest unit

bench-core: $(VENV)/.installed redis-server
	$(PY) -m bench.perf.core

# The whole performance suite, sections one after another, the 10-minute soak last;
# run it on a quiet machine. PERF_ARGS=--quick checks that every section runs, in minutes.
bench-performance: $(VENV)/.installed redis-server
	$(PY) -m bench.perf.performance $(PERF_ARGS)

# The 400% burst experiment, short version (about 3 minutes): Redis, simulated vLLM nodes,
# scheduler with a standby, two gateways; progress on the terminal, the table at the end.
# Its files go to the untracked bench/results/tmp/, so a demo leaves the checkout clean.
demo: $(VENV)/.installed redis-server
	$(PY) -m bench.burst.experiment --short --mix article --out bench/results/tmp
