/*
 * fc_state.h - the shared device state of the simulated GPU.
 *
 * One file per host device, FAKECUDA_STATE_DIR/gpu<index>, mapped MAP_SHARED
 * by every process that uses that device (libcuda.so.1, libnvidia-ml.so.1 and
 * fakecuda-ctl).  The file is created fully initialised and published with
 * link(2), so a reader never sees a half-written one.  Its properties (name,
 * memory) are fixed by whoever creates it.
 *
 * Locking: d->mu is a process-shared robust mutex that guards every field
 * below it; it is held only for short bookkeeping.  Kernel execution is a
 * logical ownership (owner_ticket) handed over by the device model (slice,
 * timer or kernel: README.md, "Device models"), so that waiting processes
 * are served fairly; a dead owner is detected through its process entry
 * (see fc_proc.alive).
 */
#ifndef FC_STATE_H
#define FC_STATE_H

#include <pthread.h>
#include <stdint.h>

#define FC_MAX_DEVICES 64
#define FC_MAX_PROCS 1024
#define FC_MAX_WAITERS 256
#define FC_MAGIC 0x41445543454b4146ULL /* "FAKECUDA" */
#define FC_LAYOUT 10
#define FC_TRACE 4096 /* ownership changes kept in fc_dev.trace */
#define FC_KRUNS 32768 /* kernel runs kept in fc_dev.krun (a power of two) */
#define FC_SAMPLES 16 /* utilisation samples kept in fc_dev.samp (NVML) */
#define FC_SAMPLE_MIN_NS 20000000ULL /* NVML takes a new sample at most every 20 ms */
#define FC_NAME_LEN 96

enum { FC_PROC_FREE = 0, FC_PROC_ALIVE = 1, FC_PROC_DEAD = 2 };

/* How the device passes between processes (FAKECUDA_DEVICE_MODEL). */
enum { FC_MODEL_SLICE = 0, FC_MODEL_TIMER = 1, FC_MODEL_KERNEL = 2 };

struct fc_proc {
    /* Robust mutex locked for its whole life by the process's keeper thread:
     * trylock == EBUSY means alive; EOWNERDEAD (or success) means it died. */
    pthread_mutex_t alive;
    int32_t state;
    int32_t pid;    /* getpid() in the process's own pid namespace */
    uint64_t pidns; /* inode of its /proc/self/ns/pid (0: unknown) */
    uint64_t busy_ns;   /* time it held the device (its kernels and the gaps between them in its slice) */
    uint64_t mem_used;
    uint64_t kernels;
    uint64_t kernel_ns; /* time its kernels ran */
    int32_t ctxs;       /* its live contexts on the device (NVML lists it while > 0 or it holds memory) */
    int32_t pad;
    /* Utilisation samples (NVML, see fc_sample_locked): registration (or
     * reset), when busy_ns was 0, as CLOCK_REALTIME us and CLOCK_MONOTONIC
     * ns; the device's sample number then (samples before it predate the
     * process: busy 0); busy_ns at sample k in samp_busy[k % FC_SAMPLES]. */
    uint64_t start_us;
    uint64_t start_ns;
    uint64_t first_samp;
    uint64_t samp_busy[FC_SAMPLES];
};

/* One utilisation sample of a device: when it was taken. */
struct fc_sample {
    uint64_t t_us; /* CLOCK_REALTIME, us since the epoch (NVML's timeStamp); strictly increasing */
    uint64_t t_ns; /* CLOCK_MONOTONIC, ns */
};

/* One change of the process holding the device: from t_ns on, proc held it
 * (-1: nobody).  A stream of the same process taking over is no change. */
struct fc_trace_ent {
    uint64_t t_ns;
    int32_t proc;
    int32_t pad;
};

/* A stretch of device time in which a kernel ran: [end_ns - dur_ns,
 * end_ns) on the device's timeline, by the process of pid (in its own pid
 * namespace).  A kernel preempted in the timer model runs in several; the
 * device's gap before a kernel (FAKECUDA_KERNEL_GAP_US) is not in it. */
struct fc_krun {
    uint64_t end_ns;
    uint32_t dur_ns; /* capped at UINT32_MAX (4.29 s) */
    int32_t pid;
};

struct fc_waiter {
    uint64_t ticket; /* 0: slot free */
    int32_t proc;
    int32_t pad;
};

struct fc_dev {
    uint64_t magic;
    uint32_t layout;
    uint32_t index;
    uint64_t size;
    char name[FC_NAME_LEN];
    uint64_t mem_total;
    uint32_t model;        /* FC_MODEL_*, fixed by the creator */
    uint32_t gap_us;       /* FAKECUDA_KERNEL_GAP_US: device time before each kernel starts (fixed by the creator) */
    pthread_mutex_t mu;
    /* guarded by mu */
    uint64_t mem_used;
    uint64_t busy_ns;   /* time some process held the device */
    uint64_t kernels;
    uint64_t kernel_ns; /* time kernels ran */
    uint64_t next_ticket;
    uint64_t owner_ticket; /* 0: device idle */
    int32_t owner_proc;
    uint32_t nwait;
    uint32_t seq; /* futex word: bumped on every hand-over */
    int32_t slice_proc;    /* process whose time slice runs; -1: none */
    uint64_t slice_end_ns; /* when that slice ends (CLOCK_MONOTONIC) */
    uint64_t slice_ns;     /* FAKECUDA_TIMESLICE_US, in ns (fixed by the creator) */
    uint64_t turn_end_ns;  /* when the holding stream's turn among its process's streams ends */
    uint64_t handed_ns;    /* where grant_next_locked last handed the device on (device time) */
    uint64_t free_ns;      /* when the device was last left with no owner */
    /* CLOCK_MONOTONIC since when the owner's held time is not yet in its
     * busy_ns (the stream worker's mark); 0: none (idle, or granted and the
     * worker not awake yet).  A reader adds now - hold_ns to the owner's
     * busy_ns (fc_busy_now_locked). */
    uint64_t hold_ns;
    /* CLOCK_MONOTONIC when the owner's worker wakes next (the end of its
     * kernel, or of its slice in timer); written without mu (a hint for
     * the waiters' liveness checks, fc_exec_acquire). */
    uint64_t hold_until_ns;
    uint64_t nsamp;     /* utilisation samples taken; sample k is samp[k % FC_SAMPLES] */
    uint64_t samp_from; /* samples before it are void (reset) */
    struct fc_sample samp[FC_SAMPLES];
    uint64_t handoffs; /* the device passed from one process to another */
    uint64_t idles;    /* the device was left with no holder */
    uint64_t ntrace; /* ownership changes recorded; the last FC_TRACE are in trace */
    struct fc_trace_ent trace[FC_TRACE];
    uint64_t nkrun; /* kernel runs recorded; the last FC_KRUNS are in krun */
    struct fc_krun krun[FC_KRUNS];
    struct fc_waiter wq[FC_MAX_WAITERS];
    struct fc_proc procs[FC_MAX_PROCS];
};

/* Configuration from the environment (defaults documented in README.md). */
const char *fc_env_state_dir(void);
int fc_env_devices(void);
uint64_t fc_env_memory_bytes(void);
const char *fc_env_name(void);
/* FAKECUDA_DEVICE_MODEL as FC_MODEL_* (unset or empty: slice); -1 for an
 * unknown value, which *bad then points to. */
int fc_env_model(const char **bad);
/* "slice", "timer", "kernel" ("?" for anything else). */
const char *fc_model_name(uint32_t model);

/* GPU-5a1e0000-0000-4000-8000-<index as 12 hex digits>. */
void fc_uuid_bytes(int index, unsigned char out[16]);
void fc_uuid_string(int index, char *buf, size_t len);

uint64_t fc_now_ns(void);
/* CLOCK_REALTIME in microseconds since the epoch (NVML timestamps). */
uint64_t fc_now_us_real(void);

/* Maps the state of host device index.  create: create the file (from the
 * environment) when missing.  Returns NULL with errno set on failure. */
struct fc_dev *fc_dev_open(int index, int create);
void fc_dev_close(struct fc_dev *d);

void fc_dev_lock(struct fc_dev *d);
void fc_dev_unlock(struct fc_dev *d);

/* With d->mu held: 1 if process entry i is alive; a dead one is reaped. */
int fc_proc_check_locked(struct fc_dev *d, int i);
/* With d->mu held: reaps every dead process entry. */
void fc_reap_locked(struct fc_dev *d);

/* Inode of the calling process's pid namespace (/proc/self/ns/pid), or 0
 * when it cannot be read (no /proc). */
uint64_t fc_self_pidns(void);

/* Registers the calling process; must be called by the thread that stays
 * alive as long as the process (the keeper).  pidns tells processes of
 * different pid namespaces (containers) with the same pid apart.  Returns
 * the entry or -1. */
int fc_proc_register(struct fc_dev *d, int pid, uint64_t pidns);

/* Exclusive kernel execution; who gets the device next is the device
 * model's choice (grant_next_locked in fc_state.c).  at: when the kernel was
 * queued.  *since: when the caller's hold began on the device's timeline
 * (fc_cuda.c): when the device was handed to it, or, if it was idle, when
 * the kernel was queued or the device went idle, whichever is later; not
 * when the calling thread happened to wake. */
uint64_t fc_exec_acquire(struct fc_dev *d, int proc, uint64_t at, uint64_t *since);
/* Records a kernel that ended at end_ns on the device the caller holds:
 * busy_ns is the time held since the last record (what the worker did
 * before the kernel while holding, and the kernel), kernel_ns the kernel's
 * own time (its run, in fc_dev.krun, ends at end_ns). */
void fc_exec_account(struct fc_dev *d, uint64_t ticket, int proc, uint64_t busy_ns, uint64_t kernel_ns,
                     uint64_t end_ns);
/* Releases the device; busy_ns: time held since the last record. */
void fc_exec_release(struct fc_dev *d, uint64_t ticket, int proc, uint64_t busy_ns);
/* Before the next kernel of one stream: records busy_ns as fc_exec_release
 * does and returns 1 if the caller may keep the device for it, otherwise
 * hands the device on and returns 0.  Slice model: keeps it if nobody waits
 * (the slice is renewed), if only its process's other streams wait and its
 * turn among them runs (the slice is renewed too), or if another process
 * waits and its process's slice runs.  Timer model: the same, except that
 * the slice is never renewed, only followed by the next one once it has
 * ended.  Kernel model: keeps it if nobody waits or, while only its own
 * streams wait, in its turn; never while another process waits. */
int fc_exec_continue(struct fc_dev *d, uint64_t ticket, int proc, uint64_t busy_ns);
/* Timer model: when the caller's slice ends (CLOCK_MONOTONIC ns), where its
 * running kernel must call fc_exec_preempt; 0 if it no longer holds the
 * device. */
uint64_t fc_exec_slice_end(struct fc_dev *d, uint64_t ticket);
/* Timer model, at the end of the caller's slice inside a kernel (end_ns):
 * records busy_ns as fc_exec_release does and kernel_ns as the kernel's
 * time so far (a run ending at end_ns, not counted as a kernel); if another process waits, hands the device on
 * (round robin) and returns 0, the kernel then queues again for the rest of
 * its time; otherwise a new slice begins for the caller, *slice_end is its
 * end, and it returns 1. */
int fc_exec_preempt(struct fc_dev *d, uint64_t ticket, int proc, uint64_t busy_ns, uint64_t kernel_ns,
                    uint64_t end_ns, uint64_t *slice_end);

/* Device memory accounting: 0, or -1 when over the device total. */
int fc_mem_reserve(struct fc_dev *d, int proc, uint64_t bytes);
void fc_mem_unreserve(struct fc_dev *d, int proc, uint64_t bytes);

/* Contexts of process entry proc on the device: delta +1 when one is
 * created, -1 when destroyed (NVML lists processes that have one). */
void fc_proc_ctx(struct fc_dev *d, int proc, int delta);

/* With d->mu held: busy_ns of process entry i at now_ns (CLOCK_MONOTONIC),
 * including the device hold in progress. */
uint64_t fc_busy_now_locked(const struct fc_dev *d, int i, uint64_t now_ns);
/* With d->mu held: the newest utilisation sample's number, after taking a
 * new one (every live process's busy time now) unless the newest is under
 * FC_SAMPLE_MIN_NS old. */
uint64_t fc_sample_locked(struct fc_dev *d);
/* With d->mu held: busy_ns of process entry i at sample k (0 for a sample
 * before the process registered); -1 (UINT64_MAX) if sample k is no longer
 * kept or void. */
uint64_t fc_sample_busy_locked(const struct fc_dev *d, int i, uint64_t k);

/* Clears busy counters and forgets exited processes. */
void fc_dev_reset(struct fc_dev *d);

#endif
