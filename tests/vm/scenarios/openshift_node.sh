# proves: the OpenShift node as far as the VM carries it: the kubelet (cgroupDriver systemd) drives CRI-O (cgroup_manager systemd, SELinux on, hooks wired by `oci-gpu-hook install --runtime crio`), which drives runc under enforcing SELinux; a pod whose seLinuxOptions.type is gpu_container_t runs in gpu_container_t, in a crio-*.scope of the kubepods slices, opens exactly GPU 0, and keeps it across `systemctl daemon-reload` and a restart of an unrelated unit of its slices (its running process and a new exec; nvidia-container-toolkit#48): the hook asked systemd whether it filters the scope's devices and added the GPU nodes to its DeviceAllow=
# timeout: 900
# needs: crio kubelet
install -m 0755 "$P"/bin/crio "$P"/bin/pinns "$P"/bin/crictl "$P"/bin/kubelet /usr/local/bin/
restorecon -F /usr/local/bin/crio /usr/local/bin/pinns /usr/local/bin/crictl /usr/local/bin/kubelet
run podman import -q "$P/pause.tar" localhost/pause:1
restorecon -RF /run/containers /var/lib/containers

run "$HOOK" install --runtime podman --runtime crio || fail "install --runtime crio"
mkdir -p /etc/kubernetes/manifests /var/log/pods
crio_configure
node_units --container-runtime-endpoint=unix:///var/run/crio/crio.sock --cgroup-driver=systemd --fail-swap-on=false --pod-manifest-path=/etc/kubernetes/manifests --file-check-frequency=5s --anonymous-auth=true --authentication-token-webhook=false --authorization-mode=AlwaysAllow --address=127.0.0.1 --healthz-bind-address=127.0.0.1 --make-iptables-util-chains=false '--eviction-hard=memory.available<100Mi,nodefs.available<1%,imagefs.available<1%' --image-gc-high-threshold=100 --image-gc-low-threshold=99 --v=2
run systemctl start crio.service
wait_for 180 test -S /var/run/crio/crio.sock || { journalctl -u crio --no-pager | tail -n 40; fail "CRI-O did not start"; }
crictl() { /usr/local/bin/crictl "$@"; }

# leave the node as it was (also when a check below fails): pods gone, daemons stopped
leave() {
    systemctl stop vmcheck-unrelated.service >/dev/null 2>&1
    rm -f /etc/kubernetes/manifests/gpu.yaml
    wait_for 120 sh -c '[ -z "$(/usr/local/bin/crictl ps -q)" ]' || true
    run systemctl stop kubelet.service
    crictl rmp -fa >/dev/null 2>&1
    run systemctl stop crio.service
    rm -f /tmp/pod.out /tmp/pod.loop /tmp/pod.exec /etc/crictl.yaml
}
die() { leave; fail "$@"; }

run systemctl start kubelet.service
domain_of() { ps -o label= -p "$(prop "$1" MainPID)"; }
if [ "$FLAVOUR" = rhel ]; then
    # (a simple unit's start may return before its exec: wait for the program's own domain)
    wait_for 30 sh -c "ps -o label= -p \$(systemctl show -p MainPID --value crio.service) | grep -q ':container_runtime_t:'" \
        || die "CRI-O does not run in container_runtime_t: $(domain_of crio.service)"
    wait_for 30 sh -c "ps -o label= -p \$(systemctl show -p MainPID --value kubelet.service) | grep -q ':kubelet_t:'" \
        || die "the kubelet does not run in kubelet_t: $(domain_of kubelet.service)"
fi
echo "crio: $(domain_of crio.service); kubelet: $(domain_of kubelet.service)"

# after the probe, the container opens its GPU nodes every 2 s, one line each
LOOP='while true; do /bin/busybox sleep 2; for d in /dev/nvidiactl /dev/nvidia0; do err=$(head -c1 $d 2>&1 >/dev/null); echo "loop $d $(classify "$err")"; done; done'
cat > /etc/kubernetes/manifests/gpu.yaml <<YAML
apiVersion: v1
kind: Pod
metadata:
  name: vmcheck-gpu
  namespace: default
spec:
  hostNetwork: true
  restartPolicy: Never
  containers:
  - name: main
    image: localhost/gpubox:latest
    imagePullPolicy: Never
    tty: true
    command: ["/bin/sh", "-c", $(python3 -c 'import json,sys; print(json.dumps(sys.argv[1] + "\necho PROBE-DONE\n" + sys.argv[2]))' "$GPU_PROBE" "$LOOP")]
    env:
    - {name: NVIDIA_VISIBLE_DEVICES, value: "0"}
    - {name: NVIDIA_DRIVER_CAPABILITIES, value: "compute,utility"}
    securityContext:
      seLinuxOptions: {type: gpu_container_t}
YAML
log() { cat /var/log/pods/default_vmcheck-gpu-*/main/*.log 2>/dev/null; }
if ! wait_for 420 sh -c 'cat /var/log/pods/default_vmcheck-gpu-*/main/*.log 2>/dev/null | grep -q PROBE-DONE'; then
    crictl pods; crictl ps -a
    journalctl -u kubelet --no-pager | grep -v -E 'Failed to get system container|Unable to read config path' | tail -n 40
    journalctl -u crio --no-pager | tail -n 30
    die "the GPU pod did not run its probe"
fi
log | tee /tmp/pod.out
crictl ps -a
grep -F -q "domain=system_u:system_r:gpu_container_t:s0:c" /tmp/pod.out || die "the pod is not in gpu_container_t"
for d in /dev/nvidiactl /dev/nvidia0; do
    grep -E -q "dev $d (ENXIO|ENODEV)-allowed" /tmp/pod.out || die "the gpu_container_t pod may not open $d"
done
grep -F -q "nodes=1" /tmp/pod.out || die "the pod has other GPU nodes than GPU 0's"
cid=$(crictl ps --name main -q | head -n 1)
echo "container $cid"

# the hook told systemd: the scope's own DeviceAllow= lists the GPU nodes (rw: the hook's entries;
# runc's are rwm), so that a reload re-applies them
pid=$(crictl inspect "$cid" | python3 -c 'import json,sys; print(json.load(sys.stdin)["info"]["pid"])')
scope=$(basename "$(sed -n 's/^0:://p' "/proc/$pid/cgroup")")
echo "scope $scope"
case "$scope" in crio-*.scope) ;; *) die "the container's cgroup is not CRI-O's systemd scope: $scope" ;; esac
systemctl show "$scope" -p DevicePolicy -p DeviceAllow
grep -F "\"container\":\"$cid\"" /var/log/oci-gpu-hook.log | grep -F -q "systemd not told" \
    && die "the hook could not tell systemd: $(grep -F "\"container\":\"$cid\"" /var/log/oci-gpu-hook.log | tail -n 1)"
gpu0=$(printf '%d:%d' "0x$(stat -c %t "$SIM/dev/nvidia0")" "0x$(stat -c %T "$SIM/dev/nvidia0")")
systemctl show "$scope" -p DeviceAllow --value | grep -F -q "/dev/char/$gpu0 rw" \
    || die "systemd's view of $scope has no DeviceAllow=/dev/char/$gpu0"

# nvidia-container-toolkit#48 under the kubelet and CRI-O: after daemon-reload (and after a
# restart of an unrelated unit in the kubepods slices) the running container still opens its GPU
# (its own loop), and so does a new exec into it
still_gpu() {  # $1: what happened; the loop's last lines, then a fresh exec
    sleep 8
    log | grep '^.* loop ' | tail -n 2 | tee /tmp/pod.loop
    for d in /dev/nvidiactl /dev/nvidia0; do
        grep -q "loop $d \(ENXIO\|ENODEV\)-allowed" /tmp/pod.loop || die "the running pod lost $d after $1"
    done
    # the exec's output goes to a file in the container, read here through its pid's root: a
    # gpu_container_t process may not write to CRI-O's pipes (unconfined_t on Debian), and crictl
    # gives an exec a tty only with -i
    rm -f "/proc/$pid/root/vmcheck-exec.out"
    crictl exec "$cid" /bin/sh -c "{ $GPU_PROBE
} >/vmcheck-exec.out 2>&1" || die "crictl exec failed after $1"
    tr -d '\r' < "/proc/$pid/root/vmcheck-exec.out" | tee /tmp/pod.exec
    for d in /dev/nvidiactl /dev/nvidia0; do
        grep -E -q "^dev $d (ENXIO|ENODEV)-allowed" /tmp/pod.exec || die "a new exec may not open $d after $1"
    done
}
run systemctl daemon-reload
still_gpu "daemon-reload"
run systemd-run --unit vmcheck-unrelated --slice kubepods-besteffort.slice -p DevicePolicy=closed /bin/busybox sleep 100000
run systemctl restart vmcheck-unrelated.service
still_gpu "a restart of a unit of kubepods-besteffort.slice"
run systemctl stop vmcheck-unrelated.service
run systemctl daemon-reload
still_gpu "a second daemon-reload"

# the container's cgroup: a systemd scope under the kubelet's kubepods slices
cg=$(crictl inspect "$cid" | python3 -c 'import json,sys; print(json.load(sys.stdin)["info"]["runtimeSpec"]["linux"]["cgroupsPath"])')
case "$cg" in kubepods*.slice:crio:*) ;; *) die "the container's cgroupsPath $cg is not the systemd driver's" ;; esac
denials | grep -E 'gpu_container_t|container_engine_t' && echo "(denials above: the other scenarios judge them)"

leave
