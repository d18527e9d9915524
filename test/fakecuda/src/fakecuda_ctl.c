/*
 * fakecuda-ctl - inspect and reset the simulated GPU's shared state.
 *
 *   fakecuda-ctl stat    JSON on stdout (see README.md); reaps exited processes
 *   fakecuda-ctl watch US [N]
 *                        stat every US microseconds (at most N times), one
 *                        JSON line each, until N, stdout closes or a signal
 *   fakecuda-ctl kernels DEV US
 *                        from now on, every stretch of device time in which
 *                        a kernel of device DEV ran, one line each, read
 *                        every US microseconds until a signal or stdout
 *                        closes
 *   fakecuda-ctl reset   clears busy counters, forgets exited processes
 *
 * Devices are the gpu<N> files in FAKECUDA_STATE_DIR; nothing is created.
 */
#define _GNU_SOURCE
#include "fc_state.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int list_devices(int *idx)
{
    DIR *dir = opendir(fc_env_state_dir());
    if (!dir)
        return errno == ENOENT ? 0 : -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL && n < FC_MAX_DEVICES) {
        char *end = NULL;
        if (strncmp(e->d_name, "gpu", 3) != 0 || !e->d_name[3])
            continue;
        long v = strtol(e->d_name + 3, &end, 10);
        if (*end || v < 0 || v >= FC_MAX_DEVICES)
            continue;
        idx[n++] = (int)v;
    }
    closedir(dir);
    for (int i = 1; i < n; i++) /* sort */
        for (int j = i; j > 0 && idx[j - 1] > idx[j]; j--) {
            int t = idx[j];
            idx[j] = idx[j - 1];
            idx[j - 1] = t;
        }
    return n;
}

static void json_string(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

/* One stat line of the devices devs[0..n) (opened, idx their indexes). */
static int stat_devices(struct fc_dev **devs, const int *idx, int n)
{
    static struct fc_dev snap;
    uint64_t at = 0; /* CLOCK_MONOTONIC when the first device was read */
    printf("{\"devices\":[");
    for (int k = 0; k < n; k++) {
        struct fc_dev *d = devs[k];
        fc_dev_lock(d);
        fc_reap_locked(d);
        uint64_t now = fc_now_ns();
        memcpy(&snap, d, sizeof(snap)); /* the mutexes in the copy are unused */
        /* The hold in progress counts up to now, so that busy_ns is exact
         * at the stamp (a timer-model slice is otherwise accounted only
         * when it ends, milliseconds later). */
        for (int i = 0; i < FC_MAX_PROCS; i++) {
            uint64_t b = fc_busy_now_locked(d, i, now);
            snap.busy_ns += b - snap.procs[i].busy_ns;
            snap.procs[i].busy_ns = b;
        }
        if (!at)
            at = now;
        fc_dev_unlock(d);
        char uuid[64];
        fc_uuid_string(idx[k], uuid, sizeof(uuid));
        printf("%s{\"index\":%d,\"name\":", k ? "," : "", idx[k]);
        json_string(snap.name);
        printf(",\"uuid\":\"%s\",\"model\":\"%s\",\"timeslice_ns\":%llu,\"mem_total\":%llu,\"mem_used\":%llu,\"busy_ns\":%llu,\"kernel_ns\":%llu,\"kernels\":%llu,\"handoffs\":%llu,\"idles\":%llu,\"procs\":[",
               uuid, fc_model_name(snap.model), (unsigned long long)snap.slice_ns, (unsigned long long)snap.mem_total, (unsigned long long)snap.mem_used,
               (unsigned long long)snap.busy_ns, (unsigned long long)snap.kernel_ns, (unsigned long long)snap.kernels,
               (unsigned long long)snap.handoffs, (unsigned long long)snap.idles);
        int first = 1;
        for (int i = 0; i < FC_MAX_PROCS; i++) {
            struct fc_proc *p = &snap.procs[i];
            if (p->state == FC_PROC_FREE)
                continue;
            printf("%s{\"pid\":%d,\"pidns\":%llu,\"busy_ns\":%llu,\"kernel_ns\":%llu,\"kernels\":%llu,\"mem_used\":%llu,\"alive\":%s}",
                   first ? "" : ",", p->pid, (unsigned long long)p->pidns, (unsigned long long)p->busy_ns,
                   (unsigned long long)p->kernel_ns,
                   (unsigned long long)p->kernels, (unsigned long long)p->mem_used, p->state == FC_PROC_ALIVE ? "true" : "false");
            first = 0;
        }
        printf("]}");
    }
    printf("],\"at_ns\":%llu}\n", (unsigned long long)(at ? at : fc_now_ns()));
    return fflush(stdout) ? 1 : 0;
}

/* Opens every device of the state dir into devs; the count, or -1. */
static int open_devices(struct fc_dev **devs, int *idx)
{
    int n = list_devices(idx);
    if (n < 0) {
        fprintf(stderr, "fakecuda-ctl: %s: %s\n", fc_env_state_dir(), strerror(errno));
        return -1;
    }
    for (int k = 0; k < n; k++) {
        devs[k] = fc_dev_open(idx[k], 0);
        if (!devs[k]) {
            fprintf(stderr, "fakecuda-ctl: device %d: %s\n", idx[k], strerror(errno));
            while (k-- > 0)
                fc_dev_close(devs[k]);
            return -1;
        }
    }
    return n;
}

static int stat_cmd(void)
{
    int idx[FC_MAX_DEVICES];
    struct fc_dev *devs[FC_MAX_DEVICES];
    int n = open_devices(devs, idx);
    if (n < 0)
        return 1;
    int rc = stat_devices(devs, idx, n);
    for (int k = 0; k < n; k++)
        fc_dev_close(devs[k]);
    return rc;
}

/* watch: stat every us microseconds, count times (0: until stdout closes
 * or a signal). One process keeps the state mapped, so a sample costs
 * microseconds, where starting fakecuda-ctl stat costs milliseconds of CPU
 * (on a 2-core machine, every 5 ms that is most of a core, taken from the
 * workloads being measured). Devices created after it started are not
 * watched. */
static int watch_cmd(const char *us_arg, const char *count_arg)
{
    char *end = NULL;
    errno = 0;
    long long us = strtoll(us_arg, &end, 10);
    if (errno || !*us_arg || *end || us < 100 || us > 60000000) {
        fprintf(stderr, "fakecuda-ctl: watch: interval %s: want microseconds, 100 to 60000000\n", us_arg);
        return 2;
    }
    long long count = 0;
    if (count_arg) {
        end = NULL;
        errno = 0;
        count = strtoll(count_arg, &end, 10);
        if (errno || !*count_arg || *end || count < 1) {
            fprintf(stderr, "fakecuda-ctl: watch: count %s: want a positive number\n", count_arg);
            return 2;
        }
    }
    signal(SIGPIPE, SIG_IGN); /* a closed stdout ends the watch by its error */
    int idx[FC_MAX_DEVICES];
    struct fc_dev *devs[FC_MAX_DEVICES];
    int n = open_devices(devs, idx);
    if (n < 0)
        return 1;
    int rc = 0;
    uint64_t next = fc_now_ns();
    for (long long i = 0; count == 0 || i < count; i++) {
        if (stat_devices(devs, idx, n)) {
            rc = errno == EPIPE ? 0 : 1; /* the reader went away */
            break;
        }
        next += (uint64_t)us * 1000;
        struct timespec ts = {(time_t)(next / 1000000000ULL), (long)(next % 1000000000ULL)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
            ;
    }
    for (int k = 0; k < n; k++)
        fc_dev_close(devs[k]);
    return rc;
}

static volatile sig_atomic_t kernels_stop;

static void kernels_on_signal(int sig)
{
    (void)sig;
    kernels_stop = 1;
}

/* kernels: follows device dev_arg's record of kernel runs (fc_dev.krun),
 * from the moment it starts ("from <ns>", CLOCK_MONOTONIC: every run that
 * ends later is printed), reading it every us microseconds; prints
 * "<end_ns> <dur_ns> <pid>" per run (the device's timeline,
 * CLOCK_MONOTONIC) and "lost <n>" where the record wrapped between two
 * reads (n runs missing).  SIGTERM or SIGINT ends it after one last read:
 * every run that ended before the signal is printed. */
static int kernels_cmd(const char *dev_arg, const char *us_arg)
{
    char *end = NULL;
    errno = 0;
    long dev = strtol(dev_arg, &end, 10);
    if (errno || !*dev_arg || *end || dev < 0 || dev >= FC_MAX_DEVICES) {
        fprintf(stderr, "fakecuda-ctl: kernels: device %s: want an index, 0 to %d\n", dev_arg, FC_MAX_DEVICES - 1);
        return 2;
    }
    end = NULL;
    errno = 0;
    long long us = strtoll(us_arg, &end, 10);
    if (errno || !*us_arg || *end || us < 100 || us > 60000000) {
        fprintf(stderr, "fakecuda-ctl: kernels: interval %s: want microseconds, 100 to 60000000\n", us_arg);
        return 2;
    }
    struct fc_dev *d = fc_dev_open((int)dev, 0);
    if (!d) {
        fprintf(stderr, "fakecuda-ctl: device %ld: %s\n", dev, strerror(errno));
        return 1;
    }
    signal(SIGPIPE, SIG_IGN); /* a closed stdout ends it by its error */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = kernels_on_signal; /* no SA_RESTART: the sleep ends at once */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    static struct fc_krun buf[FC_KRUNS];
    fc_dev_lock(d);
    uint64_t next = d->nkrun; /* the first run not printed yet */
    uint64_t from = fc_now_ns();
    fc_dev_unlock(d);
    printf("from %llu\n", (unsigned long long)from);
    int rc = 0;
    for (int last = 0; !last;) {
        last = kernels_stop;
        fc_dev_lock(d);
        uint64_t upto = d->nkrun, lost = 0;
        if (upto - next > FC_KRUNS) {
            lost = upto - next - FC_KRUNS;
            next = upto - FC_KRUNS;
        }
        size_t n = (size_t)(upto - next);
        for (size_t i = 0; i < n; i++)
            buf[i] = d->krun[(next + i) % FC_KRUNS];
        fc_dev_unlock(d);
        next = upto;
        if (lost)
            printf("lost %llu\n", (unsigned long long)lost);
        for (size_t i = 0; i < n; i++)
            printf("%llu %u %d\n", (unsigned long long)buf[i].end_ns, buf[i].dur_ns, buf[i].pid);
        if (fflush(stdout)) {
            rc = errno == EPIPE ? 0 : 1; /* the reader went away */
            break;
        }
        if (!last) {
            struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
            nanosleep(&ts, NULL); /* a signal ends it early: one last read follows */
        }
    }
    fc_dev_close(d);
    return rc;
}

static int reset_cmd(void)
{
    int idx[FC_MAX_DEVICES];
    int n = list_devices(idx);
    if (n < 0) {
        fprintf(stderr, "fakecuda-ctl: %s: %s\n", fc_env_state_dir(), strerror(errno));
        return 1;
    }
    for (int k = 0; k < n; k++) {
        struct fc_dev *d = fc_dev_open(idx[k], 0);
        if (!d) {
            fprintf(stderr, "fakecuda-ctl: device %d: %s\n", idx[k], strerror(errno));
            return 1;
        }
        fc_dev_reset(d);
        fc_dev_close(d);
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "stat") == 0)
        return stat_cmd();
    if ((argc == 3 || argc == 4) && strcmp(argv[1], "watch") == 0)
        return watch_cmd(argv[2], argc == 4 ? argv[3] : NULL);
    if (argc == 4 && strcmp(argv[1], "kernels") == 0)
        return kernels_cmd(argv[2], argv[3]);
    if (argc == 2 && strcmp(argv[1], "reset") == 0)
        return reset_cmd();
    fprintf(stderr, "usage: fakecuda-ctl stat|watch US [N]|kernels DEV US|reset   (state dir: FAKECUDA_STATE_DIR, now %s)\n",
            fc_env_state_dir());
    return 2;
}
