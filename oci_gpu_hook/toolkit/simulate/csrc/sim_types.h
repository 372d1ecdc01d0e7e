/* Types shared by the simulated driver's C programs.  The data itself is
 * generated per simulated host by oci_gpu_hook.toolkit.simulate into sim_host.h, so
 * the library carries its host with it: inside a container, where the host
 * directory is not visible, it still knows the GPUs and filters them by the
 * device nodes it can see, as the real NVML does. */
#ifndef SIM_TYPES_H
#define SIM_TYPES_H

struct sim_mig {
    unsigned gi_id;            /* GPU instance id */
    unsigned ci_id;            /* compute instance id */
    const char *uuid;          /* "MIG-xxxxxxxx-..." */
    const char *profile;       /* "1g.5gb" */
    unsigned gi_cap_minor;     /* minor of /dev/nvidia-caps/nvidia-cap<N> for the GI access file */
    unsigned ci_cap_minor;     /* same for the CI access file */
    unsigned long long memory_total; /* bytes */
};

/* A GPU instance profile: model.MigProfile. */
struct sim_gi_profile {
    const char *name;
    unsigned id;                  /* the profile id nvidia-smi shows */
    unsigned slices, instances, sms, copy_engines, decoders, encoders, jpegs, ofas;
    unsigned long long memory_mb;
    unsigned placement_size;      /* in memory slices (eight on an A100) */
};

struct sim_gpu {
    const char *name;          /* "NVIDIA A100-SXM4-40GB" */
    int brand;                 /* nvmlBrandType_t value */
    const char *uuid;          /* "GPU-xxxxxxxx-..." */
    const char *bus_id;        /* NVML form: "00000000:07:00.0" */
    unsigned domain, bus, device;
    unsigned pci_device_id;    /* (device id << 16) | vendor id, e.g. 0x20B010DE */
    unsigned pci_subsystem_id;
    unsigned minor;            /* /dev/nvidia<minor>; NOT the NVML index */
    int cc_major, cc_minor;
    unsigned long long memory_total, memory_used; /* bytes */
    unsigned util_gpu, util_memory;                /* percent */
    int mig_enabled;
    unsigned n_mig;
    const struct sim_mig *mig;
    int has_hbm;               /* model.GpuModel.hbm: memory with its own temperature sensor */
};

/* Where a GPU sits (sim_host.h's SIM_TOPOLOGY, in SIM_GPUS order): its PCIe switch, its NUMA
 * node, and the GPUs (SIM_GPUS indices) its NVLinks lead to, one link each. */
#define SIM_MAX_NVLINKS 12
struct sim_topology {
    unsigned pcie_switch;
    unsigned numa_node;
    unsigned n_nvlinks;
    unsigned nvlink_peer[SIM_MAX_NVLINKS];
};

/* sim_host.h defines:
 *   SIM_ROOT            "/abs/path/of/simulated/host"
 *   SIM_DRIVER_VERSION  "550.54.15"
 *   SIM_NVML_VERSION    "12.550.54.15"
 *   SIM_CUDA_VERSION    12040
 *   SIM_CAPS_MAJOR      major of "nvidia-caps" in the simulated /proc/devices
 *   SIM_VGPU_GUEST      1 in a vGPU guest (simulate's vgpu_host_driver), else 0
 *   SIM_N_GPUS          number of entries in SIM_GPUS
 *   static const struct sim_gpu SIM_GPUS[]   in NVML index (PCI bus) order
 *   static const struct sim_gi_profile GI_PROFILES[]   the MIG GPU instance profiles
 *   static const struct sim_topology SIM_TOPOLOGY[]   the same order
 */
#endif
