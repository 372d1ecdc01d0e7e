# proves: a GPU container under podman --cgroup-manager systemd keeps its devices across `systemctl daemon-reload` and a restart of an unrelated unit in its slice, and a new exec still opens them (nvidia-container-toolkit#48): the hook adds the GPU nodes to systemd's own view of the scope (SetUnitProperties DeviceAllow= over /run/systemd/private), which systemd re-applies
# timeout: 360
NAME=vmcheck-reload
ENFORCING=1
start() {
    podman rm -f "$NAME" >/dev/null 2>&1
    run timeout 300 podman --runtime runc --cgroup-manager systemd run -d -t --name "$NAME" --network none \
        --security-opt label=type:gpu_container_t -e NVIDIA_VISIBLE_DEVICES=0 \
        -e NVIDIA_DRIVER_CAPABILITIES=compute,utility localhost/gpubox /bin/busybox sleep 100000
}
if ! start; then
    # as seen on Debian's policy: say so, and prove the reload behaviour permissive
    echo "note: the systemd-driver container did not start under enforcing; retrying permissive"
    denials | tail -n 5
    run setenforce 0; ENFORCING=0
    start || { setenforce 1; fail "podman --cgroup-manager systemd did not start the GPU container"; }
fi
restore() { [ "$ENFORCING" = 1 ] || setenforce 1; }
pid=$(podman inspect -f '{{.State.Pid}}' "$NAME")
cg=/sys/fs/cgroup$(sed -n 's/^0:://p' "/proc/$pid/cgroup")
unit=$(basename "$cg")
echo "cgroup $cg"
case "$unit" in *.scope) ;; *) restore; fail "the container's cgroup is no systemd scope: $cg";; esac
systemctl show "$unit" -p DevicePolicy -p DeviceAllow
# where systemd keeps the scope's settings, for the record (the hook asks systemd, not these files)
ls /run/systemd/transient/"$unit" /run/systemd/transient/"$unit".d /run/systemd/system.control/"$unit".d 2>&1
tail -n 1 /var/log/oci-gpu-hook.log | grep -F -q "systemd not told" && { restore; fail "the hook could not tell systemd: $(tail -n 1 /var/log/oci-gpu-hook.log)"; }
gpu0=$(printf '%d:%d' "0x$(stat -c %t "$SIM/dev/nvidia0")" "0x$(stat -c %T "$SIM/dev/nvidia0")")
systemctl show "$unit" -p DeviceAllow --value | grep -F -q "/dev/char/$gpu0 rw" \
    || { restore; fail "systemd's view of $unit has no DeviceAllow=/dev/char/$gpu0"; }
probe() {  # what a fresh exec in the container opens; fails on anything but allowed
    podman exec -t "$NAME" /bin/sh -c "$GPU_PROBE" | tr -d '\r' | tee /tmp/reload.out
    for d in /dev/nvidiactl /dev/nvidia0; do
        grep -E -q "^dev $d (ENXIO|ENODEV)-allowed" /tmp/reload.out || return 1
    done
}
probe || { restore; fail "the GPU nodes were not usable right after the start"; }
run systemctl daemon-reload
sleep 2
bpftool cgroup show "$cg" 2>&1
probe || { restore; fail "after daemon-reload a new exec cannot open the GPU nodes (EPERM: #48)"; }
# an unrelated unit in the same slice, restarted: systemd re-realizes its siblings' cgroups
run systemd-run --unit vmcheck-unrelated --slice machine.slice -p DevicePolicy=closed /bin/busybox sleep 100000
run systemctl restart vmcheck-unrelated
sleep 2
probe || { systemctl stop vmcheck-unrelated; restore; fail "after restarting a unit of machine.slice the GPU nodes are refused"; }
run systemctl daemon-reload
sleep 2
probe || { systemctl stop vmcheck-unrelated; restore; fail "after a second daemon-reload the GPU nodes are refused"; }
run systemctl stop vmcheck-unrelated
run podman rm -f "$NAME"
restore
rm -f /tmp/reload.out
[ "$ENFORCING" = 1 ] || fail "the reload behaviour held, but only permissive: the systemd-driver start fails under enforcing"
