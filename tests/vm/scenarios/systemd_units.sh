# proves: the units `install` writes run under systemd: the refresh path unit fires when a driver update rewrites /etc/ld.so.cache and its service rewrites the inventory cache; the node services (--node-services) start, come back after a crash, restart and stop; doctor reads their state
# timeout: 480
CACHE=/run/oci-gpu-hook/inventory.json
# driver_update TARFILE: what a driver installer does: new files, then ldconfig
driver_update() {
    rm -rf "$SIM" && tar -xf "$1" -C /srv && setfiles -r "$SIM" "$FC" "$SIM"
    cp "$SIM/proc/driver/nvidia/version" /proc/driver/nvidia/version
    run ldconfig
}

echo "=== the refresh units"
[ "$(prop oci-gpu-hook-refresh.path ActiveState)" = active ] || fail "oci-gpu-hook-refresh.path is not active"
[ "$(prop oci-gpu-hook-refresh.path UnitFileState)" = enabled ] || fail "oci-gpu-hook-refresh.path is not enabled"
grep -q '550\.54\.15' "$CACHE" || fail "$CACHE does not describe the installed driver (550.54.15)"
first=$(prop oci-gpu-hook-refresh.service InvocationID)
driver_update "$P/gpuhost-next.tar"
wait_for 120 grep -q '560\.35\.03' "$CACHE" || { journalctl -u oci-gpu-hook-refresh.service --no-pager | tail -n 20; fail "the inventory cache was not refreshed after the driver update"; }
second=$(prop oci-gpu-hook-refresh.service InvocationID)
[ "$second" != "$first" ] || fail "oci-gpu-hook-refresh.service did not run again (same invocation)"
[ "$(prop oci-gpu-hook-refresh.service Result)" = success ] || fail "the refresh service did not succeed"
journalctl -u oci-gpu-hook-refresh.service --no-pager | tail -n 4
doctor_says refresh-units | grep -q '^PASS.*oci-gpu-hook-refresh.path active' || fail "doctor: $(doctor_says refresh-units)"
# doctor reads the path unit's state from systemd: stopped, driver changes go unnoticed
run systemctl stop oci-gpu-hook-refresh.path
echo "doctor: refresh-units: $(doctor_says refresh-units)"
doctor_says refresh-units | grep -q '^WARN.*oci-gpu-hook-refresh.path inactive (dead)' || fail "doctor does not see the path unit stopped"
run systemctl start oci-gpu-hook-refresh.path
# and back, as a driver downgrade
driver_update "$P/gpuhost.tar"
wait_for 120 grep -q '550\.54\.15' "$CACHE" || fail "the inventory cache was not refreshed after the downgrade"

echo "=== the node services"
run "$HOOK" install --runtime podman --node-services || fail "install --node-services"
run systemctl daemon-reload
# the labels service writes into NFD's feature directory, which NFD's package makes
mkdir -p /etc/kubernetes/node-feature-discovery/features.d
SERVICES="oci-gpu-hook-exporter.service oci-gpu-hook-labels.service oci-gpu-hook-watchdog.service"
run systemctl start $SERVICES || { systemctl status --no-pager $SERVICES; fail "the node services did not start"; }
for s in $SERVICES; do
    wait_for 60 test "$(prop $s ActiveState)" = active || fail "$s is $(prop $s ActiveState)"
done
wait_for 90 sh -c "\"$HOOK\" doctor --json | grep -q 'the exporter answers'" || true
for id in exporter labels watchdog; do
    echo "doctor: $id: $(doctor_says $id)"
    doctor_says $id | grep -q '^PASS' || { journalctl -u oci-gpu-hook-$id --no-pager | tail -n 20; fail "doctor: $id does not pass while its unit runs"; }
done
pid=$(prop oci-gpu-hook-watchdog.service MainPID)
doctor_says watchdog | grep -q "pid $pid" || fail "doctor's watchdog pid is not systemd's MainPID $pid"

echo "--- a crash: systemd restarts it (Restart=on-failure)"
pid=$(prop oci-gpu-hook-exporter.service MainPID)
run kill -KILL "$pid"
wait_for 60 new_main_pid oci-gpu-hook-exporter.service "$pid" || fail "the exporter was not restarted after SIGKILL"
[ "$(prop oci-gpu-hook-exporter.service NRestarts)" -ge 1 ] || fail "systemd counts no restart"
echo "--- systemctl restart"
pid=$(prop oci-gpu-hook-labels.service MainPID)
run systemctl restart oci-gpu-hook-labels.service || fail "restart of the labels service"
[ "$(prop oci-gpu-hook-labels.service MainPID)" != "$pid" ] || fail "the labels service kept its pid across a restart"
echo "--- systemctl stop: doctor sees them gone"
run systemctl stop $SERVICES
for s in $SERVICES; do
    [ "$(prop $s ActiveState)" = inactive ] || fail "$s is $(prop $s ActiveState) after stop"
done
for id in exporter watchdog; do
    echo "doctor: $id: $(doctor_says $id)"
    doctor_says $id | grep -q "^FAIL.*(systemd: oci-gpu-hook-$id.service is inactive (dead)" \
        || fail "doctor: $id does not fail, with systemd's state, while its unit is stopped"
done
rm -rf /etc/kubernetes/node-feature-discovery
