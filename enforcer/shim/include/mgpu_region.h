/*
 * mgpu_region.h - the per-instance shared region and the attach protocol.
 *
 * This header is the single source of truth for the binary layout shared by
 * the enforcer (Go, enforcer/region mirrors it and a test checks every size
 * and offset against this file) and the shim (C, enforcer/shim).
 *
 * One region exists per instance (mgpuXinstY).  The enforcer creates it as a
 * file under /run/mgpu/gpuX/regions/ and maps it; every process of the
 * instance that uses CUDA receives it as a file descriptor over the client
 * socket and maps it MAP_SHARED.
 *
 * Concurrency rules (a client may be SIGKILLed at any instruction):
 *  - No locks live in the region.  Every shared word is a naturally aligned
 *    32- or 64-bit value accessed with C11 atomics (Go: sync/atomic).
 *  - Each attached process owns exactly one slot (procs[slot]); the enforcer
 *    picks the slot, writes pid/start_time, and the shim writes only its own
 *    slot's counters.  Instance totals are sums over slots, so a process that
 *    dies leaves nothing half-updated: the enforcer reaps its slot whole.
 *  - Memory reservation (shim): add n to the own slot's mem_reserved, then sum
 *    mem_reserved over all slots; if the sum exceeds memory_limit, subtract n
 *    again and fail.  With sequentially consistent atomics the instance total
 *    can never exceed the limit (two racing reservations may both fail, never
 *    both pass over the limit).
 *  - grant is a futex word (shared, not private futex ops).  0 means "do not
 *    submit GPU work now"; any other value means "granted".  The enforcer
 *    wakes all waiters (FUTEX_WAKE, INT_MAX) whenever it sets a grant.
 */
#ifndef MGPU_REGION_H
#define MGPU_REGION_H

#include <stdint.h>

#ifdef __cplusplus
#define MGPU_ATOMIC(t) t
#else
#include <stdatomic.h>
#define MGPU_ATOMIC(t) _Atomic t
#endif

#define MGPU_REGION_MAGIC 0x5550474du /* "MGPU" as little-endian bytes */
#define MGPU_REGION_VERSION 1u
#define MGPU_REGION_MAX_PROCS 128u
#define MGPU_REGION_FILE_SIZE 12288u /* bytes; >= sizeof(mgpu_region_t), page multiple */

/* compute policies (the seed's compute_policy values) */
#define MGPU_POLICY_FIXED_SHARE 0u
#define MGPU_POLICY_GUARANTEED_BURST_SHARE 1u
#define MGPU_POLICY_NATIVE_BURST_SHARE 2u

/* One attached process.  64 bytes. */
typedef struct mgpu_proc {
    MGPU_ATOMIC(uint32_t) pid;          /* enforcer: host pid owning the slot; 0 = free */
    MGPU_ATOMIC(uint32_t) waiting;      /* shim: threads of this process blocked on the grant */
    MGPU_ATOMIC(uint64_t) mem_reserved; /* shim: device bytes this process holds */
    MGPU_ATOMIC(uint64_t) gpu_ns;       /* shim: cumulative measured GPU time of its work */
    MGPU_ATOMIC(uint64_t) queued_ns;    /* shim: estimated GPU time submitted, not yet known complete */
    MGPU_ATOMIC(uint64_t) launches;     /* shim: cumulative gated launches */
    MGPU_ATOMIC(uint64_t) throttled_ns; /* shim: cumulative time threads waited for a grant */
    uint64_t start_time;                /* enforcer: /proc/<pid>/stat starttime (clock ticks), tells pid reuse */
    uint64_t reserved;
} mgpu_proc_t;

/* The region.  Header 256 bytes, then the process slots. */
typedef struct mgpu_region {
    /* Identity and quotas: written by the enforcer before the region is handed
     * out, never changed afterwards; read-only to the shim. */
    uint32_t magic;         /* MGPU_REGION_MAGIC */
    uint32_t version;       /* MGPU_REGION_VERSION */
    uint32_t size;          /* file size in bytes (MGPU_REGION_FILE_SIZE) */
    uint32_t max_procs;     /* MGPU_REGION_MAX_PROCS */
    uint32_t device_index;  /* X in mgpuXinstY (NVML index) */
    uint32_t instance_id;   /* Y in mgpuXinstY */
    uint32_t policy;        /* MGPU_POLICY_* */
    uint32_t core;          /* compute quota or weight, 1..100 */
    uint64_t memory_limit;  /* device-memory quota in bytes */
    uint64_t period_ns;     /* arbitration period (compute_timeslice) */
    uint64_t max_queued_ns; /* bound on queued GPU work per process; see enforcer/shim/README.md */
    uint64_t reserved_hdr;

    /* Control: written by the enforcer. */
    MGPU_ATOMIC(uint32_t) grant;          /* futex word: 0 = wait, otherwise granted */
    MGPU_ATOMIC(uint32_t) enforcer_epoch; /* bumped by every enforcer start that adopts the region */
    MGPU_ATOMIC(uint64_t) heartbeat_ns;   /* CLOCK_MONOTONIC of the enforcer's last arbitration tick */
    /* 1 while another instance of the device may have work on the GPU (it
     * holds the grant, or its queue was not yet reported drained), so this
     * instance's event timings may include that work: the shim then charges
     * a batch no more than its launches' estimate from clean batches.
     * Written before grant at every tick; 0 on a device used by one
     * instance (see enforcer/shim/README.md "Interleaved work"). */
    MGPU_ATOMIC(uint32_t) contended;
    uint32_t reserved_ctl32;
    uint64_t reserved_ctl[5];

    uint64_t reserved_tail[16];

    mgpu_proc_t procs[MGPU_REGION_MAX_PROCS];
} mgpu_region_t;

/*
 * Attach protocol on /run/mgpu/gpuX/client/client.sock (SOCK_STREAM).
 *
 * The client sends one mgpu_attach_req_t and reads one mgpu_attach_resp_t.
 * When status is MGPU_ATTACH_OK the response carries exactly one file
 * descriptor (SCM_RIGHTS): the region, to be mapped MAP_SHARED with
 * region_size bytes; procs[slot] is the caller's own slot.  Otherwise message
 * holds one NUL-terminated line for the user (the shim prints it).  The
 * server identifies the caller by SO_PEERCRED, never by anything it sends.
 * The server closes the connection after the response.
 */
#define MGPU_ATTACH_MAGIC 0x4150474du /* "MGPA" as little-endian bytes */
#define MGPU_ATTACH_VERSION 1u

#define MGPU_ATTACH_OK 0
#define MGPU_ATTACH_NO_INSTANCE 1 /* caller belongs to no instance of this device */
#define MGPU_ATTACH_NO_SLOT 2     /* the instance has MGPU_REGION_MAX_PROCS processes attached */
#define MGPU_ATTACH_BAD_REQUEST 3 /* wrong magic, version or size */
#define MGPU_ATTACH_INTERNAL 4    /* enforcer-side failure; message says what */

typedef struct mgpu_attach_req {
    uint32_t magic;   /* MGPU_ATTACH_MAGIC */
    uint32_t version; /* MGPU_ATTACH_VERSION */
    uint32_t flags;   /* must be 0 */
    uint32_t reserved;
} mgpu_attach_req_t;

#define MGPU_ATTACH_MESSAGE_LEN 224u

typedef struct mgpu_attach_resp {
    uint32_t magic;        /* MGPU_ATTACH_MAGIC */
    uint32_t version;      /* MGPU_ATTACH_VERSION */
    int32_t status;        /* MGPU_ATTACH_* */
    uint32_t slot;         /* index into procs[] */
    uint32_t region_size;  /* bytes to map */
    uint32_t device_index; /* X */
    uint32_t instance_id;  /* Y */
    uint32_t reserved;
    char message[MGPU_ATTACH_MESSAGE_LEN];
} mgpu_attach_resp_t;

#ifndef __cplusplus
_Static_assert(sizeof(mgpu_proc_t) == 64, "mgpu_proc_t is 64 bytes");
_Static_assert(sizeof(mgpu_region_t) == 256 + 64 * MGPU_REGION_MAX_PROCS, "region layout");
_Static_assert(sizeof(mgpu_region_t) <= MGPU_REGION_FILE_SIZE, "region fits its file");
_Static_assert(sizeof(mgpu_attach_req_t) == 16, "attach request is 16 bytes");
_Static_assert(sizeof(mgpu_attach_resp_t) == 256, "attach response is 256 bytes");
#endif

#endif /* MGPU_REGION_H */
