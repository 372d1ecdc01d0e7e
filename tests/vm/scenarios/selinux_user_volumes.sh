# proves: host directories a user bind-mounts where the hook would create files (/etc/OpenCL for nvidia.icd, /lib/firmware for the GSP firmware) are byte for byte and label for label what they were once the gpu_container_t container is removed: nothing of its start, and none of its categories, outlives it on the host
# timeout: 240
snapshot() {  # names, types, modes, owners, sizes, contents and SELinux labels of a tree
    (cd "$1" && find . -printf '%p %y %m %U %G %s\n' | sort && find . -type f -exec sha256sum {} + | sort \
        && find . -exec stat -c '%n %C' {} + | sort)
}
rm -rf /root/vol-ocl /root/vol-fw
mkdir -p /root/vol-ocl /root/vol-fw/nvidia
echo "the user's own OpenCL data" > /root/vol-ocl/users-file
echo "the user's own firmware" > /root/vol-fw/users-file
restorecon -R /root/vol-ocl /root/vol-fw
snapshot /root/vol-ocl > /tmp/ocl.before; snapshot /root/vol-fw > /tmp/fw.before
podman rm -f vmcheck-volumes >/dev/null 2>&1
run podman run -d -t --name vmcheck-volumes --network none --security-opt label=type:gpu_container_t \
    -v /root/vol-ocl:/etc/OpenCL -v /root/vol-fw:/lib/firmware \
    -e NVIDIA_VISIBLE_DEVICES=0 -e NVIDIA_DRIVER_CAPABILITIES=compute,utility localhost/gpubox /bin/busybox sleep 100000 \
    || fail "the container with volumes did not start"
pid=$(podman inspect -f '{{.State.Pid}}' vmcheck-volumes)
[ -e "/proc/$pid/root/dev/nvidia0" ] || fail "the container has no /dev/nvidia0: the hook did not run"
run podman rm -f vmcheck-volumes
snapshot /root/vol-ocl > /tmp/ocl.after; snapshot /root/vol-fw > /tmp/fw.after
diff /tmp/ocl.before /tmp/ocl.after || fail "the /etc/OpenCL volume changed on the host"
diff /tmp/fw.before /tmp/fw.after || fail "the /lib/firmware volume changed on the host"
tail -n 5 /var/log/oci-gpu-hook.log | grep -F -q "is a volume from the host" \
    || fail "the hook's log does not say what it left undone in the volumes"
rm -rf /root/vol-ocl /root/vol-fw /tmp/ocl.* /tmp/fw.*
