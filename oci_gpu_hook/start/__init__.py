"""The start path: the code that runs on every container start. Standard library only.

The pipeline, in the order a start goes through it:
    state (OCI state on stdin) -> spec (bundle/config.json) -> request (what the container asks
    for; pure) -> inventory (what the host offers: inventory_cache, or discover on a miss) ->
    plan (ordered operations; pure) -> apply (in the container's mount namespace, with undo) ->
    report (one line for the runtime, a record for the log).
prestart.py runs it; ldcache_refresh.py is the CDI spec's createContainer hook. linux/ holds the
mechanisms, which carry no policy: syscalls, the rootfs by descriptors, cgroups, bpf, labels, the
confined ldconfig and the undo journal.

Nothing here imports from toolkit/, node/ or cli/ (tests/test_layout.py enforces it).
"""


def with_site_packages() -> None:
    """Make the installed dependencies importable. The launcher (toolkit/launcher.py) starts
    Python without site (-S), which a start needs only rarely: YAML and jsonschema once after the
    configuration changed (settings.py), and the CLI's commands always (hook.py)."""
    import sys

    if sys.flags.no_site and "site" not in sys.modules:
        import site

        site.main()
