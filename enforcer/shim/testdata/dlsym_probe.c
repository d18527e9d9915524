/*
 * dlsym_probe.c - prints, as key=value lines, which object answers the
 * lookups the CUDA runtime and NVML users make, so that a test can check the
 * shim's dlsym: wrappers for interposed names on the driver's handles, the
 * driver's own symbols otherwise, and RTLD_NEXT semantics preserved.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>

const char *next_probe(void);

static void show(const char *key, void *handle, const char *name)
{
    Dl_info info;
    void *p = dlsym(handle, name);
    if (!p || !dladdr(p, &info) || !info.dli_fname) {
        printf("%s=none\n", key);
        return;
    }
    printf("%s=%s\n", key, info.dli_fname);
}

int main(void)
{
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!cuda || !nvml) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 1;
    }
    show("cuda.cuGetProcAddress_v2", cuda, "cuGetProcAddress_v2");
    show("cuda.cuGetProcAddress", cuda, "cuGetProcAddress");
    show("cuda.cuMemAlloc_v2", cuda, "cuMemAlloc_v2");
    show("cuda.cuLaunchKernel_ptsz", cuda, "cuLaunchKernel_ptsz");
    show("cuda.cuDeviceGet", cuda, "cuDeviceGet");
    show("cuda.cuEventRecord", cuda, "cuEventRecord");
    show("nvml.nvmlDeviceGetMemoryInfo_v2", nvml, "nvmlDeviceGetMemoryInfo_v2");
    show("nvml.nvmlInit_v2", nvml, "nvmlInit_v2");
    show("default.cuMemAlloc_v2", RTLD_DEFAULT, "cuMemAlloc_v2");
    show("default.cuDeviceGet", RTLD_DEFAULT, "cuDeviceGet");
    show("cuda.no_such_symbol", cuda, "cuNoSuchSymbol");
    printf("next=%s\n", next_probe());
    return 0;
}
