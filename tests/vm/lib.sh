# Sourced by tests/vm/setup.sh and every scenario before it runs (inside the node VM, as root in
# unconfined_t, SELinux enforcing). What a scenario may use:
#   $P      the payload: $P/src (the checkout), $P/wheels, $P/*.tar, $P/scenarios
#   $SIM    the simulated GPU host standing in for the driver (config.yaml points the hook at it)
#   $HOOK   the installed oci-gpu-hook command (the venv's, as a user installs it)
#   $FC     the policy's file_contexts
#   $FLAVOUR  the image's policy: debian (refpolicy `default`) or rhel (Fedora's `targeted` with
#           container-selinux); tests/vm/build-base.sh says what each is
#   run CMD...           print the command, run it, print its exit status and time; returns it
#   fail MESSAGE         print "FAIL: MESSAGE" and end the scenario with exit status 1
#   expect TEXT FILE|-   fail unless the file (or stdin) holds a line containing TEXT
#   denials              print the AVC/SELINUX_ERR records logged since the scenario started
#   no_denials [WHAT]    fail if there is any (WHAT: what the scenario did, for the message)
#   no_denials_but_no_driver [WHAT]  the same, the simulation's own records left out: opening a
#                        simulated GPU node makes the kernel ask for the module char-major-195-N
#                        (no driver is behind it), which container domains may not (module_request);
#                        with a real driver loaded the kernel asks nothing
#   wait_for SECONDS CMD...  until CMD succeeds (tried each second); returns 1 if it never did
#   prop UNIT PROPERTY   the value of a systemd unit's property (systemctl show)
#   new_main_pid UNIT PID  succeeds once UNIT runs a main process other than PID (a restart)
#   doctor_says ID       doctor's check ID as "STATUS summary" (from `doctor --json`)
#   expect_gpu_zero FILE  fail unless gpu_run's output in FILE is a gpu_container_t container
#                        that opened GPU 0's nodes through the device cgroup and SELinux (ENXIO or
#                        ENODEV: no driver behind the simulated node), has no other GPU's node, and
#                        sees the driver's libraries
#   gpu_run NAME [PODMAN RUN OPTIONS...]
#                        `podman run -t` of the busybox image with GPU 0 requested, whose shell
#                        prints "domain=...", "dev <node> <OUTCOME>" for /dev/nvidiactl and
#                        /dev/nvidia0 (OUTCOME: absent, ENXIO-allowed-no-driver, ENODEV-...,
#                        EACCES-SELinux-or-DAC, EPERM-device-cgroup-refused, opened, other), and
#                        "nodes=N" (/dev/nvidiaN nodes), "libs=N" (driver libraries it sees); exits with podman's status
#   quietly CMD...       CMD with its input and output on /dev/null: semodule execs load_policy,
#                        whose domain may not use the scenario's pipes (a denial for each it inherits)
#   our_files            the paths under the directories install writes to, sorted (before and after)
#   setup_hook_away      uninstall the set-up's hook (its units stopped) and remove its module
#   setup_hook_back      the set-up's module and hook back, its refresh units started, as setup.sh left them
#   crio_configure       CRI-O's settings as an OpenShift node has them (the systemd cgroup manager,
#                        SELinux on, runc; the loopback CNI network, so that it says the network is
#                        ready), its policy.json and crictl's endpoint
#   node_units KUBELET_FLAGS...  crio.service and kubelet.service (the kubelet with those flags),
#                        each in the domain the flavour's policy gives it (see the function)
# shellcheck shell=bash
P=/opt/vmcheck
SIM=/srv/gpuhost
HOOK=/usr/local/bin/oci-gpu-hook
POLICY_NAME=$(sed -n 's/^SELINUXTYPE=//p' /etc/selinux/config)
FC=/etc/selinux/$POLICY_NAME/contexts/files/file_contexts
case $POLICY_NAME in targeted) FLAVOUR=rhel ;; *) FLAVOUR=debian ;; esac
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C HOME=/root

run() {
    printf '$ %s\n' "$*"
    local t rc
    t=$(date +%s.%N); "$@"; rc=$?
    printf '[rc=%s, %s s]\n' "$rc" "$(awk -v a="$t" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')"
    return $rc
}
fail() { echo "FAIL: $*"; exit 1; }
expect() {
    local text=$1 file=${2:--}
    if [ "$file" = - ]; then grep -F -q -- "$text" || fail "expected a line with '$text'"
    else grep -F -q -- "$text" "$file" || fail "expected a line with '$text' in $file"; fi
}

denials() {
    sleep 1  # auditd writes asynchronously
    tail -n +"$((${VMCHECK_AUDIT_MARK:-0} + 1))" /var/log/audit/audit.log | grep -E 'type=(AVC|USER_AVC|SELINUX_ERR)'
}
no_denials() {
    local found
    found=$(denials)
    [ -z "$found" ] || { echo "$found"; fail "SELinux denials during ${1:-the scenario}"; }
}
no_denials_but_no_driver() {
    local found
    found=$(denials | grep -v -E 'denied +\{ module_request \} .* kmod="char-major-')
    [ -z "$found" ] || { echo "$found"; fail "SELinux denials during ${1:-the scenario}"; }
    if denials | grep -q .; then echo "(only the no-driver module_request records were logged)"; fi
}

wait_for() {
    local limit=$1; shift
    local end=$(( $(date +%s) + limit ))
    until "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -lt "$end" ] || return 1
        sleep 1
    done
}
prop() { systemctl show -p "$2" --value "$1"; }
new_main_pid() { local now; now=$(prop "$1" MainPID); [ "$now" != 0 ] && [ "$now" != "$2" ]; }
doctor_says() {
    "$HOOK" doctor --json | python3 -c 'import json,sys; c={c["id"]: c for c in json.load(sys.stdin)["checks"]}[sys.argv[1]]; print(c["status"], c["summary"])' "$1"
}

# what a device open says: EPERM = the device cgroup refused; EACCES = SELinux (or mode bits);
# ENXIO/ENODEV = allowed through both, and no driver behind the simulated node
GPU_PROBE='classify() { case "$1" in
  *"not permitted"*) echo EPERM-device-cgroup-refused ;;
  *"ermission denied"*) echo EACCES-SELinux-or-DAC ;;
  *"No such device or address"*) echo ENXIO-allowed-no-driver ;;
  *"No such device"*) echo ENODEV-allowed-no-driver ;;
  "") echo opened ;;
  *) echo other ;; esac; }
echo "domain=$(cat /proc/self/attr/current)"
for d in /dev/nvidiactl /dev/nvidia0; do
  if [ -e $d ]; then err=$(head -c1 $d 2>&1 >/dev/null); echo "dev $d $(classify "$err") (${err:-no error})"
  else echo "dev $d absent"; fi
done
echo "nodes=$(ls /dev | grep -c "^nvidia[0-9]")"
echo "libs=$(ls /usr/lib64/libcuda.so* /usr/lib/x86_64-linux-gnu/libcuda.so* /usr/lib64/libnvidia-ml.so* /usr/lib/x86_64-linux-gnu/libnvidia-ml.so* 2>/dev/null | wc -l)"'

gpu_run() {
    local name=$1; shift
    podman rm -f "$name" >/dev/null 2>&1
    printf '$ podman run -t --rm --name %s --network none %s -e NVIDIA_VISIBLE_DEVICES=0 localhost/gpubox sh -c PROBE\n' "$name" "$*"
    # -t: container_t may not write the pipes conmon (bin_t, in our unconfined_t) makes; a pty is
    # the container's own (shared/tools/node-vm/README.md). tr: the pty's CRLF.
    timeout 300 podman run -t --rm --name "$name" --network none "$@" -e NVIDIA_VISIBLE_DEVICES=0 \
        -e NVIDIA_DRIVER_CAPABILITIES=compute,utility localhost/gpubox /bin/sh -c "$GPU_PROBE" | tr -d '\r'
    local rc=${PIPESTATUS[0]}
    printf '[podman rc=%s]\n' "$rc"
    return "$rc"
}

expect_gpu_zero() {
    local file=$1 d
    expect "domain=system_u:system_r:gpu_container_t:s0:c" "$file"
    for d in /dev/nvidiactl /dev/nvidia0; do
        grep -E -q "^dev $d (ENXIO|ENODEV)-allowed" "$file" || fail "gpu_container_t may not open $d"
    done
    expect "nodes=1" "$file"  # GPU 0 asked for: /dev/nvidia1 is not there
    grep -q '^libs=0$' "$file" && fail "no driver library in the gpu_container_t container"
    return 0
}

quietly() { "$@" </dev/null >/dev/null 2>&1; }
our_files() {
    find /usr/local /etc/containers /etc/crio /etc/systemd/system /etc/oci-gpu-hook /var/lib/oci-gpu-hook -xdev \
        2>/dev/null | sort
}

setup_hook_away() {
    run "$HOOK" uninstall --stop-units || fail "uninstall of the set-up's hook"
    if [ "$FLAVOUR" = rhel ]; then run quietly semodule -X 200 -r oci_gpu_hook || fail "removing the RPM's module"
    else run quietly semodule -X 400 -r oci_gpu_hook || fail "removing the set-up's module"; fi
    semodule --list-modules=full | grep -a -E ' oci_gpu_hook ' && fail "a module of ours is still loaded"
    return 0
}
setup_hook_back() {
    if [ "$FLAVOUR" = rhel ]; then
        run quietly semodule -X 200 -i /usr/share/selinux/packages/targeted/oci_gpu_hook.pp.bz2 || fail "restoring the RPM's module"
    else
        run quietly semodule -i /root/selinux/oci_gpu_hook.pp || fail "restoring the set-up's module"
    fi
    run "$HOOK" install --runtime podman || fail "restoring the set-up's install"
    run systemctl daemon-reload
    run systemctl enable --now oci-gpu-hook-refresh.path oci-gpu-hook-refresh.service
}

crio_configure() {
    mkdir -p /etc/crio/crio.conf.d /etc/cni/net.d
    cat > /etc/crio/crio.conf.d/10-vmcheck.conf <<'CONF'
# the node's own settings (as an OpenShift node's): the systemd cgroup manager, SELinux, runc
[crio.runtime]
cgroup_manager = "systemd"
conmon_cgroup = "pod"
conmon = "/usr/bin/conmon"
default_runtime = "runc"
selinux = true
pinns_path = "/usr/local/bin/pinns"
# CRI-O runs host-network pods unconfined (spc_t) by default; the pods here are host-network only
# because the VM has no pod network, and their labels are what is under test
hostnetwork_disable_selinux = false
[crio.runtime.runtimes.runc]
runtime_path = "/usr/sbin/runc"
runtime_root = "/run/runc"
[crio.image]
pause_image = "localhost/pause:1"
pause_command = "/pause"
signature_policy = "/etc/crio/policy.json"
[crio.metrics]
enable_metrics = false
# a network no pod uses (all are host-network): without one CRI-O says the network is not ready,
# and the Node never is
[crio.network]
network_dir = "/etc/cni/net.d"
plugin_dirs = ["/usr/lib/cni"]
CONF
    echo '{"cniVersion": "0.4.0", "name": "vmcheck-unused", "plugins": [{"type": "loopback"}]}' \
        > /etc/cni/net.d/10-vmcheck-unused.conflist
    echo '{"default": [{"type": "insecureAcceptAnything"}]}' > /etc/crio/policy.json
    printf 'runtime-endpoint: unix:///var/run/crio/crio.sock\nimage-endpoint: unix:///var/run/crio/crio.sock\n' > /etc/crictl.yaml
}

node_units() {
    # Debian's policy: a service's runc is container_engine_t and may not start containers
    # (shared/tools/node-vm/README.md); the daemons run where an administrator's shell does. An
    # /etc/init.d path is initrc_exec_t: systemd starts it in initrc_t, which may change to that.
    # RHEL's policy: systemd starts each program in its own domain, as on an OpenShift node
    # (container-selinux labels them): CRI-O in container_runtime_t, the kubelet in kubelet_t.
    local launch_crio="" launch_kubelet="" d
    if [ "$FLAVOUR" = debian ]; then
        for d in crio kubelet; do
            printf '#!/bin/sh\nexec runcon unconfined_u:unconfined_r:unconfined_t:s0-s0:c0.c1023 "$@"\n' > /etc/init.d/vmcheck-$d
            chmod 0755 /etc/init.d/vmcheck-$d
        done
        restorecon -F /etc/init.d/vmcheck-crio /etc/init.d/vmcheck-kubelet
        launch_crio="/etc/init.d/vmcheck-crio " launch_kubelet="/etc/init.d/vmcheck-kubelet "
    fi
    cat > /etc/systemd/system/crio.service <<UNIT
[Unit]
Description=CRI-O (vmcheck)
[Service]
ExecStart=${launch_crio}/usr/local/bin/crio
Delegate=yes
KillMode=process
UNIT
    cat > /etc/systemd/system/kubelet.service <<UNIT
[Unit]
Description=kubelet (vmcheck)
After=crio.service
[Service]
ExecStart=${launch_kubelet}/usr/local/bin/kubelet $*
UNIT
    run systemctl daemon-reload
}
