/* Stands in for one NVIDIA driver library.  Each copy is linked with that library's real
 * SONAME, so the dynamic loader, ldconfig and the hook's ld.so.cache parser see exactly what
 * they would see for the real file; nothing calls into it. */
const char oci_gpu_hook_simulated_driver_library[] = "simulated NVIDIA driver library";
