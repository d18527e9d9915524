/*
 * fakecuda-ctl - inspect and reset the simulated GPU's shared state.
 *
 *   fakecuda-ctl stat    JSON on stdout (see README.md); reaps exited processes
 *   fakecuda-ctl reset   clears busy counters, forgets exited processes
 *
 * Devices are the gpu<N> files in FAKECUDA_STATE_DIR; nothing is created.
 */
#define _GNU_SOURCE
#include "fc_state.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static int stat_cmd(void)
{
    int idx[FC_MAX_DEVICES];
    int n = list_devices(idx);
    if (n < 0) {
        fprintf(stderr, "fakecuda-ctl: %s: %s\n", fc_env_state_dir(), strerror(errno));
        return 1;
    }
    static struct fc_dev snap;
    uint64_t at = 0; /* CLOCK_MONOTONIC when the first device was read */
    printf("{\"devices\":[");
    for (int k = 0; k < n; k++) {
        struct fc_dev *d = fc_dev_open(idx[k], 0);
        if (!d) {
            fprintf(stderr, "fakecuda-ctl: device %d: %s\n", idx[k], strerror(errno));
            return 1;
        }
        fc_dev_lock(d);
        fc_reap_locked(d);
        memcpy(&snap, d, sizeof(snap)); /* the mutexes in the copy are unused */
        if (!at)
            at = fc_now_ns();
        fc_dev_unlock(d);
        fc_dev_close(d);
        char uuid[64];
        fc_uuid_string(idx[k], uuid, sizeof(uuid));
        printf("%s{\"index\":%d,\"name\":", k ? "," : "", idx[k]);
        json_string(snap.name);
        printf(",\"uuid\":\"%s\",\"model\":\"%s\",\"timeslice_ns\":%llu,\"mem_total\":%llu,\"mem_used\":%llu,\"busy_ns\":%llu,\"kernel_ns\":%llu,\"kernels\":%llu,\"procs\":[",
               uuid, fc_model_name(snap.model), (unsigned long long)snap.slice_ns, (unsigned long long)snap.mem_total, (unsigned long long)snap.mem_used,
               (unsigned long long)snap.busy_ns, (unsigned long long)snap.kernel_ns, (unsigned long long)snap.kernels);
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
    if (argc == 2 && strcmp(argv[1], "reset") == 0)
        return reset_cmd();
    fprintf(stderr, "usage: fakecuda-ctl stat|reset   (state dir: FAKECUDA_STATE_DIR, now %s)\n",
            fc_env_state_dir());
    return 2;
}
