/*
 * shim.h - internal declarations shared by the shim's translation units.
 * Nothing here is exported: the library is built with -fvisibility=hidden and
 * a version script generated from shim.def.
 */
#ifndef MGPU_SHIM_H
#define MGPU_SHIM_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "mgpu_cuda.h"
#include "mgpu_region.h"

#define MGPU_EXPORT __attribute__((visibility("default")))
#define MGPU_LIKELY(x) __builtin_expect(!!(x), 1)
#define MGPU_UNLIKELY(x) __builtin_expect(!!(x), 0)

#define MGPU_MAX_DEVICES 64

/* Pointers into the real driver and NVML, filled once by mgpu_load_cuda /
 * mgpu_load_nvml from the list in shim.def. */
struct mgpu_real {
#define MGPU_CU(name, base, since, ptsz) __typeof__(&name) name;
#define MGPU_CU_REAL(name) __typeof__(&name) name;
#define MGPU_NVML(name) __typeof__(&name) name;
#define MGPU_NVML_REAL(name) __typeof__(&name) name;
#include "shim.def"
};
extern struct mgpu_real mgpu_real;
#define REAL(name) (mgpu_real.name)

/* One device the process may use (a CUDA ordinal). */
struct mgpu_dev {
    int ordinal;           /* CUDA ordinal */
    unsigned host_index;   /* X of /run/mgpu/gpuX */
    const mgpu_control_t *region; /* the control file, read-only; NULL: not managed by mgpu (refused) */
    mgpu_proc_t *slot;            /* the own proc file, read-write */
    char *procs;                  /* the other slots' proc files, read-only, MGPU_PROC_FILE_SIZE apart */
    _Atomic uint64_t mapped[MGPU_REGION_MAX_PROCS / 64]; /* slots mapped at procs (asked for when first seen taken) */
    unsigned own;                 /* the own slot */
    uint64_t limit;               /* region->memory_limit */
    uint64_t max_queued_ns;
    /* The instance's wake socket (mgpu_region.h, MGPU_ATTACH_FLAG_WAKE):
     * its descriptor + 1 (0: none yet), the enforcer epoch it belongs to,
     * the CLOCK_MONOTONIC time before which a failed fetch is not
     * retried, and its inode. */
    _Atomic int wake_fd1;
    _Atomic uint32_t wake_epoch;
    _Atomic uint64_t wake_retry_ns;
    _Atomic uint64_t wake_ino; /* the socket's inode: the descriptor is still ours */
};

enum mgpu_state {
    MGPU_ST_NONE = 0, /* not attached yet */
    MGPU_ST_READY,    /* attached: enforce */
    MGPU_ST_FAILED,   /* attach failed: every entry point fails */
    MGPU_ST_OPEN,     /* attach failed, MGPU_FAIL_OPEN=1: pass everything through */
};

/* init.c */
int mgpu_load_cuda(void); /* 0 on success; loads the driver, never attaches */
int mgpu_load_nvml(void);
enum mgpu_state mgpu_ensure(void);    /* attach on first use (and again after fork) */
extern _Atomic int mgpu_state_now;    /* enum mgpu_state */
extern struct mgpu_dev *_Atomic mgpu_fast_dev; /* the only device, when there is exactly one */
struct mgpu_dev *mgpu_dev_by_ordinal(int ordinal); /* NULL: unmanaged or out of range */
struct mgpu_dev *mgpu_dev_by_host_index(unsigned idx);
struct mgpu_dev *mgpu_current_dev(CUresult *err); /* the current context's device */
/* Loads the driver, attaches on first use and returns the device a call
 * accounts on (ordinal < 0: the current context's).  CUDA_SUCCESS with *pd
 * NULL: pass through unaccounted (fail-open). */
CUresult mgpu_resolve_dev(int ordinal, struct mgpu_dev **pd);
uint64_t mgpu_instance_used(struct mgpu_dev *d, int held);
/* Wakes the enforcer's loop (the region's wake word asked for it): one
 * datagram on the instance's wake socket, fetched on first use and again
 * after an enforcer restart.  Never blocks for long; safe under
 * mgpu_acct_mu. */
void mgpu_wake(struct mgpu_dev *d);
extern unsigned mgpu_generation; /* bumped in a forked child; guarded by mgpu_acct_mu */

/* mem.c */
void mgpu_mem_reset_after_fork(void);

/* launch.c */
extern pthread_mutex_t mgpu_acct_mu;
void mgpu_launch_reset_after_fork(void);

#endif /* MGPU_SHIM_H */
