/*
 * launch.c - compute gating (the launch family).  Part 1: the grant gate.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"

pthread_mutex_t mgpu_acct_mu = PTHREAD_MUTEX_INITIALIZER;

void mgpu_launch_reset_after_fork(void)
{
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static __attribute__((noinline)) void wait_grant(struct mgpu_dev *d)
{
    atomic_fetch_add(&d->slot->waiting, 1);
    uint64_t t0 = now_ns();
    while (atomic_load(&d->region->grant) == 0) {
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 1000000};
        syscall(SYS_futex, &d->region->grant, FUTEX_WAIT, 0, &ts, NULL, 0);
    }
    atomic_fetch_add(&d->slot->throttled_ns, now_ns() - t0);
    atomic_fetch_sub(&d->slot->waiting, 1);
}

/* Returns the device to gate on, NULL to pass through, or sets *err. */
static inline struct mgpu_dev *gate(CUresult *err)
{
    struct mgpu_dev *d = atomic_load_explicit(&mgpu_fast_dev, memory_order_relaxed);
    if (MGPU_UNLIKELY(!d)) {
        *err = CUDA_SUCCESS;
        if (mgpu_load_cuda()) {
            *err = CUDA_ERROR_NOT_INITIALIZED;
            return NULL;
        }
        enum mgpu_state s = mgpu_ensure();
        if (s == MGPU_ST_FAILED) {
            *err = CUDA_ERROR_NOT_INITIALIZED;
            return NULL;
        }
        if (s == MGPU_ST_OPEN)
            return NULL;
        d = mgpu_current_dev(err);
        if (!d)
            return NULL;
    }
    if (MGPU_UNLIKELY(atomic_load_explicit(&d->region->grant, memory_order_acquire) == 0))
        wait_grant(d);
    atomic_fetch_add_explicit(&d->slot->launches, 1, memory_order_relaxed);
    return d;
}

#define GATED(call)                                                                                               \
    do {                                                                                                          \
        CUresult e_ = CUDA_SUCCESS;                                                                               \
        struct mgpu_dev *d_ = gate(&e_);                                                                          \
        (void)d_;                                                                                                 \
        if (e_ != CUDA_SUCCESS)                                                                                   \
            return e_;                                                                                            \
        return (call);                                                                                            \
    } while (0)

MGPU_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                    unsigned int by, unsigned int bz, unsigned int shm, CUstream s, void **params,
                                    void **extra)
{
    GATED(REAL(cuLaunchKernel)(f, gx, gy, gz, bx, by, bz, shm, s, params, extra));
}
MGPU_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                         unsigned int bx, unsigned int by, unsigned int bz, unsigned int shm,
                                         CUstream s, void **params, void **extra)
{
    GATED(REAL(cuLaunchKernel_ptsz)(f, gx, gy, gz, bx, by, bz, shm, s, params, extra));
}
MGPU_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{
    GATED(REAL(cuLaunchKernelEx)(config, f, params, extra));
}
MGPU_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{
    GATED(REAL(cuLaunchKernelEx_ptsz)(config, f, params, extra));
}
MGPU_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                               unsigned int bx, unsigned int by, unsigned int bz, unsigned int shm,
                                               CUstream s, void **params)
{
    GATED(REAL(cuLaunchCooperativeKernel)(f, gx, gy, gz, bx, by, bz, shm, s, params));
}
MGPU_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                                    unsigned int bx, unsigned int by, unsigned int bz,
                                                    unsigned int shm, CUstream s, void **params)
{
    GATED(REAL(cuLaunchCooperativeKernel_ptsz)(f, gx, gy, gz, bx, by, bz, shm, s, params));
}
MGPU_EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s)
{
    GATED(REAL(cuGraphLaunch)(g, s));
}
MGPU_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s)
{
    GATED(REAL(cuGraphLaunch_ptsz)(g, s));
}

MGPU_EXPORT CUresult cuStreamSynchronize(CUstream s)
{
    return REAL(cuStreamSynchronize)(s);
}
MGPU_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s)
{
    return REAL(cuStreamSynchronize_ptsz)(s);
}
MGPU_EXPORT CUresult cuCtxSynchronize(void)
{
    return REAL(cuCtxSynchronize)();
}
MGPU_EXPORT CUresult cuEventSynchronize(CUevent e)
{
    return REAL(cuEventSynchronize)(e);
}
MGPU_EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode)
{
    return REAL(cuStreamBeginCapture_v2)(s, mode);
}
MGPU_EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream s, CUstreamCaptureMode mode)
{
    return REAL(cuStreamBeginCapture_v2_ptsz)(s, mode);
}
MGPU_EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph *g)
{
    return REAL(cuStreamEndCapture)(s, g);
}
MGPU_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *g)
{
    return REAL(cuStreamEndCapture_ptsz)(s, g);
}
