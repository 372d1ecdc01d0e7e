# The set-up every scenario starts from, as a user does it on a GPU host (docs/toolkit.md, "Typical
# sequence"; selinux/README.md): the package into a venv from wheels (the VM has no network), the
# SELinux module (debian: built with the devel Makefile and loaded with `semodule -i`; rhel: the
# oci-gpu-hook-selinux RPM installed with rpm), then `oci-gpu-hook
# install --runtime podman` (no --root, no test-only flags), daemon-reload, the refresh units
# enabled, doctor. The one stand-in is the driver: the simulated GPU host in $SIM, labelled as a
# real host's files are, with /etc/oci-gpu-hook/config.yaml pointing the hook at it, and
# /proc/driver/nvidia/version (what the refresh unit's condition looks for) on a tmpfs.
set -e
run python3 -m venv /opt/oci-gpu-hook
run /opt/oci-gpu-hook/bin/pip install -q --no-index --find-links "$P/wheels" 'oci-gpu-hook[kubernetes]'
ln -sf /opt/oci-gpu-hook/bin/oci-gpu-hook "$HOOK"

# the driver's stand-in, labelled as the policy labels a host's /dev, /usr/lib64, /usr/bin
mkdir -p /srv && tar -xf "$P/gpuhost.tar" -C /srv
setfiles -r "$SIM" "$FC" "$SIM"
mkdir -p /etc/oci-gpu-hook
printf 'driver_root: %s\ndev_root: %s\nproc_root: %s\n' "$SIM" "$SIM" "$SIM" > /etc/oci-gpu-hook/config.yaml
run mount -t tmpfs -o mode=0755 vmcheck-driver /proc/driver
mkdir -p /proc/driver/nvidia && cp "$SIM/proc/driver/nvidia/version" /proc/driver/nvidia/version

# the SELinux module. debian: as selinux/README.md says to build and load it. rhel: as RHEL installs
# it, the oci-gpu-hook-selinux package (`make rpm`, its module built against RHEL's headers) with
# rpm, whose %post loads it at priority 200. --nodeps: this rpm database knows none of the packages
# it requires (selinux-policy-targeted, container-selinux), whose files the image has.
t=$(date +%s)
if [ "$FLAVOUR" = rhel ]; then
    semodule -l > /root/modules-before-rpm
    run rpm -i --nodeps "$P"/rpms/oci-gpu-hook-selinux-*.noarch.rpm
    semodule --list-modules=full | grep -a -E '^200 +oci_gpu_hook ' || { echo "the package did not load the module at priority 200"; exit 1; }
else
    rm -rf /root/selinux && cp -r "$P/src/selinux" /root/selinux
    run make -s -C /root/selinux -f /usr/share/selinux/devel/Makefile oci_gpu_hook.pp
    run semodule -i /root/selinux/oci_gpu_hook.pp
fi
echo "module built and loaded in $(( $(date +%s) - t )) s"
semodule -l | grep -w oci_gpu_hook

run "$HOOK" install --runtime podman
run systemctl daemon-reload
run systemctl enable --now oci-gpu-hook-refresh.path oci-gpu-hook-refresh.service
run systemctl is-active oci-gpu-hook-refresh.path
run "$HOOK" doctor || true

# the image the scenarios run (busybox + glibc, made with the project's make_rootfs on the host).
# Debian's podman is bin_t and runs in its caller's domain, so what it creates gets the caller's
# labels, not container_ro_file_t and the like (a container then may not even map its libc: "cannot
# apply additional memory protection"): label podman's state as the policy says, before and after,
# as an administrator on Debian must (shared/tools/node-vm/README.md).
mkdir -p /run/containers /run/libpod /var/lib/containers
restorecon -RF /run/containers /run/libpod /var/lib/containers
run podman import -q "$P/gpubox.tar" localhost/gpubox
restorecon -RF /run/containers /run/libpod /var/lib/containers
