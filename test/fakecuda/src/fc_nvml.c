/*
 * fc_nvml.c - libnvidia-ml.so.1 of the simulated GPU: device count, memory
 * info and the per-process queries (running processes, process
 * utilisation) from the shared device state (host indexes; NVML ignores
 * CUDA_VISIBLE_DEVICES, like the real one).  Pids are reported in the
 * caller's pid namespace, translated through /proc (README.md, "NVML").
 */
#define _GNU_SOURCE
#include "mgpu_cuda.h"
#include "fc_nvml.h"
#include "fc_state.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define FC_API __attribute__((visibility("default")))

struct nvmlDevice_st {
    unsigned index;
    struct fc_dev *dev;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int refs;
static unsigned count;
static struct nvmlDevice_st devs[FC_MAX_DEVICES];
static uint64_t self_pidns; /* the caller's pid namespace (0: unknown), read at the first nvmlInit_v2 */

FC_API nvmlReturn_t nvmlInit_v2(void)
{
    nvmlReturn_t r = NVML_SUCCESS;
    pthread_mutex_lock(&mu);
    const char *bad = "";
    if (refs == 0 && fc_env_model(&bad) < 0) {
        fprintf(stderr, "fakecuda: unknown FAKECUDA_DEVICE_MODEL=%s (want slice, timer or kernel)\n", bad);
        pthread_mutex_unlock(&mu);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (refs == 0) {
        int n = fc_env_devices();
        for (int i = 0; i < n; i++) {
            devs[i].index = (unsigned)i;
            if (!devs[i].dev)
                devs[i].dev = fc_dev_open(i, 1);
            if (!devs[i].dev) {
                fprintf(stderr, "fakecuda nvml: device %d state in %s: %s\n", i, fc_env_state_dir(),
                        strerror(errno));
                r = NVML_ERROR_UNKNOWN;
                break;
            }
        }
        if (r == NVML_SUCCESS) {
            count = (unsigned)n;
            self_pidns = fc_self_pidns();
        }
    }
    if (r == NVML_SUCCESS)
        refs++;
    pthread_mutex_unlock(&mu);
    return r;
}

FC_API nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t r = NVML_SUCCESS;
    pthread_mutex_lock(&mu);
    if (refs == 0)
        r = NVML_ERROR_UNINITIALIZED;
    else
        refs--;
    pthread_mutex_unlock(&mu);
    return r; /* mappings are kept: handles stay valid, like NVML's */
}

static int inited(void)
{
    pthread_mutex_lock(&mu);
    int r = refs > 0;
    pthread_mutex_unlock(&mu);
    return r;
}

FC_API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!deviceCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = count;
    return NVML_SUCCESS;
}

FC_API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devs[index];
    return NVML_SUCCESS;
}

static int valid(nvmlDevice_t d)
{
    return d && d >= &devs[0] && d < &devs[count] && d->dev;
}

FC_API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !index)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = device->index;
    return NVML_SUCCESS;
}

static void mem(nvmlDevice_t d, unsigned long long *total, unsigned long long *used)
{
    fc_dev_lock(d->dev);
    fc_reap_locked(d->dev); /* a dead process's memory is free, as with the driver */
    *total = d->dev->mem_total;
    *used = d->dev->mem_used;
    fc_dev_unlock(d->dev);
    if (*used > *total)
        *used = *total;
}

FC_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    mem(device, &memory->total, &memory->used);
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

FC_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2)
        return FC_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    mem(device, &memory->total, &memory->used);
    memory->reserved = 0;
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

FC_API const char *nvmlErrorString(nvmlReturn_t result)
{
    switch ((int)result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 25: return "Argument version mismatch";
    case 999: return "Unknown Error";
    default: return "Unknown Error";
    }
}

/* ---- per-process queries ---- */

/* One process of an answer, read under the device lock. */
struct qproc {
    int32_t pid;       /* in its own pid namespace; then in the caller's (translate) */
    uint64_t pidns;    /* its pid namespace */
    uint64_t start_ns; /* its registration: tells a reused pid apart */
    uint64_t mem;
    unsigned util;
};

/* Guards q and the pid cache; held for a whole query. */
static pthread_mutex_t qmu = PTHREAD_MUTEX_INITIALIZER;
static struct qproc q[FC_MAX_PROCS];

/* Translations of processes of other pid namespaces: host 0 means not
 * visible in the caller's /proc (skipped).  A registration is alive while
 * it is reported, so its translation cannot change. */
#define FC_XLATE 256
static struct xlate {
    uint64_t pidns, start_ns;
    int32_t pid, host;
} xcache[FC_XLATE];
static unsigned xnext;

static int xlate_find(const struct qproc *v)
{
    for (int i = 0; i < FC_XLATE; i++) {
        const struct xlate *x = &xcache[i];
        if (x->pidns == v->pidns && x->pid == v->pid && x->start_ns == v->start_ns && x->pidns)
            return x->host;
    }
    return -1;
}

static void xlate_add(const struct qproc *v, int host)
{
    xcache[xnext++ % FC_XLATE] = (struct xlate){v->pidns, v->start_ns, v->pid, host};
}

/* The last number of the NSpid: line of /proc/<pid>/status (the process's
 * pid in its own namespace), or -1. */
static long nspid_last(long pid)
{
    char path[64], buf[8192];
    snprintf(path, sizeof(path), "/proc/%ld/status", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t len = 0;
    for (;;) {
        ssize_t r = read(fd, buf + len, sizeof(buf) - 1 - len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        len += (size_t)r;
        if (len == sizeof(buf) - 1)
            break;
    }
    close(fd);
    buf[len] = 0;
    const char *l = strstr(buf, "\nNSpid:");
    if (!l)
        return -1;
    long last = -1;
    for (const char *c = l + 7; *c && *c != '\n';) {
        if (*c >= '0' && *c <= '9') {
            char *end;
            last = strtol(c, &end, 10);
            c = end;
        } else {
            c++;
        }
    }
    return last;
}

/* Finds in /proc the processes of v[] that need it (pid < 0 marks them:
 * -pid-1 is the pid in their namespace): /proc/<N>/ns/pid is their
 * namespace and the last NSpid field their pid, then N is their pid here. */
static void xlate_scan(struct qproc *v, int n, int need)
{
    DIR *dir = opendir("/proc");
    if (!dir)
        return; /* skipped this time, not remembered */
    struct dirent *e;
    while (need > 0 && (e = readdir(dir)) != NULL) {
        char *end = NULL;
        long host = strtol(e->d_name, &end, 10);
        if (e->d_name[0] < '1' || e->d_name[0] > '9' || *end || host <= 0 || host > INT32_MAX)
            continue;
        char path[64];
        snprintf(path, sizeof(path), "/proc/%ld/ns/pid", host);
        struct stat st;
        if (stat(path, &st))
            continue;
        int match = 0;
        for (int i = 0; i < n && !match; i++)
            match = v[i].pid < 0 && v[i].pidns == (uint64_t)st.st_ino;
        if (!match)
            continue;
        long last = nspid_last(host);
        for (int i = 0; i < n; i++) {
            if (v[i].pid < 0 && v[i].pidns == (uint64_t)st.st_ino && -(long)v[i].pid - 1 == last) {
                v[i].pid = (int32_t)(-v[i].pid - 1);
                xlate_add(&v[i], (int)host);
                v[i].pid = (int32_t)host;
                need--;
            }
        }
    }
    closedir(dir);
    for (int i = 0; i < n; i++) {
        if (v[i].pid < 0) {
            v[i].pid = (int32_t)(-v[i].pid - 1);
            xlate_add(&v[i], 0); /* not visible from here */
            v[i].pid = 0;
        }
    }
}

/* Reports each process's pid in the caller's pid namespace: as registered
 * when it is the same namespace (or either is unknown), else translated
 * through /proc; drops the ones that have no pid here.  Returns how many
 * are left.  With qmu held. */
static int translate(struct qproc *v, int n)
{
    int need = 0;
    for (int i = 0; i < n; i++) {
        if (!self_pidns || !v[i].pidns || v[i].pidns == self_pidns)
            continue;
        int host = xlate_find(&v[i]);
        if (host >= 0) {
            v[i].pid = host;
        } else {
            v[i].pid = -v[i].pid - 1; /* to find */
            need++;
        }
    }
    if (need)
        xlate_scan(v, n, need);
    int k = 0;
    for (int i = 0; i < n; i++)
        if (v[i].pid > 0)
            v[k++] = v[i];
    return k;
}

/* The processes with a context on the device (or memory there), alive. */
static int collect_running(struct fc_dev *d)
{
    int n = 0;
    fc_dev_lock(d);
    fc_reap_locked(d);
    for (int i = 0; i < FC_MAX_PROCS; i++) {
        const struct fc_proc *p = &d->procs[i];
        if (p->state == FC_PROC_ALIVE && (p->ctxs > 0 || p->mem_used > 0))
            q[n++] = (struct qproc){p->pid, p->pidns, p->start_ns, p->mem_used, 0};
    }
    fc_dev_unlock(d);
    return n;
}

/* version: 1 (nvmlProcessInfo_v1_t), 2 or 3 (nvmlProcessInfo_t). */
static nvmlReturn_t running(nvmlDevice_t device, unsigned int *infoCount, void *infos, int version)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !infoCount || (!infos && *infoCount))
        return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&qmu);
    int n = translate(q, collect_running(device->dev));
    nvmlReturn_t r = NVML_SUCCESS;
    if ((unsigned)n > *infoCount) {
        r = FC_NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        for (int i = 0; i < n; i++) {
            if (version == 1)
                ((nvmlProcessInfo_v1_t *)infos)[i] = (nvmlProcessInfo_v1_t){(unsigned)q[i].pid, q[i].mem};
            else
                ((nvmlProcessInfo_t *)infos)[i] =
                    (nvmlProcessInfo_t){(unsigned)q[i].pid, q[i].mem, FC_NVML_NO_INSTANCE, FC_NVML_NO_INSTANCE};
        }
    }
    *infoCount = (unsigned)n;
    pthread_mutex_unlock(&qmu);
    return r;
}

FC_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                         nvmlProcessInfo_v1_t *infos)
{
    return running(device, infoCount, infos, 1);
}

FC_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_v2_t *infos)
{
    return running(device, infoCount, infos, 2);
}

FC_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos)
{
    return running(device, infoCount, infos, 3);
}

/* A point of a process's busy time: at t_us / t_ns it had held the device
 * busy ns. */
struct point {
    uint64_t t_us, t_ns, busy;
};

/* The live processes that held the device between the start point and the
 * newest sample (fc_sample_locked), with their utilisation; *ts: that
 * sample's time.  The start point is, of the points known for the process
 * (its registration or the last reset, busy 0; the samples kept), the
 * oldest at or after last, else the newest before it: exact when last is a
 * sample's timeStamp, as a watcher passes the previous answer's. */
static int collect_util(struct fc_dev *d, unsigned long long last, uint64_t *ts)
{
    int n = 0;
    fc_dev_lock(d);
    fc_reap_locked(d);
    uint64_t k = fc_sample_locked(d);
    const struct fc_sample t = d->samp[k % FC_SAMPLES];
    *ts = t.t_us;
    uint64_t lo = d->samp_from;
    if (d->nsamp > FC_SAMPLES && d->nsamp - FC_SAMPLES > lo)
        lo = d->nsamp - FC_SAMPLES;
    for (int i = 0; i < FC_MAX_PROCS && t.t_us > last; i++) {
        const struct fc_proc *p = &d->procs[i];
        if (p->state != FC_PROC_ALIVE || k < p->first_samp)
            continue; /* registered after the sample */
        uint64_t busy = p->samp_busy[k % FC_SAMPLES];
        struct point after = {0, 0, 0}, before = {0, 0, 0};
        int have_after = 0, have_before = 0;
        for (uint64_t j = lo; j <= k; j++) {
            /* j == k: the registration (or reset) point, in time order
             * among the samples */
            struct point c;
            if (j < k) {
                uint64_t b = fc_sample_busy_locked(d, i, j);
                if (b == UINT64_MAX)
                    continue;
                c = (struct point){d->samp[j % FC_SAMPLES].t_us, d->samp[j % FC_SAMPLES].t_ns, b};
            } else {
                c = (struct point){p->start_us, p->start_ns, 0};
                if (c.t_ns >= t.t_ns)
                    continue;
            }
            if (c.t_us >= last) {
                if (!have_after || c.t_ns < after.t_ns)
                    after = c;
                have_after = 1;
            } else {
                if (!have_before || c.t_ns > before.t_ns)
                    before = c;
                have_before = 1;
            }
        }
        if (!have_after && !have_before)
            continue;
        struct point s = have_after ? after : before;
        if (busy <= s.busy || t.t_ns <= s.t_ns)
            continue; /* did not run in the interval */
        uint64_t len = t.t_ns - s.t_ns, b = busy - s.busy;
        uint64_t util = b >= len ? 100 : (b * 200 + len) / (2 * len);
        q[n++] = (struct qproc){p->pid, p->pidns, p->start_ns, 0, (unsigned)(util > 100 ? 100 : util)};
    }
    fc_dev_unlock(d);
    return n;
}

FC_API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                                    unsigned int *processSamplesCount,
                                                    unsigned long long lastSeenTimeStamp)
{
    if (!inited())
        return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !processSamplesCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&qmu);
    uint64_t ts = 0;
    int n = translate(q, collect_util(device->dev, lastSeenTimeStamp, &ts));
    nvmlReturn_t r = NVML_SUCCESS;
    if (n == 0) {
        r = NVML_ERROR_NOT_FOUND;
    } else if (!utilization || (unsigned)n > *processSamplesCount) {
        r = FC_NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        for (int i = 0; i < n; i++)
            utilization[i] = (nvmlProcessUtilizationSample_t){(unsigned)q[i].pid, ts, q[i].util, 0, 0, 0};
    }
    *processSamplesCount = (unsigned)n;
    pthread_mutex_unlock(&qmu);
    return r;
}
