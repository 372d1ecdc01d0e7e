# proves: the harness reports what it must: a scenario's exit status, its output, and the SELinux
# denial it caused (a container_t process reading a file in root's home, admin_home_t)
# timeout: 120
# tests/e2e/test_node_vm.py expects this one to FAIL, with exit status 3, the marker below and
# the denial; it runs first in every boot.
mkdir -p /root/vmcheck-selfcheck && echo secret > /root/vmcheck-selfcheck/file
podman run -t --rm --network none -v /root/vmcheck-selfcheck:/x localhost/gpubox /bin/cat /x/file | tr -d '\r'
echo "VMCHECK-SELFCHECK-MARKER podman rc=${PIPESTATUS[0]}"
rm -rf /root/vmcheck-selfcheck
exit 3
