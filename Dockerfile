# syntax=docker/dockerfile:1
# gpushare image: the daemon (and kubectl-gpushare, the extender) plus HAMi-core's
# interposer libvgpu.so, taken from HAMi's published image (HAMi-core is not built here).
#   make image          linux/amd64 + linux/arm64 with docker buildx (PUSH=1 IMAGE=reg/gpushare:V)
#   make image-local    this machine's architecture, loaded into docker
#   docker build --build-arg HAMI_VERSION=v2.5.0 --build-arg VERSION=0.1.0 .
# Base images are pinned by exact tag; pin by digest too (name:tag@sha256:..., via
# --build-arg PYTHON_IMAGE=...) in a release pipeline. Both bases publish amd64 and arm64;
# every stage runs on the target platform (binary wheels for that architecture).
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm
ARG HAMI_VERSION=v2.4.1
ARG VERSION=0.0.0

FROM projecthami/hami:${HAMI_VERSION} AS hami

# One file out of HAMi's library directory. Older images hold libvgpu.so, newer ones
# libvgpu.so.<version> (sometimes next to a libvgpu.so link): take the highest
# versioned file, else the plain one, resolving links; fail the build if there is none.
FROM ${PYTHON_IMAGE} AS interposer
COPY --from=hami /k8s-vgpu/lib/nvidia/ /hami/
RUN set -eu; cd /hami; \
    lib="$(ls -1 libvgpu.so.* 2>/dev/null | sort -V | tail -n 1 || true)"; \
    if [ -z "$lib" ]; then lib=libvgpu.so; fi; \
    if [ ! -e "$lib" ]; then echo "no libvgpu.so* in /k8s-vgpu/lib/nvidia of the HAMi image" >&2; exit 1; fi; \
    mkdir -p /out; cp -L "$lib" /out/libvgpu.so; chmod 0644 /out/libvgpu.so; \
    echo "interposer: $lib"

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
RUN /opt/venv/bin/pip install . && /opt/venv/bin/pip uninstall -y pip

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gpushare" \
      org.opencontainers.image.description="Kubernetes device plugin sharing NVIDIA GPUs with hard memory limits" \
      org.opencontainers.image.licenses="Apache-2.0"
ARG HAMI_VERSION
ARG VERSION
LABEL io.gpushare.hami-version="${HAMI_VERSION}" \
      org.opencontainers.image.version="${VERSION}"
COPY --from=build /opt/venv /opt/venv
# The daemon's default --library path (src/gpushare/config.py).
COPY --from=interposer /out/libvgpu.so /opt/gpushare/lib/libvgpu.so
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# Runs as root: the kubelet's sockets are root-owned. The DaemonSet drops every capability.
CMD ["gpushare-device-plugin", "--log-format=json"]
