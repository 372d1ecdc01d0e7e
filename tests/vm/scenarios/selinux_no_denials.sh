# proves: a GPU container start logs no SELinux denial on the hook's path under enforcing: the hook runs the host's ldconfig with no_new_privs in its own domain (setexeccon), so no refused transition to ldconfig_t (nnp_transition, SELINUX_ERR security_bounded_transition) is logged, and gpu_container_t uses its GPU without a denial
# timeout: 240
[ "$(getenforce)" = Enforcing ] || fail "SELinux is $(getenforce), not Enforcing"
gpu_run vmcheck-quiet --security-opt label=type:gpu_container_t | tee /tmp/quiet.out
[ "${PIPESTATUS[0]}" = 0 ] || fail "the gpu_container_t container did not run"
grep -E -q "^dev /dev/nvidia0 (ENXIO|ENODEV)-allowed" /tmp/quiet.out || fail "gpu_container_t may not open /dev/nvidia0"
grep -q '^libs=0$' /tmp/quiet.out && fail "no driver library: ldconfig's cache or the mounts are missing"
rm -f /tmp/quiet.out
# The simulated nodes have no driver behind them: that record alone is left out (lib.sh says why).
no_denials_but_no_driver "a gpu_container_t start (hook, ldconfig, the container's GPU open)"
