/* A stand-in for NVML's per-cgroup memory-limit calls (driver r615+), for testing the
 * memory hook (hook/memory-hook.c) and the daemon's self-test without a GPU. Its state
 * is a directory shared with the Python simulation (src/gpushare/gpu/memlimits.py), named
 * by GPUSHARE_NVML_STORE:
 *   cards/<uuid>           a card; its text: ok | broken (a set is not kept) |
 *                          unsupported (a set answers NOT_SUPPORTED) | dmem (a set needs
 *                          every level above the cgroup to enable +dmem in its
 *                          cgroup.subtree_control, else NOT_FOUND) | gone (a set answers
 *                          OPERATING_SYSTEM)
 *   memory/<uuid>          the card's total memory in bytes (nvmlDeviceGetMemoryInfo; a
 *                          hard limit above it is INVALID_ARGUMENT); absent: not known
 *   limits/<uuid>.<fnv>    one limit: "<namespace>\n<soft> <hard>\n"; <fnv> is the
 *                          64-bit FNV-1a of the namespace, in 16 hex digits
 *   driver_version         what nvmlSystemGetDriverVersion answers
 * A set needs the namespace to be an existing directory; soft 0 with hard UINT64_MAX
 * clears; a get with no limit answers NOT_SUPPORTED, as the driver does. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct { const char *nameSpace; unsigned long long softLimit, hardLimit; } set_t;
typedef struct {
    const char *nameSpace;
    unsigned long long softLimit, hardLimit, currentUsed;
} get_t;
enum { OK = 0, UNINIT = 1, INVALID = 2, NOT_SUPPORTED = 3, NOT_FOUND = 6, NOT_LOADED = 9,
       OPERATING_SYSTEM = 17, UNKNOWN = 999 };
typedef struct { unsigned long long total, free, used; } memory_t;

static char store[2048];
static char uuids[64][96];
static int n_uuids;

nvmlReturn_t nvmlInit_v2(void) {
    const char *s = getenv("GPUSHARE_NVML_STORE");
    if (!s || !*s || strlen(s) >= sizeof store) return NOT_LOADED;
    strcpy(store, s);
    return OK;
}
nvmlReturn_t nvmlShutdown(void) { return OK; }
const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case OK: return "Success";
    case INVALID: return "Invalid Argument";
    case NOT_SUPPORTED: return "Not Supported";
    case NOT_FOUND: return "Not Found";
    case NOT_LOADED: return "Driver Not Loaded";
    case OPERATING_SYSTEM: return "Operating System Error";
    default: return "Unknown Error";
    }
}

static int read_text(const char *path, char *buf, size_t size) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, size - 1, f);
    fclose(f);
    buf[n] = 0;
    return 0;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    char path[2200], text[96];
    if (!*store) return UNINIT;
    snprintf(path, sizeof path, "%s/driver_version", store);
    if (read_text(path, text, sizeof text)) strcpy(text, "550.54.15");
    text[strcspn(text, "\n")] = 0;
    if (strlen(text) + 1 > length) return 7;
    strcpy(version, text);
    return OK;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    char path[2300];
    struct stat st;
    if (!*store) return UNINIT;
    if (strlen(uuid) >= sizeof uuids[0] || strchr(uuid, '/')) return INVALID;
    snprintf(path, sizeof path, "%s/cards/%s", store, uuid);
    if (stat(path, &st)) return NOT_FOUND;
    for (int i = 0; i < n_uuids; i++)
        if (!strcmp(uuids[i], uuid)) { *device = (nvmlDevice_t)(intptr_t)(i + 1); return OK; }
    if (n_uuids == 64) return UNKNOWN;
    strcpy(uuids[n_uuids++], uuid);
    *device = (nvmlDevice_t)(intptr_t)n_uuids;
    return OK;
}

static const char *uuid_of(nvmlDevice_t d) {
    intptr_t i = (intptr_t)d;
    return i >= 1 && i <= n_uuids ? uuids[i - 1] : NULL;
}

static void mode_of(const char *uuid, char *mode, size_t size) {
    char path[2300];
    snprintf(path, sizeof path, "%s/cards/%s", store, uuid);
    if (read_text(path, mode, size)) mode[0] = 0;
    mode[strcspn(mode, "\n ")] = 0;
}

static uint64_t fnv1a(const char *s) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (; *s; s++) { h ^= (unsigned char)*s; h *= 0x100000001b3ULL; }
    return h;
}

static void limit_path(char *path, size_t size, const char *uuid, const char *ns) {
    snprintf(path, size, "%s/limits/%s.%016llx", store, uuid, (unsigned long long)fnv1a(ns));
}

/* The card's total (memory/<uuid>); 0 where not published. */
static unsigned long long total_of(const char *uuid) {
    char path[2300], text[64];
    snprintf(path, sizeof path, "%s/memory/%s", store, uuid);
    if (read_text(path, text, sizeof text)) return 0;
    return strtoull(text, 0, 10);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, memory_t *memory) {
    const char *uuid = uuid_of(device);
    if (!uuid || !memory) return INVALID;
    unsigned long long total = total_of(uuid);
    if (!total) return NOT_SUPPORTED;
    memory->total = memory->free = total;
    memory->used = 0;
    return OK;
}

static int has_word(const char *path, const char *word) {
    char text[512];
    if (read_text(path, text, sizeof text)) return 0;
    for (char *t = strtok(text, " \n"); t; t = strtok(NULL, " \n"))
        if (!strcmp(t, word)) return 1;
    return 0;
}

/* Whether a level above ``ns`` (its parent up to the cgroup root: the last directory with
 * cgroup.controllers whose parent has none) does not enable dmem: as
 * gpushare.gpu.memlimits.dmem_chain_broken reads it. */
static int dmem_chain_broken(const char *ns) {
    char level[2048], probe[2200], up[2048];
    struct stat st;
    if (strlen(ns) >= sizeof level) return 1;
    strcpy(level, ns);
    for (;;) {
        char *slash = strrchr(level, '/');
        if (!slash) return 1;
        if (slash == level) slash[1] = 0; else *slash = 0; /* the parent */
        snprintf(probe, sizeof probe, "%s/cgroup.subtree_control", level);
        if (!has_word(probe, "dmem")) return 1;
        if (!strcmp(level, "/")) return 0;
        strcpy(up, level);
        char *s2 = strrchr(up, '/');
        if (s2 == up) s2[1] = 0; else *s2 = 0;
        snprintf(probe, sizeof probe, "%s/cgroup.controllers", level);
        int here = !stat(probe, &st);
        snprintf(probe, sizeof probe, "%s/cgroup.controllers", up);
        if (here && stat(probe, &st)) return 0; /* the root */
    }
}

nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, set_t *limits) {
    const char *uuid = uuid_of(device);
    char mode[32], path[2400], tmp[2500], dir[2200];
    struct stat st;
    if (!uuid || !limits || !limits->nameSpace) return INVALID;
    mode_of(uuid, mode, sizeof mode);
    if (!strcmp(mode, "gone")) return OPERATING_SYSTEM;
    if (stat(limits->nameSpace, &st) || !S_ISDIR(st.st_mode)) return OPERATING_SYSTEM;
    if (!strcmp(mode, "unsupported")) return NOT_SUPPORTED;
    if (!strcmp(mode, "dmem") && dmem_chain_broken(limits->nameSpace)) return NOT_FOUND;
    if (!strcmp(mode, "broken")) return OK; /* claims success, keeps nothing */
    limit_path(path, sizeof path, uuid, limits->nameSpace);
    if (limits->softLimit == 0 && limits->hardLimit == UINT64_MAX) {
        unlink(path);
        return OK;
    }
    unsigned long long total = total_of(uuid);
    if (limits->softLimit > limits->hardLimit) return INVALID;
    if (total && limits->hardLimit > total) return INVALID;
    snprintf(dir, sizeof dir, "%s/limits", store);
    mkdir(dir, 0755);
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return UNKNOWN;
    fprintf(f, "%s\n%llu %llu\n", limits->nameSpace, limits->softLimit, limits->hardLimit);
    if (fclose(f) || rename(tmp, path)) { unlink(tmp); return UNKNOWN; }
    return OK;
}

nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, get_t *limits) {
    const char *uuid = uuid_of(device);
    char path[2400], text[4400];
    if (!uuid || !limits || !limits->nameSpace) return INVALID;
    limit_path(path, sizeof path, uuid, limits->nameSpace);
    if (read_text(path, text, sizeof text)) return NOT_SUPPORTED;
    char *nl = strchr(text, '\n');
    if (!nl) return UNKNOWN;
    *nl = 0;
    if (strcmp(text, limits->nameSpace)) return NOT_SUPPORTED; /* a hash collision */
    if (sscanf(nl + 1, "%llu %llu", &limits->softLimit, &limits->hardLimit) != 2) return UNKNOWN;
    limits->currentUsed = 0;
    return OK;
}
