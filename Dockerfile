# syntax=docker/dockerfile:1
# gpushare image: the daemon (and kubectl-gpushare, the extender) plus HAMi-core's
# interposer libvgpu.so, obtained one of three ways (build argument INTERPOSER):
#   published  (default) copied out of HAMi's published image projecthami/hami:HAMI_VERSION
#   source     compiled from HAMi-core at the pinned commit HAMI_CORE_COMMIT with gcc and
#              the CUDA/NVML headers of two PyPI wheels (no CUDA toolkit, no GPU): take a
#              fix before HAMi publishes it (scripts/build-hami-core.sh)
#   stub       (offline stand-in) hook/libvgpu-stub.c: exports the hooks' names and
#              enforces NOTHING; for CI and machines that reach neither HAMi's image nor
#              github.com. Its libvgpu.version and io.gpushare.interposer say "stub".
# Every way, the build checks with nm -D that the library exports the hooks enforcement
# depends on (scripts/check-interposer.sh) and records what it is in
# /opt/gpushare/lib/libvgpu.version and the image's labels (docs/operations.md).
#   make image          docker buildx: linux/amd64 + linux/arm64 (PUSH=1 IMAGE=reg/gpushare:V);
#                       else docker, buildah or podman: this machine's architecture, with
#                       the offline stand-ins below only where a source is out of reach
#                       (scripts/build_image.py, docs/deploy.md#building-the-image)
#   make image-local    this machine's architecture, loaded into docker
#   make image-local INTERPOSER=source HAMI_CORE_COMMIT=<40 hex digits>
#   docker build --build-arg HAMI_VERSION=v2.5.0 --build-arg VERSION=0.1.0 .
# Offline stand-ins, as build arguments (the defaults are the published bases):
#   PYTHON_IMAGE=localhost/gpushare-debian-python:bookworm  a Debian base made locally
#       with mmdebstrap (python3 from Debian) instead of python:*-slim
#   INTERPOSER=stub                                          instead of published/source
#   HOOK_BUILDER=base  the memory hook built with the base's own gcc instead of manylinux2014:
#       it then needs the glibc it was linked against (its .version file says which)
# Base images are pinned by exact tag; pin by digest too (name:tag@sha256:..., via
# --build-arg PYTHON_IMAGE=...) in a release pipeline. Both bases publish amd64 and arm64;
# every stage runs on the target platform (binary wheels for that architecture).
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm
ARG HAMI_VERSION=v2.4.1
ARG INTERPOSER=published
# HAMi-core's main branch on 2026-06-30 (Merge pull request #212).
ARG HAMI_CORE_COMMIT=8f3a89c67b037d8fdfe6c4cd4d8c4f0cd6504811
ARG CUDA_HEADERS_VERSION=12.9.79
ARG VERSION=0.0.0
# The driver memory hook is built against glibc 2.17 (manylinux2014) so that it runs on
# every host it is installed on (it runs on the HOST, by the container runtime).
ARG MANYLINUX_TAG=2026.10.03-1
# manylinux (the default) or base (offline stand-in: the PYTHON_IMAGE's gcc; the hook then
# needs that base's glibc on the host)
ARG HOOK_BUILDER=manylinux
ARG TARGETARCH=amd64

FROM projecthami/hami:${HAMI_VERSION} AS hami

# nm (binutils) and the hook check, for both ways of obtaining the library.
FROM ${PYTHON_IMAGE} AS checker
RUN apt-get update && apt-get install -y --no-install-recommends binutils \
    && rm -rf /var/lib/apt/lists/*
COPY scripts/check-interposer.sh scripts/build-hami-core.sh /usr/local/bin/

# One file out of HAMi's library directory. Older images hold libvgpu.so, newer ones
# libvgpu.so.<version> (sometimes next to a libvgpu.so link): take the highest
# versioned file, else the plain one, resolving links; fail the build if there is none.
FROM checker AS interposer-published
ARG HAMI_VERSION
COPY --from=hami /k8s-vgpu/lib/nvidia/ /hami/
RUN set -eu; cd /hami; \
    lib="$(ls -1 libvgpu.so.* 2>/dev/null | sort -V | tail -n 1 || true)"; \
    if [ -z "$lib" ]; then lib=libvgpu.so; fi; \
    if [ ! -e "$lib" ]; then echo "no libvgpu.so* in /k8s-vgpu/lib/nvidia of the HAMi image" >&2; exit 1; fi; \
    mkdir -p /out; cp -L "$lib" /out/libvgpu.so; chmod 0644 /out/libvgpu.so; \
    check-interposer.sh /out/libvgpu.so; \
    echo "published projecthami/hami:${HAMI_VERSION} /k8s-vgpu/lib/nvidia/$lib sha256:$(sha256sum /out/libvgpu.so | cut -d' ' -f1)" \
        > /out/libvgpu.version; cat /out/libvgpu.version

# gcc for what the image compiles from source on the base (HAMi-core, the stub, and the
# memory hook where it is not built on manylinux).
FROM checker AS compiler
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# HAMi-core from source at a pinned commit: gcc, cmake and the headers of the wheels.
FROM compiler AS interposer-source
ARG HAMI_CORE_COMMIT
ARG CUDA_HEADERS_VERSION
RUN apt-get update && apt-get install -y --no-install-recommends make cmake \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=secret,id=pip-ca,mode=0444,required=false \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    pip install --no-cache-dir --no-deps "nvidia-cuda-runtime-cu12==${CUDA_HEADERS_VERSION}" \
    "nvidia-nvml-dev-cu12==${CUDA_HEADERS_VERSION}"
ADD https://github.com/Project-HAMi/HAMi-core/archive/${HAMI_CORE_COMMIT}.tar.gz /hami-core.tar.gz
RUN set -eu; mkdir /hami-core; tar -xzf /hami-core.tar.gz -C /hami-core --strip-components=1; \
    build-hami-core.sh /hami-core /out/libvgpu.so; \
    echo "source Project-HAMi/HAMi-core@${HAMI_CORE_COMMIT} sha256:$(sha256sum /out/libvgpu.so | cut -d' ' -f1)" \
        > /out/libvgpu.version; cat /out/libvgpu.version

# The offline stand-in: a stub that exports the hooks' names and enforces nothing
# (hook/libvgpu-stub.c), checked like the others, and saying so in its version file.
FROM compiler AS interposer-stub
COPY hook/libvgpu-stub.c /src/libvgpu-stub.c
RUN set -eu; mkdir -p /out; \
    gcc -shared -fPIC -O2 -std=c11 -Wall -Wextra -Werror -o /out/libvgpu.so /src/libvgpu-stub.c; \
    chmod 0644 /out/libvgpu.so; check-interposer.sh /out/libvgpu.so; \
    echo "stub hook/libvgpu-stub.c (a stand-in: exports the hooks' names, ENFORCES NOTHING) sha256:$(sha256sum /out/libvgpu.so | cut -d' ' -f1)" \
        > /out/libvgpu.version; cat /out/libvgpu.version

FROM interposer-${INTERPOSER} AS interposer

# The driver memory hook (hook/memory-hook.c): an OCI createRuntime hook the daemon
# installs on the host beside libvgpu.so for cards whose memory backend is `driver`
# (docs/choosing.md) and, where DRA is served, as the claims' limit check
# (--check-limits, docs/dra.md). Plain C, libc and dlopen only; checked to print its
# usage and to refuse an OCI state without a bundle in its check mode.
# The version file next to it names the builder and the newest glibc symbol version it
# needs on the host (2.17 at most from manylinux2014; the base's glibc with HOOK_BUILDER=base).
FROM quay.io/pypa/manylinux2014_x86_64:${MANYLINUX_TAG} AS hook-builder-manylinux-amd64
FROM quay.io/pypa/manylinux2014_aarch64:${MANYLINUX_TAG} AS hook-builder-manylinux-arm64
FROM hook-builder-manylinux-${TARGETARCH} AS hook-builder-manylinux
FROM compiler AS hook-builder-base
FROM hook-builder-${HOOK_BUILDER} AS memory-hook
ARG HOOK_BUILDER
COPY hook/memory-hook.c /src/memory-hook.c
RUN set -eu; mkdir -p /out; \
    gcc -O2 -std=c11 -Wall -Wextra -Werror -o /out/gpushare-memory-hook /src/memory-hook.c -ldl; \
    if /out/gpushare-memory-hook 2>/tmp/usage; then exit 1; fi; grep -q '^usage:' /tmp/usage; \
    if echo '{}' | /out/gpushare-memory-hook --check-limits 2>/tmp/check; then exit 1; fi; \
    grep -q 'has no "bundle"' /tmp/check; \
    chmod 0755 /out/gpushare-memory-hook; \
    floor="$(objdump -T /out/gpushare-memory-hook | grep -o 'GLIBC_[0-9][0-9.]*' | sort -uV | tail -n 1)"; \
    echo "${HOOK_BUILDER} $(ldd --version | head -n 1) needs ${floor:?no GLIBC symbol versions} sha256:$(sha256sum /out/gpushare-memory-hook | cut -d' ' -f1)" \
        > /out/gpushare-memory-hook.version; cat /out/gpushare-memory-hook.version

# Build as an unprivileged user, into a virtual environment copied whole to the final
# image. Dependencies come as binary wheels; the slim image has no compiler, so a
# dependency that would need one fails here rather than growing the image.
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --create-home --uid 10001 builder && install -d -o builder -g builder /opt/venv
USER builder
WORKDIR /home/builder/src
RUN python -m venv /opt/venv
COPY --chown=builder:builder pyproject.toml setup.py README.md ./
COPY --chown=builder:builder proto ./proto
COPY --chown=builder:builder src ./src
# Behind a TLS-inspecting proxy, the machine's CA bundle comes in as the build secret
# pip-ca (scripts/build_image.py passes the one pip uses there): mounted for pip's steps
# only, in no layer of the image.
RUN --mount=type=secret,id=pip-ca,mode=0444,required=false \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    /opt/venv/bin/pip install . && /opt/venv/bin/pip uninstall -y pip

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gpushare" \
      org.opencontainers.image.description="Kubernetes device plugin sharing NVIDIA GPUs with hard memory limits" \
      org.opencontainers.image.licenses="Apache-2.0"
ARG HAMI_VERSION
ARG INTERPOSER
ARG HAMI_CORE_COMMIT
ARG HOOK_BUILDER
ARG VERSION
LABEL io.gpushare.interposer="${INTERPOSER}" \
      io.gpushare.memory-hook-builder="${HOOK_BUILDER}" \
      io.gpushare.hami-version="${HAMI_VERSION}" \
      io.gpushare.hami-core-commit="${HAMI_CORE_COMMIT}" \
      org.opencontainers.image.version="${VERSION}"
COPY --from=build /opt/venv /opt/venv
# The daemon's default --library path (src/gpushare/config.py).
COPY --from=interposer /out/libvgpu.version /opt/gpushare/lib/libvgpu.version
COPY --from=interposer /out/libvgpu.so /opt/gpushare/lib/libvgpu.so
# The daemon's default --memory-hook path (src/gpushare/config.py).
COPY --from=memory-hook /out/gpushare-memory-hook /opt/gpushare/lib/gpushare-memory-hook
COPY --from=memory-hook /out/gpushare-memory-hook.version /opt/gpushare/lib/gpushare-memory-hook.version
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# Runs as root: the kubelet's sockets are root-owned. The DaemonSet drops every capability.
CMD ["gpushare-device-plugin", "--log-format=json"]
