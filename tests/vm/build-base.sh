#!/bin/bash
# The node VM's BASE image, built once per machine and cached: Debian 12 with systemd, unified
# cgroup2, refpolicy `default` enforcing (MCS) with refpolicy's container module, podman, runc,
# conmon, auditd, python3. Nothing of this checkout goes into it: tests/vmcheck.py passes the
# checkout in at boot on a second disk (the payload), and a boot unit baked in here unpacks it and
# runs it. So no project change ever rebuilds the base. The recipe's steps are those of the
# workplace's ../shared/tools/node-vm/build-image.sh (its README has the facts behind them).
#
#   tests/vm/build-base.sh [CACHE]      (default $SEVM, else /var/cache/oci-gpu-hook-node-vm)
#
# Output in CACHE/base: rootfs.img (raw ext4, labelled), vmlinuz, initrd.img, and READY (the
# stamp vmcheck.py looks for). Stages, each skipped when its stamp matches its own text (and every
# stage before it was skipped): bootstrap (debootstrap, ~150 s), packages (~320 s), config
# (policy module, SELinux config, boot unit), label (setfiles -r), image (mkfs.ext4 -d).
# It runs itself in a private mount namespace: the chroot's /proc, /sys, /dev never reach the
# host's mount table. Host needs: root, qemu-system-x86 and debootstrap (scripts/setup-host.sh),
# package access for the first build, /usr/src/selinux-policy-src.tar.zst.
set -euo pipefail
if [ -z "${VMCHECK_UNSHARED:-}" ]; then
    VMCHECK_UNSHARED=1 exec unshare -m --propagation private /bin/bash "$0" "$@"
fi
SEVM=${1:-${SEVM:-/var/cache/oci-gpu-hook-node-vm}}
BASE=$SEVM/base
ROOT=$BASE/root
MIRROR=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
MIRROR=${MIRROR:-http://deb.debian.org/debian}
IMG_SIZE=${IMG_SIZE:-8G}
export DEBIAN_FRONTEND=noninteractive LC_ALL=C PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# conntrack, iptables, socat: what a kubelet and CRI-O look for on a node (the OpenShift scenario)
PACKAGES="systemd-sysv udev kmod procps linux-image-amd64 initramfs-tools
 selinux-basics selinux-policy-default selinux-policy-dev selinux-utils policycoreutils semodule-utils
 checkpolicy setools auditd
 podman runc conmon uidmap bpftool
 python3 python3-venv python3-selinux gcc libc6-dev make busybox-static libcap-dev
 ca-certificates e2fsprogs iproute2 less dbus conntrack iptables socat"

mounts_up() {
    mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
    mountpoint -q "$ROOT/sys" || mount -t sysfs sys "$ROOT/sys"
    mountpoint -q "$ROOT/dev" || mount --bind /dev "$ROOT/dev"
    mountpoint -q "$ROOT/dev/pts" || mount --bind /dev/pts "$ROOT/dev/pts"
}
mounts_down() {
    for m in dev/pts dev sys proc; do
        if mountpoint -q "$ROOT/$m"; then umount "$ROOT/$m"; fi
    done
}
in_root() { chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C DEBIAN_FRONTEND=noninteractive "$@"; }

stage_bootstrap() {
    rm -rf "$ROOT"; mkdir -p "$ROOT"
    debootstrap --variant=minbase --include=systemd-sysv,udev,kmod bookworm "$ROOT" "$MIRROR"
}

stage_packages() {
    cat > "$ROOT/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb ${MIRROR}-security bookworm-security main
EOF
    # the package source may serve a dated snapshot
    printf 'Acquire::Check-Valid-Until "false";\nAcquire::Check-Date "false";\n' > "$ROOT/etc/apt/apt.conf.d/99vmcheck-snapshot"
    # no service may start inside the chroot
    printf '#!/bin/sh\nexit 101\n' > "$ROOT/usr/sbin/policy-rc.d"; chmod +x "$ROOT/usr/sbin/policy-rc.d"
    mounts_up
    in_root apt-get update -q
    # shellcheck disable=SC2086
    in_root apt-get install -y -q --no-install-recommends $PACKAGES
    in_root apt-get clean
    rm -f "$ROOT/usr/sbin/policy-rc.d"
    mounts_down
}

stage_config() {
    mounts_up
    # refpolicy's container module: Debian ships it only in selinux-policy-src
    rm -rf "$ROOT/opt/vmcheck-base"; mkdir -p "$ROOT/opt/vmcheck-base/container"
    for e in te fc; do
        tar --zstd -xOf /usr/src/selinux-policy-src.tar.zst selinux-policy-src/policy/modules/services/container.$e \
            > "$ROOT/opt/vmcheck-base/container/container.$e"
    done
    in_root make -C /opt/vmcheck-base/container -f /usr/share/selinux/devel/Makefile container.pp
    in_root semodule -i /opt/vmcheck-base/container/container.pp
    in_root semodule -l | grep -w container
    sed -i 's/^SELINUX=.*/SELINUX=enforcing/; s/^SELINUXTYPE=.*/SELINUXTYPE=default/' "$ROOT/etc/selinux/config"
    rm -f "$ROOT/.autorelabel"  # labelled offline (stage label): no relabel-and-reboot
    echo '/dev/vda / ext4 rw,relatime 0 1' > "$ROOT/etc/fstab"
    echo vmcheck > "$ROOT/etc/hostname"
    in_root passwd -d root >/dev/null
    # The boot unit: /etc/init.d/vmcheck is initrc_exec_t, so systemd starts it in initrc_t. It
    # unpacks the payload (a tar on /dev/vdb) into /opt/vmcheck and runs the payload's guest.sh,
    # which writes its results onto /dev/vdc. All of the test's logic is in the payload.
    cat > "$ROOT/etc/init.d/vmcheck" <<'EOF'
#!/bin/sh
# vmcheck: unpack the payload from /dev/vdb, run its guest.sh, power off
exec > /dev/ttyS0 2>&1
echo "VMCHECK-BOOTED uptime $(cut -d' ' -f1 /proc/uptime)"
rm -rf /opt/vmcheck && mkdir -p /opt/vmcheck && tar -xf /dev/vdb -C /opt/vmcheck \
    && /bin/bash /opt/vmcheck/guest.sh
echo "VMCHECK-GUEST-EXIT $?"
systemctl --no-block poweroff
exit 0
EOF
    chmod 0755 "$ROOT/etc/init.d/vmcheck"
    cat > "$ROOT/etc/systemd/system/vmcheck.service" <<'EOF'
[Unit]
Description=vmcheck: run the payload on /dev/vdb
After=auditd.service dbus.service systemd-user-sessions.service dev-vdb.device dev-vdc.device
Wants=dev-vdb.device dev-vdc.device
ConditionPathExists=/dev/vdb

[Service]
Type=oneshot
ExecStart=/etc/init.d/vmcheck
TimeoutStartSec=3600

[Install]
WantedBy=multi-user.target
EOF
    ln -sf /etc/systemd/system/vmcheck.service "$ROOT/etc/systemd/system/multi-user.target.wants/vmcheck.service"
    # no getty on the serial console: agetty's vhangup() on ttyS0 cuts the output there
    in_root systemctl mask serial-getty@ttyS0.service >/dev/null 2>&1 || true
    in_root systemctl mask systemd-networkd-wait-online.service apt-daily.timer apt-daily-upgrade.timer e2scrub_reap.service >/dev/null 2>&1 || true
    mounts_down
}

stage_label() {
    mounts_down
    local fc="$ROOT/etc/selinux/default/contexts/files/file_contexts"
    setfiles -r "$ROOT" -c "$ROOT/etc/selinux/default/policy/policy.33" "$fc" "$ROOT" 2>&1 | tail -5 || true
    setfiles -r "$ROOT" "$fc" "$ROOT"
}

stage_image() {
    mounts_down
    rm -f "$BASE/rootfs.img.new"
    truncate -s "$IMG_SIZE" "$BASE/rootfs.img.new"
    mkfs.ext4 -q -L vmcheck-root -d "$ROOT" "$BASE/rootfs.img.new"
    local k i
    k=$(ls "$ROOT"/boot/vmlinuz-* | sort -V | tail -1); i=$(ls "$ROOT"/boot/initrd.img-* | sort -V | tail -1)
    cp "$k" "$BASE/vmlinuz"; cp "$i" "$BASE/initrd.img"
    mv "$BASE/rootfs.img.new" "$BASE/rootfs.img"
}

stamp_of() { { declare -f "stage_$1"; [ "$1" = packages ] && echo "$PACKAGES"; [ "$1" = bootstrap ] && echo "$MIRROR"; true; } | sha256sum | cut -c1-16; }

mkdir -p "$BASE"
trap mounts_down EXIT
rebuild=""
for s in bootstrap packages config label image; do
    want=$(stamp_of "$s")
    if [ -z "$rebuild" ] && [ "$(cat "$BASE/.stage-$s" 2>/dev/null)" = "$want" ]; then
        continue
    fi
    rebuild=1
    rm -f "$BASE/READY" "$BASE/.stage-$s"
    t=$(date +%s)
    echo "=== stage $s"
    "stage_$s"
    echo "$want" > "$BASE/.stage-$s"
    echo "=== stage $s done in $(( $(date +%s) - t )) s"
done
touch "$BASE/READY"
echo "$BASE/rootfs.img"
