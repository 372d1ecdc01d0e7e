"""CRI-O for tests: its programs, built by ../shared/tools/crio/build.sh on first use (about 2
minutes on 2 cores, cached per machine), and what `crio config` says a configuration tree means."""

from __future__ import annotations

import os
import subprocess

from kubeletcheck import shared_tool

from oci_gpu_hook.toolkit import runtime_config


def programs() -> str:
    """The directory holding crio, pinns and crictl."""
    return shared_tool("crio", os.environ.get("CRIO_CACHE") or "/var/cache/oci-gpu-hook-crio")


def config(root: str, *options: str) -> dict:
    """The configuration CRI-O merges from crio.conf and crio.conf.d under root, as `crio config`
    prints it (parsed)."""
    crio = os.path.join(programs(), "crio")
    conf = root + runtime_config.CRIO_CONF
    # An absent crio.conf is CRI-O's defaults; named on the command line, it would be an error.
    done = subprocess.run([crio, "--config", conf if os.path.exists(conf) else "", "--config-dir",
                           root + runtime_config.CRIO_DROPIN_DIR, "config", *options], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return runtime_config.load_toml(done.stdout)


def hooks_dirs(root: str) -> list:
    """The hooks directories CRI-O reads: `crio config` leaves out (comments) a value that is the
    default, which `crio config --default` then prints."""
    runtime = config(root)["crio"]["runtime"]
    return runtime["hooks_dir"] if "hooks_dir" in runtime else config(root, "--default")["crio"]["runtime"]["hooks_dir"]
