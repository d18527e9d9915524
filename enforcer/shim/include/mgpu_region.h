/*
 * mgpu_region.h - the per-instance shared region and the attach protocol.
 *
 * This header is the single source of truth for the binary layout shared by
 * the enforcer (Go, enforcer/region mirrors it and a test checks every size
 * and offset against this file) and the shim (C, enforcer/shim).
 *
 * One region exists per instance (mgpuXinstY), all created by the enforcer
 * (version 4; version 3 had no used bitmap, version 2 kept the slots as
 * files beside the control file, version 1 was one writable file):
 *
 *   control   mgpu_control_t, the file /run/mgpu/gpuX/regions/mgpuXinstY/
 *             control: identity, quotas, grant, heartbeat, and the owner
 *             (pid, start time) and memfd identity of every process slot.
 *             Written by the enforcer only; every process receives it
 *             READ-ONLY.
 *   slots     mgpu_proc_t, one memfd per slot (MGPU_REGION_MAX_PROCS, named
 *             "mgpu-proc.NNN", made when a process first attaches to the
 *             slot): the counters of the process in slot NNN.  Sealed
 *             (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) at
 *             MGPU_PROC_FILE_SIZE bytes, so no holder can shrink it (the
 *             others' mappings would fault) or grow it (host memory), and in
 *             no file system.  The process in that slot receives its own
 *             read-write; it may ask for the other attached processes',
 *             read-only (to sum the instance's memory reservations).
 *
 * Tenants are untrusted.  The control file's descriptor comes from a
 * read-only (detached) mount of the regions directory, so that neither
 * mmap(PROT_WRITE), mprotect, nor reopening /proc/self/fd/N for writing can
 * turn it into a writable one (EACCES / EROFS).  A read-only slot descriptor
 * cannot be mapped or mprotect-ed writable either, but a memfd is in no
 * mount that could be read-only: a root process may reopen its instance's
 * other slots for writing (docs/tenants.md).  What a process writes into a
 * slot is input to the enforcer, range- and rate-checked there, never
 * trusted.
 *
 * Concurrency rules (a client may be SIGKILLed at any instruction):
 *  - No locks live in the region.  Every shared word is a naturally aligned
 *    32- or 64-bit value accessed with C11 atomics (Go: sync/atomic).
 *  - Each attached process owns exactly one slot; the enforcer picks it,
 *    writes its owner (control->slots[slot]) and clears its counters;
 *    the shim writes only its own slot.  Instance totals are sums over
 *    slots, so a process that dies leaves nothing half-updated: the enforcer
 *    reaps its slot whole.
 *  - The enforcer keeps control->used, a bitmap of the taken slots: a slot's
 *    bit is set after its owner is written and before the process gets its
 *    answer, and cleared after its counters were zeroed.  A process reads
 *    the bitmap instead of every slot's pid.
 *  - Memory reservation (shim): add n to the own slot's mem_reserved, then sum
 *    mem_reserved over the slots of control->used; if the sum exceeds
 *    memory_limit, subtract n again and fail.  With sequentially consistent
 *    atomics the instance total can never exceed the limit (two racing
 *    reservations may both fail, never both pass over the limit): a process
 *    reserves only after its attach was answered, so after its bit was set.
 *    An allocation smaller than the chunk (min(4 MiB, memory_limit / 256))
 *    reserves one chunk more this way, kept in mem_ahead; allocations take
 *    from mem_ahead first, frees give back to it, and what exceeds two
 *    chunks is given back to the instance.  An allocation that fits in
 *    mem_ahead reads no other slot; one that needs more uses the process's
 *    own mem_ahead and reserves the rest (the chunk only if the instance
 *    has room for it).  So an allocation may be refused while other
 *    processes of the instance hold up to two chunks each ahead; the
 *    instance total still never exceeds the limit.
 *  - grant is a futex word (shared, not private futex ops).  0 means "do not
 *    submit GPU work now"; any other value means "granted" (MGPU_GRANT_ONE
 *    with one launch outstanding per stream at most).  The enforcer wakes
 *    all waiters (FUTEX_WAKE, INT_MAX) whenever it sets a grant.
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
#define MGPU_REGION_VERSION 4u
#define MGPU_REGION_MAX_PROCS 128u
#define MGPU_CONTROL_FILE_SIZE 8192u /* bytes; >= sizeof(mgpu_control_t), page multiple */
#define MGPU_PROC_FILE_SIZE 4096u    /* bytes of each slot's memfd; one page */

/* compute policies (the seed's compute_policy values) */
#define MGPU_POLICY_FIXED_SHARE 0u
#define MGPU_POLICY_GUARANTEED_BURST_SHARE 1u
#define MGPU_POLICY_NATIVE_BURST_SHARE 2u

/* mgpu_control_t.grant values other than 0 (wait) */
#define MGPU_GRANT_ALL 1u /* granted */
#define MGPU_GRANT_ONE 2u /* granted, at most one launch outstanding per stream */

/* mgpu_control_t.wake bits */
#define MGPU_WAKE_BUSY 1u
#define MGPU_WAKE_IDLE 2u

/* The owner of one process slot and its memfd (in the control file).  32
 * bytes. */
typedef struct mgpu_slot {
    MGPU_ATOMIC(uint32_t) pid;        /* host pid owning the slot; 0 = free */
    uint32_t reserved;
    MGPU_ATOMIC(uint64_t) start_time; /* /proc/<pid>/stat starttime (clock ticks), tells pid reuse; written before pid */
    /* st_dev and st_ino of the slot's memfd: a restarted enforcer finds the
     * memfd again in the mappings of the instance's processes by them.  The
     * shim does not read them. */
    MGPU_ATOMIC(uint64_t) proc_dev;
    MGPU_ATOMIC(uint64_t) proc_ino;
} mgpu_slot_t;

/* The counters of one attached process (its slot's memfd).  64 bytes.
 * Written by that process only; the enforcer treats every value as
 * untrusted input. */
typedef struct mgpu_proc {
    MGPU_ATOMIC(uint32_t) waiting;      /* threads of this process blocked on the grant */
    uint32_t reserved32;
    MGPU_ATOMIC(uint64_t) mem_reserved; /* device bytes this process holds */
    MGPU_ATOMIC(uint64_t) gpu_ns;       /* cumulative measured GPU time of its work */
    MGPU_ATOMIC(uint64_t) queued_ns;    /* estimated GPU time submitted, not yet known complete */
    MGPU_ATOMIC(uint64_t) launches;     /* cumulative gated launches */
    MGPU_ATOMIC(uint64_t) throttled_ns; /* cumulative time threads waited for a grant */
    /* CLOCK_MONOTONIC when queued_ns last fell to 0 (0: never); read by the
     * enforcer only while queued_ns is 0 (the fill grace of offline
     * instances, see wake below) */
    MGPU_ATOMIC(uint64_t) idle_ns;
    /* Of mem_reserved, the bytes reserved ahead of the process's
     * allocations (the reservation protocol below): its allocations hold
     * mem_reserved - mem_ahead.  0 from shims before it. */
    MGPU_ATOMIC(uint64_t) mem_ahead;
} mgpu_proc_t;

/* The control file.  Header 256 bytes, then the slot owners. */
typedef struct mgpu_control {
    /* Identity and quotas: written by the enforcer before the region is handed
     * out, never changed afterwards. */
    uint32_t magic;         /* MGPU_REGION_MAGIC */
    uint32_t version;       /* MGPU_REGION_VERSION */
    uint32_t size;          /* control file size in bytes (MGPU_CONTROL_FILE_SIZE) */
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
    /* futex word: 0 = wait, otherwise granted; MGPU_GRANT_ONE: keep at most
     * one launch outstanding per stream (an offline instance filling the
     * device beside an idle online one, which may get work at any moment:
     * what it then finds ahead of its first kernel is one kernel) */
    MGPU_ATOMIC(uint32_t) grant;
    MGPU_ATOMIC(uint32_t) enforcer_epoch; /* bumped by every enforcer start that adopts the region */
    MGPU_ATOMIC(uint64_t) heartbeat_ns;   /* CLOCK_MONOTONIC of the enforcer's last arbitration tick */
    /* 1 while another instance of the device may have work on the GPU (it
     * holds the grant, or its queue was not yet reported drained), so this
     * instance's event timings may include that work: the shim then charges
     * a batch no more than its launches' estimate from clean batches.
     * Written before grant at every tick; 0 on a device used by one
     * instance (see enforcer/shim/README.md "Interleaved work"). */
    MGPU_ATOMIC(uint32_t) contended;
    /* When the enforcer wants this instance's processes to wake it at once
     * (a write to the instance's wake socket, MGPU_ATTACH_FLAG_WAKE) rather
     * than wait for its next tick: MGPU_WAKE_BUSY when queued_ns rises
     * from 0 or a thread starts waiting for the grant (this instance does
     * not hold it: its demand is new, or an offline instance fills the
     * device and must stop), MGPU_WAKE_IDLE when queued_ns falls to 0
     * (an offline instance waits for this one to be quiet, or it holds
     * contested: docs/arbiter.md step 9).  0: no wake wanted. */
    MGPU_ATOMIC(uint32_t) wake;
    /* The taken slots, bit i%64 of used[i/64] for slot i (see the
     * concurrency rules above): what a process sums its instance's memory
     * reservations over, without reading every slot's pid. */
    MGPU_ATOMIC(uint64_t) used[MGPU_REGION_MAX_PROCS / 64];
    uint64_t reserved_ctl[3];

    uint64_t reserved_tail[16];

    mgpu_slot_t slots[MGPU_REGION_MAX_PROCS];
} mgpu_control_t;

/*
 * Attach protocol on /run/mgpu/gpuX/client/client.sock (SOCK_STREAM).
 *
 * The client sends one mgpu_attach_req_t and reads one mgpu_attach_resp_t.
 * Two requests, by flags:
 *   0                        attach.  An OK response carries two file
 *                            descriptors (SCM_RIGHTS, with the first byte of
 *                            the response): [0] the control file, read-only
 *                            (map PROT_READ, control_size bytes), [1] the
 *                            caller's own slot memfd, read-write (proc_size
 *                            bytes).  slot is the caller's own slot.
 *   MGPU_ATTACH_FLAG_PEERS   the other attached processes' slot memfds,
 *                            read-only (the caller must be attached).  An
 *                            OK response has peers[] set to the slots whose
 *                            descriptors follow, one each, in ascending slot
 *                            order.  A slot's memfd stays that slot's while
 *                            any process maps it (an enforcer restart finds
 *                            it again), so a mapping of it never goes stale:
 *                            the shim asks once for slots it sees taken
 *                            (control->slots[i].pid) and has not mapped.
 *   MGPU_ATTACH_FLAG_WAKE    the caller's instance's wake socket (the caller
 *                            must be attached): one descriptor, the sending
 *                            end of a SOCK_DGRAM socket pair whose other end
 *                            only the enforcer holds.  A datagram sent on it
 *                            (MSG_DONTWAIT | MSG_NOSIGNAL; content ignored)
 *                            wakes the enforcer's loop, which then ticks at
 *                            once (no sooner than a minimum interval after
 *                            its previous tick).  An enforcer restart makes
 *                            a new pair: the shim asks again when
 *                            enforcer_epoch changes.
 * Otherwise no descriptor comes and message holds one NUL-terminated line
 * for the user (the shim prints it).  The server identifies the caller by
 * the kernel: the pidfd of the process that connected (SO_PEERPIDFD, Linux
 * >= 6.5).  On older kernels the client sends a pidfd of itself
 * (pidfd_open(getpid())) as SCM_RIGHTS with the request and its own
 * descriptor of the connection in sock_fd; the server takes the pidfd only
 * when its pid and uid are those SO_PEERCRED recorded at connect and the
 * process holds the connection at sock_fd (pidfd_getfd; the server shuts
 * that end's writing down, which the client no longer needs, and sees the
 * end of its own read).  A pid number is never looked up after the fact.  A newer server
 * closes the descriptor unread.  The request must arrive within 500 ms of
 * the server taking up the connection, and each instance (or caller of no
 * instance, by pid namespace or cgroup) has its own budget of connections
 * served and waiting: beyond it a connection is answered at once with a
 * refusal.  The server closes the connection after the response.
 *
 * Versions: a request of another version that carries the right magic is
 * answered in that version's response layout (magic, version, status and
 * message sit at the same offsets in every version) with
 * MGPU_ATTACH_BAD_REQUEST and a message naming both versions, so an older
 * shim prints why it was refused instead of failing on a layout it does not
 * know.
 */
#define MGPU_ATTACH_MAGIC 0x4150474du /* "MGPA" as little-endian bytes */
#define MGPU_ATTACH_VERSION 2u
#define MGPU_ATTACH_FDS 2u           /* descriptors of an OK attach */
#define MGPU_ATTACH_FLAG_PEERS 1u    /* request: the other processes' proc files */
#define MGPU_ATTACH_FLAG_WAKE 2u     /* request: the instance's wake socket */

#define MGPU_ATTACH_OK 0
#define MGPU_ATTACH_NO_INSTANCE 1 /* caller belongs to no instance of this device */
#define MGPU_ATTACH_NO_SLOT 2     /* the instance has MGPU_REGION_MAX_PROCS processes attached */
#define MGPU_ATTACH_BAD_REQUEST 3 /* wrong magic, version or size */
#define MGPU_ATTACH_INTERNAL 4    /* enforcer-side failure; message says what */

typedef struct mgpu_attach_req {
    uint32_t magic;   /* MGPU_ATTACH_MAGIC */
    uint32_t version; /* MGPU_ATTACH_VERSION */
    uint32_t flags;   /* 0 (attach), MGPU_ATTACH_FLAG_PEERS or MGPU_ATTACH_FLAG_WAKE */
    uint32_t sock_fd; /* the client's own descriptor of this connection plus one (0: not sent); Linux < 6.5 */
} mgpu_attach_req_t;

#define MGPU_ATTACH_MESSAGE_LEN 224u

typedef struct mgpu_attach_resp {
    uint32_t magic;        /* MGPU_ATTACH_MAGIC */
    uint32_t version;      /* MGPU_ATTACH_VERSION */
    int32_t status;        /* MGPU_ATTACH_* */
    uint32_t slot;         /* the caller's slot: control->slots[slot], its own proc file */
    uint32_t control_size; /* bytes of the control file to map */
    uint32_t device_index; /* X */
    uint32_t instance_id;  /* Y */
    uint32_t proc_size;    /* bytes of each proc file to map */
    union {
        char message[MGPU_ATTACH_MESSAGE_LEN]; /* status != OK */
        uint64_t peers[MGPU_REGION_MAX_PROCS / 64]; /* OK answer to FLAG_PEERS: bitmap of the slots sent */
    };
} mgpu_attach_resp_t;

#ifndef __cplusplus
_Static_assert(sizeof(mgpu_proc_t) == 64, "mgpu_proc_t is 64 bytes");
_Static_assert(sizeof(mgpu_proc_t) <= MGPU_PROC_FILE_SIZE, "counters fit their memfd");
_Static_assert(sizeof(mgpu_slot_t) == 32, "mgpu_slot_t is 32 bytes");
_Static_assert(sizeof(mgpu_control_t) == 256 + 32 * MGPU_REGION_MAX_PROCS, "control layout");
_Static_assert(sizeof(mgpu_control_t) <= MGPU_CONTROL_FILE_SIZE, "control fits its file");
_Static_assert(sizeof(mgpu_attach_req_t) == 16, "attach request is 16 bytes");
_Static_assert(sizeof(mgpu_attach_resp_t) == 256, "attach response is 256 bytes");
#endif

#endif /* MGPU_REGION_H */
