/* fc_state.c - shared device state of the simulated GPU (see fc_state.h). */
#define _GNU_SOURCE
#include "fc_state.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* A waiter re-checks the owner's liveness this long after the owner's
 * worker should have woken (fc_dev.hold_until_ns), and at least this
 * often: a process that dies holding the device (SIGKILL inside a kernel)
 * hands it on about when its kernel would have ended, as a real driver
 * tears a dead process's context down at once. */
#define FC_LIVENESS_SLACK_NS 1000000ULL
#define FC_LIVENESS_POLL_NS 10000000ULL

const char *fc_env_state_dir(void)
{
    const char *s = getenv("FAKECUDA_STATE_DIR");
    return (s && *s) ? s : "/dev/shm/fakecuda";
}

static long env_long(const char *name, long def, long min, long max)
{
    const char *s = getenv(name);
    if (!s || !*s)
        return def;
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < min || v > max) {
        fprintf(stderr, "fakecuda: ignoring invalid %s=%s\n", name, s);
        return def;
    }
    return v;
}

int fc_env_devices(void)
{
    return (int)env_long("FAKECUDA_DEVICES", 1, 0, FC_MAX_DEVICES);
}

uint64_t fc_env_memory_bytes(void)
{
    return (uint64_t)env_long("FAKECUDA_MEMORY_MIB", 81920, 1, 1L << 30) << 20;
}

const char *fc_env_name(void)
{
    const char *s = getenv("FAKECUDA_NAME");
    return (s && *s) ? s : "Simulated-GPU-80GB";
}

static const char *const model_names[] = {"slice", "timer", "kernel"};

int fc_env_model(const char **bad)
{
    const char *s = getenv("FAKECUDA_DEVICE_MODEL");
    if (!s || !*s)
        return FC_MODEL_SLICE;
    for (int m = 0; m < (int)(sizeof(model_names) / sizeof(model_names[0])); m++)
        if (strcmp(s, model_names[m]) == 0)
            return m;
    if (bad)
        *bad = s;
    return -1;
}

const char *fc_model_name(uint32_t model)
{
    return model < sizeof(model_names) / sizeof(model_names[0]) ? model_names[model] : "?";
}

void fc_uuid_bytes(int index, unsigned char out[16])
{
    static const unsigned char prefix[10] = {0x5a, 0x1e, 0, 0, 0, 0, 0x40, 0, 0x80, 0};
    memcpy(out, prefix, sizeof(prefix));
    uint64_t v = (uint64_t)(unsigned)index;
    for (int i = 15; i >= 10; i--) {
        out[i] = (unsigned char)(v & 0xff);
        v >>= 8;
    }
}

void fc_uuid_string(int index, char *buf, size_t len)
{
    snprintf(buf, len, "GPU-5a1e0000-0000-4000-8000-%012x", (unsigned)index);
}

uint64_t fc_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

uint64_t fc_now_us_real(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000ULL + (uint64_t)ts.tv_nsec / 1000;
}

static int robust_init(pthread_mutex_t *m)
{
    pthread_mutexattr_t a;
    int r = pthread_mutexattr_init(&a);
    if (!r)
        r = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    if (!r)
        r = pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    if (!r)
        r = pthread_mutex_init(m, &a);
    pthread_mutexattr_destroy(&a);
    return r;
}

static int mkdir_p(const char *path)
{
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof(buf), "%s", path) >= (int)sizeof(buf)) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = 0;
        if (mkdir(buf, 0777) && errno != EEXIST)
            return -1;
        *p = '/';
    }
    if (mkdir(buf, 0777) && errno != EEXIST)
        return -1;
    return 0;
}

static struct fc_dev *map_fd(int fd)
{
    struct stat st;
    if (fstat(fd, &st))
        return NULL;
    if ((size_t)st.st_size != sizeof(struct fc_dev)) {
        errno = EPROTO;
        return NULL;
    }
    void *p = mmap(NULL, sizeof(struct fc_dev), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return NULL;
    struct fc_dev *d = p;
    if (d->magic != FC_MAGIC || d->layout != FC_LAYOUT || d->size != sizeof(struct fc_dev)) {
        munmap(p, sizeof(struct fc_dev));
        errno = EPROTO;
        return NULL;
    }
    return d;
}

/* Creates a fully initialised file under a private name, then publishes it
 * with link(2); losing the race to another creator is fine. */
static int create_file(const char *dir, const char *path, int index)
{
    int model = fc_env_model(NULL);
    if (model < 0) {
        errno = EINVAL; /* unknown FAKECUDA_DEVICE_MODEL; cuInit and nvmlInit say so */
        return -1;
    }
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof(tmp), "%s/.gpu%d.%d.tmp", dir, index, (int)getpid()) >= (int)sizeof(tmp)) {
        errno = ENAMETOOLONG;
        return -1;
    }
    int fd = open(tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0)
        return -1;
    int rc = -1;
    if (fchmod(fd, 0666) || ftruncate(fd, (off_t)sizeof(struct fc_dev)))
        goto out;
    struct fc_dev *d = mmap(NULL, sizeof(*d), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (d == MAP_FAILED)
        goto out;
    d->layout = FC_LAYOUT;
    d->slice_proc = -1;
    d->model = (uint32_t)model;
    /* The timer model preempts at every slice end: a slice shorter than
     * 100 us would be mostly hand-overs. */
    if (model == FC_MODEL_TIMER)
        d->slice_ns = (uint64_t)env_long("FAKECUDA_TIMESLICE_US", 2000, 100, 1000000) * 1000;
    else
        d->slice_ns = (uint64_t)env_long("FAKECUDA_TIMESLICE_US", 4000, 0, 1000000) * 1000;
    /* A real device spends time between two kernels (launch latency, the
     * work distributor): a process alone does not keep it 100 % busy. */
    d->gap_us = (uint32_t)env_long("FAKECUDA_KERNEL_GAP_US", 0, 0, 100000);
    d->index = (uint32_t)index;
    d->size = sizeof(*d);
    snprintf(d->name, sizeof(d->name), "%s", fc_env_name());
    d->mem_total = fc_env_memory_bytes();
    d->owner_proc = -1;
    int bad = robust_init(&d->mu);
    for (int i = 0; i < FC_MAX_PROCS && !bad; i++)
        bad = robust_init(&d->procs[i].alive);
    __atomic_store_n(&d->magic, FC_MAGIC, __ATOMIC_RELEASE);
    munmap(d, sizeof(*d));
    if (bad) {
        errno = bad;
        goto out;
    }
    if (link(tmp, path) && errno != EEXIST)
        goto out;
    rc = 0;
out:
    close(fd);
    unlink(tmp);
    return rc;
}

struct fc_dev *fc_dev_open(int index, int create)
{
    const char *dir = fc_env_state_dir();
    char path[PATH_MAX];
    if (snprintf(path, sizeof(path), "%s/gpu%d", dir, index) >= (int)sizeof(path)) {
        errno = ENAMETOOLONG;
        return NULL;
    }
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT && create) {
        if (mkdir_p(dir) || create_file(dir, path, index))
            return NULL;
        fd = open(path, O_RDWR | O_CLOEXEC);
    }
    if (fd < 0)
        return NULL;
    struct fc_dev *d = map_fd(fd);
    int e = errno;
    close(fd);
    errno = e;
    return d;
}

void fc_dev_close(struct fc_dev *d)
{
    if (d)
        munmap(d, sizeof(*d));
}

static long futex(uint32_t *addr, int op, uint32_t val, const struct timespec *ts)
{
    return syscall(SYS_futex, addr, op, val, ts, NULL, 0);
}

static void grant_next_locked(struct fc_dev *d);

/* Repairs the bookkeeping after a process died inside d->mu. */
static void repair_locked(struct fc_dev *d)
{
    uint32_t n = 0;
    for (int i = 0; i < FC_MAX_WAITERS; i++)
        if (d->wq[i].ticket)
            n++;
    d->nwait = n;
    fc_reap_locked(d);
    uint64_t used = 0;
    for (int i = 0; i < FC_MAX_PROCS; i++)
        if (d->procs[i].state == FC_PROC_ALIVE)
            used += d->procs[i].mem_used;
    d->mem_used = used;
}

void fc_dev_lock(struct fc_dev *d)
{
    int r = pthread_mutex_lock(&d->mu);
    if (r == EOWNERDEAD) {
        pthread_mutex_consistent(&d->mu);
        repair_locked(d);
    } else if (r) {
        fprintf(stderr, "fakecuda: device %u state lock: %s\n", d->index, strerror(r));
        abort();
    }
}

void fc_dev_unlock(struct fc_dev *d)
{
    pthread_mutex_unlock(&d->mu);
}

static void reap_one_locked(struct fc_dev *d, int i)
{
    struct fc_proc *p = &d->procs[i];
    d->mem_used = d->mem_used >= p->mem_used ? d->mem_used - p->mem_used : 0;
    p->mem_used = 0;
    p->state = FC_PROC_DEAD;
    for (int w = 0; w < FC_MAX_WAITERS; w++) {
        if (d->wq[w].ticket && d->wq[w].proc == i) {
            d->wq[w].ticket = 0;
            d->nwait--;
        }
    }
    if (d->owner_ticket && d->owner_proc == i)
        grant_next_locked(d);
}

int fc_proc_check_locked(struct fc_dev *d, int i)
{
    if (i < 0 || i >= FC_MAX_PROCS || d->procs[i].state != FC_PROC_ALIVE)
        return 0;
    pthread_mutex_t *m = &d->procs[i].alive;
    int r = pthread_mutex_trylock(m);
    if (r == EBUSY)
        return 1;
    if (r == EOWNERDEAD)
        pthread_mutex_consistent(m);
    if (r == 0 || r == EOWNERDEAD)
        pthread_mutex_unlock(m);
    else
        robust_init(m); /* ENOTRECOVERABLE: start over */
    reap_one_locked(d, i);
    return 0;
}

void fc_reap_locked(struct fc_dev *d)
{
    for (int i = 0; i < FC_MAX_PROCS; i++)
        if (d->procs[i].state == FC_PROC_ALIVE)
            fc_proc_check_locked(d, i);
}

uint64_t fc_self_pidns(void)
{
    struct stat st;
    if (stat("/proc/self/ns/pid", &st))
        return 0;
    return (uint64_t)st.st_ino;
}

int fc_proc_register(struct fc_dev *d, int pid, uint64_t pidns)
{
    fc_dev_lock(d);
    fc_reap_locked(d);
    int slot = -1;
    for (int i = 0; i < FC_MAX_PROCS && slot < 0; i++)
        if (d->procs[i].state == FC_PROC_FREE)
            slot = i;
    /* Table full: forget the exited process that did least. */
    for (int i = 0; i < FC_MAX_PROCS && slot < 0; i++)
        if (d->procs[i].state == FC_PROC_DEAD)
            slot = i;
    for (int i = slot + 1; slot >= 0 && i < FC_MAX_PROCS; i++)
        if (d->procs[i].state == FC_PROC_DEAD && d->procs[slot].state == FC_PROC_DEAD &&
            d->procs[i].busy_ns < d->procs[slot].busy_ns)
            slot = i;
    if (slot >= 0) {
        struct fc_proc *p = &d->procs[slot];
        int r = pthread_mutex_trylock(&p->alive);
        if (r == EOWNERDEAD) {
            pthread_mutex_consistent(&p->alive);
            r = 0;
        }
        if (r) {
            robust_init(&p->alive);
            r = pthread_mutex_trylock(&p->alive);
        }
        if (r) {
            slot = -1;
        } else {
            p->state = FC_PROC_ALIVE;
            p->pid = pid;
            p->pidns = pidns;
            p->busy_ns = 0;
            p->kernel_ns = 0;
            p->mem_used = 0;
            p->kernels = 0;
            p->ctxs = 0;
            p->start_us = fc_now_us_real();
            p->start_ns = fc_now_ns();
            p->first_samp = d->nsamp;
        }
    }
    fc_dev_unlock(d);
    return slot;
}

/* Whether a process other than proc waits for the device. */
static int others_wait_locked(const struct fc_dev *d, int proc)
{
    if (d->nwait == 0)
        return 0;
    for (int w = 0; w < FC_MAX_WAITERS; w++)
        if (d->wq[w].ticket && d->wq[w].proc != proc)
            return 1;
    return 0;
}

/* With d->mu held: records that proc (-1: nobody) holds the device from now
 * on, if that is a change of process. */
static void trace_locked(struct fc_dev *d, int proc, uint64_t now)
{
    int prev = d->ntrace ? d->trace[(d->ntrace - 1) % FC_TRACE].proc : -1;
    if (d->ntrace && prev == proc)
        return;
    if (proc < 0)
        d->idles++;
    else if (prev >= 0)
        d->handoffs++;
    struct fc_trace_ent *e = &d->trace[d->ntrace % FC_TRACE];
    e->t_ns = now;
    e->proc = proc;
    d->ntrace++;
}

/* The oldest waiter of proc (or, for proc < 0, of any process; other: of any
 * process but proc), or -1. */
static int oldest_locked(const struct fc_dev *d, int proc, int other)
{
    int best = -1;
    for (int w = 0; w < FC_MAX_WAITERS; w++)
        if (d->wq[w].ticket && (proc < 0 || (other ? d->wq[w].proc != proc : d->wq[w].proc == proc)) &&
            (best < 0 || d->wq[w].ticket < d->wq[best].ticket))
            best = w;
    return best;
}

/* Slice model: the waiter to serve next.  in_slice: the slice of
 * d->slice_proc runs. */
static int pick_slice_locked(const struct fc_dev *d, int in_slice)
{
    int best = -1;
    /* While a process's time slice runs, its own waiters go first (a
     * real GPU switches contexts at slice boundaries, not per kernel). */
    if (in_slice)
        for (int w = 0; w < FC_MAX_WAITERS; w++)
            if (d->wq[w].ticket && d->wq[w].proc == d->slice_proc &&
                (best < 0 || d->wq[w].ticket < d->wq[best].ticket))
                best = w;
    /* When it has ended, another process goes first: the slice's own
     * streams may hold older tickets, but they are the context whose
     * turn is over. */
    if (best < 0 && !in_slice)
        for (int w = 0; w < FC_MAX_WAITERS; w++)
            if (d->wq[w].ticket && d->wq[w].proc != d->slice_proc &&
                (best < 0 || d->wq[w].ticket < d->wq[best].ticket))
                best = w;
    if (best < 0)
        for (int w = 0; w < FC_MAX_WAITERS; w++)
            if (d->wq[w].ticket && (best < 0 || d->wq[w].ticket < d->wq[best].ticket))
                best = w;
    return best;
}

/* Timer model: while the slice of d->slice_proc runs, its oldest waiter;
 * otherwise (or when it has none) round robin: the first process after
 * d->slice_proc in process entry order that waits (d->slice_proc itself
 * last), its oldest waiter. */
static int pick_timer_locked(const struct fc_dev *d, int in_slice)
{
    int cur = d->slice_proc;
    int best = in_slice ? oldest_locked(d, cur, 0) : -1;
    if (best >= 0)
        return best;
    int bestd = 0;
    for (int w = 0; w < FC_MAX_WAITERS; w++) {
        if (!d->wq[w].ticket)
            continue;
        int dist = cur >= 0 ? (d->wq[w].proc - cur - 1 + FC_MAX_PROCS) % FC_MAX_PROCS : d->wq[w].proc;
        if (best < 0 || dist < bestd || (dist == bestd && d->wq[w].ticket < d->wq[best].ticket)) {
            best = w;
            bestd = dist;
        }
    }
    return best;
}

/* Timer model: a slice that has ended while its process kept the device
 * (nobody else waited) is followed at once by the next one: the slice
 * clock is free-running from when the process got the device. */
static void timer_renew_locked(struct fc_dev *d, uint64_t now)
{
    if (now >= d->slice_end_ns && d->slice_ns)
        d->slice_end_ns += ((now - d->slice_end_ns) / d->slice_ns + 1) * d->slice_ns;
}

/* Hands the device to the live waiter the device model picks (or leaves it
 * idle). */
static void grant_next_locked(struct fc_dev *d)
{
    uint64_t now = fc_now_ns();
    /* where the previous holder's worker has recorded up to: its last
     * kernel's end on the device's timeline (fc_cuda.c); none when it died
     * holding the device (handed on now, when that is noticed) */
    int prev = d->owner_proc;
    uint64_t prev_mark = d->owner_ticket && prev >= 0 && prev < FC_MAX_PROCS && d->procs[prev].state == FC_PROC_ALIVE
                             ? d->hold_ns
                             : 0;
    int in_slice = 0;
    if (d->model == FC_MODEL_SLICE) {
        /* A process's own streams are one context: while no other process
         * waits, its slice goes on, as when nobody waits at all. */
        if (d->slice_proc >= 0 && !others_wait_locked(d, d->slice_proc))
            d->slice_end_ns = now + d->slice_ns;
        in_slice = d->slice_proc >= 0 && now < d->slice_end_ns;
    } else if (d->model == FC_MODEL_TIMER) {
        in_slice = d->slice_proc >= 0 && now < d->slice_end_ns;
    }
    for (;;) {
        int best;
        if (d->model == FC_MODEL_TIMER)
            best = pick_timer_locked(d, in_slice);
        else if (d->model == FC_MODEL_KERNEL)
            /* after each kernel, the longest waiting kernel of another
             * process; the holder's own streams only when none waits */
            best = d->slice_proc >= 0 && others_wait_locked(d, d->slice_proc) ? oldest_locked(d, d->slice_proc, 1)
                                                                             : oldest_locked(d, -1, 0);
        else
            best = pick_slice_locked(d, in_slice);
        if (best < 0) {
            d->owner_ticket = 0;
            d->owner_proc = -1;
            d->hold_ns = 0;
            d->free_ns = now;
            break;
        }
        struct fc_waiter wt = d->wq[best];
        d->wq[best].ticket = 0;
        d->nwait--;
        if (d->procs[wt.proc].state != FC_PROC_ALIVE)
            continue;
        /* The liveness check is a trylock, no system call. */
        pthread_mutex_t *m = &d->procs[wt.proc].alive;
        int r = pthread_mutex_trylock(m);
        if (r != EBUSY) {
            if (r == EOWNERDEAD)
                pthread_mutex_consistent(m);
            if (r == 0 || r == EOWNERDEAD)
                pthread_mutex_unlock(m);
            struct fc_proc *p = &d->procs[wt.proc];
            d->mem_used = d->mem_used >= p->mem_used ? d->mem_used - p->mem_used : 0;
            p->mem_used = 0;
            p->state = FC_PROC_DEAD;
            continue;
        }
        /* The next holder takes over where the previous one's worker has
         * recorded up to: at a kernel boundary, where its last kernel ended
         * (the worker's late wake-up is nobody's time); after a preemption
         * or a queue that ran dry, when the worker gave the device back. */
        d->handed_ns = prev_mark && prev_mark < now ? prev_mark : now;
        d->hold_ns = 0; /* set by the new holder's worker when it wakes (fc_exec_acquire) */
        d->owner_ticket = wt.ticket;
        d->owner_proc = wt.proc;
        d->turn_end_ns = now + d->slice_ns;
        if (wt.proc != d->slice_proc || !in_slice) {
            d->slice_proc = wt.proc; /* a new slice begins */
            d->slice_end_ns = now + d->slice_ns;
        }
        break;
    }
    trace_locked(d, d->owner_proc, now);
    __atomic_add_fetch(&d->seq, 1, __ATOMIC_SEQ_CST);
    futex(&d->seq, FUTEX_WAKE, INT_MAX, NULL);
}

/* Takes the device for a kernel queued at `at`.  *since is when it was
 * held from on the device's own timeline (fc_cuda.c): an idle device
 * started the kernel when it was queued, or when the device was last left
 * idle if that is later; a device handed on started it at the hand-off;
 * not when this thread happened to wake. */
uint64_t fc_exec_acquire(struct fc_dev *d, int proc, uint64_t at, uint64_t *since)
{
    fc_dev_lock(d);
    uint64_t t = ++d->next_ticket;
    *since = fc_now_ns(); /* the immediate path below; the waiting path sets it again */
    if (d->owner_ticket == 0 && d->nwait == 0) {
        uint64_t from = at > d->free_ns ? at : d->free_ns;
        if (from < *since)
            *since = from;
        d->owner_ticket = t;
        d->owner_proc = proc;
        d->turn_end_ns = *since + d->slice_ns;
        if (proc != d->slice_proc || fc_now_ns() >= d->slice_end_ns) {
            d->slice_proc = proc;
            d->slice_end_ns = fc_now_ns() + d->slice_ns;
        }
        d->hold_ns = *since;
        trace_locked(d, proc, *since);
        fc_dev_unlock(d);
        return t;
    }
    int slot = -1;
    for (;;) {
        if (d->owner_ticket == t)
            break;
        if (slot < 0) {
            for (int w = 0; w < FC_MAX_WAITERS && slot < 0; w++) {
                if (!d->wq[w].ticket) {
                    slot = w;
                    d->wq[w].ticket = t;
                    d->wq[w].proc = proc;
                    d->nwait++;
                }
            }
            if (slot >= 0 && d->owner_ticket == 0)
                grant_next_locked(d); /* queue was non-empty, device idle */
            if (d->owner_ticket == t)
                break;
        } else if (d->wq[slot].ticket != t && d->owner_ticket != t) {
            slot = -1; /* removed as dead by mistake cannot happen; re-queue */
            continue;
        }
        uint32_t seq = __atomic_load_n(&d->seq, __ATOMIC_SEQ_CST);
        fc_dev_unlock(d);
        uint64_t until = __atomic_load_n(&d->hold_until_ns, __ATOMIC_RELAXED), now = fc_now_ns();
        uint64_t wait = (until > now ? until - now : 0) + FC_LIVENESS_SLACK_NS;
        if (wait > FC_LIVENESS_POLL_NS)
            wait = FC_LIVENESS_POLL_NS;
        struct timespec ts = {(time_t)(wait / 1000000000ULL), (long)(wait % 1000000000ULL)};
        futex(&d->seq, FUTEX_WAIT, seq, &ts);
        fc_dev_lock(d);
        if (d->owner_ticket && d->owner_ticket != t && !fc_proc_check_locked(d, d->owner_proc))
            ; /* reaping the dead owner handed the device on */
        else if (d->owner_ticket == 0 && d->nwait > 0)
            grant_next_locked(d);
    }
    /* Held from the hand-off, not from when this thread woke, whether
     * another stream of this process or another process handed it on. */
    *since = fc_now_ns();
    if (d->handed_ns < *since)
        *since = d->handed_ns;
    d->hold_ns = *since;
    fc_dev_unlock(d);
    return t;
}

/* Records held time and kernels for proc (under mu). */
static void account_locked(struct fc_dev *d, int proc, uint64_t busy_ns, uint64_t kernel_ns, uint64_t kernels)
{
    d->busy_ns += busy_ns;
    d->kernel_ns += kernel_ns;
    d->kernels += kernels;
    if (proc >= 0 && proc < FC_MAX_PROCS) {
        d->procs[proc].busy_ns += busy_ns;
        d->procs[proc].kernel_ns += kernel_ns;
        d->procs[proc].kernels += kernels;
    }
    /* Only the holder records (its worker's mark moves on by busy_ns). */
    if (d->hold_ns)
        d->hold_ns += busy_ns;
}

/* Records a kernel's run of kernel_ns ending at end_ns for proc (under mu). */
static void krun_locked(struct fc_dev *d, int proc, uint64_t kernel_ns, uint64_t end_ns)
{
    if (kernel_ns == 0)
        return;
    struct fc_krun *r = &d->krun[d->nkrun % FC_KRUNS];
    r->end_ns = end_ns;
    r->dur_ns = kernel_ns > UINT32_MAX ? UINT32_MAX : (uint32_t)kernel_ns;
    r->pid = proc >= 0 && proc < FC_MAX_PROCS ? d->procs[proc].pid : -1;
    d->nkrun++;
}

void fc_exec_account(struct fc_dev *d, uint64_t ticket, int proc, uint64_t busy_ns, uint64_t kernel_ns,
                     uint64_t end_ns)
{
    fc_dev_lock(d);
    if (d->owner_ticket == ticket) {
        account_locked(d, proc, busy_ns, kernel_ns, 1);
        krun_locked(d, proc, kernel_ns, end_ns);
    }
    fc_dev_unlock(d);
}

void fc_exec_release(struct fc_dev *d, uint64_t ticket, int proc, uint64_t busy_ns)
{
    fc_dev_lock(d);
    if (d->owner_ticket == ticket) {
        account_locked(d, proc, busy_ns, 0, 0);
        if (d->nwait > 0) {
            grant_next_locked(d);
        } else {
            d->free_ns = fc_now_ns();
            d->owner_ticket = 0;
            d->owner_proc = -1;
            d->hold_ns = 0;
            trace_locked(d, -1, d->free_ns);
        }
    }
    fc_dev_unlock(d);
}

int fc_exec_continue(struct fc_dev *d, uint64_t ticket, int proc, uint64_t busy_ns)
{
    fc_dev_lock(d);
    if (d->owner_ticket != ticket) {
        fc_dev_unlock(d);
        return 0;
    }
    account_locked(d, proc, busy_ns, 0, 0);
    uint64_t now = fc_now_ns();
    int keep = 0;
    if (d->model == FC_MODEL_TIMER) {
        if (d->nwait == 0) {
            keep = 1; /* nobody waits: the slice (free-running) goes on */
            d->slice_proc = proc;
            timer_renew_locked(d, now);
            d->turn_end_ns = now + d->slice_ns;
        } else if (d->slice_proc == proc && !others_wait_locked(d, proc)) {
            /* Only this process's other streams wait: its slices go on;
             * its streams take turns of a slice's length. */
            timer_renew_locked(d, now);
            keep = now < d->turn_end_ns;
        } else if (d->slice_proc == proc && now < d->slice_end_ns) {
            keep = 1; /* inside the slice, the process keeps the device */
        }
    } else if (d->model == FC_MODEL_KERNEL) {
        if (d->nwait == 0) {
            keep = 1;
            d->slice_proc = proc;
            d->slice_end_ns = now + d->slice_ns;
            d->turn_end_ns = d->slice_end_ns;
        } else if (!others_wait_locked(d, proc)) {
            keep = now < d->turn_end_ns; /* own streams only: turns, as in the slice model */
        }
        /* another process waits: it gets the device after each kernel */
    } else if (d->nwait == 0) {
        keep = 1; /* nobody waits: the slice goes on */
        d->slice_proc = proc;
        d->slice_end_ns = now + d->slice_ns;
        d->turn_end_ns = d->slice_end_ns;
    } else if (d->slice_proc == proc && !others_wait_locked(d, proc)) {
        /* Only this process's other streams wait: its slice goes on; its
         * streams take turns of a slice's length (grant_next_locked hands
         * the device to the oldest of them). */
        d->slice_end_ns = now + d->slice_ns;
        keep = now < d->turn_end_ns;
    } else if (d->slice_proc == proc && now < d->slice_end_ns) {
        keep = 1;
    }
    if (!keep)
        grant_next_locked(d);
    fc_dev_unlock(d);
    return keep;
}

uint64_t fc_exec_slice_end(struct fc_dev *d, uint64_t ticket)
{
    fc_dev_lock(d);
    uint64_t end = d->owner_ticket == ticket ? d->slice_end_ns : 0;
    fc_dev_unlock(d);
    return end;
}

int fc_exec_preempt(struct fc_dev *d, uint64_t ticket, int proc, uint64_t busy_ns, uint64_t kernel_ns,
                    uint64_t end_ns, uint64_t *slice_end)
{
    fc_dev_lock(d);
    if (d->owner_ticket != ticket) {
        fc_dev_unlock(d);
        return 0;
    }
    account_locked(d, proc, busy_ns, kernel_ns, 0);
    krun_locked(d, proc, kernel_ns, end_ns);
    int keep = !others_wait_locked(d, proc);
    if (keep) {
        /* its own streams waiting do not count: one context */
        timer_renew_locked(d, fc_now_ns());
        *slice_end = d->slice_end_ns;
    } else {
        grant_next_locked(d); /* the slice has ended: round robin */
    }
    fc_dev_unlock(d);
    return keep;
}

int fc_mem_reserve(struct fc_dev *d, int proc, uint64_t bytes)
{
    fc_dev_lock(d);
    if (bytes > d->mem_total || d->mem_used > d->mem_total - bytes) {
        fc_reap_locked(d);
        if (bytes > d->mem_total || d->mem_used > d->mem_total - bytes) {
            fc_dev_unlock(d);
            return -1;
        }
    }
    d->mem_used += bytes;
    if (proc >= 0 && proc < FC_MAX_PROCS)
        d->procs[proc].mem_used += bytes;
    fc_dev_unlock(d);
    return 0;
}

void fc_mem_unreserve(struct fc_dev *d, int proc, uint64_t bytes)
{
    fc_dev_lock(d);
    d->mem_used = d->mem_used >= bytes ? d->mem_used - bytes : 0;
    if (proc >= 0 && proc < FC_MAX_PROCS && d->procs[proc].state == FC_PROC_ALIVE) {
        struct fc_proc *p = &d->procs[proc];
        p->mem_used = p->mem_used >= bytes ? p->mem_used - bytes : 0;
    }
    fc_dev_unlock(d);
}

void fc_dev_reset(struct fc_dev *d)
{
    fc_dev_lock(d);
    fc_reap_locked(d);
    d->busy_ns = 0;
    d->kernel_ns = 0;
    d->kernels = 0;
    /* Busy times start again from 0 now: earlier samples are void.  A hold
     * in progress is recorded whole when it ends, as before a reset. */
    d->samp_from = d->nsamp;
    uint64_t now_us = fc_now_us_real(), now_ns = fc_now_ns();
    for (int i = 0; i < FC_MAX_PROCS; i++) {
        struct fc_proc *p = &d->procs[i];
        p->busy_ns = 0;
        p->kernel_ns = 0;
        p->kernels = 0;
        p->start_us = now_us;
        p->start_ns = now_ns;
        p->first_samp = d->nsamp;
        if (p->state == FC_PROC_DEAD) {
            p->state = FC_PROC_FREE;
            p->pid = 0;
            p->pidns = 0;
        }
    }
    fc_dev_unlock(d);
}

void fc_proc_ctx(struct fc_dev *d, int proc, int delta)
{
    if (!d || proc < 0 || proc >= FC_MAX_PROCS)
        return;
    fc_dev_lock(d);
    struct fc_proc *p = &d->procs[proc];
    if (p->state == FC_PROC_ALIVE)
        p->ctxs = p->ctxs + delta > 0 ? p->ctxs + delta : 0;
    fc_dev_unlock(d);
}

uint64_t fc_busy_now_locked(const struct fc_dev *d, int i, uint64_t now_ns)
{
    uint64_t b = d->procs[i].busy_ns;
    if (d->owner_ticket && d->owner_proc == i && d->hold_ns && now_ns > d->hold_ns)
        b += now_ns - d->hold_ns;
    return b;
}

uint64_t fc_sample_locked(struct fc_dev *d)
{
    uint64_t now_ns = fc_now_ns();
    if (d->nsamp > d->samp_from) {
        const struct fc_sample *last = &d->samp[(d->nsamp - 1) % FC_SAMPLES];
        if (now_ns - last->t_ns < FC_SAMPLE_MIN_NS)
            return d->nsamp - 1;
    }
    uint64_t k = d->nsamp;
    uint64_t t_us = fc_now_us_real();
    if (k > 0 && t_us <= d->samp[(k - 1) % FC_SAMPLES].t_us)
        t_us = d->samp[(k - 1) % FC_SAMPLES].t_us + 1; /* the wall clock went back: stay increasing */
    d->samp[k % FC_SAMPLES] = (struct fc_sample){t_us, now_ns};
    for (int i = 0; i < FC_MAX_PROCS; i++)
        if (d->procs[i].state == FC_PROC_ALIVE)
            d->procs[i].samp_busy[k % FC_SAMPLES] = fc_busy_now_locked(d, i, now_ns);
    d->nsamp = k + 1;
    return k;
}

uint64_t fc_sample_busy_locked(const struct fc_dev *d, int i, uint64_t k)
{
    if (k >= d->nsamp || k < d->samp_from || k + FC_SAMPLES < d->nsamp)
        return UINT64_MAX;
    const struct fc_proc *p = &d->procs[i];
    return k < p->first_samp ? 0 : p->samp_busy[k % FC_SAMPLES];
}
