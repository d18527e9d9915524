/*
 * mem.c - device-memory quotas.
 *
 * Every allocation reserves its bytes in the process's own slot before the
 * real call (mgpu_region.h: from what it reserved ahead, else add, sum the
 * taken slots, undo if over the limit) and gives them back if the driver
 * fails.  A process-local table remembers the
 * size of each live allocation so that the matching free gives back exactly
 * what was reserved.  The table's mutex is process-local: nothing in the
 * region is ever locked.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "shim.h"

/* ---- reservation ---- */

/* The chunk a small allocation reserves ahead (mgpu_region.h): at most
 * 4 MiB and 1/256 of the quota, so that what other processes hold ahead
 * stays a small part of it. */
#define MGPU_AHEAD_MAX (4ull << 20)

static uint64_t ahead_chunk(const struct mgpu_dev *d)
{
    uint64_t c = d->limit / 256;
    return c < MGPU_AHEAD_MAX ? c : MGPU_AHEAD_MAX;
}

/* Adds n to the own slot, sums the taken slots and undoes it if the
 * instance is over its limit. */
static int reserve_checked(struct mgpu_dev *d, uint64_t n)
{
    atomic_fetch_add(&d->slot->mem_reserved, n);
    if (mgpu_instance_used(d, 0) > d->limit) {
        atomic_fetch_sub(&d->slot->mem_reserved, n);
        return 0;
    }
    return 1;
}

static int reserve(struct mgpu_dev *d, uint64_t n)
{
    if (n == 0)
        return 1;
    if (n > d->limit)
        return 0;
    /* From what is reserved ahead: no other process's slot is read. */
    _Atomic uint64_t *ahead = &d->slot->mem_ahead;
    uint64_t a = atomic_load(ahead);
    while (a >= n)
        if (atomic_compare_exchange_weak(ahead, &a, a - n))
            return 1;
    /* Take all that is ahead and reserve the rest, with a chunk ahead for a
     * small allocation when the instance has room for it. */
    a = atomic_exchange(ahead, 0);
    if (a >= n) { /* a free gave some back meanwhile */
        atomic_fetch_add(ahead, a - n);
        return 1;
    }
    uint64_t need = n - a, chunk = ahead_chunk(d);
    if (n < chunk && reserve_checked(d, need + chunk)) {
        atomic_fetch_add(ahead, chunk);
        return 1;
    }
    if (reserve_checked(d, need))
        return 1;
    atomic_fetch_add(ahead, a);
    return 0;
}

static void unreserve(struct mgpu_dev *d, uint64_t n)
{
    if (!n)
        return;
    /* The bytes go ahead; more than two chunks ahead go back to the
     * instance. */
    _Atomic uint64_t *ahead = &d->slot->mem_ahead;
    uint64_t chunk = ahead_chunk(d);
    uint64_t a = atomic_fetch_add(ahead, n) + n;
    while (a > 2 * chunk)
        if (atomic_compare_exchange_weak(ahead, &a, chunk)) {
            atomic_fetch_sub(&d->slot->mem_reserved, a - chunk);
            return;
        }
}

/* ---- live allocations: open addressing, linear probing ---- */

enum { K_EMPTY = 0, K_PTR = 1, K_HANDLE = 2, K_ARRAY = 3, K_TOMB = 0xff };

struct ent {
    uint64_t key;
    uint64_t size;
    struct mgpu_dev *dev;
    unsigned kind;
};

static pthread_mutex_t g_mem_mu = PTHREAD_MUTEX_INITIALIZER;
static struct ent *g_tab;
static size_t g_cap;  /* power of two */
static size_t g_fill; /* live + tombstones */

static size_t slot_of(unsigned kind, uint64_t key, size_t cap)
{
    uint64_t h = (key ^ ((uint64_t)kind << 59)) * 0x9e3779b97f4a7c15ull;
    return (size_t)(h >> 17) & (cap - 1);
}

static int tab_grow(void)
{
    size_t live = 0;
    for (size_t i = 0; i < g_cap; i++)
        live += g_tab[i].kind != K_EMPTY && g_tab[i].kind != K_TOMB;
    size_t cap = g_cap ? g_cap : 1024;
    while ((live + 1) * 2 > cap)
        cap *= 2;
    struct ent *t = calloc(cap, sizeof *t);
    if (!t)
        return -1;
    for (size_t i = 0; i < g_cap; i++) {
        struct ent *e = &g_tab[i];
        if (e->kind == K_EMPTY || e->kind == K_TOMB)
            continue;
        size_t j = slot_of(e->kind, e->key, cap);
        while (t[j].kind != K_EMPTY)
            j = (j + 1) & (cap - 1);
        t[j] = *e;
    }
    free(g_tab);
    g_tab = t;
    g_cap = cap;
    g_fill = live;
    return 0;
}

static int tab_put(const struct ent *e)
{
    int r = 0;
    pthread_mutex_lock(&g_mem_mu);
    if ((g_fill + 1) * 2 > g_cap && tab_grow()) {
        r = -1;
    } else {
        size_t j = slot_of(e->kind, e->key, g_cap);
        while (g_tab[j].kind != K_EMPTY && g_tab[j].kind != K_TOMB)
            j = (j + 1) & (g_cap - 1);
        if (g_tab[j].kind == K_EMPTY)
            g_fill++;
        g_tab[j] = *e;
    }
    pthread_mutex_unlock(&g_mem_mu);
    return r;
}

static int tab_take(unsigned kind, uint64_t key, struct ent *out)
{
    int found = 0;
    pthread_mutex_lock(&g_mem_mu);
    if (g_cap) {
        for (size_t j = slot_of(kind, key, g_cap); g_tab[j].kind != K_EMPTY; j = (j + 1) & (g_cap - 1)) {
            if (g_tab[j].kind == kind && g_tab[j].key == key) {
                *out = g_tab[j];
                g_tab[j].kind = K_TOMB;
                found = 1;
                break;
            }
        }
    }
    pthread_mutex_unlock(&g_mem_mu);
    return found;
}

/* ---- stream-ordered frees ----
 * cuMemFreeAsync frees when the stream gets there: its bytes are given back
 * only once an event recorded after it has completed, so that the driver
 * never holds more than the quota. */

struct pending {
    CUevent ev;
    struct mgpu_dev *dev;
    uint64_t size;
};
#define MGPU_MAX_PENDING 4096
static struct pending *g_pend; /* under g_mem_mu */
static _Atomic size_t g_npend; /* read unlocked as a hint */

/* Gives back the bytes of completed frees; wait: also wait for the others. */
static void reap_pending(int wait)
{
    pthread_mutex_lock(&g_mem_mu);
    for (size_t i = 0; i < g_npend;) {
        struct pending p = g_pend[i];
        CUresult r = REAL(cuEventQuery)(p.ev);
        if (r == CUDA_ERROR_NOT_READY && wait) /* held: nobody may destroy it meanwhile */
            r = REAL(cuEventSynchronize)(p.ev);
        if (r == CUDA_ERROR_NOT_READY) {
            i++;
            continue;
        }
        REAL(cuEventDestroy_v2)(p.ev);
        unreserve(p.dev, p.size);
        g_pend[i] = g_pend[--g_npend];
    }
    pthread_mutex_unlock(&g_mem_mu);
}

static int defer_free(struct mgpu_dev *d, uint64_t size, CUstream h, int ptsz)
{
    if (!REAL(cuEventCreate) || !REAL(cuEventRecord))
        return -1;
    CUevent ev;
    if (REAL(cuEventCreate)(&ev, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS)
        return -1;
    if (REAL(cuEventRecord)(ev, h == NULL && ptsz ? CU_STREAM_PER_THREAD : h) != CUDA_SUCCESS) {
        REAL(cuEventDestroy_v2)(ev);
        return -1;
    }
    int r = -1;
    pthread_mutex_lock(&g_mem_mu);
    if (!g_pend)
        g_pend = calloc(MGPU_MAX_PENDING, sizeof *g_pend);
    if (g_pend && g_npend < MGPU_MAX_PENDING) {
        g_pend[g_npend++] = (struct pending){ev, d, size};
        r = 0;
    }
    pthread_mutex_unlock(&g_mem_mu);
    if (r) {
        REAL(cuEventSynchronize)(ev);
        REAL(cuEventDestroy_v2)(ev);
    }
    return 0; /* given back now, or later by reap_pending */
}

void mgpu_mem_reset_after_fork(void)
{
    g_npend = 0; /* the parent's events */
    /* The child holds none of its parent's allocations. */
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    g_mem_mu = m;
    if (g_tab)
        memset(g_tab, 0, g_cap * sizeof *g_tab);
    g_fill = 0;
}

/* ---- allocation helpers ---- */

/* Reserves n bytes on the device (ordinal < 0: the current context's).
 * On CUDA_SUCCESS *pd is the device to account on, or NULL to pass through
 * without accounting (fail-open). */
static CUresult mem_begin(int ordinal, uint64_t n, struct mgpu_dev **pd)
{
    struct mgpu_dev *d;
    CUresult r = mgpu_resolve_dev(ordinal, &d);
    *pd = NULL;
    if (r != CUDA_SUCCESS || !d)
        return r;
    if (g_npend)
        reap_pending(0);
    if (!reserve(d, n)) {
        if (!g_npend)
            return CUDA_ERROR_OUT_OF_MEMORY;
        reap_pending(1); /* memory being freed on a stream is free once the stream gets there */
        if (!reserve(d, n))
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *pd = d;
    return CUDA_SUCCESS;
}

static void mem_end(struct mgpu_dev *d, CUresult r, unsigned kind, uint64_t key, uint64_t n)
{
    if (!d)
        return;
    if (r != CUDA_SUCCESS || n == 0) {
        unreserve(d, n);
        return;
    }
    struct ent e = {.key = key, .size = n, .dev = d, .kind = kind};
    if (tab_put(&e)) {
        /* Out of process memory: keep the reservation (the quota stays
         * conservative; the bytes are given back when the process exits). */
    }
}

#define ALLOC_BODY(bytes, ordinal, call, kind, keyexpr)                                                           \
    do {                                                                                                          \
        struct mgpu_dev *d;                                                                                       \
        uint64_t n_ = (bytes);                                                                                    \
        CUresult r = mem_begin((ordinal), n_, &d);                                                                \
        if (r != CUDA_SUCCESS)                                                                                    \
            return r;                                                                                             \
        r = (call);                                                                                               \
        mem_end(d, r, (kind), r == CUDA_SUCCESS ? (uint64_t)(keyexpr) : 0, n_);                                   \
        return r;                                                                                                 \
    } while (0)

MGPU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    ALLOC_BODY(bytesize, -1, REAL(cuMemAlloc_v2)(dptr, bytesize), K_PTR, *dptr);
}

MGPU_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    ALLOC_BODY(bytesize, -1, REAL(cuMemAllocManaged)(dptr, bytesize, flags), K_PTR, *dptr);
}

MGPU_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    ALLOC_BODY(bytesize, -1, REAL(cuMemAllocAsync)(dptr, bytesize, hStream), K_PTR, *dptr);
}

MGPU_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    ALLOC_BODY(bytesize, -1, REAL(cuMemAllocAsync_ptsz)(dptr, bytesize, hStream), K_PTR, *dptr);
}

MGPU_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                             CUstream hStream)
{
    ALLOC_BODY(bytesize, -1, REAL(cuMemAllocFromPoolAsync)(dptr, bytesize, pool, hStream), K_PTR, *dptr);
}

MGPU_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                  CUstream hStream)
{
    ALLOC_BODY(bytesize, -1, REAL(cuMemAllocFromPoolAsync_ptsz)(dptr, bytesize, pool, hStream), K_PTR, *dptr);
}

MGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                 unsigned long long flags)
{
    int ordinal = prop && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? prop->location.id : -1;
    ALLOC_BODY(size, ordinal, REAL(cuMemCreate)(handle, size, prop, flags), K_HANDLE, *handle);
}

/* Pitch: the driver picks the pitch, so reserve for the widest it may pick
 * and settle to the real size afterwards. */
#define MGPU_PITCH_ALIGN 512u

MGPU_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                        unsigned int ElementSizeBytes)
{
    uint64_t w = WidthInBytes, est;
    if (w > UINT64_MAX - MGPU_PITCH_ALIGN || __builtin_mul_overflow((w + MGPU_PITCH_ALIGN - 1) / MGPU_PITCH_ALIGN *
                                                                         MGPU_PITCH_ALIGN,
                                                                     (uint64_t)Height, &est))
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct mgpu_dev *d;
    CUresult r = mem_begin(-1, est, &d);
    if (r != CUDA_SUCCESS)
        return r;
    r = REAL(cuMemAllocPitch_v2)(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (!d)
        return r;
    if (r != CUDA_SUCCESS) {
        unreserve(d, est);
        return r;
    }
    uint64_t real;
    if (__builtin_mul_overflow((uint64_t)*pPitch, (uint64_t)Height, &real))
        real = UINT64_MAX;
    if (real > est) {
        if (!reserve(d, real - est)) {
            REAL(cuMemFree_v2)(*dptr);
            unreserve(d, est);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    } else {
        unreserve(d, est - real);
    }
    mem_end(d, r, K_PTR, *dptr, real);
    return r;
}

static uint64_t format_bytes(CUarray_format f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
        return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
        return 2;
    default: /* 32-bit formats, and the widest for formats not listed here */
        return 4;
    }
}

static uint64_t array_bytes(size_t w, size_t h, size_t depth, CUarray_format f, unsigned channels)
{
    uint64_t n = format_bytes(f), r;
    if (__builtin_mul_overflow(n, (uint64_t)(channels ? channels : 1), &r) ||
        __builtin_mul_overflow(r, (uint64_t)w, &r) || __builtin_mul_overflow(r, (uint64_t)(h ? h : 1), &r) ||
        __builtin_mul_overflow(r, (uint64_t)(depth ? depth : 1), &r))
        return UINT64_MAX;
    return r;
}

MGPU_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray)
{
    uint64_t n = pAllocateArray ? array_bytes(pAllocateArray->Width, pAllocateArray->Height, 1,
                                              pAllocateArray->Format, pAllocateArray->NumChannels)
                                : 0;
    ALLOC_BODY(n, -1, REAL(cuArrayCreate_v2)(pHandle, pAllocateArray), K_ARRAY, (uintptr_t)*pHandle);
}

MGPU_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray)
{
    uint64_t n = pAllocateArray ? array_bytes(pAllocateArray->Width, pAllocateArray->Height, pAllocateArray->Depth,
                                              pAllocateArray->Format, pAllocateArray->NumChannels)
                                : 0;
    ALLOC_BODY(n, -1, REAL(cuArray3DCreate_v2)(pHandle, pAllocateArray), K_ARRAY, (uintptr_t)*pHandle);
}

/* ---- frees ---- */

/* The entry leaves the table before the real free (so that a new allocation
 * at the same address cannot be confused with it) and returns if the free
 * fails. */
#define FREE_BODY(kind, keyexpr, call)                                                                            \
    do {                                                                                                          \
        if (mgpu_load_cuda())                                                                                     \
            return CUDA_ERROR_NOT_INITIALIZED;                                                                    \
        enum mgpu_state s_ = mgpu_ensure();                                                                       \
        if (s_ == MGPU_ST_FAILED)                                                                                 \
            return CUDA_ERROR_NOT_INITIALIZED;                                                                    \
        struct ent e_;                                                                                            \
        uint64_t k_ = (uint64_t)(keyexpr);                                                                        \
        int have_ = s_ == MGPU_ST_READY && k_ && tab_take((kind), k_, &e_);                                       \
        CUresult r = (call);                                                                                      \
        if (have_) {                                                                                              \
            if (r == CUDA_SUCCESS)                                                                                \
                unreserve(e_.dev, e_.size);                                                                       \
            else if (tab_put(&e_))                                                                                \
                unreserve(e_.dev, e_.size);                                                                       \
        }                                                                                                         \
        return r;                                                                                                 \
    } while (0)

MGPU_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    FREE_BODY(K_PTR, dptr, REAL(cuMemFree_v2)(dptr));
}

static CUresult free_async(CUdeviceptr dptr, CUstream h, int ptsz, CUresult (*real)(CUdeviceptr, CUstream))
{
    if (mgpu_load_cuda() || !real)
        return CUDA_ERROR_NOT_INITIALIZED;
    enum mgpu_state s = mgpu_ensure();
    if (s == MGPU_ST_FAILED)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct ent e;
    int have = s == MGPU_ST_READY && dptr && tab_take(K_PTR, dptr, &e);
    CUresult r = real(dptr, h);
    if (have) {
        if (r != CUDA_SUCCESS) {
            if (tab_put(&e))
                unreserve(e.dev, e.size);
        } else if (defer_free(e.dev, e.size, h, ptsz)) {
            unreserve(e.dev, e.size);
        }
    }
    return r;
}

MGPU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    return free_async(dptr, hStream, 0, REAL(cuMemFreeAsync));
}

MGPU_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    return free_async(dptr, hStream, 1, REAL(cuMemFreeAsync_ptsz));
}

MGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    FREE_BODY(K_HANDLE, handle, REAL(cuMemRelease)(handle));
}

MGPU_EXPORT CUresult cuArrayDestroy(CUarray hArray)
{
    FREE_BODY(K_ARRAY, (uintptr_t)hArray, REAL(cuArrayDestroy)(hArray));
}

/* ---- what the process is told ---- */

static uint64_t free_in_quota(struct mgpu_dev *d, uint64_t real_free)
{
    uint64_t used = mgpu_instance_used(d, 1);
    uint64_t f = used >= d->limit ? 0 : d->limit - used;
    return f < real_free ? f : real_free;
}

MGPU_EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
{
    if (mgpu_load_cuda())
        return CUDA_ERROR_NOT_INITIALIZED;
    enum mgpu_state s = mgpu_ensure();
    if (s == MGPU_ST_FAILED)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (g_npend)
        reap_pending(0);
    CUresult r = REAL(cuMemGetInfo_v2)(free, total);
    if (r != CUDA_SUCCESS || s != MGPU_ST_READY || !free || !total)
        return r;
    CUresult err;
    struct mgpu_dev *d = mgpu_current_dev(&err);
    if (!d)
        return err;
    *free = (size_t)free_in_quota(d, *free);
    *total = (size_t)d->limit;
    return r;
}

MGPU_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    if (mgpu_load_cuda())
        return CUDA_ERROR_NOT_INITIALIZED;
    enum mgpu_state s = mgpu_ensure();
    if (s == MGPU_ST_FAILED)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = REAL(cuDeviceTotalMem_v2)(bytes, dev);
    if (r != CUDA_SUCCESS || s != MGPU_ST_READY || !bytes)
        return r;
    struct mgpu_dev *d = mgpu_dev_by_ordinal(dev);
    if (!d)
        return CUDA_ERROR_INVALID_DEVICE;
    *bytes = (size_t)d->limit;
    return r;
}

/* NVML: the device is named by its NVML (host) index.  Devices the process
 * is not attached to report what the driver says. */
static nvmlReturn_t nvml_begin(nvmlDevice_t device, struct mgpu_dev **pd)
{
    *pd = NULL;
    enum mgpu_state s = mgpu_ensure();
    if (s == MGPU_ST_FAILED)
        return NVML_ERROR_UNKNOWN;
    unsigned idx;
    if (s == MGPU_ST_READY && REAL(nvmlDeviceGetIndex) && REAL(nvmlDeviceGetIndex)(device, &idx) == NVML_SUCCESS)
        *pd = mgpu_dev_by_host_index(idx);
    return NVML_SUCCESS;
}

MGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    if (mgpu_load_nvml() || !REAL(nvmlDeviceGetMemoryInfo))
        return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t r = REAL(nvmlDeviceGetMemoryInfo)(device, memory);
    struct mgpu_dev *d;
    if (r != NVML_SUCCESS || !memory)
        return r;
    if ((r = nvml_begin(device, &d)) != NVML_SUCCESS || !d)
        return r;
    uint64_t used = mgpu_instance_used(d, 1);
    memory->total = d->limit;
    memory->used = used < d->limit ? used : d->limit;
    memory->free = free_in_quota(d, memory->free);
    return NVML_SUCCESS;
}

MGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    if (mgpu_load_nvml() || !REAL(nvmlDeviceGetMemoryInfo_v2))
        return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t r = REAL(nvmlDeviceGetMemoryInfo_v2)(device, memory);
    struct mgpu_dev *d;
    if (r != NVML_SUCCESS || !memory)
        return r;
    if ((r = nvml_begin(device, &d)) != NVML_SUCCESS || !d)
        return r;
    uint64_t used = mgpu_instance_used(d, 1);
    memory->total = d->limit;
    memory->reserved = 0;
    memory->used = used < d->limit ? used : d->limit;
    memory->free = free_in_quota(d, memory->free);
    return NVML_SUCCESS;
}
