/* gpushare-memory-hook: an OCI createRuntime hook that sets the driver's hard GPU-memory
 * limit (NVIDIA r615+, nvmlDeviceSetMemoryLimits_v1) on the container's own cgroup v2
 * directory before the workload runs. The daemon installs it on the host beside
 * libvgpu.so and names it, with the card and the limit as ARGUMENTS, in the CDI spec of
 * each grant on a card whose memory backend is `driver` (docs/choosing.md). Nothing comes
 * from the environment: the tenant writes its pod's env.
 *
 *   gpushare-memory-hook --gpu GPU-<uuid> --limit-mib N
 *       [--nvml-lib PATH] [--cgroup-root DIR] [--proc-root DIR]
 *
 * stdin: the OCI state (JSON, at most 64 KiB) with the container's init `pid`. Its cgroup
 * is the `0::` line of /proc/<pid>/cgroup; the path is refused if it is the root, holds
 * `.`/`..` or empty components, or if any component under the cgroup root is a symlink
 * or not a directory. Then: soft 0, hard N MiB, read back with
 * nvmlDeviceGetMemoryLimits_v1. Any failure: exit 1 with one line on stderr, and the
 * runtime does not create the container (fail closed). It writes nothing itself: the
 * only change it makes is the limit, through NVML. It gives up after 10 s (SIGALRM).
 *
 * The NVML structures (no version field; x86-64 sizes 24 and 32 bytes), as NVIDIA's
 * nvml.h of CUDA 13.4 (cuda-nvml-dev-13-4) declares them; read through the search tool in
 * go-nvml's nvml.h as copied into a public mock header, and in a public project quoting
 * the header from the cuda-nvml-dev-13-4_13.4.92 package. Check against the driver's own
 * nvml.h before relying on it: `make gpu-proof` does, on a GPU. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

typedef struct {
    const char *nameSpace;        /* full path of the cgroup directory */
    unsigned long long softLimit; /* bytes */
    unsigned long long hardLimit; /* bytes */
} nvmlSetMemoryLimits_v1_t;

typedef struct {
    const char *nameSpace;
    unsigned long long softLimit;
    unsigned long long hardLimit;
    unsigned long long currentUsed;
} nvmlGetMemoryLimits_v1_t;

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;

enum { STATE_MAX = 64 << 10, CGROUP_FILE_MAX = 16 << 10, DEPTH_MAX = 32, TIMEOUT_S = 10 };
#define CGROUP2_SUPER_MAGIC 0x63677270
#define DEFAULT_CGROUP_ROOT "/sys/fs/cgroup"

static void fail(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
#include <stdarg.h>
static void fail(const char *fmt, ...) {
    va_list ap;
    fputs("gpushare-memory-hook: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

/* ------------------------------------------------------------------ the OCI state */

struct scan {
    const char *p, *end;
    long pid;   /* -1: not seen */
    int pids;   /* how many top-level "pid" keys */
};

static void ws(struct scan *s) {
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
        s->p++;
}

/* A JSON string; returns 0 on success and the raw (still escaped) body in *b, *n. */
static int string(struct scan *s, const char **b, size_t *n) {
    if (s->p >= s->end || *s->p != '"') return -1;
    const char *start = ++s->p;
    while (s->p < s->end) {
        unsigned char c = (unsigned char)*s->p;
        if (c == '"') {
            *b = start;
            *n = (size_t)(s->p - start);
            s->p++;
            return 0;
        }
        if (c < 0x20) return -1;
        if (c == '\\') {
            s->p++;
            if (s->p >= s->end) return -1;
            if (*s->p == 'u') {
                for (int i = 0; i < 4; i++) {
                    s->p++;
                    if (s->p >= s->end || !strchr("0123456789abcdefABCDEF", *s->p)) return -1;
                }
            } else if (!strchr("\"\\/bfnrt", *s->p)) {
                return -1;
            }
        }
        s->p++;
    }
    return -1;
}

static int number(struct scan *s, long *out) {
    const char *start = s->p;
    int integer = 1, digits = 0;
    if (s->p < s->end && *s->p == '-') s->p++;
    while (s->p < s->end && *s->p >= '0' && *s->p <= '9') s->p++, digits++;
    if (!digits) return -1;
    if (s->p < s->end && *s->p == '.') {
        integer = 0;
        s->p++;
        if (s->p >= s->end || *s->p < '0' || *s->p > '9') return -1;
        while (s->p < s->end && *s->p >= '0' && *s->p <= '9') s->p++;
    }
    if (s->p < s->end && (*s->p == 'e' || *s->p == 'E')) {
        integer = 0;
        s->p++;
        if (s->p < s->end && (*s->p == '+' || *s->p == '-')) s->p++;
        if (s->p >= s->end || *s->p < '0' || *s->p > '9') return -1;
        while (s->p < s->end && *s->p >= '0' && *s->p <= '9') s->p++;
    }
    if (out) {
        *out = -1;
        if (integer && *start != '-' && digits <= 9) {
            long v = 0;
            for (const char *q = start; q < s->p; q++) v = v * 10 + (*q - '0');
            *out = v;
        }
    }
    return 0;
}

static int value(struct scan *s, int depth, long *num);

static int object(struct scan *s, int depth) {
    s->p++; /* { */
    ws(s);
    if (s->p < s->end && *s->p == '}') return s->p++, 0;
    for (;;) {
        const char *key;
        size_t n;
        ws(s);
        if (string(s, &key, &n)) return -1;
        ws(s);
        if (s->p >= s->end || *s->p != ':') return -1;
        s->p++;
        ws(s);
        int is_pid = depth == 1 && n == 3 && memcmp(key, "pid", 3) == 0;
        long num = -2;
        if (value(s, depth, is_pid ? &num : NULL)) return -1;
        if (is_pid) {
            s->pids++;
            s->pid = num;
        }
        ws(s);
        if (s->p < s->end && *s->p == ',') { s->p++; continue; }
        if (s->p < s->end && *s->p == '}') return s->p++, 0;
        return -1;
    }
}

static int array(struct scan *s, int depth) {
    s->p++; /* [ */
    ws(s);
    if (s->p < s->end && *s->p == ']') return s->p++, 0;
    for (;;) {
        ws(s);
        if (value(s, depth, NULL)) return -1;
        ws(s);
        if (s->p < s->end && *s->p == ',') { s->p++; continue; }
        if (s->p < s->end && *s->p == ']') return s->p++, 0;
        return -1;
    }
}

static int literal(struct scan *s, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(s->end - s->p) < n || memcmp(s->p, word, n)) return -1;
    s->p += n;
    return 0;
}

/* num: where the value of a top-level "pid" goes (-2: not a number, -1: not a small
 * non-negative integer). */
static int value(struct scan *s, int depth, long *num) {
    if (depth >= DEPTH_MAX) return -1;
    if (s->p >= s->end) return -1;
    switch (*s->p) {
    case '{': return object(s, depth + 1);
    case '[': return array(s, depth + 1);
    case '"': { const char *b; size_t n; return string(s, &b, &n); }
    case 't': return literal(s, "true");
    case 'f': return literal(s, "false");
    case 'n': return literal(s, "null");
    default: return number(s, num);
    }
}

static long state_pid(void) {
    static char buf[STATE_MAX + 1];
    size_t got = 0;
    for (;;) {
        ssize_t r = read(0, buf + got, sizeof buf - got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) fail("cannot read the OCI state on stdin: %s", strerror(errno));
        if (r == 0) break;
        got += (size_t)r;
        if (got > STATE_MAX) fail("the OCI state on stdin is larger than %d bytes", STATE_MAX);
    }
    struct scan s = {buf, buf + got, -1, 0};
    ws(&s);
    if (s.p >= s.end || *s.p != '{') fail("the OCI state on stdin is not a JSON object");
    if (value(&s, 0, NULL)) fail("the OCI state on stdin is not valid JSON");
    ws(&s);
    if (s.p != s.end) fail("the OCI state on stdin has data after its JSON object");
    if (s.pids != 1) fail("the OCI state has %s \"pid\"", s.pids ? "more than one" : "no");
    if (s.pid <= 0 || s.pid > 4194304) fail("the OCI state's pid is not a process id");
    return s.pid;
}

/* ------------------------------------------------------------------ the cgroup */

/* The `0::` path of /proc/<pid>/cgroup, checked; returned in a static buffer. */
static const char *cgroup_of(const char *proc_root, long pid) {
    static char buf[CGROUP_FILE_MAX + 1];
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%ld/cgroup", proc_root, pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        if (errno == ENOENT || errno == ESRCH) fail("process %ld is gone", pid);
        fail("cannot read %s: %s", path, strerror(errno));
    }
    size_t got = 0;
    for (;;) {
        ssize_t r = read(fd, buf + got, sizeof buf - got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            if (errno == ESRCH) fail("process %ld is gone", pid);
            fail("cannot read %s: %s", path, strerror(errno));
        }
        if (r == 0) break;
        got += (size_t)r;
        if (got > CGROUP_FILE_MAX) fail("%s is larger than %d bytes", path, CGROUP_FILE_MAX);
    }
    close(fd);
    buf[got] = 0;
    if (memchr(buf, 0, got)) fail("%s holds a NUL byte", path);
    const char *found = NULL;
    for (char *line = buf; line && *line;) {
        char *next = strchr(line, '\n');
        if (next) *next++ = 0;
        if (strncmp(line, "0::", 3) == 0) {
            if (found) fail("%s has two cgroup v2 lines", path);
            found = line + 3;
        }
        line = next;
    }
    if (!found) fail("process %ld is in no cgroup v2 directory (no 0:: line)", pid);
    size_t n = strlen(found);
    if (found[0] != '/' || n >= PATH_MAX - 256) fail("process %ld's cgroup is not a path", pid);
    if (n == 1) fail("process %ld is in the root cgroup: refusing to limit it", pid);
    /* components: no empty, no "." or "..", nothing after a final '/' */
    for (const char *c = found + 1;;) {
        const char *slash = strchr(c, '/');
        size_t len = slash ? (size_t)(slash - c) : strlen(c);
        if (len == 0 || (len == 1 && c[0] == '.') || (len == 2 && c[0] == '.' && c[1] == '.'))
            fail("process %ld's cgroup path %.200s has an empty, . or .. component", pid, found);
        if (!slash) break;
        c = slash + 1;
    }
    return found;
}

/* Walk `rel` (starting with '/') under `root` one directory at a time, never following
 * a link: every component must be a real directory. */
static void walk(const char *root, const char *rel, int check_fs) {
    int dir = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) fail("cannot open the cgroup root %s: %s", root, strerror(errno));
    if (check_fs) {
        struct statfs fs;
        if (fstatfs(dir, &fs) || fs.f_type != CGROUP2_SUPER_MAGIC)
            fail("%s is not a cgroup v2 file system", root);
    }
    char part[NAME_MAX + 1];
    for (const char *c = rel + 1; *c;) {
        const char *slash = strchr(c, '/');
        size_t len = slash ? (size_t)(slash - c) : strlen(c);
        if (len > NAME_MAX) fail("a component of the cgroup path is too long");
        memcpy(part, c, len);
        part[len] = 0;
        int next = openat(dir, part, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (next < 0) {
            if (errno == ELOOP || errno == ENOTDIR)
                fail("the cgroup path %.200s has a symlink or a non-directory at %s", rel, part);
            fail("cannot open the cgroup %s%.200s: %s", root, rel, strerror(errno));
        }
        close(dir);
        dir = next;
        if (!slash) break;
        c = slash + 1;
    }
    close(dir);
}

/* ------------------------------------------------------------------ NVML */

static void *need(void *lib, const char *name) {
    void *f = dlsym(lib, name);
    if (!f) fail("NVML has no %s (driver r615 or newer is needed)", name);
    return f;
}

static void set_limit(const char *nvml_lib, const char *uuid, const char *ns,
                      unsigned long long bytes) {
    void *lib = dlopen(nvml_lib, RTLD_NOW | RTLD_LOCAL);
    if (!lib) fail("cannot load %s: %s", nvml_lib, dlerror());
    nvmlReturn_t (*init)(void) = need(lib, "nvmlInit_v2");
    nvmlReturn_t (*shutdown)(void) = need(lib, "nvmlShutdown");
    nvmlReturn_t (*by_uuid)(const char *, nvmlDevice_t *) = need(lib, "nvmlDeviceGetHandleByUUID");
    nvmlReturn_t (*set)(nvmlDevice_t, nvmlSetMemoryLimits_v1_t *) =
        need(lib, "nvmlDeviceSetMemoryLimits_v1");
    nvmlReturn_t (*get)(nvmlDevice_t, nvmlGetMemoryLimits_v1_t *) =
        need(lib, "nvmlDeviceGetMemoryLimits_v1");
    const char *(*error_string)(nvmlReturn_t) = dlsym(lib, "nvmlErrorString");
#define WHY(r) (error_string ? error_string(r) : "NVML error")
    nvmlReturn_t r = init();
    if (r) fail("nvmlInit_v2: %s (%d)", WHY(r), r);
    nvmlDevice_t device;
    r = by_uuid(uuid, &device);
    if (r) fail("no GPU %s: %s (%d)", uuid, WHY(r), r);
    nvmlSetMemoryLimits_v1_t limits = {ns, 0, bytes};
    r = set(device, &limits);
    if (r) fail("nvmlDeviceSetMemoryLimits_v1 on %s for %s: %s (%d)", uuid, ns, WHY(r), r);
    nvmlGetMemoryLimits_v1_t back = {ns, 0, 0, 0};
    r = get(device, &back);
    if (r == 3) /* NOT_SUPPORTED: no limit there */
        fail("the limit on %s for %s reads back nothing after it was set", uuid, ns);
    if (r) fail("nvmlDeviceGetMemoryLimits_v1 on %s for %s: %s (%d)", uuid, ns, WHY(r), r);
    if (back.hardLimit != bytes || back.softLimit != 0)
        fail("the limit on %s for %s reads back soft %llu hard %llu, not soft 0 hard %llu", uuid,
             ns, back.softLimit, back.hardLimit, bytes);
    shutdown();
}

/* ------------------------------------------------------------------ main */

static void usage(void) {
    fputs("usage: gpushare-memory-hook --gpu GPU-<uuid> --limit-mib N [--nvml-lib PATH] "
          "[--cgroup-root DIR] [--proc-root DIR] < OCI state\n", stderr);
    exit(2);
}

static int good_uuid(const char *u) {
    size_t n = strlen(u);
    if (n < 5 || n > 80 || strncmp(u, "GPU-", 4)) return 0;
    for (size_t i = 4; i < n; i++)
        if (!(u[i] == '-' || (u[i] >= '0' && u[i] <= '9') || (u[i] >= 'a' && u[i] <= 'z') ||
              (u[i] >= 'A' && u[i] <= 'Z')))
            return 0;
    return 1;
}

int main(int argc, char **argv) {
    const char *uuid = NULL, *limit = NULL, *nvml_lib = "libnvidia-ml.so.1";
    const char *cgroup_root = DEFAULT_CGROUP_ROOT, *proc_root = "/proc";
    int custom_root = 0;
    alarm(TIMEOUT_S); /* a hung driver call must not hold the container's creation */
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc) usage();
        const char *flag = argv[i], *arg = argv[++i];
        if (!strcmp(flag, "--gpu")) uuid = arg;
        else if (!strcmp(flag, "--limit-mib")) limit = arg;
        else if (!strcmp(flag, "--nvml-lib")) nvml_lib = arg;
        else if (!strcmp(flag, "--cgroup-root")) cgroup_root = arg, custom_root = 1;
        else if (!strcmp(flag, "--proc-root")) proc_root = arg;
        else usage();
    }
    if (!uuid || !limit) usage();
    if (!good_uuid(uuid)) fail("--gpu %.100s is not a GPU UUID", uuid);
    char *end;
    errno = 0;
    unsigned long long mib = strtoull(limit, &end, 10);
    if (errno || *end || !*limit || limit[0] == '-' || mib == 0 || mib > (1ULL << 40))
        fail("--limit-mib %.40s is not a positive number of MiB", limit);
    if (cgroup_root[0] != '/' || strlen(cgroup_root) > 1024)
        fail("--cgroup-root must be an absolute path");
    long pid = state_pid();
    const char *rel = cgroup_of(proc_root, pid);
    walk(cgroup_root, rel, !custom_root);
    char ns[PATH_MAX];
    size_t root_len = strlen(cgroup_root);
    while (root_len > 1 && cgroup_root[root_len - 1] == '/') root_len--;
    if ((size_t)snprintf(ns, sizeof ns, "%.*s%s", (int)root_len, cgroup_root, rel) >= sizeof ns)
        fail("the cgroup path is too long");
    set_limit(nvml_lib, uuid, ns, mib << 20);
    return 0;
}
