#!/bin/bash
# The node VM's BASE image, built once per machine and cached: Debian 12 with systemd, unified
# cgroup2, SELinux enforcing (MCS), podman, runc, conmon, auditd, python3. Nothing of this
# checkout goes into it: tests/vmcheck.py passes the checkout in at boot on a second disk (the
# payload), and a boot unit baked in here unpacks it and runs it. So no project change ever
# rebuilds the base. The recipe's steps are those of the workplace's
# ../shared/tools/node-vm/build-image.sh (its README has the facts behind them).
#
#   tests/vm/build-base.sh [CACHE [FLAVOUR]]   (CACHE: default $SEVM, else /var/cache/oci-gpu-hook-node-vm)
#
# Two flavours of policy, on the same Debian userland (issue 50):
#   debian  Debian's refpolicy `default`, with refpolicy's container module. Output in CACHE/base.
#   rhel    Fedora's targeted policy (the RHEL family's) with container-selinux as one of its
#           modules, built whole from ../shared/tools/selinux-rhel's source (build-policy.sh,
#           cached there) and installed as the `targeted` store, as selinux-policy-targeted and
#           container-selinux install it on RHEL. Output in CACHE/base-rhel. Its root starts as a
#           copy of the debian flavour's, which is built first.
# Output: rootfs.img (raw ext4, labelled), vmlinuz, initrd.img, and READY (the stamp vmcheck.py
# looks for). Stages, each skipped when its stamp matches its own text (and every stage before it
# was skipped): debian: bootstrap (debootstrap, ~150 s), packages (~320 s); rhel: copy (the debian
# root); then the flavour's policy, config (SELinux mode, boot unit), label (setfiles -r), image
# (mkfs.ext4 -d). It runs itself in a private mount namespace: the chroot's /proc, /sys, /dev
# never reach the host's mount table. Host needs: root, qemu-system-x86 and debootstrap
# (scripts/setup-host.sh), package access for the first build, /usr/src/selinux-policy-src.tar.zst;
# for rhel, checkpolicy, m4, semodule and ../shared/tools/selinux-rhel.
set -euo pipefail
if [ -z "${VMCHECK_UNSHARED:-}" ]; then
    VMCHECK_UNSHARED=1 exec unshare -m --propagation private /bin/bash "$0" "$@"
fi
SEVM=${1:-${SEVM:-/var/cache/oci-gpu-hook-node-vm}}
FLAVOUR=${2:-debian}
case $FLAVOUR in
    debian) BASE=$SEVM/base; POLICY_NAME=default; STAGES="bootstrap packages policy_debian config label image" ;;
    rhel) BASE=$SEVM/base-rhel; POLICY_NAME=targeted; STAGES="copy policy_rhel config label image" ;;
    *) echo "build-base.sh: no flavour $FLAVOUR (debian, rhel)" >&2; exit 2 ;;
esac
ROOT=$BASE/root
RHEL_TOOL=$(cd "$(dirname "$0")/../.." && pwd)/../shared/tools/selinux-rhel
RHEL_CACHE=${SELINUX_RHEL_CACHE:-/var/cache/oci-gpu-hook-selinux-rhel}
MIRROR=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
MIRROR=${MIRROR:-http://deb.debian.org/debian}
IMG_SIZE=${IMG_SIZE:-8G}
export DEBIAN_FRONTEND=noninteractive LC_ALL=C PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# conntrack, iptables, socat: what a kubelet and CRI-O look for on a node (the OpenShift scenario);
# rpm: the rhel flavour installs the SELinux package with it (the RPM's own %post and %postun)
PACKAGES="systemd-sysv udev kmod procps linux-image-amd64 initramfs-tools
 selinux-basics selinux-policy-default selinux-policy-dev selinux-utils policycoreutils semodule-utils
 checkpolicy setools auditd
 podman runc conmon uidmap bpftool
 python3 python3-venv python3-selinux gcc libc6-dev make busybox-static libcap-dev
 ca-certificates e2fsprogs iproute2 less dbus conntrack iptables socat
 rpm"

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

stage_policy_debian() {
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
    mounts_down
}

# The root of the rhel flavour: the debian flavour's, whole (the same packages), built just before.
stage_copy() {
    rm -rf "$ROOT"; mkdir -p "$BASE"
    cp -a --reflink=auto "$SEVM/base/root" "$ROOT"
}

# Fedora's targeted policy, as a RHEL node has it: the policy store made from every module
# (base at priority 100, as selinux-policy-targeted installs it), container-selinux's among them;
# the application contexts the policy's make install-appconfig installs (lxc_contexts, the labels
# podman and CRI-O give containers: container_t, container_file_t); libsemanage's settings as
# RHEL's semanage.conf has them (no expand-check: a semodule -i in the VM relinks 420 modules).
stage_policy_rhel() {
    local pp src conf
    pp=$(mkdir -p "$RHEL_CACHE" && flock "$RHEL_CACHE/build.lock" sh "$RHEL_TOOL/build-policy.sh" "$RHEL_CACHE" | tail -n 1)
    [ -f "$pp/base.pp" ] || { echo "build-policy.sh made no base.pp ($pp)" >&2; return 1; }
    printf 'module-store = direct\nexpand-check = 0\nusepasswd = False\nbzip-small = true\nbzip-blocksize = 5\n' \
        > "$ROOT/etc/selinux/semanage.conf"
    rm -rf "$ROOT/etc/selinux/targeted" "$ROOT/var/lib/selinux/targeted"
    # shellcheck disable=SC2046
    semodule -p "$ROOT" -s targeted -n -X 100 -i "$pp/base.pp" $(ls "$pp"/*.pp | grep -v '/base\.pp$')
    semodule -p "$ROOT" -s targeted -l | grep -w container >/dev/null
    # libsemanage makes the directories it creates root's alone (0700); RHEL's packages ship them
    # 0755, and services that are not root read them (dbus-daemon its dbus_contexts)
    find "$ROOT/etc/selinux/targeted" -type d -exec chmod 0755 {} +
    src=$BASE/policy-src; rm -rf "$src"; mkdir -p "$src"; conf=$src/selinux-policy/config  # in the cache: no leftover in /tmp on failure
    tar -xJf "$RHEL_TOOL/src.tar.xz" -C "$src" ./selinux-policy/config ./SOURCES
    local ctx=$ROOT/etc/selinux/targeted/contexts f
    mkdir -p "$ctx/users" "$ctx/files"
    for f in default_contexts default_type initrc_context failsafe_context userhelper_context removable_context \
        dbus_contexts sepgsql_contexts x_contexts securetty_types virtual_image_context virtual_domain_context \
        lxc_contexts openssh_contexts systemd_contexts snapperd_contexts; do
        install -m 0644 "$conf/appconfig-mcs/$f" "$ctx/$f"
    done
    for f in "$conf"/appconfig-mcs/*_default_contexts; do
        install -m 0644 "$f" "$ctx/users/$(basename "$f" _default_contexts)"
    done
    install -m 0644 "$conf/appconfig-mcs/media" "$ctx/files/media"
    install -m 0644 "$conf/file_contexts.subs_dist" "$ctx/files/file_contexts.subs_dist"
    # which policy this is (docs/selinux.md quotes it)
    cp "$src/SOURCES" "$ROOT/etc/selinux/targeted/SOURCES"
    rm -rf "$src"
}

stage_config() {
    mounts_up
    sed -i "s/^SELINUX=.*/SELINUX=enforcing/; s/^SELINUXTYPE=.*/SELINUXTYPE=$POLICY_NAME/" "$ROOT/etc/selinux/config"
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
    rm -rf "$ROOT/etc/systemd/system/vmcheck.service.d"
    if [ "$FLAVOUR" = rhel ]; then
        # The test runs where a RHEL administrator's login shell runs (unconfined_t, every
        # category). RHEL's policy has no transition from initrc_t to unconfined_t (guest.sh's
        # runcon is refused); systemd (init_t) may enter it, through the shell, its entry point.
        mkdir -p "$ROOT/etc/systemd/system/vmcheck.service.d"
        printf '[Service]\nSELinuxContext=unconfined_u:unconfined_r:unconfined_t:s0-s0:c0.c1023\nExecStart=\nExecStart=/bin/sh /etc/init.d/vmcheck\n' \
            > "$ROOT/etc/systemd/system/vmcheck.service.d/administrator.conf"
    fi
    # no getty on the serial console: agetty's vhangup() on ttyS0 cuts the output there
    in_root systemctl mask serial-getty@ttyS0.service >/dev/null 2>&1 || true
    in_root systemctl mask systemd-networkd-wait-online.service apt-daily.timer apt-daily-upgrade.timer e2scrub_reap.service >/dev/null 2>&1 || true
    mounts_down
}

stage_label() {
    mounts_down
    local fc="$ROOT/etc/selinux/$POLICY_NAME/contexts/files/file_contexts"
    setfiles -r "$ROOT" -c "$ROOT/etc/selinux/$POLICY_NAME/policy/policy.33" "$fc" "$ROOT" 2>&1 | tail -5 || true
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

# a stage's stamp: its text and what it reads beyond it (the packages, the mirror, the debian root
# the rhel flavour copies, the RHEL policy's source)
stamp_of() {
    {
        declare -f "stage_$1"
        case $1 in
            packages) echo "$PACKAGES" ;;
            bootstrap) echo "$MIRROR" ;;
            copy) cat "$SEVM"/base/.stage-* 2>/dev/null ;;
            policy_rhel) sha256sum "$RHEL_TOOL/src.tar.xz" "$RHEL_TOOL/build-policy.sh" | cut -c1-64 ;;
        esac
        true
    } | sha256sum | cut -c1-16
}

mkdir -p "$BASE"
trap mounts_down EXIT
# the rhel root is a copy of the debian one's: that one first (a no-op when it is built), so that
# the copy's stamp reads the debian stamps it is copied with
if [ "$FLAVOUR" = rhel ]; then
    VMCHECK_UNSHARED=1 bash "$0" "$SEVM" debian >&2
fi
rebuild=""
for s in $STAGES; do
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
