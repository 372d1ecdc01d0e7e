# proves: the start server on a node, set up as a user does it (`oci-gpu-hook install --runtime podman`, which installs and enables it by default, daemon-reload, the socket unit started): the first GPU start's offer makes systemd start oci-gpu-hook-start.service, whose worker (in the service's domain, not the runtime's) gives the gpu_container_t container exactly its GPU and tells systemd the scope's GPU nodes ("via": "start server" in the hook's log, no "systemd not told") with no SELinux denial; the server and its workers run in the module's oci_gpu_hook_start_t, entered from the server's own launcher, which install labelled oci_gpu_hook_start_exec_t (the hook's program keeps usr_t), and init_t gains nothing (selinux/oci_gpu_hook.te); after `systemctl restart` of the service it serves again; with socket and service stopped the next GPU container gets its GPU from the Python hook (no "via")
# timeout: 720 (a hang guard: 214 s measured with other suites running beside the VM, as under make test)
LOG=/var/log/oci-gpu-hook.log
SOCKET=oci-gpu-hook-start.socket
SERVICE=oci-gpu-hook-start.service
UNITS=/etc/systemd/system
SOCK=/run/oci-gpu-hook/start.sock
LIBEXEC=/usr/local/libexec/oci-gpu-hook
SERVER=$LIBEXEC/oci-gpu-hook-start-server
DOMAIN=oci_gpu_hook_start_t
domain_of() { tr -d '\0' < "/proc/$1/attr/current" 2>/dev/null; }  # user:role:type:level

# leave the node as it was, also when a check fails: socket and service stopped, the units this
# scenario's install wrote removed (the manifest still names them; uninstall skips a file that is
# gone), and the socket file, which systemd leaves behind (RemoveOnStop=no)
leave() {
    systemctl stop "$SOCKET" "$SERVICE" >/dev/null 2>&1
    rm -f "$UNITS/$SOCKET" "$UNITS/$SERVICE" "$UNITS/sockets.target.wants/$SOCKET" "$SOCK" "$SERVER" /tmp/start-server.out /tmp/start-server.log
    systemctl daemon-reload
    systemctl reset-failed "$SOCKET" "$SERVICE" >/dev/null 2>&1
}
trap leave EXIT
trap 'exit 1' TERM
show() { journalctl -u "$SERVICE" -u "$SOCKET" --no-pager -o cat | tail -n 20; }
# ready N: the Nth server since the scenario began listens, with a worker forked ahead beside it (a
# pre-filter waits only prefilter_rule.START_SERVER_TAKE_MS for a server to take its start, and an
# interpreter's start under emulation takes seconds)
ready() {
    local i cg
    for i in $(seq 300); do
        cg=$(prop "$SERVICE" ControlGroup)
        [ -n "$cg" ] && [ "$(journalctl -u "$SERVICE" --no-pager -o cat | grep -c "listening on")" -ge "$1" ] \
            && [ "$(wc -w < "/sys/fs/cgroup$cg/cgroup.procs")" -ge 2 ] && return 0
        sleep 0.2
    done
    show; fail "server $1 did not listen with a worker ready within 60 s"
}

# gpu_start NAME VIA: a gpu_container_t start that must get exactly its GPU; the hook's log record
# of it must say "via": "start server" (VIA=server) or carry no "via" (VIA=python); VIA=any: either
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
        any) ;;
    esac
    return 0
}

# the set-up's plain `install --runtime podman` put the start server in place (the default wherever
# the pre-filter is built, and gcc is here): units, the server's launcher, the link that enables the
# socket; nothing started it (as after the RPM's %post, before a reboot)
for f in "$UNITS/$SOCKET" "$UNITS/$SERVICE" "$SERVER" "$UNITS/sockets.target.wants/$SOCKET"; do
    [ -e "$f" ] || fail "$f is missing after the set-up's install (the start server is the default)"
done
[ "$(prop "$SOCKET" ActiveState)" = inactive ] || fail "$SOCKET is $(prop "$SOCKET" ActiveState) before anyone started it"

echo "=== install --start-server, as a user asks for it: nothing more to do"
run "$HOOK" install --runtime podman --start-server | tee /tmp/start-server.out
[ "${PIPESTATUS[0]}" = 0 ] || fail "install --start-server"
expect "nothing to do: already installed" /tmp/start-server.out
# The server's launcher is its domain's entry point: install gave it the label the module's file
# context names, its type, as restorecon sets it (no restorecon here); the hook's program, which
# runtimes run, keeps usr_t.
for f in "$SERVER" "$LIBEXEC/oci-gpu-hook" "$LIBEXEC/oci-gpu-hook-python"; do echo "label: $f $(stat -c %C "$f")"; done
[ "$(stat -c %C "$SERVER" | cut -d: -f3)" = oci_gpu_hook_start_exec_t ] || fail "$SERVER is $(stat -c %C "$SERVER")"
for f in "$LIBEXEC/oci-gpu-hook" "$LIBEXEC/oci-gpu-hook-python"; do
    case $(stat -c %C "$f") in *:usr_t:*) ;; *) fail "$f is $(stat -c %C "$f"), not usr_t: runtimes would enter another domain" ;; esac
done
grep -q "^ExecStart=$SERVER start-server$" "$UNITS/$SERVICE" || fail "the service does not run $SERVER: $(grep ExecStart "$UNITS/$SERVICE")"
# The policy loaded: the module gives init_t nothing on itself (it no longer widens it): none of
# the module's rules is init_t's on init_t (those toward the server's own types are
# init_daemon_domain's: the transition); on Debian's policy init_t then may not start units as itself.
# (RHEL's base policy already lets its unconfined init_t do everything on itself.) The server's
# domain may, and systemd enters it from the launcher's type.
echo "init_t on itself: $(sesearch -A -s init_t -t init_t -c system)"
rm -f /tmp/oci_gpu_hook.cil
(cd /tmp && semodule --cil -E oci_gpu_hook) || fail "semodule -E oci_gpu_hook failed"
grep -q '(type gpu_container_t)' /tmp/oci_gpu_hook.cil || fail "semodule -E gave no CIL of the module"
grep -E '\((allow|allowx|auditallow) init_t (init_t|self) ' /tmp/oci_gpu_hook.cil && fail "the module has a rule for init_t on itself"
rm -f /tmp/oci_gpu_hook.cil
if [ "$FLAVOUR" = debian ]; then
    [ -z "$(sesearch -A -s init_t -t init_t -c system -p start)" ] || fail "init_t may system start on itself"
fi
sesearch -A -s oci_gpu_hook_start_t -t init_t -c system -p start | grep -q . || fail "oci_gpu_hook_start_t may not tell systemd of a scope"
sesearch -T -s init_t -t oci_gpu_hook_start_exec_t -c process | grep -q "oci_gpu_hook_start_t;" || fail "no transition from init_t"
run systemctl daemon-reload
[ "$(prop "$SOCKET" UnitFileState)" = enabled ] || fail "$SOCKET is $(prop "$SOCKET" UnitFileState), not enabled"
run systemctl start "$SOCKET" || { show; fail "$SOCKET did not start"; }
[ "$(prop "$SOCKET" ActiveState)" = active ] || fail "$SOCKET is $(prop "$SOCKET" ActiveState)"
[ "$(prop "$SERVICE" ActiveState)" = inactive ] || fail "$SERVICE runs before any offer: $(prop "$SERVICE" ActiveState)"
test -S "$SOCK" || fail "$SOCK is not a socket"
echo "socket: $(stat -c '%a %U:%G' "$SOCK") $(stat -c %C "$SOCK"), directory $(stat -c '%a %U' "$(dirname "$SOCK")") $(stat -c %C "$(dirname "$SOCK")")"
[ "$(stat -c '%a %u' "$SOCK")" = "600 0" ] || fail "$SOCK is not root's alone"

echo "=== the first GPU start: its offer makes systemd start the server (socket activation)"
# The start itself goes to Python when the server is not taking it within the pre-filter's short
# wait, as a server that is still starting is not (issue 46: no start waits on the server).
gpu_start vmcheck-activating any
run systemctl is-active "$SERVICE" || { show; fail "$SERVICE did not start on the first offer"; }
ready 1
# That start's offer, if its pre-filter gave up on a server still starting, is answered "not taken"
# (its pre-filter went to Python) once the server reads it: let it settle, then count from there.
not_taken() { journalctl -u "$SERVICE" --no-pager -o cat | grep -c -F "not taken"; }
sleep 3
refused=$(not_taken)
echo "=== the next GPU start: the server's worker runs the hook"
gpu_start vmcheck-served server
pid=$(prop "$SERVICE" MainPID)
echo "server pid $pid, domain $(tr -d '\0' < "/proc/$pid/attr/current"), cgroup $(cut -d: -f3 "/proc/$pid/cgroup")"
[ "$(domain_of "$pid" | cut -d: -f3)" = "$DOMAIN" ] || fail "the server is in $(domain_of "$pid"), not $DOMAIN"
# every process of the service: the server and the workers it forked ahead (a worker that ran a
# start is gone by now; it was one of these, forked from the server, which never execs)
for _ in $(seq 50); do  # the next spare is forked as the server loops again
    procs=$(cat "/sys/fs/cgroup$(prop "$SERVICE" ControlGroup)/cgroup.procs")
    [ "$(echo "$procs" | wc -w)" -ge 2 ] && break
    sleep 0.1
done
for p in $procs; do
    d=$(domain_of "$p") || continue  # a worker that just ended
    echo "process $p ($(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | cut -c1-80)): $d"
    [ "$(echo "$d" | cut -d: -f3)" = "$DOMAIN" ] || fail "process $p of $SERVICE is in $d, not $DOMAIN"
done
[ "$(echo "$procs" | wc -w)" -ge 2 ] || fail "no worker beside the server: $procs"
[ "$(not_taken)" = "$refused" ] || { show; fail "the server refused an offer once it listened"; }
show

echo "=== systemctl restart: a new server serves the next start"
run systemctl restart "$SERVICE" || { show; fail "systemctl restart $SERVICE"; }
[ "$(prop "$SERVICE" MainPID)" != "$pid" ] || fail "the server kept its pid across a restart"
ready 2
gpu_start vmcheck-restarted server
[ "$(not_taken)" = "$refused" ] || { show; fail "the restarted server refused an offer"; }
run systemctl is-active "$SERVICE" || fail "$SERVICE is not active after the restart's start"

echo "=== socket and service stopped: the pre-filter hands the next start to Python"
run systemctl stop "$SOCKET" "$SERVICE" || fail "systemctl stop"
for u in "$SOCKET" "$SERVICE"; do
    [ "$(prop "$u" ActiveState)" = inactive ] || fail "$u is $(prop "$u" ActiveState) after stop"
done
gpu_start vmcheck-unserved python

# The simulated nodes have no driver behind them: that record alone is left out (lib.sh says why).
no_denials_but_no_driver "the start server's path (socket, server, worker, hook, the container's GPU open)"
echo "no SELinux denial on the start server's path"
