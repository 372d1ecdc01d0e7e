# proves: container-selinux's container_use_devices boolean, on RHEL's targeted policy, with what each setting gives: off (the default), a container_t container gets the GPU nodes the hook mounts but SELinux refuses them (not even a stat; logged denials) while gpu_container_t opens them; on, container_t opens them too (every device, which is why the docs point at gpu_container_t instead); the boolean is put back as it was
# timeout: 420
# flavours: rhel
was=$(getsebool container_use_devices | awk '{print $3}')
[ "$was" = off ] || fail "container_use_devices is $was on a fresh node; RHEL's default is off"
restore() { setsebool container_use_devices "$was"; }
trap restore EXIT

gpu_run vmcheck-off-plain | tee /tmp/off-plain.out
[ "${PIPESTATUS[0]}" = 0 ] || fail "the container_t container did not run"
expect "domain=system_u:system_r:container_t:s0:c" /tmp/off-plain.out
# absent: the probe's `[ -e ]` is refused too (getattr), so the node looks missing
for d in /dev/nvidiactl /dev/nvidia0; do
    grep -E -q "^dev $d (EACCES-SELinux-or-DAC|absent)" /tmp/off-plain.out || fail "container_t got $d with container_use_devices off"
done
denials | grep -q 'scontext=system_u:system_r:container_t:.*tcontext=[a-z_]*:object_r:xserver_misc_device_t:' \
    || fail "no denial logged for container_t's use of the GPU nodes"
gpu_run vmcheck-off-gpu --security-opt label=type:gpu_container_t | tee /tmp/off-gpu.out
grep -E -q "^dev /dev/nvidia0 (ENXIO|ENODEV)-allowed" /tmp/off-gpu.out || fail "gpu_container_t may not open /dev/nvidia0"

run setsebool container_use_devices on || fail "setsebool container_use_devices on failed"
gpu_run vmcheck-on-plain | tee /tmp/on-plain.out
[ "${PIPESTATUS[0]}" = 0 ] || fail "the container_t container did not run"
expect "domain=system_u:system_r:container_t:s0:c" /tmp/on-plain.out
for d in /dev/nvidiactl /dev/nvidia0; do
    grep -E -q "^dev $d (ENXIO|ENODEV)-allowed" /tmp/on-plain.out || fail "container_t may not open $d with container_use_devices on"
done
expect "nodes=1" /tmp/on-plain.out
restore
[ "$(getsebool container_use_devices | awk '{print $3}')" = "$was" ] || fail "container_use_devices was not put back"
rm -f /tmp/off-plain.out /tmp/off-gpu.out /tmp/on-plain.out
