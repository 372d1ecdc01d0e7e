# proves: installed as a user installs it (pip, semodule -i, `oci-gpu-hook install --runtime podman`, no --hooks-dir), podman under SELinux enforcing, systemd and cgroup v2 alone gives a gpu_container_t container exactly its GPU, and a container_t container none
# timeout: 300
[ "$(getenforce)" = Enforcing ] || fail "SELinux is $(getenforce), not Enforcing"
[ "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs ] || fail "/sys/fs/cgroup is not cgroup2 alone"
[ "$(cat /proc/1/comm)" = systemd ] || fail "PID 1 is not systemd"
semodule -l | grep -qw oci_gpu_hook || fail "the oci_gpu_hook module is not loaded"
# podman's default cgroup manager as root under systemd: each container a systemd scope
manager=$(podman info --format '{{.Host.CgroupManager}}')
[ "$manager" = systemd ] || fail "podman's cgroup manager is $manager, not systemd"

# gpu_container_t: GPU 0 only, its nodes pass the device cgroup and SELinux (ENXIO: allowed, no
# driver behind the simulated node), and the driver's libraries are there
gpu_run vmcheck-gpu --security-opt label=type:gpu_container_t | tee /tmp/gpu.out
[ "${PIPESTATUS[0]}" = 0 ] || fail "the gpu_container_t container did not run"
expect "domain=system_u:system_r:gpu_container_t:s0:c" /tmp/gpu.out
for d in /dev/nvidiactl /dev/nvidia0; do
    grep -E -q "^dev $d (ENXIO|ENODEV)-allowed" /tmp/gpu.out || fail "gpu_container_t may not open $d"
done
expect "nodes=1" /tmp/gpu.out  # GPU 0 asked for: /dev/nvidia1 is not there
grep -q '^libs=0$' /tmp/gpu.out && fail "no driver library in the gpu_container_t container"

# container_t (podman's default): the hook gives it the same nodes, SELinux refuses them
gpu_run vmcheck-plain | tee /tmp/plain.out
[ "${PIPESTATUS[0]}" = 0 ] || fail "the container_t container did not run"
expect "domain=system_u:system_r:container_t:s0:c" /tmp/plain.out
for d in /dev/nvidiactl /dev/nvidia0; do
    grep -E -q "^dev $d (EACCES-SELinux-or-DAC|absent)" /tmp/plain.out || fail "container_t got $d"
done
denials | grep -q 'scontext=system_u:system_r:container_t' || fail "no denial logged for container_t's open"
rm -f /tmp/gpu.out /tmp/plain.out
