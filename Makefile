# gpushare developer commands. Needs only python3 (3.11+) and make.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PROTOS := $(shell find proto -name '*.proto')
comma  := ,

.PHONY: gpu-proof gpu-bench gpu-bench-prepare demo test test-slow lint bench scale simulate churn image image-local version manifests clean verify-pairing e2e e2e-build kubectl-plugin image-plan image-check image-archive

demo: $(VENV)/.installed  ## run the daemon on a simulated node with a simulated kubelet
	$(BIN)/gpushare-demo

# The suite's test files run on TEST_WORKERS pytest-xdist workers, each file whole on one
# worker (--dist loadfile): its tests mostly wait (daemons starting and stopping, gRPC
# grace periods, subprocesses), so four workers overlap those waits even on 2 cores
# (docs/benchmarks.md, "make test"). TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 4
test: $(VENV)/.installed-test  ## lint, type-check, check the layers and run the test suite
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile

# A real Kubernetes (etcd, kube-apiserver, kube-scheduler, kube-controller-manager and
# kubelets on a CRI fake, and on a real containerd and runc for test_real_runtime.py) built
# from Go modules, and the suite in tests/e2e that runs the daemon on it. K8S_VERSION picks the minor: 1.36 (v1.36.3, e2e/go.mod, into e2e/bin) or
# 1.37 (v1.37.2, e2e/go.1.37.mod, into e2e/bin-1.37). Needs Go >= 1.26, root (mount
# namespaces) and, the first time, the Go module proxy. See e2e/README.md.
K8S_VERSION ?= 1.36
e2e-build:
	K8S_VERSION=$(K8S_VERSION) e2e/build.sh

e2e: $(VENV)/.installed-test e2e-build  ## build the e2e cluster's programs and run tests/e2e on them (K8S_VERSION=1.36|1.37)
	K8S_VERSION=$(K8S_VERSION) $(BIN)/pytest -q -m e2e tests/e2e

lint: $(VENV)/.installed-test
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

verify-pairing: $(VENV)/.installed-test  ## every admission sequence of up to 5 containers, 3 regimes
	$(BIN)/pytest -q -m slow tests/scenarios/test_pairing.py

# Every test marked slow: make verify-pairing's runs, and the full sizes of the properties
# that make test runs quick (fewer hypothesis examples or a smaller world; tests/kit/sizes.py).
test-slow: $(VENV)/.installed-test  ## the full sizes left out of make test (marker slow; verify-pairing included)
	$(BIN)/pytest -q -m slow

# On a GPU machine (root): the driver version, memory, MIG mode, cgroup type and
# dmem.capacity, then the enforcement probe under every memory backend the machine
# supports (interposer; driver on r615+ with cgroup v2). DRY=1: the facts and the plan only.
gpu-proof: $(VENV)/.installed  ## prove the enforcement backends on this GPU machine
	PYTHON=$(BIN)/python scripts/gpu-proof.sh $(if $(DRY),--dry-run)

# On a GPU machine (root), in one call of at most 10 minutes (issue 42, docs/gpu-proof.md):
# make gpu-proof's checks, then the figures users compare GPU sharing on, per backend
# (throughput kept by two tenants at 50 %, isolation under pressure, start costs), into
# $(OUT) (else gpu-bench-out/). Needs no venv and nothing from the network: GPU_PYTHON
# (the machine's python3) with src/ on its path, and the folder make gpu-bench-prepare
# made on the CPU machine (.gpu-bench: libvgpu.so, the memory hook, wheels). DRY=1: the
# facts and the plan only. It changes no GPU setting; MPS daemons it starts it stops.
GPU_PYTHON ?= python3
gpu-bench:  ## issue 42's figures on this GPU machine (DRY=1: the facts and the plan only)
	GPU_PYTHON=$(GPU_PYTHON) scripts/gpu-bench.sh $(if $(DRY),--dry-run)

# On the CPU machine: build what make gpu-bench carries (HAMI_CORE_SRC: a HAMi-core tree or
# a git directory holding the Dockerfile's pinned commit).
gpu-bench-prepare: $(VENV)/.installed-test  ## build .gpu-bench/ (libvgpu.so, memory hook, wheels) for make gpu-bench
	PYTHON=$(BIN)/python scripts/gpu-bench-prepare.sh $(HAMI_CORE_SRC)

# make bench and make simulate write their reports into $(BENCH_OUT) (gitignored);
# UPDATE_DOCS=1 also rewrites their sections of the tracked docs/benchmarks.md.
BENCH_OUT ?= bench-out
UPDATE_DOCS ?=

bench: $(VENV)/.installed-test  ## measure latency, start time and footprint (bench-out/; UPDATE_DOCS=1: docs too)
	$(BIN)/python -m gpushare.bench --out $(BENCH_OUT)/bench.md \
	  $(if $(UPDATE_DOCS),--write docs/benchmarks.md)

SCALE_NODES ?= 100,1000,5000
SCALE_PODS ?= 10000,50000,150000
# SCALE_API: real (kube-apiserver + etcd from e2e/bin, make e2e-build), stand-in, or auto
# (real where the binaries are; the table says which)
SCALE_API ?= auto
scale: $(VENV)/.installed-test  ## the extender at 100/1 000/5 000 nodes and 10k-150k pods (DOCS=1: into docs/benchmarks.md)
	$(BIN)/python -m gpushare.bench.scale --api $(SCALE_API) --nodes $(SCALE_NODES) \
	  --pods $(SCALE_PODS) --out bench-out/scale.md \
	  $(if $(DOCS),--write docs/benchmarks.md)
	$(BIN)/python -m gpushare.bench.writes --out bench-out/writes.md \
	  $(if $(BASELINE_SRC),--baseline-src $(BASELINE_SRC)) $(if $(DOCS),--write docs/benchmarks.md)

churn: $(VENV)/.installed  ## freed room to binding: the churn scenario against the stand-ins
	$(BIN)/python -m gpushare.sim.churn --rounds 8 --legacy

# SIMULATE_ARGS: more options of python -m gpushare.sim.trace, e.g. "--pods 600 --list-delay 0.3"
# (every node's kubelet answers PodResources List 0.3 s late).
SIMULATE_ARGS ?=

simulate: $(VENV)/.installed  ## trace-driven placement simulation (bench-out/; UPDATE_DOCS=1: docs too)
	$(BIN)/python -m gpushare.sim.trace $(SIMULATE_ARGS) --write $(BENCH_OUT)/simulate.md \
	  $(if $(UPDATE_DOCS),--section docs/benchmarks.md)

# The version is written once, in src/gpushare/__init__.py; the image tag follows it.
VERSION   := $(shell sed -n 's/^__version__ = "\(.*\)"$$/\1/p' src/gpushare/__init__.py)
IMAGE     ?= gpushare:$(VERSION)
HAMI_VERSION ?= v2.4.1
# The interposer: published (out of HAMi's image), source (HAMi-core at HAMI_CORE_COMMIT;
# empty: the Dockerfile's pinned commit) or stub (enforces nothing: CI's offline stand-in)
INTERPOSER ?= published
HAMI_CORE_COMMIT ?=
PLATFORMS ?= linux/amd64,linux/arm64
# PUSH=1 pushes the multi-arch image to IMAGE's registry; otherwise buildx writes it as
# the OCI archive dist/gpushare-<version>.oci.tar (a multi-arch image cannot be loaded
# into the classic docker image store).
PUSH      ?=
BUILD_ARGS := --build-arg HAMI_VERSION=$(HAMI_VERSION) --build-arg VERSION=$(VERSION) \
  --build-arg INTERPOSER=$(INTERPOSER) \
  $(if $(HAMI_CORE_COMMIT),--build-arg HAMI_CORE_COMMIT=$(HAMI_CORE_COMMIT))

# make image: docker buildx where a docker engine answers (both platforms); else docker,
# buildah or podman for this machine's architecture, with offline stand-ins (a Debian base
# made by mmdebstrap, the stub interposer, the hook built by the base's gcc) only where the
# published sources cannot be reached (scripts/build_image.py; STANDINS=all: always, as CI
# does; none: never). Root on Debian without a builder: buildah is installed first.
STANDINS ?= auto
IMAGE_SCRIPT = $(PYTHON) scripts/build_image.py --image $(IMAGE) --interposer $(INTERPOSER) \
  --standins $(STANDINS) --hami-version $(HAMI_VERSION) --platforms $(PLATFORMS) \
  $(if $(HAMI_CORE_COMMIT),--hami-core-commit $(HAMI_CORE_COMMIT)) $(if $(PUSH),--push)

image:  ## build the image (docker buildx: linux/amd64 + linux/arm64; else this machine's arch)
	$(IMAGE_SCRIPT) build

image-plan:  ## which builder, platforms and stand-ins make image would use here
	$(IMAGE_SCRIPT) plan

image-check:  ## run the image's programs from the image (daemon, extender, kubectl-gpushare, libvgpu.so, hook, probe)
	$(IMAGE_SCRIPT) check

# A single-platform image as a docker-archive tar: ctr -n k8s.io images import, docker load
image-archive: image  ## build, check, then write dist/gpushare-<version>-<arch>.tar
	$(IMAGE_SCRIPT) check
	$(IMAGE_SCRIPT) archive

image-local:  ## build the image for this machine only and load it into docker
	docker build $(BUILD_ARGS) -t $(IMAGE) .

# Where the krew archive will be published (the manifest names it with its sha256).
PLUGIN_URL ?= https://github.com/gpushare/gpushare/releases/download/v$(VERSION)

kubectl-plugin: $(VENV)/.installed  ## dist/kubectl-gpushare: one file, Python 3.9+, nothing to install; and its krew manifest
	$(BIN)/python scripts/build_kubectl_plugin.py dist/kubectl-gpushare --krew-url $(PLUGIN_URL)

version:  ## print the version (the one source: src/gpushare/__init__.py)
	@echo $(VERSION)

manifests:  ## copy daemonset/*.yaml (and policies/) into the package, for kubectl gpushare install
	rm -f src/gpushare/manifests/*.yaml src/gpushare/manifests/policies/*.yaml
	mkdir -p src/gpushare/manifests/policies
	cp daemonset/*.yaml src/gpushare/manifests/
	cp daemonset/policies/*.yaml src/gpushare/manifests/policies/

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
	rm -rf $(VENV) src/gpushare/_proto build dist src/*.egg-info e2e/bin e2e/logs
