/* A stand-in for the CUDA driver with an interposer's memory limit, for testing the
 * enforcement probe without a GPU (tests/unit/probe/test_checks_standin.py). Not NVIDIA's API beyond
 * the probe's prototypes: allocations are counted against STANDIN_LIMIT bytes, shared by
 * every process that names the same CUDA_DEVICE_MEMORY_SHARED_CACHE file (as HAMi-core
 * shares its accounting). STANDIN_BYPASS_ASYNC=1 lets cuMemAllocAsync past the limit
 * (what some HAMi-core versions do); STANDIN_PER_PROCESS=1 counts each process alone.
 * Kernel launches sleep: 20 ms when throttled (CUDA_DEVICE_SM_LIMIT 1..99 and the policy
 * not "disable"), 0.2 ms otherwise. STANDIN_BURST_SECONDS=S leaves a throttled process's
 * launches unthrottled for its first S seconds after its first launch, as HAMi-core's
 * limiter does while its first bucket of tokens lasts (docs/gpu-proof.md).
 * The driver's per-cgroup limit (r615+): with STANDIN_DRIVER_STORE (the simulated NVML's
 * store, src/gpushare/gpu/memlimits.py), STANDIN_GPU and STANDIN_CGROUP (the namespace
 * this process's cgroup stands for), the limit is the hard limit the store holds for that
 * card and cgroup (STANDIN_LIMIT, the card's memory, where it holds none), and every
 * process of that cgroup is counted together, as the driver counts them; there a context
 * costs STANDIN_CONTEXT_BYTES inside the limit, and managed memory (cuMemAllocManaged) is
 * not counted at all (the driver counts it only in system memory). Elsewhere (an
 * interposer's limit) managed memory is counted like any allocation. */
#include <fcntl.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
enum { OK = 0, OOM = 2, SLOTS = 65536 };
static uint64_t limit, own_used;
static size_t sizes[SLOTS];
static int next_slot;
static int fd = -1;
static int by_driver; /* the limit is the simulated driver's per-cgroup one */
static uint64_t context_bytes; /* what this process's context holds inside the limit */

static int env_is(const char *name, const char *value) {
    const char *v = getenv(name);
    return v && strcmp(v, value) == 0;
}

static uint64_t shared_used(int64_t delta) {
    if (fd < 0 || env_is("STANDIN_PER_PROCESS", "1")) {
        own_used += delta;
        return own_used;
    }
    uint64_t used = 0;
    flock(fd, LOCK_EX);
    if (pread(fd, &used, sizeof used, 0) != sizeof used) used = 0;
    used += delta;
    pwrite(fd, &used, sizeof used, 0);
    flock(fd, LOCK_UN);
    return used;
}

static CUresult take(uint64_t *ptr, size_t n) {
    if (shared_used(0) + n > limit) return OOM;
    shared_used((int64_t)n);
    int slot = next_slot++ % SLOTS;
    sizes[slot] = n;
    *ptr = ((uint64_t)slot + 1) << 20;
    return OK;
}

static void give(uint64_t ptr) {
    int slot = (int)(ptr >> 20) - 1;
    if (slot >= 0 && slot < SLOTS && sizes[slot]) {
        shared_used(-(int64_t)sizes[slot]);
        sizes[slot] = 0;
    }
}

static uint64_t fnv1a(const char *text) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (; *text; text++) { h ^= (unsigned char)*text; h *= 0x100000001b3ULL; }
    return h;
}

/* The hard limit the simulated driver holds for this card and cgroup (0: none), and the
 * cgroup's shared accounting file opened into fd. */
static uint64_t driver_limit(const char *store, const char *gpu, const char *cgroup) {
    char path[4096], text[4096];
    unsigned long long soft = 0, hard = 0;
    uint64_t h = fnv1a(cgroup);
    snprintf(path, sizeof path, "%s/used.%s.%016llx", store, gpu, (unsigned long long)h);
    fd = open(path, O_RDWR | O_CREAT, 0600);
    snprintf(path, sizeof path, "%s/limits/%s.%016llx", store, gpu, (unsigned long long)h);
    int in = open(path, O_RDONLY);
    if (in < 0) return 0;
    ssize_t n = read(in, text, sizeof text - 1);
    close(in);
    if (n <= 0) return 0;
    text[n] = 0;
    char *nl = strchr(text, '\n');
    if (!nl) return 0;
    *nl = 0;
    if (strcmp(text, cgroup) != 0) return 0;
    if (sscanf(nl + 1, "%llu %llu", &soft, &hard) != 2) return 0;
    return hard;
}

CUresult cuInit(unsigned int flags) {
    const char *l = getenv("STANDIN_LIMIT");
    const char *cache = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    const char *store = getenv("STANDIN_DRIVER_STORE");
    limit = l ? strtoull(l, 0, 10) : 0;
    if (store && getenv("STANDIN_GPU") && getenv("STANDIN_CGROUP")) {
        uint64_t hard = driver_limit(store, getenv("STANDIN_GPU"), getenv("STANDIN_CGROUP"));
        if (hard) limit = hard;
        by_driver = 1;
    } else if (cache) {
        fd = open(cache, O_RDWR | O_CREAT, 0600);
    }
    (void)flags;
    return OK;
}
CUresult cuDriverGetVersion(int *v) { *v = 12040; return OK; }
CUresult cuDeviceGet(int *d, int ordinal) { *d = ordinal; return OK; }
CUresult cuDeviceGetCount(int *c) { *c = 1; return OK; }
CUresult cuGetErrorName(CUresult e, const char **s) {
    *s = e == OOM ? "CUDA_ERROR_OUT_OF_MEMORY" : e == 801 ? "CUDA_ERROR_NOT_SUPPORTED"
                                                           : "CUDA_ERROR_UNKNOWN";
    return OK;
}
CUresult cuCtxCreate_v2(void **ctx, unsigned int flags, int dev) {
    const char *cost = getenv("STANDIN_CONTEXT_BYTES");
    *ctx = (void *)1; (void)flags; (void)dev;
    if (by_driver && cost && !context_bytes) {
        if (shared_used(0) + strtoull(cost, 0, 10) > limit) return OOM;
        context_bytes = strtoull(cost, 0, 10);
        shared_used((int64_t)context_bytes);
    }
    return OK;
}
CUresult cuCtxDestroy_v2(void *ctx) {
    (void)ctx;
    if (context_bytes) shared_used(-(int64_t)context_bytes), context_bytes = 0;
    return OK;
}
CUresult cuCtxSynchronize(void) { return OK; }
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    uint64_t used = shared_used(0);
    *total = limit;
    *free_bytes = used < limit ? limit - used : 0;
    return OK;
}
CUresult cuMemAlloc_v2(uint64_t *ptr, size_t n) { return take(ptr, n); }
CUresult cuMemFree_v2(uint64_t ptr) { give(ptr); return OK; }
CUresult cuStreamCreate(void **s, unsigned int flags) { *s = (void *)1; (void)flags; return OK; }
CUresult cuStreamSynchronize(void *s) { (void)s; return OK; }
CUresult cuStreamDestroy_v2(void *s) { (void)s; return OK; }
CUresult cuMemAllocAsync(uint64_t *ptr, size_t n, void *s) {
    (void)s;
    if (env_is("STANDIN_BYPASS_ASYNC", "1")) { *ptr = 1; return OK; }
    return take(ptr, n);
}
CUresult cuMemFreeAsync(uint64_t ptr, void *s) { (void)s; give(ptr); return OK; }
CUresult cuMemAllocManaged(uint64_t *ptr, size_t n, unsigned int flags) {
    (void)flags;
    if (by_driver) { *ptr = 1; return OK; } /* system memory only: not against the limit */
    return take(ptr, n);
}
CUresult cuMemGetAllocationGranularity(size_t *g, const void *prop, int option) {
    *g = 2 << 20; (void)prop; (void)option; return OK;
}
CUresult cuMemCreate(unsigned long long *h, size_t n, const void *prop, unsigned long long f) {
    uint64_t ptr;
    (void)prop; (void)f;
    CUresult r = take(&ptr, n);
    if (r == OK) *h = ptr;
    return r;
}
CUresult cuMemRelease(unsigned long long h) { give(h); return OK; }
CUresult cuModuleLoadData(void **m, const void *image) { *m = (void *)1; (void)image; return OK; }
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
    *f = (void *)1; (void)m; (void)name; return OK;
}
CUresult cuModuleUnload(void *m) { (void)m; return OK; }
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared, void *s, void **params,
                        void **extra) {
    const char *sm = getenv("CUDA_DEVICE_SM_LIMIT");
    int limit_pct = sm ? atoi(sm) : 0;
    int throttled = limit_pct > 0 && limit_pct < 100 &&
                    !env_is("GPU_CORE_UTILIZATION_POLICY", "disable");
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared;
    (void)s; (void)params; (void)extra;
    static double first = -1.0;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    double t = (double)now.tv_sec + (double)now.tv_nsec / 1e9;
    if (first < 0) first = t;
    const char *burst = getenv("STANDIN_BURST_SECONDS");
    if (throttled && burst && t - first < atof(burst)) throttled = 0;
    usleep(throttled ? 20000 : 200); /* 100x apart: a loaded machine stretches the short one */
    return OK;
}
