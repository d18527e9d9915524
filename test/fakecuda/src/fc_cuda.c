/*
 * fc_cuda.c - libcuda.so.1 of the simulated GPU (a test fixture, never a
 * driver).  See README.md for what it reads and how it behaves.
 *
 * Per process: contexts, streams (one worker thread each, fed through a ring
 * buffer), events, modules, graphs and a table of fake device allocations.
 * Per device, shared by all processes: fc_state.h.
 */
#define _GNU_SOURCE
#include "mgpu_cuda.h"
#include "fc_state.h"

#include <errno.h>
#include <sched.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define FC_API __attribute__((visibility("default")))
#define FC_DRIVER_VERSION 12040
#define FC_ERROR_ILLEGAL_STATE ((CUresult)401)
#define FC_RING 4096u
#define FC_CTX_STACK 16
#define FC_ADDR_BASE 0x7f0000000000ULL
#define FC_ADDR_ALIGN (2ULL << 20)

enum { M_CTX = 0x43545801, M_STREAM, M_EVENT, M_MODULE, M_FUNC, M_GRAPH, M_NODE, M_EXEC, M_POOL };
enum { OP_KERNEL = 1, OP_EVENT, OP_FREE };
enum { K_LINEAR = 1, K_ARRAY, K_VMM };

struct fc_op {
    uint32_t kind;
    uint64_t arg;
    void *ptr;
    uint64_t at; /* when it was queued (fc_now_ns), set by push_locked */
};

struct CUstream_st {
    uint32_t magic;
    CUcontext ctx;
    unsigned flags;
    int builtin; /* legacy or per-thread default stream */
    pthread_mutex_t pmu; /* serialises producers */
    _Atomic uint64_t tail;
    _Atomic uint64_t head;
    _Atomic uint32_t wsleep, wseq, dseq, dwaiters;
    _Atomic int stop;
    int capturing;   /* CUstreamCaptureStatus */
    CUgraph capture; /* graph being captured */
    struct CUstream_st *next;
    struct fc_op ring[FC_RING];
};

struct CUctx_st {
    uint32_t magic;
    int ordinal;
    int host;
    int primary;
    int refs;
    uint64_t id;
    pthread_mutex_t mu;
    struct CUstream_st *streams;
    struct CUstream_st *legacy;
    struct CUctx_st *gnext; /* g.ctxs */
};

struct CUevent_st {
    uint32_t magic;
    unsigned flags;
    _Atomic uint64_t rec, done;
    uint64_t ts;
    pthread_mutex_t mu;
    _Atomic uint32_t eseq, ewaiters;
    _Atomic int refs;
};

struct CUfunc_st {
    uint32_t magic;
    CUmodule mod;
    struct CUfunc_st *next;
    char name[];
};

struct CUmod_st {
    uint32_t magic;
    CUcontext ctx;
    struct CUfunc_st *funcs;
};

struct CUgraphNode_st {
    uint32_t magic;
    CUgraph graph;
    uint64_t dur;
    struct CUgraphNode_st *next;
};

struct CUgraph_st {
    uint32_t magic;
    struct CUgraphNode_st *first, *last;
    size_t n;
};

struct CUgraphExec_st {
    uint32_t magic;
    size_t n;
    uint64_t *durs;
};

struct CUmemPoolHandle_st {
    uint32_t magic;
    int ordinal;
    int is_default;
};

struct fc_alloc {
    CUdeviceptr base;
    uint64_t size;
    int host;
    int kind;
    uint64_t ctx_id;
};

/* ---- process state ---- */
static struct {
    pthread_mutex_t mu; /* init, contexts */
    pthread_mutex_t amu; /* allocation table */
    pid_t pid;
    unsigned gen; /* bumped in a forked child: invalidates thread-locals */
    int inited;
    CUresult init_result;
    int ndev;
    int host[FC_MAX_DEVICES];
    struct fc_dev *dev[FC_MAX_DEVICES]; /* by host index, kept across fork */
    int proc[FC_MAX_DEVICES];           /* entry in dev's process table, by host index */
    struct CUctx_st primary[FC_MAX_DEVICES];
    struct CUmemPoolHandle_st pools[FC_MAX_DEVICES];
    uint64_t next_ctx_id;
    struct CUctx_st *ctxs; /* created (non-primary) contexts */
    struct fc_alloc *allocs;
    size_t nallocs, capallocs;
    CUdeviceptr next_addr;
    pthread_key_t tls_key;
} g = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .amu = PTHREAD_MUTEX_INITIALIZER,
    .next_addr = FC_ADDR_BASE,
};

struct fc_tls {
    unsigned gen;
    int depth;
    CUcontext stack[FC_CTX_STACK];
    int nptds;
    uint64_t ptds_ctx[FC_CTX_STACK];
    struct CUstream_st *ptds[FC_CTX_STACK];
};

static __thread struct fc_tls *tls;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static long futex_private(_Atomic uint32_t *addr, int op, uint32_t val)
{
    return syscall(SYS_futex, (uint32_t *)addr, op | FUTEX_PRIVATE_FLAG, val, NULL, NULL, 0);
}

/* ---- fork and thread exit ---- */
static void fork_prepare(void)
{
    pthread_mutex_lock(&g.mu);
    pthread_mutex_lock(&g.amu);
}

static void fork_parent(void)
{
    pthread_mutex_unlock(&g.amu);
    pthread_mutex_unlock(&g.mu);
}

static void reset_process_locked(void)
{
    g.inited = 0;
    g.gen++;
    for (int i = 0; i < FC_MAX_DEVICES; i++)
        g.proc[i] = -1;
    memset(g.primary, 0, sizeof(g.primary));
    g.ctxs = NULL; /* the parent's contexts are not the child's */
    free(g.allocs);
    g.allocs = NULL;
    g.nallocs = g.capallocs = 0;
}

static void fork_child(void)
{
    pthread_mutex_init(&g.mu, NULL);
    pthread_mutex_init(&g.amu, NULL);
    g.pid = getpid();
    reset_process_locked();
}

static void stream_release(struct CUstream_st *s);
static CUcontext ctx_by_id_locked(uint64_t id);

static void tls_destroy(void *p)
{
    struct fc_tls *t = p;
    if (t->gen == g.gen) {
        pthread_mutex_lock(&g.mu);
        for (int i = 0; i < t->nptds; i++) {
            CUcontext c = ctx_by_id_locked(t->ptds_ctx[i]);
            if (c) {
                pthread_mutex_lock(&c->mu);
                for (struct CUstream_st **pp = &c->streams; *pp; pp = &(*pp)->next) {
                    if (*pp == t->ptds[i]) {
                        *pp = t->ptds[i]->next;
                        break;
                    }
                }
                pthread_mutex_unlock(&c->mu);
                stream_release(t->ptds[i]);
            }
        }
        pthread_mutex_unlock(&g.mu);
    }
    free(t);
}

static void once_init(void)
{
    pthread_atfork(fork_prepare, fork_parent, fork_child);
    pthread_key_create(&g.tls_key, tls_destroy);
    for (int i = 0; i < FC_MAX_DEVICES; i++)
        g.proc[i] = -1;
}

static struct fc_tls *get_tls(void)
{
    if (tls && tls->gen == g.gen)
        return tls;
    if (!tls) {
        tls = calloc(1, sizeof(*tls));
        if (!tls)
            return NULL;
        pthread_setspecific(g.tls_key, tls);
    }
    memset(tls, 0, sizeof(*tls));
    tls->gen = g.gen;
    return tls;
}

/* ---- errors ---- */
#define FC_ERRORS(X)                                                                          \
    X(CUDA_SUCCESS, "no error")                                                               \
    X(CUDA_ERROR_INVALID_VALUE, "invalid argument")                                           \
    X(CUDA_ERROR_OUT_OF_MEMORY, "out of memory")                                              \
    X(CUDA_ERROR_NOT_INITIALIZED, "initialization error")                                     \
    X(CUDA_ERROR_DEINITIALIZED, "driver shutting down")                                       \
    X(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected")                             \
    X(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal")                                    \
    X(CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid")                             \
    X(CUDA_ERROR_INVALID_CONTEXT, "invalid device context")                                   \
    X(CUDA_ERROR_OPERATING_SYSTEM, "OS call failed or operation not supported on this OS")    \
    X(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle")                                   \
    X(CUDA_ERROR_ILLEGAL_STATE, "the operation cannot be performed in the present state")     \
    X(CUDA_ERROR_NOT_FOUND, "named symbol not found")                                         \
    X(CUDA_ERROR_NOT_READY, "device not ready")                                               \
    X(CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure")                                 \
    X(CUDA_ERROR_NOT_PERMITTED, "operation not permitted")                                    \
    X(CUDA_ERROR_NOT_SUPPORTED, "operation not supported")                                    \
    X(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "operation not permitted when stream is capturing") \
    X(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "operation failed due to a previous error during capture") \
    X(CUDA_ERROR_UNKNOWN, "unknown error")

#define CUDA_ERROR_ILLEGAL_STATE FC_ERROR_ILLEGAL_STATE
static const struct fc_error {
    CUresult code;
    const char *name, *text;
} errors[] = {
#define X(c, t) {c, #c, t},
    FC_ERRORS(X)
#undef X
};

/* The entry of code in errors, or NULL. */
static const struct fc_error *find_error(CUresult code)
{
    for (size_t i = 0; i < sizeof(errors) / sizeof(errors[0]); i++)
        if (errors[i].code == code)
            return &errors[i];
    return NULL;
}

FC_API CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    const struct fc_error *e = find_error(error);
    *pStr = e ? e->name : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FC_API CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    const struct fc_error *e = find_error(error);
    *pStr = e ? e->text : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- initialisation ---- */
struct keeper_arg {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;
    int ok;
};

/* The keeper thread lives as long as the process and holds the process's
 * liveness mutex in every device it uses (see fc_proc.alive). */
static void *keeper_main(void *p)
{
    struct keeper_arg *a = p;
    int ok = 1;
    uint64_t pidns = fc_self_pidns();
    for (int k = 0; k < g.ndev; k++) {
        int h = g.host[k];
        g.proc[h] = fc_proc_register(g.dev[h], (int)getpid(), pidns);
        if (g.proc[h] < 0)
            ok = 0;
    }
    pthread_mutex_lock(&a->mu);
    a->ok = ok;
    a->done = 1;
    pthread_cond_signal(&a->cv);
    pthread_mutex_unlock(&a->mu);
    for (;;)
        pause(); /* all signals are blocked in this thread */
    return NULL;
}

static int start_thread(pthread_t *t, void *(*fn)(void *), void *arg)
{
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* never take the process's signals */
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&at, 256 * 1024);
    int r = pthread_create(t, &at, fn, arg);
    pthread_attr_destroy(&at);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return r;
}

static int parse_visible(int total, int *host)
{
    const char *s = getenv("CUDA_VISIBLE_DEVICES");
    if (!s) {
        for (int i = 0; i < total; i++)
            host[i] = i;
        return total;
    }
    int n = 0;
    while (*s && n < total) {
        while (*s == ' ')
            s++;
        const char *e = s;
        while (*e && *e != ',')
            e++;
        int idx = -1;
        if (e > s && strncmp(s, "GPU-", 4) == 0) {
            for (int i = 0; i < total && idx < 0; i++) {
                char u[64];
                fc_uuid_string(i, u, sizeof(u));
                if ((size_t)(e - s) <= strlen(u) && strncmp(u, s, (size_t)(e - s)) == 0)
                    idx = i;
            }
        } else if (e > s) {
            char *end = NULL;
            long v = strtol(s, &end, 10);
            if (end == e && v >= 0 && v < total)
                idx = (int)v;
        }
        if (idx < 0)
            break; /* like the real driver, an invalid entry ends the list */
        for (int i = 0; i < n; i++)
            if (host[i] == idx)
                return n;
        host[n++] = idx;
        s = *e ? e + 1 : e;
    }
    return n;
}

static CUresult do_init(void)
{
    const char *bad = "";
    if (fc_env_model(&bad) < 0) {
        fprintf(stderr, "fakecuda: unknown FAKECUDA_DEVICE_MODEL=%s (want slice, timer or kernel)\n", bad);
        return CUDA_ERROR_INVALID_VALUE;
    }
    int total = fc_env_devices();
    g.ndev = parse_visible(total, g.host);
    if (g.ndev == 0)
        return CUDA_ERROR_NO_DEVICE;
    for (int k = 0; k < g.ndev; k++) {
        int h = g.host[k];
        if (!g.dev[h]) {
            g.dev[h] = fc_dev_open(h, 1);
            if (!g.dev[h]) {
                fprintf(stderr, "fakecuda: device %d state in %s: %s\n", h, fc_env_state_dir(), strerror(errno));
                return CUDA_ERROR_OPERATING_SYSTEM;
            }
        }
    }
    for (int k = 0; k < g.ndev; k++) {
        struct CUmemPoolHandle_st *p = &g.pools[k];
        p->magic = M_POOL;
        p->ordinal = k;
        p->is_default = 1;
    }
    struct keeper_arg a = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    pthread_t t;
    if (start_thread(&t, keeper_main, &a)) {
        fprintf(stderr, "fakecuda: cannot start the keeper thread\n");
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    pthread_mutex_lock(&a.mu);
    while (!a.done)
        pthread_cond_wait(&a.cv, &a.mu);
    pthread_mutex_unlock(&a.mu);
    if (!a.ok) {
        fprintf(stderr, "fakecuda: device process table full\n");
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    return CUDA_SUCCESS;
}

FC_API CUresult cuInit(unsigned int Flags)
{
    if (Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&once, once_init);
    pthread_mutex_lock(&g.mu);
    if (g.inited && g.pid != getpid())
        reset_process_locked(); /* forked without pthread_atfork (raw clone) */
    if (!g.inited) {
        g.pid = getpid();
        g.init_result = do_init();
        g.inited = 1;
    }
    CUresult r = g.init_result;
    pthread_mutex_unlock(&g.mu);
    return r;
}

static inline CUresult check_init(void)
{
    if (!g.inited || g.init_result != CUDA_SUCCESS)
        return CUDA_ERROR_NOT_INITIALIZED;
    return CUDA_SUCCESS;
}

FC_API CUresult cuDriverGetVersion(int *driverVersion)
{
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = FC_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

/* ---- devices ---- */
#define CHECK_INIT()                            \
    do {                                        \
        CUresult r_ = check_init();             \
        if (r_ != CUDA_SUCCESS)                 \
            return r_;                          \
    } while (0)

static int valid_dev(CUdevice dev)
{
    return dev >= 0 && dev < g.ndev;
}

FC_API CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    CHECK_INIT();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(ordinal))
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGetCount(int *count)
{
    CHECK_INIT();
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = g.ndev;
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    CHECK_INIT();
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "%s", g.dev[g.host[dev]]->name);
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    CHECK_INIT();
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    fc_uuid_bytes(g.host[dev], (unsigned char *)uuid->bytes);
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    return cuDeviceGetUuid(uuid, dev);
}

FC_API CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    CHECK_INIT();
    if (!pi)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *pi = 108; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: *pi = 0x10 + g.host[dev]; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: *pi = 0; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *pi = 8; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *pi = 0; break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY:
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH:
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: *pi = 1; break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CHECK_INIT();
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *bytes = (size_t)g.dev[g.host[dev]]->mem_total;
    return CUDA_SUCCESS;
}

/* ---- contexts ---- */
/* The live context with this id (primary or created), or NULL. */
static CUcontext ctx_by_id_locked(uint64_t id)
{
    for (int i = 0; i < FC_MAX_DEVICES; i++)
        if (g.primary[i].magic == M_CTX && g.primary[i].id == id)
            return &g.primary[i];
    for (CUcontext c = g.ctxs; c; c = c->gnext)
        if (c->id == id)
            return c;
    return NULL;
}

static CUcontext current_ctx(void)
{
    struct fc_tls *t = get_tls();
    if (!t || t->depth == 0)
        return NULL;
    return t->stack[t->depth - 1];
}

static int valid_ctx(CUcontext c)
{
    return c && c->magic == M_CTX;
}

static void ctx_setup(CUcontext c, int ordinal, int primary)
{
    memset(c, 0, sizeof(*c));
    c->magic = M_CTX;
    c->ordinal = ordinal;
    c->host = g.host[ordinal];
    c->primary = primary;
    c->id = ++g.next_ctx_id;
    pthread_mutex_init(&c->mu, NULL);
}

static void free_ctx_allocs(uint64_t ctx_id);

/* A context of this process on host device h came (+1) or went (-1): NVML
 * lists processes that have one. */
static void ctx_count(int h, int delta)
{
    fc_proc_ctx(g.dev[h], g.proc[h], delta);
}

/* Destroys a context's streams and memory (destroy, or primary reset). */
static void ctx_teardown(CUcontext c)
{
    pthread_mutex_lock(&c->mu);
    struct CUstream_st *s = c->streams;
    c->streams = NULL;
    c->legacy = NULL;
    pthread_mutex_unlock(&c->mu);
    while (s) {
        struct CUstream_st *n = s->next;
        stream_release(s);
        s = n;
    }
    free_ctx_allocs(c->id);
}

FC_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    CHECK_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g.mu);
    CUcontext c = &g.primary[dev];
    if (c->magic != M_CTX)
        ctx_setup(c, dev, 1);
    if (c->refs++ == 0)
        ctx_count(c->host, 1);
    pthread_mutex_unlock(&g.mu);
    *pctx = c;
    return CUDA_SUCCESS;
}

FC_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    CHECK_INIT();
    if (!valid_dev(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g.mu);
    CUcontext c = &g.primary[dev];
    if (c->magic != M_CTX || c->refs <= 0) {
        pthread_mutex_unlock(&g.mu);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (--c->refs == 0) {
        /* The last release resets the primary context, like the driver;
         * the new id invalidates per-thread streams of the old one. */
        ctx_teardown(c);
        c->id = ++g.next_ctx_id;
        ctx_count(c->host, -1);
    }
    pthread_mutex_unlock(&g.mu);
    return CUDA_SUCCESS;
}

static CUresult push_ctx(CUcontext c)
{
    struct fc_tls *t = get_tls();
    if (!t)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (t->depth == FC_CTX_STACK)
        return CUDA_ERROR_INVALID_VALUE;
    t->stack[t->depth++] = c;
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CHECK_INIT();
    if (!pctx || flags > 0x3f)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    CUcontext c = malloc(sizeof(*c));
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g.mu);
    ctx_setup(c, dev, 0);
    c->gnext = g.ctxs;
    g.ctxs = c;
    ctx_count(c->host, 1);
    pthread_mutex_unlock(&g.mu);
    CUresult r = push_ctx(c);
    if (r != CUDA_SUCCESS) {
        cuCtxDestroy_v2(c);
        return r;
    }
    *pctx = c;
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    CHECK_INIT();
    if (!valid_ctx(ctx) || ctx->primary)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct fc_tls *t = get_tls();
    if (t) {
        for (int i = 0; i < t->depth; i++) {
            if (t->stack[i] == ctx) {
                memmove(&t->stack[i], &t->stack[i + 1], (size_t)(t->depth - i - 1) * sizeof(CUcontext));
                t->depth--;
                i--;
            }
        }
    }
    pthread_mutex_lock(&g.mu);
    for (CUcontext *pp = &g.ctxs; *pp; pp = &(*pp)->gnext) {
        if (*pp == ctx) {
            *pp = ctx->gnext;
            break;
        }
    }
    ctx_teardown(ctx);
    ctx_count(ctx->host, -1);
    ctx->magic = 0;
    pthread_mutex_unlock(&g.mu);
    pthread_mutex_destroy(&ctx->mu);
    free(ctx);
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CHECK_INIT();
    if (ctx && !valid_ctx(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    struct fc_tls *t = get_tls();
    if (!t)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (!ctx) {
        if (t->depth > 0)
            t->depth--;
    } else if (t->depth == 0) {
        t->stack[t->depth++] = ctx;
    } else {
        t->stack[t->depth - 1] = ctx;
    }
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    CHECK_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = current_ctx();
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    CHECK_INIT();
    if (!valid_ctx(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    return push_ctx(ctx);
}

FC_API CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    CHECK_INIT();
    struct fc_tls *t = get_tls();
    if (!t || t->depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    CUcontext c = t->stack[--t->depth];
    if (pctx)
        *pctx = c;
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxGetDevice(CUdevice *device)
{
    CHECK_INIT();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    CUcontext c = current_ctx();
    if (!valid_ctx(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    *device = c->ordinal;
    return CUDA_SUCCESS;
}

#define CURRENT_CTX(c)                          \
    CUcontext c = current_ctx();                \
    if (!valid_ctx(c))                          \
        return CUDA_ERROR_INVALID_CONTEXT

/* ---- streams ---- */
static void stream_wait(struct CUstream_st *s, uint64_t target)
{
    for (;;) {
        uint32_t d = atomic_load(&s->dseq);
        if (atomic_load(&s->head) >= target)
            return;
        atomic_fetch_add(&s->dwaiters, 1);
        if (atomic_load(&s->head) >= target) {
            atomic_fetch_sub(&s->dwaiters, 1);
            return;
        }
        futex_private(&s->dseq, FUTEX_WAIT, d);
        atomic_fetch_sub(&s->dwaiters, 1);
    }
}

static void wake_worker(struct CUstream_st *s)
{
    if (atomic_load(&s->wsleep)) {
        atomic_store(&s->wsleep, 0);
        atomic_fetch_add(&s->wseq, 1);
        futex_private(&s->wseq, FUTEX_WAKE, 1);
    }
}

/* Appends n ops; the caller holds s->pmu. */
static void push_locked(struct CUstream_st *s, const struct fc_op *ops, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint64_t t = atomic_load_explicit(&s->tail, memory_order_relaxed);
        if (t - atomic_load(&s->head) >= FC_RING) {
            wake_worker(s);
            stream_wait(s, t - FC_RING + 1);
        }
        struct fc_op op = ops[i];
        op.at = fc_now_ns();
        s->ring[t & (FC_RING - 1)] = op;
        atomic_store(&s->tail, t + 1);
    }
    wake_worker(s);
}

static void push_op(struct CUstream_st *s, uint32_t kind, uint64_t arg, void *ptr)
{
    struct fc_op op = {kind, arg, ptr, 0};
    pthread_mutex_lock(&s->pmu);
    push_locked(s, &op, 1);
    pthread_mutex_unlock(&s->pmu);
}

static void event_mark(struct CUevent_st *e, uint64_t gen, uint64_t ts);
static void event_wake(struct CUevent_st *e);
static void event_unref(struct CUevent_st *e);
static void free_linear(CUdeviceptr p);

/* The device a stream worker holds between consecutive kernels (time slice). */
struct held {
    struct fc_dev *d;
    uint64_t ticket;
    int proc;
    uint64_t mark; /* held since; not yet recorded */
};

/* The device's own timeline.  A kernel queued behind another on the stream
 * starts when that one ends, and runs for its duration: when the worker
 * thread wakes late (the host is busy), the device did not wait for it, so
 * the lateness neither lengthens the kernel nor delays the next one, and an
 * event completes when the work before it did (or when it was recorded, if
 * later).  Otherwise a loaded host would show up as GPU time of whoever
 * holds the device, which no real GPU does and nothing in mgpu can see.
 * A hand-off at a kernel boundary (the model gives the device to another
 * stream or process) happens where the kernel ended.  What stays in host
 * time is what a worker must wake to notice: a slice that ends inside a
 * kernel (timer) and a queue that ran dry; the device is held until the
 * worker gives it back. */
static uint64_t later(uint64_t a, uint64_t b) { return a > b ? a : b; }

/* Gives the device back, recording the held time since the last kernel
 * (the worker noticing that its queue ran dry is host time, as a hand-off
 * is: the device's own timeline, below).  Returns when, 0 if it held none. */
static uint64_t held_release(struct held *hd)
{
    if (!hd->d)
        return 0;
    uint64_t now = fc_now_ns();
    fc_exec_release(hd->d, hd->ticket, hd->proc, now - hd->mark);
    hd->d = NULL;
    return now;
}

/* The part of seg (device time a kernel held) that its kernel ran, the
 * rest of its gap (*gap) going first. */
static uint64_t ran(uint64_t seg, uint64_t *gap)
{
    uint64_t idle = seg < *gap ? seg : *gap;
    *gap -= idle;
    return seg - idle;
}

/* Runs a kernel of dur ns queued at `at`; *vcur is the stream's device
 * time (when its previous op completed), moved to the kernel's end. */
static void run_kernel(CUcontext c, uint64_t dur, uint64_t at, uint64_t *vcur, struct held *hd)
{
    if (dur == 0)
        return; /* takes no device time */
    int h = c->host;
    struct fc_dev *d = g.dev[h];
    int proc = g.proc[h];
    if (hd->d && hd->d != d) {
        held_release(hd);
    } else if (hd->d) {
        /* held since the previous kernel ended (mark): idle until this one
         * was queued, if it came later */
        uint64_t start = later(hd->mark, at);
        if (fc_exec_continue(hd->d, hd->ticket, hd->proc, start - hd->mark))
            hd->mark = start;
        else
            hd->d = NULL; /* the slice ended: fc_exec_continue handed the device on */
    }
    if (!hd->d) {
        uint64_t since;
        hd->ticket = fc_exec_acquire(d, proc, at, &since);
        hd->d = d;
        hd->proc = proc;
        hd->mark = since;
    }
    /* The device's gap before the kernel (FAKECUDA_KERNEL_GAP_US) holds it
     * like the kernel does but runs nothing: it is busy_ns, not kernel_ns. */
    uint64_t gap = (uint64_t)d->gap_us * 1000;
    uint64_t t0 = later(hd->mark, at);
    uint64_t end = t0 + gap + dur;
    /* the timer model preempts at the end of the slice */
    uint64_t se = d->model == FC_MODEL_TIMER ? fc_exec_slice_end(d, hd->ticket) : UINT64_MAX;
    for (;;) {
        uint64_t wake = se < end ? se : end;
        __atomic_store_n(&d->hold_until_ns, wake, __ATOMIC_RELAXED);
        struct timespec ts = {(time_t)(wake / 1000000000ULL), (long)(wake % 1000000000ULL)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
            ;
        uint64_t t1 = fc_now_ns();
        if (t1 >= end)
            break;
        /* The slice ended inside the kernel: if another process waits, the
         * kernel leaves the device with the time it ran and queues again
         * for the rest; otherwise it runs on in a new slice.  (A slice
         * ends in host time, when the worker wakes for it.) */
        int keep = fc_exec_preempt(d, hd->ticket, proc, t1 - hd->mark, ran(t1 - t0, &gap), t1, &se);
        hd->mark = t1;
        t0 = t1;
        if (keep)
            continue;
        uint64_t left = end - t1, since;
        hd->ticket = fc_exec_acquire(d, proc, t1, &since);
        hd->mark = since;
        se = fc_exec_slice_end(d, hd->ticket);
        t0 = since;
        end = t0 + left;
    }
    /* Recorded now, so that a process that exits right after its last
     * kernel leaves a complete record.  It ended at `end`, however late
     * the worker woke. */
    fc_exec_account(d, hd->ticket, proc, end - hd->mark, ran(end - t0, &gap), end);
    hd->mark = end;
    *vcur = end;
}

static void *worker_main(void *p)
{
    struct CUstream_st *s = p;
    struct held hd = {0};
    uint64_t vcur = 0; /* the stream's device time: when its last op completed */
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL); /* kernels end on time, not 50 us late */
    for (;;) {
        uint64_t h = atomic_load(&s->head);
        if (h == atomic_load(&s->tail)) {
            /* nothing queued: the device goes back before the worker sleeps */
            held_release(&hd);
            if (atomic_load(&s->stop))
                break;
            uint32_t w = atomic_load(&s->wseq);
            atomic_store(&s->wsleep, 1);
            if (h != atomic_load(&s->tail) || atomic_load(&s->stop)) {
                atomic_store(&s->wsleep, 0);
                continue;
            }
            futex_private(&s->wseq, FUTEX_WAIT, w);
            continue;
        }
        struct fc_op op = s->ring[h & (FC_RING - 1)];
        switch (op.kind) {
        case OP_KERNEL: run_kernel(s->ctx, op.arg, op.at, &vcur, &hd); break;
        case OP_EVENT: break; /* completed below, once the stream has moved past it */
        case OP_FREE: free_linear((CUdeviceptr)op.arg); break;
        default: break;
        }
        /* Nothing more queued: give the device back before anyone can learn
         * that the work is done (a process that exits right after its last
         * synchronisation must not die owning the device). */
        if (h + 1 == atomic_load(&s->tail)) {
            /* held until now: what follows on the stream (the event that
             * tells its process) comes after that */
            vcur = later(vcur, held_release(&hd));
        }
        /* An event is complete before the head moves past it, so a stream
         * synchronisation that returns has every event before it complete
         * (a program that frees on a stream and synchronises it sees the
         * free done); its waiters are woken after, so that whoever an event
         * wakes sees the stream done up to it (cuStreamQuery after
         * cuEventSynchronize). */
        if (op.kind == OP_EVENT)
            event_mark(op.ptr, op.arg, later(vcur, op.at));
        atomic_store(&s->head, h + 1);
        if (op.kind == OP_EVENT) {
            event_wake(op.ptr);
            event_unref(op.ptr);
        }
        if (atomic_load(&s->dwaiters)) {
            atomic_fetch_add(&s->dseq, 1);
            futex_private(&s->dseq, FUTEX_WAKE, INT_MAX);
        }
    }
    /* The destroyer may still be inside wake_worker: wait for it; and let
     * cuCtxSynchronize callers that still look at this stream leave (they
     * return at once: everything is done). */
    pthread_mutex_lock(&s->pmu);
    pthread_mutex_unlock(&s->pmu);
    while (atomic_load(&s->dwaiters)) {
        atomic_fetch_add(&s->dseq, 1);
        futex_private(&s->dseq, FUTEX_WAKE, INT_MAX);
        sched_yield();
    }
    pthread_mutex_destroy(&s->pmu);
    if (s->capture) {
        /* graph of an unfinished capture */
        struct CUgraphNode_st *n = s->capture->first;
        while (n) {
            struct CUgraphNode_st *x = n->next;
            free(n);
            n = x;
        }
        free(s->capture);
    }
    free(s);
    return NULL;
}

/* Stops a stream once its queued work is done; it frees itself. */
static void stream_release(struct CUstream_st *s)
{
    s->magic = 0;
    pthread_mutex_lock(&s->pmu);
    atomic_store(&s->stop, 1);
    atomic_store(&s->wsleep, 1);
    wake_worker(s);
    pthread_mutex_unlock(&s->pmu);
}

static struct CUstream_st *stream_new(CUcontext c, unsigned flags, int builtin)
{
    struct CUstream_st *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->magic = M_STREAM;
    s->ctx = c;
    s->flags = flags;
    s->builtin = builtin;
    pthread_mutex_init(&s->pmu, NULL);
    pthread_t t;
    if (start_thread(&t, worker_main, s)) {
        pthread_mutex_destroy(&s->pmu);
        free(s);
        return NULL;
    }
    return s;
}

static struct CUstream_st *stream_add(CUcontext c, unsigned flags, int builtin)
{
    struct CUstream_st *s = stream_new(c, flags, builtin);
    if (s) {
        pthread_mutex_lock(&c->mu);
        s->next = c->streams;
        c->streams = s;
        pthread_mutex_unlock(&c->mu);
    }
    return s;
}

/* Maps a stream argument to a stream: NULL is the legacy default stream, or
 * the per-thread one for _ptsz entry points. */
static CUresult get_stream(CUstream h, int ptds, struct CUstream_st **out)
{
    if (h && h != CU_STREAM_LEGACY && h != CU_STREAM_PER_THREAD) {
        if (h->magic != M_STREAM)
            return CUDA_ERROR_INVALID_HANDLE;
        *out = h;
        return CUDA_SUCCESS;
    }
    CURRENT_CTX(c);
    if (h == CU_STREAM_PER_THREAD || (!h && ptds)) {
        struct fc_tls *t = get_tls();
        if (!t)
            return CUDA_ERROR_OUT_OF_MEMORY;
        for (int i = 0; i < t->nptds; i++) {
            if (t->ptds_ctx[i] == c->id) {
                *out = t->ptds[i];
                return CUDA_SUCCESS;
            }
        }
        if (t->nptds == FC_CTX_STACK)
            return CUDA_ERROR_OUT_OF_MEMORY;
        struct CUstream_st *s = stream_add(c, CU_STREAM_DEFAULT, 1);
        if (!s)
            return CUDA_ERROR_OUT_OF_MEMORY;
        t->ptds_ctx[t->nptds] = c->id;
        t->ptds[t->nptds++] = s;
        *out = s;
        return CUDA_SUCCESS;
    }
    pthread_mutex_lock(&c->mu);
    struct CUstream_st *s = c->legacy;
    if (!s) {
        s = stream_new(c, CU_STREAM_DEFAULT, 1);
        if (s) {
            s->next = c->streams;
            c->streams = s;
            c->legacy = s;
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *out = s;
    return CUDA_SUCCESS;
}

#define GET_STREAM(s, h, ptds)                              \
    struct CUstream_st *s = NULL;                           \
    do {                                                    \
        CUresult r_ = get_stream((h), (ptds), &s);          \
        if (r_ != CUDA_SUCCESS)                             \
            return r_;                                      \
    } while (0)

FC_API CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    CHECK_INIT();
    if (!phStream || Flags > CU_STREAM_NON_BLOCKING)
        return CUDA_ERROR_INVALID_VALUE;
    CURRENT_CTX(c);
    struct CUstream_st *s = stream_add(c, Flags, 0);
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *phStream = s;
    return CUDA_SUCCESS;
}

FC_API CUresult cuStreamDestroy_v2(CUstream hStream)
{
    CHECK_INIT();
    if (!hStream || hStream == CU_STREAM_LEGACY || hStream == CU_STREAM_PER_THREAD ||
        hStream->magic != M_STREAM || hStream->builtin)
        return CUDA_ERROR_INVALID_HANDLE;
    CUcontext c = hStream->ctx;
    pthread_mutex_lock(&c->mu);
    for (struct CUstream_st **pp = &c->streams; *pp; pp = &(*pp)->next) {
        if (*pp == hStream) {
            *pp = hStream->next;
            break;
        }
    }
    pthread_mutex_unlock(&c->mu);
    stream_release(hStream);
    return CUDA_SUCCESS;
}

static CUresult capture_violation(struct CUstream_st *s)
{
    if (s->capturing == CU_STREAM_CAPTURE_STATUS_ACTIVE)
        s->capturing = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

static CUresult stream_sync(CUstream h, int ptds)
{
    CHECK_INIT();
    GET_STREAM(s, h, ptds);
    if (s->capturing)
        return capture_violation(s);
    stream_wait(s, atomic_load(&s->tail));
    return CUDA_SUCCESS;
}

FC_API CUresult cuStreamSynchronize(CUstream hStream) { return stream_sync(hStream, 0); }
FC_API CUresult cuStreamSynchronize_ptsz(CUstream hStream) { return stream_sync(hStream, 1); }

static CUresult stream_query(CUstream h, int ptds)
{
    CHECK_INIT();
    GET_STREAM(s, h, ptds);
    if (s->capturing)
        return capture_violation(s);
    return atomic_load(&s->head) == atomic_load(&s->tail) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

FC_API CUresult cuStreamQuery(CUstream hStream) { return stream_query(hStream, 0); }
FC_API CUresult cuStreamQuery_ptsz(CUstream hStream) { return stream_query(hStream, 1); }

FC_API CUresult cuCtxSynchronize(void)
{
    CHECK_INIT();
    CURRENT_CTX(c);
    /* Snapshot the queue ends, then wait outside the lock. */
    for (;;) {
        pthread_mutex_lock(&c->mu);
        struct CUstream_st *busy = NULL;
        uint64_t target = 0;
        for (struct CUstream_st *s = c->streams; s && !busy; s = s->next) {
            uint64_t t = atomic_load(&s->tail);
            if (atomic_load(&s->head) < t && !s->capturing) {
                busy = s;
                target = t;
            }
        }
        if (!busy) {
            pthread_mutex_unlock(&c->mu);
            return CUDA_SUCCESS;
        }
        /* Our count in dwaiters keeps a destroyed stream from being freed
         * under us (worker_main waits for it to drop). */
        atomic_fetch_add(&busy->dwaiters, 1);
        pthread_mutex_unlock(&c->mu);
        stream_wait(busy, target);
        atomic_fetch_sub(&busy->dwaiters, 1);
    }
}

/* ---- capture and graphs ---- */
static CUgraph graph_new(void)
{
    CUgraph gr = calloc(1, sizeof(*gr));
    if (gr)
        gr->magic = M_GRAPH;
    return gr;
}

static CUgraphNode graph_add(CUgraph gr, uint64_t dur)
{
    CUgraphNode n = calloc(1, sizeof(*n));
    if (!n)
        return NULL;
    n->magic = M_NODE;
    n->graph = gr;
    n->dur = dur;
    if (gr->last)
        gr->last->next = n;
    else
        gr->first = n;
    gr->last = n;
    gr->n++;
    return n;
}

static void graph_free(CUgraph gr)
{
    struct CUgraphNode_st *n = gr->first;
    while (n) {
        struct CUgraphNode_st *x = n->next;
        n->magic = 0;
        free(n);
        n = x;
    }
    gr->magic = 0;
    free(gr);
}

static CUresult begin_capture(CUstream h, CUstreamCaptureMode mode, int ptds)
{
    CHECK_INIT();
    if ((unsigned)mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    if (h == CU_STREAM_LEGACY || (!h && !ptds))
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    GET_STREAM(s, h, ptds);
    if (s->capturing)
        return CUDA_ERROR_ILLEGAL_STATE;
    s->capture = graph_new();
    if (!s->capture)
        return CUDA_ERROR_OUT_OF_MEMORY;
    s->capturing = CU_STREAM_CAPTURE_STATUS_ACTIVE;
    return CUDA_SUCCESS;
}

FC_API CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)
{
    return begin_capture(hStream, mode, 0);
}

FC_API CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode)
{
    return begin_capture(hStream, mode, 1);
}

static CUresult end_capture(CUstream h, CUgraph *ph, int ptds)
{
    CHECK_INIT();
    if (!ph)
        return CUDA_ERROR_INVALID_VALUE;
    GET_STREAM(s, h, ptds);
    if (!s->capturing)
        return CUDA_ERROR_ILLEGAL_STATE;
    CUgraph gr = s->capture;
    int status = s->capturing;
    s->capture = NULL;
    s->capturing = CU_STREAM_CAPTURE_STATUS_NONE;
    if (status == CU_STREAM_CAPTURE_STATUS_INVALIDATED) {
        graph_free(gr);
        *ph = NULL;
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    *ph = gr;
    return CUDA_SUCCESS;
}

FC_API CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) { return end_capture(hStream, phGraph, 0); }
FC_API CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph)
{
    return end_capture(hStream, phGraph, 1);
}

FC_API CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    CHECK_INIT();
    if (!captureStatus)
        return CUDA_ERROR_INVALID_VALUE;
    GET_STREAM(s, hStream, 0);
    *captureStatus = (CUstreamCaptureStatus)s->capturing;
    return CUDA_SUCCESS;
}

FC_API CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
    CHECK_INIT();
    if (!phGraph || flags)
        return CUDA_ERROR_INVALID_VALUE;
    *phGraph = graph_new();
    return *phGraph ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

FC_API CUresult cuGraphDestroy(CUgraph hGraph)
{
    CHECK_INIT();
    if (!hGraph || hGraph->magic != M_GRAPH)
        return CUDA_ERROR_INVALID_VALUE;
    graph_free(hGraph);
    return CUDA_SUCCESS;
}

static uint64_t kernel_duration(void **kernelParams)
{
    if (!kernelParams || !kernelParams[0])
        return 0;
    uint64_t v;
    memcpy(&v, kernelParams[0], sizeof(v));
    return v;
}

FC_API CUresult cuGraphAddKernelNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                     size_t numDependencies, const CUDA_KERNEL_NODE_PARAMS *nodeParams)
{
    CHECK_INIT();
    if (!phGraphNode || !hGraph || hGraph->magic != M_GRAPH || !nodeParams || (numDependencies && !dependencies))
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < numDependencies; i++)
        if (!dependencies[i] || dependencies[i]->magic != M_NODE || dependencies[i]->graph != hGraph)
            return CUDA_ERROR_INVALID_VALUE;
    if (!nodeParams->func || nodeParams->func->magic != M_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!nodeParams->gridDimX || !nodeParams->gridDimY || !nodeParams->gridDimZ || !nodeParams->blockDimX ||
        !nodeParams->blockDimY || !nodeParams->blockDimZ)
        return CUDA_ERROR_INVALID_VALUE;
    /* Nodes run in the order they were added: a valid topological order. */
    CUgraphNode n = graph_add(hGraph, kernel_duration(nodeParams->kernelParams));
    if (!n)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *phGraphNode = n;
    return CUDA_SUCCESS;
}

FC_API CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    CHECK_INIT();
    if (!phGraphExec || !hGraph || hGraph->magic != M_GRAPH || (flags & ~0x1fULL))
        return CUDA_ERROR_INVALID_VALUE;
    CUgraphExec e = calloc(1, sizeof(*e));
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->durs = calloc(hGraph->n ? hGraph->n : 1, sizeof(uint64_t));
    if (!e->durs) {
        free(e);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (struct CUgraphNode_st *n = hGraph->first; n; n = n->next)
        e->durs[e->n++] = n->dur;
    e->magic = M_EXEC;
    *phGraphExec = e;
    return CUDA_SUCCESS;
}

FC_API CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    CHECK_INIT();
    if (!hGraphExec || hGraphExec->magic != M_EXEC)
        return CUDA_ERROR_INVALID_VALUE;
    hGraphExec->magic = 0;
    free(hGraphExec->durs);
    free(hGraphExec);
    return CUDA_SUCCESS;
}

static CUresult graph_launch(CUgraphExec e, CUstream h, int ptds)
{
    CHECK_INIT();
    if (!e || e->magic != M_EXEC)
        return CUDA_ERROR_INVALID_VALUE;
    GET_STREAM(s, h, ptds);
    if (s->capturing == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
        for (size_t i = 0; i < e->n; i++)
            if (!graph_add(s->capture, e->durs[i]))
                return CUDA_ERROR_OUT_OF_MEMORY;
        return CUDA_SUCCESS;
    }
    if (s->capturing)
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    pthread_mutex_lock(&s->pmu);
    for (size_t i = 0; i < e->n; i++) {
        struct fc_op op = {OP_KERNEL, e->durs[i], NULL, 0};
        push_locked(s, &op, 1);
    }
    pthread_mutex_unlock(&s->pmu);
    return CUDA_SUCCESS;
}

FC_API CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) { return graph_launch(hGraphExec, hStream, 0); }
FC_API CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(hGraphExec, hStream, 1);
}

/* ---- modules and launches ---- */
FC_API CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    CHECK_INIT();
    if (!module || !image)
        return CUDA_ERROR_INVALID_VALUE;
    CURRENT_CTX(c);
    CUmodule m = calloc(1, sizeof(*m));
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    m->magic = M_MODULE;
    m->ctx = c;
    *module = m;
    return CUDA_SUCCESS;
}

FC_API CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    CHECK_INIT();
    if (!hfunc || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!hmod || hmod->magic != M_MODULE)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g.mu);
    struct CUfunc_st *f = hmod->funcs;
    while (f && strcmp(f->name, name) != 0)
        f = f->next;
    if (!f) {
        size_t len = strlen(name);
        f = calloc(1, sizeof(*f) + len + 1);
        if (f) {
            f->magic = M_FUNC;
            f->mod = hmod;
            memcpy(f->name, name, len + 1);
            f->next = hmod->funcs;
            hmod->funcs = f;
        }
    }
    pthread_mutex_unlock(&g.mu);
    if (!f)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *hfunc = f;
    return CUDA_SUCCESS;
}

FC_API CUresult cuModuleUnload(CUmodule hmod)
{
    CHECK_INIT();
    if (!hmod || hmod->magic != M_MODULE)
        return CUDA_ERROR_INVALID_HANDLE;
    struct CUfunc_st *f = hmod->funcs;
    while (f) {
        struct CUfunc_st *n = f->next;
        f->magic = 0;
        free(f);
        f = n;
    }
    hmod->magic = 0;
    free(hmod);
    return CUDA_SUCCESS;
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       CUstream h, void **params, int ptds)
{
    CHECK_INIT();
    if (!f || f->magic != M_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    GET_STREAM(s, h, ptds);
    uint64_t dur = kernel_duration(params);
    if (s->capturing) {
        if (s->capturing != CU_STREAM_CAPTURE_STATUS_ACTIVE)
            return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        return graph_add(s->capture, dur) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    }
    push_op(s, OP_KERNEL, dur, NULL);
    return CUDA_SUCCESS;
}

FC_API CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                               unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                               unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
{
    (void)sharedMemBytes;
    (void)extra;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, kernelParams, 0);
}

FC_API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                    unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                    unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
{
    (void)sharedMemBytes;
    (void)extra;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, kernelParams, 1);
}

static CUresult launch_ex(const CUlaunchConfig *config, CUfunction f, void **kernelParams, int ptds)
{
    /* Attributes (cooperative, ...) change nothing in the simulation. */
    if (!config || (config->numAttrs && !config->attrs))
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                  config->blockDimZ, config->hStream, kernelParams, ptds);
}

FC_API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    (void)extra;
    return launch_ex(config, f, kernelParams, 0);
}

FC_API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    (void)extra;
    return launch_ex(config, f, kernelParams, 1);
}

FC_API CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                          unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                          unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                          void **kernelParams)
{
    (void)sharedMemBytes;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, kernelParams, 0);
}

FC_API CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                               unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                               unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                               void **kernelParams)
{
    (void)sharedMemBytes;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, kernelParams, 1);
}

/* ---- events ---- */
FC_API CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    CHECK_INIT();
    if (!phEvent || (Flags & ~0x7u))
        return CUDA_ERROR_INVALID_VALUE;
    CURRENT_CTX(c);
    (void)c;
    CUevent e = calloc(1, sizeof(*e));
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = M_EVENT;
    e->flags = Flags;
    pthread_mutex_init(&e->mu, NULL);
    atomic_store(&e->refs, 1);
    *phEvent = e;
    return CUDA_SUCCESS;
}

static void event_unref(struct CUevent_st *e)
{
    if (atomic_fetch_sub(&e->refs, 1) == 1) {
        pthread_mutex_destroy(&e->mu);
        free(e);
    }
}

/* The stream reached record gen of e: stamp it and mark it complete. */
static void event_mark(struct CUevent_st *e, uint64_t gen, uint64_t ts)
{
    pthread_mutex_lock(&e->mu);
    if (gen > atomic_load(&e->done)) {
        e->ts = ts;
        atomic_store(&e->done, gen);
    }
    pthread_mutex_unlock(&e->mu);
}

/* Wakes the threads waiting for e. */
static void event_wake(struct CUevent_st *e)
{
    if (atomic_load(&e->ewaiters)) {
        atomic_fetch_add(&e->eseq, 1);
        futex_private(&e->eseq, FUTEX_WAKE, INT_MAX);
    }
}

FC_API CUresult cuEventDestroy_v2(CUevent hEvent)
{
    CHECK_INIT();
    if (!hEvent || hEvent->magic != M_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    hEvent->magic = 0;
    event_unref(hEvent); /* freed once pending records completed */
    return CUDA_SUCCESS;
}

static CUresult event_record(CUevent e, CUstream h, int ptds)
{
    CHECK_INIT();
    if (!e || e->magic != M_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    GET_STREAM(s, h, ptds);
    if (s->capturing)
        return CUDA_SUCCESS; /* a capture records no event node here */
    struct fc_op op = {OP_EVENT, 0, e, 0};
    atomic_fetch_add(&e->refs, 1);
    pthread_mutex_lock(&s->pmu);
    op.arg = atomic_fetch_add(&e->rec, 1) + 1;
    push_locked(s, &op, 1);
    pthread_mutex_unlock(&s->pmu);
    return CUDA_SUCCESS;
}

FC_API CUresult cuEventRecord(CUevent hEvent, CUstream hStream) { return event_record(hEvent, hStream, 0); }
FC_API CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream) { return event_record(hEvent, hStream, 1); }

FC_API CUresult cuEventQuery(CUevent hEvent)
{
    CHECK_INIT();
    if (!hEvent || hEvent->magic != M_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    return atomic_load(&hEvent->done) >= atomic_load(&hEvent->rec) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

FC_API CUresult cuEventSynchronize(CUevent hEvent)
{
    CHECK_INIT();
    if (!hEvent || hEvent->magic != M_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t target = atomic_load(&hEvent->rec);
    for (;;) {
        uint32_t seq = atomic_load(&hEvent->eseq);
        if (atomic_load(&hEvent->done) >= target)
            return CUDA_SUCCESS;
        atomic_fetch_add(&hEvent->ewaiters, 1);
        if (atomic_load(&hEvent->done) < target)
            futex_private(&hEvent->eseq, FUTEX_WAIT, seq);
        atomic_fetch_sub(&hEvent->ewaiters, 1);
    }
}

FC_API CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    CHECK_INIT();
    if (!pMilliseconds)
        return CUDA_ERROR_INVALID_VALUE;
    if (!hStart || hStart->magic != M_EVENT || !hEnd || hEnd->magic != M_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    if ((hStart->flags | hEnd->flags) & CU_EVENT_DISABLE_TIMING)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!atomic_load(&hStart->rec) || !atomic_load(&hEnd->rec))
        return CUDA_ERROR_INVALID_HANDLE;
    if (cuEventQuery(hStart) != CUDA_SUCCESS || cuEventQuery(hEnd) != CUDA_SUCCESS)
        return CUDA_ERROR_NOT_READY;
    pthread_mutex_lock(&hStart->mu);
    uint64_t a = hStart->ts;
    pthread_mutex_unlock(&hStart->mu);
    pthread_mutex_lock(&hEnd->mu);
    uint64_t b = hEnd->ts;
    pthread_mutex_unlock(&hEnd->mu);
    *pMilliseconds = (float)((double)((int64_t)(b - a)) / 1e6);
    return CUDA_SUCCESS;
}

/* ---- memory ---- */
/* Index of the allocation containing p (or the first above it). */
static size_t alloc_find(CUdeviceptr p)
{
    size_t lo = 0, hi = g.nallocs;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (g.allocs[mid].base + (g.allocs[mid].size ? g.allocs[mid].size : 1) <= p)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static CUresult mem_alloc(CUdeviceptr *out, uint64_t bytes, int ordinal, int kind, uint64_t ctx_id)
{
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    if (bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    int h = g.host[ordinal];
    if (fc_mem_reserve(g.dev[h], g.proc[h], bytes))
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g.amu);
    if (g.nallocs == g.capallocs) {
        size_t cap = g.capallocs ? g.capallocs * 2 : 64;
        struct fc_alloc *n = realloc(g.allocs, cap * sizeof(*n));
        if (!n) {
            pthread_mutex_unlock(&g.amu);
            fc_mem_unreserve(g.dev[h], g.proc[h], bytes);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        g.allocs = n;
        g.capallocs = cap;
    }
    /* Addresses only grow, so appending keeps the table sorted; a guard gap
     * of one alignment unit keeps allocations apart. */
    CUdeviceptr base = g.next_addr;
    uint64_t span = (bytes + FC_ADDR_ALIGN - 1) & ~(FC_ADDR_ALIGN - 1);
    g.next_addr += span + FC_ADDR_ALIGN;
    g.allocs[g.nallocs++] = (struct fc_alloc){base, bytes, h, kind, ctx_id};
    pthread_mutex_unlock(&g.amu);
    *out = base;
    return CUDA_SUCCESS;
}

/* Frees the allocation starting at p of the given kind; 0 or -1. */
static int mem_free(CUdeviceptr p, int kind)
{
    pthread_mutex_lock(&g.amu);
    size_t i = alloc_find(p);
    if (i >= g.nallocs || g.allocs[i].base != p || g.allocs[i].kind != kind) {
        pthread_mutex_unlock(&g.amu);
        return -1;
    }
    struct fc_alloc a = g.allocs[i];
    memmove(&g.allocs[i], &g.allocs[i + 1], (g.nallocs - i - 1) * sizeof(*g.allocs));
    g.nallocs--;
    pthread_mutex_unlock(&g.amu);
    fc_mem_unreserve(g.dev[a.host], g.proc[a.host], a.size);
    return 0;
}

static void free_linear(CUdeviceptr p)
{
    mem_free(p, K_LINEAR);
}

static void free_ctx_allocs(uint64_t ctx_id)
{
    pthread_mutex_lock(&g.amu);
    size_t j = 0;
    for (size_t i = 0; i < g.nallocs; i++) {
        struct fc_alloc a = g.allocs[i];
        if (a.ctx_id == ctx_id)
            fc_mem_unreserve(g.dev[a.host], g.proc[a.host], a.size);
        else
            g.allocs[j++] = a;
    }
    g.nallocs = j;
    pthread_mutex_unlock(&g.amu);
}

FC_API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    CHECK_INIT();
    if (!free_bytes || !total)
        return CUDA_ERROR_INVALID_VALUE;
    CURRENT_CTX(c);
    struct fc_dev *d = g.dev[c->host];
    fc_dev_lock(d);
    uint64_t used = d->mem_used, tot = d->mem_total;
    fc_dev_unlock(d);
    *total = (size_t)tot;
    *free_bytes = (size_t)(used < tot ? tot - used : 0);
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    CHECK_INIT();
    CURRENT_CTX(c);
    return mem_alloc(dptr, bytesize, c->ordinal, K_LINEAR, c->id);
}

FC_API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                   unsigned int ElementSizeBytes)
{
    CHECK_INIT();
    if (!dptr || !pPitch || !WidthInBytes || !Height ||
        (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16))
        return CUDA_ERROR_INVALID_VALUE;
    CURRENT_CTX(c);
    size_t pitch = (WidthInBytes + 511) & ~(size_t)511;
    if (Height > SIZE_MAX / pitch)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = mem_alloc(dptr, (uint64_t)pitch * Height, c->ordinal, K_LINEAR, c->id);
    if (r == CUDA_SUCCESS)
        *pPitch = pitch;
    return r;
}

FC_API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    CHECK_INIT();
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != 0x2 /* CU_MEM_ATTACH_HOST */)
        return CUDA_ERROR_INVALID_VALUE;
    CURRENT_CTX(c);
    return mem_alloc(dptr, bytesize, c->ordinal, K_LINEAR, c->id);
}

FC_API CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    CHECK_INIT();
    if (dptr == 0)
        return CUDA_SUCCESS;
    return mem_free(dptr, K_LINEAR) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

FC_API CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    CHECK_INIT();
    pthread_mutex_lock(&g.amu);
    size_t i = alloc_find(dptr);
    int ok = i < g.nallocs && g.allocs[i].kind == K_LINEAR && g.allocs[i].base <= dptr &&
             dptr < g.allocs[i].base + g.allocs[i].size;
    struct fc_alloc a = ok ? g.allocs[i] : (struct fc_alloc){0};
    pthread_mutex_unlock(&g.amu);
    if (!ok)
        return CUDA_ERROR_NOT_FOUND;
    if (pbase)
        *pbase = a.base;
    if (psize)
        *psize = (size_t)a.size;
    return CUDA_SUCCESS;
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t bytes, int ordinal, CUstream h, int ptds)
{
    GET_STREAM(s, h, ptds);
    if (s->capturing)
        return capture_violation(s);
    if (ordinal < 0)
        ordinal = s->ctx->ordinal;
    return mem_alloc(dptr, bytes, ordinal, K_LINEAR, s->ctx->id);
}

FC_API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    CHECK_INIT();
    return alloc_async(dptr, bytesize, -1, hStream, 0);
}

FC_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    CHECK_INIT();
    return alloc_async(dptr, bytesize, -1, hStream, 1);
}

static int valid_pool(CUmemoryPool p)
{
    return p && p->magic == M_POOL && valid_dev(p->ordinal);
}

FC_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    CHECK_INIT();
    if (!valid_pool(pool))
        return CUDA_ERROR_INVALID_VALUE;
    return alloc_async(dptr, bytesize, pool->ordinal, hStream, 0);
}

FC_API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                             CUstream hStream)
{
    CHECK_INIT();
    if (!valid_pool(pool))
        return CUDA_ERROR_INVALID_VALUE;
    return alloc_async(dptr, bytesize, pool->ordinal, hStream, 1);
}

static CUresult free_async(CUdeviceptr p, CUstream h, int ptds)
{
    CHECK_INIT();
    GET_STREAM(s, h, ptds);
    if (s->capturing)
        return capture_violation(s);
    pthread_mutex_lock(&g.amu);
    size_t i = alloc_find(p);
    int ok = i < g.nallocs && g.allocs[i].base == p && g.allocs[i].kind == K_LINEAR;
    pthread_mutex_unlock(&g.amu);
    if (!ok)
        return CUDA_ERROR_INVALID_VALUE;
    push_op(s, OP_FREE, p, NULL); /* freed when the stream gets there */
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) { return free_async(dptr, hStream, 0); }
FC_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) { return free_async(dptr, hStream, 1); }

FC_API CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps)
{
    CHECK_INIT();
    if (!pool || !poolProps || poolProps->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        poolProps->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(poolProps->location.id))
        return CUDA_ERROR_INVALID_DEVICE;
    CUmemoryPool p = calloc(1, sizeof(*p));
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    p->magic = M_POOL;
    p->ordinal = poolProps->location.id;
    *pool = p;
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    CHECK_INIT();
    if (!valid_pool(pool) || pool->is_default)
        return CUDA_ERROR_INVALID_VALUE;
    pool->magic = 0;
    free(pool);
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev)
{
    CHECK_INIT();
    if (!pool_out)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *pool_out = &g.pools[dev];
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags)
{
    CHECK_INIT();
    if (!handle || !prop || flags || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(prop->location.id))
        return CUDA_ERROR_INVALID_DEVICE;
    CUdeviceptr p;
    CUresult r = mem_alloc(&p, size, prop->location.id, K_VMM, 0);
    if (r == CUDA_SUCCESS)
        *handle = p;
    return r;
}

FC_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    CHECK_INIT();
    return mem_free(handle, K_VMM) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

static uint64_t format_size(CUarray_format f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT: return 4;
    default: return 0;
    }
}

static CUresult array_create(CUarray *ph, CUarray_format fmt, unsigned ch, size_t w, size_t hgt, size_t dep)
{
    CHECK_INIT();
    uint64_t fs = format_size(fmt);
    if (!ph || !fs || (ch != 1 && ch != 2 && ch != 4) || !w)
        return CUDA_ERROR_INVALID_VALUE;
    CURRENT_CTX(c);
    hgt = hgt ? hgt : 1;
    dep = dep ? dep : 1;
    if (w > UINT64_MAX / fs / ch || hgt > UINT64_MAX / (fs * ch * w) || dep > UINT64_MAX / (fs * ch * w * hgt))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUdeviceptr p;
    CUresult r = mem_alloc(&p, fs * ch * w * hgt * dep, c->ordinal, K_ARRAY, c->id);
    if (r == CUDA_SUCCESS)
        *ph = (CUarray)(uintptr_t)p;
    return r;
}

FC_API CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray)
{
    if (!pAllocateArray)
        return CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, pAllocateArray->Format, pAllocateArray->NumChannels, pAllocateArray->Width,
                        pAllocateArray->Height, 1);
}

FC_API CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray)
{
    if (!pAllocateArray)
        return CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, pAllocateArray->Format, pAllocateArray->NumChannels, pAllocateArray->Width,
                        pAllocateArray->Height, pAllocateArray->Depth);
}

FC_API CUresult cuArrayDestroy(CUarray hArray)
{
    CHECK_INIT();
    return mem_free((CUdeviceptr)(uintptr_t)hArray, K_ARRAY) ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS;
}

/* ---- cuGetProcAddress ---- */
static const struct {
    const char *base;
    void *fn;
    int since;
    int ptds;
} procs[] = {
#define FC_SYM(base, sym, since) {#base, (void *)sym, since, 0},
#define FC_PTSZ(base, sym, since) {#base, (void *)sym, since, 1},
#include "fc_procs.def"
#undef FC_SYM
#undef FC_PTSZ
};

FC_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *symbolStatus)
{
    if (!symbol || !pfn || cudaVersion <= 0 || (flags & ~(cuuint64_t)0x3))
        return CUDA_ERROR_INVALID_VALUE;
    int want_ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    int best = -1, best_ptds = -1, known = 0;
    for (size_t i = 0; i < sizeof(procs) / sizeof(procs[0]); i++) {
        if (strcmp(procs[i].base, symbol) != 0)
            continue;
        known = 1;
        if (procs[i].since > cudaVersion)
            continue;
        if (procs[i].ptds) {
            if (best_ptds < 0 || procs[i].since > procs[best_ptds].since)
                best_ptds = (int)i;
        } else if (best < 0 || procs[i].since > procs[best].since) {
            best = (int)i;
        }
    }
    if (want_ptds && best_ptds >= 0)
        best = best_ptds;
    if (best < 0) {
        *pfn = NULL;
        if (symbolStatus)
            *symbolStatus = known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = procs[best].fn;
    if (symbolStatus)
        *symbolStatus = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

FC_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}
