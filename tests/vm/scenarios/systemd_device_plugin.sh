# proves: the device plugin's unit that `install --device-plugin` writes runs under systemd: started with no kubelet it is active and its log says it waits for the kubelet (doctor WARNs, with systemd's state); a kubelet stand-in (a Registration server on kubelet.sock in /var/lib/kubelet/device-plugins) then gets its registration and, from its socket there (closed to others), a ListAndWatch list of healthy GPUs; killed with SIGKILL, systemd restarts it and it registers again; `systemctl restart` gives a new process that registers again; `systemctl stop` stops it, its socket goes, and doctor FAILs with what systemd says of the unit
# timeout: 420
UNIT=oci-gpu-hook-device-plugin.service
UNIT_FILE=/etc/systemd/system/$UNIT
DIR=/var/lib/kubelet/device-plugins
KLOG=/tmp/kubelet-standin.log
PY=/opt/oci-gpu-hook/bin/python
registrations() { grep -c '^register ' "$KLOG"; }
lists() { grep -c '^devices ' "$KLOG"; }
journal() { journalctl -u "$UNIT" --no-pager -o cat; }
show() { journal | tail -n 20; echo "--- the kubelet stand-in:"; cat "$KLOG" /tmp/kubelet-standin.out 2>/dev/null; }

# leave the node as it was, also when a check fails: the stand-in and the plugin stopped, the
# unit and what this scenario made removed (the manifest still names the unit; uninstall skips a
# file that is gone)
standin=""
made_dir=""
leave() {
    [ -z "$standin" ] || kill "$standin" 2>/dev/null
    systemctl stop "$UNIT" >/dev/null 2>&1
    rm -f "$UNIT_FILE" "/etc/systemd/system/multi-user.target.wants/$UNIT" "$DIR/kubelet.sock" "$KLOG" /tmp/kubelet-standin.out /root/kubelet-standin.py
    systemctl daemon-reload
    [ -z "$made_dir" ] || rm -rf "$made_dir"
}
trap leave EXIT
trap 'exit 1' TERM

# no kubelet runs here (openshift_node stops its own): a kubelet.sock left behind is stale
systemctl is-active -q kubelet.service && fail "a kubelet runs: this scenario needs the device-plugins directory to itself"
[ -d /var/lib/kubelet ] || made_dir=/var/lib/kubelet
mkdir -p "$DIR"
rm -f "$DIR/kubelet.sock"
: > "$KLOG"

echo "=== the unit, started before the kubelet"
run "$HOOK" install --runtime podman --device-plugin || fail "install --device-plugin"
grep -q '^After=.*kubelet.service' "$UNIT_FILE" || fail "$UNIT_FILE is not ordered after the kubelet"
run systemctl daemon-reload
[ "$(prop $UNIT UnitFileState)" = enabled ] || fail "$UNIT is $(prop $UNIT UnitFileState), not enabled"
run systemctl start "$UNIT" || { systemctl status --no-pager "$UNIT"; fail "$UNIT did not start"; }
wait_for 90 sh -c "journalctl -u $UNIT --no-pager -o cat | grep -q 'waiting for the kubelet: $DIR/kubelet.sock is not there'" \
    || { show; fail "the plugin's log does not say it waits for the kubelet"; }
[ "$(prop $UNIT ActiveState)" = active ] || { show; fail "$UNIT is $(prop $UNIT ActiveState) while it waits"; }
journal | tail -n 3
echo "doctor: device-plugin: $(doctor_says device-plugin)"
doctor_says device-plugin | grep -q "^WARN the device plugin runs but serves no socket for .*(is the kubelet up?) (systemd: $UNIT is active (running)" \
    || fail "doctor does not WARN, with systemd's state, while the plugin waits for the kubelet"

echo "=== a kubelet stand-in: registration, then ListAndWatch on the plugin's socket, as the kubelet does"
cat > /root/kubelet-standin.py <<'PY'
import os, signal, sys, threading
from concurrent import futures

import grpc

from oci_gpu_hook.node.kubelet_api import deviceplugin_pb2 as pb2, deviceplugin_pb2_grpc as pb2_grpc

directory, log_path = sys.argv[1], sys.argv[2]
sock = os.path.join(directory, "kubelet.sock")
lock = threading.Lock()


def note(line):
    with lock, open(log_path, "a") as f:
        f.write(line + "\n")


def follow(request):
    # the kubelet, once a plugin registered: open its endpoint and read its device lists
    path = os.path.join(directory, request.endpoint)
    try:
        with grpc.insecure_channel("unix://" + path) as channel:
            for reply in pb2_grpc.DevicePluginStub(channel).ListAndWatch(pb2.Empty()):
                health = ",".join(sorted({d.health for d in reply.devices}))
                note(f"devices {request.resource_name} {len(reply.devices)} {health}")
    except grpc.RpcError as e:
        note(f"stream-ended {request.resource_name} {e.code().name}")


class Registration(pb2_grpc.RegistrationServicer):
    def Register(self, request, context):
        note(f"register {request.resource_name} {request.endpoint} {request.version}")
        threading.Thread(target=follow, args=(request,), daemon=True).start()
        return pb2.Empty()


server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
pb2_grpc.add_RegistrationServicer_to_server(Registration(), server)
if server.add_insecure_port("unix://" + sock) == 0:
    sys.exit(f"cannot serve {sock}")
server.start()
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
while not stop.wait(1):
    pass
server.stop(None).wait(5)  # gRPC unlinks kubelet.sock as it closes
PY
"$PY" /root/kubelet-standin.py "$DIR" "$KLOG" > /tmp/kubelet-standin.out 2>&1 &
standin=$!
wait_for 60 test -S "$DIR/kubelet.sock" || { show; fail "the kubelet stand-in does not serve $DIR/kubelet.sock"; }
wait_for 90 grep -q '^devices ' "$KLOG" || { show; fail "the plugin did not register with the kubelet stand-in, or sent no device list"; }
cat "$KLOG"
read -r _ resource endpoint version < <(grep '^register ' "$KLOG" | head -n 1)
[ "$resource" = nvidia.com/gpu ] || fail "registered $resource, not nvidia.com/gpu"
[ "$version" = v1beta1 ] || fail "registered with API version $version"
sock="$DIR/$endpoint"
test -S "$sock" || fail "$sock is not a socket"
mode=$(stat -c %a "$sock")
[ $(( 8#$mode & 8#077 )) = 0 ] || fail "$sock has mode $mode: others may connect and ask for devices"
read -r _ _ count health < <(grep '^devices ' "$KLOG" | head -n 1)
[ "$count" -ge 1 ] && [ "$health" = Healthy ] || fail "ListAndWatch sent $count devices, health $health"
wait_for 30 sh -c "journalctl -u $UNIT --no-pager -o cat | grep -q 'nvidia.com/gpu: registered with the kubelet'" \
    || { show; fail "the plugin's log does not say it registered"; }
journal | grep -F "registered with the kubelet"
[ "$(prop $UNIT ActiveState)" = active ] || fail "$UNIT is $(prop $UNIT ActiveState) after registering"
echo "doctor: device-plugin: $(doctor_says device-plugin)"
doctor_says device-plugin | grep -q "^PASS the device plugin offers nvidia.com/gpu to the kubelet" \
    || fail "doctor does not pass while the plugin serves the kubelet"

echo "--- a crash: systemd restarts it (Restart=on-failure), and it registers again"
pid=$(prop $UNIT MainPID)
m=$(lists)
run kill -KILL "$pid"
wait_for 60 new_main_pid $UNIT "$pid" || { show; fail "the plugin was not restarted after SIGKILL"; }
[ "$(prop $UNIT NRestarts)" -ge 1 ] || fail "systemd counts no restart"
wait_for 90 sh -c "[ \$(grep -c '^register ' $KLOG) -ge 2 ]" || { show; fail "the restarted plugin did not register again"; }
wait_for 30 sh -c "[ \$(grep -c '^devices ' $KLOG) -gt $m ]" || { show; fail "the restarted plugin sent no device list"; }
test -S "$sock" || fail "$sock is gone after the restart"
echo "restarts: $(prop $UNIT NRestarts), registrations: $(registrations)"

echo "--- systemctl restart: a new process, registered again"
pid=$(prop $UNIT MainPID)
n=$(registrations)
run systemctl restart "$UNIT" || fail "systemctl restart $UNIT"
[ "$(prop $UNIT MainPID)" != "$pid" ] || fail "the plugin kept its pid across a restart"
wait_for 90 sh -c "[ \$(grep -c '^register ' $KLOG) -gt $n ]" || { show; fail "the plugin did not register again after systemctl restart"; }

echo "--- systemctl stop: the socket goes, doctor sees the unit stopped"
said=$(journal | grep -c 'oci-gpu-hook device-plugin: stopped')
run systemctl stop "$UNIT" || fail "systemctl stop $UNIT"
[ "$(prop $UNIT ActiveState)" = inactive ] || fail "$UNIT is $(prop $UNIT ActiveState) after stop"
[ ! -e "$sock" ] || fail "$sock is still there after stop"
wait_for 30 sh -c "[ \$(journalctl -u $UNIT --no-pager -o cat | grep -c 'oci-gpu-hook device-plugin: stopped') -gt $said ]" \
    || { show; fail "the plugin's log does not say it stopped"; }
echo "doctor: device-plugin: $(doctor_says device-plugin)"
doctor_says device-plugin | grep -q "^FAIL the device plugin is not running.*(systemd: $UNIT is inactive (dead)" \
    || fail "doctor does not fail, with systemd's state, while the unit is stopped"
