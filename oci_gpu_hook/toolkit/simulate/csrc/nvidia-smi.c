/* Simulated nvidia-smi: like the real one, a pure NVML client, so what it
 * prints inside a container is exactly what the (simulated) NVML lets that
 * container see.  Output formats follow the real tool closely enough for
 * scripts that parse `-L` and `--query-gpu ... --format=csv`. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sim_nvml.h"

#define MIB (1024ULL * 1024ULL)

/* nvidia-smi's documented return codes mirror the NVML error codes it hit;
 * anything outside that documented set is 255. */
static int exit_code(nvmlReturn_t ret)
{
    switch (ret) {
    case NVML_ERROR_INVALID_ARGUMENT:
    case NVML_ERROR_NOT_SUPPORTED:
    case NVML_ERROR_NO_PERMISSION:
    case NVML_ERROR_NOT_FOUND:
    case NVML_ERROR_INSUFFICIENT_POWER:
    case NVML_ERROR_DRIVER_NOT_LOADED:
    case NVML_ERROR_TIMEOUT:
    case NVML_ERROR_LIBRARY_NOT_FOUND:
    case NVML_ERROR_FUNCTION_NOT_FOUND:
    case NVML_ERROR_CORRUPTED_INFOROM:
    case NVML_ERROR_GPU_IS_LOST:
        return (int)ret;
    default:
        return 255;
    }
}

static int init_or_die(void)
{
    nvmlReturn_t ret = nvmlInit_v2();
    if (ret == NVML_SUCCESS)
        return 0;
    if (ret == NVML_ERROR_DRIVER_NOT_LOADED)
        printf("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
               "Make sure that the latest NVIDIA driver is installed and running.\n\n");
    else
        printf("Failed to initialize NVML: %s\n", nvmlErrorString(ret));
    return exit_code(ret);
}

static int fail(nvmlReturn_t ret)
{
    printf("Unable to determine the device handle for GPU: %s\n", nvmlErrorString(ret));
    nvmlShutdown();
    return exit_code(ret);
}

static int bad_args(void)
{
    printf("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n\n");
    return 2;
}

static int no_devices(void)
{
    printf("No devices were found\n");
    nvmlShutdown();
    return exit_code(NVML_ERROR_NOT_FOUND);
}

/* "12.550.54.15" -> "550.54": nvidia-smi shows the driver branch, not the
 * CUDA-prefixed string NVML returns. */
static void short_nvml_version(const char *full, char *out, size_t size)
{
    const char *p = strchr(full, '.');
    snprintf(out, size, "%s", p ? p + 1 : full);
    char *first = strchr(out, '.');
    char *last = strrchr(out, '.');
    if (first && last && first != last)
        *last = '\0';
}

static void cuda_version(char *out, size_t size)
{
    int v = 0;
    if (nvmlSystemGetCudaDriverVersion_v2(&v) == NVML_SUCCESS)
        snprintf(out, size, "%d.%d", v / 1000, (v % 1000) / 10);
    else
        snprintf(out, size, "N/A");
}

/* The MIG profile is what follows " MIG " in the MIG device's name. */
static const char *mig_profile(const char *name)
{
    const char *p = strstr(name, " MIG ");
    return p ? p + 5 : name;
}

/* The head of every command that walks the GPUs: NVML up, and at least one GPU to show (with
 * none, the real tool says so and exits 6). Returns 0 to go on, else the exit status. */
static int open_devices(unsigned *count)
{
    int rc = init_or_die();
    if (rc)
        return rc;
    nvmlReturn_t ret = nvmlDeviceGetCount_v2(count);
    if (ret != NVML_SUCCESS)
        return fail(ret);
    return *count == 0 ? no_devices() : 0;
}

/* The walk of every command that shows GPUs: visit(index, handle, arg) for each in index order. An
 * NVML error, from the handle or the visit, ends it as the real tool ends (fail). Returns 0 once
 * every GPU was visited (NVML still up), else the exit status. */
static int each_gpu(unsigned count, nvmlReturn_t (*visit)(unsigned, nvmlDevice_t, void *), void *arg)
{
    for (unsigned i = 0; i < count; i++) {
        nvmlDevice_t dev;
        nvmlReturn_t ret = nvmlDeviceGetHandleByIndex_v2(i, &dev);
        if (ret == NVML_SUCCESS)
            ret = visit(i, dev, arg);
        if (ret != NVML_SUCCESS)
            return fail(ret);
    }
    return 0;
}

static int cmd_version(void)
{
    int rc = init_or_die();
    if (rc)
        return rc;
    char drv[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE] = "N/A";
    char nvml[NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE] = "N/A", nvml_short[sizeof nvml];
    char cuda[32];
    nvmlSystemGetDriverVersion(drv, sizeof drv);
    nvmlSystemGetNVMLVersion(nvml, sizeof nvml);
    short_nvml_version(nvml, nvml_short, sizeof nvml_short);
    cuda_version(cuda, sizeof cuda);
    /* The tool ships with the driver, so its own version is the driver's. */
    printf("NVIDIA-SMI version  : %s\n", drv);
    printf("NVML version        : %s\n", nvml_short);
    printf("DRIVER version      : %s\n", drv);
    printf("CUDA Version        : %s\n", cuda);
    nvmlShutdown();
    return 0;
}

/* -L: the GPU's line, then one for each of its MIG devices. */
static nvmlReturn_t list_gpu(unsigned i, nvmlDevice_t dev, void *unused)
{
    (void)unused;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE], uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    nvmlReturn_t ret;
    if ((ret = nvmlDeviceGetName(dev, name, sizeof name)) != NVML_SUCCESS ||
        (ret = nvmlDeviceGetUUID(dev, uuid, sizeof uuid)) != NVML_SUCCESS)
        return ret;
    printf("GPU %u: %s (UUID: %s)\n", i, name, uuid);

    unsigned current = 0, pending = 0, max = 0;
    if (nvmlDeviceGetMigMode(dev, &current, &pending) != NVML_SUCCESS ||
        current != NVML_DEVICE_MIG_ENABLE ||
        nvmlDeviceGetMaxMigDeviceCount(dev, &max) != NVML_SUCCESS)
        return NVML_SUCCESS;
    for (unsigned m = 0; m < max; m++) {
        nvmlDevice_t mig;
        /* Unpopulated slots answer NOT_FOUND; they are simply skipped. */
        if (nvmlDeviceGetMigDeviceHandleByIndex(dev, m, &mig) != NVML_SUCCESS)
            continue;
        if (nvmlDeviceGetName(mig, name, sizeof name) != NVML_SUCCESS ||
            nvmlDeviceGetUUID(mig, uuid, sizeof uuid) != NVML_SUCCESS)
            continue;
        printf("  MIG %-11s Device %2u: (UUID: %s)\n", mig_profile(name), m, uuid);
    }
    return NVML_SUCCESS;
}

static int cmd_list(void)
{
    unsigned count = 0;
    int rc = open_devices(&count);
    if (rc || (rc = each_gpu(count, list_gpu, NULL)))
        return rc;
    nvmlShutdown();
    return 0;
}

/* ---- the default table --------------------------------------------------- */

/* One table cell: content formatted, then padded or cut to exactly width. */
static void cell(char *out, int width, const char *fmt, ...)
{
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    size_t len = strlen(buf), w = (size_t)width;
    if (len > w)
        len = w;
    memcpy(out, buf, len);
    memset(out + len, ' ', w - len);
    out[w] = '\0';
}

static void rule(char left, const int *widths, int n, char fill, char sep, char right)
{
    putchar(left);
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < widths[i]; j++)
            putchar(fill);
        putchar(i == n - 1 ? right : sep);
    }
    putchar('\n');
}

static void row(int n, char cells[][128])
{
    putchar('|');
    for (int i = 0; i < n; i++)
        printf("%s|", cells[i]);
    putchar('\n');
}

static const int W_FULL[] = {89};
static const int W_GPU[] = {41, 24, 22};
static const int W_MIG[] = {18, 34, 11, 23};

/* A table's header: rows of n fixed texts (row after row in texts), each cell padded to its width. */
static void header_rows(const int *widths, int n, int rows, const char *const *texts)
{
    char c[4][128];
    for (int r = 0; r < rows; r++) {
        for (int i = 0; i < n; i++)
            cell(c[i], widths[i], "%s", texts[r * n + i]);
        row(n, c);
    }
}

static const char *const GPU_HEADER[] = {
    " GPU  Name                 Persistence-M ", " Bus-Id          Disp.A ", " Volatile Uncorr. ECC ",
    " Fan  Temp   Perf          Pwr:Usage/Cap ", "           Memory-Usage ", " GPU-Util  Compute M. ",
    "", "", "               MIG M. ",
};
static const char *const MIG_HEADER[] = {
    " GPU  GI  CI  MIG ", "                     Memory-Usage ", "        Vol", "        Shared         ",
    "      ID  ID  Dev ", "                       BAR1-Usage ", " SM     Unc", " CE ENC  DEC  OFA  JPG ",
    "", "", "        ECC", "",
};

static void full_line(const char *fmt, ...)
{
    char buf[256], c[1][128];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    cell(c[0], W_FULL[0], " %s", buf);
    row(1, c);
}

static nvmlReturn_t print_gpu(unsigned i, nvmlDevice_t dev, void *unused)
{
    (void)unused;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE] = "N/A";
    char util[16] = "N/A", mig_mode[16] = "N/A";
    nvmlPciInfo_t pci;
    nvmlMemory_t mem = {0, 0, 0};
    nvmlUtilization_t u;
    nvmlEnableState_t persistence = NVML_FEATURE_DISABLED;
    unsigned current = 0, pending = 0;
    char c[3][128];

    nvmlDeviceGetName(dev, name, sizeof name);
    if (nvmlDeviceGetPciInfo_v3(dev, &pci) != NVML_SUCCESS)
        snprintf(pci.busId, sizeof pci.busId, "N/A");
    nvmlDeviceGetMemoryInfo(dev, &mem);
    if (nvmlDeviceGetUtilizationRates(dev, &u) == NVML_SUCCESS)
        snprintf(util, sizeof util, "%u%%", u.gpu);
    nvmlDeviceGetPersistenceMode(dev, &persistence);
    if (nvmlDeviceGetMigMode(dev, &current, &pending) == NVML_SUCCESS)
        snprintf(mig_mode, sizeof mig_mode, "%s", current ? "Enabled" : "Disabled");

    cell(c[0], W_GPU[0], " %3u  %-30.30s %-3s ", i, name,
         persistence == NVML_FEATURE_ENABLED ? "On" : "Off");
    cell(c[1], W_GPU[1], " %18s %3s ", pci.busId, "Off");
    cell(c[2], W_GPU[2], " %20s ", "N/A");
    row(3, c);
    cell(c[0], W_GPU[0], " %-3s %5s %5s %15s / %5s ", "N/A", "N/A", "N/A", "N/A", "N/A");
    cell(c[1], W_GPU[1], " %7lluMiB / %6lluMiB ", mem.used / MIB, mem.total / MIB);
    cell(c[2], W_GPU[2], " %7s %12s ", util, "Default");
    row(3, c);
    cell(c[0], W_GPU[0], "");
    cell(c[1], W_GPU[1], "");
    cell(c[2], W_GPU[2], " %20s ", mig_mode);
    row(3, c);
    rule('+', W_GPU, 3, '-', '+', '+');
    return NVML_SUCCESS;
}

static void print_migs(unsigned count)
{
    int header = 0;
    char c[4][128];
    for (unsigned i = 0; i < count; i++) {
        nvmlDevice_t dev, mig;
        unsigned current = 0, pending = 0, max = 0;
        if (nvmlDeviceGetHandleByIndex_v2(i, &dev) != NVML_SUCCESS ||
            nvmlDeviceGetMigMode(dev, &current, &pending) != NVML_SUCCESS || !current ||
            nvmlDeviceGetMaxMigDeviceCount(dev, &max) != NVML_SUCCESS)
            continue;
        for (unsigned m = 0; m < max; m++) {
            unsigned gi = 0, ci = 0;
            nvmlMemory_t mem = {0, 0, 0};
            if (nvmlDeviceGetMigDeviceHandleByIndex(dev, m, &mig) != NVML_SUCCESS)
                continue;
            nvmlDeviceGetGpuInstanceId(mig, &gi);
            nvmlDeviceGetComputeInstanceId(mig, &ci);
            nvmlDeviceGetMemoryInfo(mig, &mem);
            if (!header) {
                header = 1;
                printf("\n");
                rule('+', W_FULL, 1, '-', '+', '+');
                full_line("MIG devices:");
                rule('+', W_MIG, 4, '-', '+', '+');
                header_rows(W_MIG, 4, 3, MIG_HEADER);
                rule('|', W_MIG, 4, '=', '+', '|');
            }
            cell(c[0], W_MIG[0], " %3u %3u %3u %3u  ", i, gi, ci, m);
            char usage[64];
            snprintf(usage, sizeof usage, "%lluMiB / %lluMiB", mem.used / MIB, mem.total / MIB);
            cell(c[1], W_MIG[1], " %28s     ", usage);
            cell(c[2], W_MIG[2], " %3s %5s ", "N/A", "N/A");
            cell(c[3], W_MIG[3], " %21s ", "N/A");
            row(4, c);
            rule('+', W_MIG, 4, '-', '+', '+');
        }
    }
}

static int cmd_table(void)
{
    unsigned count = 0;
    int rc = open_devices(&count);
    if (rc)
        return rc;

    char drv[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE] = "N/A", cuda[32], stamp[64];
    nvmlSystemGetDriverVersion(drv, sizeof drv);
    cuda_version(cuda, sizeof cuda);
    time_t now = time(NULL);
    strftime(stamp, sizeof stamp, "%a %b %e %H:%M:%S %Y", localtime(&now));
    printf("%s       \n", stamp);

    rule('+', W_FULL, 1, '-', '+', '+');
    char a[64], b[64], d[64];
    snprintf(a, sizeof a, "NVIDIA-SMI %s", drv);
    snprintf(b, sizeof b, "Driver Version: %s", drv);
    snprintf(d, sizeof d, "CUDA Version: %s", cuda);
    full_line("%-33s %-30s %-22s", a, b, d);
    rule('|', W_GPU, 3, '-', '+', '+');
    header_rows(W_GPU, 3, 3, GPU_HEADER);
    rule('|', W_GPU, 3, '=', '+', '|');

    if ((rc = each_gpu(count, print_gpu, NULL)))
        return rc;
    print_migs(count);

    printf("\n");
    rule('+', W_FULL, 1, '-', '+', '+');
    full_line("Processes:");
    full_line(" GPU   GI   CI        PID   Type   Process name                              GPU Memory");
    full_line("       ID   ID                                                               Usage");
    rule('|', W_FULL, 1, '=', '+', '|');
    full_line(" No running processes found");
    rule('+', W_FULL, 1, '-', '+', '+');
    nvmlShutdown();
    return 0;
}

/* ---- --query-gpu ---------------------------------------------------------- */

struct query_opts {
    int header, units;
    char **names; /* the fields asked for, n of them */
    int n;
};

static const char *const FIELDS[] = {
    "index", "count", "name", "gpu_name", "uuid", "gpu_uuid", "pci.bus_id", "gpu_bus_id",
    "driver_version", "memory.total", "memory.used", "memory.free", "utilization.gpu",
    "utilization.memory", "compute_cap", "mig.mode.current", "mig.mode.pending",
    "persistence_mode",
};

static int valid_field(const char *field)
{
    for (size_t k = 0; k < sizeof FIELDS / sizeof FIELDS[0]; k++)
        if (strcmp(field, FIELDS[k]) == 0)
            return 1;
    return 0;
}

/* Writes one field's value, "[N/A]" where NVML has no answer. */
static void query_field(const char *field, unsigned i, nvmlDevice_t dev, const struct query_opts *o,
                       char *out, size_t size)
{
    char buf[NVML_DEVICE_NAME_V2_BUFFER_SIZE + NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    nvmlMemory_t mem;
    nvmlPciInfo_t pci;
    nvmlUtilization_t u;
    unsigned current, pending, count;
    int major, minor;
    const char *mib = o->units ? " MiB" : "";
    snprintf(out, size, "[N/A]");
    if (strcmp(field, "index") == 0)
        snprintf(out, size, "%u", i);
    else if (strcmp(field, "count") == 0) {
        if (nvmlDeviceGetCount_v2(&count) == NVML_SUCCESS)
            snprintf(out, size, "%u", count);
    } else if (strcmp(field, "name") == 0 || strcmp(field, "gpu_name") == 0) {
        if (nvmlDeviceGetName(dev, buf, sizeof buf) == NVML_SUCCESS)
            snprintf(out, size, "%s", buf);
    } else if (strcmp(field, "uuid") == 0 || strcmp(field, "gpu_uuid") == 0) {
        if (nvmlDeviceGetUUID(dev, buf, sizeof buf) == NVML_SUCCESS)
            snprintf(out, size, "%s", buf);
    } else if (strcmp(field, "pci.bus_id") == 0 || strcmp(field, "gpu_bus_id") == 0) {
        if (nvmlDeviceGetPciInfo_v3(dev, &pci) == NVML_SUCCESS)
            snprintf(out, size, "%s", pci.busId);
    } else if (strcmp(field, "driver_version") == 0) {
        if (nvmlSystemGetDriverVersion(buf, sizeof buf) == NVML_SUCCESS)
            snprintf(out, size, "%s", buf);
    } else if (strncmp(field, "memory.", 7) == 0) {
        if (nvmlDeviceGetMemoryInfo(dev, &mem) != NVML_SUCCESS)
            return;
        unsigned long long v = field[7] == 't' ? mem.total : field[7] == 'u' ? mem.used : mem.free;
        snprintf(out, size, "%llu%s", v / MIB, mib);
    } else if (strcmp(field, "utilization.gpu") == 0 || strcmp(field, "utilization.memory") == 0) {
        if (nvmlDeviceGetUtilizationRates(dev, &u) == NVML_SUCCESS)
            snprintf(out, size, "%u%s", field[12] == 'g' ? u.gpu : u.memory, o->units ? " %" : "");
    } else if (strcmp(field, "compute_cap") == 0) {
        if (nvmlDeviceGetCudaComputeCapability(dev, &major, &minor) == NVML_SUCCESS)
            snprintf(out, size, "%d.%d", major, minor);
    } else if (strcmp(field, "mig.mode.current") == 0 || strcmp(field, "mig.mode.pending") == 0) {
        if (nvmlDeviceGetMigMode(dev, &current, &pending) == NVML_SUCCESS)
            snprintf(out, size, "%s",
                     (field[9] == 'c' ? current : pending) ? "Enabled" : "Disabled");
    } else if (strcmp(field, "persistence_mode") == 0) {
        nvmlEnableState_t mode;
        if (nvmlDeviceGetPersistenceMode(dev, &mode) == NVML_SUCCESS)
            snprintf(out, size, "%s", mode == NVML_FEATURE_ENABLED ? "Enabled" : "Disabled");
    }
}

static const char *header_name(const char *field)
{
    if (strncmp(field, "memory.", 7) == 0)
        return " [MiB]";
    if (strncmp(field, "utilization.", 12) == 0)
        return " [%]";
    return "";
}

/* --query-gpu: the GPU's line of fields (arg: the query_opts). */
static nvmlReturn_t query_gpu(unsigned i, nvmlDevice_t dev, void *arg)
{
    const struct query_opts *o = arg;
    char value[256];
    for (int k = 0; k < o->n; k++) {
        query_field(o->names[k], i, dev, o, value, sizeof value);
        printf("%s%s", k ? ", " : "", value);
    }
    printf("\n");
    return NVML_SUCCESS;
}

static int cmd_query(char *fields, const char *format)
{
    char *names[64];
    struct query_opts o = {1, 1, names, 0};
    if (format == NULL || strncmp(format, "csv", 3) != 0)
        return bad_args();
    if (strstr(format, "noheader"))
        o.header = 0;
    if (strstr(format, "nounits"))
        o.units = 0;

    for (char *save = NULL, *f = strtok_r(fields, ",", &save); f && o.n < 64;
         f = strtok_r(NULL, ",", &save)) {
        while (*f == ' ')
            f++;
        names[o.n++] = f;
    }
    if (o.n == 0)
        return bad_args();
    for (int k = 0; k < o.n; k++) {
        if (!valid_field(names[k])) {
            printf("Field \"%s\" is not a valid field to query.\n\n", names[k]);
            return 2;
        }
    }
    unsigned count = 0;
    int rc = open_devices(&count);
    if (rc)
        return rc;
    if (o.header) {
        for (int k = 0; k < o.n; k++)
            printf("%s%s%s", k ? ", " : "", names[k], header_name(names[k]));
        printf("\n");
    }
    if ((rc = each_gpu(count, query_gpu, &o)))
        return rc;
    nvmlShutdown();
    return 0;
}

/* ---- main ---------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f,
            "NVIDIA System Management Interface -- simulated (oci-gpu-hook)\n\n"
            "Usage: nvidia-smi [OPTION]\n\n"
            "    -h,   --help                Print usage information and exit.\n"
            "    -L,   --list-gpus           Display a list of GPUs connected to the system.\n"
            "          --version             Print the versions and exit.\n"
            "          --query-gpu=FIELDS    index, name, uuid, pci.bus_id, driver_version,\n"
            "                                memory.total, memory.used, memory.free,\n"
            "                                utilization.gpu, utilization.memory, compute_cap,\n"
            "                                mig.mode.current, mig.mode.pending,\n"
            "                                persistence_mode, count\n"
            "          --format=csv[,noheader][,nounits]\n\n"
            "With no option, print a summary table of the GPUs.\n");
}

int main(int argc, char **argv)
{
    enum { TABLE, LIST, VERSION, QUERY } mode = TABLE;
    char *fields = NULL;
    const char *format = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        } else if (strcmp(a, "-L") == 0 || strcmp(a, "--list-gpus") == 0) {
            mode = LIST;
        } else if (strcmp(a, "--version") == 0) {
            mode = VERSION;
        } else if (strncmp(a, "--query-gpu=", 12) == 0) {
            mode = QUERY;
            fields = argv[i] + 12;
        } else if (strcmp(a, "--query-gpu") == 0 && i + 1 < argc) {
            mode = QUERY;
            fields = argv[++i];
        } else if (strncmp(a, "--format=", 9) == 0) {
            format = a + 9;
        } else if (strcmp(a, "--format") == 0 && i + 1 < argc) {
            format = argv[++i];
        } else {
            return bad_args();
        }
    }
    if (format && mode != QUERY)
        return bad_args();
    switch (mode) {
    case LIST: return cmd_list();
    case VERSION: return cmd_version();
    case QUERY: return cmd_query(fields, format);
    case TABLE: break;
    }
    return cmd_table();
}
