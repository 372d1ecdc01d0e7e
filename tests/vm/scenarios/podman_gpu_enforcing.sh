# proves: installed as a user installs it (pip, the module loaded with semodule -i on Debian's policy or from the RPM on RHEL's, `oci-gpu-hook install --runtime podman`, no --hooks-dir), podman under SELinux enforcing, systemd and cgroup v2 alone gives a gpu_container_t container exactly its GPU, and a container_t container none; on RHEL's policy podman and conmon run in container_runtime_t and so does runc, which runs the hook (the kernel's transition for its label)
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
expect_gpu_zero /tmp/gpu.out

# container_t (podman's default): the hook gives it the same nodes, SELinux refuses them
gpu_run vmcheck-plain | tee /tmp/plain.out
[ "${PIPESTATUS[0]}" = 0 ] || fail "the container_t container did not run"
expect "domain=system_u:system_r:container_t:s0:c" /tmp/plain.out
for d in /dev/nvidiactl /dev/nvidia0; do
    grep -E -q "^dev $d (EACCES-SELinux-or-DAC|absent)" /tmp/plain.out || fail "container_t got $d"
done
denials | grep -q 'scontext=system_u:system_r:container_t' || fail "no denial logged for container_t's open"
rm -f /tmp/gpu.out /tmp/plain.out

# RHEL's policy: the runtime's domain, in which the hook runs (docs/selinux.md): podman started by
# the administrator and the conmon it leaves enter container_runtime_t; runc (the hook's parent) is
# container_runtime_exec_t, which keeps conmon's domain (the kernel computes the exec's domain)
# the domain the kernel gives a process of context $1 that execs a file labelled $2
exec_domain() {
    python3 -c 'import selinux, sys
made = selinux.security_compute_create(sys.argv[1], sys.argv[2], selinux.string_to_security_class("process"))
print(made[1] if isinstance(made, (list, tuple)) else made)' "$1" "$2"
}
if [ "$FLAVOUR" = rhel ]; then
    podman rm -f vmcheck-domains >/dev/null 2>&1
    run podman run -d --name vmcheck-domains --network none localhost/gpubox /bin/busybox sleep 120 || fail "a detached container did not start"
    conmon=$(ps -o label= -C conmon | head -n 1)
    podman kill vmcheck-domains >/dev/null 2>&1; podman rm -f vmcheck-domains >/dev/null
    echo "conmon: $conmon"
    case "$conmon" in *:container_runtime_t:*) ;; *) fail "conmon runs in ${conmon:-nothing}, not container_runtime_t" ;; esac
    runc_label=$(stat -c %C "$(command -v runc)")
    case "$runc_label" in *:container_runtime_exec_t:*) ;; *) fail "runc is $runc_label, not container_runtime_exec_t" ;; esac
    after_exec=$(exec_domain "$conmon" "$runc_label")
    echo "runc from conmon: $after_exec"
    case "$after_exec" in *:container_runtime_t:*) ;; *) fail "runc (and the hook) would run in $after_exec" ;; esac
    podman_domain=$(exec_domain "$(id -Z)" "$(stat -c %C "$(command -v podman)")")
    case "$podman_domain" in *:container_runtime_t:*) ;; *) fail "podman from $(id -Z) would run in $podman_domain" ;; esac
fi
