/*
 * init.c - loading the real driver, attaching to the enforcer, and the two
 * ways programs find driver entry points: cuGetProcAddress and dlsym.
 *
 * Nothing here runs when the library is loaded.  The driver is loaded on the
 * first CUDA-related call (a wrapper, cuGetProcAddress, or a dlsym of an
 * interposed name on the driver), and the enforcer is contacted on the first
 * call that needs a region.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"

struct mgpu_real mgpu_real;

/* ---- the interposed-name table, generated from shim.def ---- */

struct mgpu_sym {
    const char *name;
    const char *base;
    int since;
    int ptsz;
    int nvml;
    void *wrapper;
    size_t real_off; /* offset of the real pointer in struct mgpu_real */
};

static const struct mgpu_sym g_syms[] = {
#define MGPU_CU(n, b, s, p) {#n, #b, s, p, 0, (void *)&n, offsetof(struct mgpu_real, n)},
#define MGPU_NVML(n) {#n, #n, 0, 0, 1, (void *)&n, offsetof(struct mgpu_real, n)},
#include "shim.def"
};
#define NSYMS (sizeof g_syms / sizeof g_syms[0])

static void *real_of(const struct mgpu_sym *s)
{
    void *p;
    memcpy(&p, (const char *)&mgpu_real + s->real_off, sizeof p);
    return p;
}

/* dlsym is called by sanitizer runtimes before they are initialised, so the
 * code on its pass-through path is not instrumented and calls no libc. */
#define MGPU_NO_SANITIZE __attribute__((no_sanitize("address", "undefined")))

MGPU_NO_SANITIZE static int str_eq(const char *a, const char *b)
{
    while (*a && *a == *b)
        a++, b++;
    return *a == *b;
}

MGPU_NO_SANITIZE static const struct mgpu_sym *sym_by_name(const char *name)
{
    if (!name || !((name[0] == 'c' && name[1] == 'u') || (name[0] == 'n' && name[1] == 'v')))
        return NULL;
    for (size_t i = 0; i < NSYMS; i++)
        if (str_eq(g_syms[i].name, name))
            return &g_syms[i];
    return NULL;
}

/* ---- the real dlsym ---- */

typedef void *(*dlsym_fn)(void *, const char *);
static _Atomic(dlsym_fn) g_real_dlsym;

MGPU_NO_SANITIZE static dlsym_fn real_dlsym(void)
{
    dlsym_fn f = atomic_load_explicit(&g_real_dlsym, memory_order_acquire);
    if (MGPU_LIKELY(f))
        return f;
    f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!f)
        f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    atomic_store_explicit(&g_real_dlsym, f, memory_order_release);
    return f;
}

static struct link_map *map_of(const void *addr)
{
    Dl_info info;
    struct link_map *lm = NULL;
    if (!addr || !dladdr1(addr, &info, (void **)&lm, RTLD_DL_LINKMAP))
        return NULL;
    return lm;
}

static struct link_map *self_map(void)
{
    return map_of((const void *)&self_map);
}

/* ---- fork ---- */

static pthread_mutex_t g_load_mu = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
static pthread_mutex_t g_init_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_peers_mu = PTHREAD_MUTEX_INITIALIZER; /* asking for peers' proc files */
static pthread_mutex_t g_wake_mu = PTHREAD_MUTEX_INITIALIZER;  /* fetching a wake socket */
static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;
static void reset_attachment(void);
static int still_wake(struct mgpu_dev *d, int fd);

static void atfork_child(void)
{
    /* Locks other threads of the parent held stay held in the child: start
     * them afresh.  The child never writes its parent's slot: it drops the
     * parent's attachment and attaches again on its next CUDA call. */
    pthread_mutex_t rec = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
    pthread_mutex_t plain = PTHREAD_MUTEX_INITIALIZER;
    g_load_mu = rec;
    g_init_mu = plain;
    g_peers_mu = plain;
    g_wake_mu = plain;
    mgpu_acct_mu = plain;
    reset_attachment();
    mgpu_mem_reset_after_fork();
    mgpu_launch_reset_after_fork();
}

static void register_atfork(void)
{
    pthread_atfork(NULL, NULL, atfork_child);
}

/* ---- loading the driver and NVML ---- */

struct lib {
    const char *env;
    const char *dflt;
    _Atomic int loaded; /* 0 not yet, 1 loaded, -1 failed */
    int loading;        /* guarded by g_load_mu: re-entered from the library's own init */
    struct link_map *map;
    char err[256];
};
static struct lib g_cuda = {.env = "MGPU_REAL_LIBCUDA", .dflt = "libcuda.so.1"};
static struct lib g_nvml = {.env = "MGPU_REAL_LIBNVML", .dflt = "libnvidia-ml.so.1"};

static void fill_cuda(void *h)
{
    dlsym_fn ds = real_dlsym();
#define MGPU_CU(n, b, s, p) mgpu_real.n = (__typeof__(mgpu_real.n))ds(h, #n);
#define MGPU_CU_REAL(n) mgpu_real.n = (__typeof__(mgpu_real.n))ds(h, #n);
#include "shim.def"
}

static void fill_nvml(void *h)
{
    dlsym_fn ds = real_dlsym();
#define MGPU_NVML(n) mgpu_real.n = (__typeof__(mgpu_real.n))ds(h, #n);
#define MGPU_NVML_REAL(n) mgpu_real.n = (__typeof__(mgpu_real.n))ds(h, #n);
#include "shim.def"
}

static int do_load(struct lib *l, const char *probe, void (*fill)(void *))
{
    const char *path = getenv(l->env);
    if (!path || !*path)
        path = l->dflt;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(l->err, sizeof l->err, "cannot load %s: %s", path, e ? e : "unknown error");
        return -1;
    }
    void *p = real_dlsym()(h, probe);
    struct link_map *lm = map_of(p);
    if (!p || !lm) {
        snprintf(l->err, sizeof l->err, "%s has no %s", path, probe);
        return -1;
    }
    if (lm == self_map()) {
        /* Never forward to ourselves (the shim installed under the driver's name). */
        snprintf(l->err, sizeof l->err, "%s resolves to the mgpu shim itself; set %s to the real library", path,
                 l->env);
        return -1;
    }
    l->map = lm;
    fill(h);
    return 0;
}

static int load(struct lib *l, const char *probe, void (*fill)(void *))
{
    int s = atomic_load_explicit(&l->loaded, memory_order_acquire);
    if (MGPU_LIKELY(s))
        return s > 0 ? 0 : -1;
    pthread_once(&g_atfork_once, register_atfork);
    pthread_mutex_lock(&g_load_mu);
    if (l->loading) { /* the library's own initialisation called back into us */
        pthread_mutex_unlock(&g_load_mu);
        return -1;
    }
    s = atomic_load_explicit(&l->loaded, memory_order_relaxed);
    if (!s) {
        l->loading = 1;
        s = do_load(l, probe, fill) == 0 ? 1 : -1;
        l->loading = 0;
        atomic_store_explicit(&l->loaded, s, memory_order_release);
    }
    pthread_mutex_unlock(&g_load_mu);
    return s > 0 ? 0 : -1;
}

int mgpu_load_cuda(void)
{
    int r = load(&g_cuda, "cuInit", fill_cuda);
    static _Atomic int said;
    if (r && atomic_load_explicit(&g_cuda.loaded, memory_order_relaxed) < 0 && !atomic_exchange(&said, 1))
        fprintf(stderr, "mgpu: %s\n", g_cuda.err);
    return r;
}

int mgpu_load_nvml(void)
{
    return load(&g_nvml, "nvmlInit_v2", fill_nvml);
}

/* ---- attaching ---- */

_Atomic int mgpu_state_now;
struct mgpu_dev *_Atomic mgpu_fast_dev;
unsigned mgpu_generation;
static struct mgpu_dev g_devs[MGPU_MAX_DEVICES];
static int g_ndevs;        /* ordinals 0..g_ndevs-1 */
static _Atomic int g_fast_checked;

/* An attach goes in two halves: the requests, one per device (attach_send),
 * and their replies (attach_finish).  cuInit sends the requests, lets the
 * real driver initialise while the enforcers answer, and only then reads
 * the replies, so that a process waits for the enforcer only as long as its
 * driver's initialisation does not already take.  Guarded by g_init_mu. */
#define MGPU_NO_REQUEST (-1) /* default mode: a device without an enforcer */
static struct {
    int active; /* requests sent, replies not read */
    int n;
    int open; /* MGPU_FAIL_OPEN=1 */
    unsigned idx[MGPU_MAX_DEVICES];
    int sock[MGPU_MAX_DEVICES]; /* or MGPU_NO_REQUEST */
} g_pend;

static void close_pending(int from)
{
    for (int k = from; k < g_pend.n; k++)
        if (g_pend.sock[k] >= 0)
            close(g_pend.sock[k]);
    g_pend.active = 0;
    g_pend.n = 0;
}

static void unmap_dev(struct mgpu_dev *d)
{
    if (d->region)
        munmap((void *)d->region, MGPU_CONTROL_FILE_SIZE);
    if (d->slot)
        munmap(d->slot, MGPU_PROC_FILE_SIZE);
    if (d->procs)
        munmap((void *)d->procs, (size_t)MGPU_PROC_FILE_SIZE * MGPU_REGION_MAX_PROCS);
    d->region = NULL;
    d->slot = NULL;
    d->procs = NULL;
}

static void reset_attachment(void)
{
    for (int i = 0; i < g_ndevs; i++) {
        int w = atomic_load(&g_devs[i].wake_fd1);
        if (w > 0 && still_wake(&g_devs[i], w - 1))
            close(w - 1);
        unmap_dev(&g_devs[i]);
        memset(&g_devs[i], 0, sizeof g_devs[i]);
    }
    g_ndevs = 0;
    close_pending(0); /* the parent's requests: the parent reads their replies */
    atomic_store(&mgpu_fast_dev, NULL);
    atomic_store(&g_fast_checked, 0);
    atomic_store(&mgpu_state_now, MGPU_ST_NONE);
    mgpu_generation++;
}

static const char *run_dir(void)
{
    const char *d = getenv("MGPU_RUN_DIR");
    return d && *d ? d : "/run/mgpu";
}

static int sock_path(char *buf, size_t len, unsigned idx)
{
    int n = snprintf(buf, len, "%s/gpu%u/client/client.sock", run_dir(), idx);
    return n < 0 || (size_t)n >= len ? -1 : 0;
}

/* One more than the highest X below MGPU_MAX_DEVICES whose
 * gpuX/client/client.sock exists in the run directory (0: none).  It
 * looks only at the gpuX entries the directory has: a stat of every
 * possible X was a tenth of a millisecond of each process's start. */
static int count_devices(void)
{
    DIR *dir = opendir(run_dir());
    if (!dir)
        return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dir))) {
        const char *c = e->d_name;
        if (strncmp(c, "gpu", 3) != 0 || c[3] < '0' || c[3] > '9' || (c[3] == '0' && c[4]))
            continue;
        unsigned x = 0;
        for (c += 3; *c >= '0' && *c <= '9' && x < MGPU_MAX_DEVICES; c++)
            x = x * 10 + (unsigned)(*c - '0');
        char rel[64];
        struct stat st;
        if (*c || x >= MGPU_MAX_DEVICES || (int)x < n)
            continue;
        snprintf(rel, sizeof rel, "gpu%u/client/client.sock", x);
        if (fstatat(dirfd(dir), rel, &st, 0) == 0)
            n = (int)x + 1;
    }
    closedir(dir);
    return n;
}

static int write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Sends a request with a pidfd of this process (mgpu_region.h: an
 * enforcer on Linux < 6.5, which cannot ask the kernel for the caller's
 * pidfd, identifies the caller by it; a newer one closes it).  A kernel
 * without pidfd_open (< 5.3) sends the request alone.  Returns 0 or -1. */
static int send_req(int s, const mgpu_attach_req_t *req)
{
#ifdef SYS_pidfd_open
    int pfd = (int)syscall(SYS_pidfd_open, (long)getpid(), 0L);
#else
    int pfd = -1;
#endif
    if (pfd < 0)
        return write_all(s, req, sizeof *req);
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } cbuf;
    memset(&cbuf, 0, sizeof cbuf);
    struct iovec iov = {(void *)req, sizeof *req};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf.buf, .msg_controllen = sizeof cbuf.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &pfd, sizeof pfd);
    ssize_t n;
    do
        n = sendmsg(s, &mh, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    close(pfd);
    if (n <= 0)
        return -1;
    return write_all(s, (const char *)req + n, sizeof *req - (size_t)n);
}

/* Reads the response and the descriptors that come with it (at most max,
 * the others are closed; *nfds says how many).  Returns 0, or -1 with err filled
 * and no descriptor left open. */
static int read_resp(int s, mgpu_attach_resp_t *resp, int *fds, unsigned *nfds, unsigned max, char *err, size_t errlen)
{
    size_t got = 0;
    *nfds = 0;
    while (got < sizeof *resp) {
        struct iovec iov = {(char *)resp + got, sizeof *resp - got};
        union {
            char buf[CMSG_SPACE(MGPU_REGION_MAX_PROCS * sizeof(int))];
            struct cmsghdr align;
        } cbuf;
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf.buf,
                            .msg_controllen = sizeof cbuf.buf};
        ssize_t n = recvmsg(s, &mh, MSG_CMSG_CLOEXEC);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            snprintf(err, errlen, "reading the response: %s",
                     errno == EAGAIN ? "timed out" : strerror(errno));
            goto fail;
        }
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                continue;
            size_t nfd = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < nfd; i++) {
                int f;
                memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof f);
                if (*nfds < max)
                    fds[(*nfds)++] = f;
                else
                    close(f);
            }
        }
        if (mh.msg_flags & MSG_CTRUNC) {
            snprintf(err, errlen, "the response's file descriptors did not fit (too many, or the process is at its "
                                  "open-file limit)");
            goto fail;
        }
        if (n == 0) {
            snprintf(err, errlen, "the enforcer closed the connection after %zu of %zu bytes", got,
                     sizeof *resp);
            goto fail;
        }
        got += (size_t)n;
    }
    return 0;
fail:
    for (unsigned i = 0; i < *nfds; i++)
        close(fds[i]);
    *nfds = 0;
    return -1;
}

/* Maps what an OK attach carries (mgpu_region.h): the control file
 * read-only, the own proc file read-write, and reserves the range the other
 * slots' files are mapped into when first needed.  Closes the descriptors.
 * Returns 0, or -1 with err filled and nothing mapped. */
static int map_region(struct mgpu_dev *d, const mgpu_attach_resp_t *resp, int *fds, unsigned nfds, unsigned idx,
                      char *err, size_t errlen)
{
    int rc = -1;
    struct stat st;
    if (nfds != MGPU_ATTACH_FDS) {
        snprintf(err, errlen, "the enforcer sent %u file descriptors, want %u", nfds, MGPU_ATTACH_FDS);
        goto out;
    }
    if (resp->control_size != MGPU_CONTROL_FILE_SIZE || resp->proc_size != MGPU_PROC_FILE_SIZE ||
        resp->slot >= MGPU_REGION_MAX_PROCS || fstat(fds[0], &st) || (uint64_t)st.st_size < MGPU_CONTROL_FILE_SIZE) {
        snprintf(err, errlen, "bad region (control %u bytes, proc files %u bytes, slot %u)", resp->control_size,
                 resp->proc_size, resp->slot);
        goto out;
    }
    void *ctl = mmap(NULL, MGPU_CONTROL_FILE_SIZE, PROT_READ, MAP_SHARED, fds[0], 0);
    if (ctl == MAP_FAILED) {
        snprintf(err, errlen, "mapping the control file: %s", strerror(errno));
        goto out;
    }
    d->region = ctl;
    void *own = mmap(NULL, MGPU_PROC_FILE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fds[1], 0);
    if (own == MAP_FAILED) {
        snprintf(err, errlen, "mapping the own proc file: %s", strerror(errno));
        goto out;
    }
    d->slot = own;
    char *base = mmap(NULL, (size_t)MGPU_PROC_FILE_SIZE * MGPU_REGION_MAX_PROCS, PROT_NONE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) {
        snprintf(err, errlen, "reserving the slots' range: %s", strerror(errno));
        goto out;
    }
    d->procs = base;
    const mgpu_control_t *rg = d->region;
    if (rg->magic != MGPU_REGION_MAGIC || rg->version != MGPU_REGION_VERSION || rg->size != MGPU_CONTROL_FILE_SIZE ||
        rg->max_procs != MGPU_REGION_MAX_PROCS || rg->device_index != idx) {
        snprintf(err, errlen, "bad region (magic %#x version %u size %u max_procs %u device %u)", rg->magic,
                 rg->version, rg->size, rg->max_procs, rg->device_index);
        goto out;
    }
    d->own = resp->slot;
    rc = 0;
out:
    for (unsigned i = 0; i < nfds; i++)
        close(fds[i]);
    if (rc)
        unmap_dev(d);
    return rc;
}

#define MGPU_REQUEST_TIMEOUT_MS 10000 /* attach and peers requests */
#define MGPU_WAKE_TIMEOUT_MS 100      /* a wake socket request: the enforcer that asked for wakes is up */
#define MGPU_WAKE_RETRY_NS 1000000000ull /* after a failed wake socket request */

/* Connects to device idx's client socket and sends a request with flags.
 * Returns the socket, or -1 with err filled. */
static int request(unsigned idx, uint32_t flags, int timeout_ms, char *path, size_t pathlen, char *err, size_t errlen)
{
    if (sock_path(path, pathlen, idx)) {
        snprintf(path, pathlen, "%s/gpu%u/client/client.sock", run_dir(), idx);
        snprintf(err, errlen, "path too long");
        return -1;
    }
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path) {
        snprintf(err, errlen, "path too long for a unix socket");
        return -1;
    }
    strcpy(sa.sun_path, path);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) {
        snprintf(err, errlen, "socket: %s", strerror(errno));
        return -1;
    }
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    int r;
    do
        r = connect(s, (struct sockaddr *)&sa, sizeof sa);
    while (r < 0 && errno == EINTR);
    if (r < 0) {
        snprintf(err, errlen, "%s", strerror(errno));
        close(s);
        return -1;
    }
    mgpu_attach_req_t req = {
        .magic = MGPU_ATTACH_MAGIC, .version = MGPU_ATTACH_VERSION, .flags = flags, .sock_fd = (uint32_t)s + 1};
    if (send_req(s, &req)) {
        snprintf(err, errlen, "sending the request: %s", strerror(errno));
        close(s);
        return -1;
    }
    return s;
}

/* Checks a response: 0 when it is an OK of this version, -1 with err filled
 * (the enforcer's message for a refusal). */
static int check_resp(mgpu_attach_resp_t *resp, char *err, size_t errlen)
{
    if (resp->magic != MGPU_ATTACH_MAGIC) {
        snprintf(err, errlen, "not an mgpu enforcer (bad response magic)");
        return -1;
    }
    if (resp->status != MGPU_ATTACH_OK) {
        resp->message[MGPU_ATTACH_MESSAGE_LEN - 1] = 0;
        for (char *c = resp->message; *c; c++)
            if (*c == '\n' || *c == '\r')
                *c = ' ';
        snprintf(err, errlen, "%s", resp->message[0] ? resp->message : "refused");
        return -1;
    }
    if (resp->version != MGPU_ATTACH_VERSION) {
        snprintf(err, errlen, "the enforcer speaks attach protocol %u, this shim %u: install the libmgpu-shim.so of "
                              "the enforcer's release", resp->version, MGPU_ATTACH_VERSION);
        return -1;
    }
    return 0;
}

/* Asks the enforcer for the proc files of the instance's other attached
 * processes and maps the ones not mapped yet.  Returns 0 or -1 (err). */
static int fetch_peers(struct mgpu_dev *d, char *err, size_t errlen)
{
    char path[PATH_MAX];
    int s = request(d->host_index, MGPU_ATTACH_FLAG_PEERS, MGPU_REQUEST_TIMEOUT_MS, path, sizeof path, err, errlen);
    if (s < 0)
        return -1;
    mgpu_attach_resp_t resp;
    memset(&resp, 0, sizeof resp);
    int fds[MGPU_REGION_MAX_PROCS];
    unsigned nfds = 0, used = 0;
    int r = read_resp(s, &resp, fds, &nfds, MGPU_REGION_MAX_PROCS, err, errlen);
    close(s);
    if (r)
        return -1;
    if (check_resp(&resp, err, errlen) == 0) {
        for (unsigned i = 0; i < MGPU_REGION_MAX_PROCS && used < nfds; i++) {
            if (!(resp.peers[i / 64] & (1ull << (i % 64))))
                continue;
            int fd = fds[used++];
            uint64_t bit = 1ull << (i % 64);
            if (i == d->own || (atomic_load(&d->mapped[i / 64]) & bit))
                continue;
            if (mmap(d->procs + (size_t)i * MGPU_PROC_FILE_SIZE, MGPU_PROC_FILE_SIZE, PROT_READ, MAP_SHARED | MAP_FIXED,
                     fd, 0) == MAP_FAILED) {
                snprintf(err, errlen, "mapping proc file %u: %s", i, strerror(errno));
                r = -1;
                break;
            }
            atomic_fetch_or(&d->mapped[i / 64], bit);
        }
    } else {
        r = -1;
    }
    for (unsigned i = 0; i < nfds; i++)
        close(fds[i]);
    return r;
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Asks the enforcer for the instance's wake socket, for epoch ep.  The
 * descriptor number a thread may be sending on never changes once set: a
 * new socket replaces the old one in place (dup3), so that no send can go
 * to a descriptor the application opened meanwhile.  Returns 0 or -1. */
static int fetch_wake(struct mgpu_dev *d, uint32_t ep)
{
    char path[PATH_MAX], err[256];
    int s = request(d->host_index, MGPU_ATTACH_FLAG_WAKE, MGPU_WAKE_TIMEOUT_MS, path, sizeof path, err, sizeof err);
    if (s < 0)
        return -1;
    mgpu_attach_resp_t resp;
    memset(&resp, 0, sizeof resp);
    int fd = -1;
    unsigned nfds = 0;
    int r = read_resp(s, &resp, &fd, &nfds, 1, err, sizeof err);
    close(s);
    if (r)
        return -1;
    if (check_resp(&resp, err, sizeof err) || nfds != 1) {
        if (nfds)
            close(fd);
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) || !S_ISSOCK(st.st_mode)) {
        close(fd);
        return -1;
    }
    int old = atomic_load(&d->wake_fd1);
    if (old > 0) {
        if (dup3(fd, old - 1, O_CLOEXEC) < 0) {
            close(fd);
            return -1;
        }
        close(fd);
    } else {
        atomic_store(&d->wake_fd1, fd + 1);
    }
    atomic_store(&d->wake_ino, (uint64_t)st.st_ino);
    atomic_store(&d->wake_epoch, ep);
    return 0;
}

/* Whether descriptor fd is still the wake socket: an application that
 * closes descriptors it did not open (closefrom) may have reused the
 * number for one of its own, which must never receive a datagram. */
static int still_wake(struct mgpu_dev *d, int fd)
{
    struct stat st;
    return fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) && (uint64_t)st.st_ino == atomic_load(&d->wake_ino);
}

void mgpu_wake(struct mgpu_dev *d)
{
    uint32_t ep = atomic_load_explicit(&d->region->enforcer_epoch, memory_order_acquire);
    int fd1 = atomic_load_explicit(&d->wake_fd1, memory_order_acquire);
    int saved = errno;
    if (fd1 > 0 && !still_wake(d, fd1 - 1)) {
        /* Not ours any more (checked again under the fetch mutex, which
         * a replacement holds): forget the number, never close it, and
         * ask for a new socket. */
        if (pthread_mutex_trylock(&g_wake_mu) != 0) {
            errno = saved;
            return;
        }
        if (atomic_load(&d->wake_fd1) == fd1 && !still_wake(d, fd1 - 1))
            atomic_store(&d->wake_fd1, 0);
        pthread_mutex_unlock(&g_wake_mu);
        fd1 = atomic_load(&d->wake_fd1);
    }
    errno = saved;
    if (fd1 <= 0 || atomic_load_explicit(&d->wake_epoch, memory_order_acquire) != ep) {
        /* One thread fetches; the others go on without waking (the
         * enforcer's tick comes anyway).  A failure is retried a second
         * later at the earliest. */
        if (mono_ns() < atomic_load(&d->wake_retry_ns) || pthread_mutex_trylock(&g_wake_mu) != 0)
            return;
        int r = 0;
        if (atomic_load(&d->wake_epoch) != ep || atomic_load(&d->wake_fd1) <= 0)
            r = fetch_wake(d, ep);
        if (r)
            atomic_store(&d->wake_retry_ns, mono_ns() + MGPU_WAKE_RETRY_NS);
        pthread_mutex_unlock(&g_wake_mu);
        errno = saved;
        fd1 = atomic_load(&d->wake_fd1);
        if (r || fd1 <= 0)
            return;
    }
    char b = 1;
    while (send(fd1 - 1, &b, 1, MSG_DONTWAIT | MSG_NOSIGNAL) < 0 && errno == EINTR)
        ;
    errno = saved;
}

/* Reads the reply to the attach request on socket s (closed here) and maps
 * device idx's region into d.  Returns 0, or -1 with err filled. */
static int attach_one(struct mgpu_dev *d, int s, unsigned idx, char *err, size_t errlen)
{
    mgpu_attach_resp_t resp;
    memset(&resp, 0, sizeof resp);
    int fds[MGPU_ATTACH_FDS];
    unsigned nfds = 0;
    int r2 = read_resp(s, &resp, fds, &nfds, MGPU_ATTACH_FDS, err, errlen);
    close(s);
    if (r2)
        return -1;
    if (check_resp(&resp, err, errlen))
        goto fail;
    unsigned n = nfds;
    nfds = 0;
    if (map_region(d, &resp, fds, n, idx, err, errlen))
        return -1;
    d->host_index = idx;
    d->limit = d->region->memory_limit;
    d->max_queued_ns = d->region->max_queued_ns;
    return 0;
fail:
    for (unsigned i = 0; i < nfds; i++)
        close(fds[i]);
    return -1;
}

/* MGPU_VISIBLE_DEVICES: a comma list of host indexes; ordinal k = k-th entry. */
static int parse_visible(const char *v, unsigned *out, int *n)
{
    *n = 0;
    const char *p = v;
    while (*p) {
        if (*p < '0' || *p > '9' || *n >= MGPU_MAX_DEVICES)
            return -1;
        unsigned long x = 0;
        while (*p >= '0' && *p <= '9') {
            x = x * 10 + (unsigned long)(*p - '0');
            if (x > 1000000)
                return -1;
            p++;
        }
        out[(*n)++] = (unsigned)x;
        if (*p == ',') {
            p++;
            if (!*p)
                return -1;
        } else if (*p) {
            return -1;
        }
    }
    return *n ? 0 : -1;
}

static void fail_line(const char *what, const char *err, int open)
{
    if (open)
        fprintf(stderr, "mgpu: %s: %s; MGPU_FAIL_OPEN=1 is set, running WITHOUT limits\n", what, err);
    else
        fprintf(stderr, "mgpu: %s: %s; set MGPU_FAIL_OPEN=1 to run without limits (debugging only)\n", what, err);
}

/* Sends the attach requests.  Returns MGPU_ST_NONE with the requests
 * pending, or the state a failure leaves (its line printed). */
static enum mgpu_state attach_send(void)
{
    const char *fo = getenv("MGPU_FAIL_OPEN");
    int open = fo && strcmp(fo, "1") == 0;
    char path[PATH_MAX], err[320], what[PATH_MAX + 32];
    unsigned *idx = g_pend.idx;
    int n = 0, explicit_list = 0;
    const char *vis = getenv("MGPU_VISIBLE_DEVICES");

    if (vis) {
        explicit_list = 1;
        if (parse_visible(vis, idx, &n)) {
            snprintf(what, sizeof what, "invalid MGPU_VISIBLE_DEVICES=\"%.64s\"", vis);
            fail_line(what, "want a comma list of device indexes", open);
            return open ? MGPU_ST_OPEN : MGPU_ST_FAILED;
        }
    } else {
        /* Default: ordinal k is host device k, for the devices that have a socket. */
        n = count_devices();
        for (int i = 0; i < n; i++)
            idx[i] = (unsigned)i;
        if (n == 0) { /* no enforcer at all: report device 0 */
            idx[0] = 0;
            n = 1;
        }
    }
    g_pend.open = open;
    g_pend.n = 0;
    for (int k = 0; k < n; k++) {
        struct stat st;
        g_pend.n = k + 1;
        g_pend.sock[k] = MGPU_NO_REQUEST;
        if (!explicit_list && n > 1 && sock_path(path, sizeof path, idx[k]) == 0 && stat(path, &st) != 0)
            continue; /* default mode: a device without an enforcer is refused, not attached */
        int sk = request(idx[k], 0, MGPU_REQUEST_TIMEOUT_MS, path, sizeof path, err, sizeof err);
        if (sk < 0) {
            close_pending(0);
            snprintf(what, sizeof what, "cannot attach to %s", path);
            fail_line(what, err, open);
            return open ? MGPU_ST_OPEN : MGPU_ST_FAILED;
        }
        g_pend.sock[k] = sk;
    }
    g_pend.active = 1;
    return MGPU_ST_NONE;
}

/* Reads the replies of the pending requests and maps the regions. */
static enum mgpu_state attach_finish(void)
{
    char path[PATH_MAX], err[320], what[PATH_MAX + 32];
    int n = g_pend.n, open = g_pend.open;
    for (int k = 0; k < n; k++) {
        struct mgpu_dev *d = &g_devs[k];
        memset(d, 0, sizeof *d);
        d->ordinal = k;
        int sk = g_pend.sock[k];
        if (sk == MGPU_NO_REQUEST)
            continue;
        g_pend.sock[k] = MGPU_NO_REQUEST; /* closed by attach_one */
        if (attach_one(d, sk, g_pend.idx[k], err, sizeof err)) {
            close_pending(k + 1);
            for (int j = 0; j < k; j++)
                unmap_dev(&g_devs[j]);
            memset(d, 0, sizeof *d);
            if (sock_path(path, sizeof path, g_pend.idx[k]))
                snprintf(path, sizeof path, "%s/gpu%u/client/client.sock", run_dir(), g_pend.idx[k]);
            snprintf(what, sizeof what, "cannot attach to %s", path);
            fail_line(what, err, open);
            return open ? MGPU_ST_OPEN : MGPU_ST_FAILED;
        }
    }
    g_pend.active = 0;
    g_ndevs = n;
    return MGPU_ST_READY;
}

enum mgpu_state mgpu_ensure(void)
{
    /* A forked child starts at MGPU_ST_NONE again: the pthread_atfork child
     * handler (registered on first use) drops the parent's attachment. */
    int s = atomic_load_explicit(&mgpu_state_now, memory_order_acquire);
    if (MGPU_LIKELY(s != MGPU_ST_NONE))
        return (enum mgpu_state)s;
    pthread_once(&g_atfork_once, register_atfork);
    pthread_mutex_lock(&g_init_mu);
    s = atomic_load_explicit(&mgpu_state_now, memory_order_relaxed);
    if (s == MGPU_ST_NONE) {
        if (!g_pend.active)
            s = attach_send();
        if (s == MGPU_ST_NONE)
            s = attach_finish();
        atomic_store_explicit(&mgpu_state_now, s, memory_order_release);
    }
    pthread_mutex_unlock(&g_init_mu);
    return (enum mgpu_state)s;
}

/* Sends the attach requests unless they have been sent or answered
 * (mgpu_ensure reads the replies).  Returns MGPU_ST_NONE while they are
 * pending, else the state reached. */
static enum mgpu_state attach_ahead(void)
{
    int s = atomic_load_explicit(&mgpu_state_now, memory_order_acquire);
    if (s != MGPU_ST_NONE)
        return (enum mgpu_state)s;
    pthread_once(&g_atfork_once, register_atfork);
    pthread_mutex_lock(&g_init_mu);
    s = atomic_load_explicit(&mgpu_state_now, memory_order_relaxed);
    if (s == MGPU_ST_NONE && !g_pend.active) {
        s = attach_send();
        if (s != MGPU_ST_NONE)
            atomic_store_explicit(&mgpu_state_now, s, memory_order_release);
    }
    pthread_mutex_unlock(&g_init_mu);
    return (enum mgpu_state)s;
}

struct mgpu_dev *mgpu_dev_by_ordinal(int ordinal)
{
    if (ordinal < 0 || ordinal >= g_ndevs || !g_devs[ordinal].region)
        return NULL;
    return &g_devs[ordinal];
}

struct mgpu_dev *mgpu_dev_by_host_index(unsigned idx)
{
    for (int i = 0; i < g_ndevs; i++)
        if (g_devs[i].region && g_devs[i].host_index == idx)
            return &g_devs[i];
    return NULL;
}

/* The fast path skips cuCtxGetDevice when the driver shows exactly one
 * device and it is managed. */
static void check_fast(void)
{
    if (atomic_load_explicit(&g_fast_checked, memory_order_acquire))
        return;
    int count = 0;
    if (!REAL(cuDeviceGetCount) || REAL(cuDeviceGetCount)(&count) != CUDA_SUCCESS)
        return; /* not initialised yet: try again later */
    pthread_mutex_lock(&g_init_mu);
    if (count == 1 && g_ndevs >= 1 && g_devs[0].region)
        atomic_store_explicit(&mgpu_fast_dev, &g_devs[0], memory_order_release);
    atomic_store_explicit(&g_fast_checked, 1, memory_order_release);
    pthread_mutex_unlock(&g_init_mu);
}

struct mgpu_dev *mgpu_current_dev(CUresult *err)
{
    struct mgpu_dev *d = atomic_load_explicit(&mgpu_fast_dev, memory_order_acquire);
    if (d)
        return d;
    check_fast();
    d = atomic_load_explicit(&mgpu_fast_dev, memory_order_acquire);
    if (d)
        return d;
    CUdevice dev;
    CUresult r = REAL(cuCtxGetDevice) ? REAL(cuCtxGetDevice)(&dev) : CUDA_ERROR_NOT_INITIALIZED;
    if (r != CUDA_SUCCESS) {
        *err = r;
        return NULL;
    }
    d = mgpu_dev_by_ordinal(dev);
    if (!d)
        *err = CUDA_ERROR_INVALID_DEVICE;
    return d;
}

CUresult mgpu_resolve_dev(int ordinal, struct mgpu_dev **pd)
{
    *pd = NULL;
    if (mgpu_load_cuda())
        return CUDA_ERROR_NOT_INITIALIZED;
    enum mgpu_state s = mgpu_ensure();
    if (s == MGPU_ST_FAILED)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (s == MGPU_ST_OPEN)
        return CUDA_SUCCESS;
    CUresult err = CUDA_ERROR_INVALID_DEVICE;
    *pd = ordinal < 0 ? mgpu_current_dev(&err) : mgpu_dev_by_ordinal(ordinal);
    return *pd ? CUDA_SUCCESS : err;
}

/* Maps slot i, taken after the enforcer last answered a peers request:
 * asks again (twice at most).  Returns 0, or -1 when the slot stays
 * unknown. */
static int map_peer(struct mgpu_dev *d, unsigned i)
{
    uint64_t bit = 1ull << (i % 64);
    for (int tries = 0; !(atomic_load(&d->mapped[i / 64]) & bit); tries++) {
        /* A slot being freed may still show its bit: its pid goes first. */
        if (atomic_load(&d->region->slots[i].pid) == 0)
            return 0;
        if (tries == 2)
            return -1;
        char err[256];
        pthread_mutex_lock(&g_peers_mu);
        int r = (atomic_load(&d->mapped[i / 64]) & bit) ? 0 : fetch_peers(d, err, sizeof err);
        pthread_mutex_unlock(&g_peers_mu);
        if (r) {
            fprintf(stderr, "mgpu: cannot read the instance's other processes' memory (%s); the allocation fails\n",
                    err);
            return -1;
        }
    }
    return 0;
}

/* A slot's mem_reserved; with held, less its mem_ahead. */
static uint64_t held_of(const mgpu_proc_t *p, int held)
{
    uint64_t v = atomic_load(&p->mem_reserved);
    if (held) {
        uint64_t a = atomic_load(&p->mem_ahead);
        v = a < v ? v - a : 0;
    }
    return v;
}

uint64_t mgpu_instance_used(struct mgpu_dev *d, int held)
{
    /* The own slot through its writable mapping; the other taken slots
     * (control->used) through read-only mappings, asked for from the
     * enforcer the first time a slot is seen taken.  A slot's counters are
     * zero whenever its bit is clear (the enforcer clears them first), and
     * a mapping of a slot never goes stale (mgpu_region.h), so a slot freed
     * meanwhile adds 0.  A slot's value is what its process claims: a huge
     * one makes this instance's allocations fail, never another's.  With
     * held, what the slots' allocations hold (mem_reserved less mem_ahead):
     * what the processes are told, never what reservations check. */
    uint64_t sum = held_of(d->slot, held);
    for (unsigned w = 0; w < MGPU_REGION_MAX_PROCS / 64; w++) {
        uint64_t taken = atomic_load(&d->region->used[w]);
        if (w == d->own / 64)
            taken &= ~(1ull << (d->own % 64));
        for (; taken; taken &= taken - 1) {
            unsigned i = w * 64 + (unsigned)__builtin_ctzll(taken);
            uint64_t bit = 1ull << (i % 64);
            if (!(atomic_load(&d->mapped[w]) & bit)) {
                if (map_peer(d, i))
                    return UINT64_MAX; /* unknown: fail closed */
                if (!(atomic_load(&d->mapped[w]) & bit))
                    continue; /* freed meanwhile */
            }
            const mgpu_proc_t *p = (const mgpu_proc_t *)(const void *)(d->procs + (size_t)i * MGPU_PROC_FILE_SIZE);
            uint64_t v = held_of(p, held);
            sum = sum + v < sum ? UINT64_MAX : sum + v;
        }
    }
    return sum;
}

/* ---- cuInit ---- */

MGPU_EXPORT CUresult cuInit(unsigned int Flags)
{
    if (mgpu_load_cuda())
        return CUDA_ERROR_NOT_INITIALIZED;
    /* The requests go first and the real driver initialises while the
     * enforcers answer.  A process that cannot even ask never initialises
     * the real driver; one refused in the reply has initialised it (no
     * context, no device memory) and fails here all the same. */
    enum mgpu_state s = attach_ahead();
    if (s == MGPU_ST_FAILED)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = REAL(cuInit)(Flags);
    s = mgpu_ensure();
    if (s == MGPU_ST_FAILED)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (r == CUDA_SUCCESS && s == MGPU_ST_READY)
        check_fast();
    return r;
}

/* ---- cuGetProcAddress ---- */

static void *substitute(const char *symbol, void *p, int ver, cuuint64_t flags)
{
    /* Exact: the driver handed out one of the entry points we interpose. */
    for (size_t i = 0; i < NSYMS; i++)
        if (!g_syms[i].nvml && real_of(&g_syms[i]) == p)
            return g_syms[i].wrapper;
    /* By name, for drivers whose table pointers differ from their exports. */
    int want = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    const struct mgpu_sym *best = NULL;
    for (int pass = 0; pass < 2 && !best; pass++) {
        for (size_t i = 0; i < NSYMS; i++) {
            const struct mgpu_sym *s = &g_syms[i];
            if (s->nvml || s->ptsz != (pass == 0 ? want : 0) || s->since > ver || strcmp(s->base, symbol))
                continue;
            if (!best || s->since > best->since)
                best = s;
        }
        if (!want)
            break;
    }
    return best ? best->wrapper : p;
}

MGPU_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                         CUdriverProcAddressQueryResult *symbolStatus)
{
    if (mgpu_load_cuda() || !REAL(cuGetProcAddress_v2))
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = REAL(cuGetProcAddress_v2)(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (r == CUDA_SUCCESS && symbol && pfn && *pfn)
        *pfn = substitute(symbol, *pfn, cudaVersion, flags);
    return r;
}

MGPU_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    if (mgpu_load_cuda() || !REAL(cuGetProcAddress))
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = REAL(cuGetProcAddress)(symbol, pfn, cudaVersion, flags);
    if (r == CUDA_SUCCESS && symbol && pfn && *pfn)
        *pfn = substitute(symbol, *pfn, cudaVersion, flags);
    return r;
}

/* ---- dlsym ---- */

static void *dlsym_override_cuda(const struct mgpu_sym *s, void *handle, const char *name, const void *caller);

/* Returns the wrapper to hand out instead of what the real dlsym finds, or
 * NULL to answer exactly as the real dlsym does. */
MGPU_NO_SANITIZE static void *dlsym_override(void *handle, const char *name, const void *caller)
{
    const struct mgpu_sym *s = sym_by_name(name);
    if (!s || handle == RTLD_DEFAULT) /* RTLD_DEFAULT already finds our export first */
        return NULL;
    return dlsym_override_cuda(s, handle, name, caller);
}

static void *dlsym_override_cuda(const struct mgpu_sym *s, void *handle, const char *name, const void *caller)
{
    if (s->nvml ? mgpu_load_nvml() : mgpu_load_cuda())
        return NULL;
    struct link_map *drv = s->nvml ? g_nvml.map : g_cuda.map;
    struct link_map *from = map_of(caller);
    if (from == g_cuda.map || from == g_nvml.map || from == self_map())
        return NULL; /* the driver's own lookups get the driver's own symbols */
    if (!real_of(s))
        return NULL;
    if (handle == RTLD_NEXT)
        return s->wrapper;
    void *p = real_dlsym()(handle, name);
    return p && map_of(p) == drv ? s->wrapper : NULL;
}

MGPU_NO_SANITIZE MGPU_EXPORT void *dlsym(void *handle, const char *name)
{
    void *w = dlsym_override(handle, name, __builtin_return_address(0));
    if (w)
        return w;
    /* A tail call: the real dlsym sees our caller's return address, which
     * RTLD_NEXT (and the caller's namespace) depend on. */
    return real_dlsym()(handle, name);
}
