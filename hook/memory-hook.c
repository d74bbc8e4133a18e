/* gpushare-memory-hook: an OCI createRuntime hook that sets the driver's hard GPU-memory
 * limit (NVIDIA r615+, nvmlDeviceSetMemoryLimits_v1) on the container's own cgroup v2
 * directory before the workload runs. The daemon installs it on the host beside
 * libvgpu.so and names it, with the card and the limit as ARGUMENTS, in the CDI spec of
 * each grant on a card whose memory backend is `driver` (docs/choosing.md). Nothing comes
 * from the environment: the tenant writes its pod's env.
 *
 *   gpushare-memory-hook --gpu GPU-<uuid> --limit-mib N [--holder DIR]
 *       [--nvml-lib PATH] [--cgroup-root DIR] [--proc-root DIR]
 *
 * stdin: the OCI state (JSON, at most 64 KiB) with the container's init `pid`. Its cgroup
 * is the `0::` line of /proc/<pid>/cgroup; the path is refused if it is the root, holds
 * `.`/`..` or empty components, or if any component under the cgroup root is a symlink
 * or not a directory. Then: soft 0, hard N MiB (held to the card's total from
 * nvmlDeviceGetMemoryInfo: the setter refuses more with INVALID_ARGUMENT), read back with
 * nvmlDeviceGetMemoryLimits_v1 (NOT_SUPPORTED after a set that succeeded: not enforced).
 * A refused set says what NVML's answer means (explain()). Any failure: exit 1 with one
 * line on stderr, and the runtime does not create the container (fail closed). It writes
 * nothing itself but the limit, through NVML, and, for a DRA claim's share (--holder), the
 * claim's holder record in the daemon's own directory for it (one live container per
 * claim share: see "--holder" below, docs/dra.md). It gives up after 10 s (SIGALRM).
 *
 * The NVML structures (no version field; x86-64 sizes 24 and 32 bytes), as NVIDIA's
 * nvml.h of CUDA 13.4 (cuda-nvml-dev-13-4) declares them; read through the search tool in
 * go-nvml's nvml.h as copied into a public mock header, and in a public project quoting
 * the header from the cuda-nvml-dev-13-4_13.4.92 package. Check against the driver's own
 * nvml.h before relying on it: `make gpu-proof` does, on a GPU.
 *
 * The same program checks a DRA claim's limits (docs/dra.md, docs/security.md row 32.2):
 *
 *   gpushare-memory-hook --check-limits [--memory-mib N] [--cores C] [--neutral NAME=VALUE]...
 *
 * named in the CDI spec of every claim share whose limits HAMi-core holds, with that
 * claim's share. It reads the container's final env from `<bundle>/config.json` (the bundle
 * from the OCI state; config.json at most 16 MiB, a regular file, never followed if a link
 * stands there), and refuses the container (exit 1, one line) if any occurrence of
 * CUDA_DEVICE_MEMORY_LIMIT or CUDA_DEVICE_MEMORY_LIMIT_<i> (i 0-15, the names HAMi-core
 * reads) is above N MiB, of CUDA_DEVICE_SM_LIMIT(_<i>) above C, or is not a plain decimal
 * with an optional k/m/g (HAMi-core reads 0 and junk as "no limit"), if one of them is not
 * set at all, or if a --neutral name is not at its value. Two claims of unequal shares in
 * one container: whichever spec the runtime applied last, the smaller claim's check sees
 * the larger share and nothing starts. It reads, never writes, and loads no library. */
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
#include <strings.h>
#include <sys/file.h>
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
#define CONFIG_MAX (16u << 20) /* a bundle's config.json */
#define CGROUP2_SUPER_MAGIC 0x63677270
#define DEFAULT_CGROUP_ROOT "/sys/fs/cgroup"

static void fail(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
static void usage(void) __attribute__((noreturn));
static void usage(void) {
    fputs("usage: gpushare-memory-hook --gpu GPU-<uuid> --limit-mib N [--holder DIR] "
          "[--nvml-lib PATH] [--cgroup-root DIR] [--proc-root DIR] < OCI state; or "
          "gpushare-memory-hook "
          "--check-limits [--memory-mib N] [--cores C] [--neutral NAME=VALUE]... < OCI state\n",
          stderr);
    exit(2);
}
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

/* ------------------------------------------------------------------ JSON */

/* A bounded JSON validator that keeps what it is asked for: the OCI state's top-level
 * "pid" and "bundle", or a bundle config's "process" -> "env" strings. Keys are decoded
 * and compared ASCII case-insensitively where a Go runtime's decoder would match them
 * (encoding/json), and a key that occurs twice where it matters is refused. */
enum role { R_NONE, R_TOP, R_PID, R_BUNDLE, R_PROCESS, R_ENV, R_ENV_ITEM };

struct scan {
    char *p, *end;
    int config;  /* 1: a bundle's config.json; 0: the OCI state */
    long pid;    /* -1: not seen */
    int pids;    /* how many top-level "pid" keys */
    char *bundle; /* decoded, NUL-terminated in place */
    int bundles, processes, envs;
    void (*on_env)(char *entry, size_t n); /* each decoded string of process.env */
};

static void ws(struct scan *s) {
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
        s->p++;
}

static int hex4(const char *p) {
    int v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        v = v * 16 + (c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                                                           : c - 'A' + 10);
    }
    return v;
}

/* Decode a string body (already validated by string()) in place, as UTF-8; returns the
 * decoded length, or -1 for a lone surrogate (not text a runtime would pass on). */
static long decode(char *b, size_t n) {
    char *out = b;
    for (size_t i = 0; i < n;) {
        if (b[i] != '\\') { *out++ = b[i++]; continue; }
        char e = b[i + 1];
        i += 2;
        if (e != 'u') {
            *out++ = e == 'b' ? '\b' : e == 'f' ? '\f' : e == 'n' ? '\n' : e == 'r' ? '\r'
                   : e == 't' ? '\t' : e;
            continue;
        }
        long cp = hex4(b + i);
        i += 4;
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (i + 6 > n || b[i] != '\\' || b[i + 1] != 'u') return -1;
            long lo = hex4(b + i + 2);
            if (lo < 0xDC00 || lo > 0xDFFF) return -1;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            i += 6;
        } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return -1;
        }
        if (cp < 0x80) *out++ = (char)cp;
        else if (cp < 0x800) *out++ = (char)(0xC0 | cp >> 6), *out++ = (char)(0x80 | (cp & 63));
        else if (cp < 0x10000)
            *out++ = (char)(0xE0 | cp >> 12), *out++ = (char)(0x80 | (cp >> 6 & 63)),
            *out++ = (char)(0x80 | (cp & 63));
        else
            *out++ = (char)(0xF0 | cp >> 18), *out++ = (char)(0x80 | (cp >> 12 & 63)),
            *out++ = (char)(0x80 | (cp >> 6 & 63)), *out++ = (char)(0x80 | (cp & 63));
    }
    return (long)(out - b);
}

/* A JSON string; returns 0 on success and the raw (still escaped) body in *b, *n. */
static int string(struct scan *s, char **b, size_t *n) {
    if (s->p >= s->end || *s->p != '"') return -1;
    char *start = ++s->p;
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

static int value(struct scan *s, int depth, enum role role);

static int key_is(const char *key, long n, const char *word, int fold) {
    if (n != (long)strlen(word)) return 0;
    return fold ? strncasecmp(key, word, (size_t)n) == 0 : memcmp(key, word, (size_t)n) == 0;
}

/* What the value under ``key`` is, inside an object that is ``role``. */
static enum role child(struct scan *s, enum role role, const char *key, long n) {
    /* Go's decoder also folds some non-ASCII letters onto ASCII ones ("ſ" onto "s"): a
     * config's own keys are ASCII, so any other is refused where it could match. */
    if (s->config && (role == R_TOP || role == R_PROCESS))
        for (long k = 0; k < n; k++)
            if ((unsigned char)key[k] >= 0x80) fail("the bundle's config has a non-ASCII key");
    if (role == R_TOP && !s->config) {
        if (key_is(key, n, "pid", 0)) return R_PID;
        if (key_is(key, n, "bundle", 0)) return R_BUNDLE;
    }
    if (role == R_TOP && s->config && key_is(key, n, "process", 1)) return R_PROCESS;
    if (role == R_PROCESS && key_is(key, n, "env", 1)) return R_ENV;
    return R_NONE;
}

static int object(struct scan *s, int depth, enum role role) {
    s->p++; /* { */
    ws(s);
    if (s->p < s->end && *s->p == '}') return s->p++, 0;
    for (;;) {
        char *key;
        size_t n;
        ws(s);
        if (string(s, &key, &n)) return -1;
        ws(s);
        if (s->p >= s->end || *s->p != ':') return -1;
        s->p++;
        ws(s);
        long len = decode(key, n);
        if (len < 0) return -1;
        if (value(s, depth, child(s, role, key, len))) return -1;
        ws(s);
        if (s->p < s->end && *s->p == ',') { s->p++; continue; }
        if (s->p < s->end && *s->p == '}') return s->p++, 0;
        return -1;
    }
}

static int array(struct scan *s, int depth, enum role role) {
    s->p++; /* [ */
    ws(s);
    if (s->p < s->end && *s->p == ']') return s->p++, 0;
    for (;;) {
        ws(s);
        if (value(s, depth, role == R_ENV ? R_ENV_ITEM : R_NONE)) return -1;
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

static int text(struct scan *s, enum role role) {
    char *b;
    size_t n;
    if (string(s, &b, &n)) return -1;
    if (role != R_BUNDLE && role != R_ENV_ITEM) return 0;
    long len = decode(b, n);
    if (len < 0) return -1;
    if (role == R_ENV_ITEM) {
        s->on_env(b, (size_t)len);
    } else {
        s->bundles++;
        if (memchr(b, 0, (size_t)len)) return -1;
        b[len] = 0; /* over the closing quote, already passed */
        s->bundle = b;
    }
    return 0;
}

/* A value that is ``role`` (a "pid" that is not a small non-negative integer: -1). */
static int value(struct scan *s, int depth, enum role role) {
    if (depth >= DEPTH_MAX) return -1;
    if (s->p >= s->end) return -1;
    if (role == R_PROCESS && ++s->processes > 1) fail("the bundle's config has two \"process\"");
    if (role == R_ENV && ++s->envs > 1) fail("the bundle's config has two \"process.env\"");
    if (role == R_PID) s->pids++, s->pid = -2;
    if (role == R_ENV_ITEM && *s->p != '"') fail("the bundle's config has a non-string env entry");
    if (role == R_ENV && *s->p != '[' && *s->p != 'n')
        fail("the bundle's process.env is not a list");
    switch (*s->p) {
    case '{': return object(s, depth + 1, role == R_PID ? R_NONE : role);
    case '[': return array(s, depth + 1, role);
    case '"': return text(s, role);
    case 't': return literal(s, "true");
    case 'f': return literal(s, "false");
    case 'n': return literal(s, "null");
    default: return number(s, role == R_PID ? &s->pid : NULL);
    }
}

/* Read all of ``fd`` into ``buf`` (``max`` bytes at most); the length. */
static size_t slurp(int fd, char *buf, size_t max, const char *what) {
    size_t got = 0;
    for (;;) {
        ssize_t r = read(fd, buf + got, max + 1 - got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) fail("cannot read %s: %s", what, strerror(errno));
        if (r == 0) break;
        got += (size_t)r;
        if (got > max) fail("%s is larger than %zu bytes", what, max);
    }
    return got;
}

static void parse(struct scan *s, const char *what) {
    ws(s);
    if (s->p >= s->end || *s->p != '{') fail("%s is not a JSON object", what);
    if (value(s, 0, R_TOP)) fail("%s is not valid JSON", what);
    ws(s);
    if (s->p != s->end) fail("%s has data after its JSON object", what);
}

/* The OCI state on stdin: its top-level "pid" (``need_pid``) and "bundle" (or NULL). */
static struct scan read_state(int need_pid) {
    static char buf[STATE_MAX + 1];
    size_t got = slurp(0, buf, STATE_MAX, "the OCI state on stdin");
    struct scan s = {buf, buf + got, 0, -1, 0, NULL, 0, 0, 0, NULL};
    parse(&s, "the OCI state on stdin");
    if (need_pid) {
        if (s.pids != 1) fail("the OCI state has %s \"pid\"", s.pids ? "more than one" : "no");
        if (s.pid <= 0 || s.pid > 4194304) fail("the OCI state's pid is not a process id");
    }
    if (s.bundles > 1) fail("the OCI state has more than one \"bundle\"");
    return s;
}

static long state_pid(void) { return read_state(1).pid; }

/* ------------------------------------------------------------------ the cgroup */

/* Whether the path after its leading '/' has only plain components: no empty one, no
 * "." or "..", nothing after a final '/'. */
static int plain_components(const char *path) {
    for (const char *c = path + 1;;) {
        const char *slash = strchr(c, '/');
        size_t len = slash ? (size_t)(slash - c) : strlen(c);
        if (len == 0 || (len == 1 && c[0] == '.') || (len == 2 && c[0] == '.' && c[1] == '.'))
            return 0;
        if (!slash) return 1;
        c = slash + 1;
    }
}

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
    if (!plain_components(found))
        fail("process %ld's cgroup path %.200s has an empty, . or .. component", pid, found);
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

/* ------------------------------------------------------------------ --holder */

/* A DRA claim's share of a `driver` card is one budget, but the driver's limit is set per
 * container (on its own cgroup): two live containers of one claim would each get all of
 * it. So the claim's spec names --holder DIR, a directory the daemon made for that share
 * when it prepared the claim (root's, 0700, outside everything a container mounts), and
 * the hook records there the cgroup of the one container that holds the share:
 *
 *   DIR/lock    flock()ed while the record is read and replaced (a crashed hook's lock
 *               goes with its process)
 *   DIR/holder  "<cgroup path>\n" of the holder, replaced by rename (never torn)
 *
 * A record whose cgroup is gone, or has no process left (`populated 0` in its
 * cgroup.events: the container ended; a restart of it is a new container in a new
 * cgroup), is stale and taken over; a record naming this container's own cgroup (the
 * runtime ran the hook again) is kept. Otherwise the container is refused. When the
 * hook fails after it wrote the record, it takes the record back before it exits. */

static int holder_fd = -1;  /* the holder directory, once this hook's record is in it */
static int holder_kept;     /* the limit is set: the record stays */

static void drop_holder(void) {
    if (holder_fd >= 0 && !holder_kept) unlinkat(holder_fd, "holder", 0);
}

/* The record's cgroup path (into ``out``), or 0 when there is none or it is not one. */
static int read_holder(int dir, char *out, size_t max) {
    int fd = openat(dir, "holder", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) return 0;
        fail("cannot read the claim's holder record: %s", strerror(errno));
    }
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) fail("the claim's holder record is not a file");
    size_t got = 0;
    for (;;) {
        ssize_t r = read(fd, out + got, max - 1 - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
        if (got >= max - 1) break;
    }
    close(fd);
    out[got] = 0;
    if (got < 3 || out[0] != '/' || out[got - 1] != '\n' || memchr(out, 0, got)) return 0;
    out[got - 1] = 0;
    return strchr(out, '\n') == NULL && plain_components(out);
}

/* Whether cgroup ``rel`` under ``root`` still holds a process: missing is no; a cgroup
 * whose events cannot be read counts as live (the container is refused, never doubled). */
static int cgroup_live(const char *root, const char *rel) {
    int dir = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) return 1;
    char part[NAME_MAX + 1];
    for (const char *c = rel + 1; *c;) {
        const char *slash = strchr(c, '/');
        size_t len = slash ? (size_t)(slash - c) : strlen(c);
        if (len > NAME_MAX) return close(dir), 0;
        memcpy(part, c, len);
        part[len] = 0;
        int next = openat(dir, part, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        int err = errno;
        close(dir);
        if (next < 0) return !(err == ENOENT || err == ENOTDIR || err == ELOOP);
        dir = next;
        if (!slash) break;
        c = slash + 1;
    }
    int fd = openat(dir, "cgroup.events", O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    close(dir);
    if (fd < 0) return 1; /* no events file to read: the directory is all we know */
    char buf[4096];
    ssize_t got = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (got <= 0) return 1;
    buf[got] = 0;
    for (char *line = buf; line;) {
        if (strncmp(line, "populated ", 10) == 0) return line[10] != '0';
        line = strchr(line, '\n');
        if (line) line++;
    }
    return 1;
}

/* Take the claim's holder record in ``path`` for the container in cgroup ``rel``, or
 * refuse the container. */
static void take_holder(const char *path, const char *root, const char *rel, const char *uuid) {
    int dir = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dir < 0)
        fail("cannot open the claim's holder directory %.200s: %s (is the claim still "
             "prepared?)", path, strerror(errno));
    struct stat st;
    if (fstat(dir, &st) || st.st_uid != geteuid() || (st.st_mode & 022))
        fail("the claim's holder directory %.200s is not the hook's own (owner %u, mode %o)",
             path, (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777));
    int lock = openat(dir, "lock", O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (lock < 0) fail("cannot open the claim's holder lock: %s", strerror(errno));
    while (flock(lock, LOCK_EX) < 0)
        if (errno != EINTR) fail("cannot lock the claim's holder record: %s", strerror(errno));
    static char other[PATH_MAX];
    if (read_holder(dir, other, sizeof other) && strcmp(other, rel) && cgroup_live(root, other))
        fail("this claim's share of %s is held by another running container (cgroup "
             "%.200s): the driver's memory limit is set per container, so a claim on a "
             "card whose memory is `driver` serves one container at a time, or each would "
             "get the whole charge; give each container its own claim (a "
             "ResourceClaimTemplate, or one request per container), or start this one "
             "after the other has ended", uuid, other);
    int fd = openat(dir, "holder.new", O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC,
                    0600);
    if (fd < 0) fail("cannot write the claim's holder record: %s", strerror(errno));
    size_t n = strlen(rel);
    if (write(fd, rel, n) != (ssize_t)n || write(fd, "\n", 1) != 1 || close(fd))
        fail("cannot write the claim's holder record: %s", strerror(errno));
    if (renameat(dir, "holder.new", dir, "holder"))
        fail("cannot write the claim's holder record: %s", strerror(errno));
    holder_fd = dir; /* the lock stays held until the hook exits */
    atexit(drop_holder);
}

/* ------------------------------------------------------------------ NVML */

static void *need(void *lib, const char *name) {
    void *f = dlsym(lib, name);
    if (!f) fail("NVML has no %s (driver r615 or newer is needed)", name);
    return f;
}

/* What the NVML reference says each answer of the setter means; the same words as
 * gpushare.gpu.memlimits.MEANINGS (tests/unit/host/test_memory_hook_meanings.py holds the
 * two together). */
static const char *explain(nvmlReturn_t r) {
    switch (r) {
    case 2: return ": a limit above the card's total memory, or soft above hard";
    case 4: return ": setting a limit needs root with CAP_SYS_ADMIN";
    case 6: return ": the cgroup has no dmem files: a level above it does not enable +dmem";
    case 17: return ": the cgroup is gone or not visible to the driver";
    default: return "";
    }
}

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;

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
    nvmlReturn_t (*memory)(nvmlDevice_t, nvmlMemory_t *) = dlsym(lib, "nvmlDeviceGetMemoryInfo");
    const char *(*error_string)(nvmlReturn_t) = dlsym(lib, "nvmlErrorString");
#define WHY(r) (error_string ? error_string(r) : "NVML error")
    nvmlReturn_t r = init();
    if (r) fail("nvmlInit_v2: %s (%d)", WHY(r), r);
    nvmlDevice_t device;
    r = by_uuid(uuid, &device);
    if (r) fail("no GPU %s: %s (%d)", uuid, WHY(r), r);
    /* The setter refuses a limit above the card's total (INVALID_ARGUMENT): a grant is
     * never more than the card, so one above it is held to the card (the daemon clamps the
     * same way, share/answers.py driver_hook). */
    nvmlMemory_t info = {0, 0, 0};
    if (memory && memory(device, &info) == 0 && info.total && bytes > info.total) {
        fprintf(stderr, "gpushare-memory-hook: %llu MiB is above card %s's total %llu MiB: "
                "limited to the card's total\n", bytes >> 20, uuid, info.total >> 20);
        bytes = info.total;
    }
    nvmlSetMemoryLimits_v1_t limits = {ns, 0, bytes};
    r = set(device, &limits);
    if (r)
        fail("nvmlDeviceSetMemoryLimits_v1 on %s for %s: %s (%d)%s", uuid, ns, WHY(r), r,
             explain(r));
    nvmlGetMemoryLimits_v1_t back = {ns, 0, 0, 0};
    r = get(device, &back);
    if (r == 3) /* NOT_SUPPORTED after a set that succeeded: the driver does not hold it */
        fail("the limit on %s for %s reads back nothing (NOT_SUPPORTED) after it was set: "
             "the limit is not enforced", uuid, ns);
    if (r) fail("nvmlDeviceGetMemoryLimits_v1 on %s for %s: %s (%d)", uuid, ns, WHY(r), r);
    if (back.hardLimit != bytes || back.softLimit != 0)
        fail("the limit on %s for %s reads back soft %llu hard %llu, not soft 0 hard %llu", uuid,
             ns, back.softLimit, back.hardLimit, bytes);
    shutdown();
}

/* ------------------------------------------------------------------ --check-limits */

/* HAMi-core reads per card index 0-15 (its CUDA_DEVICE_MAX_COUNT), each name falling back
 * to the un-indexed one: every one of them must be no larger than this claim's share. */
enum { INDEXES = 16, NAMES = INDEXES + 1, NEUTRAL_MAX = 16 };
struct limit {
    const char *prefix;        /* CUDA_DEVICE_MEMORY_LIMIT or CUDA_DEVICE_SM_LIMIT */
    unsigned long long most;   /* in the unit HAMi-core reads: bytes, or percent */
    int on;                    /* asked for */
    int seen[NAMES];           /* [0]: un-indexed, [1 + i]: _<i> */
};
static struct limit memory_limit = {"CUDA_DEVICE_MEMORY_LIMIT", 0, 0, {0}};
static struct limit core_limit = {"CUDA_DEVICE_SM_LIMIT", 0, 0, {0}};
static struct {
    const char *name, *value;
    size_t name_n;
    int seen;
} neutral[NEUTRAL_MAX];
static int neutrals;

/* A value for the error line: at most 40 bytes, anything unprintable shown as '?'. */
static const char *shown(const char *v, size_t n) {
    static char out[48];
    size_t k = 0;
    for (; k < n && k < 40; k++) out[k] = v[k] >= 0x20 && v[k] < 0x7f ? v[k] : '?';
    if (n > 40) out[k++] = '.', out[k++] = '.', out[k++] = '.';
    out[k] = 0;
    return out;
}

/* Which name of ``l`` this is: 0 un-indexed, 1 + i for _<i> as HAMi-core writes it ("%d"),
 * -1 none. */
static int which(const struct limit *l, const char *name, size_t n) {
    size_t p = strlen(l->prefix);
    if (n < p || memcmp(name, l->prefix, p)) return -1;
    if (n == p) return 0;
    if (name[p] != '_' || n == p + 1 || n > p + 3) return -1;
    if (name[p + 1] == '0') return n == p + 2 ? 1 : -1;
    int i = 0;
    for (size_t k = p + 1; k < n; k++) {
        if (name[k] < '0' || name[k] > '9') return -1;
        i = i * 10 + (name[k] - '0');
    }
    return i < INDEXES ? 1 + i : -1;
}

/* The value as HAMi-core reads it (strtoul, then a k/m/g suffix scales it), accepted only
 * in the one form whose reading is plain: a decimal number without sign, space or leading
 * zero, with an optional k/K/m/M/g/G. 0 when it is not in that form or overflows (HAMi-core
 * reads 0, or junk, as "no limit", and the runtime's reading of other forms is not ours
 * to guess). */
static unsigned long long reading(const char *v, size_t n) {
    unsigned long long scale = 1;
    if (n && strchr("kKmMgG", v[n - 1])) {
        char c = (char)(v[n - 1] | 0x20);
        scale = c == 'k' ? 1ULL << 10 : c == 'm' ? 1ULL << 20 : 1ULL << 30;
        n--;
    }
    if (n == 0 || n > 15 || v[0] < '1' || v[0] > '9') return 0;
    unsigned long long x = 0;
    for (size_t k = 0; k < n; k++) {
        if (v[k] < '0' || v[k] > '9') return 0;
        x = x * 10 + (unsigned long long)(v[k] - '0');
    }
    return x > ~0ULL / scale ? 0 : x * scale; /* HAMi-core reads an overflow as none */
}

static void check_limit(struct limit *l, const char *name, size_t n, const char *v, size_t vn) {
    int at = which(l, name, n);
    if (at < 0 || !l->on) return;
    l->seen[at] = 1;
    unsigned long long got = reading(v, vn);
    if (got == 0)
        fail("%.*s=%s is not a limit HAMi-core reads plainly (it could mean none): refusing",
             (int)n, name, shown(v, vn));
    if (got > l->most)
        fail("%.*s=%s is above this claim's share (%llu%s): another claim or the pod's env "
             "sets it, and the card it lands on would run above its charge; give the claims "
             "of one container equal shares",
             (int)n, name, shown(v, vn), l == &memory_limit ? l->most >> 20 : l->most,
             l == &memory_limit ? " MiB" : " %");
}

/* One entry of process.env: every occurrence of a watched name is checked, so it does not
 * matter which duplicate a runtime applies (runc keeps the last, getenv finds the first). */
static void check_entry(char *entry, size_t n) {
    if (memchr(entry, 0, n)) fail("an env entry of the bundle's config holds a NUL byte");
    char *eq = memchr(entry, '=', n);
    if (!eq) return; /* not NAME=VALUE: no process sees it as a variable */
    size_t name_n = (size_t)(eq - entry), vn = n - name_n - 1;
    check_limit(&memory_limit, entry, name_n, eq + 1, vn);
    check_limit(&core_limit, entry, name_n, eq + 1, vn);
    for (int k = 0; k < neutrals; k++) {
        if (neutral[k].name_n != name_n || memcmp(neutral[k].name, entry, name_n)) continue;
        neutral[k].seen = 1;
        if (strlen(neutral[k].value) != vn || memcmp(neutral[k].value, eq + 1, vn))
            fail("%.*s=%s, not %s as this claim's spec sets it: refusing", (int)name_n, entry,
                 shown(eq + 1, vn), neutral[k].value);
    }
}

static void all_seen(const struct limit *l) {
    if (!l->on) return;
    for (int at = 0; at < NAMES; at++)
        if (!l->seen[at]) {
            if (at) fail("%s_%d is not set: a card would run without this claim's limit",
                         l->prefix, at - 1);
            fail("%s is not set: a card would run without this claim's limit", l->prefix);
        }
}

static unsigned long long positive(const char *flag, const char *arg, unsigned long long most) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(arg, &end, 10);
    if (errno || *end || !*arg || arg[0] < '0' || arg[0] > '9' || v == 0 || v > most)
        fail("%s %.40s is not a number from 1 to %llu", flag, arg, most);
    return v;
}

/* gpushare-memory-hook --check-limits [--memory-mib N] [--cores C] [--neutral NAME=VALUE]...
 * Refuses the container (exit 1, one line) when its final env, read from the bundle's
 * config.json, lets HAMi-core give any card index more than N MiB or C % of the cores, or
 * leaves a switch at other than its neutral value. */
static int check_limits(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc) usage();
        const char *flag = argv[i], *arg = argv[++i];
        if (!strcmp(flag, "--memory-mib")) {
            memory_limit.most = positive(flag, arg, 1ULL << 40) << 20;
            memory_limit.on = 1;
        } else if (!strcmp(flag, "--cores")) {
            core_limit.most = positive(flag, arg, 100);
            core_limit.on = 1;
        } else if (!strcmp(flag, "--neutral")) {
            const char *eq = strchr(arg, '=');
            if (!eq || eq == arg || neutrals == NEUTRAL_MAX)
                fail("--neutral %.40s is not NAME=VALUE (at most %d)", arg, NEUTRAL_MAX);
            neutral[neutrals].name = arg;
            neutral[neutrals].name_n = (size_t)(eq - arg);
            neutral[neutrals++].value = eq + 1;
        } else {
            usage();
        }
    }
    struct scan state = read_state(0);
    if (!state.bundle) fail("the OCI state has no \"bundle\"");
    if (state.bundle[0] != '/' || strlen(state.bundle) >= PATH_MAX - 16)
        fail("the OCI state's bundle is not an absolute path");
    /* The bundle is the runtime's own directory; config.json in it is never followed if a
     * link stands there, and must be a regular file (a FIFO would hold the container). */
    int dir = open(state.bundle, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) fail("cannot open the bundle %.200s: %s", state.bundle, strerror(errno));
    int fd = openat(dir, "config.json", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) fail("cannot open %.200s/config.json: %s", state.bundle, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode))
        fail("%.200s/config.json is not a regular file", state.bundle);
    static char config[CONFIG_MAX + 1];
    size_t got = slurp(fd, config, CONFIG_MAX, "the bundle's config.json");
    close(fd);
    close(dir);
    struct scan s = {config, config + got, 1, -1, 0, NULL, 0, 0, 0, check_entry};
    parse(&s, "the bundle's config.json");
    all_seen(&memory_limit);
    all_seen(&core_limit);
    for (int k = 0; k < neutrals; k++)
        if (!neutral[k].seen)
            fail("%.*s is not set, not %s as this claim's spec sets it: refusing",
                 (int)neutral[k].name_n, neutral[k].name, neutral[k].value);
    return 0;
}

/* ------------------------------------------------------------------ main */


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
    const char *cgroup_root = DEFAULT_CGROUP_ROOT, *proc_root = "/proc", *holder = NULL;
    int custom_root = 0;
    alarm(TIMEOUT_S); /* a hung driver call must not hold the container's creation */
    if (argc > 1 && !strcmp(argv[1], "--check-limits")) return check_limits(argc - 1, argv + 1);
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc) usage();
        const char *flag = argv[i], *arg = argv[++i];
        if (!strcmp(flag, "--gpu")) uuid = arg;
        else if (!strcmp(flag, "--limit-mib")) limit = arg;
        else if (!strcmp(flag, "--nvml-lib")) nvml_lib = arg;
        else if (!strcmp(flag, "--cgroup-root")) cgroup_root = arg, custom_root = 1;
        else if (!strcmp(flag, "--proc-root")) proc_root = arg;
        else if (!strcmp(flag, "--holder")) holder = arg;
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
    if (holder && (holder[0] != '/' || strlen(holder) > 1024))
        fail("--holder must be an absolute path");
    long pid = state_pid();
    const char *rel = cgroup_of(proc_root, pid);
    walk(cgroup_root, rel, !custom_root);
    char ns[PATH_MAX];
    size_t root_len = strlen(cgroup_root);
    while (root_len > 1 && cgroup_root[root_len - 1] == '/') root_len--;
    if ((size_t)snprintf(ns, sizeof ns, "%.*s%s", (int)root_len, cgroup_root, rel) >= sizeof ns)
        fail("the cgroup path is too long");
    if (holder) take_holder(holder, cgroup_root, rel, uuid);
    set_limit(nvml_lib, uuid, ns, mib << 20);
    holder_kept = 1;
    return 0;
}
