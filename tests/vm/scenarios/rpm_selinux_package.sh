# proves: the oci-gpu-hook-selinux RPM on RHEL's targeted policy: installed with rpm (the set-up did, as a RHEL administrator does), its %post loaded the module at priority 200 and gpu_container_t is in the running kernel's policy; `rpm -e` runs its %postun, which removes the module: `semodule -l` is line for line what it was before the package, and gpu_container_t is gone from the running policy; `rpm -i` again brings both back; no denial
# timeout: 900
# flavours: rhel
# The RPM's scriptlets are the stand-ins of rpm/oci-gpu-hook.spec (Debian's rpmbuild has no
# selinux-policy macros): `semodule -n -s targeted -X 200 -i|-r`, then load_policy.
# whether the running kernel's policy knows the domain (security_check_context: EINVAL if not)
in_policy() {
    python3 -c 'import selinux, sys
try:
    selinux.security_check_context(sys.argv[1])
except OSError:
    sys.exit(1)' system_u:system_r:gpu_container_t:s0
}
rpm -q oci-gpu-hook-selinux || fail "the set-up did not install oci-gpu-hook-selinux"
semodule --list-modules=full | grep -a -E '^200 +oci_gpu_hook ' || fail "the module is not at priority 200"
in_policy || fail "gpu_container_t is not in the running policy after the package's %post"

# whatever fails below, the node keeps its module for the scenarios after this one
trap 'rpm -q oci-gpu-hook-selinux >/dev/null || rpm -i --nodeps "$P"/rpms/oci-gpu-hook-selinux-*.noarch.rpm' EXIT
run rpm -e oci-gpu-hook-selinux || fail "rpm -e failed"
semodule -l > /tmp/modules-after-erase
diff /root/modules-before-rpm /tmp/modules-after-erase || fail "semodule -l after rpm -e differs from before the package"
in_policy && fail "gpu_container_t is still in the running policy after rpm -e"
echo "after rpm -e: semodule -l as before the package ($(wc -l < /tmp/modules-after-erase) modules), gpu_container_t gone"

run rpm -i --nodeps "$P"/rpms/oci-gpu-hook-selinux-*.noarch.rpm || fail "rpm -i again failed"
semodule --list-modules=full | grep -a -E '^200 +oci_gpu_hook ' || fail "the module is not back at priority 200"
in_policy || fail "gpu_container_t is not back in the running policy"
rm -f /tmp/modules-after-erase
no_denials "rpm -e and rpm -i of the SELinux package"
