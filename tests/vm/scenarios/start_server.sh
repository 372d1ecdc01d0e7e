# proves: the start server on a node, set up as a user does it (`oci-gpu-hook install --runtime podman --start-server`, daemon-reload, the socket unit started): the first GPU start's offer makes systemd start oci-gpu-hook-start.service, whose worker (in the service's domain, not the runtime's) gives the gpu_container_t container exactly its GPU and tells systemd the scope's GPU nodes ("via": "start server" in the hook's log, no "systemd not told") with no SELinux denial (the server runs in init_t: the module lets it ask systemd, selinux/oci_gpu_hook.te); after `systemctl restart` of the service it serves again; with socket and service stopped the next GPU container gets its GPU from the Python hook (no "via")
# timeout: 360
LOG=/var/log/oci-gpu-hook.log
SOCKET=oci-gpu-hook-start.socket
SERVICE=oci-gpu-hook-start.service
UNITS=/etc/systemd/system
SOCK=/run/oci-gpu-hook/start.sock
prop() { systemctl show -p "$2" --value "$1"; }

# leave the node as it was, also when a check fails: socket and service stopped, the units this
# scenario's install wrote removed (the manifest still names them; uninstall skips a file that is
# gone), and the socket file, which systemd leaves behind (RemoveOnStop=no)
leave() {
    systemctl stop "$SOCKET" "$SERVICE" >/dev/null 2>&1
    rm -f "$UNITS/$SOCKET" "$UNITS/$SERVICE" "$UNITS/sockets.target.wants/$SOCKET" "$SOCK" /tmp/start-server.out /tmp/start-server.log
    systemctl daemon-reload
    systemctl reset-failed "$SOCKET" "$SERVICE" >/dev/null 2>&1
}
trap leave EXIT
trap 'exit 1' TERM
show() { journalctl -u "$SERVICE" -u "$SOCKET" --no-pager -o cat | tail -n 20; }

# gpu_start NAME VIA: a gpu_container_t start that must get exactly its GPU; the hook's log record
# of it must say "via": "start server" (VIA=server) or carry no "via" (VIA=python)
gpu_start() {
    local name=$1 via=$2 before
    before=$(cat "$LOG" 2>/dev/null | wc -l)  # the first start may make the log
    gpu_run "$name" --security-opt label=type:gpu_container_t | tee /tmp/start-server.out
    [ "${PIPESTATUS[0]}" = 0 ] || { show; fail "$name: the gpu_container_t container did not run"; }
    expect "domain=system_u:system_r:gpu_container_t:s0:c" /tmp/start-server.out
    for d in /dev/nvidiactl /dev/nvidia0; do
        grep -E -q "^dev $d (ENXIO|ENODEV)-allowed" /tmp/start-server.out || fail "$name: gpu_container_t may not open $d"
    done
    expect "nodes=1" /tmp/start-server.out
    grep -q '^libs=0$' /tmp/start-server.out && fail "$name: no driver library in the container"
    tail -n +"$((before + 1))" "$LOG" | grep -F '"message":"GPU devices configured"' > /tmp/start-server.log
    [ "$(grep -c . /tmp/start-server.log)" = 1 ] \
        || { tail -n +"$((before + 1))" "$LOG"; fail "$name: not one 'GPU devices configured' record in $LOG"; }
    echo "the hook's record: $(grep -o '"via":"[^"]*"' /tmp/start-server.log || echo 'no "via"')"
    # systemd told of the scope's GPU nodes (DeviceAllow=), or a daemon-reload takes them away
    grep -F -q "systemd not told" /tmp/start-server.log \
        && fail "$name: $(grep -o 'systemd not told[^"]*' /tmp/start-server.log)"
    case $via in
        server) grep -F -q '"via":"start server"' /tmp/start-server.log || { show; fail "$name: the start did not go through the start server"; } ;;
        python) grep -F -q '"via"' /tmp/start-server.log && fail "$name: a start server took the start after it was stopped" ;;
    esac
    return 0
}

# the set-up installed without --start-server: no start server yet (install refuses
# --start-server unless runtimes run the pre-filter, the one that offers starts)
[ -e "$UNITS/$SOCKET" ] && fail "$UNITS/$SOCKET exists before install --start-server"

echo "=== install --start-server, as a user adds it"
run "$HOOK" install --runtime podman --start-server | tee /tmp/start-server.out
[ "${PIPESTATUS[0]}" = 0 ] || fail "install --start-server"
expect "wrote $UNITS/$SOCKET" /tmp/start-server.out
expect "wrote $UNITS/$SERVICE" /tmp/start-server.out
run systemctl daemon-reload
[ "$(prop "$SOCKET" UnitFileState)" = enabled ] || fail "$SOCKET is $(prop "$SOCKET" UnitFileState), not enabled"
run systemctl start "$SOCKET" || { show; fail "$SOCKET did not start"; }
[ "$(prop "$SOCKET" ActiveState)" = active ] || fail "$SOCKET is $(prop "$SOCKET" ActiveState)"
[ "$(prop "$SERVICE" ActiveState)" = inactive ] || fail "$SERVICE runs before any offer: $(prop "$SERVICE" ActiveState)"
test -S "$SOCK" || fail "$SOCK is not a socket"
echo "socket: $(stat -c '%a %U:%G' "$SOCK") $(stat -c %C "$SOCK"), directory $(stat -c '%a %U' "$(dirname "$SOCK")") $(stat -c %C "$(dirname "$SOCK")")"
[ "$(stat -c '%a %u' "$SOCK")" = "600 0" ] || fail "$SOCK is not root's alone"

echo "=== the first GPU start: socket activation starts the server, its worker runs the hook"
gpu_start vmcheck-served server
run systemctl is-active "$SERVICE" || { show; fail "$SERVICE did not start on the first offer"; }
pid=$(prop "$SERVICE" MainPID)
echo "server pid $pid, domain $(tr -d '\0' < "/proc/$pid/attr/current"), cgroup $(cut -d: -f3 "/proc/$pid/cgroup")"
journalctl -u "$SERVICE" --no-pager -o cat | grep -F "not taken" && fail "the server refused an offer"
show

echo "=== systemctl restart: a new server serves the next start"
run systemctl restart "$SERVICE" || { show; fail "systemctl restart $SERVICE"; }
[ "$(prop "$SERVICE" MainPID)" != "$pid" ] || fail "the server kept its pid across a restart"
gpu_start vmcheck-restarted server
run systemctl is-active "$SERVICE" || fail "$SERVICE is not active after the restart's start"

echo "=== socket and service stopped: the pre-filter hands the next start to Python"
run systemctl stop "$SOCKET" "$SERVICE" || fail "systemctl stop"
for u in "$SOCKET" "$SERVICE"; do
    [ "$(prop "$u" ActiveState)" = inactive ] || fail "$u is $(prop "$u" ActiveState) after stop"
done
gpu_start vmcheck-unserved python

# The simulated nodes have no driver behind them: opening one makes the kernel ask for the module
# char-major-195-N, which container domains may not (module_request); selinux_no_denials.sh says why
# that record alone is the simulation's.
found=$(denials | grep -v -E 'denied +\{ module_request \} .* kmod="char-major-')
[ -z "$found" ] || { echo "$found"; fail "SELinux denials on the start server's path (socket, server, worker, hook, the container's GPU open)"; }
echo "no SELinux denial on the start server's path"
