/*
 * fc_nvml.h - the NVML types and entry points of fakecuda's
 * libnvidia-ml.so.1 beyond enforcer/shim/include/mgpu_cuda.h (which has the
 * memory-info path): per-process queries.  Names, layouts and values follow
 * NVIDIA's public nvml.h.
 */
#ifndef FC_NVML_H
#define FC_NVML_H

#include "mgpu_cuda.h"

/* nvmlReturn_t values that mgpu_cuda.h's enum does not name. */
#define FC_NVML_ERROR_NO_PERMISSION ((nvmlReturn_t)4)
#define FC_NVML_ERROR_ALREADY_INITIALIZED ((nvmlReturn_t)5)
#define FC_NVML_ERROR_INSUFFICIENT_SIZE ((nvmlReturn_t)7)
#define FC_NVML_ERROR_ARGUMENT_VERSION_MISMATCH ((nvmlReturn_t)25)

/* gpuInstanceId / computeInstanceId of a device without MIG. */
#define FC_NVML_NO_INSTANCE 0xFFFFFFFFu

typedef struct nvmlProcessInfo_v1_st {
    unsigned int pid;
    unsigned long long usedGpuMemory; /* bytes */
} nvmlProcessInfo_v1_t;

typedef struct nvmlProcessInfo_v2_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t;

/* _v3's layout (nvml.h: nvmlProcessInfo_st, the same fields as v2). */
typedef struct nvmlProcessInfo_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct nvmlProcessUtilizationSample_st {
    unsigned int pid;
    unsigned long long timeStamp; /* CPU timestamp, us (CLOCK_REALTIME) */
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

const char *nvmlErrorString(nvmlReturn_t result);
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                  nvmlProcessInfo_v1_t *infos);
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_v2_t *infos);
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos);
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount,
                                             unsigned long long lastSeenTimeStamp);

#endif
