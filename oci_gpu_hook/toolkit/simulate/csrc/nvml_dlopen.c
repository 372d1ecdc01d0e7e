/* The simulated nvidia-smi reaches NVML as the real one does: with dlopen("libnvidia-ml.so.1") at
 * run time, not through a NEEDED entry, so a container without the library gets nvidia-smi's own
 * message instead of the loader's.  Each NVML function nvidia-smi.c calls is defined here as a
 * trampoline to the library's symbol, looked up on first use. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#include "sim_nvml.h"

static void *symbol(const char *name)
{
    static void *library;
    if (!library) {
        library = dlopen("libnvidia-ml.so.1", RTLD_NOW);
        if (!library) {
            /* What the real nvidia-smi says when libnvidia-ml.so.1 cannot be loaded. */
            printf("NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that "
                   "the NVIDIA Display Driver is properly installed and present in your system.\n"
                   "Please also try adding directory that contains libnvidia-ml.so to your system PATH.\n");
            exit(NVML_ERROR_LIBRARY_NOT_FOUND);
        }
    }
    void *found = dlsym(library, name);
    if (!found) {
        printf("NVIDIA-SMI: NVML has no %s\n", name);
        exit(NVML_ERROR_FUNCTION_NOT_FOUND);
    }
    return found;
}

#define TRAMPOLINE(ret, name, params, args)              \
    ret name params                                      \
    {                                                    \
        static ret(*call) params;                        \
        if (!call)                                       \
            *(void **)&call = symbol(#name);             \
        return call args;                                \
    }

TRAMPOLINE(nvmlReturn_t, nvmlInit_v2, (void), ())
TRAMPOLINE(nvmlReturn_t, nvmlShutdown, (void), ())
TRAMPOLINE(const char *, nvmlErrorString, (nvmlReturn_t result), (result))
TRAMPOLINE(nvmlReturn_t, nvmlSystemGetDriverVersion, (char *version, unsigned int length), (version, length))
TRAMPOLINE(nvmlReturn_t, nvmlSystemGetNVMLVersion, (char *version, unsigned int length), (version, length))
TRAMPOLINE(nvmlReturn_t, nvmlSystemGetCudaDriverVersion_v2, (int *version), (version))
TRAMPOLINE(nvmlReturn_t, nvmlDeviceGetCount_v2, (unsigned int *count), (count))
TRAMPOLINE(nvmlReturn_t, nvmlDeviceGetHandleByIndex_v2, (unsigned int index, nvmlDevice_t *device), (index, device))
TRAMPOLINE(nvmlReturn_t, nvmlDeviceGetName, (nvmlDevice_t device, char *name, unsigned int length),
           (device, name, length))
TRAMPOLINE(nvmlReturn_t, nvmlDeviceGetUUID, (nvmlDevice_t device, char *uuid, unsigned int length),
           (device, uuid, length))
TRAMPOLINE(nvmlReturn_t, nvmlDeviceGetPciInfo_v3, (nvmlDevice_t device, nvmlPciInfo_t *pci), (device, pci))
TRAMPOLINE(nvmlReturn_t, nvmlDeviceGetCudaComputeCapability, (nvmlDevice_t device, int *major, int *minor),
           (device, major, minor))
TRAMPOLINE(nvmlReturn_t, nvmlDeviceGetMemoryInfo, (nvmlDevice_t device, nvmlMemory_t *memory), (device, memory))
TRAMPOLINE(nvmlReturn_t, nvmlDeviceGetUtilizationRates, (nvmlDevice_t device, nvmlUtilization_t *utilization),
           (device, utilization))
TRAMPOLINE(nvmlReturn_t, nvmlDeviceGetPersistenceMode, (nvmlDevice_t device, nvmlEnableState_t *mode),
           (device, mode))
TRAMPOLINE(nvmlReturn_t, nvmlDeviceGetMigMode, (nvmlDevice_t device, unsigned int *current, unsigned int *pending),
           (device, current, pending))
TRAMPOLINE(nvmlReturn_t, nvmlDeviceGetMaxMigDeviceCount, (nvmlDevice_t device, unsigned int *count), (device, count))
TRAMPOLINE(nvmlReturn_t, nvmlDeviceGetMigDeviceHandleByIndex,
           (nvmlDevice_t device, unsigned int index, nvmlDevice_t *mig), (device, index, mig))
TRAMPOLINE(nvmlReturn_t, nvmlDeviceGetGpuInstanceId, (nvmlDevice_t device, unsigned int *id), (device, id))
TRAMPOLINE(nvmlReturn_t, nvmlDeviceGetComputeInstanceId, (nvmlDevice_t device, unsigned int *id), (device, id))
