"""The exit statuses: one table in code (errors.Exit), the same in docs/cli.md, and every error
class of the package using one of them."""

import importlib
import os
import pkgutil
import re

import oci_gpu_hook
from oci_gpu_hook.errors import Exit, HookError

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "cli.md")


def test_the_docs_table_is_the_code_table():
    with open(DOCS) as f:
        rows = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", f.read(), re.M))
    assert {int(k): v for k, v in rows.items()} == Exit.MEANINGS


def test_every_error_class_exits_with_a_status_of_the_table():
    for module in pkgutil.walk_packages(oci_gpu_hook.__path__, "oci_gpu_hook."):
        if module.name.startswith("oci_gpu_hook.cli") or module.name.endswith("__main__"):
            continue
        importlib.import_module(module.name)
    errors = set()
    pending = [HookError]
    while pending:
        cls = pending.pop()
        errors.add(cls)
        pending.extend(cls.__subclasses__())
    assert len(errors) >= 14
    for cls in errors:
        assert cls.exit_code in Exit.MEANINGS and cls.exit_code not in (Exit.SUCCESS, Exit.INTERNAL), cls


def test_the_node_services_restart_status_is_in_the_table():
    """The exporter, the watchdog and the device plugin exit 75 when the driver's NVML library
    changed under them (nvml_reader.RESTART): a status the program uses, so it is in the table
    and in docs/cli.md with the others."""
    from oci_gpu_hook.node.nvml_reader import RESTART

    assert Exit.MEANINGS.get(RESTART, "").startswith("a node service stops to be started again")
