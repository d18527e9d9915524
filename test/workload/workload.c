/*
 * mgpu-workload - a CUDA driver API workload for mgpu's tests, demo and
 * benchmarks.  See README.md or `mgpu-workload --help`.
 *
 * Every driver call goes through the table `cu`, filled according to
 * --resolve: by symbol name (direct), through cuGetProcAddress_v2 (proc),
 * the way the CUDA runtime does it (runtime: dlopen + dlsym on the handle +
 * cuGetProcAddress_v2), or the way a tenant that bypasses a preloaded shim
 * would (dlmopen: the driver loaded into a new link-map namespace, where
 * LD_PRELOAD does not reach).
 */
#define _GNU_SOURCE
#include "mgpu_cuda.h"

#include <dlfcn.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define WL_CUDA_VERSION 12040

/* X(name, base name for cuGetProcAddress, has a _ptsz variant) */
#define WL_FUNCS(X)                                                                                  \
    X(cuInit, cuInit, 0) X(cuDriverGetVersion, cuDriverGetVersion, 0) X(cuGetErrorName, cuGetErrorName, 0) \
    X(cuDeviceGet, cuDeviceGet, 0) X(cuDeviceGetCount, cuDeviceGetCount, 0)                          \
    X(cuDeviceGetName, cuDeviceGetName, 0) X(cuDeviceGetUuid_v2, cuDeviceGetUuid, 0)                 \
    X(cuDeviceTotalMem_v2, cuDeviceTotalMem, 0) X(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, 0) \
    X(cuDevicePrimaryCtxRelease_v2, cuDevicePrimaryCtxRelease, 0) X(cuCtxSetCurrent, cuCtxSetCurrent, 0) \
    X(cuCtxSynchronize, cuCtxSynchronize, 0) X(cuModuleLoadData, cuModuleLoadData, 0)                \
    X(cuModuleGetFunction, cuModuleGetFunction, 0) X(cuStreamCreate, cuStreamCreate, 0)              \
    X(cuStreamDestroy_v2, cuStreamDestroy, 0) X(cuStreamSynchronize, cuStreamSynchronize, 1)         \
    X(cuStreamBeginCapture_v2, cuStreamBeginCapture, 1) X(cuStreamEndCapture, cuStreamEndCapture, 1) \
    X(cuEventCreate, cuEventCreate, 0) X(cuEventDestroy_v2, cuEventDestroy, 0)                       \
    X(cuEventRecord, cuEventRecord, 1) X(cuEventSynchronize, cuEventSynchronize, 0)                  \
    X(cuEventElapsedTime, cuEventElapsedTime, 0) X(cuLaunchKernel, cuLaunchKernel, 1)                \
    X(cuLaunchKernelEx, cuLaunchKernelEx, 1) X(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel, 1) \
    X(cuGraphCreate, cuGraphCreate, 0) X(cuGraphDestroy, cuGraphDestroy, 0)                          \
    X(cuGraphAddKernelNode, cuGraphAddKernelNode, 0)                                                 \
    X(cuGraphInstantiateWithFlags, cuGraphInstantiateWithFlags, 0)                                   \
    X(cuGraphExecDestroy, cuGraphExecDestroy, 0) X(cuGraphLaunch, cuGraphLaunch, 1)                  \
    X(cuMemGetInfo_v2, cuMemGetInfo, 0) X(cuMemAlloc_v2, cuMemAlloc, 0)                              \
    X(cuMemAllocPitch_v2, cuMemAllocPitch, 0) X(cuMemAllocManaged, cuMemAllocManaged, 0)             \
    X(cuMemFree_v2, cuMemFree, 0) X(cuMemAllocAsync, cuMemAllocAsync, 1)                             \
    X(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync, 1) X(cuMemFreeAsync, cuMemFreeAsync, 1)      \
    X(cuDeviceGetDefaultMemPool, cuDeviceGetDefaultMemPool, 0) X(cuMemCreate, cuMemCreate, 0)        \
    X(cuMemRelease, cuMemRelease, 0) X(cuArrayCreate_v2, cuArrayCreate, 0)                           \
    X(cuArray3DCreate_v2, cuArray3DCreate, 0) X(cuArrayDestroy, cuArrayDestroy, 0)

static struct {
#define X(name, base, ptsz) __typeof__(&name) name;
    WL_FUNCS(X)
#undef X
} cu;

/* ---- options ---- */
static struct {
    const char *resolve;
    int ptsz;
    int device;
    const char *api;
    double mib;
    long count;
    long hold_ms;
    int do_free;
    long iterations;
    long kernel_us;
    long depth;
    double seconds;
    long streams;
    long threads;
    long report_ms;
    long idle_ms;
    long burst;
    double period_ms;
    long sync_every;
    long host_us;
    int null_stream;
    int raw;
    long graph_nodes;
    const char *graph_build;
    long n;
    long batches;
    long long bytes;
} opt = {
    .resolve = "direct", .count = 1, .depth = 2, .seconds = 1, .streams = 1, .threads = 1,
    .kernel_us = 1000, .iterations = 1000, .graph_nodes = 4, .graph_build = "capture", .n = 100000,
    .bytes = 1 << 20,
};

static void usage(FILE *f)
{
    fprintf(f,
            "usage: mgpu-workload [--resolve direct|proc|runtime|dlmopen] [--ptsz] [--device D] COMMAND [options]\n"
            "commands:\n"
            "  info                                    devices, memory (CUDA and NVML), key=value lines\n"
            "  alloc --api NAME --mib N [--count K] [--hold-ms T] [--free]\n"
            "        NAME: cuMemAlloc_v2 cuMemAllocPitch_v2 cuMemAllocManaged cuMemAllocAsync\n"
            "              cuMemAllocFromPoolAsync cuMemCreate cuArrayCreate_v2 cuArray3DCreate_v2\n"
            "        T=-1 holds until killed; exit 2 when an allocation ran out of memory\n"
            "  alloc-churn --api NAME --mib N --iterations I [--threads T]\n"
            "  compute --api launch|launchex|coop|graph --kernel-us U --depth D --seconds S\n"
            "          [--streams N] [--threads T] [--null-stream] [--report-ms M] [--idle-ms I]\n"
            "          [--graph-nodes G] [--graph-build capture|nodes] [--sync-every K] [--host-us H]\n"
            "  serve --kernel-us U --burst K --period-ms T --seconds S [--depth D] [--raw]\n"
            "        requests arrive every T ms; each launches K kernels (at most D in flight)\n"
            "        and waits for them; prints latency percentiles from arrival to completion\n"
            "        (--raw: then every request's latency, lat_us=N, in arrival order)\n"
            "  bench-launch [--n N] [--batches B]      ns_per_launch of 0-duration kernels\n"
            "  bench-alloc [--n N] [--batches B] [--bytes B] [--api NAME]   ns_per_alloc of alloc+free pairs\n"
            "  fork [--kernel-us U]                    CUDA in the parent, then in a forked child\n"
            "A kernel's duration is its first parameter (uint64 ns), as fakecuda expects.\n");
}

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "mgpu-workload: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(1);
}

static const char *errname(CUresult r)
{
    static __thread char buf[32];
    const char *s = NULL;
    if (cu.cuGetErrorName && cu.cuGetErrorName(r, &s) == CUDA_SUCCESS && s)
        return s;
    snprintf(buf, sizeof(buf), "CUDA_ERROR_%d", (int)r);
    return buf;
}

#define CK(call)                                                                                      \
    do {                                                                                              \
        CUresult r_ = (call);                                                                         \
        if (r_ != CUDA_SUCCESS)                                                                       \
            die("%s -> %s (%d)", #call, errname(r_), (int)r_);                                        \
    } while (0)

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* ---- entry point resolution ---- */
typedef CUresult (*getproc_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef CUresult (*getproc1_fn)(const char *, void **, int, cuuint64_t);

static void resolve_direct(void)
{
#define X(name, base, ptsz) cu.name = name;
    WL_FUNCS(X)
#undef X
    if (opt.ptsz) {
        cu.cuStreamSynchronize = cuStreamSynchronize_ptsz;
        cu.cuStreamBeginCapture_v2 = cuStreamBeginCapture_v2_ptsz;
        cu.cuStreamEndCapture = cuStreamEndCapture_ptsz;
        cu.cuEventRecord = cuEventRecord_ptsz;
        cu.cuLaunchKernel = cuLaunchKernel_ptsz;
        cu.cuLaunchKernelEx = cuLaunchKernelEx_ptsz;
        cu.cuLaunchCooperativeKernel = cuLaunchCooperativeKernel_ptsz;
        cu.cuGraphLaunch = cuGraphLaunch_ptsz;
        cu.cuMemAllocAsync = cuMemAllocAsync_ptsz;
        cu.cuMemAllocFromPoolAsync = cuMemAllocFromPoolAsync_ptsz;
        cu.cuMemFreeAsync = cuMemFreeAsync_ptsz;
    }
}

static void resolve_with(getproc_fn gp2, getproc1_fn gp1)
{
    cuuint64_t flags = opt.ptsz ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_DEFAULT;
    void *p;
    CUdriverProcAddressQueryResult st;
    CUresult r;
#define X(name, base, ptsz)                                                                               \
    p = NULL;                                                                                             \
    st = CU_GET_PROC_ADDRESS_SUCCESS;                                                                     \
    r = gp2 ? gp2(#base, &p, WL_CUDA_VERSION, flags, &st) : gp1(#base, &p, WL_CUDA_VERSION, flags);        \
    if (r != CUDA_SUCCESS || !p || st != CU_GET_PROC_ADDRESS_SUCCESS)                                     \
        die("cuGetProcAddress(%s) -> %d status %d", #base, (int)r, (int)st);                              \
    memcpy(&cu.name, &p, sizeof(p));
    WL_FUNCS(X)
#undef X
}

static void resolve(void)
{
    if (strcmp(opt.resolve, "direct") == 0) {
        resolve_direct();
    } else if (strcmp(opt.resolve, "proc") == 0) {
        resolve_with(cuGetProcAddress_v2, NULL);
    } else if (strcmp(opt.resolve, "runtime") == 0 || strcmp(opt.resolve, "dlmopen") == 0) {
        /* Exactly what libcudart does; dlmopen: the same in a namespace of
         * its own, which no preloaded library is part of. */
        void *h = strcmp(opt.resolve, "runtime") == 0 ? dlopen("libcuda.so.1", RTLD_NOW)
                                                      : dlmopen(LM_ID_NEWLM, "libcuda.so.1", RTLD_NOW);
        if (!h)
            die("%s libcuda.so.1: %s", opt.resolve, dlerror());
        void *p2 = dlsym(h, "cuGetProcAddress_v2");
        void *p1 = p2 ? NULL : dlsym(h, "cuGetProcAddress");
        if (!p2 && !p1)
            die("libcuda.so.1 has no cuGetProcAddress");
        getproc_fn gp2 = NULL;
        getproc1_fn gp1 = NULL;
        memcpy(&gp2, &p2, sizeof(p2));
        memcpy(&gp1, &p1, sizeof(p1));
        resolve_with(gp2, gp1);
    } else {
        die("unknown --resolve %s", opt.resolve);
    }
}

/* ---- common setup ---- */
static CUcontext ctx;
static CUfunction kernel;

/* setup: the primary context of --device, current on this thread. */
static void setup(void)
{
    CK(cu.cuInit(0));
    CUdevice dev;
    CK(cu.cuDeviceGet(&dev, opt.device));
    CK(cu.cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cu.cuCtxSetCurrent(ctx));
}

/* load_kernel: fakecuda's spin kernel from a dummy module (a real driver
 * refuses the image: only the commands that launch need it, so memory and
 * info commands also run against a real GPU). */
static void load_kernel(void)
{
    CUmodule mod;
    static const char image[] = "mgpu-workload kernel image";
    CK(cu.cuModuleLoadData(&mod, image));
    CK(cu.cuModuleGetFunction(&kernel, mod, "mgpu_spin"));
}

static void print_meminfo(void)
{
    size_t fr = 0, tot = 0;
    CK(cu.cuMemGetInfo_v2(&fr, &tot));
    printf("mem_free=%zu mem_total=%zu\n", fr, tot);
}

/* ---- info ---- */
typedef int (*nvml_fn0)(void);
typedef int (*nvml_cnt)(unsigned *);
typedef int (*nvml_h)(unsigned, nvmlDevice_t *);
typedef int (*nvml_idx)(nvmlDevice_t, unsigned *);
typedef int (*nvml_mem)(nvmlDevice_t, nvmlMemory_t *);
typedef int (*nvml_mem2)(nvmlDevice_t, nvmlMemory_v2_t *);

#define SYM(h, type, name)                                 \
    type p_##name;                                        \
    {                                                     \
        void *p_ = dlsym(h, #name);                       \
        if (!p_)                                          \
            die("nvml: no %s", #name);                    \
        memcpy(&p_##name, &p_, sizeof(p_));               \
    }

static void info_nvml(void)
{
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!h) {
        printf("nvml=unavailable\n");
        return;
    }
    SYM(h, nvml_fn0, nvmlInit_v2)
    SYM(h, nvml_cnt, nvmlDeviceGetCount_v2)
    SYM(h, nvml_h, nvmlDeviceGetHandleByIndex_v2)
    SYM(h, nvml_idx, nvmlDeviceGetIndex)
    SYM(h, nvml_mem, nvmlDeviceGetMemoryInfo)
    SYM(h, nvml_mem2, nvmlDeviceGetMemoryInfo_v2)
    SYM(h, nvml_fn0, nvmlShutdown)
    int r = p_nvmlInit_v2();
    if (r)
        die("nvmlInit_v2 -> %d", r);
    unsigned n = 0;
    if ((r = p_nvmlDeviceGetCount_v2(&n)))
        die("nvmlDeviceGetCount_v2 -> %d", r);
    printf("nvml.device_count=%u\n", n);
    for (unsigned i = 0; i < n; i++) {
        nvmlDevice_t d;
        unsigned idx = 0;
        nvmlMemory_t m;
        nvmlMemory_v2_t m2 = {.version = nvmlMemory_v2};
        if ((r = p_nvmlDeviceGetHandleByIndex_v2(i, &d)) || (r = p_nvmlDeviceGetIndex(d, &idx)) ||
            (r = p_nvmlDeviceGetMemoryInfo(d, &m)) || (r = p_nvmlDeviceGetMemoryInfo_v2(d, &m2)))
            die("nvml device %u -> %d", i, r);
        printf("nvml.%u.index=%u\n", i, idx);
        printf("nvml.%u.total=%llu\nnvml.%u.free=%llu\nnvml.%u.used=%llu\n", i, m.total, i, m.free, i, m.used);
        printf("nvml.%u.v2.total=%llu\nnvml.%u.v2.free=%llu\nnvml.%u.v2.used=%llu\n", i, m2.total, i, m2.free, i,
               m2.used);
    }
    p_nvmlShutdown();
}

static int cmd_info(void)
{
    CK(cu.cuInit(0));
    int v = 0, n = 0;
    CK(cu.cuDriverGetVersion(&v));
    CK(cu.cuDeviceGetCount(&n));
    printf("driver_version=%d\ndevice_count=%d\n", v, n);
    for (int i = 0; i < n; i++) {
        CUdevice dev;
        char name[256];
        CUuuid u;
        size_t total = 0, fr = 0, tot = 0;
        CUcontext c;
        CK(cu.cuDeviceGet(&dev, i));
        CK(cu.cuDeviceGetName(name, (int)sizeof(name), dev));
        CK(cu.cuDeviceGetUuid_v2(&u, dev));
        CK(cu.cuDeviceTotalMem_v2(&total, dev));
        CK(cu.cuDevicePrimaryCtxRetain(&c, dev));
        CK(cu.cuCtxSetCurrent(c));
        CK(cu.cuMemGetInfo_v2(&fr, &tot));
        const unsigned char *b = (const unsigned char *)u.bytes;
        printf("device.%d.name=%s\n", i, name);
        printf("device.%d.uuid=GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n", i, b[0],
               b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
        printf("device.%d.total_mem=%zu\ndevice.%d.mem_free=%zu\ndevice.%d.mem_total=%zu\n", i, total, i, fr, i, tot);
    }
    info_nvml();
    return 0;
}

/* ---- alloc ---- */
struct alloc_h {
    CUdeviceptr p;
    CUarray a;
    CUmemGenericAllocationHandle vmm;
};

static CUstream alloc_stream;

static CUresult do_alloc(const char *api, uint64_t bytes, struct alloc_h *h)
{
    memset(h, 0, sizeof(*h));
    if (strcmp(api, "cuMemAlloc_v2") == 0)
        return cu.cuMemAlloc_v2(&h->p, bytes);
    if (strcmp(api, "cuMemAllocPitch_v2") == 0) {
        size_t pitch;
        size_t rows = bytes >> 20 ? bytes >> 20 : 1;
        return cu.cuMemAllocPitch_v2(&h->p, &pitch, bytes >> 20 ? 1 << 20 : bytes, rows, 4);
    }
    if (strcmp(api, "cuMemAllocManaged") == 0)
        return cu.cuMemAllocManaged(&h->p, bytes, CU_MEM_ATTACH_GLOBAL);
    if (strcmp(api, "cuMemAllocAsync") == 0)
        return cu.cuMemAllocAsync(&h->p, bytes, alloc_stream);
    if (strcmp(api, "cuMemAllocFromPoolAsync") == 0) {
        CUmemoryPool pool;
        CUresult r = cu.cuDeviceGetDefaultMemPool(&pool, opt.device);
        return r ? r : cu.cuMemAllocFromPoolAsync(&h->p, bytes, pool, alloc_stream);
    }
    if (strcmp(api, "cuMemCreate") == 0) {
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof(prop));
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = opt.device;
        return cu.cuMemCreate(&h->vmm, bytes, &prop, 0);
    }
    if (strcmp(api, "cuArrayCreate_v2") == 0) {
        /* FLOAT x4 = 16 bytes per element, 16384 wide: 256 KiB per row. */
        CUDA_ARRAY_DESCRIPTOR d = {.Width = 16384, .Height = bytes / (256 << 10), .Format = CU_AD_FORMAT_FLOAT,
                                   .NumChannels = 4};
        if (!d.Height)
            d.Height = 1;
        return cu.cuArrayCreate_v2(&h->a, &d);
    }
    if (strcmp(api, "cuArray3DCreate_v2") == 0) {
        /* 256 x 256 x 16 bytes = 1 MiB per slice. */
        CUDA_ARRAY3D_DESCRIPTOR d = {.Width = 256, .Height = 256, .Depth = bytes >> 20, .Format = CU_AD_FORMAT_FLOAT,
                                     .NumChannels = 4};
        if (!d.Depth)
            d.Depth = 1;
        return cu.cuArray3DCreate_v2(&h->a, &d);
    }
    die("unknown --api %s", api);
    return CUDA_ERROR_INVALID_VALUE;
}

static const char *free_name(const char *api)
{
    if (strcmp(api, "cuMemAllocAsync") == 0 || strcmp(api, "cuMemAllocFromPoolAsync") == 0)
        return "cuMemFreeAsync";
    if (strcmp(api, "cuMemCreate") == 0)
        return "cuMemRelease";
    if (strncmp(api, "cuArray", 7) == 0)
        return "cuArrayDestroy";
    return "cuMemFree_v2";
}

static CUresult do_free(const char *api, struct alloc_h *h)
{
    const char *f = free_name(api);
    if (strcmp(f, "cuMemFreeAsync") == 0) {
        CUresult r = cu.cuMemFreeAsync(h->p, alloc_stream);
        return r ? r : cu.cuStreamSynchronize(alloc_stream);
    }
    if (strcmp(f, "cuMemRelease") == 0)
        return cu.cuMemRelease(h->vmm);
    if (strcmp(f, "cuArrayDestroy") == 0)
        return cu.cuArrayDestroy(h->a);
    return cu.cuMemFree_v2(h->p);
}

static uint64_t mib_bytes(void)
{
    if (opt.mib <= 0)
        die("--mib must be > 0");
    return (uint64_t)(opt.mib * 1048576.0);
}

static int cmd_alloc(void)
{
    if (!opt.api)
        die("alloc needs --api");
    uint64_t bytes = mib_bytes();
    setup();
    CK(cu.cuStreamCreate(&alloc_stream, CU_STREAM_NON_BLOCKING));
    struct alloc_h *hs = calloc((size_t)opt.count, sizeof(*hs));
    CUresult *rs = calloc((size_t)opt.count, sizeof(*rs));
    if (!hs || !rs)
        die("out of host memory");
    int oom = 0, bad = 0, ok = 0;
    for (long i = 0; i < opt.count; i++) {
        rs[i] = do_alloc(opt.api, bytes, &hs[i]);
        printf("alloc %ld %s %gMiB -> %s (%d)\n", i, opt.api, opt.mib, errname(rs[i]), (int)rs[i]);
        fflush(stdout); /* a process killed for what it holds has said what it got */
        if (rs[i] == CUDA_SUCCESS)
            ok++;
        else if (rs[i] == CUDA_ERROR_OUT_OF_MEMORY)
            oom++;
        else
            bad++;
    }
    printf("allocated=%d failed=%d\n", ok, oom + bad);
    print_meminfo();
    fflush(stdout);
    if (opt.hold_ms) {
        printf("holding ms=%ld\n", opt.hold_ms);
        fflush(stdout);
        if (opt.hold_ms < 0) {
            for (;;)
                pause();
        }
        struct timespec ts = {opt.hold_ms / 1000, (opt.hold_ms % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) && errno == EINTR)
            ;
    }
    if (opt.do_free) {
        for (long i = 0; i < opt.count; i++) {
            if (rs[i] != CUDA_SUCCESS)
                continue;
            CUresult r = do_free(opt.api, &hs[i]);
            printf("free %ld %s -> %s (%d)\n", i, free_name(opt.api), errname(r), (int)r);
            if (r)
                bad++;
        }
        print_meminfo();
    }
    free(hs);
    free(rs);
    return bad ? 1 : oom ? 2 : 0;
}

/* ---- alloc-churn ---- */
static atomic_long churn_ok, churn_oom, churn_err;

static void *churn_thread(void *arg)
{
    (void)arg;
    CK(cu.cuCtxSetCurrent(ctx));
    uint64_t bytes = mib_bytes();
    for (long i = 0; i < opt.iterations; i++) {
        struct alloc_h h;
        CUresult r = do_alloc(opt.api, bytes, &h);
        if (r == CUDA_SUCCESS) {
            atomic_fetch_add(&churn_ok, 1);
            if (do_free(opt.api, &h) != CUDA_SUCCESS)
                atomic_fetch_add(&churn_err, 1);
        } else if (r == CUDA_ERROR_OUT_OF_MEMORY) {
            atomic_fetch_add(&churn_oom, 1);
        } else {
            atomic_fetch_add(&churn_err, 1);
            fprintf(stderr, "alloc-churn: %s -> %s (%d)\n", opt.api, errname(r), (int)r);
        }
    }
    return NULL;
}

static int cmd_churn(void)
{
    if (!opt.api)
        opt.api = "cuMemAlloc_v2";
    setup();
    CK(cu.cuStreamCreate(&alloc_stream, CU_STREAM_NON_BLOCKING));
    pthread_t t[64];
    long nt = opt.threads < 1 ? 1 : opt.threads > 64 ? 64 : opt.threads;
    uint64_t t0 = now_ns();
    for (long i = 0; i < nt; i++)
        if (pthread_create(&t[i], NULL, churn_thread, NULL))
            die("pthread_create failed");
    for (long i = 0; i < nt; i++)
        pthread_join(t[i], NULL);
    printf("churn api=%s iterations=%ld threads=%ld ok=%ld oom=%ld errors=%ld wall_ns=%" PRIu64 "\n", opt.api,
           opt.iterations, nt, atomic_load(&churn_ok), atomic_load(&churn_oom), atomic_load(&churn_err),
           now_ns() - t0);
    print_meminfo();
    return atomic_load(&churn_err) ? 1 : 0;
}

/* ---- compute ---- */
enum { API_LAUNCH, API_LAUNCHEX, API_COOP, API_GRAPH };
static int api_kind;
static CUstream *streams;
static CUgraphExec graph_exec;
static uint64_t kernel_ns;
static atomic_ulong launches;
static atomic_int threads_done;

static CUresult launch_one(CUstream s)
{
    uint64_t ns = kernel_ns;
    void *params[] = {&ns};
    switch (api_kind) {
    case API_LAUNCH: return cu.cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, s, params, NULL);
    case API_LAUNCHEX: {
        CUlaunchAttribute attr;
        memset(&attr, 0, sizeof(attr));
        attr.id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
        attr.value.cooperative = 0;
        CUlaunchConfig cfg = {.gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 32, .blockDimY = 1,
                              .blockDimZ = 1, .hStream = s, .attrs = &attr, .numAttrs = 1};
        return cu.cuLaunchKernelEx(&cfg, kernel, params, NULL);
    }
    case API_COOP: return cu.cuLaunchCooperativeKernel(kernel, 1, 1, 1, 32, 1, 1, 0, s, params);
    default: return cu.cuGraphLaunch(graph_exec, s);
    }
}

static void build_graph(CUstream s)
{
    CUgraph gr;
    uint64_t ns = kernel_ns;
    void *params[] = {&ns};
    if (strcmp(opt.graph_build, "capture") == 0) {
        CK(cu.cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
        for (long i = 0; i < opt.graph_nodes; i++)
            CK(cu.cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, s, params, NULL));
        CK(cu.cuStreamEndCapture(s, &gr));
    } else if (strcmp(opt.graph_build, "nodes") == 0) {
        CK(cu.cuGraphCreate(&gr, 0));
        CUgraphNode prev = NULL;
        for (long i = 0; i < opt.graph_nodes; i++) {
            CUDA_KERNEL_NODE_PARAMS p = {.func = kernel, .gridDimX = 1, .gridDimY = 1, .gridDimZ = 1,
                                         .blockDimX = 32, .blockDimY = 1, .blockDimZ = 1, .kernelParams = params};
            CUgraphNode n;
            CK(cu.cuGraphAddKernelNode(&n, gr, prev ? &prev : NULL, prev ? 1 : 0, &p));
            prev = n;
        }
    } else {
        die("unknown --graph-build %s", opt.graph_build);
    }
    CK(cu.cuGraphInstantiateWithFlags(&graph_exec, gr, 0));
    CK(cu.cuGraphDestroy(gr));
}

/* spin_ns: busy host time, not a sleep (a framework dispatching work). */
static void spin_ns(uint64_t ns)
{
    uint64_t until = now_ns() + ns;
    while (now_ns() < until)
        ;
}

static void *compute_thread(void *arg)
{
    long t = (long)(intptr_t)arg;
    CK(cu.cuCtxSetCurrent(ctx));
    long mine[256];
    int nm = 0;
    if (opt.threads <= opt.streams) {
        for (long s = t; s < opt.streams && nm < 256; s += opt.threads)
            mine[nm++] = s;
    } else {
        mine[nm++] = t % opt.streams;
    }
    CUevent *ev = calloc((size_t)(nm * opt.depth), sizeof(CUevent));
    uint64_t *cnt = calloc((size_t)nm, sizeof(uint64_t));
    if (!ev || !cnt)
        die("out of host memory");
    for (long i = 0; i < nm * opt.depth; i++)
        CK(cu.cuEventCreate(&ev[i], CU_EVENT_DISABLE_TIMING));
    uint64_t deadline = now_ns() + (uint64_t)(opt.seconds * 1e9);
    unsigned long per = api_kind == API_GRAPH ? (unsigned long)opt.graph_nodes : 1;
    while (now_ns() < deadline) {
        for (int j = 0; j < nm; j++) {
            CUstream s = streams[mine[j]];
            CUevent e = ev[j * opt.depth + (long)(cnt[j] % (uint64_t)opt.depth)];
            if (cnt[j] >= (uint64_t)opt.depth)
                CK(cu.cuEventSynchronize(e)); /* at most depth launches in flight */
            if (opt.host_us > 0)
                spin_ns((uint64_t)opt.host_us * 1000); /* the framework's host work per launch */
            CUresult r = launch_one(s);
            if (r != CUDA_SUCCESS)
                die("launch -> %s (%d)", errname(r), (int)r);
            CK(cu.cuEventRecord(e, s));
            cnt[j]++;
            atomic_fetch_add(&launches, per);
            if (opt.sync_every > 0 && cnt[j] % (uint64_t)opt.sync_every == 0)
                CK(cu.cuStreamSynchronize(s)); /* a step's result read back, as loss.item() does */
        }
    }
    for (int j = 0; j < nm; j++)
        CK(cu.cuStreamSynchronize(streams[mine[j]]));
    for (long i = 0; i < nm * opt.depth; i++)
        CK(cu.cuEventDestroy_v2(ev[i]));
    free(ev);
    free(cnt);
    atomic_fetch_add(&threads_done, 1);
    return NULL;
}

static int cmd_compute(void)
{
    const char *api = opt.api ? opt.api : "launch";
    if (strcmp(api, "launch") == 0)
        api_kind = API_LAUNCH;
    else if (strcmp(api, "launchex") == 0)
        api_kind = API_LAUNCHEX;
    else if (strcmp(api, "coop") == 0)
        api_kind = API_COOP;
    else if (strcmp(api, "graph") == 0)
        api_kind = API_GRAPH;
    else
        die("unknown compute --api %s", api);
    if (opt.depth < 1 || opt.streams < 1 || opt.threads < 1 || opt.threads > 256 || opt.kernel_us < 0 ||
        opt.graph_nodes < 1 || opt.sync_every < 0 || opt.host_us < 0)
        die("bad compute options");
    kernel_ns = (uint64_t)opt.kernel_us * 1000;
    setup();
    load_kernel();
    streams = calloc((size_t)opt.streams, sizeof(CUstream));
    if (!streams)
        die("out of host memory");
    for (long i = 0; i < opt.streams; i++) {
        if (opt.null_stream)
            streams[i] = NULL; /* legacy default stream, or per-thread with --ptsz */
        else
            CK(cu.cuStreamCreate(&streams[i], CU_STREAM_NON_BLOCKING));
    }
    if (api_kind == API_GRAPH) {
        CUstream cs;
        CK(cu.cuStreamCreate(&cs, CU_STREAM_NON_BLOCKING));
        build_graph(cs);
        CK(cu.cuStreamDestroy_v2(cs));
    }
    if (opt.idle_ms > 0) { /* attached and ready, but no demand yet */
        uint64_t until = now_ns() + (uint64_t)opt.idle_ms * 1000000ULL;
        printf("idle ms=%ld until_mono_ns=%" PRIu64 "\n", opt.idle_ms, until);
        fflush(stdout);
        struct timespec ts = {(time_t)(until / 1000000000ULL), (long)(until % 1000000000ULL)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
            ;
    }
    printf("start mono_ns=%" PRIu64 "\n", now_ns()); /* the first launch follows */
    fflush(stdout);
    pthread_t th[256];
    uint64_t t0 = now_ns();
    for (long i = 0; i < opt.threads; i++)
        if (pthread_create(&th[i], NULL, compute_thread, (void *)(intptr_t)i))
            die("pthread_create failed");
    if (opt.report_ms > 0) {
        uint64_t next = t0;
        while (atomic_load(&threads_done) < opt.threads) {
            next += (uint64_t)opt.report_ms * 1000000ULL;
            struct timespec ts = {(time_t)(next / 1000000000ULL), (long)(next % 1000000000ULL)};
            while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
                ;
            printf("progress t_ms=%" PRIu64 " launches=%lu\n", (now_ns() - t0) / 1000000, atomic_load(&launches));
            fflush(stdout);
        }
    }
    for (long i = 0; i < opt.threads; i++)
        pthread_join(th[i], NULL);
    uint64_t wall = now_ns() - t0;
    printf("launches=%lu wall_ns=%" PRIu64 " api=%s kernel_us=%ld depth=%ld streams=%ld threads=%ld\n",
           atomic_load(&launches), wall, api, opt.kernel_us, opt.depth, opt.streams, opt.threads);
    return 0;
}

/* ---- serve: request/response latency ---- */

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* pct returns the p-th percentile (nearest rank) of the n sorted values. */
static uint64_t pct(const uint64_t *v, size_t n, double p)
{
    size_t k = (size_t)(p / 100.0 * (double)n + 0.999999);
    if (k < 1)
        k = 1;
    if (k > n)
        k = n;
    return v[k - 1];
}

static volatile sig_atomic_t serve_stop;

static void serve_on_signal(int sig)
{
    (void)sig;
    serve_stop = 1;
}

/* One request: --burst kernels on s, at most --depth in flight (ev holds
 * --depth events), and the wait for the last.  Returns when its first
 * launch was called (CLOCK_MONOTONIC, the simulated device's clock). */
static uint64_t serve_request(CUstream s, CUevent *ev)
{
    uint64_t start = now_ns();
    for (long k = 0; k < opt.burst; k++) {
        if (k >= opt.depth)
            CK(cu.cuEventSynchronize(ev[k % opt.depth])); /* at most depth in flight */
        CUresult r = launch_one(s);
        if (r != CUDA_SUCCESS)
            die("launch -> %s (%d)", errname(r), (int)r);
        CK(cu.cuEventRecord(ev[k % opt.depth], s));
    }
    CK(cu.cuStreamSynchronize(s));
    return start;
}

/* An inference server's shape: requests arrive on a fixed schedule (every
 * --period-ms from the start, whether or not the previous one is done);
 * each launches --burst kernels of --kernel-us on one stream, at most
 * --depth in flight, and waits for the last. A request's latency runs from
 * its scheduled arrival to its completion, so time spent waiting behind a
 * late predecessor counts, as it does for a client. One unmeasured request
 * warms the server up before the schedule starts. With --raw, each
 * request's latency (lat_us=) and when its first launch was called and
 * its wait returned (req start_ns= done_ns=, CLOCK_MONOTONIC: what the
 * device's own record of its kernels is matched against). */
static int cmd_serve(void)
{
    if (opt.kernel_us < 0 || opt.burst < 1 || opt.period_ms <= 0 || opt.seconds <= 0 || opt.depth < 1)
        die("serve needs --kernel-us >= 0, --burst >= 1, --period-ms > 0, --seconds > 0, --depth >= 1");
    api_kind = API_LAUNCH;
    kernel_ns = (uint64_t)opt.kernel_us * 1000;
    setup();
    load_kernel();
    CUstream s;
    CK(cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CUevent *ev = calloc((size_t)opt.depth, sizeof(CUevent));
    uint64_t period = (uint64_t)(opt.period_ms * 1e6);
    size_t max_req = (size_t)(opt.seconds * 1e9 / (double)period) + 1;
    uint64_t *lat = calloc(max_req, sizeof(uint64_t));
    uint64_t *req = opt.raw ? calloc(2 * max_req, sizeof(uint64_t)) : NULL; /* start, done */
    if (!ev || !lat || (opt.raw && !req))
        die("out of host memory");
    for (long i = 0; i < opt.depth; i++)
        CK(cu.cuEventCreate(&ev[i], CU_EVENT_DISABLE_TIMING));
    /* A server warms up before it takes traffic: one unmeasured request
     * (the first launches of a process are slow, and a slow first request
     * would make the next few late too). */
    serve_request(s, ev);
    /* SIGTERM or SIGINT ends the schedule: the request in progress
     * completes, and the requests served are reported. */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = serve_on_signal; /* no SA_RESTART: a sleep ends at once */
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGTERM, &sa, NULL) != 0 || sigaction(SIGINT, &sa, NULL) != 0)
        die("sigaction: %s", strerror(errno));
    /* request i arrives at mono_ns + i x period */
    uint64_t t0 = now_ns(), end = t0 + (uint64_t)(opt.seconds * 1e9);
    printf("start mono_ns=%" PRIu64 "\n", t0);
    fflush(stdout);
    size_t n = 0, late = 0;
    uint64_t busy = 0;
    for (uint64_t arrive = t0; arrive < end && n < max_req && !serve_stop; arrive += period) {
        uint64_t now = now_ns();
        if (now < arrive) {
            struct timespec ts = {(time_t)(arrive / 1000000000ULL), (long)(arrive % 1000000000ULL)};
            while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR && !serve_stop)
                ;
            if (serve_stop)
                break;
        } else if (n > 0) {
            late++; /* the previous request was still running when this one arrived */
        }
        uint64_t started = serve_request(s, ev), done = now_ns();
        if (req) {
            req[2 * n] = started;
            req[2 * n + 1] = done;
        }
        lat[n++] = done - arrive;
        busy += (uint64_t)opt.burst * kernel_ns;
    }
    uint64_t wall = now_ns() - t0;
    uint64_t *raw = opt.raw ? malloc(n * sizeof(uint64_t)) : NULL;
    if (opt.raw && !raw)
        die("out of host memory");
    if (raw)
        memcpy(raw, lat, n * sizeof(uint64_t));
    qsort(lat, n, sizeof(uint64_t), cmp_u64);
    uint64_t top = n ? lat[n - 1] : 0, bottom = n ? lat[0] : 0;
    printf("requests=%zu late=%zu p50_us=%" PRIu64 " p90_us=%" PRIu64 " p99_us=%" PRIu64 " max_us=%" PRIu64
           " min_us=%" PRIu64 " kernel_us=%ld burst=%ld period_ms=%g busy_ns=%" PRIu64 " wall_ns=%" PRIu64 "\n",
           n, late, n ? pct(lat, n, 50) / 1000 : 0, n ? pct(lat, n, 90) / 1000 : 0, n ? pct(lat, n, 99) / 1000 : 0,
           top / 1000, bottom / 1000, opt.kernel_us, opt.burst, opt.period_ms, busy, wall);
    for (size_t i = 0; raw && i < n; i++)
        printf("lat_us=%" PRIu64 "\n", raw[i] / 1000);
    for (size_t i = 0; req && i < n; i++)
        printf("req start_ns=%" PRIu64 " done_ns=%" PRIu64 "\n", req[2 * i], req[2 * i + 1]);
    free(raw);
    free(req);
    for (long i = 0; i < opt.depth; i++)
        CK(cu.cuEventDestroy_v2(ev[i]));
    CK(cu.cuStreamDestroy_v2(s));
    free(ev);
    free(lat);
    return 0;
}

/* ---- benchmarks ---- */

/* CPU time of the calling thread, in ns: unlike the wall clock it does not
 * count the time the thread waited for a CPU that other processes held.
 * The shim does its work in the caller's thread (it starts none); the
 * simulated device of fakecuda runs in threads of its own, whose time would
 * swamp what is measured. */
static uint64_t cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* Runs op opt.n times in opt.batches batches, calling settle (if any,
 * untimed) after each, and prints, for key, the wall ns per op over all
 * (key=, settling included) and the median over the batches of the CPU ns
 * per op (cpu_key=). */
static void bench_batches(const char *key, void (*op)(long i), void (*settle)(void))
{
    uint64_t *per = calloc((size_t)opt.batches, sizeof *per);
    if (!per)
        die("out of host memory");
    uint64_t t0 = now_ns();
    long done = 0;
    for (long b = 0; b < opt.batches; b++) {
        long k = opt.n / opt.batches + (b < opt.n % opt.batches);
        uint64_t c0 = cpu_ns();
        for (long i = 0; i < k; i++)
            op(done + i);
        per[b] = (cpu_ns() - c0) * 1000 / (uint64_t)k; /* ps per op */
        done += k;
        if (settle)
            settle();
    }
    uint64_t dt = now_ns() - t0;
    qsort(per, (size_t)opt.batches, sizeof *per, cmp_u64);
    printf("%s=%.1f cpu_%s=%.1f batches=%ld ", key, (double)dt / (double)opt.n, key,
           (double)per[opt.batches / 2] / 1000.0, opt.batches);
    free(per);
}

static CUstream launch_stream;
static void *launch_params[1];

static void launch_op(long i)
{
    (void)i;
    CUresult r = cu.cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, launch_stream, launch_params, NULL);
    if (r != CUDA_SUCCESS)
        die("cuLaunchKernel -> %s (%d)", errname(r), (int)r);
}

static void launch_settle(void)
{
    CK(cu.cuStreamSynchronize(launch_stream));
}

static int cmd_bench_launch(void)
{
    if (opt.batches == 0) /* default: the fewest batches of at most 1024 */
        opt.batches = (opt.n + 1023) / 1024;
    if (opt.n / opt.batches > 1024)
        die("bench-launch: at most 1024 launches a batch (--n / --batches), the stream is synchronised between batches");
    setup();
    load_kernel();
    CK(cu.cuStreamCreate(&launch_stream, CU_STREAM_NON_BLOCKING));
    uint64_t zero = 0;
    launch_params[0] = &zero;
    for (int i = 0; i < 1024; i++) /* warm up */
        CK(cu.cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, launch_stream, launch_params, NULL));
    CK(cu.cuStreamSynchronize(launch_stream));
    bench_batches("ns_per_launch", launch_op, launch_settle);
    printf("launches=%ld\n", opt.n);
    return 0;
}

static const char *alloc_api;

static void alloc_op(long i)
{
    (void)i;
    struct alloc_h h;
    CUresult r = do_alloc(alloc_api, (uint64_t)opt.bytes, &h);
    if (r != CUDA_SUCCESS)
        die("%s -> %s (%d)", alloc_api, errname(r), (int)r);
    CK(do_free(alloc_api, &h));
}

static int cmd_bench_alloc(void)
{
    alloc_api = opt.api ? opt.api : "cuMemAlloc_v2";
    if (opt.batches == 0)
        opt.batches = 1;
    setup();
    CK(cu.cuStreamCreate(&alloc_stream, CU_STREAM_NON_BLOCKING));
    for (int i = 0; i < 256; i++) /* warm up */
        alloc_op(i);
    bench_batches("ns_per_alloc", alloc_op, NULL);
    printf("allocs=%ld bytes=%lld api=%s\n", opt.n, opt.bytes, alloc_api);
    return 0;
}

/* ---- fork ---- */
static int cuda_roundtrip(const char *who)
{
    setup();
    load_kernel();
    CUstream s;
    CUevent a, b;
    CUdeviceptr p;
    CK(cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CK(cu.cuEventCreate(&a, CU_EVENT_DEFAULT));
    CK(cu.cuEventCreate(&b, CU_EVENT_DEFAULT));
    CK(cu.cuMemAlloc_v2(&p, 1 << 20));
    uint64_t ns = (uint64_t)opt.kernel_us * 1000;
    void *params[] = {&ns};
    CK(cu.cuEventRecord(a, s));
    CK(cu.cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, s, params, NULL));
    CK(cu.cuEventRecord(b, s));
    CK(cu.cuEventSynchronize(b));
    float ms = 0;
    CK(cu.cuEventElapsedTime(&ms, a, b));
    CK(cu.cuMemFree_v2(p));
    printf("%s pid=%d ok elapsed_ms=%.3f\n", who, (int)getpid(), ms);
    fflush(stdout);
    return 0;
}

static int cmd_fork(void)
{
    if (opt.kernel_us == 1000)
        opt.kernel_us = 5000;
    cuda_roundtrip("parent");
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0)
        die("fork: %s", strerror(errno));
    if (pid == 0) {
        cuda_roundtrip("child");
        _exit(0);
    }
    int st = 0;
    if (waitpid(pid, &st, 0) != pid)
        die("waitpid: %s", strerror(errno));
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        die("child failed (status 0x%x)", st);
    cuda_roundtrip("parent-after");
    return 0;
}

/* ---- main ---- */
static long num(const char *flag, const char *v)
{
    char *end = NULL;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || !*v || *end)
        die("%s wants an integer, got %s", flag, v);
    return x;
}

static double fnum(const char *flag, const char *v)
{
    char *end = NULL;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || !*v || *end)
        die("%s wants a number, got %s", flag, v);
    return x;
}

int main(int argc, char **argv)
{
    const char *cmd = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define VAL() (v ? (i++, v) : (die("%s needs a value", a), ""))
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 0;
        } else if (strcmp(a, "--resolve") == 0) {
            opt.resolve = VAL();
        } else if (strcmp(a, "--ptsz") == 0) {
            opt.ptsz = 1;
        } else if (strcmp(a, "--device") == 0) {
            opt.device = (int)num(a, VAL());
        } else if (strcmp(a, "--api") == 0) {
            opt.api = VAL();
        } else if (strcmp(a, "--mib") == 0) {
            opt.mib = fnum(a, VAL());
        } else if (strcmp(a, "--count") == 0) {
            opt.count = num(a, VAL());
        } else if (strcmp(a, "--hold-ms") == 0) {
            opt.hold_ms = num(a, VAL());
        } else if (strcmp(a, "--free") == 0) {
            opt.do_free = 1;
        } else if (strcmp(a, "--iterations") == 0) {
            opt.iterations = num(a, VAL());
        } else if (strcmp(a, "--kernel-us") == 0) {
            opt.kernel_us = num(a, VAL());
        } else if (strcmp(a, "--depth") == 0) {
            opt.depth = num(a, VAL());
        } else if (strcmp(a, "--seconds") == 0) {
            opt.seconds = fnum(a, VAL());
        } else if (strcmp(a, "--streams") == 0) {
            opt.streams = num(a, VAL());
        } else if (strcmp(a, "--threads") == 0) {
            opt.threads = num(a, VAL());
        } else if (strcmp(a, "--report-ms") == 0) {
            opt.report_ms = num(a, VAL());
        } else if (strcmp(a, "--idle-ms") == 0) {
            opt.idle_ms = num(a, VAL());
        } else if (strcmp(a, "--burst") == 0) {
            opt.burst = num(a, VAL());
        } else if (strcmp(a, "--period-ms") == 0) {
            opt.period_ms = fnum(a, VAL());
        } else if (strcmp(a, "--sync-every") == 0) {
            opt.sync_every = num(a, VAL());
        } else if (strcmp(a, "--host-us") == 0) {
            opt.host_us = num(a, VAL());
        } else if (strcmp(a, "--null-stream") == 0) {
            opt.null_stream = 1;
        } else if (strcmp(a, "--raw") == 0) {
            opt.raw = 1;
        } else if (strcmp(a, "--graph-nodes") == 0) {
            opt.graph_nodes = num(a, VAL());
        } else if (strcmp(a, "--graph-build") == 0) {
            opt.graph_build = VAL();
        } else if (strcmp(a, "--n") == 0) {
            opt.n = num(a, VAL());
        } else if (strcmp(a, "--batches") == 0) {
            opt.batches = num(a, VAL());
        } else if (strcmp(a, "--bytes") == 0) {
            opt.bytes = num(a, VAL());
        } else if (a[0] == '-') {
            usage(stderr);
            die("unknown option %s", a);
        } else if (!cmd) {
            cmd = a;
        } else {
            die("unexpected argument %s", a);
        }
#undef VAL
    }
    if (!cmd) {
        usage(stderr);
        return 1;
    }
    if (opt.count < 1 || opt.n < 1 || opt.batches < 0 || opt.batches > opt.n)
        die("--count and --n must be >= 1, --batches between 1 and --n");
    resolve();
    if (strcmp(cmd, "info") == 0)
        return cmd_info();
    if (strcmp(cmd, "alloc") == 0)
        return cmd_alloc();
    if (strcmp(cmd, "alloc-churn") == 0)
        return cmd_churn();
    if (strcmp(cmd, "compute") == 0)
        return cmd_compute();
    if (strcmp(cmd, "serve") == 0)
        return cmd_serve();
    if (strcmp(cmd, "bench-launch") == 0)
        return cmd_bench_launch();
    if (strcmp(cmd, "bench-alloc") == 0)
        return cmd_bench_alloc();
    if (strcmp(cmd, "fork") == 0)
        return cmd_fork();
    usage(stderr);
    die("unknown command %s", cmd);
    return 1;
}
