/*
 * fctest - checks of fakecuda's driver API semantics, driven by
 * fakecuda_test.go.  Each subcommand prints key=value lines and exits 1 with a
 * "FAIL ..." line on the first wrong result; timing bounds are judged by the
 * Go test from the printed numbers.
 */
#define _GNU_SOURCE
#include "mgpu_cuda.h"
#include "fc_nvml.h"
#include "fc_state.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EXPECT(call, want)                                                                          \
    do {                                                                                            \
        CUresult r_ = (call);                                                                       \
        if (r_ != (want)) {                                                                         \
            const char *n_ = NULL;                                                                  \
            cuGetErrorName(r_, &n_);                                                                \
            printf("FAIL %s:%d %s -> %s (%d), want %d\n", __FILE__, __LINE__, #call, n_ ? n_ : "?", \
                   (int)r_, (int)(want));                                                           \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)
#define OK(call) EXPECT(call, CUDA_SUCCESS)
#define CHECK(cond)                                                         \
    do {                                                                    \
        if (!(cond)) {                                                      \
            printf("FAIL %s:%d %s\n", __FILE__, __LINE__, #cond);           \
            exit(1);                                                        \
        }                                                                   \
    } while (0)

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static CUcontext ctx;
static CUfunction fn;

static void setup(void)
{
    CUdevice d;
    CUmodule m;
    OK(cuInit(0));
    OK(cuDeviceGet(&d, 0));
    OK(cuDevicePrimaryCtxRetain(&ctx, d));
    OK(cuCtxSetCurrent(ctx));
    OK(cuModuleLoadData(&m, "image"));
    OK(cuModuleGetFunction(&fn, m, "k"));
}

static CUresult launch_ms(CUstream s, uint64_t ms)
{
    uint64_t ns = ms * 1000000ULL;
    void *p[] = {&ns};
    return cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, s, p, NULL);
}

/* A 100 ms kernel: the launch returns at once, queries say NOT_READY until
 * the stream got there, and the events measure the kernel. */
static int t_async(void)
{
    setup();
    CUstream s;
    CUevent a, b;
    OK(cuStreamCreate(&s, 0));
    OK(cuEventCreate(&a, 0));
    OK(cuEventCreate(&b, 0));
    EXPECT(cuEventQuery(b), CUDA_SUCCESS); /* never recorded */
    uint64_t t0 = now_ns();
    OK(cuEventRecord(a, s));
    OK(launch_ms(s, 100));
    OK(cuEventRecord(b, s));
    uint64_t t1 = now_ns();
    EXPECT(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    EXPECT(cuEventQuery(b), CUDA_ERROR_NOT_READY);
    float ms;
    EXPECT(cuEventElapsedTime(&ms, a, b), CUDA_ERROR_NOT_READY);
    OK(cuEventSynchronize(b));
    uint64_t t2 = now_ns();
    OK(cuEventQuery(b));
    OK(cuStreamQuery(s));
    OK(cuEventElapsedTime(&ms, a, b));
    printf("launch_ns=%llu\nsync_ns=%llu\nelapsed_ms=%.3f\n", (unsigned long long)(t1 - t0),
           (unsigned long long)(t2 - t0), ms);
    /* in-order execution across two kernels; cuCtxSynchronize waits for all.
     * Timed from before the first launch: the two kernels cannot both have
     * run in less than 60 ms after it, however long the launches took. */
    t0 = now_ns();
    OK(launch_ms(s, 30));
    OK(launch_ms(NULL, 30));
    OK(cuCtxSynchronize());
    printf("ctxsync_ns=%llu\n", (unsigned long long)(now_ns() - t0));
    OK(cuStreamQuery(s));
    OK(cuStreamQuery(NULL));
    /* timing disabled events cannot be measured */
    CUevent c;
    OK(cuEventCreate(&c, CU_EVENT_DISABLE_TIMING));
    OK(cuEventRecord(c, s));
    OK(cuEventSynchronize(c));
    EXPECT(cuEventElapsedTime(&ms, a, c), CUDA_ERROR_INVALID_HANDLE);
    OK(cuEventDestroy_v2(c));
    /* an event destroyed while pending is released when reached */
    OK(launch_ms(s, 10));
    OK(cuEventRecord(a, s));
    OK(cuEventDestroy_v2(a));
    OK(cuStreamSynchronize(s));
    OK(cuStreamDestroy_v2(s));
    EXPECT(cuStreamDestroy_v2(NULL), CUDA_ERROR_INVALID_HANDLE);
    return 0;
}

#define WANT_PROC(name, ver, flags, sym)                                                       \
    do {                                                                                       \
        void *p_ = NULL;                                                                       \
        CUdriverProcAddressQueryResult st_ = 99;                                               \
        OK(cuGetProcAddress_v2(name, &p_, ver, flags, &st_));                                  \
        CHECK(st_ == CU_GET_PROC_ADDRESS_SUCCESS);                                             \
        CHECK(p_ == (void *)sym);                                                              \
        printf("proc %s %d %d -> %s\n", name, ver, (int)(flags), #sym);                        \
    } while (0)

static int t_procaddr(void)
{
    const cuuint64_t D = CU_GET_PROC_ADDRESS_DEFAULT, P = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    WANT_PROC("cuLaunchKernel", 12040, D, cuLaunchKernel);
    WANT_PROC("cuLaunchKernel", 12040, P, cuLaunchKernel_ptsz);
    WANT_PROC("cuLaunchKernelEx", 12040, P, cuLaunchKernelEx_ptsz);
    WANT_PROC("cuLaunchCooperativeKernel", 12040, P, cuLaunchCooperativeKernel_ptsz);
    WANT_PROC("cuGraphLaunch", 12040, P, cuGraphLaunch_ptsz);
    WANT_PROC("cuEventRecord", 12040, P, cuEventRecord_ptsz);
    WANT_PROC("cuStreamSynchronize", 12040, P, cuStreamSynchronize_ptsz);
    WANT_PROC("cuStreamQuery", 12040, P, cuStreamQuery_ptsz);
    WANT_PROC("cuStreamBeginCapture", 12040, D, cuStreamBeginCapture_v2);
    WANT_PROC("cuStreamBeginCapture", 12040, P, cuStreamBeginCapture_v2_ptsz);
    WANT_PROC("cuStreamEndCapture", 12040, P, cuStreamEndCapture_ptsz);
    WANT_PROC("cuMemAllocAsync", 12040, P, cuMemAllocAsync_ptsz);
    WANT_PROC("cuMemAllocFromPoolAsync", 12040, P, cuMemAllocFromPoolAsync_ptsz);
    WANT_PROC("cuMemFreeAsync", 12040, P, cuMemFreeAsync_ptsz);
    WANT_PROC("cuMemAlloc", 12040, P, cuMemAlloc_v2); /* no _ptsz variant */
    WANT_PROC("cuMemAlloc", 12040, D, cuMemAlloc_v2);
    WANT_PROC("cuMemFree", 12040, D, cuMemFree_v2);
    WANT_PROC("cuMemGetInfo", 12040, D, cuMemGetInfo_v2);
    WANT_PROC("cuCtxCreate", 12040, D, cuCtxCreate_v2);
    WANT_PROC("cuCtxDestroy", 12040, D, cuCtxDestroy_v2);
    WANT_PROC("cuStreamDestroy", 12040, D, cuStreamDestroy_v2);
    WANT_PROC("cuEventDestroy", 12040, D, cuEventDestroy_v2);
    WANT_PROC("cuDeviceTotalMem", 12040, D, cuDeviceTotalMem_v2);
    WANT_PROC("cuDevicePrimaryCtxRelease", 12040, D, cuDevicePrimaryCtxRelease_v2);
    WANT_PROC("cuDeviceGetUuid", 12040, D, cuDeviceGetUuid_v2);
    WANT_PROC("cuDeviceGetUuid", 11000, D, cuDeviceGetUuid);
    WANT_PROC("cuGetProcAddress", 12040, D, cuGetProcAddress_v2);
    WANT_PROC("cuGetProcAddress", 11080, D, cuGetProcAddress);
    WANT_PROC("cuArrayCreate", 12040, D, cuArrayCreate_v2);
    WANT_PROC("cuArray3DCreate", 12040, D, cuArray3DCreate_v2);
    WANT_PROC("cuMemCreate", 12040, D, cuMemCreate);
    void *p = (void *)1;
    CUdriverProcAddressQueryResult st = 99;
    EXPECT(cuGetProcAddress_v2("cuNoSuchThing", &p, 12040, D, &st), CUDA_ERROR_NOT_FOUND);
    CHECK(p == NULL && st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    EXPECT(cuGetProcAddress_v2("cuMemAlloc_v2", &p, 12040, D, &st), CUDA_ERROR_NOT_FOUND); /* base names only */
    EXPECT(cuGetProcAddress_v2("cuLaunchKernelEx", &p, 11000, D, &st), CUDA_ERROR_NOT_FOUND);
    CHECK(p == NULL && st == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    EXPECT(cuGetProcAddress("cuNoSuchThing", &p, 12040, D), CUDA_ERROR_NOT_FOUND);
    OK(cuGetProcAddress("cuInit", &p, 12040, D));
    CHECK(p == (void *)cuInit);
    EXPECT(cuGetProcAddress_v2(NULL, &p, 12040, D, &st), CUDA_ERROR_INVALID_VALUE);
    printf("procaddr=ok\n");
    return 0;
}

struct ptds_arg {
    pthread_barrier_t *bar;
    CUresult own, other;
};

static void *ptds_thread(void *p)
{
    struct ptds_arg *a = p;
    cuCtxSetCurrent(ctx);
    pthread_barrier_wait(a->bar); /* the main thread's per-thread stream is busy now */
    a->own = cuStreamQuery_ptsz(NULL);
    a->other = cuStreamQuery_ptsz(CU_STREAM_PER_THREAD);
    pthread_barrier_wait(a->bar);
    return NULL;
}

/* Per-thread default streams are per thread and distinct from the legacy one. */
static int t_ptsz(void)
{
    setup();
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, 2);
    struct ptds_arg a = {&bar, -1, -1};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, ptds_thread, &a) == 0);
    uint64_t ns = 200000000ULL;
    void *p[] = {&ns};
    OK(cuLaunchKernel_ptsz(fn, 1, 1, 1, 1, 1, 1, 0, NULL, p, NULL));
    pthread_barrier_wait(&bar);
    pthread_barrier_wait(&bar);
    pthread_join(t, NULL);
    CHECK(a.own == CUDA_SUCCESS && a.other == CUDA_SUCCESS);
    EXPECT(cuStreamQuery_ptsz(NULL), CUDA_ERROR_NOT_READY);
    EXPECT(cuStreamQuery(CU_STREAM_PER_THREAD), CUDA_ERROR_NOT_READY);
    OK(cuStreamQuery(NULL)); /* legacy stream: idle */
    OK(cuStreamQuery(CU_STREAM_LEGACY));
    OK(cuStreamSynchronize_ptsz(NULL));
    OK(cuStreamQuery(CU_STREAM_PER_THREAD));
    printf("ptsz=ok\n");
    return 0;
}

/* Captured launches build a graph and do not run; the graph runs them. */
static int t_graph(void)
{
    setup();
    CUstream s;
    CUevent a, b;
    CUgraph gr;
    CUgraphExec ex;
    CUstreamCaptureStatus cs;
    float ms;
    OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    OK(cuEventCreate(&a, 0));
    OK(cuEventCreate(&b, 0));
    EXPECT(cuStreamBeginCapture_v2(NULL, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    OK(cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    OK(cuStreamIsCapturing(s, &cs));
    CHECK(cs == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    for (int i = 0; i < 5; i++)
        OK(launch_ms(s, 20));
    OK(cuStreamEndCapture(s, &gr));
    CHECK(gr != NULL);
    OK(cuStreamIsCapturing(s, &cs));
    CHECK(cs == CU_STREAM_CAPTURE_STATUS_NONE);
    OK(cuStreamQuery(s)); /* nothing ran */
    OK(cuGraphInstantiateWithFlags(&ex, gr, 0));
    OK(cuEventRecord(a, s));
    OK(cuGraphLaunch(ex, s));
    OK(cuEventRecord(b, s));
    EXPECT(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    OK(cuStreamSynchronize(s));
    OK(cuEventElapsedTime(&ms, a, b));
    printf("capture_graph_ms=%.3f\n", ms);
    OK(cuGraphExecDestroy(ex));
    OK(cuGraphDestroy(gr));

    /* explicit nodes */
    OK(cuGraphCreate(&gr, 0));
    uint64_t ns = 20000000ULL;
    void *p[] = {&ns};
    CUDA_KERNEL_NODE_PARAMS np = {.func = fn, .gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 1,
                                  .blockDimY = 1, .blockDimZ = 1, .kernelParams = p};
    CUgraphNode n1, n2, n3;
    OK(cuGraphAddKernelNode(&n1, gr, NULL, 0, &np));
    ns = 0; /* parameters are copied when the node is added */
    OK(cuGraphAddKernelNode(&n2, gr, &n1, 1, &np));
    ns = 20000000ULL;
    OK(cuGraphAddKernelNode(&n3, gr, &n2, 1, &np));
    OK(cuGraphInstantiateWithFlags(&ex, gr, 0));
    OK(cuEventRecord(a, s));
    OK(cuGraphLaunch_ptsz(ex, s));
    OK(cuEventRecord(b, s));
    OK(cuEventSynchronize(b));
    OK(cuEventElapsedTime(&ms, a, b));
    printf("node_graph_ms=%.3f\n", ms);

    /* a synchronize during capture invalidates it */
    OK(cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_RELAXED));
    EXPECT(cuStreamSynchronize(s), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    EXPECT(cuStreamEndCapture(s, &gr), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    CHECK(gr == NULL);
    EXPECT(cuStreamEndCapture(s, &gr), (CUresult)401); /* CUDA_ERROR_ILLEGAL_STATE */
    printf("graph=ok\n");
    return 0;
}

static void meminfo(size_t *fr)
{
    size_t tot;
    OK(cuMemGetInfo_v2(fr, &tot));
}

/* Accounting of every allocation API, address ranges, bad frees. */
static int t_memory(void)
{
    setup();
    size_t f0, f1;
    CUdeviceptr p, q, base;
    size_t size, pitch;
    meminfo(&f0);
    OK(cuMemAlloc_v2(&p, 1000));
    OK(cuMemAlloc_v2(&q, 5000));
    CHECK(p != q && p % 512 == 0 && q % 512 == 0);
    OK(cuMemGetAddressRange_v2(&base, &size, q + 4999));
    CHECK(base == q && size == 5000);
    EXPECT(cuMemGetAddressRange_v2(&base, &size, q + 5000), CUDA_ERROR_NOT_FOUND);
    meminfo(&f1);
    CHECK(f0 - f1 == 6000);
    OK(cuMemFree_v2(p));
    EXPECT(cuMemFree_v2(p), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemFree_v2(q));
    EXPECT(cuMemAlloc_v2(&p, 0), CUDA_ERROR_INVALID_VALUE);

    OK(cuMemAllocPitch_v2(&p, &pitch, 1000, 10, 4));
    CHECK(pitch == 1024);
    meminfo(&f1);
    CHECK(f0 - f1 == 10240);
    OK(cuMemFree_v2(p));

    CUarray arr;
    CUDA_ARRAY_DESCRIPTOR ad = {.Width = 100, .Height = 0, .Format = CU_AD_FORMAT_HALF, .NumChannels = 2};
    OK(cuArrayCreate_v2(&arr, &ad));
    meminfo(&f1);
    CHECK(f0 - f1 == 400);
    EXPECT(cuMemFree_v2((CUdeviceptr)(uintptr_t)arr), CUDA_ERROR_INVALID_VALUE);
    OK(cuArrayDestroy(arr));
    CUDA_ARRAY3D_DESCRIPTOR ad3 = {.Width = 10, .Height = 20, .Depth = 3, .Format = CU_AD_FORMAT_FLOAT,
                                   .NumChannels = 4};
    OK(cuArray3DCreate_v2(&arr, &ad3));
    meminfo(&f1);
    CHECK(f0 - f1 == 16 * 10 * 20 * 3);
    OK(cuArrayDestroy(arr));

    CUmemGenericAllocationHandle h;
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    OK(cuMemCreate(&h, 2 << 20, &prop, 0));
    meminfo(&f1);
    CHECK(f0 - f1 == (2 << 20));
    OK(cuMemRelease(h));
    EXPECT(cuMemRelease(h), CUDA_ERROR_INVALID_VALUE);

    /* stream-ordered free happens when the stream gets there */
    CUstream s;
    CUmemoryPool pool;
    OK(cuStreamCreate(&s, 0));
    OK(cuDeviceGetDefaultMemPool(&pool, 0));
    OK(cuMemAllocFromPoolAsync(&p, 4096, pool, s));
    OK(cuMemAllocAsync(&q, 4096, s));
    OK(launch_ms(s, 100));
    OK(cuMemFreeAsync(p, s));
    OK(cuMemFreeAsync(q, s));
    meminfo(&f1);
    CHECK(f0 - f1 == 8192); /* still in use by the running kernel */
    OK(cuStreamSynchronize(s));
    meminfo(&f1);
    CHECK(f0 == f1);

    /* destroying a context frees its memory */
    CUcontext c2;
    OK(cuCtxCreate_v2(&c2, 0, 0));
    OK(cuMemAlloc_v2(&p, 1 << 20));
    meminfo(&f1);
    CHECK(f0 - f1 == (1 << 20));
    OK(cuCtxDestroy_v2(c2));
    CUcontext cur;
    OK(cuCtxGetCurrent(&cur));
    CHECK(cur == ctx);
    meminfo(&f1);
    CHECK(f0 == f1);
    printf("memory=ok\n");
    return 0;
}

/* A process's own streams are one context: while only they wait for the
 * device, its time slice goes on.  The parent keeps two streams busy with
 * 250 us kernels well past one slice; then a child process launches one
 * kernel.  The child waits about a whole slice (the parent's slice was
 * renewed at its last kernel), never longer than a slice and a kernel. */
static int t_slice(void)
{
    int go[2], back[2];
    CHECK(pipe(go) == 0 && pipe(back) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        setup();
        char c;
        CHECK(read(go[0], &c, 1) == 1);
        uint64_t t0 = now_ns();
        uint64_t ns = 100000ULL;
        void *p[] = {&ns};
        OK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, p, NULL));
        OK(cuStreamSynchronize(NULL));
        uint64_t waited = now_ns() - t0;
        CHECK(write(back[1], &waited, sizeof waited) == (ssize_t)sizeof waited);
        _exit(0);
    }
    setup();
    CUstream s[2];
    OK(cuStreamCreate(&s[0], 0));
    OK(cuStreamCreate(&s[1], 0));
    uint64_t ns = 250000ULL;
    void *p[] = {&ns};
    CUevent mid;
    OK(cuEventCreate(&mid, 0));
    for (int i = 0; i < 96; i++) { /* 24 ms of work, 12 ms per stream */
        OK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, s[i % 2], p, NULL));
        if (i == 43) /* 11 ms in: between the slice boundaries of 4 ms turns */
            OK(cuEventRecord(mid, s[1]));
    }
    OK(cuEventSynchronize(mid));
    CHECK(write(go[1], "g", 1) == 1);
    uint64_t waited = 0;
    CHECK(read(back[0], &waited, sizeof waited) == (ssize_t)sizeof waited);
    int st = 0;
    CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    OK(cuCtxSynchronize());
    printf("other_wait_us=%.0f\nslice=ok\n", (double)waited / 1e3);
    return 0;
}

/* cuInit's result (an unknown FAKECUDA_DEVICE_MODEL is refused). */
static int t_init(void)
{
    CUresult r = cuInit(0);
    int n = -1;
    CUresult r2 = cuDeviceGetCount(&n);
    printf("init_result=%d\ncount_result=%d\ncount=%d\n", (int)r, (int)r2, n);
    return 0;
}

static void write_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        CHECK(w > 0);
        p += w;
        n -= (size_t)w;
    }
}

/* One process of t_share: count kernels of us microseconds on one stream,
 * an event before the first and after each; prints each kernel's time
 * between its events (whatever else ran on the device in between counts). */
static void share_child(int k, uint64_t us, int count, int readyfd, int gofd)
{
    setup();
    CUstream s;
    OK(cuStreamCreate(&s, 0));
    CUevent *ev = calloc((size_t)count + 1, sizeof(*ev));
    CHECK(ev != NULL);
    for (int i = 0; i <= count; i++)
        OK(cuEventCreate(&ev[i], 0));
    char c = 'r';
    CHECK(write(readyfd, &c, 1) == 1);
    CHECK(read(gofd, &c, 1) == 1);
    uint64_t ns = us * 1000ULL;
    void *p[] = {&ns};
    OK(cuEventRecord(ev[0], s));
    for (int i = 0; i < count; i++) {
        OK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, s, p, NULL));
        OK(cuEventRecord(ev[i + 1], s));
    }
    OK(cuStreamSynchronize(s));
    size_t cap = 128 + (size_t)count * 48, len = 0; /* %.0f of a float: at most 40 digits */
    char *buf = malloc(cap);
    CHECK(buf != NULL);
    float ms = 0;
    OK(cuEventElapsedTime(&ms, ev[0], ev[count]));
    len += (size_t)snprintf(buf + len, cap - len, "c%d.elapsed_us=%.0f\nc%d.gaps_us=", k, ms * 1e3, k);
    for (int i = 0; i < count; i++) {
        OK(cuEventElapsedTime(&ms, ev[i], ev[i + 1]));
        CHECK(len < cap);
        len += (size_t)snprintf(buf + len, cap - len, "%s%.0f", i ? "," : "", ms * 1e3);
    }
    CHECK(len < cap);
    len += (size_t)snprintf(buf + len, cap - len, "\n");
    CHECK(len < cap);
    write_all(1, buf, len);
    _exit(0);
}

/* n processes start together (on a word from this one, which does not use
 * CUDA) and each runs share_child's kernels.  Then this one reads from the
 * device state who held the device when (its ownership trace) and each
 * process's counters:
 *   runs=WHO@START+DUR,...  WHO: the process's number, '-' for nobody;
 *                           START, DUR: us from the word to start
 *   c<k>.kernel_ns= c<k>.busy_ns= c<k>.kernels=
 * The Go tests judge the numbers against the device model. */
static int t_share(int n, uint64_t us, int count)
{
    enum { MAXN = 8 };
    CHECK(n >= 1 && n <= MAXN && count >= 1 && count <= 1000 && us > 0);
    struct fc_dev *d = fc_dev_open(0, 1);
    if (!d) {
        printf("FAIL device state: %s\n", strerror(errno));
        exit(1);
    }
    fflush(stdout);
    int ready[2], go[MAXN][2];
    pid_t pids[MAXN];
    CHECK(pipe(ready) == 0);
    for (int k = 0; k < n; k++) {
        CHECK(pipe(go[k]) == 0);
        pids[k] = fork();
        CHECK(pids[k] >= 0);
        if (pids[k] == 0)
            share_child(k, us, count, ready[1], go[k][0]);
    }
    for (int k = 0; k < n; k++) {
        char c;
        CHECK(read(ready[0], &c, 1) == 1);
    }
    fc_dev_lock(d);
    uint64_t n0 = d->ntrace;
    fc_dev_unlock(d);
    uint64_t t_go = now_ns();
    for (int k = 0; k < n; k++)
        CHECK(write(go[k][1], "g", 1) == 1);
    int failed = 0;
    for (int k = 0; k < n; k++) {
        int st = 0;
        CHECK(waitpid(pids[k], &st, 0) == pids[k]);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
            failed = 1;
    }
    CHECK(!failed);
    static struct fc_trace_ent tr[FC_TRACE];
    int entry[MAXN];
    fc_dev_lock(d);
    uint64_t n1 = d->ntrace;
    if (n1 - n0 > FC_TRACE)
        n0 = n1 - FC_TRACE;
    for (uint64_t i = n0; i < n1; i++)
        tr[i - n0] = d->trace[i % FC_TRACE];
    for (int k = 0; k < n; k++) {
        entry[k] = -1;
        for (int i = 0; i < FC_MAX_PROCS; i++)
            if (d->procs[i].state != FC_PROC_FREE && d->procs[i].pid == pids[k])
                entry[k] = i;
        CHECK(entry[k] >= 0);
        struct fc_proc *p = &d->procs[entry[k]];
        printf("c%d.kernel_ns=%llu\nc%d.busy_ns=%llu\nc%d.kernels=%llu\n", k, (unsigned long long)p->kernel_ns, k,
               (unsigned long long)p->busy_ns, k, (unsigned long long)p->kernels);
    }
    printf("model=%s\ntimeslice_ns=%llu\n", fc_model_name(d->model), (unsigned long long)d->slice_ns);
    fc_dev_unlock(d);
    printf("runs=");
    for (uint64_t i = 0; i < n1 - n0; i++) {
        int who = -1;
        for (int k = 0; k < n; k++)
            if (tr[i].proc >= 0 && tr[i].proc == entry[k])
                who = k;
        uint64_t dur = i + 1 < n1 - n0 ? tr[i + 1].t_ns - tr[i].t_ns : 0;
        char w[16] = "-";
        if (who >= 0)
            snprintf(w, sizeof(w), "%d", who);
        printf("%s%s@%.0f+%.0f", i ? "," : "", w, ((double)tr[i].t_ns - (double)t_go) / 1e3, (double)dur / 1e3);
    }
    printf("\nshare=ok\n");
    fc_dev_close(d);
    return 0;
}

/* ---- NVML per-process queries ---- */

/* The layouts go-nvml (and nvml.h) use. */
_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16, "nvmlProcessInfo_v1_t");
_Static_assert(sizeof(nvmlProcessInfo_v2_t) == 24, "nvmlProcessInfo_v2_t");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t");
_Static_assert(sizeof(nvmlProcessUtilizationSample_t) == 32, "nvmlProcessUtilizationSample_t");

#define NV(call, want)                                                                                   \
    do {                                                                                                 \
        nvmlReturn_t r_ = (call);                                                                        \
        if (r_ != (want)) {                                                                              \
            printf("FAIL %s:%d %s -> %s (%d), want %d\n", __FILE__, __LINE__, #call, nvmlErrorString(r_), \
                   (int)r_, (int)(want));                                                                \
            exit(1);                                                                                     \
        }                                                                                                \
    } while (0)

static uint64_t real_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000ULL + (uint64_t)ts.tv_nsec / 1000;
}

static nvmlDevice_t nvml_dev0(void)
{
    nvmlDevice_t d;
    NV(nvmlInit_v2(), NVML_SUCCESS);
    NV(nvmlDeviceGetHandleByIndex_v2(0, &d), NVML_SUCCESS);
    return d;
}

/* A child of the NVML tests: runs commands from the parent, one byte each
 * on its own pipe, and answers each with one byte. */
struct kid {
    pid_t pid;
    int cmd, ack; /* parent's ends */
};

typedef void (*kid_fn)(char cmd, void *arg);

static struct kid kid_start(kid_fn body, void *arg)
{
    int c[2], a[2];
    CHECK(pipe(c) == 0 && pipe(a) == 0);
    fflush(stdout);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(c[1]);
        close(a[0]);
        body(0, arg); /* start */
        CHECK(write(a[1], "k", 1) == 1);
        char cmd;
        while (read(c[0], &cmd, 1) == 1 && cmd != 'x') {
            body(cmd, arg);
            CHECK(write(a[1], "k", 1) == 1);
        }
        _exit(0);
    }
    close(c[0]);
    close(a[1]);
    struct kid k = {pid, c[1], a[0]};
    char ack;
    CHECK(read(k.ack, &ack, 1) == 1);
    return k;
}

static void kid_do(struct kid *k, char cmd)
{
    char ack;
    CHECK(write(k->cmd, &cmd, 1) == 1);
    CHECK(read(k->ack, &ack, 1) == 1);
}

static void kid_end(struct kid *k)
{
    int st = 0;
    CHECK(write(k->cmd, "x", 1) == 1);
    CHECK(waitpid(k->pid, &st, 0) == k->pid && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    close(k->cmd);
    close(k->ack);
}

/* Child A: memory through every allocation family; 'f' frees the linear
 * 100 MiB synchronously and the async 2 MiB on its stream. */
static CUdeviceptr a_big, a_async;
static CUstream a_stream;
#define A_PITCH_BYTES (1024ULL * 1000) /* 1000 wide rounded up to 512, 1000 high */
#define A_BYTES                                                                                              \
    ((100ULL << 20) + A_PITCH_BYTES + (1ULL << 20) + (2ULL << 20) + (3ULL << 20) + (4ULL << 20) + 4 * 64 * 8)
#define A_FREED ((100ULL << 20) + (2ULL << 20))
static void kid_a(char cmd, void *arg)
{
    (void)arg;
    if (cmd == 0) {
        setup();
        CUdeviceptr p;
        size_t pitch;
        OK(cuMemAlloc_v2(&a_big, 100 << 20));
        OK(cuMemAllocPitch_v2(&p, &pitch, 1000, 1000, 4));
        CHECK(pitch == 1024);
        OK(cuMemAllocManaged(&p, 1 << 20, CU_MEM_ATTACH_GLOBAL));
        OK(cuStreamCreate(&a_stream, 0));
        OK(cuMemAllocAsync(&a_async, 2 << 20, a_stream));
        CUmemoryPool pool;
        OK(cuDeviceGetDefaultMemPool(&pool, 0));
        OK(cuMemAllocFromPoolAsync(&p, 3 << 20, pool, a_stream));
        CUmemGenericAllocationHandle h;
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof(prop));
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        OK(cuMemCreate(&h, 4 << 20, &prop, 0));
        CUarray arr;
        CUDA_ARRAY_DESCRIPTOR ad = {.Width = 64, .Height = 8, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 1};
        OK(cuArrayCreate_v2(&arr, &ad));
    } else if (cmd == 'f') {
        OK(cuMemFree_v2(a_big));
        OK(launch_ms(a_stream, 20));
        OK(cuMemFreeAsync(a_async, a_stream));
        OK(cuStreamSynchronize(a_stream));
    }
}

/* Child B: 50 MiB and a 3D array, then waits to be killed. */
#define B_BYTES ((50ULL << 20) + 16ULL * 10 * 20 * 3)
static void kid_b(char cmd, void *arg)
{
    (void)arg;
    if (cmd == 0) {
        setup();
        CUdeviceptr p;
        OK(cuMemAlloc_v2(&p, 50 << 20));
        CUarray arr;
        CUDA_ARRAY3D_DESCRIPTOR ad3 = {.Width = 10, .Height = 20, .Depth = 3, .Format = CU_AD_FORMAT_FLOAT,
                                       .NumChannels = 4};
        OK(cuArray3DCreate_v2(&arr, &ad3));
    }
}

/* Child C: cuInit only; 'c' retains the primary context, 'r' releases it,
 * 'n' creates a context, 'd' destroys it. */
static CUcontext c_ctx;
static void kid_c(char cmd, void *arg)
{
    (void)arg;
    CUcontext c;
    if (cmd == 0)
        OK(cuInit(0));
    else if (cmd == 'c')
        OK(cuDevicePrimaryCtxRetain(&c, 0));
    else if (cmd == 'r')
        OK(cuDevicePrimaryCtxRelease_v2(0));
    else if (cmd == 'n')
        OK(cuCtxCreate_v2(&c_ctx, 0, 0));
    else if (cmd == 'd')
        OK(cuCtxDestroy_v2(c_ctx));
}

#define MAXP 16
static unsigned list_v3(nvmlDevice_t d, nvmlProcessInfo_t *out)
{
    unsigned n = MAXP;
    NV(nvmlDeviceGetComputeRunningProcesses_v3(d, &n, out), NVML_SUCCESS);
    for (unsigned i = 0; i < n; i++)
        CHECK(out[i].gpuInstanceId == 0xFFFFFFFFu && out[i].computeInstanceId == 0xFFFFFFFFu);
    return n;
}

/* The memory of pid in a v3 list; -1 if not listed. */
static long long mem_of(const nvmlProcessInfo_t *v, unsigned n, pid_t pid)
{
    long long m = -1;
    for (unsigned i = 0; i < n; i++)
        if (v[i].pid == (unsigned)pid) {
            CHECK(m < 0); /* listed once */
            m = (long long)v[i].usedGpuMemory;
        }
    return m;
}

static unsigned long long nvml_used(nvmlDevice_t d)
{
    nvmlMemory_t m;
    NV(nvmlDeviceGetMemoryInfo(d, &m), NVML_SUCCESS);
    return m.used;
}

/* nvmlDeviceGetComputeRunningProcesses*: who is listed with how much
 * memory, the count protocol, the three layouts, contexts, a SIGKILLed
 * process. */
static int t_nvml_procs(void)
{
    unsigned n = 0;
    NV(nvmlDeviceGetComputeRunningProcesses_v3(NULL, &n, NULL), NVML_ERROR_UNINITIALIZED);
    nvmlDevice_t d = nvml_dev0();
    NV(nvmlDeviceGetComputeRunningProcesses_v3(d, &n, NULL), NVML_SUCCESS); /* nobody yet */
    CHECK(n == 0);
    struct kid a = kid_start(kid_a, NULL), b = kid_start(kid_b, NULL), c = kid_start(kid_c, NULL);
    nvmlProcessInfo_t v[MAXP];
    n = list_v3(d, v);
    CHECK(n == 2); /* c has no context */
    CHECK(mem_of(v, n, a.pid) == (long long)A_BYTES && mem_of(v, n, b.pid) == (long long)B_BYTES);
    CHECK(nvml_used(d) == A_BYTES + B_BYTES);
    printf("a.mem=%lld\nb.mem=%lld\n", mem_of(v, n, a.pid), mem_of(v, n, b.pid));

    /* the count protocol */
    n = 0;
    NV(nvmlDeviceGetComputeRunningProcesses_v3(d, &n, NULL), FC_NVML_ERROR_INSUFFICIENT_SIZE);
    CHECK(n == 2);
    n = 1;
    NV(nvmlDeviceGetComputeRunningProcesses_v3(d, &n, v), FC_NVML_ERROR_INSUFFICIENT_SIZE);
    CHECK(n == 2);
    n = 3;
    NV(nvmlDeviceGetComputeRunningProcesses_v3(d, &n, NULL), NVML_ERROR_INVALID_ARGUMENT);
    NV(nvmlDeviceGetComputeRunningProcesses_v3(d, NULL, v), NVML_ERROR_INVALID_ARGUMENT);
    NV(nvmlDeviceGetComputeRunningProcesses_v3((nvmlDevice_t)&n, &n, v), NVML_ERROR_INVALID_ARGUMENT);
    n = 2;
    NV(nvmlDeviceGetComputeRunningProcesses_v3(d, &n, v), NVML_SUCCESS);
    CHECK(n == 2);
    nvmlProcessInfo_v1_t v1[4];
    memset(v1, 0xff, sizeof(v1));
    n = 4;
    NV(nvmlDeviceGetComputeRunningProcesses(d, &n, v1), NVML_SUCCESS);
    CHECK(n == 2 && v1[2].pid == 0xFFFFFFFFu);
    for (unsigned i = 0; i < n; i++)
        CHECK(v1[i].pid == v[i].pid && v1[i].usedGpuMemory == v[i].usedGpuMemory);
    nvmlProcessInfo_v2_t v2[4];
    n = 4;
    NV(nvmlDeviceGetComputeRunningProcesses_v2(d, &n, v2), NVML_SUCCESS);
    CHECK(n == 2);
    for (unsigned i = 0; i < n; i++)
        CHECK(v2[i].pid == v[i].pid && v2[i].usedGpuMemory == v[i].usedGpuMemory &&
              v2[i].gpuInstanceId == 0xFFFFFFFFu && v2[i].computeInstanceId == 0xFFFFFFFFu);

    /* a process is listed while it has a context */
    kid_do(&c, 'c');
    n = list_v3(d, v);
    CHECK(n == 3 && mem_of(v, n, c.pid) == 0);
    kid_do(&c, 'r');
    n = list_v3(d, v);
    CHECK(n == 2 && mem_of(v, n, c.pid) == -1);
    kid_do(&c, 'n');
    n = list_v3(d, v);
    CHECK(n == 3 && mem_of(v, n, c.pid) == 0);
    kid_do(&c, 'd');
    n = list_v3(d, v);
    CHECK(n == 2 && mem_of(v, n, c.pid) == -1);

    /* frees */
    kid_do(&a, 'f');
    n = list_v3(d, v);
    CHECK(mem_of(v, n, a.pid) == (long long)(A_BYTES - A_FREED) && mem_of(v, n, b.pid) == (long long)B_BYTES);
    printf("a.mem_after_free=%lld\n", mem_of(v, n, a.pid));

    /* SIGKILL: gone at once, its memory free */
    CHECK(kill(b.pid, SIGKILL) == 0);
    int st = 0;
    CHECK(waitpid(b.pid, &st, 0) == b.pid && WIFSIGNALED(st));
    n = list_v3(d, v);
    CHECK(n == 1 && mem_of(v, n, a.pid) == (long long)(A_BYTES - A_FREED) && mem_of(v, n, b.pid) == -1);
    CHECK(nvml_used(d) == A_BYTES - A_FREED);
    close(b.cmd);
    close(b.ack);

    kid_end(&a);
    kid_end(&c);
    n = 0;
    NV(nvmlDeviceGetComputeRunningProcesses_v3(d, &n, NULL), NVML_SUCCESS);
    CHECK(n == 0);
    CHECK(nvml_used(d) == 0);
    NV(nvmlShutdown(), NVML_SUCCESS);
    printf("nvml_procs=ok\n");
    return 0;
}

/* The children of t_nvml_util. */
struct ukid {
    uint64_t kernel_us, period_us; /* period 0: flat out (two kernels in flight) */
    uint64_t seconds_ms;
};

static void kid_util(char cmd, void *arg)
{
    const struct ukid *u = arg;
    if (cmd == 0) {
        setup();
        if (u->kernel_us == 0) { /* the primer: one kernel before the watcher's first call */
            OK(launch_ms(NULL, 1));
            OK(cuStreamSynchronize(NULL));
        }
        return;
    }
    if (cmd != 'g')
        return;
    CUstream s;
    CUevent ev[2];
    OK(cuStreamCreate(&s, 0));
    OK(cuEventCreate(&ev[0], 0));
    OK(cuEventCreate(&ev[1], 0));
    uint64_t ns = u->kernel_us * 1000ULL;
    void *p[] = {&ns};
    uint64_t t = now_ns(), end = t + u->seconds_ms * 1000000ULL;
    for (uint64_t i = 0; now_ns() < end; i++) {
        OK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, s, p, NULL));
        if (u->period_us) {
            OK(cuStreamSynchronize(s));
            t += u->period_us * 1000ULL;
            struct timespec ts = {(time_t)(t / 1000000000ULL), (long)(t % 1000000000ULL)};
            while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
                ;
        } else {
            OK(cuEventRecord(ev[i % 2], s));
            if (i > 0)
                OK(cuEventSynchronize(ev[(i + 1) % 2])); /* at most two in flight */
        }
    }
    OK(cuStreamSynchronize(s));
}

/* One nvmlDeviceGetProcessUtilization answer the way go-nvml asks
 * (count first, then the samples); returns the count, 0 for NOT_FOUND. */
static unsigned util_query(nvmlDevice_t d, unsigned long long last, nvmlProcessUtilizationSample_t *out)
{
    unsigned n = 0;
    uint64_t t = now_ns();
    nvmlReturn_t r = nvmlDeviceGetProcessUtilization(d, NULL, &n, last);
    if (r == NVML_ERROR_NOT_FOUND)
        return 0;
    NV(r, FC_NVML_ERROR_INSUFFICIENT_SIZE);
    CHECK(n > 0 && n <= MAXP);
    unsigned want = n;
    n = MAXP;
    r = nvmlDeviceGetProcessUtilization(d, out, &n, last);
    if (now_ns() - t < 10000000ULL) {
        NV(r, NVML_SUCCESS);
        CHECK(n == want); /* the same sample: under 20 ms later */
    } else if (r == NVML_ERROR_NOT_FOUND) {
        return 0; /* a loaded box: a new sample, in which nobody ran */
    } else {
        NV(r, NVML_SUCCESS);
    }
    for (unsigned i = 1; i < n; i++)
        CHECK(out[i].timeStamp == out[0].timeStamp);
    for (unsigned i = 0; i < n; i++)
        CHECK(out[i].smUtil <= 100 && out[i].memUtil == 0 && out[i].encUtil == 0 && out[i].decUtil == 0);
    return n;
}

static int util_of(const nvmlProcessUtilizationSample_t *v, unsigned n, pid_t pid)
{
    int u = -1;
    for (unsigned i = 0; i < n; i++)
        if (v[i].pid == (unsigned)pid) {
            CHECK(u < 0);
            u = (int)v[i].smUtil;
        }
    return u;
}

static uint64_t busy_of(struct fc_dev *fd, pid_t pid)
{
    uint64_t b = UINT64_MAX;
    fc_dev_lock(fd);
    for (int i = 0; i < FC_MAX_PROCS; i++)
        if (fd->procs[i].state == FC_PROC_ALIVE && fd->procs[i].pid == pid)
            b = fd->procs[i].busy_ns;
    fc_dev_unlock(fd);
    CHECK(b != UINT64_MAX);
    return b;
}

/* nvmlDeviceGetProcessUtilization as a watcher calls it: every 250 ms with
 * the previous answer's timeStamp.  Process a runs kernels of a_us flat
 * out, process b (if b_us > 0) a kernel of b_us every b_period_us, both for
 * ms milliseconds, then idle (alive).  Prints each window and, over the
 * whole run, NVML's value beside the truth (busy_ns / window). */
static int t_nvml_util(uint64_t a_us, uint64_t b_us, uint64_t b_period_us, uint64_t ms)
{
    CHECK(a_us > 0 && ms > 0 && ms <= 10000 && (b_us == 0 || b_period_us > b_us));
    nvmlDevice_t d = nvml_dev0();
    nvmlProcessUtilizationSample_t v[MAXP];
    struct ukid up = {0, 0, 0}, ua = {a_us, 0, ms}, ub = {b_us, b_period_us, ms};
    struct kid prim = kid_start(kid_util, &up);
    struct kid a = kid_start(kid_util, &ua), b = {0, -1, -1};
    if (b_us)
        b = kid_start(kid_util, &ub);
    struct fc_dev *fd = fc_dev_open(0, 0);
    CHECK(fd != NULL);

    /* The first answer: only the primer ran (since it started).  The
     * newest sample (another caller's, in this state dir) may be up to
     * 20 ms old, from before the primer ran: answers come from it until
     * then. */
    struct timespec pause_ = {0, 30000000L};
    nanosleep(&pause_, NULL);
    unsigned n = util_query(d, 0, v);
    CHECK(n == 1 && v[0].pid == (unsigned)prim.pid);
    unsigned long long t0 = v[0].timeStamp, now = real_us();
    CHECK(t0 <= now && t0 + 1000000 > now);
    CHECK(util_query(d, t0, v) == 0); /* nothing newer */
    printf("first.primer=%u\n", v[0].smUtil);

    CHECK(write(a.cmd, "g", 1) == 1);
    if (b_us)
        CHECK(write(b.cmd, "g", 1) == 1);
    uint64_t go = now_ns(), tick = go;
    unsigned long long last = t0;
    int done = 0;
    double sum_a = 0, sum_b = 0;
    printf("windows=");
    for (int w = 0; w < 64; w++) {
        tick += 250000000ULL;
        struct timespec ts = {(time_t)(tick / 1000000000ULL), (long)(tick % 1000000000ULL)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
            ;
        if (!done && tick >= go + ms * 1000000ULL) {
            /* the children's work is over: the next window's sample
             * comes after it (they are idle and alive then) */
            char ack;
            CHECK(read(a.ack, &ack, 1) == 1);
            if (b_us)
                CHECK(read(b.ack, &ack, 1) == 1);
            done = 1;
            continue;
        }
        n = util_query(d, last, v);
        if (n == 0) {
            CHECK(done); /* a runs flat out until done */
            break;
        }
        CHECK(v[0].timeStamp > last);
        CHECK(util_of(v, n, prim.pid) == -1); /* it did not run */
        int ua_ = util_of(v, n, a.pid), ub_ = b_us ? util_of(v, n, b.pid) : 0;
        double len = (double)(v[0].timeStamp - last);
        sum_a += ua_ > 0 ? ua_ * len : 0;
        sum_b += ub_ > 0 ? ub_ * len : 0;
        printf("%s%.0f:%d:%d%s", w ? "," : "", len, ua_, ub_, done ? ":end" : "");
        last = v[0].timeStamp;
        if (done)
            break;
    }
    printf("\n");
    CHECK(done);
    /* The whole run in one answer, from t0: the same (newest) sample,
     * or on a loaded box a later one (the children are idle since). */
    n = util_query(d, t0, v);
    CHECK(n >= 1 && v[0].timeStamp >= last);
    double whole = (double)(v[0].timeStamp - t0); /* us */
    uint64_t busy_a = busy_of(fd, a.pid), busy_b = b_us ? busy_of(fd, b.pid) : 0;
    /* truth: busy_ns over the window; sum: the windows' values weighted
     * by their lengths (they tile (t0, last], where all the work was) */
    printf("whole_us=%.0f\nwhole.a=%d\ntruth.a=%.2f\nsum.a=%.2f\n", whole, util_of(v, n, a.pid),
           (double)busy_a / whole / 10.0, sum_a / whole);
    if (b_us)
        printf("whole.b=%d\ntruth.b=%.2f\nsum.b=%.2f\n", util_of(v, n, b.pid), (double)busy_b / whole / 10.0,
               sum_b / whole);
    /* idle: nobody ran since */
    struct timespec idle = {0, 100000000L};
    nanosleep(&idle, NULL);
    CHECK(util_query(d, last, v) == 0);
    kid_end(&prim);
    kid_end(&a);
    if (b_us)
        kid_end(&b);
    fc_dev_close(fd);
    NV(nvmlShutdown(), NVML_SUCCESS);
    printf("nvml_util=ok\n");
    return 0;
}

/* What this process's NVML reports: the running processes and one
 * utilisation answer since lastSeenTimeStamp 0 (for the pid namespace
 * tests). */
static int t_nvml_list(void)
{
    nvmlDevice_t d = nvml_dev0();
    nvmlProcessInfo_t v[MAXP];
    unsigned n = list_v3(d, v);
    printf("procs=%u\n", n);
    for (unsigned i = 0; i < n; i++)
        printf("proc pid=%u mem=%llu\n", v[i].pid, v[i].usedGpuMemory);
    nvmlProcessUtilizationSample_t u[MAXP];
    n = util_query(d, 0, u);
    printf("samples=%u\n", n);
    for (unsigned i = 0; i < n; i++)
        printf("util pid=%u sm=%u\n", u[i].pid, u[i].smUtil);
    NV(nvmlShutdown(), NVML_SUCCESS);
    printf("nvml_list=ok\n");
    return 0;
}

/* One kernel of us on a new stream, then (hold != 0) sleep until killed, or
 * exit when it is done. */
static void owner_child(uint64_t us, int readyfd, int hold)
{
    setup();
    CUstream s;
    OK(cuStreamCreate(&s, 0));
    uint64_t ns = us * 1000ULL;
    void *p[] = {&ns};
    OK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, s, p, NULL));
    char c = 'r';
    CHECK(write(readyfd, &c, 1) == 1);
    if (hold)
        for (;;)
            pause();
    OK(cuStreamSynchronize(s));
    _exit(0);
}

/* The device table entry of process pid (-1: none yet). */
static int entry_of(struct fc_dev *d, pid_t pid)
{
    int e = -1;
    fc_dev_lock(d);
    for (int i = 0; i < FC_MAX_PROCS; i++)
        if (d->procs[i].state == FC_PROC_ALIVE && d->procs[i].pid == pid)
            e = i;
    fc_dev_unlock(d);
    return e;
}

/* Polls (1 ms apart, 10 s at most) until cond(d, arg) holds under d->mu. */
static void await_dev(struct fc_dev *d, int (*cond)(struct fc_dev *, int), int arg, const char *what)
{
    for (int i = 0; i < 10000; i++) {
        fc_dev_lock(d);
        int ok = cond(d, arg);
        fc_dev_unlock(d);
        if (ok)
            return;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    printf("FAIL %s: not within 10 s\n", what);
    exit(1);
}

static int owned_by(struct fc_dev *d, int e) { return d->owner_proc == e && d->owner_ticket != 0; }
static int someone_waits(struct fc_dev *d, int e) { (void)e; return d->nwait > 0; }

/* A process killed (SIGKILL) inside a 5 s kernel while another waits for
 * the device: how long after its death (waitpid) the other got the device,
 * from the device's ownership trace:
 *   handover_us=N */
static int t_killed_owner(void)
{
    struct fc_dev *d = fc_dev_open(0, 1);
    if (!d) {
        printf("FAIL device state: %s\n", strerror(errno));
        return 1;
    }
    fflush(stdout);
    int ready[2];
    CHECK(pipe(ready) == 0);
    pid_t a = fork();
    CHECK(a >= 0);
    if (a == 0)
        owner_child(5000000, ready[1], 1);
    char c;
    CHECK(read(ready[0], &c, 1) == 1);
    int ea = entry_of(d, a);
    CHECK(ea >= 0);
    await_dev(d, owned_by, ea, "the 5 s kernel holds the device");
    pid_t b = fork();
    CHECK(b >= 0);
    if (b == 0)
        owner_child(1000, ready[1], 0);
    CHECK(read(ready[0], &c, 1) == 1);
    await_dev(d, someone_waits, 0, "the second process waits for the device");
    int eb = entry_of(d, b);
    CHECK(eb >= 0);
    fc_dev_lock(d);
    uint64_t n0 = d->ntrace;
    fc_dev_unlock(d);
    CHECK(kill(a, SIGKILL) == 0);
    int st = 0;
    CHECK(waitpid(a, &st, 0) == a);
    uint64_t dead = now_ns();
    CHECK(waitpid(b, &st, 0) == b && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    uint64_t handed = 0;
    fc_dev_lock(d);
    for (uint64_t i = n0; i < d->ntrace && !handed; i++)
        if (d->trace[i % FC_TRACE].proc == eb)
            handed = d->trace[i % FC_TRACE].t_ns;
    fc_dev_unlock(d);
    CHECK(handed != 0);
    printf("handover_us=%llu\n", (unsigned long long)(handed > dead ? (handed - dead) / 1000 : 0));
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 5 && !strcmp(argv[1], "share"))
        return t_share(atoi(argv[2]), strtoull(argv[3], NULL, 10), atoi(argv[4]));
    if (argc == 6 && !strcmp(argv[1], "nvml-util"))
        return t_nvml_util(strtoull(argv[2], NULL, 10), strtoull(argv[3], NULL, 10), strtoull(argv[4], NULL, 10),
                           strtoull(argv[5], NULL, 10));
    if (argc != 2) {
        fprintf(stderr, "usage: fctest async|procaddr|ptsz|graph|memory|slice|init|nvml-procs|nvml-list|killed-owner\n"
                        "       fctest share PROCESSES KERNEL_US KERNELS\n"
                        "       fctest nvml-util A_KERNEL_US B_KERNEL_US B_PERIOD_US MS\n");
        return 2;
    }
    int r = 2;
    if (!strcmp(argv[1], "async"))
        r = t_async();
    else if (!strcmp(argv[1], "procaddr"))
        r = t_procaddr();
    else if (!strcmp(argv[1], "ptsz"))
        r = t_ptsz();
    else if (!strcmp(argv[1], "graph"))
        r = t_graph();
    else if (!strcmp(argv[1], "memory"))
        r = t_memory();
    else if (!strcmp(argv[1], "slice"))
        r = t_slice();
    else if (!strcmp(argv[1], "init"))
        r = t_init();
    else if (!strcmp(argv[1], "nvml-procs"))
        r = t_nvml_procs();
    else if (!strcmp(argv[1], "nvml-list"))
        r = t_nvml_list();
    else if (!strcmp(argv[1], "killed-owner"))
        r = t_killed_owner();
    return r;
}
