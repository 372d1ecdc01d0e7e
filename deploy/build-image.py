#!/usr/bin/env python3
"""Build the node services' container image offline, from this machine's own files:
`make image`, or `deploy/build-image.py [--output FILE] [--name NAME]`.

No registry and no base image. The root is assembled from what is installed here:
- the host's python3 and its standard library (no tests, IDLE, tkinter or ensurepip);
- this project and its dependencies (with the `kubernetes` extra: grpcio, protobuf), installed
  by pip with `--target` into /usr/lib/oci-gpu-hook, from the index pip is configured with (a
  local one on the build machines);
- every shared library the interpreter and the extension modules need, as ldd resolves them on
  this machine, at the same paths;
- /usr/bin/oci-gpu-hook, the project's launcher (`python3 -IS`, the package's directory appended).

The result is a docker-archive tarball (`ctr images import`, `podman load`, `docker load`) named
localhost/oci-gpu-hook-node:<version>. Build it on the distribution and architecture the nodes
run (the interpreter and the libraries are this machine's). docs/deploy.md ("The node services
on Kubernetes") says how to roll it out with the manifests in deploy/kubernetes/.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from oci_gpu_hook.toolkit import containers, launcher  # noqa: E402

SITE = "/usr/lib/oci-gpu-hook"
SKIP = {"test", "tests", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages",
        "dist-packages", "__phello__"}  # fmt: skip


def version() -> str:
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        return next(line.split('"')[1] for line in f if line.startswith("version"))


def python_paths(python: str) -> tuple:
    """(the interpreter's real path, its major.minor, its standard library, its extension modules)."""
    probe = ("import sys, sysconfig; print(sys.executable); print('%d.%d' % sys.version_info[:2]); "
             "print(sysconfig.get_paths()['stdlib']); print(sysconfig.get_config_var('DESTSHARED'))")  # fmt: skip
    out = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True, check=True).stdout.split("\n")
    return os.path.realpath(out[0]), out[1], out[2], out[3]


def copy(source: str, root: str, target: str | None = None) -> None:
    """source (links followed) to the same path, or target, under root."""
    destination = os.path.join(root, (target or source).lstrip("/"))
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    shutil.copy2(os.path.realpath(source), destination)


def needed_libraries(path: str) -> set:
    """The shared libraries path needs, as this machine's loader resolves them (ldd)."""
    out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    found = set()
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) > parts.index("=>") + 1 and parts[parts.index("=>") + 1].startswith("/"):
            found.add(parts[parts.index("=>") + 1])
        elif parts and parts[0].startswith("/"):
            found.add(parts[0])  # the loader
    return found


def build(output: str, name: str, python: str) -> str:
    interpreter, short, stdlib, dynload = python_paths(python)
    running = "{}.{}".format(*sys.version_info[:2])
    if short != running:
        raise SystemExit(f"{python} is Python {short}, but pip runs on {running}: run this with {python}")
    with tempfile.TemporaryDirectory(prefix="oci-gpu-hook-image-") as work:
        root = os.path.join(work, "rootfs")
        for directory in ("etc", "tmp", "usr/bin", "proc", "sys", "dev", "run", "var/cache"):
            os.makedirs(os.path.join(root, directory), exist_ok=True)
        os.chmod(os.path.join(root, "tmp"), 0o1777)
        copy(interpreter, root, "/usr/bin/python3")
        shutil.copytree(stdlib, os.path.join(root, stdlib.lstrip("/")), symlinks=True,
                        ignore=lambda d, names: [n for n in names if n in SKIP])  # fmt: skip
        if not os.path.isdir(os.path.join(root, dynload.lstrip("/"))):
            shutil.copytree(dynload, os.path.join(root, dynload.lstrip("/")))
        site = os.path.join(root, SITE.lstrip("/"))
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "--target", site, f"{REPO}[kubernetes]"], check=True)  # fmt: skip
        programs = [interpreter] + [os.path.join(d, f) for top in (os.path.join(root, SITE.lstrip("/")),
                                                                    os.path.join(root, dynload.lstrip("/")))
                                    for d, _, files in os.walk(top) for f in files if ".so" in f]  # fmt: skip
        libraries = set()
        for program in programs:
            libraries |= needed_libraries(program)
        for library in sorted(libraries):
            copy(library, root)
        with open(os.path.join(root, "usr/bin/oci-gpu-hook"), "w") as f:
            f.write(launcher.text("/usr/bin/python3", SITE, note="# The node services' image (build-image.py).\n"))
        os.chmod(os.path.join(root, "usr/bin/oci-gpu-hook"), 0o755)
        with open(os.path.join(root, "etc/passwd"), "w") as f:
            f.write("root:x:0:0:root:/:/usr/sbin/nologin\n")
        with open(os.path.join(root, "etc/group"), "w") as f:
            f.write("root:x:0:\n")
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        containers.docker_archive(root, output, name, ["/usr/bin/oci-gpu-hook", "--help"])
    return output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=os.path.join(REPO, "build", "oci-gpu-hook-node.tar"))
    parser.add_argument("--name", default=f"localhost/oci-gpu-hook-node:{version()}")
    parser.add_argument("--python", default="/usr/bin/python3", help="the interpreter the image runs")
    args = parser.parse_args()
    print(build(args.output, args.name, args.python))
    return 0


if __name__ == "__main__":
    sys.exit(main())
