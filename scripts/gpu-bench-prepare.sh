#!/bin/sh
# Prepare make gpu-bench's folder on the CPU machine: the GPU machine reaches nothing, so
# what it needs beyond the repository travels in one folder (the device tool's `carry`).
#
#   scripts/gpu-bench-prepare.sh [HAMI_CORE_SOURCE]
#
# HAMI_CORE_SOURCE: a HAMi-core source tree, or a git directory that holds
# HAMI_CORE_COMMIT (default: the Dockerfile's pinned commit), such as a mirror of
# github.com/Project-HAMi/HAMi-core (a clone). Default: $HAMI_CORE_SRC. Without a source
# the interposer is left out, and make gpu-bench reports it absent.
#
# Writes PREPARED (default .gpu-bench, added to the repository's .git/info/exclude so it
# is never committed):
#   libvgpu.so              scripts/build-hami-core.sh's build (gcc, cmake, the CUDA/NVML
#                           headers of the test extra's wheels), its hooks checked
#   gpushare-memory-hook    hook/memory-hook.c, gcc -O2
#   wheels/                 structlog and nvidia-ml-py for CPython 3.12 x86-64 (pip
#                           download; GPU_BENCH_NO_WHEELS=1 skips it)
#   PREPARED.txt            what was built from what (commit, sha256 of each file)
# PYTHON (default .venv/bin/python where it exists, else python3) finds the headers.
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
out="${PREPARED:-$root/.gpu-bench}"
py="${PYTHON:-}"
[ -n "$py" ] || { [ -x "$root/.venv/bin/python" ] && py="$root/.venv/bin/python" || py=python3; }
commit="${HAMI_CORE_COMMIT:-$(sed -n 's/^ARG HAMI_CORE_COMMIT=\([0-9a-f]\{40\}\)$/\1/p' "$root/Dockerfile" | head -n 1)}"
src="${1:-${HAMI_CORE_SRC:-}}"
mkdir -p "$out"
exclude="$(git -C "$root" rev-parse --git-common-dir 2>/dev/null || true)"
if [ -n "$exclude" ]; then
    case "$exclude" in /*) ;; *) exclude="$root/$exclude" ;; esac
    name="/$(basename "$out")/"
    grep -qxF "$name" "$exclude/info/exclude" 2>/dev/null || echo "$name" >> "$exclude/info/exclude"
fi
: > "$out/PREPARED.txt"
note() { echo "$*"; echo "$*" >> "$out/PREPARED.txt"; }
note "prepared $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"

# the interposer
if [ -z "$src" ]; then
    note "libvgpu.so: NOT BUILT (no HAMi-core source: pass a tree or a git directory holding $commit)"
else
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    if [ -f "$src/CMakeLists.txt" ]; then
        tree="$src"; from="the tree $src"
    else
        git --git-dir="$src" archive --format=tar "$commit" | tar -x -C "$work"
        tree="$work"; from="Project-HAMi/HAMi-core@$commit (from $src)"
    fi
    include_of() {
        "$py" -c "import importlib, pathlib; m = importlib.import_module('nvidia.$1'); \
print(next(str(pathlib.Path(p) / 'include') for p in m.__path__))"
    }
    CUDA_INCLUDE="${CUDA_INCLUDE:-$(include_of cuda_runtime)}" \
    NVML_INCLUDE="${NVML_INCLUDE:-$(include_of nvml_dev)}" \
        "$here/build-hami-core.sh" "$tree" "$out/libvgpu.so"
    note "libvgpu.so: built from $from, sha256 $(sha256sum "$out/libvgpu.so" | cut -d' ' -f1)"
fi

# the memory hook
gcc -O2 -Wall -Wextra -o "$out/gpushare-memory-hook" "$root/hook/memory-hook.c" -ldl
note "gpushare-memory-hook: hook/memory-hook.c, sha256 $(sha256sum "$out/gpushare-memory-hook" | cut -d' ' -f1)"

# the Python packages the GPU machine's image may lack
if [ "${GPU_BENCH_NO_WHEELS:-}" != 1 ]; then
    mkdir -p "$out/wheels"
    for package in structlog nvidia-ml-py; do
        version="$("$py" -m pip show "$package" 2>/dev/null | sed -n 's/^Version: //p')"
        "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux2014_x86_64 -d "$out/wheels" \
            "$package${version:+==$version}"
    done
    note "wheels: $(ls "$out/wheels" | tr '\n' ' ')"
fi
note "size: $(du -sh "$out" | cut -f1) (the device call carries at most 64 MiB with the tree)"
