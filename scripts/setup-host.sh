#!/bin/sh
# Install the Debian packages oci-gpu-hook needs; a no-op when all are there.
#   setup-host.sh demo   what `make demo` needs: Python, a C compiler (the simulated host's
#                        libraries), runc and busybox (the demo's container). No daemon.
#   setup-host.sh image  what `make image` needs: Python and its venv (the image's interpreter,
#                        the locked Python packages it copies), a C compiler with the static
#                        C library (the bundle's python3), and the SELinux policy's headers and
#                        compiler (the module the toolkit loads). ldd is libc-bin's, always there.
#   setup-host.sh        (or `test`) what the whole test suite needs, the demo's included.
# Recommends are installed too: the suite was verified with them (podman's, for one).
# RHEL 9 equivalent: dnf install python3 gcc glibc-devel glibc-devel.i686 runc podman busybox libcap-devel
# (glibc-static: make image's static bundle python3; selinux-policy-devel: its SELinux module)
# (docker.io: Docker's --gpus end-to-end test; its postinst starts no daemon where systemd is not PID 1)
# (prometheus: the exporter end-to-end test starts its own server; the package's service is not used)
# (containerd: the Kubernetes end-to-end test runs its own, with a kubelet built from ../shared/tools/kubelet)
# (qemu-system-x86, debootstrap: the node VM, tests/vmcheck.py; its base image is built once per machine)
set -eu
demo="python3 python3-venv python3-dev gcc libc6-dev make runc busybox-static"
case "${1:-test}" in
    demo) packages="$demo" ;;
    image) packages="python3 python3-venv gcc libc6-dev make m4 checkpolicy semodule-utils selinux-policy-dev" ;;
    test) packages="$demo gcc-multilib libcap-dev python3-selinux podman uidmap time rpm rpmlint bzip2 zstd checkpolicy semodule-utils policycoreutils selinux-policy-dev selinux-policy-default selinux-policy-src setools python3-setools python3-packaging python3-setuptools docker.io containerd prometheus strace openssl qemu-system-x86 debootstrap" ;;
    *) echo "usage: setup-host.sh [demo|image|test]" >&2; exit 2 ;;
esac
missing=""
for p in $packages; do
    dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ]; then
    echo "setup-host: missing packages:$missing; run as root (or install them) first" >&2
    exit 1
fi
echo "setup-host: installing$missing"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq $missing >/dev/null
