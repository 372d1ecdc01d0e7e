#!/bin/bash
# Runs inside the node VM at boot (the base image's vmcheck.service unpacked the payload into
# /opt/vmcheck and started this: in initrc_t on the debian flavour, in an administrator's
# unconfined_t on the rhel one), with SELinux enforcing and systemd as PID 1.
# Set-up as a user does it (tests/vm/setup.sh: a venv from the payload's wheels, the SELinux
# module, `oci-gpu-hook install`), then each scenario named
# in scenarios.list, in that order, then the results as a tar stream onto /dev/vdc.
# Results: setup/ and scenarios/NAME/ each with rc, seconds, output.log, avc.log; audit.log,
# journal.log, oci-gpu-hook.log (the console is the serial log). tests/vmcheck.py reads them.
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C HOME=/root
# Debian's policy: from initrc_t, runc enters the confined container_engine_t and no container
# starts (shared/tools/node-vm/README.md). Run where an administrator's login shell runs: root
# logs in as unconfined_u:unconfined_r:unconfined_t (system_r's unconfined_t may not run
# `mount`: unconfined_mount_t is not in system_r). system_r's, should the role change be refused.
if [ -z "${VMCHECK_REEXEC:-}" ] && [ "$(id -Z | cut -d: -f3)" = initrc_t ]; then
    for context in unconfined_u:unconfined_r:unconfined_t:s0-s0:c0.c1023 system_u:system_r:unconfined_t:s0-s0:c0.c1023; do
        if runcon "$context" /bin/true; then
            VMCHECK_REEXEC=1 exec runcon "$context" /bin/bash "$0" "$@"
        fi
    done
fi
P=/opt/vmcheck
R=/root/results
rm -rf "$R"; mkdir -p "$R/scenarios"
AUDIT=/var/log/audit/audit.log
T0=$(date +%s.%N)
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }
echo "VMCHECK-GUEST uptime $(cut -d' ' -f1 /proc/uptime) s, $(id -Z), $(getenforce), $(stat -fc %T /sys/fs/cgroup)"

# step NAME DIR SCRIPT TIMEOUT: run SCRIPT (sourcing lib.sh) with its output, exit status, time
# and the SELinux denials logged meanwhile kept in DIR
step() {
    local name=$1 dir=$2 script=$3 limit=$4 mark_audit mark_dmesg t rc
    mkdir -p "$dir"
    mark_audit=$(wc -l < "$AUDIT" 2>/dev/null || echo 0)
    mark_dmesg=$(dmesg | wc -l)
    echo "VMCHECK-STEP-START $name (uptime $(cut -d' ' -f1 /proc/uptime) s)"
    t=$(date +%s.%N)
    VMCHECK_AUDIT_MARK=$mark_audit timeout --kill-after=10 "$limit" /bin/bash -c 'set -u; source "$0"; source "$1"' "$P/lib.sh" "$script" \
        < /dev/null 2>&1 | tee "$dir/output.log"
    rc=${PIPESTATUS[0]}
    elapsed "$t" > "$dir/seconds"
    echo "$rc" > "$dir/rc"
    # auditd may not have flushed yet: give it a moment
    sleep 1
    # (the kernel log has them only while auditd does not run)
    if [ -s "$AUDIT" ]; then tail -n +"$((mark_audit + 1))" "$AUDIT" | grep -E 'type=(AVC|USER_AVC|SELINUX_ERR)'
    else dmesg | tail -n +"$((mark_dmesg + 1))" | grep -E 'avc: +denied|SELINUX_ERR'; fi > "$dir/avc.log"
    echo "VMCHECK-STEP-END $name rc=$rc $(cat "$dir/seconds") s, $(grep -c . "$dir/avc.log") denial lines"
    return "$rc"
}

if step setup "$R/setup" "$P/setup.sh" 900; then
    while read -r name; do
        [ -n "$name" ] || continue
        limit=$(sed -n 's/^# timeout: *\([0-9]*\).*/\1/p' "$P/scenarios/$name.sh" | head -n 1)
        step "$name" "$R/scenarios/$name" "$P/scenarios/$name.sh" "${limit:-300}"
    done < "$P/scenarios.list"
else
    echo "set-up failed: no scenario runs"
fi

echo "VMCHECK-GUEST took $(elapsed "$T0") s"
cp "$AUDIT" "$R/audit.log" 2>/dev/null
cp /var/log/oci-gpu-hook.log "$R/" 2>/dev/null
journalctl -b --no-pager > "$R/journal.log" 2>/dev/null
systemd-analyze > "$R/systemd-analyze.txt" 2>&1
sync
tar -C "$R" -cf /dev/vdc . && echo "VMCHECK-RESULTS-WRITTEN"
sync
