"""The hook's first test, as data: the commands by which a runtime runs the hook, and the names in
a container's configuration that can make it ask for GPUs.

A leaf that imports nothing, so that every side reads it and none reads another through it:
hook.py dispatches on the commands, prestart.may_ask_for_gpus tests the names, request.py reads
the request by the same names, and toolkit/prefilter.py writes all of it into the compiled
pre-filter's header (prefilter_rule.h), so that the Python and C rules cannot drift apart.
"""

# The hook itself (the OCI prestart and createRuntime hooks).
RUNTIME_COMMANDS = ("prestart", "createRuntime")
# The CDI spec's createContainer hook (ldcache_refresh.py): it runs for each container too.
LDCACHE_REFRESH = "ldcache-refresh"
# The start server (server.py): the command that runs it, where it listens (compiled into the
# pre-filter, which offers it each start Python would get), the protocol at the head of every
# offer's first line (the code's identity follows it: server.version_line), and how long a
# pre-filter waits for "taken" before the start is Python's (the most a faulty server adds to one).
START_SERVER = "start-server"
START_SERVER_SOCKET = "/run/oci-gpu-hook/start.sock"
START_SERVER_VERSION = "oci-gpu-hook start 2"
START_SERVER_TAKE_MS = 250
# The hook's own environment variables (OCI_GPU_HOOK_CONFIG, _DEBUG, _FAULT_AT) all start so: a start
# server's worker has the server's environment, so the pre-filter offers it no start while one is set.
HOOK_ENV_PREFIX = "OCI_GPU_HOOK_"

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
NO_DEVICES = "void"  # in the device list: not a GPU container, whatever else it names
LEGACY_VARIABLE = "CUDA_VERSION"  # images from before NVIDIA_REQUIRE_CUDA
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
# Set by each device of the spec `cdi generate` writes (OCI_GPU_HOOK_CDI_DEVICE_<name>=<id>): the
# runtime applied that device, and the hook only records the container (its limits, its names).
CDI_DEVICE_ENV_PREFIX = "OCI_GPU_HOOK_CDI_DEVICE_"
# NVIDIA's volume-mount device list: /dev/null mounted at VOLUME_MOUNT_DIR/<id> (spec.py reads it).
VOLUME_MOUNT_DIR = "/var/run/nvidia-container-devices"


def split_config(argv):
    """(--config value or None, the rest) of a command line: what the runtime's fast path (hook.py)
    and the start server (server.py) read; click parses everything else."""
    if argv and argv[0] == "--config" and len(argv) > 1:
        return argv[1], argv[2:]
    if argv and argv[0].startswith("--config="):
        return argv[0].split("=", 1)[1], argv[1:]
    return None, argv


def is_runtime_command(argv) -> bool:
    """argv is [--config FILE] and one command a runtime runs for each container (the hook)."""
    rest = split_config(argv)[1]
    return len(rest) == 1 and rest[0] in RUNTIME_COMMANDS
