# gpushare developer commands. Needs only python3 (3.11+) and make.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PROTOS := $(shell find proto -name '*.proto')

.PHONY: demo test lint bench simulate image manifests clean verify-pairing

demo: $(VENV)/.installed  ## run the daemon on a simulated node with a simulated kubelet
	$(BIN)/gpushare-demo

test: $(VENV)/.installed-test  ## lint, type-check and run the test suite
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	$(BIN)/pytest -q

lint: $(VENV)/.installed-test
	$(BIN)/ruff check src tests
	$(BIN)/mypy

verify-pairing: $(VENV)/.installed-test  ## every admission sequence of up to 5 containers, 3 regimes
	$(BIN)/pytest -q -m slow tests/test_pairing.py

bench: $(VENV)/.installed-test  ## measure latency, start time and footprint
	$(BIN)/python -m gpushare.bench --write docs/benchmarks.md

simulate: $(VENV)/.installed  ## trace-driven placement simulation
	$(BIN)/python -m gpushare.sim.trace --section docs/benchmarks.md

IMAGE ?= gpushare:0.1.0
HAMI_VERSION ?= v2.4.1

image:  ## build the container image (needs a Docker engine)
	docker build --build-arg HAMI_VERSION=$(HAMI_VERSION) -t $(IMAGE) .

manifests:  ## copy daemonset/*.yaml into the package, for kubectl gpushare install
	rm -f src/gpushare/manifests/*.yaml
	cp daemonset/*.yaml src/gpushare/manifests/

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py $(PROTOS)
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(BIN)/python pyproject.toml setup.py $(PROTOS)
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@ $(VENV)/.installed

clean:
	rm -rf $(VENV) src/gpushare/_proto build dist src/*.egg-info
