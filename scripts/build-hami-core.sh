#!/bin/sh
# Build HAMi-core's libvgpu.so from a source tree with gcc, cmake and the CUDA/NVML
# headers of the PyPI wheels nvidia-cuda-runtime-cu12 and nvidia-nvml-dev-cu12 (no CUDA
# toolkit, no nvcc, no GPU), then check its exported hooks.
#   scripts/build-hami-core.sh SOURCE_DIR OUTPUT_FILE
# CUDA_INCLUDE and NVML_INCLUDE name the header directories; by default they are found
# in the python3 environment's nvidia.cuda_runtime and nvidia.nvml_dev packages.
# Used by the Dockerfile (INTERPOSER=source) and by tests/deploy/test_interposer_check.py.
set -eu
src="${1:?usage: build-hami-core.sh SOURCE_DIR OUTPUT_FILE}"
out="${2:?usage: build-hami-core.sh SOURCE_DIR OUTPUT_FILE}"
here="$(cd "$(dirname "$0")" && pwd)"
include_of() {
    python3 -c "import importlib, pathlib; m = importlib.import_module('nvidia.$1'); \
print(next(str(pathlib.Path(p) / 'include') for p in m.__path__))"
}
cuda_include="${CUDA_INCLUDE:-$(include_of cuda_runtime)}"
nvml_include="${NVML_INCLUDE:-$(include_of nvml_dev)}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# CUDA_HOME as HAMi-core's CMakeLists expects it: include/ with cuda.h and nvml.h
mkdir -p "$work/cuda/include" "$work/stubs" "$work/build"
cp -r "$cuda_include"/. "$work/cuda/include/"
cp "$nvml_include/nvml.h" "$work/cuda/include/"
# It links -lcuda -lnvidia-ml; the driver provides them in the container at run time:
# empty stand-ins with the drivers' sonames satisfy the linker.
: > "$work/stubs/empty.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$work/stubs/libcuda.so" "$work/stubs/empty.c"
gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -o "$work/stubs/libnvidia-ml.so" "$work/stubs/empty.c"
cp -r "$src" "$work/src"
# test/ needs the CUDA toolkit (find_package(CUDA)); the library does not
sed -i 's/^add_subdirectory(test)/# add_subdirectory(test)/' "$work/src/CMakeLists.txt"
# The options of upstream's build.sh, and its Debug build type: a Release build adds
# -fvisibility=hidden and then exports dlsym alone (check-interposer.sh refuses that).
cd "$work/build"
CUDA_HOME="$work/cuda" LIBRARY_PATH="$work/stubs" cmake "$work/src" \
    -DDLSYM_HOOK_ENABLE=1 -DMULTIPROCESS_LIMIT_ENABLE=1 -DHOOK_MEMINFO_ENABLE=1 \
    -DHOOK_NVML_ENABLE=1 -DCMAKE_BUILD_TYPE=Debug >cmake.log 2>&1 || { tail -20 cmake.log >&2; exit 1; }
LIBRARY_PATH="$work/stubs" make -j"$(nproc)" vgpu >make.log 2>&1 || { tail -30 make.log >&2; exit 1; }
strip --strip-debug libvgpu.so  # the debug information only; the dynamic symbols stay
mkdir -p "$(dirname "$out")"
cp libvgpu.so "$out"
chmod 0644 "$out"
"$here/check-interposer.sh" "$out"
