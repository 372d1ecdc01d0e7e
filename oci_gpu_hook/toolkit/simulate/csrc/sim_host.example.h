/* Example of the generated header (2 GPUs, GPU 1 in MIG mode, minors swapped). */
#include "sim_types.h"
#define SIM_ROOT "/tmp/simhost"
#define SIM_DRIVER_VERSION "550.54.15"
#define SIM_NVML_VERSION "12.550.54.15"
#define SIM_CUDA_VERSION 12040
#define SIM_CAPS_MAJOR 510
#define SIM_VGPU_GUEST 0
static const struct sim_gi_profile GI_PROFILES[] = {
    {"1g.5gb", 19, 1, 7, 14, 1, 0, 0, 0, 0, 4864, 1},
    {"2g.10gb", 14, 2, 3, 28, 2, 1, 0, 0, 0, 9984, 2},
    {"3g.20gb", 9, 3, 2, 42, 3, 2, 0, 0, 0, 20096, 4},
    {"4g.20gb", 5, 4, 1, 56, 4, 2, 0, 0, 0, 20096, 4},
    {"7g.40gb", 0, 7, 1, 98, 7, 5, 0, 1, 1, 40192, 8},
};
static const struct sim_mig SIM_MIG_1[] = {
    {1, 0, "MIG-0b8f4c2e-6a1d-5f3b-9c7e-2d4a6b8c0e1f", "3g.20gb", 12, 13, 21072183296ULL},
    {5, 0, "MIG-1c9a5d3f-7b2e-5a4c-8d6f-3e5b7c9d1f20", "2g.10gb", 48, 49, 10468982784ULL},
    {13, 0, "MIG-2dab6e40-8c3f-5b5d-9e70-4f6c8dae2031", "1g.5gb", 120, 121, 5100273664ULL},
};
#define SIM_N_GPUS 2
static const struct sim_gpu SIM_GPUS[SIM_N_GPUS] = {
    {"NVIDIA A100-SXM4-40GB", 2, "GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77", "00000000:07:00.0",
     0, 7, 0, 0x20B010DE, 0x134F10DE, 1, 8, 0, 42949672960ULL, 0ULL, 0, 0, 0, 0, 0, 1},
    {"NVIDIA A100-SXM4-40GB", 2, "GPU-2f76cbca-88aa-4e8e-2fde-65765797dbbb", "00000000:0f:00.0",
     0, 15, 0, 0x20B010DE, 0x134F10DE, 0, 8, 0, 42949672960ULL, 0ULL, 0, 0, 1, 3, SIM_MIG_1, 1},
};
/* Both GPUs under one PCIe switch, on NUMA node 0, joined by one NVLink. */
static const struct sim_topology SIM_TOPOLOGY[SIM_N_GPUS] = {
    {0, 0, 1, {1}},
    {0, 0, 1, {0}},
};
