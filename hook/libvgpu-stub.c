/* A STUB of HAMi-core's interposer libvgpu.so, for building the image where HAMi's
 * published image and HAMi-core's source cannot be reached (CI, offline machines:
 * `make image` picks it only then, scripts/build_image.py). It exports the names of the
 * hooks scripts/check-interposer.sh requires, so the image's checks, the daemon's copy to
 * the host and every container's LD_PRELOAD work as with the real library, and it
 * ENFORCES NOTHING. It fails closed rather than pretending: every hook answers "not
 * supported" (CUDA_ERROR_NOT_SUPPORTED, NVML_ERROR_NOT_SUPPORTED), so a CUDA program
 * that loads it stops at cuInit instead of running without its limits. The image's
 * /opt/gpushare/lib/libvgpu.version says "stub", and the label io.gpushare.interposer. */

#define CUDA_ERROR_NOT_SUPPORTED 801
#define NVML_ERROR_NOT_SUPPORTED 3

/* Found with `strings` or `nm -D`: what this library is. */
const char gpushare_stub_interposer[] =
    "gpushare stub interposer: exports HAMi-core's hook names, enforces nothing";

#define CUDA_HOOK(name) int name(void) { return CUDA_ERROR_NOT_SUPPORTED; }
#define NVML_HOOK(name) int name(void) { return NVML_ERROR_NOT_SUPPORTED; }

CUDA_HOOK(cuInit)
CUDA_HOOK(cuGetProcAddress)
CUDA_HOOK(cuGetProcAddress_v2)
CUDA_HOOK(cuMemAlloc_v2)
CUDA_HOOK(cuMemAllocManaged)
CUDA_HOOK(cuMemAllocPitch_v2)
CUDA_HOOK(cuMemAllocAsync)
CUDA_HOOK(cuMemCreate)
CUDA_HOOK(cuMemFree_v2)
CUDA_HOOK(cuMemGetInfo_v2)
CUDA_HOOK(cuLaunchKernel)
NVML_HOOK(nvmlInit_v2)
NVML_HOOK(nvmlDeviceGetMemoryInfo)
NVML_HOOK(nvmlDeviceGetMemoryInfo_v2)
