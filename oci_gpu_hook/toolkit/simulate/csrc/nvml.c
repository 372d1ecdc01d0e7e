/* Simulated libnvidia-ml.so: the subset of NVML that container tooling and
 * the pynvml bindings use, with the C ABI of nvml.h (function names, struct
 * layouts, return codes), so unmodified clients can load it by SONAME.
 *
 * The GPUs come from sim_host.h, compiled in.  Which of them a process sees
 * is decided at init from the device nodes it can reach, as with the real
 * driver inside a container: the library carries the whole host, the mount
 * namespace decides what is visible. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "sim_host.h"
#include "sim_nvml.h"

#define EXPORT __attribute__((visibility("default")))
/* Return what a check answers unless it is success: the first line of most entry points. */
#define TRY(check)                         \
    do {                                   \
        nvmlReturn_t try_ = (check);       \
        if (try_ != NVML_SUCCESS)          \
            return try_;                   \
    } while (0)

/* The layouts clients read through their own copy of nvml.h (pynvml's ctypes structures among
 * them): a field out of place would hand them another field's bytes. */
_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t is 40 bytes in nvml.h");
_Static_assert(sizeof(nvmlProcessUtilizationSample_t) == 32, "nvmlProcessUtilizationSample_t is 32 bytes");
_Static_assert(sizeof(nvmlGpmMetric_t) == 40, "nvmlGpmMetric_t is 40 bytes in nvml.h");

/* Upper bound on MIG devices per GPU: A100/H100 allow 7 compute instances. */
#define SIM_MAX_MIG 16

/* A handle is a pointer to one of these; they live in static storage so a
 * stale handle kept across shutdown/init is still safe to dereference. */
struct nvmlDevice_st {
    const struct sim_gpu *gpu;
    const struct sim_mig *mig;        /* NULL for a physical GPU */
    struct nvmlDevice_st *parent;     /* MIG: its GPU */
    int visible;
    unsigned index;                   /* among visible GPUs / the GPU's visible MIGs */
    unsigned n_mig;                   /* GPU: visible MIG devices, in migs[] */
    struct nvmlDevice_st *migs[SIM_MAX_MIG];
};

/* +1: a host description may have no GPUs, and C has no empty arrays. */
static struct nvmlDevice_st g_gpus[SIM_N_GPUS + 1];
static struct nvmlDevice_st g_migs[SIM_N_GPUS + 1][SIM_MAX_MIG];
static struct nvmlDevice_st *g_visible[SIM_N_GPUS + 1];
static unsigned g_n_visible;
static unsigned g_refcount;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

/* Existence only: the nodes may be real character devices or, in tests,
 * plain files; opening them would reach no driver either way. */
static int exists(const char *dir, const char *name, long number)
{
    char path[4096];
    int n = number >= 0 ? snprintf(path, sizeof path, "%s/%s%ld", dir, name, number)
                        : snprintf(path, sizeof path, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= sizeof path)
        return 0;
    return access(path, F_OK) == 0;
}

/* Where the device nodes are: if the simulated host's procfs is reachable we
 * run on the host and its dev directory applies; otherwise we are inside a
 * container, whose runtime put (some of) the nodes under the real /dev. */
static const char *device_root(void)
{
    if (access(SIM_ROOT "/proc/driver/nvidia/version", F_OK) == 0)
        return SIM_ROOT "/dev";
    return "/dev";
}

static nvmlReturn_t scan_devices(void)
{
    const char *dev = device_root();
    char caps[4096];
    int n = snprintf(caps, sizeof caps, "%s/nvidia-caps", dev);
    if (n < 0 || (size_t)n >= sizeof caps)
        return NVML_ERROR_UNKNOWN;
    /* The real library talks to the driver through nvidiactl; without it
     * there is no driver as far as this process can tell. */
    if (!exists(dev, "nvidiactl", -1))
        return NVML_ERROR_DRIVER_NOT_LOADED;

    g_n_visible = 0;
    for (unsigned i = 0; i < SIM_N_GPUS; i++) {
        const struct sim_gpu *gpu = &SIM_GPUS[i];
        struct nvmlDevice_st *d = &g_gpus[i];
        memset(d, 0, sizeof *d);
        d->gpu = gpu;
        if (!exists(dev, "nvidia", gpu->minor))
            continue;
        d->visible = 1;
        d->index = g_n_visible;
        g_visible[g_n_visible++] = d;
        if (!gpu->mig_enabled)
            continue;
        for (unsigned m = 0; m < gpu->n_mig && m < SIM_MAX_MIG; m++) {
            const struct sim_mig *mig = &gpu->mig[m];
            struct nvmlDevice_st *md = &g_migs[i][m];
            memset(md, 0, sizeof *md);
            md->gpu = gpu;
            md->mig = mig;
            md->parent = d;
            if (!exists(caps, "nvidia-cap", mig->gi_cap_minor) ||
                !exists(caps, "nvidia-cap", mig->ci_cap_minor))
                continue;
            md->visible = 1;
            md->index = d->n_mig;
            d->migs[d->n_mig++] = md;
        }
    }
    return NVML_SUCCESS;
}

static void forget_devices(void)
{
    memset(g_gpus, 0, sizeof g_gpus);
    memset(g_migs, 0, sizeof g_migs);
    g_n_visible = 0;
}

static int initialized(void)
{
    pthread_mutex_lock(&g_lock);
    int ok = g_refcount > 0;
    pthread_mutex_unlock(&g_lock);
    return ok;
}

static nvmlReturn_t injected_fault(void);

/* Every device query starts here: a handle is valid only if it points into
 * our tables and names a device visible in the current session. */
static nvmlReturn_t check(nvmlDevice_t device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    uintptr_t p = (uintptr_t)device;
    uintptr_t gpus = (uintptr_t)g_gpus, migs = (uintptr_t)g_migs;
    uintptr_t base;
    if (p >= gpus && p < gpus + SIM_N_GPUS * sizeof g_gpus[0])
        base = gpus;
    else if (p >= migs && p < migs + sizeof g_migs)
        base = migs;
    else
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((p - base) % sizeof(struct nvmlDevice_st) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!device->visible || device->gpu == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    return injected_fault();
}

/* The usual head of a device query: a valid handle and somewhere to put the answer. */
static nvmlReturn_t check_out(nvmlDevice_t device, const void *out)
{
    TRY(check(device));
    return out == NULL ? NVML_ERROR_INVALID_ARGUMENT : NVML_SUCCESS;
}

static nvmlReturn_t copy_string(char *dst, unsigned length, const char *src)
{
    if (dst == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/* Handles handed out from static storage (event sets, GPM samples): slots of one size whose
 * first member is `int used`.  A handle is checked against its pool before it is followed, so
 * one freed, or never ours, answers INVALID_ARGUMENT instead of crashing the caller. */
struct sim_pool {
    void *slots;
    size_t size, count;
    pthread_mutex_t *lock;
};

/* Called with the pool's lock held. */
static int pool_holds(const struct sim_pool *pool, const void *handle)
{
    uintptr_t p = (uintptr_t)handle, base = (uintptr_t)pool->slots;
    return handle != NULL && p >= base && p < base + pool->size * pool->count && (p - base) % pool->size == 0 &&
           *(const int *)handle;
}

/* A free slot, zeroed and marked used; NULL when every one is taken.  Called with the lock held. */
static void *pool_take(const struct sim_pool *pool)
{
    for (size_t i = 0; i < pool->count; i++) {
        int *slot = (int *)((char *)pool->slots + i * pool->size);
        if (!*slot) {
            memset(slot, 0, pool->size);
            *slot = 1;
            return slot;
        }
    }
    return NULL;
}

static nvmlReturn_t pool_free(const struct sim_pool *pool, void *handle)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    pthread_mutex_lock(pool->lock);
    int ok = pool_holds(pool, handle);
    if (ok)
        *(int *)handle = 0;
    pthread_mutex_unlock(pool->lock);
    return ok ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

/* MIG is a GA100/GH100/GB100-class feature; the host header only says
 * whether it is enabled, so infer the capability from the architecture. */
static int mig_capable(const struct sim_gpu *gpu)
{
    if (gpu->mig_enabled || gpu->n_mig > 0)
        return 1;
    return (gpu->cc_major == 8 && gpu->cc_minor == 0) || gpu->cc_major == 9 || gpu->cc_major == 10;
}

/* ---- live values: the control file -------------------------------------- */

/* Tests (toolkit/simulate/control.py) change what the GPUs report while
 * clients run, through SIM_ROOT/nvml-control, re-read whenever it changes:
 *     fail <nvmlReturn_t>            nvmlInit, the device count and handle
 *                                    lookups and every device query answer it
 *     <uuid> <key> <number>          a value of that GPU or MIG device (below)
 *     <uuid> process <pid> <bytes>   a process using that GPU or MIG device
 *     <uuid> process_util <pid> <sm%> <mem%> <enc%> <dec%>
 *                                    a process's utilization sample on that GPU
 * The keys, and what a device reports without one:
 *     util_gpu util_memory (%)       the host description's (0)
 *     memory_used (bytes)            its live processes' sum, else the host's
 *     memory_reserved (bytes)        384 MiB on a GPU, 0 on a MIG device
 *     temperature (C) 33   power (mW) 58000   sm_clock 1410, mem_clock 1215
 *     (MHz)   energy (mJ) 0          board values: GPUs only
 *     memory_temp (C) 45             GPUs with HBM only (field 82)
 *     pcie_replay 0                  GPUs only
 *     enc_util dec_util (%) 0        GPUs only
 *     remapped_correctable remapped_uncorrectable (rows) 0, remap_pending
 *     remap_failure (0/1) 0          GPUs of compute capability 8.0 and later
 *     nvlink_raw_tx nvlink_raw_rx (KiB) 0   GPUs with an NVLink (fields 140, 141)
 *     gpm_graphics_util gpm_sm_util gpm_sm_occupancy gpm_tensor_util
 *     gpm_dram_util (%) 0, gpm_pcie_tx gpm_pcie_rx (MiB/s) 0
 *                                    GPM metrics, GPUs (and their MIG devices)
 *                                    of compute capability 9.0 and later
 *     vgpu_licensed (0/1) 1          a vGPU guest's GPUs only (SIM_VGPU_GUEST)
 * Only on the host: inside a container the file is out of reach, as the
 * real driver's state is out of a container's reach too. */
#define SIM_MAX_LIVE (SIM_N_GPUS * (SIM_MAX_MIG + 1) + 1)
#define SIM_MAX_PROCS 256
/* One list makes both the key enum and the names the file uses, so the two stay in step. */
#define SIM_LIVE_KEYS(X)                                                                        \
    X(L_UTIL_GPU, "util_gpu") X(L_UTIL_MEM, "util_memory") X(L_MEM_USED, "memory_used")         \
    X(L_TEMP, "temperature") X(L_POWER, "power") X(L_SM_CLOCK, "sm_clock")                      \
    X(L_MEM_CLOCK, "mem_clock") X(L_ENERGY, "energy") X(L_MEM_TEMP, "memory_temp")              \
    X(L_PCIE_REPLAY, "pcie_replay") X(L_ENC_UTIL, "enc_util") X(L_DEC_UTIL, "dec_util")         \
    X(L_MEM_RESERVED, "memory_reserved") X(L_REMAP_CORR, "remapped_correctable")                \
    X(L_REMAP_UNC, "remapped_uncorrectable") X(L_REMAP_PENDING, "remap_pending")                \
    X(L_REMAP_FAILURE, "remap_failure") X(L_NVLINK_TX, "nvlink_raw_tx")                         \
    X(L_NVLINK_RX, "nvlink_raw_rx") X(L_GPM_GRAPHICS, "gpm_graphics_util")                      \
    X(L_GPM_SM, "gpm_sm_util") X(L_GPM_SM_OCCUPANCY, "gpm_sm_occupancy")                        \
    X(L_GPM_TENSOR, "gpm_tensor_util") X(L_GPM_DRAM, "gpm_dram_util")                           \
    X(L_GPM_PCIE_TX, "gpm_pcie_tx") X(L_GPM_PCIE_RX, "gpm_pcie_rx")                             \
    X(L_VGPU_LICENSED, "vgpu_licensed")
#define SIM_KEY_ENUM(key, name) key,
#define SIM_KEY_NAME(key, name) name,
enum { SIM_LIVE_KEYS(SIM_KEY_ENUM) L_N };
static const char *const LIVE_KEYS[L_N] = {SIM_LIVE_KEYS(SIM_KEY_NAME)};

/* Defaults of the keys above that are not the host description's. */
#define SIM_MEMORY_RESERVED (384ULL << 20)
#define SIM_MEMORY_TEMP 45

struct sim_live {
    char uuid[96];
    int have[L_N];
    unsigned long long value[L_N];
};
struct sim_proc {
    char uuid[96];
    unsigned pid;
    unsigned long long bytes;
};
struct sim_proc_util {
    char uuid[96];
    unsigned pid, sm, mem, enc, dec;
};

static struct sim_live g_live[SIM_MAX_LIVE];
static unsigned g_n_live;
static struct sim_proc g_procs[SIM_MAX_PROCS];
static unsigned g_n_procs;
static struct sim_proc_util g_proc_utils[SIM_MAX_PROCS];
static unsigned g_n_proc_utils;
static nvmlReturn_t g_fail;
static struct stat g_control_stat;
static int g_control_seen;
static pthread_mutex_t g_live_lock = PTHREAD_MUTEX_INITIALIZER;

static struct sim_live *live_slot(const char *uuid)
{
    for (unsigned i = 0; i < g_n_live; i++)
        if (strcmp(g_live[i].uuid, uuid) == 0)
            return &g_live[i];
    if (g_n_live == SIM_MAX_LIVE)
        return NULL;
    struct sim_live *l = &g_live[g_n_live++];
    memset(l, 0, sizeof *l);
    snprintf(l->uuid, sizeof l->uuid, "%s", uuid);
    return l;
}

/* Called with g_live_lock held. */
static void reload_control(void)
{
    const char *path = SIM_ROOT "/nvml-control";
    struct stat st;
    if (stat(path, &st) != 0) {
        g_n_live = g_n_procs = g_n_proc_utils = 0;
        g_fail = NVML_SUCCESS;
        g_control_seen = 0;
        return;
    }
    if (g_control_seen && st.st_ino == g_control_stat.st_ino && st.st_size == g_control_stat.st_size &&
        st.st_mtim.tv_sec == g_control_stat.st_mtim.tv_sec &&
        st.st_mtim.tv_nsec == g_control_stat.st_mtim.tv_nsec)
        return;
    FILE *f = fopen(path, "re");
    if (f == NULL)
        return;
    g_n_live = g_n_procs = g_n_proc_utils = 0;
    g_fail = NVML_SUCCESS;
    char line[512], uuid[96], key[32];
    unsigned long long a, b, u[4];
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "fail %llu", &a) == 1) {
            g_fail = (nvmlReturn_t)a;
        } else if (sscanf(line, "%95s process_util %llu %llu %llu %llu %llu", uuid, &a, &u[0], &u[1], &u[2],
                          &u[3]) == 6) {
            if (g_n_proc_utils < SIM_MAX_PROCS) {
                struct sim_proc_util *p = &g_proc_utils[g_n_proc_utils++];
                snprintf(p->uuid, sizeof p->uuid, "%s", uuid);
                p->pid = (unsigned)a;
                p->sm = (unsigned)u[0];
                p->mem = (unsigned)u[1];
                p->enc = (unsigned)u[2];
                p->dec = (unsigned)u[3];
            }
        } else if (sscanf(line, "%95s process %llu %llu", uuid, &a, &b) == 3) {
            if (g_n_procs < SIM_MAX_PROCS) {
                struct sim_proc *p = &g_procs[g_n_procs++];
                snprintf(p->uuid, sizeof p->uuid, "%s", uuid);
                p->pid = (unsigned)a;
                p->bytes = b;
            }
        } else if (sscanf(line, "%95s %31s %llu", uuid, key, &a) == 3) {
            for (int k = 0; k < L_N; k++) {
                if (strcmp(key, LIVE_KEYS[k]) == 0) {
                    struct sim_live *l = live_slot(uuid);
                    if (l) {
                        l->have[k] = 1;
                        l->value[k] = a;
                    }
                }
            }
        }
    }
    fclose(f);
    g_control_stat = st;
    g_control_seen = 1;
}

static int on_host(void)
{
    return access(SIM_ROOT "/proc/driver/nvidia/version", F_OK) == 0;
}

/* The fault the control file asks for, NVML_SUCCESS for none. */
static nvmlReturn_t injected_fault(void)
{
    if (!on_host())
        return NVML_SUCCESS;
    pthread_mutex_lock(&g_live_lock);
    reload_control();
    nvmlReturn_t fail = g_fail;
    pthread_mutex_unlock(&g_live_lock);
    return fail;
}

static const char *uuid_of(nvmlDevice_t device)
{
    return device->mig ? device->mig->uuid : device->gpu->uuid;
}

/* The device's GPU's place in SIM_GPUS (and SIM_TOPOLOGY). */
static unsigned gpu_number(nvmlDevice_t device)
{
    return (unsigned)(device->gpu - SIM_GPUS);
}

/* The control file's value of key for device, or fallback. */
static unsigned long long live_value(nvmlDevice_t device, int key, unsigned long long fallback)
{
    if (!on_host())
        return fallback;
    pthread_mutex_lock(&g_live_lock);
    reload_control();
    unsigned long long v = fallback;
    for (unsigned i = 0; i < g_n_live; i++)
        if (strcmp(g_live[i].uuid, uuid_of(device)) == 0 && g_live[i].have[key])
            v = g_live[i].value[key];
    pthread_mutex_unlock(&g_live_lock);
    return v;
}

/* A process is reported only while it exists, as the real driver forgets
 * the processes that exit. */
static int process_exists(unsigned pid)
{
    return pid > 0 && (kill((pid_t)pid, 0) == 0 || errno == EPERM);
}

/* Does process p run on device: on it, or (for a GPU) on one of its MIG devices. */
static int process_on(const struct sim_proc *p, nvmlDevice_t device, const struct sim_mig **mig)
{
    *mig = NULL;
    if (strcmp(p->uuid, uuid_of(device)) == 0) {
        *mig = device->mig;
        return 1;
    }
    if (device->mig)
        return 0;
    for (unsigned m = 0; m < device->gpu->n_mig; m++) {
        if (strcmp(p->uuid, device->gpu->mig[m].uuid) == 0) {
            *mig = &device->gpu->mig[m];
            return 1;
        }
    }
    return 0;
}

/* Copies the device's live processes into buf (up to cap), returns how many there are. */
static unsigned live_processes(nvmlDevice_t device, nvmlProcessInfo_t *buf, unsigned cap,
                               unsigned long long *bytes)
{
    unsigned n = 0;
    *bytes = 0;
    if (!on_host())
        return 0;
    pthread_mutex_lock(&g_live_lock);
    reload_control();
    for (unsigned i = 0; i < g_n_procs; i++) {
        const struct sim_mig *mig;
        if (!process_on(&g_procs[i], device, &mig) || !process_exists(g_procs[i].pid))
            continue;
        if (buf && n < cap) {
            buf[n].pid = g_procs[i].pid;
            buf[n].usedGpuMemory = g_procs[i].bytes;
            buf[n].gpuInstanceId = mig ? mig->gi_id : 0xFFFFFFFFu;
            buf[n].computeInstanceId = mig ? mig->ci_id : 0xFFFFFFFFu;
        }
        *bytes += g_procs[i].bytes;
        n++;
    }
    pthread_mutex_unlock(&g_live_lock);
    return n;
}

/* ---- init / shutdown ---------------------------------------------------- */

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags; /* NO_GPUS is the behaviour anyway: zero visible GPUs is not an error */
    nvmlReturn_t ret = injected_fault();
    if (ret != NVML_SUCCESS)
        return ret;
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0)
        ret = scan_devices();
    if (ret == NVML_SUCCESS)
        g_refcount++;
    else
        forget_devices();
    pthread_mutex_unlock(&g_lock);
    return ret;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

EXPORT nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t ret = NVML_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0)
        ret = NVML_ERROR_UNINITIALIZED;
    else if (--g_refcount == 0)
        forget_devices();
    pthread_mutex_unlock(&g_lock);
    return ret;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "Driver/library version mismatch";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED:
        return "The requested vgpu operation is not available on target device, because ECC is enabled";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_FREQ_NOT_SUPPORTED: return "The requested frequency is not supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    case NVML_ERROR_RESET_TYPE_NOT_SUPPORTED: return "Reset type not supported";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
    }
    return "Unknown Error";
}

/* ---- system queries ----------------------------------------------------- */

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    return copy_string(version, length, SIM_DRIVER_VERSION);
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    /* The real library answers this one without nvmlInit. */
    return copy_string(version, length, SIM_NVML_VERSION);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    /* Also answered before init: the real one asks libcuda, not the driver. */
    if (cudaDriverVersion == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *cudaDriverVersion = SIM_CUDA_VERSION;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

/* ---- device enumeration ------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (injected_fault() != NVML_SUCCESS)
        return injected_fault();
    if (deviceCount == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = g_n_visible;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return nvmlDeviceGetCount_v2(deviceCount);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (injected_fault() != NVML_SUCCESS)
        return injected_fault();
    if (device == NULL || index >= g_n_visible)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = g_visible[index];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (injected_fault() != NVML_SUCCESS)
        return injected_fault();
    if (uuid == NULL || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < g_n_visible; i++) {
        struct nvmlDevice_st *d = g_visible[i];
        if (strcmp(d->gpu->uuid, uuid) == 0) {
            *device = d;
            return NVML_SUCCESS;
        }
        for (unsigned m = 0; m < d->n_mig; m++) {
            if (strcmp(d->migs[m]->mig->uuid, uuid) == 0) {
                *device = d->migs[m];
                return NVML_SUCCESS;
            }
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

/* Accepts what the real one does: "domain:bus:device.function" or
 * "bus:device.function", hex, any case, with or without leading zeros. */
static int parse_bus_id(const char *s, unsigned *domain, unsigned *bus, unsigned *dev,
                        unsigned *fn)
{
    char tail;
    if (sscanf(s, "%x:%x:%x.%x%c", domain, bus, dev, fn, &tail) == 4)
        return 1;
    *domain = 0;
    if (sscanf(s, "%x:%x.%x%c", bus, dev, fn, &tail) == 3)
        return 1;
    return 0;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    unsigned domain, bus, dev, fn;
    if (pciBusId == NULL || device == NULL || !parse_bus_id(pciBusId, &domain, &bus, &dev, &fn))
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < g_n_visible; i++) {
        const struct sim_gpu *g = g_visible[i]->gpu;
        if (g->domain == domain && g->bus == bus && g->device == dev && fn == 0) {
            *device = g_visible[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

/* ---- device identity ---------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    TRY(check(device));
    if (device->mig == NULL)
        return copy_string(name, length, device->gpu->name);
    /* MIG devices are named after their parent and profile, as the real one does. */
    char buf[256];
    snprintf(buf, sizeof buf, "%s MIG %s", device->gpu->name, device->mig->profile);
    return copy_string(name, length, buf);
}

EXPORT nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, nvmlBrandType_t *type)
{
    TRY(check_out(device, type));
    *type = device->gpu->brand;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    TRY(check(device));
    return copy_string(uuid, length, device->mig ? device->mig->uuid : device->gpu->uuid);
}

/* Minor and index identify physical GPUs only; tools find a MIG device's
 * nodes through its parent. */
EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    TRY(check_out(device, minorNumber));
    if (device->mig)
        return NVML_ERROR_NOT_SUPPORTED;
    *minorNumber = device->gpu->minor;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    TRY(check_out(device, index));
    if (device->mig)
        return NVML_ERROR_NOT_SUPPORTED;
    *index = device->index;
    return NVML_SUCCESS;
}

static void fill_pci(const struct sim_gpu *g, nvmlPciInfo_t *pci)
{
    memset(pci, 0, sizeof *pci);
    /* Formatted from the numbers, not copied: NVML prints upper-case hex. */
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT,
             g->domain & 0xffff, g->bus & 0xff, g->device & 0xff);
    snprintf(pci->busId, sizeof pci->busId, NVML_DEVICE_PCI_BUS_ID_FMT, g->domain, g->bus & 0xff,
             g->device & 0xff);
    pci->domain = g->domain;
    pci->bus = g->bus;
    pci->device = g->device;
    pci->pciDeviceId = g->pci_device_id;
    pci->pciSubSystemId = g->pci_subsystem_id;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    TRY(check_out(device, pci));
    fill_pci(device->gpu, pci);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_v1_t *pci)
{
    nvmlPciInfo_t full;
    TRY(nvmlDeviceGetPciInfo_v3(device, pci ? &full : NULL));
    memset(pci, 0, sizeof *pci);
    memcpy(pci->busId, full.busIdLegacy, sizeof pci->busId);
    pci->domain = full.domain;
    pci->bus = full.bus;
    pci->device = full.device;
    pci->pciDeviceId = full.pciDeviceId;
    pci->pciSubSystemId = full.pciSubSystemId;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfoExt(nvmlDevice_t device, nvmlPciInfoExt_v1_t *pci)
{
    TRY(check_out(device, pci));
    if (pci->version != nvmlPciInfoExt_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlPciInfo_t full;
    fill_pci(device->gpu, &full);
    memset(pci, 0, sizeof *pci);
    pci->version = nvmlPciInfoExt_v1;
    pci->domain = full.domain;
    pci->bus = full.bus;
    pci->device = full.device;
    pci->pciDeviceId = full.pciDeviceId;
    pci->pciSubSystemId = full.pciSubSystemId;
    pci->baseClass = 0x03; /* display controller / 3D controller */
    pci->subClass = 0x02;
    memcpy(pci->busId, full.busId, sizeof pci->busId);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    TRY(check(device));
    if (major == NULL || minor == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *major = device->gpu->cc_major;
    *minor = device->gpu->cc_minor;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, nvmlDeviceArchitecture_t *arch)
{
    TRY(check_out(device, arch));
    /* nvmlDeviceArchitecture_t values by compute capability. */
    int cc = device->gpu->cc_major * 10 + device->gpu->cc_minor;
    if (cc >= 100)
        *arch = 10; /* Blackwell */
    else if (cc >= 90)
        *arch = 9; /* Hopper */
    else if (cc == 89)
        *arch = 8; /* Ada */
    else if (cc >= 80)
        *arch = 7; /* Ampere */
    else if (cc >= 75)
        *arch = 6; /* Turing */
    else if (cc >= 70)
        *arch = 5; /* Volta */
    else if (cc >= 60)
        *arch = 4; /* Pascal */
    else
        *arch = 0xffffffffu; /* unknown */
    return NVML_SUCCESS;
}

/* ---- state -------------------------------------------------------------- */

/* Used memory: the control file's figure; else what the device's live
 * processes use; else the host description's. */
static void memory_of(nvmlDevice_t device, unsigned long long *total, unsigned long long *used)
{
    unsigned long long by_processes;
    unsigned n = live_processes(device, NULL, 0, &by_processes);
    *total = device->mig ? device->mig->memory_total : device->gpu->memory_total;
    *used = live_value(device, L_MEM_USED, n ? by_processes : device->mig ? 0 : device->gpu->memory_used);
    if (*used > *total)
        *used = *total;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    TRY(check_out(device, memory));
    memory_of(device, &memory->total, &memory->used);
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    TRY(check_out(device, memory));
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory_of(device, &memory->total, &memory->used);
    /* The driver's own share (firmware, page tables, ECC), which the first version of the call
     * counts as used; here the first version reports the used figure alone. total = reserved +
     * used + free holds: what the file says is used is cut to what reservation leaves. */
    memory->reserved = live_value(device, L_MEM_RESERVED, device->mig ? 0 : SIM_MEMORY_RESERVED);
    if (memory->reserved > memory->total)
        memory->reserved = memory->total;
    if (memory->used > memory->total - memory->reserved)
        memory->used = memory->total - memory->reserved;
    memory->free = memory->total - memory->reserved - memory->used;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    TRY(check_out(device, utilization));
    /* With MIG on, the GPU has no single utilization figure (nvidia-smi shows N/A). */
    if (device->mig || device->gpu->mig_enabled)
        return NVML_ERROR_NOT_SUPPORTED;
    utilization->gpu = (unsigned)live_value(device, L_UTIL_GPU, device->gpu->util_gpu);
    utilization->memory = (unsigned)live_value(device, L_UTIL_MEM, device->gpu->util_memory);
    return NVML_SUCCESS;
}

/* Sensors and counters of the board: a MIG device has none of its own. */
static nvmlReturn_t board_value(nvmlDevice_t device, const void *out)
{
    TRY(check_out(device, out));
    return device->mig ? NVML_ERROR_NOT_SUPPORTED : NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensorType, unsigned int *temp)
{
    TRY(board_value(device, temp));
    if (sensorType != 0) /* NVML_TEMPERATURE_GPU is the only sensor */
        return NVML_ERROR_INVALID_ARGUMENT;
    *temp = (unsigned)live_value(device, L_TEMP, 33);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    TRY(board_value(device, power));
    *power = (unsigned)live_value(device, L_POWER, 58000); /* milliwatts */
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned int *clock)
{
    TRY(board_value(device, clock));
    switch (type) { /* nvmlClockType_t: graphics, SM, memory, video */
    case 0:
    case 1: *clock = (unsigned)live_value(device, L_SM_CLOCK, 1410); break;
    case 2: *clock = (unsigned)live_value(device, L_MEM_CLOCK, 1215); break;
    case 3: *clock = 1275; break;
    default: return NVML_ERROR_INVALID_ARGUMENT;
    }
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device, unsigned long long *energy)
{
    TRY(board_value(device, energy));
    *energy = live_value(device, L_ENERGY, 0); /* millijoules since the driver loaded */
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t *mode)
{
    TRY(check_out(device, mode));
    *mode = NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

/* The count protocol of the process queries: a NULL array (or a count too
 * small) is a size query answered with INSUFFICIENT_SIZE and the count
 * needed; zero processes need no buffer. Compute processes come from the
 * control file; graphics and MPS lists are always empty here. */
static nvmlReturn_t processes(nvmlDevice_t device, unsigned int *infoCount, void *infos, int v1, int any)
{
    TRY(check_out(device, infoCount));
    nvmlProcessInfo_t found[SIM_MAX_PROCS];
    unsigned long long bytes;
    unsigned n = any ? live_processes(device, found, SIM_MAX_PROCS, &bytes) : 0;
    if (n > SIM_MAX_PROCS)
        n = SIM_MAX_PROCS;
    if (n == 0) {
        *infoCount = 0;
        return NVML_SUCCESS;
    }
    if (infos == NULL || *infoCount < n) {
        *infoCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < n; i++) {
        if (v1) {
            nvmlProcessInfo_v1_t *out = (nvmlProcessInfo_v1_t *)infos + i;
            out->pid = found[i].pid;
            out->usedGpuMemory = found[i].usedGpuMemory;
        } else {
            ((nvmlProcessInfo_t *)infos)[i] = found[i];
        }
    }
    *infoCount = n;
    return NVML_SUCCESS;
}

#define PROCESS_QUERY(fn, type, v1, any)                                        \
    EXPORT nvmlReturn_t fn(nvmlDevice_t device, unsigned int *infoCount, type *infos) \
    {                                                                           \
        return processes(device, infoCount, infos, v1, any);                    \
    }

PROCESS_QUERY(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t, 1, 1)
PROCESS_QUERY(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_t, 0, 1)
PROCESS_QUERY(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t, 0, 1)
PROCESS_QUERY(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t, 1, 0)
PROCESS_QUERY(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_t, 0, 0)
PROCESS_QUERY(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t, 0, 0)
PROCESS_QUERY(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t, 1, 0)
PROCESS_QUERY(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_t, 0, 0)
PROCESS_QUERY(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t, 0, 0)

/* ---- what DCGM exporter's default fields read ---------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t device, unsigned int *value)
{
    TRY(board_value(device, value));
    *value = (unsigned)live_value(device, L_PCIE_REPLAY, 0);
    return NVML_SUCCESS;
}

/* The window encoder and decoder use is averaged over, which the calls report beside the
 * figure: fixed here at a sixth of a second. */
#define SIM_CODEC_PERIOD_US 167000u

static nvmlReturn_t codec_utilization(nvmlDevice_t device, int key, unsigned int *utilization,
                                      unsigned int *samplingPeriodUs)
{
    TRY(board_value(device, utilization));
    if (samplingPeriodUs == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *utilization = (unsigned)live_value(device, key, 0);
    *samplingPeriodUs = SIM_CODEC_PERIOD_US;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                                    unsigned int *samplingPeriodUs)
{
    return codec_utilization(device, L_ENC_UTIL, utilization, samplingPeriodUs);
}

EXPORT nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                                    unsigned int *samplingPeriodUs)
{
    return codec_utilization(device, L_DEC_UTIL, utilization, samplingPeriodUs);
}

/* Row remapping replaced page retirement with Ampere (compute capability 8.0). */
EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                              unsigned int *isPending, unsigned int *failureOccurred)
{
    TRY(check(device));
    if (corrRows == NULL || uncRows == NULL || isPending == NULL || failureOccurred == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (device->mig || device->gpu->cc_major < 8)
        return NVML_ERROR_NOT_SUPPORTED;
    *corrRows = (unsigned)live_value(device, L_REMAP_CORR, 0);
    *uncRows = (unsigned)live_value(device, L_REMAP_UNC, 0);
    *isPending = (unsigned)live_value(device, L_REMAP_PENDING, 0);
    *failureOccurred = (unsigned)live_value(device, L_REMAP_FAILURE, 0);
    return NVML_SUCCESS;
}

/* A vGPU guest's GPUs are in vGPU mode (bare metal's in none); a MIG handle answers for its GPU. */
EXPORT nvmlReturn_t nvmlDeviceGetVirtualizationMode(nvmlDevice_t device, nvmlGpuVirtualizationMode_t *mode)
{
    TRY(check_out(device, mode));
    *mode = SIM_VGPU_GUEST ? NVML_GPU_VIRTUALIZATION_MODE_VGPU : NVML_GPU_VIRTUALIZATION_MODE_NONE;
    return NVML_SUCCESS;
}

/* A guest's one licensable feature, vGPU, licensed as the control file says (by default it is);
 * bare metal has none to license (supported 0, no features), as a real GPU without vGPU. */
EXPORT nvmlReturn_t nvmlDeviceGetGridLicensableFeatures_v4(nvmlDevice_t device,
                                                           nvmlGridLicensableFeatures_t *features)
{
    TRY(check_out(device, features));
    memset(features, 0, sizeof(*features));
    if (!SIM_VGPU_GUEST || device->mig)
        return NVML_SUCCESS;
    nvmlGridLicensableFeature_t *vgpu = &features->gridLicensableFeatures[0];
    features->isGridLicenseSupported = 1;
    features->licensableFeaturesCount = 1;
    vgpu->featureCode = NVML_GRID_LICENSE_FEATURE_CODE_VGPU;
    vgpu->featureState = live_value(device, L_VGPU_LICENSED, 1) ? 1 : 0;
    vgpu->featureEnabled = 1;
    snprintf(vgpu->licenseInfo, sizeof(vgpu->licenseInfo), "%s", "NVIDIA-vComputeServer,9.0");
    snprintf(vgpu->productName, sizeof(vgpu->productName), "%s", "NVIDIA Virtual Compute Server");
    return NVML_SUCCESS;
}

static long long now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* One field of a field values request: its value and type, or why there is none. */
static nvmlReturn_t field_value(nvmlDevice_t device, nvmlFieldValue_t *field)
{
    int key;
    nvmlValueType_t type = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG; /* counters */
    switch (field->fieldId) {
    case NVML_FI_DEV_MEMORY_TEMP:
        if (!device->gpu->has_hbm)
            return NVML_ERROR_NOT_SUPPORTED;
        key = L_MEM_TEMP;
        type = NVML_VALUE_TYPE_UNSIGNED_INT;
        break;
    case NVML_FI_DEV_PCIE_REPLAY_COUNTER: key = L_PCIE_REPLAY; break;
    case NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX:
    case NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX:
        if (SIM_TOPOLOGY[gpu_number(device)].n_nvlinks == 0)
            return NVML_ERROR_NOT_SUPPORTED;
        /* scopeId names a link, or UINT_MAX all of them (nvml.h): the file sets the GPU's total,
         * which its links share evenly (the first links take what does not divide). */
        if (field->scopeId != 0xFFFFFFFFu && field->scopeId >= SIM_TOPOLOGY[gpu_number(device)].n_nvlinks)
            return NVML_ERROR_INVALID_ARGUMENT;
        key = field->fieldId == NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX ? L_NVLINK_TX : L_NVLINK_RX;
        break;
    default: return NVML_ERROR_NOT_SUPPORTED;
    }
    if (device->mig) /* every field here is the board's */
        return NVML_ERROR_NOT_SUPPORTED;
    unsigned long long v = live_value(device, key, key == L_MEM_TEMP ? SIM_MEMORY_TEMP : 0);
    if ((key == L_NVLINK_TX || key == L_NVLINK_RX) && field->scopeId != 0xFFFFFFFFu) {
        unsigned links = SIM_TOPOLOGY[gpu_number(device)].n_nvlinks;
        v = v / links + (field->scopeId < v % links ? 1 : 0);
    }
    field->valueType = type;
    if (type == NVML_VALUE_TYPE_UNSIGNED_INT)
        field->value.uiVal = (unsigned)v;
    else
        field->value.ullVal = v;
    return NVML_SUCCESS;
}

/* The call succeeds while the device does; each field says on its own whether it has a value. */
EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values)
{
    TRY(check(device));
    if (valuesCount < 0 || (valuesCount > 0 && values == NULL))
        return NVML_ERROR_INVALID_ARGUMENT;
    long long now = now_us();
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *field = &values[i];
        field->timestamp = now;
        field->latencyUsec = 0; /* the values are at hand: no driver round trip to wait for */
        field->valueType = NVML_VALUE_TYPE_DOUBLE;
        memset(&field->value, 0, sizeof field->value);
        field->nvmlReturn = field_value(device, field);
    }
    return NVML_SUCCESS;
}

/* ---- per-process utilization ---------------------------------------------
 * The control file's process_util lines of a GPU, for the processes that still
 * exist.  The simulated GPU samples all the time: every sample is stamped with
 * the time of the call (microseconds since 1970), so a caller that passes the
 * newest timestamp it has seen gets the processes again on its next read, and
 * one that passes a time not yet reached gets none.  GPUs in MIG mode keep no
 * per-process samples (as their utilization is not supported either). */
EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                                    unsigned int *processSamplesCount,
                                                    unsigned long long lastSeenTimeStamp)
{
    TRY(check_out(device, processSamplesCount));
    if (device->mig || device->gpu->mig_enabled)
        return NVML_ERROR_NOT_SUPPORTED;
    nvmlProcessUtilizationSample_t found[SIM_MAX_PROCS];
    unsigned n = 0;
    unsigned long long now = (unsigned long long)now_us();
    if (on_host() && now > lastSeenTimeStamp) {
        pthread_mutex_lock(&g_live_lock);
        reload_control();
        for (unsigned i = 0; i < g_n_proc_utils && n < SIM_MAX_PROCS; i++) {
            const struct sim_proc_util *p = &g_proc_utils[i];
            if (strcmp(p->uuid, device->gpu->uuid) != 0 || !process_exists(p->pid))
                continue;
            found[n++] = (nvmlProcessUtilizationSample_t){p->pid, now, p->sm, p->mem, p->enc, p->dec};
        }
        pthread_mutex_unlock(&g_live_lock);
    }
    if (n == 0) {
        *processSamplesCount = 0;
        return NVML_ERROR_NOT_FOUND;
    }
    if (utilization == NULL || *processSamplesCount < n) {
        *processSamplesCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(utilization, found, n * sizeof found[0]);
    *processSamplesCount = n;
    return NVML_SUCCESS;
}

/* ---- GPM: GPU Performance Monitoring (Hopper and later) -------------------
 * A sample is a snapshot of one device's gpm_* values from the control file,
 * numbered in the order samples are taken; a metric over two samples is the
 * value the second one holds (what the file said the rate was then).  Samples
 * live in a static pool, so a bad or freed handle is refused, not followed. */

#define SIM_MAX_GPM_SAMPLES 1024
#define SIM_GPM_KEYS 7

struct nvmlGpmSample_st {
    int used;
    nvmlDevice_t device; /* NULL until taken; a GPU or a MIG device */
    unsigned long long taken; /* order among all samples taken */
    unsigned long long value[SIM_GPM_KEYS];
};

/* The metrics the simulation models: their live value and NVML's names for them. */
static const struct {
    unsigned id;
    int key;
    char *short_name, *long_name, *unit;
} GPM_METRICS[SIM_GPM_KEYS] = {
    {NVML_GPM_METRIC_GRAPHICS_UTIL, L_GPM_GRAPHICS, "gr_util", "graphics engine utilization", "%"},
    {NVML_GPM_METRIC_SM_UTIL, L_GPM_SM, "sm_util", "streaming multiprocessor utilization", "%"},
    {NVML_GPM_METRIC_SM_OCCUPANCY, L_GPM_SM_OCCUPANCY, "sm_occupancy", "warps resident on the SMs", "%"},
    {NVML_GPM_METRIC_ANY_TENSOR_UTIL, L_GPM_TENSOR, "any_tensor_util", "any tensor pipe utilization", "%"},
    {NVML_GPM_METRIC_DRAM_BW_UTIL, L_GPM_DRAM, "dram_bw_util", "memory bandwidth utilization", "%"},
    {NVML_GPM_METRIC_PCIE_TX_PER_SEC, L_GPM_PCIE_TX, "pcie_tx", "PCIe bytes sent", "MiB/s"},
    {NVML_GPM_METRIC_PCIE_RX_PER_SEC, L_GPM_PCIE_RX, "pcie_rx", "PCIe bytes received", "MiB/s"},
};

static struct nvmlGpmSample_st g_gpm[SIM_MAX_GPM_SAMPLES];
static unsigned long long g_gpm_taken;
static pthread_mutex_t g_gpm_lock = PTHREAD_MUTEX_INITIALIZER;
static const struct sim_pool GPM_SAMPLES = {g_gpm, sizeof g_gpm[0], SIM_MAX_GPM_SAMPLES, &g_gpm_lock};

static int gpm_capable(const struct sim_gpu *gpu)
{
    return gpu->cc_major >= 9;
}

/* Called with g_gpm_lock held. */
static int valid_sample(nvmlGpmSample_t sample)
{
    return pool_holds(&GPM_SAMPLES, sample);
}

EXPORT nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t device, nvmlGpmSupport_t *gpmSupport)
{
    TRY(check_out(device, gpmSupport));
    if (gpmSupport->version != NVML_GPM_SUPPORT_VERSION)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    gpmSupport->isSupportedDevice = gpm_capable(device->gpu); /* a MIG device: its GPU's answer */
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *gpmSample)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (gpmSample == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_gpm_lock);
    nvmlGpmSample_t sample = pool_take(&GPM_SAMPLES);
    if (sample)
        *gpmSample = sample;
    pthread_mutex_unlock(&g_gpm_lock);
    return sample ? NVML_SUCCESS : NVML_ERROR_MEMORY;
}

EXPORT nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t gpmSample)
{
    return pool_free(&GPM_SAMPLES, gpmSample);
}

/* Fill sample with device's values now. */
static nvmlReturn_t take_sample(nvmlDevice_t device, nvmlGpmSample_t sample)
{
    unsigned long long value[SIM_GPM_KEYS];
    for (unsigned i = 0; i < SIM_GPM_KEYS; i++) /* read first: live_value takes its own lock */
        value[i] = live_value(device, GPM_METRICS[i].key, 0);
    pthread_mutex_lock(&g_gpm_lock);
    int ok = valid_sample(sample);
    if (ok) {
        sample->device = device;
        sample->taken = ++g_gpm_taken;
        memcpy(sample->value, value, sizeof value);
    }
    pthread_mutex_unlock(&g_gpm_lock);
    return ok ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

/* A GPU's sample, or with a MIG device's handle that MIG device's. */
EXPORT nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t device, nvmlGpmSample_t gpmSample)
{
    TRY(check(device));
    if (!gpm_capable(device->gpu))
        return NVML_ERROR_NOT_SUPPORTED;
    return take_sample(device, gpmSample);
}

/* The sample of the MIG device of GPU instance gpuInstanceId on GPU device. */
EXPORT nvmlReturn_t nvmlGpmMigSampleGet(nvmlDevice_t device, unsigned int gpuInstanceId, nvmlGpmSample_t gpmSample)
{
    TRY(check(device));
    if (device->mig)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!gpm_capable(device->gpu))
        return NVML_ERROR_NOT_SUPPORTED;
    for (unsigned i = 0; i < device->n_mig; i++)
        if (device->migs[i]->mig->gi_id == gpuInstanceId)
            return take_sample(device->migs[i], gpmSample);
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *metricsGet)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (metricsGet == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (metricsGet->version != NVML_GPM_METRICS_GET_VERSION)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    TRY(injected_fault());
    if (metricsGet->numMetrics > NVML_GPM_METRIC_MAX)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct nvmlGpmSample_st second;
    pthread_mutex_lock(&g_gpm_lock);
    nvmlGpmSample_t s1 = metricsGet->sample1, s2 = metricsGet->sample2;
    /* Two samples of one device, the second taken after the first: a rate needs an interval. */
    int ok = valid_sample(s1) && valid_sample(s2) && s1->device != NULL && s1->device == s2->device &&
             s2->taken > s1->taken;
    if (ok)
        second = *s2;
    pthread_mutex_unlock(&g_gpm_lock);
    if (!ok)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < metricsGet->numMetrics; i++) {
        nvmlGpmMetric_t *m = &metricsGet->metrics[i];
        m->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        m->value = 0;
        m->metricInfo.shortName = m->metricInfo.longName = m->metricInfo.unit = NULL;
        for (unsigned k = 0; k < SIM_GPM_KEYS; k++) {
            if (GPM_METRICS[k].id == m->metricId) {
                m->nvmlReturn = NVML_SUCCESS;
                m->value = (double)second.value[k];
                m->metricInfo.shortName = GPM_METRICS[k].short_name;
                m->metricInfo.longName = GPM_METRICS[k].long_name;
                m->metricInfo.unit = GPM_METRICS[k].unit;
            }
        }
    }
    return NVML_SUCCESS;
}

/* ---- MIG ---------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                         unsigned int *pendingMode)
{
    TRY(check(device));
    if (currentMode == NULL || pendingMode == NULL || device->mig)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!mig_capable(device->gpu))
        return NVML_ERROR_NOT_SUPPORTED;
    *currentMode = *pendingMode = device->gpu->mig_enabled ? 1 : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    TRY(check(device));
    if (count == NULL || device->mig)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* Seven compute slices on every MIG-capable part; zero when MIG is off. */
    unsigned max = device->gpu->mig_enabled ? 7 : 0;
    if (device->gpu->mig_enabled && device->gpu->n_mig > max)
        max = device->gpu->n_mig < SIM_MAX_MIG ? device->gpu->n_mig : SIM_MAX_MIG;
    *count = max;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                        nvmlDevice_t *migDevice)
{
    TRY(check(device));
    unsigned max = 0;
    nvmlDeviceGetMaxMigDeviceCount(device, &max);
    if (migDevice == NULL || device->mig || index >= max)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (index >= device->n_mig)
        return NVML_ERROR_NOT_FOUND;
    *migDevice = device->migs[index];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    TRY(check_out(device, isMigDevice));
    *isMigDevice = device->mig != NULL;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    TRY(check_out(device, id));
    if (device->mig == NULL)
        return NVML_ERROR_NOT_SUPPORTED;
    *id = device->mig->gi_id;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    TRY(check_out(device, id));
    if (device->mig == NULL)
        return NVML_ERROR_NOT_SUPPORTED;
    *id = device->mig->ci_id;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice,
                                                                 nvmlDevice_t *device)
{
    TRY(check(migDevice));
    if (device == NULL || migDevice->mig == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = migDevice->parent;
    return NVML_SUCCESS;
}

/* ---- MIG instances and profiles ------------------------------------------
 * What NVIDIA's CDI generator asks of a MIG device: its attributes, its GPU
 * and compute instance (by id) and their info, and the instance profiles.
 * Every simulated MIG GPU is an A100-SXM4-40GB; the numbers are that part's
 * (nvidia-smi mig -lgip / -lcip).  Each MIG device is one GPU instance
 * holding one compute instance that spans it. */

/* GI_PROFILES (sim_host.h, from model.MIG_PROFILES) is indexed by
 * NVML_GPU_INSTANCE_PROFILE_<n>_SLICE; the compute instance profiles
 * (NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE) have the same indices and slice counts.
 * A MIG device's attributes and its memory info come from the same host data, so
 * that GFD's label (attributes) and ours (memory info) agree, as on a real GPU. */
#define N_GI_PROFILES (sizeof GI_PROFILES / sizeof GI_PROFILES[0])

/* NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE for a compute instance of n slices. */
static int ci_profile_index(unsigned slices)
{
    for (unsigned i = 0; i < N_GI_PROFILES; i++)
        if (GI_PROFILES[i].slices == slices)
            return (int)i;
    return -1;
}

static const struct sim_gi_profile *profile_named(const char *name)
{
    for (unsigned i = 0; i < N_GI_PROFILES; i++)
        if (strcmp(GI_PROFILES[i].name, name) == 0)
            return &GI_PROFILES[i];
    return NULL;
}

static const struct sim_gi_profile *profile_of(nvmlDevice_t mig)
{
    return profile_named(mig->mig->profile);
}

/* Where a GPU instance sits: its GPU's instances, in the host's order, packed from slice 0. */
static unsigned placement_start(nvmlDevice_t mig)
{
    const struct sim_gpu *gpu = mig->gpu;
    unsigned start = 0;
    for (unsigned i = 0; i < gpu->n_mig && &gpu->mig[i] != mig->mig; i++) {
        const struct sim_gi_profile *p = profile_named(gpu->mig[i].profile);
        start += p ? p->placement_size : 1;
    }
    return start;
}

/* A GPU or compute instance handle is the MIG device's own. */
/* A GPU or compute instance handle is the MIG device's own; profile: its GPU instance profile. */
static nvmlReturn_t check_instance(const void *handle, nvmlDevice_t *mig, const struct sim_gi_profile **profile)
{
    nvmlDevice_t device = (nvmlDevice_t)(uintptr_t)handle;
    TRY(check(device));
    if (device->mig == NULL || (*profile = profile_of(device)) == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *mig = device;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    TRY(check_out(device, attributes));
    const struct sim_gi_profile *p = device->mig ? profile_of(device) : NULL;
    if (p == NULL)
        return NVML_ERROR_NOT_SUPPORTED; /* whole GPUs: see docs/simulate.md */
    attributes->multiprocessorCount = p->sms;
    attributes->sharedCopyEngineCount = p->copy_engines;
    attributes->sharedDecoderCount = p->decoders;
    attributes->sharedEncoderCount = p->encoders;
    attributes->sharedJpegCount = p->jpegs;
    attributes->sharedOfaCount = p->ofas;
    attributes->gpuInstanceSliceCount = p->slices;
    attributes->computeInstanceSliceCount = p->slices;
    attributes->memorySizeMB = p->memory_mb;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    return nvmlDeviceGetAttributes_v2(device, attributes);
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id, nvmlGpuInstance_t *gpuInstance)
{
    TRY(check_out(device, gpuInstance));
    if (device->mig != NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!device->gpu->mig_enabled)
        return NVML_ERROR_NOT_SUPPORTED;
    for (unsigned i = 0; i < device->n_mig; i++) {
        if (device->migs[i]->mig->gi_id == id) {
            *gpuInstance = (nvmlGpuInstance_t)(uintptr_t)device->migs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info)
{
    nvmlDevice_t mig = NULL;
    const struct sim_gi_profile *p = NULL;
    TRY(check_instance(gpuInstance, &mig, &p));
    if (info == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    info->device = mig->parent;
    info->id = mig->mig->gi_id;
    info->profileId = p->id;
    info->placement.start = placement_start(mig);
    info->placement.size = p->placement_size;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance, unsigned int id,
                                                          nvmlComputeInstance_t *computeInstance)
{
    nvmlDevice_t mig = NULL;
    const struct sim_gi_profile *p = NULL;
    TRY(check_instance(gpuInstance, &mig, &p));
    if (computeInstance == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (mig->mig->ci_id != id)
        return NVML_ERROR_NOT_FOUND;
    *computeInstance = (nvmlComputeInstance_t)(uintptr_t)mig;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance,
                                                  nvmlComputeInstanceInfo_t *info)
{
    nvmlDevice_t mig = NULL;
    const struct sim_gi_profile *p = NULL;
    TRY(check_instance(computeInstance, &mig, &p));
    if (info == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    info->device = mig->parent;
    info->gpuInstance = (nvmlGpuInstance_t)(uintptr_t)mig;
    info->id = mig->mig->ci_id;
    info->profileId = (unsigned)ci_profile_index(p->slices);
    info->placement.start = 0;
    info->placement.size = p->slices;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t computeInstance, nvmlComputeInstanceInfo_t *info)
{
    return nvmlComputeInstanceGetInfo_v2(computeInstance, info);
}

/* The profile a GPU instance profile query asks about; info, the struct it fills, is checked last,
 * as NVML orders its checks. */
static nvmlReturn_t gi_profile(nvmlDevice_t device, unsigned int profile, const void *info,
                               const struct sim_gi_profile **out)
{
    TRY(check(device));
    if (device->mig != NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!mig_capable(device->gpu) || profile >= N_GI_PROFILES)
        return NVML_ERROR_NOT_SUPPORTED; /* past 7 slices: the *_REV1 and other parts' profiles */
    if (info == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = &GI_PROFILES[profile];
    return NVML_SUCCESS;
}

/* Both versions of the profile structs share their field names: one filler each serves both. */
#define FILL_GI_PROFILE(info, p)                                                                \
    do {                                                                                        \
        (info)->id = (p)->id;                                                                   \
        (info)->isP2pSupported = 0;                                                             \
        (info)->sliceCount = (p)->slices;                                                       \
        (info)->instanceCount = (p)->instances;                                                 \
        (info)->multiprocessorCount = (p)->sms;                                                 \
        (info)->copyEngineCount = (p)->copy_engines;                                            \
        (info)->decoderCount = (p)->decoders;                                                   \
        (info)->encoderCount = (p)->encoders;                                                   \
        (info)->jpegCount = (p)->jpegs;                                                         \
        (info)->ofaCount = (p)->ofas;                                                           \
        (info)->memorySizeMB = (p)->memory_mb;                                                  \
    } while (0)

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                        nvmlGpuInstanceProfileInfo_t *info)
{
    const struct sim_gi_profile *p = NULL;
    TRY(gi_profile(device, profile, info, &p));
    FILL_GI_PROFILE(info, p);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
                                                         nvmlGpuInstanceProfileInfo_v2_t *info)
{
    const struct sim_gi_profile *p = NULL;
    TRY(gi_profile(device, profile, info, &p));
    if (info->version != nvmlGpuInstanceProfileInfo_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    FILL_GI_PROFILE(info, p);
    snprintf(info->name, sizeof info->name, "MIG %s", p->name);
    return NVML_SUCCESS;
}

/* The GPU instance and slice count a compute instance profile query asks about; info as in
 * gi_profile. */
static nvmlReturn_t ci_profile(nvmlGpuInstance_t gpuInstance, unsigned int profile, unsigned int engProfile,
                               const void *info, const struct sim_gi_profile **gi, unsigned *slices)
{
    nvmlDevice_t mig = NULL;
    TRY(check_instance(gpuInstance, &mig, gi));
    if (engProfile != 0) /* NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED only */
        return NVML_ERROR_NOT_SUPPORTED;
    if (profile >= N_GI_PROFILES || GI_PROFILES[profile].slices > (*gi)->slices)
        return NVML_ERROR_NOT_SUPPORTED;
    if (info == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *slices = GI_PROFILES[profile].slices;
    return NVML_SUCCESS;
}

#define FILL_CI_PROFILE(info, profile, slices, gi)                                              \
    do {                                                                                        \
        (info)->id = (profile);                                                                 \
        (info)->sliceCount = (slices);                                                          \
        (info)->instanceCount = (gi)->slices / (slices);                                        \
        (info)->multiprocessorCount = 14 * (slices); /* an A100 slice has 14 SMs */             \
        (info)->sharedCopyEngineCount = (gi)->copy_engines;                                     \
        (info)->sharedDecoderCount = (gi)->decoders;                                            \
        (info)->sharedEncoderCount = (gi)->encoders;                                            \
        (info)->sharedJpegCount = (gi)->jpegs;                                                  \
        (info)->sharedOfaCount = (gi)->ofas;                                                    \
    } while (0)

EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                                 unsigned int engProfile,
                                                                 nvmlComputeInstanceProfileInfo_t *info)
{
    const struct sim_gi_profile *gi = NULL;
    unsigned slices = 0;
    TRY(ci_profile(gpuInstance, profile, engProfile, info, &gi, &slices));
    FILL_CI_PROFILE(info, profile, slices, gi);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                                  unsigned int engProfile,
                                                                  nvmlComputeInstanceProfileInfo_v2_t *info)
{
    const struct sim_gi_profile *gi = NULL;
    unsigned slices = 0;
    TRY(ci_profile(gpuInstance, profile, engProfile, info, &gi, &slices));
    if (info->version != nvmlComputeInstanceProfileInfo_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    FILL_CI_PROFILE(info, profile, slices, gi);
    if (slices == gi->slices)
        snprintf(info->name, sizeof info->name, "MIG %s", gi->name);
    else
        snprintf(info->name, sizeof info->name, "MIG %uc.%s", slices, gi->name);
    return NVML_SUCCESS;
}

/* ---- events -------------------------------------------------------------
 * What NVIDIA's device plugin waits on for health: an event set, the device's
 * supported event types, registration, and the wait.  Events come from
 * SIM_ROOT/nvml-events, a log that tests append to (control.inject_xid):
 *     <uuid> xid <n>            an XID on a GPU; with a MIG device's uuid, on
 *                               its GPU, naming the MIG device's instances
 * Any other line, and any line over 255 bytes, is read past as no event.
 * A set sees the lines appended after it was made, as the driver delivers only
 * the events that happen while a set exists; each set reads the log on its own,
 * so every process (and every set) waiting gets every event.  Only on the host. */

#define SIM_EVENTS_FILE SIM_ROOT "/nvml-events"
#define SIM_MAX_EVENT_SETS 64
#define SIM_SUPPORTED_EVENTS                                                                 \
    (nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError | nvmlEventTypePState | \
     nvmlEventTypeXidCriticalError | nvmlEventTypeClock)
#define SIM_NO_INSTANCE 0xFFFFFFFFu

struct nvmlEventSet_st {
    int used;
    long offset;                                   /* bytes of the log already read */
    unsigned long long registered[SIM_N_GPUS + 1]; /* event types, by SIM_GPUS index */
};

static struct nvmlEventSet_st g_sets[SIM_MAX_EVENT_SETS];
static pthread_mutex_t g_sets_lock = PTHREAD_MUTEX_INITIALIZER;
static const struct sim_pool EVENT_SETS = {g_sets, sizeof g_sets[0], SIM_MAX_EVENT_SETS, &g_sets_lock};

static long events_size(void)
{
    struct stat st;
    return on_host() && stat(SIM_EVENTS_FILE, &st) == 0 ? (long)st.st_size : 0;
}

/* A set handle is valid if it is one of ours and in use; called with g_sets_lock held. */
static int valid_set(nvmlEventSet_t set)
{
    return pool_holds(&EVENT_SETS, set);
}

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (set == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    TRY(injected_fault());
    pthread_mutex_lock(&g_sets_lock);
    nvmlEventSet_t made = pool_take(&EVENT_SETS);
    if (made) {
        made->offset = events_size();
        *set = made;
    }
    pthread_mutex_unlock(&g_sets_lock);
    return made ? NVML_SUCCESS : NVML_ERROR_MEMORY;
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    return pool_free(&EVENT_SETS, set);
}

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    TRY(check_out(device, eventTypes));
    if (device->mig) /* events are registered on the GPU; they name the MIG instance */
        return NVML_ERROR_NOT_SUPPORTED;
    *eventTypes = SIM_SUPPORTED_EVENTS;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                             nvmlEventSet_t set)
{
    TRY(check(device));
    if (device->mig)
        return NVML_ERROR_NOT_SUPPORTED;
    if (eventTypes & ~SIM_SUPPORTED_EVENTS) /* nvml.h: some of the requested types are unsupported */
        return NVML_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&g_sets_lock);
    int ok = valid_set(set);
    if (ok)
        set->registered[gpu_number(device)] |= eventTypes;
    pthread_mutex_unlock(&g_sets_lock);
    return ok ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

/* The event a log line names, if it is for a GPU this process sees and the set registered for. */
static int event_of(const char *line, nvmlEventSet_t set, nvmlEventData_t *data)
{
    char uuid[96], kind[16];
    unsigned long long value;
    if (sscanf(line, "%95s %15s %llu", uuid, kind, &value) != 3 || strcmp(kind, "xid") != 0)
        return 0;
    for (unsigned i = 0; i < g_n_visible; i++) {
        struct nvmlDevice_st *d = g_visible[i];
        const struct sim_mig *mig = NULL;
        if (strcmp(d->gpu->uuid, uuid) != 0) {
            for (unsigned m = 0; m < d->gpu->n_mig; m++)
                if (strcmp(d->gpu->mig[m].uuid, uuid) == 0)
                    mig = &d->gpu->mig[m];
            if (mig == NULL)
                continue;
        }
        if (!(set->registered[gpu_number(d)] & nvmlEventTypeXidCriticalError))
            return 0;
        data->device = d;
        data->eventType = nvmlEventTypeXidCriticalError;
        data->eventData = value;
        data->gpuInstanceId = mig ? mig->gi_id : SIM_NO_INSTANCE;
        data->computeInstanceId = mig ? mig->ci_id : SIM_NO_INSTANCE;
        return 1;
    }
    return 0;
}

/* The next whole line of f: its length in bytes, newline included, with its first size - 1
 * bytes in buf (NUL-terminated), or 0 while no whole line is there (a writer's line is consumed
 * once its newline is there). A longer line is counted whole and cut in buf, and *cut says so:
 * the caller skips it, rather than stop at it for good as it would reading only what fits. */
static long whole_line(FILE *f, char *buf, size_t size, int *cut)
{
    long n = 0;
    int c;
    while ((c = getc(f)) != EOF) {
        if ((size_t)n < size - 1)
            buf[n] = (char)c;
        n++;
        if (c == '\n') {
            *cut = (size_t)n > size - 1;
            buf[*cut ? size - 1 : (size_t)n] = '\0';
            return n;
        }
    }
    return 0;
}

/* The next event of the set in the log, if one was appended; 1 when data holds it. */
static int next_event(nvmlEventSet_t set, nvmlEventData_t *data)
{
    if (!on_host())
        return 0;
    FILE *f = fopen(SIM_EVENTS_FILE, "re");
    if (f == NULL)
        return 0;
    int found = 0, cut = 0;
    long n;
    char line[256];
    pthread_mutex_lock(&g_sets_lock);
    struct stat st;
    /* A log shorter than what the set read was removed and begun again (control.clear_events). */
    if (valid_set(set) && fstat(fileno(f), &st) == 0 && st.st_size < set->offset)
        set->offset = 0;
    if (valid_set(set) && fseek(f, set->offset, SEEK_SET) == 0) {
        /* No event's line is that long: one that is (a writer's garbage) is no event. */
        while (!found && (n = whole_line(f, line, sizeof line, &cut)) > 0) {
            set->offset += n;
            found = !cut && event_of(line, set, data);
        }
    }
    pthread_mutex_unlock(&g_sets_lock);
    fclose(f);
    return found;
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (data == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_sets_lock);
    int ok = valid_set(set);
    pthread_mutex_unlock(&g_sets_lock);
    if (!ok)
        return NVML_ERROR_INVALID_ARGUMENT;
    long long deadline = now_ms() + timeoutms;
    for (;;) {
        TRY(injected_fault());
        if (next_event(set, data))
            return NVML_SUCCESS;
        long long left = deadline - now_ms();
        if (left <= 0)
            return NVML_ERROR_TIMEOUT;
        /* The log is polled: 20 ms is far below any health check's interval. */
        struct timespec pause = {0, (left < 20 ? left : 20) * 1000000L};
        nanosleep(&pause, NULL);
    }
}

EXPORT nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_v1_t *data, unsigned int timeoutms)
{
    nvmlEventData_t full;
    if (data == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    TRY(nvmlEventSetWait_v2(set, &full, timeoutms));
    data->device = full.device;
    data->eventType = full.eventType;
    data->eventData = full.eventData;
    return NVML_SUCCESS;
}

/* ---- topology ------------------------------------------------------------
 * From the host description (SIM_TOPOLOGY): GPUs under one PCIe switch meet
 * there (SINGLE); else, on one NUMA node, at its CPU (NODE: each switch has its
 * own host bridge); else across the CPUs' interconnect (SYSTEM).  A MIG device
 * sits where its GPU does.  NVLinks: link n of a GPU leads to its n-th peer. */

/* NVLinks a part has (A100: 12, H100: 18); PCIe cards (L4, T4) have none. */
static unsigned nvlinks_of(const struct sim_gpu *gpu)
{
    if (gpu->cc_major == 8 && gpu->cc_minor == 0)
        return 12;
    return gpu->cc_major >= 9 ? 18 : 0;
}

EXPORT nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                        nvmlGpuTopologyLevel_t *pathInfo)
{
    TRY(check_out(device1, pathInfo));
    TRY(check(device2));
    const struct sim_topology *a = &SIM_TOPOLOGY[gpu_number(device1)];
    const struct sim_topology *b = &SIM_TOPOLOGY[gpu_number(device2)];
    if (device1->gpu == device2->gpu)
        *pathInfo = NVML_TOPOLOGY_INTERNAL;
    else if (a->pcie_switch == b->pcie_switch)
        *pathInfo = NVML_TOPOLOGY_SINGLE;
    else if (a->numa_node == b->numa_node)
        *pathInfo = NVML_TOPOLOGY_NODE;
    else
        *pathInfo = NVML_TOPOLOGY_SYSTEM;
    return NVML_SUCCESS;
}

/* The topology of an NVLink query's GPU and link; NVML_SUCCESS when the link exists. */
static nvmlReturn_t nvlink(nvmlDevice_t device, unsigned int link, const void *out,
                           const struct sim_topology **topology)
{
    TRY(check_out(device, out));
    if (link >= NVML_NVLINK_MAX_LINKS)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* Past the part's own links, as on none at all: NOT_SUPPORTED, which go-gpuallocator skips
     * (any other error there fails its whole topology read). */
    if (device->mig || link >= nvlinks_of(device->gpu))
        return NVML_ERROR_NOT_SUPPORTED;
    *topology = &SIM_TOPOLOGY[gpu_number(device)];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive)
{
    const struct sim_topology *t = NULL;
    TRY(nvlink(device, link, isActive, &t));
    *isActive = link < t->n_nvlinks ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    const struct sim_topology *t = NULL;
    TRY(nvlink(device, link, pci, &t));
    if (link >= t->n_nvlinks || t->nvlink_peer[link] >= SIM_N_GPUS)
        return NVML_ERROR_NOT_SUPPORTED; /* an inactive link leads nowhere */
    fill_pci(&SIM_GPUS[t->nvlink_peer[link]], pci);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetNvLinkRemotePciInfo_v2(device, link, pci);
}
