"""The hook's configuration: where it is found, how it is checked, what it holds.

Found at --config FILE, else $OCI_GPU_HOOK_CONFIG, else /etc/oci-gpu-hook/config.yaml (whose
absence means defaults). Checked against schemas/config.schema.json; every error names the file,
the key and what is accepted.

YAML and jsonschema cost the hook more than everything else it does (~100 ms of imports), so the
hook (prestart, load(cache=True)) also keeps a validated file compiled, as JSON, under
/run/oci-gpu-hook, keyed by the file's path, inode, size and modification time, and reads that
while the file is unchanged. Only the hook: the commands people and services run read the file
itself and leave /run/oci-gpu-hook alone, so that a command run with --config on a file of one's
own leaves nothing on the host, where the hook may not even be installed. What the hook keeps
(this copy, the inventory cache) is CACHE_UID's, a uid no process runs as (write_trusted), and
used only while it is (trusted): see CACHE_UID for why root's own would not do.
"""

from __future__ import annotations

import errno
import os
import stat

from oci_gpu_hook.errors import ConfigError
from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.start import driver, files, jsonio

DEFAULT_PATH = "/etc/oci-gpu-hook/config.yaml"
RUN_DIR = "/run/oci-gpu-hook"  # compiled settings, the inventory cache, pending/ (journal.py)
ENV_VAR = "OCI_GPU_HOOK_CONFIG"
# The package's JSON schemas (config, CDI, oci-hooks): the one place that says where they are.
SCHEMAS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "schemas")
SCHEMA_PATH = os.path.join(SCHEMAS_DIR, "config.schema.json")
MAX_CONFIG_BYTES = 1 << 20
# The owner of the files the hook keeps for itself (the compiled settings, the inventory cache,
# the container records, the start journal; the watchdog's counts too): they decide what
# containers get, where mounts come from, whose processes the watchdog kills, what the next
# start removes from a rootfs. Not root: a process of uid 0 without a single capability (a
# container's root with its capabilities dropped, given a hostPath of the host's /run) is still
# the owner of every file of root's, and may rewrite, chmod or replace them and make new ones in
# root's directories. What it may not do is make a file of another uid, or write or chmod one
# (that takes CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER). So the hook, with those capabilities,
# gives what it keeps to this uid, which no process runs as, and trusts nothing else there.
# 65533: in 65520-65533, which systemd's uid map (UIDS-GIDS.md) leaves unused; past
# distributions' users (to 60000), systemd-homed's and its dynamic users' (to 65519); below every
# range handed to user namespaces (subuid's from 100000, the kubelet's from 65536,
# systemd-nspawn's from 524288), where a container's process could hold it; and not 65534, the
# overflow uid, which daemons run as and which every unmapped owner shows as in a user namespace.
CACHE_UID = 65533


class LoggingSettings(Frozen):
    __slots__ = ("level", "file", "syslog")
    _defaults = {"level": "info", "file": "/var/log/oci-gpu-hook.log", "syslog": False}
    level: str
    file: str | None
    syslog: bool


class NodeSettings(Frozen):
    """The node services' keys (node/): nothing on the start path reads them."""

    __slots__ = ("exporter_listen", "features_file", "mig_strategy", "replicas", "watchdog_policy",
                 "watchdog_interval", "watchdog_grace", "device_plugin_config", "kubelet_socket_dir",
                 "sys_root")  # fmt: skip
    _defaults = {
        "exporter_listen": ":9400",
        "features_file": "/etc/kubernetes/node-feature-discovery/features.d/oci-gpu-hook",
        "mig_strategy": "none",
        "replicas": 1,
        "watchdog_policy": "kill",
        "watchdog_interval": 1.0,
        "watchdog_grace": 0.0,
        "device_plugin_config": None,
        "kubelet_socket_dir": "/var/lib/kubelet/device-plugins",
        "sys_root": "/",
    }
    exporter_listen: str
    features_file: str
    mig_strategy: str
    replicas: int
    watchdog_policy: str
    watchdog_interval: float
    watchdog_grace: float
    device_plugin_config: str | None  # plugin_config.py's file; None: mig_strategy and replicas above
    kubelet_socket_dir: str
    sys_root: str  # root under which sysfs is read (/sys/...), as proc_root for procfs


class Settings(Frozen):
    __slots__ = (
        "driver_root",
        "dev_root",
        "proc_root",
        "supported_capabilities",
        "accept_envvar_when_unprivileged",
        "accept_volume_mounts",
        "accept_cdi_annotations",
        "cdi_kind",
        "disable_require",
        "mps_pipe_directories",
        "inventory_cache",
        "records_directory",
        "shared_gpu_memory_limit",
        "cgroups",
        "deadline_seconds",
        "logging",
        "node",
        "source",
    )
    _defaults = {
        "driver_root": "/",
        "dev_root": "/",
        "proc_root": "/",
        "supported_capabilities": driver.CAPABILITIES,
        "accept_envvar_when_unprivileged": True,
        "accept_volume_mounts": False,
        # Off: runtimes with CDI (CRI-O, podman) inject annotated devices themselves; the hook
        # would configure them a second time. For runtimes that only pass the annotations on.
        "accept_cdi_annotations": False,
        "cdi_kind": "nvidia.com/gpu",
        "disable_require": False,
        "mps_pipe_directories": (driver.MPS_PIPE_DIRECTORY,),
        "inventory_cache": f"{RUN_DIR}/inventory.json",
        "records_directory": None,  # RUN_DIR/containers (records_path)
        "shared_gpu_memory_limit": None,
        "cgroups": "auto",
        "deadline_seconds": 8.0,
        "logging": LoggingSettings(),
        "node": NodeSettings(),
        "source": None,
    }
    driver_root: str
    dev_root: str
    proc_root: str
    supported_capabilities: tuple[str, ...]
    accept_envvar_when_unprivileged: bool
    accept_volume_mounts: bool
    accept_cdi_annotations: bool
    cdi_kind: str
    disable_require: bool
    mps_pipe_directories: tuple[str, ...]
    inventory_cache: str
    records_directory: str | None
    shared_gpu_memory_limit: str | None  # memory_limit.py: a size, a percentage or per-replica
    cgroups: str
    deadline_seconds: float
    logging: LoggingSettings
    node: NodeSettings
    source: str | None  # the file these settings came from; None for built-in defaults

    @property
    def records_path(self) -> str:
        """Where the container records are (start/container_record.py)."""
        return self.records_directory or os.path.join(RUN_DIR, "containers")

    @classmethod
    def from_mapping(cls, data: dict, source: str | None) -> Settings:
        """Build from an already validated mapping."""
        values = dict(data)
        values["logging"] = LoggingSettings(**values.get("logging", {}))
        values["node"] = NodeSettings(**values.get("node", {}))
        caps = values.get("supported_capabilities")
        if caps is not None:
            values["supported_capabilities"] = driver.CAPABILITIES if "all" in caps else tuple(caps)
        if "mps_pipe_directories" in values:
            values["mps_pipe_directories"] = tuple(values["mps_pipe_directories"])
        return cls(source=source, **values)


def config_path(explicit: str | None, environ: dict) -> str | None:
    """The file to read, or None when defaults apply."""
    if explicit:
        return explicit
    if environ.get(ENV_VAR):
        return environ[ENV_VAR]
    return DEFAULT_PATH if os.path.exists(DEFAULT_PATH) else None


def load(explicit: str | None = None, environ: dict = os.environ, cache: bool = False) -> Settings:
    """cache: read and keep the compiled copy under RUN_DIR; the hook's start path alone asks."""
    path = config_path(explicit, environ)
    if path is None:
        return Settings()
    path = os.path.abspath(path)
    if not cache:
        return Settings.from_mapping(parse_mapping(read_config_file(path), path), path)
    key = _file_key(path)
    if _memory is not None and key is not None and _memory.get(path, (None,))[0] == key:
        return _memory[path][1]
    compiled = _read_compiled(path, key)
    if compiled is not None:
        settings = Settings.from_mapping(compiled, path)
    else:
        data = parse_mapping(read_config_file(path), path)
        _write_compiled(path, key, data)
        settings = Settings.from_mapping(data, path)
    if _memory is not None and key is not None:
        _memory[path] = (key, settings)
    return settings


# The settings loaded with cache=True, by path, with the file key they were loaded under: only in
# a start server's spare worker (server.Spare), which loads them before its start comes, so that
# the start finds them here while the key still matches (the guarantee the compiled copy has).
_memory: dict | None = None


def keep_in_memory() -> None:
    global _memory
    _memory = {}


def _file_key(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None  # read_config_file reports it
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def compiled_path(path: str) -> str:
    # Readable and collision-tolerant: the file records its source path, checked on read.
    return os.path.join(RUN_DIR, "settings" + path.replace("_", "__").replace("/", "_") + ".json")


def cache_owners() -> tuple:
    """Whose files trusted() takes. For root: CACHE_UID's alone, since what a uid 0 without
    capabilities may write is root's. For another user: also its own, which only it (or root)
    can have written, and which can give it nothing it could not do itself. In a user namespace
    (rootless podman) only its own: there CACHE_UID, the host's root and every other user
    outside it all show as the overflow uid, a file of the host's nobody as much as root's."""
    from oci_gpu_hook.start.linux import userns

    if userns.unprivileged():
        return (os.geteuid(),)
    return (CACHE_UID,) if os.geteuid() == 0 else (CACHE_UID, os.geteuid())


def trusted(st) -> bool:
    """Owned by one of cache_owners() and writable by it alone: only the hook (or this user
    itself) can have written it."""
    return st.st_uid in cache_owners() and not st.st_mode & 0o022


def _trusted_directory(st) -> bool:
    """A directory of the hook's (root's, CACHE_UID's; this user's own) that no one else may write.
    Not what makes its files safe (trusted() does that: a uid 0 without capabilities may rename
    root's directory, and every entry of it, but make no file that passes); only that no other
    user can rename the hook's own files around in it."""
    from oci_gpu_hook.start.linux import userns

    owners = (os.geteuid(),) if userns.unprivileged() else (0, CACHE_UID, os.geteuid())
    return st.st_uid in owners and not st.st_mode & 0o022


def read_trusted(path: str, limit: int, seen: list | None = None) -> bytes:
    """The contents of the regular file at path, if it passes trusted(), for the files the hook
    keeps for itself (compiled settings, the inventory cache): they decide where mounts come from.
    seen: gets the stat of the descriptor that was read.

    Raises OSError (absent; a symlink: ELOOP) or ValueError (not a regular file, not trusted, over
    limit bytes), checked on the descriptor that is read (files.read_bounded)."""

    def check(st):
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if not trusted(st):
            owners = " or ".join(str(uid) for uid in cache_owners())
            raise ValueError(f"owned by uid {st.st_uid} with mode {st.st_mode & 0o7777:04o}: only a file of "
                             f"uid {owners} that no one else may write is used")  # fmt: skip

    def check_and_see(st):
        check(st)
        if seen is not None:
            seen.append(st)

    data = files.read_bounded(path, limit, nofollow=True, check=check_and_see)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data


def write_trusted(path: str, data: bytes, durable: bool = False) -> None:
    """Replace path with a file of data that trusted() takes: for root, CACHE_UID's, mode 0644
    (made by new_trusted, then named by link_trusted). All of it through one descriptor of the
    directory, which must not be a symlink. Raises OSError (nothing is replaced)."""
    directory, name = os.path.split(path)
    dir_fd = os.open(directory or ".", os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = new_trusted(dir_fd, data)
        try:
            if durable:
                os.fsync(fd)
            link_trusted(fd, dir_fd, name)
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


def new_trusted(dir_fd: int, data: bytes = b"") -> int:
    """A descriptor, open for writing, of a new file of data in dir_fd's directory that trusted()
    takes (for root, CACHE_UID's, mode 0644), still without a name: link_trusted gives it one.
    What is written through the descriptor later (a journal's lines) is as much the hook's.

    The file is made without a name (O_TMPFILE), written, and given its mode and owner before it
    has one: a file of root's, even for a moment, could be opened for writing by a uid 0 without
    capabilities, who would go on writing through that descriptor once the file was CACHE_UID's.
    Raises OSError: among them a filesystem without O_TMPFILE, and a root that may not chown (no
    CAP_CHOWN), whose file no reader would take."""
    from oci_gpu_hook.start.linux import userns

    fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fchmod(fd, 0o644)  # first: without CAP_FOWNER, root may not chmod CACHE_UID's file
        if os.geteuid() == 0 and not userns.unprivileged():
            os.fchown(fd, CACHE_UID, -1)
    except BaseException:
        os.close(fd)
        raise
    return fd


def link_trusted(fd: int, dir_fd: int, name: str) -> None:
    """Name the file of fd (new_trusted's) name in dir_fd's directory, replacing whatever is there
    (what the name is renamed over is never opened): linked under a new random name, then renamed.
    Raises OSError (nothing replaced)."""
    for _ in range(16):
        temporary = f".{name}.{os.urandom(6).hex()}.tmp"
        try:  # with a dir_fd, linkat(AT_SYMLINK_FOLLOW): how an O_TMPFILE file gets a name
            os.link(f"/proc/self/fd/{fd}", temporary, dst_dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
    else:
        raise OSError(errno.EEXIST, "no free temporary name", name)
    try:
        os.rename(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(temporary, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def _read_compiled(path: str, key) -> dict | None:
    if key is None:
        return None
    try:
        if not _trusted_directory(os.stat(RUN_DIR)):  # whoever may write it could rename our files around
            return None
        doc = jsonio.loads(read_trusted(compiled_path(path), MAX_CONFIG_BYTES))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("path") != path or doc.get("key") != key:
        return None
    return doc.get("settings") if isinstance(doc.get("settings"), dict) else None


def _write_compiled(path: str, key, data: dict) -> None:
    if key is None:
        return
    import json

    try:
        os.makedirs(RUN_DIR, mode=0o755, exist_ok=True)
        text = json.dumps({"path": path, "key": key, "settings": data})
        # Not durable: a compiled copy lost in a crash is rebuilt from the file on the next start.
        write_trusted(compiled_path(path), text.encode())
    except OSError:
        pass  # a read-only /run costs speed, not correctness


def read_config_file(path: str, what: str = "the configuration file") -> str:
    """A configuration file's text, at most MAX_CONFIG_BYTES. It decides what containers get (and
    the device plugin's, what the kubelet is told), so it must be root's (or this user's) and
    writable by no one else: checked on the descriptor that is read.

    In a user namespace (rootless podman runs its hooks in the user's) the host's root shows as
    the overflow uid, as every other user outside the namespace does, the host's nobody too: such
    a file is taken as root's only where every directory on the way to it is one that none but
    its owner may write and that shows as root's (the walk of mount sources, sources.HostSources),
    so not from /tmp or any directory others may write, where another user may have put it.
    What that cannot tell is a directory of another user's (or nobody's) that shows as root's
    (docs/security.md, rootless podman); install refuses to name a configuration in one."""

    from oci_gpu_hook.start.linux import userns

    # The host's root as this process sees it: the overflow uid in a user namespace (rootless podman).
    owners = (userns.root_uid(), os.geteuid())
    seen = []

    def check(st):
        if st.st_uid not in owners or st.st_mode & 0o022:
            whose = f"owned by uid {st.st_uid}" if st.st_uid not in owners else "writable by others"
            raise ConfigError(f"{path}: {what} is {whose}: it decides what containers get, so it must be root's "
                              "and writable by no one else")  # fmt: skip
        seen.append(st)

    try:
        raw = files.read_bounded(path, MAX_CONFIG_BYTES, regular=True, check=check)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read {what}: {e.strerror}") from None
    if userns.unprivileged() and seen[0].st_uid != os.geteuid():
        _check_way_in_a_user_namespace(path, what, seen[0])
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {what} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: {what} is not UTF-8 text") from None


def _check_way_in_a_user_namespace(path: str, what: str, read) -> None:
    """ConfigError unless the file that was read (its stat: read) is the one a walk through
    directories no one but root may change, as far as a user namespace can tell, reaches at path
    (sources.HostSources, the mount sources' walk: in a user namespace it crosses no directory
    others may write, sticky or not)."""
    from oci_gpu_hook.start.linux import sources

    walk = sources.HostSources()
    try:
        fd, walked = walk.open_stat(os.path.abspath(path), "file")
        os.close(fd)
    except sources.UntrustedSource as e:
        raise ConfigError(f"{path}: {what} is not root's as far as this user namespace can tell ({e.why}): the "
                          "host's root shows here as every other user outside it does, so root's file is taken "
                          "only from directories no one else may write") from None  # fmt: skip
    except OSError as e:
        raise ConfigError(f"{path}: cannot read {what}: {e.strerror}") from None
    finally:
        walk.close()
    if (walked.st_dev, walked.st_ino) != (read.st_dev, read.st_ino):
        raise ConfigError(f"{path}: {what} was replaced while it was read")


def load_yaml(text: str, where: str = "the document", libyaml: bool = True):
    """A YAML (or JSON) document as JSON's types only: mappings, lists, strings, numbers, booleans
    and null. Refused while it is parsed, before it is built, with a ConfigError naming where: past
    the bounds (check_document_size's, keys counted too, and mappings of at most MAX_LIST_ITEMS
    keys), or a key a mapping already has, which would silently replace the first. Refused with
    yaml.YAMLError: what is not YAML, merge keys (<<: older PyYAML expands them exponentially inside
    the parser) and the tags that build other types (binary, set, omap, pairs). A timestamp stays
    text.

    Bounds on a built document come too late: PyYAML took 5 to 38 s to build a 1 MiB flow list of
    half a million scalars. So each node is counted as it is composed, and the document stops
    there; libyaml parses (in C) where PyYAML has it, else (and with libyaml False, for the tests)
    PyYAML's own parser."""
    import yaml

    loader = _json_loader(libyaml)(text)
    loader.where = where
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        # libyaml's own bound (1000 deep), met while it looks ahead for a key: past ours too.
        if getattr(e, "problem", None) == "exceeded maximum nesting depth":
            raise too_large(where, TOO_DEEP) from None
        raise
    finally:
        loader.dispose()


_LOADERS = {}


def _json_loader(libyaml: bool):
    if libyaml in _LOADERS:
        return _LOADERS[libyaml]
    import yaml
    from yaml.composer import Composer
    from yaml.constructor import ConstructorError
    from yaml.events import AliasEvent
    from yaml.nodes import MappingNode, ScalarNode, SequenceNode

    refused = {f"tag:yaml.org,2002:{name}": f"{name} values are not accepted"
               for name in ("binary", "set", "omap", "pairs")}  # fmt: skip
    refused["tag:yaml.org,2002:merge"] = "merge keys (<<) are not accepted"
    parser = getattr(yaml, "CSafeLoader", yaml.SafeLoader) if libyaml else yaml.SafeLoader
    # With libyaml, Composer comes first, so that the compose_node below (in Python) composes and
    # not CParser's own, in C, which no bound can interrupt. SafeLoader is a Composer already.
    bases = (parser,) if issubclass(parser, Composer) else (Composer, parser)

    class JsonLoader(*bases):
        def __init__(self, text):
            parser.__init__(self, text)
            Composer.__init__(self)
            self.where = "the document"
            self.values = 0  # nodes composed, an alias counted as the nodes its anchor stands for
            self.depth = 0  # collections around the node being composed
            self.deepest = 0  # the depth of the deepest node composed inside the current one
            self.sizes = {}  # anchor: (nodes, height) of its node, once it is composed
            self.path = []  # keys and indices down to the node, for messages

        def count(self, nodes: int, height: int) -> None:
            self.values += nodes
            if self.values > MAX_DOCUMENT_VALUES:
                raise too_large(self.where, TOO_MANY_VALUES)
            if self.depth + height > MAX_DOCUMENT_DEPTH:
                raise too_large(self.where, TOO_DEEP)
            self.deepest = max(self.deepest, self.depth + height)

        def compose_node(self, parent, index):
            if isinstance(parent, SequenceNode) and index >= MAX_LIST_ITEMS:
                raise too_large(self.where, TOO_LONG)
            if isinstance(parent, MappingNode) and index is None and len(parent.value) >= MAX_LIST_ITEMS:
                raise too_large(self.where, TOO_WIDE)
            event = self.peek_event()
            if isinstance(event, AliasEvent):
                if event.anchor in self.anchors:  # else undefined, which the Composer reports
                    # Not in sizes: its node is still being composed and holds itself, endlessly.
                    self.count(*self.sizes.get(event.anchor, (MAX_DOCUMENT_VALUES + 1, 0)))
                return super().compose_node(parent, index)
            if event.tag in refused:  # refused before what it holds is composed: a bomb, maybe
                raise ConstructorError(None, None, refused[event.tag], event.start_mark)
            start, depth, deepest = self.values, self.depth, self.deepest
            self.deepest = depth
            self.count(1, 0)
            if parent is not None:  # a list's index, a mapping's key (a key's own nodes: "?")
                self.path.append(index if isinstance(parent, SequenceNode) else
                                 index.value if isinstance(index, ScalarNode) else "?")  # fmt: skip
            self.depth += 1
            node = super().compose_node(parent, index)
            self.depth = depth
            if node.tag in refused:  # an implicit one: a plain << key
                raise ConstructorError(None, None, refused[node.tag], node.start_mark)
            if isinstance(node, MappingNode):
                self.check_keys(node)
            if parent is not None:
                self.path.pop()
            if event.anchor is not None:
                self.sizes[event.anchor] = (self.values - start, self.deepest - depth)
            self.deepest = max(deepest, self.deepest)
            return node

        def check_keys(self, node) -> None:
            """Each key once, compared as the mapping will hold them (1, 1.0 and true are one)."""
            seen = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, ScalarNode):
                    continue  # a list or mapping as a key is refused when it is built: unhashable
                key = self.construct_object(key_node)
                if key in seen:
                    first, second = seen[key].start_mark.line + 1, key_node.start_mark.line + 1
                    lines = f"lines {first} and {second}" if first != second else f"both on line {first}"
                    name = key_path(self.path + [key_node.value])
                    name = name if len(name) <= 80 else name[:80] + "..."
                    raise ConfigError(f"{self.where}: key '{name}' appears twice ({lines})")
                seen[key] = key_node

    JsonLoader.add_constructor("tag:yaml.org,2002:timestamp", lambda loader, node: loader.construct_scalar(node))
    _LOADERS[libyaml] = JsonLoader
    return JsonLoader


def parse(text: str, path: str) -> Settings:
    return Settings.from_mapping(parse_mapping(text, path), path)


def parse_mapping(text: str, path: str) -> dict:
    """The validated mapping of a configuration file's text."""
    from oci_gpu_hook.start import with_site_packages

    with_site_packages()
    import yaml

    try:
        data = load_yaml(text, path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    except (ValueError, RecursionError) as e:  # an integer of thousands of digits; (a backstop) nesting
        raise ConfigError(f"{path}: not valid YAML: {load_problem(e)}") from None
    check_document_size(data, path)
    if data is None:
        data = {}
    if isinstance(data, dict) and data.get("cgroups") is False:
        data["cgroups"] = "off"  # YAML 1.1 reads an unquoted `off` as false; the user meant "off"
    validate(data, path)
    return data


# A configuration document is composed (with its YAML aliases counted as often as they are used,
# as every later check would walk them) only up to these bounds: a few hundred bytes of aliases can
# stand for billions of values, a deep nesting for more frames than the interpreter has, and 1 MiB
# of flow list for half a million values that take seconds to build.
MAX_DOCUMENT_VALUES = 100_000
MAX_DOCUMENT_DEPTH = 32
MAX_LIST_ITEMS = 1024  # a list's items, a mapping's keys
TOO_MANY_VALUES = f"more than {MAX_DOCUMENT_VALUES} values (YAML aliases counted as often as they are used)"
TOO_DEEP = f"nested more than {MAX_DOCUMENT_DEPTH} deep"
TOO_LONG = f"a list of more than {MAX_LIST_ITEMS} items"
TOO_WIDE = f"a mapping of more than {MAX_LIST_ITEMS} keys"


def too_large(path: str, what: str) -> ConfigError:
    return ConfigError(f"{path}: {what}; this is not a configuration")


def load_problem(error: Exception) -> str:
    if isinstance(error, RecursionError):
        return "nested too deeply"
    return str(error).split(";")[0]  # "Exceeds the limit (4300 digits) for integer string conversion..."


def check_document_size(data: object, path: str) -> None:
    """ConfigError when the document has more than MAX_DOCUMENT_VALUES values, a list or mapping of
    more than MAX_LIST_ITEMS, is nested more than MAX_DOCUMENT_DEPTH deep, or holds anything but
    JSON's types; an alias counts as often as it is used. load_yaml has stopped at these bounds
    already, while it parsed; this walks what it built, for what reaches here another way, before
    any check that could take longer (jsonschema's uniqueItems compares every pair of items)."""
    stack, count = [(data, 0)], 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_DOCUMENT_VALUES:
            raise too_large(path, TOO_MANY_VALUES)
        if depth > MAX_DOCUMENT_DEPTH:
            raise too_large(path, TOO_DEEP)
        if isinstance(value, (dict, list)) and len(value) > MAX_LIST_ITEMS:
            raise too_large(path, TOO_LONG if isinstance(value, list) else TOO_WIDE)
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif value is not None and not isinstance(value, (str, int, float)):
            raise ConfigError(f"{path}: a {type(value).__name__} value; only JSON's types are accepted")


def _schema(schema_path: str = SCHEMA_PATH) -> dict:
    import json

    with open(schema_path) as f:
        return json.load(f)


def validate(data: object, path: str, schema_path: str = SCHEMA_PATH) -> None:
    """ConfigError for the first mistake (by key) in a configuration document against its schema
    (the configuration file's unless another is named: the device plugin's)."""
    import jsonschema  # the callers have made the dependencies importable

    schema = _schema(schema_path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the configuration must be a mapping of keys to values")
    # Keys compared as text: a YAML document may have numbers for keys beside names.
    errors = sorted(
        jsonschema.Draft7Validator(schema).iter_errors(data), key=lambda e: [str(k) for k in e.absolute_path]
    )
    if errors:
        raise ConfigError(describe_error(errors[0], schema, path))


def key_path(keys) -> str:
    """flags.plugin.deviceListStrategy, resources[0].name: a document's keys as messages name them."""
    out = ""
    for key in keys:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


def describe_error(error, schema: dict, path: str) -> str:
    """One line: file, key, what is wrong and what is accepted; any document's, in the same words
    (the configuration file's, the device plugin's). Values are shown cut short, and a list or
    mapping by its kind: the document may be hostile."""
    keys = list(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        unknown = sorted(str(k) for k in error.instance if k not in allowed)
        return f"{path}: {key_path(keys + [unknown[0]])}: unknown key (accepted keys here: {', '.join(allowed)})"
    if error.validator == "required":
        missing = next(k for k in error.validator_value if k not in error.instance)
        accepted = _description(schema, keys + [missing])
        return f"{path}: {key_path(keys + [missing])}: missing (expected {accepted})"
    accepted = _description(schema, keys)
    import json

    if isinstance(error.instance, (dict, list)):
        value = "a mapping" if isinstance(error.instance, dict) else "a list"
    else:
        value = json.dumps(error.instance)
        value = value if len(value) <= 60 else value[:60] + "..."
    return f"{path}: {key_path(keys) or '(top level)'}: {value} is not accepted (expected {accepted})"


def _description(schema: dict, keys) -> str:
    node, described = schema, "a valid value"
    for key in keys:
        # A list item is described by its list ("a list of ...").
        node = node.get("items", {}) if isinstance(key, int) else node.get("properties", {}).get(key, {})
        described = node.get("description", described)
    return described
