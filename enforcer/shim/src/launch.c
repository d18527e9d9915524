/*
 * launch.c - compute gating and measured GPU time (the launch family).
 *
 * Fast path (every launch): one atomic load of the grant, a thread-local
 * lookup of the stream's state, two counter updates and one compare.  No
 * system call, no lock.  Everything else happens on the slow path, which a
 * stream enters about once per 0.25-0.5 ms of GPU work.
 *
 * Measured GPU time.  Per stream, launches are grouped into batches of
 * per_mark launches.  A batch starts with a timing event recorded just before
 * its first launch when the stream is busy (it completes at the end of the
 * previous work, so the batch is timed from there).  When the stream is idle,
 * an event recorded before the launch would complete at once, and the time
 * the first kernel then waits for the device (behind another instance's
 * queued tail, after a hand-off) would be charged to this process; so an idle
 * stream's batch starts with an event recorded just after its first launch,
 * and that first launch is charged at the measured mean.  A batch ends with a
 * "mark", a timing event recorded after its last launch.  Completed batches are placed on one
 * GPU timeline per device (elapsed time from an anchor event) and gpu_ns
 * grows by the part of each batch not already covered by another batch of
 * the process: two streams of one process that time-share the GPU are
 * counted once.  The mean GPU time per launch adapts per_mark so that marks
 * are about MGPU_TARGET_MARK_NS of GPU time apart.
 *
 * Bounded queue.  queued_ns is (launches submitted, not known complete) x
 * (mean GPU time per launch), summed over the process's streams on the
 * device.  Before a launch would take it over max_queued_ns, the launching
 * thread waits on the stream's oldest outstanding mark (cuEventSynchronize).
 * Synchronisation calls end the open batches so that their time is counted.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"
#ifdef MGPU_TRACE
#include <stdio.h>
#endif

#define MGPU_RING 64                 /* outstanding marks per stream */
#define MGPU_POOL (2 * MGPU_RING + 4) /* events per stream */
#define MGPU_TARGET_MARK_NS 375000u  /* GPU time between marks */
#define MGPU_MAX_PER_MARK 4096u
#define MGPU_MAX_STREAMS 4096u
#define MGPU_WAIT_SLICE_NS 1000000   /* futex timeout while waiting for a grant, the queue draining */
#define MGPU_WAIT_IDLE_NS 50000000   /* the same once it has drained (the grant's FUTEX_WAKE ends it) */
#define MGPU_CLEAN_MIN 4             /* clean samples before clean_ns is trusted */
#define MGPU_CONTIG_GAP_MAX_NS 1000000u /* longest gap a clean contiguous batch covers (batch_time) */

#define KEY_LEGACY ((uintptr_t)CU_STREAM_LEGACY)
#define KEY_PER_THREAD ((uintptr_t)CU_STREAM_PER_THREAD)

struct mark {
    CUevent ref; /* where the batch started */
    CUevent end; /* recorded after its last launch */
    CUevent ref0;       /* idle start: recorded before the first launch (NULL: none) */
    uint64_t first_est; /* idle start: the estimate of one launch when the batch began */
    int idle;           /* the batch began on an idle stream: ref follows its first launch */
    int contig;         /* ref was recorded while the previous mark was pending: no idle gap between them */
    int cont;           /* another instance may have run inside the batch (region's contended word) */
    uint64_t at;     /* stream launch count at the mark */
    uint64_t est_at; /* est_total at the mark */
};

struct sstate {
    /* read by the fast path */
    _Atomic uint64_t submitted; /* launches submitted on this stream */
    _Atomic uint64_t check_at;  /* the fast path takes the slow path when submitted reaches this */
    _Atomic int capturing;      /* stream capture: launches only build a graph */
    _Atomic int shared;         /* launched on by more than one thread: launches go one at a time */
    pthread_mutex_t launch_mu;  /* held around a shared stream's launch (numbering = stream order) */
    /* identity */
    struct mgpu_dev *dev;
    uintptr_t key;
    pthread_t owner; /* per-thread default stream: its thread */
    unsigned gen;
    struct sstate *next;
    /* under mgpu_acct_mu */
    uint64_t marked;    /* launch count at the newest mark */
    uint64_t completed; /* launch count at the newest completed mark */
    CUevent batch_ref;  /* start of the open batch; NULL: none open */
    int ref_after;      /* idle start: record batch_ref after the launch in flight */
    int batch_idle;     /* the open batch began on an idle stream */
    CUevent batch_ref0; /* its event before the first launch */
    uint64_t batch_first; /* first_est of the open batch */
    int batch_contig;     /* the open batch follows the previous one without a gap */
    int batch_cont;       /* the open batch began while another instance had work on the GPU */
    int counted;          /* counted in g_dev_streams (it had a measured launch) */
    uint64_t last_end;    /* timeline end of the newest completed batch (0: none) */
    struct mark ring[MGPU_RING];
    unsigned head, count;
    CUevent pool[MGPU_POOL];
    unsigned npool, nevents;
    uint64_t avg_ns;  /* mean GPU time per launch; 0: not measured yet */
    uint64_t clean_ns; /* mean GPU time per launch of batches no other instance ran inside */
    uint64_t clean_n;  /* samples in clean_ns (it is used from MGPU_CLEAN_MIN on) */
    uint64_t clean_dev; /* mean absolute deviation of the clean samples from clean_ns */
    uint64_t per_mark;
    uint64_t queued_ns; /* this stream's part of the device's queued_ns */
    /* queued_ns counts each launch at the estimate in force when it was
     * admitted (est_total), so a later change of the estimate cannot take
     * the queue over the bound after the fact. */
    uint64_t cur_est;   /* GPU time per launch assumed for new launches */
    uint64_t est_total; /* sum of estimates of launches up to 'folded' */
    uint64_t folded;
    uint64_t est_done; /* est_total at the newest completed mark */
    uint64_t admitting; /* launch number in pre_launch (numbered, not yet issued); 0: none */
};

pthread_mutex_t mgpu_acct_mu = PTHREAD_MUTEX_INITIALIZER;
static struct sstate *g_streams; /* under mgpu_acct_mu; never freed */
static unsigned g_nstreams;
static uint64_t g_dev_queued[MGPU_MAX_DEVICES]; /* by ordinal, under mgpu_acct_mu */
static unsigned g_dev_streams[MGPU_MAX_DEVICES]; /* streams with measured launches, by ordinal, under mgpu_acct_mu */

/* The process's GPU timeline on one device: an anchor event and the busy
 * intervals seen recently (disjoint, sorted), under mgpu_acct_mu. */
#define MGPU_BUSY_SPANS 128
#define MGPU_REANCHOR_NS 1000000000ull
struct gclock {
    CUevent anchor;
    uint64_t anchor_ns;
    uint64_t floor; /* everything before is treated as counted */
    unsigned n;
    uint64_t s[MGPU_BUSY_SPANS], e[MGPU_BUSY_SPANS];
};
static struct gclock g_clock[MGPU_MAX_DEVICES];

/* Adds [s, e) to the busy set; returns the part not covered before. */
static uint64_t busy_add(struct gclock *c, uint64_t s, uint64_t e)
{
    if (s < c->floor)
        s = c->floor;
    if (e <= s)
        return 0;
    unsigned i = 0;
    while (i < c->n && c->e[i] < s)
        i++;
    unsigned j = i;
    uint64_t covered = 0, ns = s, ne = e;
    while (j < c->n && c->s[j] <= e) {
        uint64_t lo = c->s[j] > s ? c->s[j] : s, hi = c->e[j] < e ? c->e[j] : e;
        if (hi > lo)
            covered += hi - lo;
        if (c->s[j] < ns)
            ns = c->s[j];
        if (c->e[j] > ne)
            ne = c->e[j];
        j++;
    }
    /* replace spans [i, j) by [ns, ne) */
    unsigned tail = c->n - j;
    if (j == i) {
        if (c->n == MGPU_BUSY_SPANS) { /* full: forget the oldest span */
            c->floor = c->e[0];
            memmove(&c->s[0], &c->s[1], (c->n - 1) * sizeof c->s[0]);
            memmove(&c->e[0], &c->e[1], (c->n - 1) * sizeof c->e[0]);
            c->n--;
            if (i > 0)
                i--;
            j = i;
        }
        memmove(&c->s[i + 1], &c->s[i], tail * sizeof c->s[0]);
        memmove(&c->e[i + 1], &c->e[i], tail * sizeof c->e[0]);
        c->n++;
    } else if (j > i + 1) {
        memmove(&c->s[i + 1], &c->s[j], tail * sizeof c->s[0]);
        memmove(&c->e[i + 1], &c->e[j], tail * sizeof c->e[0]);
        c->n -= j - i - 1;
    }
    c->s[i] = ns;
    c->e[i] = ne;
    return (e - s) - covered;
}

static int elapsed_ns(CUevent a, CUevent b, int64_t *out)
{
    float ms = 0;
    if (REAL(cuEventElapsedTime)(&ms, a, b) != CUDA_SUCCESS)
        return -1;
    *out = (int64_t)((double)ms * 1e6 + (ms >= 0 ? 0.5 : -0.5));
    return 0;
}

/* GPU time of a completed batch [ref, end] not yet counted for the process.
 * A contiguous batch (m->contig) also covers the gap since the stream's
 * previous batch ended: the stream was busy through it (the device moving
 * from one mark to the next; its ref was recorded while that mark was
 * pending, so nothing of the stream's lies between them).  Up to one
 * launch's time when another instance may have run in the gap (contended),
 * up to MGPU_CONTIG_GAP_MAX_NS otherwise: on a loaded host the simulated
 * device's worker wakes late between the two events, and bounding every gap
 * at one launch charged a saturating 70 56.4 for 68.0 % of the device.
 * Sets ss->last_end.  May keep ref or end as the device's anchor (*kept
 * says which). */
static uint64_t batch_time(struct sstate *ss, CUevent ref, CUevent end, uint64_t dur, uint64_t first, int contig,
                           int cont, int *kept)
{
    struct gclock *c = &g_clock[ss->dev->ordinal];
    *kept = 0;
    if (!c->anchor) {
        c->anchor = ref;
        c->anchor_ns = 1;
        *kept = 1;
    }
    int64_t a;
    if (elapsed_ns(c->anchor, ref, &a) || (int64_t)c->anchor_ns + a < 0) {
        ss->last_end = 0;
        return dur; /* not on this timeline (another context): count it whole */
    }
    uint64_t s = (uint64_t)((int64_t)c->anchor_ns + a);
    /* an idle start's first kernel ran (about) just before ref */
    s = s > first ? s - first : 0;
    uint64_t from = s;
    if (contig && ss->last_end && ss->last_end <= s &&
        s - ss->last_end <= (cont ? ss->avg_ns : MGPU_CONTIG_GAP_MAX_NS))
        from = ss->last_end;
    ss->last_end = s + dur;
    uint64_t add = busy_add(c, from, s + dur);
    if (s - c->anchor_ns > MGPU_REANCHOR_NS && *kept == 0) {
        /* keep timeline offsets small so float milliseconds stay precise */
        REAL(cuEventDestroy_v2)(c->anchor);
        c->anchor = end;
        c->anchor_ns = s + dur;
        *kept = 2;
    }
    return add;
}

struct tl_ent {
    struct mgpu_dev *dev;
    uintptr_t key;
    struct sstate *ss;
};
#define TL_ENTS 4
static __thread struct tl_ent tl_cache[TL_ENTS] __attribute__((tls_model("initial-exec")));

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Whether another instance of the device may have work on the GPU now:
 * then this process's events may time that work too (interleaved). */
static int contended(const struct sstate *ss)
{
    return atomic_load_explicit(&ss->dev->region->contended, memory_order_acquire) != 0;
}

static CUstream stream_handle(const struct sstate *ss)
{
    return (CUstream)ss->key; /* KEY_LEGACY and KEY_PER_THREAD are the API's own handles */
}

static inline uintptr_t stream_key(CUstream h, int ptsz)
{
    if (h == NULL)
        return ptsz ? KEY_PER_THREAD : KEY_LEGACY;
    return (uintptr_t)h;
}

/* ---- events ---- */

static CUevent ev_get(struct sstate *ss)
{
    if (ss->npool)
        return ss->pool[--ss->npool];
    if (ss->nevents >= MGPU_POOL)
        return NULL;
    CUevent e;
    if (REAL(cuEventCreate)(&e, CU_EVENT_DEFAULT) != CUDA_SUCCESS)
        return NULL;
    ss->nevents++;
    return e;
}

static void ev_put(struct sstate *ss, CUevent e)
{
    if (e && ss->npool < MGPU_POOL)
        ss->pool[ss->npool++] = e;
}

/* ---- accounting (all under mgpu_acct_mu) ---- */

static void ss_reset(struct sstate *ss)
{
    /* After fork: the events belong to the parent's contexts; forget them. */
    atomic_store(&ss->submitted, 0);
    atomic_store(&ss->check_at, 1);
    atomic_store(&ss->capturing, 0);
    ss->marked = ss->completed = 0;
    ss->batch_ref = NULL;
    ss->ref_after = 0;
    ss->batch_idle = 0;
    ss->batch_ref0 = NULL;
    ss->batch_first = 0;
    ss->batch_contig = 0;
    ss->batch_cont = 0;
    ss->counted = 0;
    ss->last_end = 0;
    ss->head = ss->count = ss->npool = ss->nevents = 0;
    ss->avg_ns = 0;
    ss->clean_ns = 0;
    ss->clean_n = 0;
    ss->clean_dev = 0;
    ss->per_mark = 1;
    ss->queued_ns = 0;
    ss->cur_est = ss->est_total = ss->folded = ss->est_done = 0;
    ss->admitting = 0;
    ss->gen = mgpu_generation;
}

/* The queue bound in force: max_queued_ns, or 1 ns (one launch
 * outstanding per stream) while the grant word says MGPU_GRANT_ONE.
 * 0: unbounded. */
static uint64_t qbound(const struct mgpu_dev *d)
{
    if (atomic_load_explicit(&d->region->grant, memory_order_relaxed) == MGPU_GRANT_ONE)
        return 1;
    return d->max_queued_ns;
}

static uint64_t target_mark_ns(const struct mgpu_dev *d)
{
    uint64_t t = MGPU_TARGET_MARK_NS, b = qbound(d);
    if (b && b / 4 < t)
        t = b / 4;
    return t ? t : 1;
}

static void fold(struct sstate *ss, uint64_t upto)
{
    if (upto > ss->folded) {
        /* before the first measurement a launch counts 1 ns: queued_ns is
         * then > 0 while anything is outstanding (the enforcer's contended
         * word of the other instances depends on it) */
        ss->est_total += (upto - ss->folded) * (ss->cur_est ? ss->cur_est : 1);
        ss->folded = upto;
    }
}

/* pending: launches counted in submitted but not admitted yet (the caller's). */
static void set_queued(struct sstate *ss, uint64_t pending)
{
    uint64_t sub = atomic_load_explicit(&ss->submitted, memory_order_relaxed) - pending;
    fold(ss, sub);
    /* Every launch marked and every mark complete: nothing is queued,
     * whatever the estimates added up to (a launch taken back after it was
     * folded left a residue that kept queued_ns > 0 for good, and the
     * other instances' contended word with it). */
    if (ss->count == 0 && !ss->batch_ref && !ss->ref_after && ss->marked >= sub && ss->completed >= ss->marked)
        ss->est_done = ss->est_total;
    uint64_t q = ss->est_total > ss->est_done ? ss->est_total - ss->est_done : 0;
    uint64_t *tot = &g_dev_queued[ss->dev->ordinal];
    uint64_t was = *tot;
    *tot = *tot - ss->queued_ns + q;
    ss->queued_ns = q;
    struct mgpu_dev *d = ss->dev;
    if (was > 0 && *tot == 0) /* before queued_ns: the enforcer reads idle_ns while it is 0 */
        atomic_store_explicit(&d->slot->idle_ns, now_ns(), memory_order_relaxed);
    atomic_store_explicit(&d->slot->queued_ns, *tot, memory_order_release);
    /* An offline instance may be waiting for this one to go quiet, or
     * filling the device beside it until it gets work: the enforcer asks
     * (region wake word) to hear of either at once. */
    if ((was == 0) != (*tot == 0)) {
        /* queued_ns before the word, both in one total order with the
         * enforcer's (it writes the word, then reads queued_ns): either
         * this sees the word or the enforcer sees the change. */
        atomic_thread_fence(memory_order_seq_cst);
        uint32_t w = atomic_load(&d->region->wake);
        if (w & (*tot ? MGPU_WAKE_BUSY : MGPU_WAKE_IDLE))
            mgpu_wake(d);
    }
}

/* Feeds one per-launch sample to the estimate.  Waiting (behind another
 * instance's work, for the host) only ever makes a sample too long: follow
 * samples down fast and up slowly, and damp outliers. */
static void learn(struct sstate *ss, uint64_t sample)
{
    if (!ss->avg_ns)
        ss->avg_ns = sample ? sample : 1;
    else if (sample < ss->avg_ns)
        ss->avg_ns = (ss->avg_ns + sample + 1) / 2;
    else
        ss->avg_ns = (7 * ss->avg_ns + (sample > 2 * ss->avg_ns ? 2 * ss->avg_ns : sample) + 4) / 8;
}

/* Feeds one per-launch sample of a batch that no other instance ran
 * inside: an unbiased mean, what an interleaved batch is charged by. */
static void learn_clean(struct sstate *ss, uint64_t sample)
{
    /* the spread first, around the mean it is measured from: a moving
     * mean absolute deviation over about 16 samples */
    if (ss->clean_n) {
        uint64_t d = sample > ss->clean_ns ? sample - ss->clean_ns : ss->clean_ns - sample;
        uint64_t wd = ss->clean_n < 16 ? ss->clean_n : 16;
        ss->clean_dev = (ss->clean_dev * (wd - 1) + d + wd / 2) / wd;
    }
    /* the mean of the first samples, then a moving average over about 8 */
    uint64_t w = ss->clean_n < 8 ? ss->clean_n + 1 : 8;
    ss->clean_ns = (ss->clean_ns * (w - 1) + sample + w / 2) / w;
    ss->clean_n++;
}

/* Whether a contended batch of timed launches that measured dur (its own
 * events, not the gap before it that batch_time may add) evidently had
 * another instance's work inside it: it took more than its launches take
 * when nobody else runs (est each) by a quarter, and by more than the
 * clean batches' own spread allows.  A process's own batches spread: on
 * the simulated GPU a 30 of four threads on one stream, 50 µs kernels,
 * measured 74 µs per launch at the median and 102-123 µs at the 97th-99th
 * percentile in batches nobody else ran inside, so a quarter over the mean
 * called its upper tail interleaved and charged 5.7 % less than it ran.
 * The spread of a sum of timed launches grows as its square root:
 * interleaved once the excess is over 4 mean absolute deviations (about
 * 3 standard deviations) times sqrt(timed). */
static int interleaved(const struct sstate *ss, uint64_t timed, uint64_t dur, uint64_t est)
{
    uint64_t own = timed * est;
    if (dur <= own + own / 4)
        return 0;
    if (ss->clean_n < MGPU_CLEAN_MIN)
        return 1;
    double x = (double)(dur - own), dev = (double)ss->clean_dev;
    return x * x > 16.0 * dev * dev * (double)timed;
}

/* GPU time per launch that an interleaved batch is charged at most: the
 * clean mean once it has a few samples, else the (low-biased) estimate,
 * or the few clean samples' mean where that is lower (a process of long
 * kernels, whose every launch is its own batch and most of them overlap a
 * hand-off, sees few clean samples and learns the estimate from upper
 * bounds). */
static uint64_t clean_est(const struct sstate *ss)
{
    if (ss->clean_n >= MGPU_CLEAN_MIN)
        return ss->clean_ns;
    if (ss->clean_n && ss->clean_ns < ss->avg_ns)
        return ss->clean_ns;
    return ss->avg_ns;
}

/* Processes the stream's completed marks, oldest first. */
static void poll_ss(struct sstate *ss, uint64_t pending)
{
    uint64_t gpu = 0;
    while (ss->count) {
        struct mark *m = &ss->ring[ss->head];
        CUresult r = REAL(cuEventQuery)(m->end);
        if (r == CUDA_ERROR_NOT_READY)
            break;
        int kept = 0, placed = 0;
        if (r == CUDA_SUCCESS && m->ref) {
            int64_t dur;
            if (elapsed_ns(m->ref, m->end, &dur) == 0 && dur >= 0) {
                uint64_t n = m->at > ss->completed ? m->at - ss->completed : 1;
                uint64_t timed = m->idle && n > 0 ? n - 1 : n; /* launches between ref and end */
                /* An idle start's first launch: from ref0 to ref it waited
                 * (perhaps behind another instance's tail) and ran.  It is
                 * charged that, but no more than one launch's estimate. */
                /* The exactly timed launches first: they seed the estimate
                 * of a new process better than its first launch, which may
                 * have waited behind another instance's tail. */
                /* A batch that another instance's work may have run
                 * inside (a hand-off: the revoked holder's tail and the new
                 * holder's first work; on a GPU that time-slices or
                 * interleaves contexts they alternate) is timed long: it
                 * may lower the estimate, never raise it. */
                int cont = m->cont || contended(ss);
                if (dur > 0 && timed > 0 && (!cont || (uint64_t)dur / timed < ss->avg_ns))
                    learn(ss, (uint64_t)dur / timed);
                if (dur > 0 && timed > 0 && !cont)
                    learn_clean(ss, (uint64_t)dur / timed);
                uint64_t first = 0;
                int64_t k1;
                if (m->idle && m->ref0 && elapsed_ns(m->ref0, m->ref, &k1) == 0 && k1 > 0) {
                    /* Without another instance on the GPU the wait is only
                     * the device taking the launch: k1 is what it took.
                     * Otherwise k1 includes the wait behind (or between)
                     * the other instance's work: an upper bound, charged at
                     * most the clean estimate of one launch, which it may
                     * lower, never raise. */
                    first = (uint64_t)k1;
                    /* With several streams the wait may be behind the
                     * process's own other stream: capped as before. */
                    int single = g_dev_streams[ss->dev->ordinal] <= 1;
                    if (!cont && single) {
                        learn(ss, first);
                        learn_clean(ss, first);
                    } else {
                        uint64_t ce = clean_est(ss);
                        uint64_t est = single && ce ? ce : m->first_est;
                        if (est && first > est)
                            first = est;
                        if (!ss->avg_ns || (uint64_t)k1 < ss->avg_ns)
                            learn(ss, (uint64_t)k1);
                    }
                }
                if (dur > 0 || first) {
                    placed = 1;
                    uint64_t add = batch_time(ss, m->ref, m->end, (uint64_t)dur + first, first, m->contig, cont, &kept);
                    /* Interleaved: charged what its launches take when
                     * nobody else runs (the clean estimate), once it
                     * measured evidently more than that (interleaved()).
                     * Capping every contended
                     * batch at the mean charged less than the device ran:
                     * a batch's own time spreads around the mean, and
                     * cutting the upper half under-charged a 30 of 100 µs
                     * kernels by 2.2 points beside a 70 of 8 ms ones. */
                    uint64_t est = clean_est(ss);
                    if (cont && est && dur > 0 && interleaved(ss, timed, (uint64_t)dur, est) &&
                        timed * est + first < add)
                        add = timed * est + first;
                    gpu += add;
#ifdef MGPU_TRACE
                    struct timespec tts;
                    clock_gettime(CLOCK_MONOTONIC, &tts);
                    fprintf(stderr, "mgpu-trace %d t=%llu n=%llu dur=%lld first=%llu avg=%llu clean=%llu cont=%d idle=%d add=%llu\n",
                            (int)getpid(), (unsigned long long)tts.tv_sec * 1000000000ull + (unsigned long long)tts.tv_nsec,
                            (unsigned long long)n, (long long)dur, (unsigned long long)first, (unsigned long long)ss->avg_ns,
                            (unsigned long long)ss->clean_ns, cont, m->idle, (unsigned long long)add);
#endif
                }
            }
        }
        if (!placed)
            ss->last_end = 0; /* the next batch cannot follow an unplaced one */
        ss->completed = m->at > ss->completed ? m->at : ss->completed;
        ss->est_done = m->est_at > ss->est_done ? m->est_at : ss->est_done;
        ev_put(ss, m->ref0);
        if (kept == 1)
            ss->nevents--; /* the anchor left the pool */
        else
            ev_put(ss, m->ref);
        if (kept == 2)
            ss->nevents--;
        else
            ev_put(ss, m->end);
        ss->head = (ss->head + 1) % MGPU_RING;
        ss->count--;
    }
    if (gpu)
        atomic_fetch_add_explicit(&ss->dev->slot->gpu_ns, gpu, memory_order_relaxed);
    if (ss->avg_ns) {
        uint64_t pm = target_mark_ns(ss->dev) / ss->avg_ns;
        ss->per_mark = pm < 1 ? 1 : pm > MGPU_MAX_PER_MARK ? MGPU_MAX_PER_MARK : pm;
        fold(ss, atomic_load_explicit(&ss->submitted, memory_order_relaxed) - pending);
        ss->cur_est = ss->avg_ns;
    }
    set_queued(ss, pending);
}

/* Waits for the stream's oldest outstanding mark; drops and retakes the lock. */
static void wait_oldest(struct sstate *ss)
{
    CUevent e = ss->ring[ss->head].end;
    pthread_mutex_unlock(&mgpu_acct_mu);
    REAL(cuEventSynchronize)(e);
    pthread_mutex_lock(&mgpu_acct_mu);
}

/* Records a mark after launch number at, ending the open batch. */
static int record_mark(struct sstate *ss, uint64_t at, uint64_t pending)
{
    if (!ss->batch_ref)
        return -1;
    while (ss->count == MGPU_RING) {
        wait_oldest(ss);
        poll_ss(ss, pending);
        if (ss->gen != mgpu_generation)
            return -1;
    }
    CUevent e = ev_get(ss);
    if (!e)
        return -1;
    if (REAL(cuEventRecord)(e, stream_handle(ss)) != CUDA_SUCCESS) {
        ev_put(ss, e);
        return -1;
    }
    fold(ss, at);
    unsigned i = (ss->head + ss->count) % MGPU_RING;
    ss->ring[i] = (struct mark){
        .ref = ss->batch_ref, .end = e, .at = at, .est_at = ss->est_total, .first_est = ss->batch_first,
        .idle = ss->batch_idle, .ref0 = ss->batch_ref0, .contig = ss->batch_contig,
        .cont = ss->batch_cont || contended(ss)};
    ss->count++;
    ss->batch_ref = NULL;
    ss->batch_ref0 = NULL;
    ss->batch_first = 0;
    ss->batch_idle = 0;
    ss->batch_contig = 0;
    ss->batch_cont = 0;
    ss->marked = at;
    return 0;
}

/* Room left under max_queued_ns for this stream (UINT64_MAX: unbounded). */
static uint64_t room(const struct sstate *ss)
{
    uint64_t b = qbound(ss->dev);
    if (!b)
        return UINT64_MAX;
    uint64_t others = g_dev_queued[ss->dev->ordinal] - ss->queued_ns;
    uint64_t r = b > others ? b - others : 0;
    return r > ss->queued_ns ? r - ss->queued_ns : 0;
}

/* Whether launch n (not yet counted in queued_ns) may go now. */
static int may_launch(const struct sstate *ss, uint64_t n)
{
    uint64_t out = n - 1 > ss->completed ? n - 1 - ss->completed : 0;
    uint64_t b = qbound(ss->dev);
    if (out == 0 || !b)
        return 1;
    if (!ss->cur_est)
        return out < 2; /* not measured yet: learn the kernel time first */
    /* A second launch may always wait behind the running one when a launch
     * fits the bound: a one-deep pipeline drains before every launch and
     * idles the device while the host wakes.  The tail after a revoke stays
     * within two bounds. */
    if (out == 1 && ss->cur_est <= b)
        return 1;
    return ss->cur_est <= room(ss);
}

static void set_check(struct sstate *ss, uint64_t n)
{
    /* no open batch: the next launch starts one */
    uint64_t next = ss->marked == n || (!ss->batch_ref && !ss->ref_after) ? n + 1 : ss->marked + ss->per_mark;
    uint64_t bound = qbound(ss->dev);
    if (bound) {
        uint64_t b;
        if (!ss->cur_est)
            b = ss->completed + 2;
        else
            b = n + room(ss) / ss->cur_est; /* the first launch that must check again */
        if (ss->cur_est && ss->cur_est <= bound && b < ss->completed + 2)
            b = ss->completed + 2; /* see may_launch: two outstanding */
        if (b < next)
            next = b;
    }
    if (next <= n)
        next = n + 1;
    atomic_store_explicit(&ss->check_at, next, memory_order_relaxed);
}

/* Before launch number n: bound the queue, start a batch.  With gated set,
 * a grant revoked while the launch waited for room in the queue stops it:
 * pre_launch then starts nothing, leaves the stream's next launch on the
 * slow path and returns 1 (the caller takes the launch back and waits for
 * the grant), so that the work queued after a revoke is what was queued
 * before it. */
static int pre_launch(struct sstate *ss, uint64_t n, int gated)
{
    pthread_mutex_lock(&mgpu_acct_mu);
    if (ss->gen != mgpu_generation) {
        ss_reset(ss);
        atomic_store(&ss->submitted, n);
        ss->marked = ss->completed = n - 1;
    }
    /* While it waits for room (wait_oldest drops the lock), another
     * thread's flush must not mark past launch n-1: n is not on the stream
     * yet, and the batch started below covers it. */
    ss->admitting = n;
    poll_ss(ss, 1);
    for (;;) {
        if (may_launch(ss, n))
            break;
        if (ss->marked < n - 1 && record_mark(ss, n - 1, 1))
            break;
        if (!ss->count)
            break;
        wait_oldest(ss);
        if (ss->gen != mgpu_generation)
            break;
        poll_ss(ss, 1);
        if (gated && atomic_load_explicit(&ss->dev->region->grant, memory_order_acquire) == 0) {
            atomic_store_explicit(&ss->check_at, n, memory_order_relaxed);
            ss->admitting = 0;
            pthread_mutex_unlock(&mgpu_acct_mu);
            return 1;
        }
    }
    ss->admitting = 0;
    /* Start a batch.  Launches after the newest mark that no batch covers
     * (another thread's flush marked past an open batch) join this one. */
    if (ss->marked < n && !ss->batch_ref && !ss->ref_after) {
        ss->batch_cont = contended(ss);
        if (!ss->counted) { /* a capture stream never gets here */
            ss->counted = 1;
            g_dev_streams[ss->dev->ordinal]++;
        }
        if (ss->count == 0) {
            ss->ref_after = 1; /* idle: start the batch after this launch */
            CUevent e0 = ev_get(ss);
            if (e0 && REAL(cuEventRecord)(e0, stream_handle(ss)) == CUDA_SUCCESS)
                ss->batch_ref0 = e0;
            else
                ev_put(ss, e0);
        } else {
            CUevent e = ev_get(ss);
            if (e && REAL(cuEventRecord)(e, stream_handle(ss)) == CUDA_SUCCESS) {
                ss->batch_ref = e;
                ss->batch_contig = 1; /* the newest mark was pending at the last poll */
            } else {
                ev_put(ss, e);
            }
        }
    }
    set_check(ss, n);
    pthread_mutex_unlock(&mgpu_acct_mu);
    return 0;
}

/* After launch number n (when pre_launch ran for it). */
static void post_launch(struct sstate *ss, uint64_t n, CUresult r)
{
    pthread_mutex_lock(&mgpu_acct_mu);
    if (r != CUDA_SUCCESS) {
        uint64_t exp = n;
        atomic_compare_exchange_strong(&ss->submitted, &exp, n - 1);
        if (ss->ref_after) {
            ss->ref_after = 0;
            ev_put(ss, ss->batch_ref0); /* recorded, completes at once: reusable */
            ss->batch_ref0 = NULL;
        }
    } else if (ss->gen == mgpu_generation) {
        if (ss->ref_after) {
            ss->ref_after = 0;
            CUevent e = ev_get(ss);
            if (e && REAL(cuEventRecord)(e, stream_handle(ss)) == CUDA_SUCCESS) {
                ss->batch_ref = e;
                ss->batch_idle = 1;
                ss->batch_first = ss->avg_ns; /* 0 before the first measurement */
            } else {
                ev_put(ss, e);
                ev_put(ss, ss->batch_ref0);
                ss->batch_ref0 = NULL;
            }
        }
        /* an idle start's batch times its launches after the first: keep
         * it open for at least one more */
        uint64_t len = ss->batch_idle && ss->per_mark < 2 ? 2 : ss->per_mark;
        if (n >= ss->marked + len)
            record_mark(ss, n, 0);
    }
    set_queued(ss, 0);
    set_check(ss, n);
    pthread_mutex_unlock(&mgpu_acct_mu);
}

/* Ends the stream's open batch so that a synchronisation completes it.
 *
 * A mark must not count a launch that is numbered but not yet on the
 * stream: that kernel would run after the mark, outside every batch, and
 * go unmeasured (the mark's batch, timing no kernel of it, also taught the
 * estimate a launch of a few hundred ns).  With threads sharing a stream
 * that happened whenever one synchronised while another waited for room in
 * the queue: a 30 % instance of four threads on one stream was charged
 * 24.8 % for 28.9 % of the device.  So: a launch waiting in pre_launch is
 * left out (the batch pre_launch then starts covers it); a shared stream
 * is flushed only while no launch holds its launch_mu (numbering and the
 * driver's launch happen under it; one in flight closes the batch itself,
 * in due course); another thread's own stream is flushed only at launches
 * it has issued or is admitting, which leaves the microseconds between a
 * fast-path launch's number and its driver call (docs: Known limits). */
static void flush_ss(struct sstate *ss)
{
    if (ss->gen != mgpu_generation || atomic_load(&ss->capturing))
        return;
    if (ss->key == KEY_PER_THREAD && !pthread_equal(ss->owner, pthread_self()))
        return;
    int locked = 0;
    if (atomic_load_explicit(&ss->shared, memory_order_relaxed)) {
        if (pthread_mutex_trylock(&ss->launch_mu) != 0)
            return; /* a launch is in flight on it */
        locked = 1;
    }
    uint64_t sub = atomic_load_explicit(&ss->submitted, memory_order_relaxed);
    if (ss->admitting && ss->admitting <= sub)
        sub = ss->admitting - 1;
    if (sub > ss->marked && record_mark(ss, sub, 0) == 0 && !ss->admitting)
        atomic_store_explicit(&ss->check_at, sub + 1, memory_order_relaxed);
    if (locked)
        pthread_mutex_unlock(&ss->launch_mu);
}

static void poll_all(void)
{
    for (struct sstate *ss = g_streams; ss; ss = ss->next)
        if (ss->gen == mgpu_generation && ss->count) {
            poll_ss(ss, 0);
            set_check(ss, atomic_load_explicit(&ss->submitted, memory_order_relaxed));
        }
}

/* Whether any stream has marks outstanding (under mgpu_acct_mu). */
static int outstanding(void)
{
    for (struct sstate *ss = g_streams; ss; ss = ss->next)
        if (ss->gen == mgpu_generation && ss->count)
            return 1;
    return 0;
}

void mgpu_launch_reset_after_fork(void)
{
    /* The fork child only (atfork_child, with mgpu_acct_mu fresh): it
     * re-initialises launch mutexes that a parent's thread may have held. */
    for (struct sstate *ss = g_streams; ss; ss = ss->next) {
        atomic_store(&ss->check_at, 0); /* the next launch takes the slow path and resets it */
        pthread_mutex_init(&ss->launch_mu, NULL); /* a parent's thread may have held it */
    }
    memset(g_dev_queued, 0, sizeof g_dev_queued);
    memset(g_dev_streams, 0, sizeof g_dev_streams);
    memset(g_clock, 0, sizeof g_clock); /* the anchors belong to the parent's contexts */
}

/* ---- stream state lookup ---- */

static struct sstate *find_locked(struct mgpu_dev *d, uintptr_t key, int create)
{
    pthread_t self = pthread_self();
    for (struct sstate *ss = g_streams; ss; ss = ss->next)
        if (ss->dev == d && ss->key == key && (key != KEY_PER_THREAD || pthread_equal(ss->owner, self)))
            return ss;
    if (!create || g_nstreams >= MGPU_MAX_STREAMS)
        return NULL;
    struct sstate *ss = calloc(1, sizeof *ss);
    if (!ss)
        return NULL;
    ss->dev = d;
    ss->key = key;
    ss->owner = self;
    pthread_mutex_init(&ss->launch_mu, NULL);
    ss_reset(ss);
    ss->next = g_streams;
    g_streams = ss;
    g_nstreams++;
    return ss;
}

static __attribute__((noinline)) struct sstate *lookup_slow(struct mgpu_dev *d, uintptr_t key)
{
    for (int i = 1; i < TL_ENTS; i++)
        if (tl_cache[i].dev == d && tl_cache[i].key == key) {
            struct tl_ent e = tl_cache[i];
            memmove(&tl_cache[1], &tl_cache[0], (size_t)i * sizeof e);
            tl_cache[0] = e;
            return e.ss;
        }
    pthread_mutex_lock(&mgpu_acct_mu);
    struct sstate *ss = find_locked(d, key, 1);
    if (ss && !pthread_equal(ss->owner, pthread_self()))
        atomic_store(&ss->shared, 1); /* a second thread launches on it */
    pthread_mutex_unlock(&mgpu_acct_mu);
    if (ss) {
        memmove(&tl_cache[1], &tl_cache[0], (TL_ENTS - 1) * sizeof tl_cache[0]);
        tl_cache[0] = (struct tl_ent){d, key, ss};
    }
    return ss;
}

static inline struct sstate *lookup(struct mgpu_dev *d, uintptr_t key)
{
    if (MGPU_LIKELY(tl_cache[0].key == key && tl_cache[0].dev == d))
        return tl_cache[0].ss;
    return lookup_slow(d, key);
}

/* ---- waiting for a grant ---- */

static __attribute__((noinline)) void wait_grant(struct mgpu_dev *d)
{
    /* End the open batches first: a batch left open across the wait would be
     * timed over the other instances' turns and charge them to us. */
    pthread_mutex_lock(&mgpu_acct_mu);
    for (struct sstate *ss = g_streams; ss; ss = ss->next)
        if (ss->dev == d && ss->batch_ref)
            flush_ss(ss);
    pthread_mutex_unlock(&mgpu_acct_mu);
    atomic_fetch_add(&d->slot->waiting, 1); /* before the word: see set_queued */
    if (atomic_load(&d->region->wake) & MGPU_WAKE_BUSY)
        mgpu_wake(d); /* new demand: the holder may be quiet, an offline filler must stop */
    uint64_t t0 = now_ns();
    int draining = 1;
    while (atomic_load(&d->region->grant) == 0) {
        /* Keep gpu_ns / queued_ns current while the queue drains; once
         * it has, nothing changes until the grant: a revoked process then
         * stays off the CPU, which the instance that holds the grant
         * shares with it (1000 wake-ups a second otherwise). */
        struct timespec ts = {.tv_sec = 0, .tv_nsec = draining ? MGPU_WAIT_SLICE_NS : MGPU_WAIT_IDLE_NS};
        syscall(SYS_futex, &d->region->grant, FUTEX_WAIT, 0, &ts, NULL, 0);
        if (draining && pthread_mutex_trylock(&mgpu_acct_mu) == 0) {
            poll_all();
            draining = outstanding();
            pthread_mutex_unlock(&mgpu_acct_mu);
        }
    }
    atomic_fetch_add(&d->slot->throttled_ns, now_ns() - t0);
    atomic_fetch_sub(&d->slot->waiting, 1);
    if (atomic_load(&d->region->grant) == MGPU_GRANT_ONE) {
        /* One launch outstanding from now on: the next launch on every
         * stream takes the slow path, which applies it. */
        pthread_mutex_lock(&mgpu_acct_mu);
        for (struct sstate *ss = g_streams; ss; ss = ss->next)
            if (ss->dev == d)
                atomic_store_explicit(&ss->check_at, 0, memory_order_relaxed);
        pthread_mutex_unlock(&mgpu_acct_mu);
    }
}

/* ---- the gate ---- */

struct gate {
    struct mgpu_dev *d; /* NULL: pass through */
    struct sstate *ss;  /* NULL: gated, not measured */
    uint64_t n;
    int slow;
    int locked; /* holds ss->launch_mu */
};

/* Numbers the launch on ss (g->n).  Launch numbers must follow the stream's
 * order, which marks and batches are counted in: threads that share a
 * stream (the legacy stream, one handed between worker threads) launch on
 * it one at a time.  The number is a read-modify-write all the same: the
 * launch in flight on the owner thread when a second thread marks the
 * stream shared must not reuse it.  Returns whether the launch takes the
 * slow path. */
static inline int gate_number(struct gate *g, struct sstate *ss)
{
    if (MGPU_UNLIKELY(atomic_load_explicit(&ss->shared, memory_order_relaxed))) {
        pthread_mutex_lock(&ss->launch_mu);
        g->locked = 1;
    }
    g->n = atomic_fetch_add_explicit(&ss->submitted, 1, memory_order_relaxed) + 1;
    return g->n >= atomic_load_explicit(&ss->check_at, memory_order_relaxed);
}

/* Launch number n waited for room in the queue while the grant was revoked
 * (pre_launch said so): take it back, wait for the next grant and number
 * the launch again.  Only if another thread launched on the stream
 * meanwhile (it became shared) must it go now. */
static __attribute__((noinline)) void gate_retry(struct gate *g, struct mgpu_dev *d, struct sstate *ss)
{
    for (;;) {
        uint64_t exp = g->n;
        if (!atomic_compare_exchange_strong(&ss->submitted, &exp, g->n - 1)) {
            pre_launch(ss, g->n, 0);
            return;
        }
        atomic_fetch_sub_explicit(&d->slot->launches, 1, memory_order_relaxed);
        if (g->locked)
            pthread_mutex_unlock(&ss->launch_mu);
        g->locked = 0;
        g->slow = 0;
        wait_grant(d);
        atomic_fetch_add_explicit(&d->slot->launches, 1, memory_order_relaxed);
        if (!gate_number(g, ss))
            return;
        g->slow = 1;
        if (!pre_launch(ss, g->n, 1))
            return;
    }
}

static inline CUresult gate_enter(struct gate *g, CUstream h, int ptsz)
{
    struct mgpu_dev *d = atomic_load_explicit(&mgpu_fast_dev, memory_order_relaxed);
    g->d = NULL;
    g->slow = 0;
    g->locked = 0;
    if (MGPU_UNLIKELY(!d)) {
        CUresult r = mgpu_resolve_dev(-1, &d);
        if (r != CUDA_SUCCESS || !d)
            return r;
    }
    struct sstate *ss = lookup(d, stream_key(h, ptsz));
    g->ss = ss;
    if (MGPU_UNLIKELY(ss && atomic_load_explicit(&ss->capturing, memory_order_relaxed)))
        return CUDA_SUCCESS; /* building a graph: nothing runs now */
    if (MGPU_UNLIKELY(atomic_load_explicit(&d->region->grant, memory_order_acquire) == 0))
        wait_grant(d);
    atomic_fetch_add_explicit(&d->slot->launches, 1, memory_order_relaxed);
    g->d = d;
    if (MGPU_UNLIKELY(!ss))
        return CUDA_SUCCESS;
    if (MGPU_UNLIKELY(gate_number(g, ss))) {
        g->slow = 1;
        if (MGPU_UNLIKELY(pre_launch(ss, g->n, 1)))
            gate_retry(g, d, ss);
    }
    return CUDA_SUCCESS;
}

static inline CUresult gate_leave(struct gate *g, CUresult r)
{
    if (MGPU_UNLIKELY(g->slow))
        post_launch(g->ss, g->n, r);
    else if (MGPU_UNLIKELY(r != CUDA_SUCCESS) && g->ss && g->d) {
        uint64_t exp = g->n;
        atomic_compare_exchange_strong(&g->ss->submitted, &exp, g->n - 1);
    }
    if (MGPU_UNLIKELY(g->locked))
        pthread_mutex_unlock(&g->ss->launch_mu);
    return r;
}

#define GATED(stream, ptsz, call)                                                                                 \
    do {                                                                                                          \
        struct gate g_;                                                                                           \
        CUresult e_ = gate_enter(&g_, (stream), (ptsz));                                                          \
        if (MGPU_UNLIKELY(e_ != CUDA_SUCCESS))                                                                    \
            return e_;                                                                                            \
        return gate_leave(&g_, (call));                                                                           \
    } while (0)

MGPU_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                    unsigned int by, unsigned int bz, unsigned int shm, CUstream s, void **params,
                                    void **extra)
{
    GATED(s, 0, REAL(cuLaunchKernel)(f, gx, gy, gz, bx, by, bz, shm, s, params, extra));
}
MGPU_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                         unsigned int bx, unsigned int by, unsigned int bz, unsigned int shm,
                                         CUstream s, void **params, void **extra)
{
    GATED(s, 1, REAL(cuLaunchKernel_ptsz)(f, gx, gy, gz, bx, by, bz, shm, s, params, extra));
}
MGPU_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{
    GATED(config ? config->hStream : NULL, 0, REAL(cuLaunchKernelEx)(config, f, params, extra));
}
MGPU_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{
    GATED(config ? config->hStream : NULL, 1, REAL(cuLaunchKernelEx_ptsz)(config, f, params, extra));
}
MGPU_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                               unsigned int bx, unsigned int by, unsigned int bz, unsigned int shm,
                                               CUstream s, void **params)
{
    GATED(s, 0, REAL(cuLaunchCooperativeKernel)(f, gx, gy, gz, bx, by, bz, shm, s, params));
}
MGPU_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                                    unsigned int bx, unsigned int by, unsigned int bz,
                                                    unsigned int shm, CUstream s, void **params)
{
    GATED(s, 1, REAL(cuLaunchCooperativeKernel_ptsz)(f, gx, gy, gz, bx, by, bz, shm, s, params));
}
MGPU_EXPORT CUresult cuGraphLaunch(CUgraphExec ge, CUstream s)
{
    GATED(s, 0, REAL(cuGraphLaunch)(ge, s));
}
MGPU_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec ge, CUstream s)
{
    GATED(s, 1, REAL(cuGraphLaunch_ptsz)(ge, s));
}

/* ---- synchronisation: complete the open batches so gpu_ns is current ---- */

static int accounting(void)
{
    return mgpu_load_cuda() == 0 && atomic_load_explicit(&mgpu_state_now, memory_order_acquire) == MGPU_ST_READY;
}

static CUresult stream_sync(CUstream h, int ptsz, CUresult (*real)(CUstream))
{
    if (mgpu_load_cuda() || !real)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!accounting())
        return real(h);
    CUresult err;
    struct mgpu_dev *d = mgpu_current_dev(&err);
    struct sstate *ss = NULL;
    if (d) {
        uintptr_t key = stream_key(h, ptsz);
        pthread_mutex_lock(&mgpu_acct_mu);
        ss = find_locked(d, key, 0);
        if (ss)
            flush_ss(ss);
        pthread_mutex_unlock(&mgpu_acct_mu);
    }
    CUresult r = real(h);
    if (ss) {
        pthread_mutex_lock(&mgpu_acct_mu);
        if (ss->gen == mgpu_generation) {
            poll_ss(ss, 0);
            set_check(ss, atomic_load_explicit(&ss->submitted, memory_order_relaxed));
        }
        pthread_mutex_unlock(&mgpu_acct_mu);
    }
    return r;
}

MGPU_EXPORT CUresult cuStreamSynchronize(CUstream s)
{
    return stream_sync(s, 0, REAL(cuStreamSynchronize));
}
MGPU_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s)
{
    return stream_sync(s, 1, REAL(cuStreamSynchronize_ptsz));
}

static void flush_all(void)
{
    pthread_mutex_lock(&mgpu_acct_mu);
    for (struct sstate *ss = g_streams; ss; ss = ss->next)
        flush_ss(ss);
    pthread_mutex_unlock(&mgpu_acct_mu);
}

static void poll_all_locked(void)
{
    pthread_mutex_lock(&mgpu_acct_mu);
    poll_all();
    pthread_mutex_unlock(&mgpu_acct_mu);
}

MGPU_EXPORT CUresult cuCtxSynchronize(void)
{
    if (mgpu_load_cuda())
        return CUDA_ERROR_NOT_INITIALIZED;
    int acct = accounting();
    if (acct)
        flush_all();
    CUresult r = REAL(cuCtxSynchronize)();
    if (acct)
        poll_all_locked();
    return r;
}

MGPU_EXPORT CUresult cuEventSynchronize(CUevent e)
{
    if (mgpu_load_cuda())
        return CUDA_ERROR_NOT_INITIALIZED;
    int acct = accounting();
    if (acct)
        flush_all();
    CUresult r = REAL(cuEventSynchronize)(e);
    if (acct)
        poll_all_locked();
    return r;
}

/* ---- capture: launches on a capturing stream are neither gated nor measured ---- */

static CUresult begin_capture(CUstream h, int ptsz, CUstreamCaptureMode mode,
                              CUresult (*real)(CUstream, CUstreamCaptureMode))
{
    if (mgpu_load_cuda() || !real)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct sstate *ss = NULL;
    CUresult err;
    struct mgpu_dev *d = accounting() ? mgpu_current_dev(&err) : NULL;
    if (d) {
        pthread_mutex_lock(&mgpu_acct_mu);
        ss = find_locked(d, stream_key(h, ptsz), 1);
        if (ss) {
            if (ss->gen != mgpu_generation)
                ss_reset(ss);
            flush_ss(ss); /* no events can be recorded into the capture */
            atomic_store(&ss->capturing, 1);
        }
        pthread_mutex_unlock(&mgpu_acct_mu);
    }
    CUresult r = real(h, mode);
    if (r != CUDA_SUCCESS && ss)
        atomic_store(&ss->capturing, 0);
    return r;
}

static CUresult end_capture(CUstream h, int ptsz, CUgraph *g, CUresult (*real)(CUstream, CUgraph *))
{
    if (mgpu_load_cuda() || !real)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(h, g);
    CUresult err;
    struct mgpu_dev *d = accounting() ? mgpu_current_dev(&err) : NULL;
    if (d) {
        pthread_mutex_lock(&mgpu_acct_mu);
        struct sstate *ss = find_locked(d, stream_key(h, ptsz), 0);
        if (ss)
            atomic_store(&ss->capturing, 0);
        pthread_mutex_unlock(&mgpu_acct_mu);
    }
    return r;
}

MGPU_EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode)
{
    return begin_capture(s, 0, mode, REAL(cuStreamBeginCapture_v2));
}
MGPU_EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream s, CUstreamCaptureMode mode)
{
    return begin_capture(s, 1, mode, REAL(cuStreamBeginCapture_v2_ptsz));
}
MGPU_EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph *g)
{
    return end_capture(s, 0, g, REAL(cuStreamEndCapture));
}
MGPU_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *g)
{
    return end_capture(s, 1, g, REAL(cuStreamEndCapture_ptsz));
}
