# proves: the cluster rolls the hook out by itself onto a node as OpenShift's (RHEL's policy, enforcing; CRI-O and the kubelet under systemd; a control plane of the shared Kubernetes build on the node), with no RPM and no `install` typed: `kubectl apply` of deploy/kubernetes/ (tests/kubecheck.py's node_manifests: the simulated GPU host's paths, the API server by its address) and NFD's label alone install the hook from the node image, load its module at priority 300, pass gate toolkit and then gate plugin (the Node's events, in that order; GPUHookReady True), advertise the 2 GPUs, and then (gate d) the labels pod writes NFD's feature file (its init container in spc_t labels its own directory in NFD's kubernetes_file_t features.d for the labels container's container_t, and the node pod's init container labels the inventory cache, var_t where the kubelet makes it, container_ro_file_t) and the exporter is ready; a pod asking for nvidia.com/gpu: 1 runs in gpu_container_t and opens exactly one GPU, with no denial; deleting the DaemonSets uninstalls: the module is gone and the node's files are as before
# timeout: 2700
# flavours: rhel
# needs: kube crio image
C=$P/cluster
NODE=vmcheck
NFD_LABEL=feature.node.kubernetes.io/pci-10de.present
[ "$(hostname)" = "$NODE" ] || fail "the VM's host name is $(hostname), not $NODE (its kubelet's certificate names $NODE)"
[ "$(getenforce)" = Enforcing ] || fail "SELinux is $(getenforce), not Enforcing"
install -m 0755 "$P"/bin/kube/* "$P"/bin/crio "$P"/bin/pinns "$P"/bin/crictl /usr/local/bin/
restorecon -F /usr/local/bin/*
run podman import -q "$P/pause.tar" localhost/pause:1
run podman load -q -i "$P/node-image.tar" || fail "podman load of the node image"
restorecon -RF /run/containers /var/lib/containers
k() { /usr/local/bin/kubectl --kubeconfig "$C/pki/admin.kubeconfig" "$@"; }
node_field() { k get node "$NODE" -o jsonpath="$1" 2>/dev/null; }
pods_field() { k get pods -n oci-gpu-hook -l "app.kubernetes.io/name=$1" -o jsonpath="$2" 2>/dev/null; }
is() { local out; out=$("${@:2}") && [ "$out" = "$1" ]; }  # is VALUE CMD...: CMD succeeds, printing VALUE
has() { "${@:2}" | grep -q -- "$1"; }  # has TEXT CMD...: CMD prints TEXT

# Nothing of ours on the node: the set-up's hook and module go first; the node's own hook
# configuration stays (the simulated driver's paths), with the two keys `install
# --accept-volume-mounts` writes on a node that has none.
setup_hook_away
cp /etc/oci-gpu-hook/config.yaml /root/config.yaml.setup
printf 'accept_volume_mounts: true\naccept_envvar_when_unprivileged: false\n' >> /etc/oci-gpu-hook/config.yaml
crio_configure
# NFD's features.d, as its worker makes it on a node: labelled as the policy says, under RHEL's
# kubernetes_file_t (all of /etc/kubernetes), which the labels pod's container_t may not write.
features=/etc/kubernetes/node-feature-discovery/features.d
[ -e "$features" ] && fail "$features is there already"
mkdir -p "$features" && restorecon -R /etc/kubernetes
ls -dZ "$features"
# The runtimes' configuration, to compare after: what install edits must come back byte for byte.
runtime_config() { find /etc/crio /etc/containers -type f -exec sha256sum {} + | sort -k 2; }
# Without the directories CRI-O makes for itself as it serves pods (its per-namespace registry
# auth and signature policies, empty here): one run had them after its labels pod, one not.
node_files() { our_files | grep -v -x -E '/etc/crio/(auth|policies)'; }
node_files > /tmp/files-before
runtime_config > /tmp/config-before

# The kubelet needs an address that is not loopback for its Node; the VM has no network.
run ip link add vmcheck0 type dummy && run ip addr add 10.77.0.1/24 dev vmcheck0 && run ip link set vmcheck0 up \
    || fail "a dummy interface for the node's address"

leave() {
    k delete -f "$C/manifests.yaml" --ignore-not-found --wait=true --timeout=300s >/dev/null 2>&1
    k delete pod vmcheck-gpu --ignore-not-found --wait=true --timeout=60s >/dev/null 2>&1
    run systemctl stop kubelet.service
    /usr/local/bin/crictl rmp -fa >/dev/null 2>&1
    run systemctl stop crio.service
    for unit in kube-scheduler kube-controller-manager kube-apiserver etcd; do
        systemctl stop "vmcheck-$unit.service" >/dev/null 2>&1
    done
    ip link del vmcheck0 2>/dev/null
    rm -rf /var/lib/vmcheck-kube /etc/systemd/system/kubelet.service /etc/systemd/system/crio.service
    systemctl daemon-reload
    cp /root/config.yaml.setup /etc/oci-gpu-hook/config.yaml
    rm -rf /etc/kubernetes/node-feature-discovery /var/cache/oci-gpu-hook-node
    rm -f /tmp/files-before /tmp/files-after /tmp/config-before /tmp/config-after /tmp/gpu.out /tmp/gpu-pod.yaml /tmp/events.json
}
die() {
    echo "--- nodes, pods, events"; k get nodes -o wide; k get pods -A -o wide; k get events -A | tail -n 30
    for pod in /var/log/pods/oci-gpu-hook_*; do echo "--- $pod"; tail -n 15 "$pod"/*/*.log 2>/dev/null; done
    journalctl -u kubelet --no-pager | grep -E ' E[0-9]{4} ' | tail -n 15
    leave; fail "$@"
}

# The control plane, as tests/kubecheck.py starts it, in units of its own: the controller-manager
# and the scheduler once the API server is ready (it exits when RBAC's roles are not there yet).
mkdir -p /var/lib/vmcheck-kube
while IFS=$'\t' read -r name command; do
    eval "set -- $command"
    run systemd-run --quiet --unit "vmcheck-$name" --collect -p Restart=on-failure -p RestartSec=5 "$@" \
        || die "starting $name"
    if [ "$name" = kube-apiserver ]; then
        wait_for 600 k get --raw /readyz || die "the API server was not ready within 600 s"
    fi
done < "$C/control-plane"
wait_for 300 k get serviceaccount default || die "no default ServiceAccount (the controller-manager's)"

node_units --config="$C/kubelet.json" --kubeconfig="$C/pki/kubelet.kubeconfig" --hostname-override="$NODE" \
    --node-ip=10.77.0.1 --v=2
run systemctl start crio.service
wait_for 180 test -S /var/run/crio/crio.sock || die "CRI-O did not start"
run systemctl start kubelet.service
wait_for 600 is True node_field '{.status.conditions[?(@.type=="Ready")].status}' \
    || die "the Node was not Ready within 600 s"
echo "crio: $(ps -o label= -p "$(prop crio.service MainPID)"); kubelet: $(ps -o label= -p "$(prop kubelet.service MainPID)")"

# What an operator types: NFD's label (its worker would set it), then the manifests.
run k label node "$NODE" "$NFD_LABEL=true" || die "labelling the node"
t=$(date +%s)
run k apply --validate=false -f "$C/manifests.yaml" || die "kubectl apply"
wait_for 1800 is True node_field '{.status.conditions[?(@.type=="GPUHookReady")].status}' \
    || die "GPUHookReady was not True within 1800 s: $(node_field '{.status.conditions[?(@.type=="GPUHookReady")].message}')"
echo "GPUHookReady True $(( $(date +%s) - t )) s after kubectl apply: $(node_field '{.status.conditions[?(@.type=="GPUHookReady")].message}')"
wait_for 120 is 2 node_field '{.status.allocatable.nvidia\.com/gpu}' \
    || die "the node does not advertise 2 GPUs: '$(node_field '{.status.allocatable.nvidia\.com/gpu}')'"
# Gate (d): the labels pod runs and writes NFD's feature file (its init container, spc_t, labelled
# its own directory container_file_t:s0; the node pod's, the inventory cache it reads
# container_ro_file_t:s0), and the exporter is ready (its probe asks /ready).
wait_for 300 has Running pods_field oci-gpu-hook-labels '{.items[*].status.phase}' \
    || die "the labels pod is not running"
wait_for 300 grep -q '^nvidia.com/gpu.count=2$' "$features/oci-gpu-hook" || die "no GPU count in NFD's features.d"
ls -laZ "$features" "$features/.oci-gpu-hook" /var/cache/oci-gpu-hook-node
for f in /var/cache/oci-gpu-hook-node /var/cache/oci-gpu-hook-node/inventory.json; do
    [ "$(stat -c %C "$f")" = system_u:object_r:container_ro_file_t:s0 ] || die "$f is $(stat -c %C "$f")"
done
wait_for 300 has true pods_field oci-gpu-hook-node '{.items[*].status.containerStatuses[?(@.name=="exporter")].ready}' \
    || die "the exporter is not ready"
echo "the labels pod runs and the exporter is ready $(( $(date +%s) - t )) s after kubectl apply"
semodule --list-modules=full | grep -a -E '^300 +oci_gpu_hook ' || die "the toolkit did not load the module at priority 300"
[ "$(semodule --list-modules=full | grep -a -c -E ' oci_gpu_hook ')" = 1 ] || die "another module of ours is loaded"
# The gates in order, from the API's events and their times.
k get events.v1.events.k8s.io -n default -o json > /tmp/events.json
/opt/oci-gpu-hook/bin/python - /tmp/events.json <<'PY' || die "the gates' events are not toolkit, then plugin"
import json, sys
items = json.load(open(sys.argv[1]))["items"]
ours = sorted((e["eventTime"], e["reason"]) for e in items if e.get("reportingController") == "oci-gpu-hook.io/toolkit")
for at, reason in ours:
    print(at, reason)
passed = [reason for _, reason in ours if reason.endswith("Passed")]
# A round that failed before the first pass is the rollout's own retry (under TCG an install once
# ran past its bound); after it, none may fail.
after = [reason for _, reason in ours[[r for _, r in ours].index("GateToolkitPassed"):]] if passed else []
sys.exit(0 if passed[:2] == ["GateToolkitPassed", "GatePluginPassed"] and not [r for r in after if r.endswith("Failed")] else 1)
PY
no_denials_but_no_driver "the rollout"

# A GPU pod as a user writes one, in gpu_container_t: exactly one GPU.
cat > /tmp/gpu-pod.yaml <<YAML
apiVersion: v1
kind: Pod
metadata: {name: vmcheck-gpu, namespace: default}
spec:
  hostNetwork: true
  restartPolicy: Never
  automountServiceAccountToken: false
  terminationGracePeriodSeconds: 1
  containers:
  - name: main
    image: localhost/gpubox:latest
    imagePullPolicy: Never
    tty: true
    command: ["/bin/sh", "-c", $(python3 -c 'import json,sys; print(json.dumps(sys.argv[1] + "\nfor d in /dev/nvidia[0-9]*; do err=$(head -c1 $d 2>&1 >/dev/null); echo \"gpu $d $(classify \"$err\")\"; done"))' "$GPU_PROBE")]
    resources: {limits: {nvidia.com/gpu: "1"}}
    securityContext:
      seLinuxOptions: {type: gpu_container_t}
YAML
run k apply --validate=false -f /tmp/gpu-pod.yaml || die "the GPU pod"
wait_for 300 is Succeeded k get pod vmcheck-gpu -o jsonpath='{.status.phase}' \
    || die "the GPU pod did not succeed: $(k get pod vmcheck-gpu -o jsonpath='{.status}')"
cat /var/log/pods/default_vmcheck-gpu_*/main/*.log | tr -d '\r' | tee /tmp/gpu.out
expect "domain=system_u:system_r:gpu_container_t:s0:c" /tmp/gpu.out
grep -E -q "dev /dev/nvidiactl (ENXIO|ENODEV)-allowed" /tmp/gpu.out || die "the pod may not open /dev/nvidiactl"
[ "$(grep -c -E ' gpu /dev/nvidia[0-9]+ (ENXIO|ENODEV)-allowed' /tmp/gpu.out)" = 1 ] || die "the pod does not open exactly one GPU"
expect "nodes=1" /tmp/gpu.out
run k delete pod vmcheck-gpu --wait=true
no_denials_but_no_driver "the GPU pod"

# Deleting the DaemonSets uninstalls: the toolkit's pod takes the hook and the module back.
run k delete daemonset -n oci-gpu-hook oci-gpu-hook-toolkit --wait=true --timeout=900s || die "deleting the toolkit DaemonSet"
wait_for 900 is "" pods_field oci-gpu-hook-toolkit '{.items[*].metadata.name}' \
    || die "the toolkit's pod did not end"
semodule --list-modules=full | grep -a -E ' oci_gpu_hook ' && die "the module is still loaded after the toolkit DaemonSet went"
run k delete -f "$C/manifests.yaml" --ignore-not-found --wait=true --timeout=300s
node_files > /tmp/files-after
diff /tmp/files-before /tmp/files-after || die "the node's files are not as before (above)"
runtime_config > /tmp/config-after
diff /tmp/config-before /tmp/config-after || die "the runtimes' configuration is not byte for byte as before (above)"
no_denials_but_no_driver "the removal"

leave
setup_hook_back
