# proves: a GPU container start logs no SELinux denial on the hook's path under enforcing: the hook runs the host's ldconfig with no_new_privs in its own domain (setexeccon), so no refused transition to ldconfig_t (nnp_transition, SELINUX_ERR security_bounded_transition) is logged, and gpu_container_t uses its GPU without a denial
# timeout: 240
[ "$(getenforce)" = Enforcing ] || fail "SELinux is $(getenforce), not Enforcing"
gpu_run vmcheck-quiet --security-opt label=type:gpu_container_t | tee /tmp/quiet.out
[ "${PIPESTATUS[0]}" = 0 ] || fail "the gpu_container_t container did not run"
grep -E -q "^dev /dev/nvidia0 (ENXIO|ENODEV)-allowed" /tmp/quiet.out || fail "gpu_container_t may not open /dev/nvidia0"
grep -q '^libs=0$' /tmp/quiet.out && fail "no driver library: ldconfig's cache or the mounts are missing"
rm -f /tmp/quiet.out
# The simulated nodes have no driver behind them: opening one makes the kernel ask for the module
# char-major-195-N, which container domains may not (module_request). A real driver is loaded, and
# the kernel asks nothing: that record alone is the simulation's, and is left out.
found=$(denials | grep -v -E 'denied +\{ module_request \} .* kmod="char-major-')
[ -z "$found" ] || { echo "$found"; fail "SELinux denials during a gpu_container_t start (hook, ldconfig, the container's GPU open)"; }
if denials | grep -q .; then echo "(only the no-driver module_request records were logged)"; fi
