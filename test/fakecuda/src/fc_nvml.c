/*
 * fc_nvml.c - libnvidia-ml.so.1 of the simulated GPU: device count and
 * memory info from the shared device state (host indexes; NVML ignores
 * CUDA_VISIBLE_DEVICES, like the real one).
 */
#define _GNU_SOURCE
#include "mgpu_cuda.h"
#include "fc_state.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <errno.h>

#define FC_API __attribute__((visibility("default")))

struct nvmlDevice_st {
    unsigned index;
    struct fc_dev *dev;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int refs;
static unsigned count;
static struct nvmlDevice_st devs[FC_MAX_DEVICES];

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
        if (r == NVML_SUCCESS)
            count = (unsigned)n;
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
        return (nvmlReturn_t)25; /* NVML_ERROR_ARGUMENT_VERSION_MISMATCH */
    mem(device, &memory->total, &memory->used);
    memory->reserved = 0;
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}
