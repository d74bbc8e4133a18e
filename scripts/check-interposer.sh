#!/bin/sh
# Check that an interposer library (HAMi-core's libvgpu.so) exports the hooks that
# enforcement depends on. A build that exports only dlsym (HAMi-core built as Release,
# whose -fvisibility=hidden hides every hook, or without its *_ENABLE options) loads
# fine and enforces nothing: refuse it.
#   scripts/check-interposer.sh path/to/libvgpu.so
# Used by the image build (Dockerfile, both ways of obtaining the library) and by
# tests/deploy/test_interposer_check.py. Needs nm (binutils). Exit 0: every hook is there.
set -eu
lib="${1:?usage: check-interposer.sh LIBRARY}"
# memory: every way to allocate, and what reports the total; compute: kernel launches;
# cuGetProcAddress: the CUDA runtime (11.3+) finds driver functions through it.
hooks="${GPUSHARE_REQUIRED_HOOKS:-cuInit cuGetProcAddress cuMemAlloc_v2 cuMemAllocManaged \
cuMemAllocPitch_v2 cuMemAllocAsync cuMemCreate cuMemFree_v2 cuMemGetInfo_v2 cuLaunchKernel \
nvmlDeviceGetMemoryInfo}"
if [ ! -f "$lib" ]; then
    echo "check-interposer: $lib: no such file" >&2
    exit 1
fi
exported="$(nm -D --defined-only "$lib" 2>/dev/null | awk 'NF >= 3 { print $3 }' | sed 's/@.*//')" || {
    echo "check-interposer: $lib: nm -D cannot read it (not a shared library?)" >&2
    exit 1
}
missing=""
for hook in $hooks; do
    if ! printf '%s\n' "$exported" | grep -qx "$hook"; then
        missing="$missing $hook"
    fi
done
count="$(printf '%s\n' "$exported" | grep -cE '^(cu|nvml)' || true)"
if [ -n "$missing" ]; then
    echo "check-interposer: $lib exports $count CUDA/NVML functions but not:$missing;" \
        "it would not enforce the limits (a Release build of HAMi-core hides its hooks:" \
        "build it as upstream's build.sh does)" >&2
    exit 1
fi
echo "check-interposer: $lib exports every required hook ($count CUDA/NVML functions)"
