# proves: the node image's toolkit alone, on an enforcing node with no module of ours loaded and no hook installed (the set-up's both taken away first): `toolkit install`, run from the image's root as the node pod runs it (the host's root at /host), loads the module the image carries for this node's policy family (read from /etc/selinux/config) at priority 300 and labels the bundle as the policy says; a gpu_container_t container then gets exactly its GPU, with no denial; install again relinks nothing; `toolkit uninstall` removes the module and every file of ours, and the policy's modules are what they were
# timeout: 1500
# needs: image
IMG=$P/node-image
[ -x "$IMG/usr/bin/oci-gpu-hook" ] || fail "no node image in the payload"
[ "$(getenforce)" = Enforcing ] || fail "SELinux is $(getenforce), not Enforcing"

# The node pod's view: the image's root, the host's at /host (recursively, as a hostPath is),
# /proc and /dev; the toolkit's own command line, as deploy/kubernetes/25-toolkit.yaml runs it.
toolkit() {
    unshare --mount --propagation private sh -c 'mount --rbind / "$1/host" && mount -t proc proc "$1/proc" &&
        mount --rbind /dev "$1/dev" && r=$1 && shift && exec chroot "$r" /usr/bin/oci-gpu-hook "$@"' \
        sh "$IMG" toolkit "$@"
}

# Its listing through a pipe: semanage_t may not write /tmp's files.
modules() { semodule -l | cat; }

# This node gets the hook and the module from the toolkit alone.
setup_hook_away
modules > /tmp/modules-before
grep -q . /tmp/modules-before || fail "semodule -l listed nothing"
# What install writes and uninstall takes back: the files there now, to compare after.
our_files > /tmp/files-before

run toolkit install --runtime podman --host-root /host --restart none | tee /tmp/install.out
[ "${PIPESTATUS[0]}" = 0 ] || fail "toolkit install"
expect "loaded SELinux module oci_gpu_hook into policy $POLICY_NAME at priority 300 (selinux/$FLAVOUR/oci_gpu_hook.pp)" /tmp/install.out
semodule --list-modules=full | grep -a -E '^300 +oci_gpu_hook ' || fail "the module is not at priority 300"
[ "$(semodule --list-modules=full | grep -a -c -E ' oci_gpu_hook ')" = 1 ] || fail "another module of ours is loaded"
relabel=$(restorecon -nvR /usr/local/libexec/oci-gpu-hook)
[ -z "$relabel" ] || { echo "$relabel" | head; fail "files of the bundle are not labelled as the policy says"; }
ls -Z /usr/local/libexec/oci-gpu-hook/oci-gpu-hook-start-server /usr/local/libexec/oci-gpu-hook/bundles/*/bin/python3

gpu_run vmcheck-toolkit --security-opt label=type:gpu_container_t | tee /tmp/gpu.out
[ "${PIPESTATUS[0]}" = 0 ] || fail "the gpu_container_t container did not run"
expect_gpu_zero /tmp/gpu.out
no_denials_but_no_driver "toolkit install and a gpu_container_t container"

# Again, as every round of the DaemonSet does: the store holds this build, nothing is relinked.
t=$(date +%s)
run toolkit install --runtime podman --host-root /host --restart none | tee /tmp/again.out
[ "${PIPESTATUS[0]}" = 0 ] || fail "toolkit install, again"
grep -q 'SELinux module' /tmp/again.out && fail "install again touched the module"
echo "install again: $(( $(date +%s) - t )) s"

run toolkit uninstall --host-root /host --restart none | tee /tmp/uninstall.out
[ "${PIPESTATUS[0]}" = 0 ] || fail "toolkit uninstall"
expect "removed SELinux module oci_gpu_hook (priority 300)" /tmp/uninstall.out
modules > /tmp/modules-after
diff /tmp/modules-before /tmp/modules-after || fail "the policy's modules are not what they were"
our_files > /tmp/files-after
diff /tmp/files-before /tmp/files-after || fail "toolkit uninstall left the files above changed"
no_denials_but_no_driver "toolkit uninstall"

# The node as the set-up left it, for any scenario after this one.
setup_hook_back
rm -f /tmp/modules-before /tmp/modules-after /tmp/files-before /tmp/files-after /tmp/install.out /tmp/again.out /tmp/uninstall.out /tmp/gpu.out
