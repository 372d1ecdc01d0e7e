"""`docker run` with and without `--gpus 1`, for `make bench`: Debian's dockerd started here
(tests/dockercheck.py, which puts back what it changes on the host however the runs end), with a
given nvidia-container-runtime-hook first on its PATH, and a busybox image of its own. Both cases
run `true` (`docker run --rm --network none ... IMAGE true`), in interleaved rounds after a warm-up
round.
"""

import os

import dockercheck

from oci_gpu_hook.toolkit import containers

IMAGE = "localhost/oci-gpu-hook-bench:1"


def samples(work: str, hook_program: str, runs: int, timed) -> dict:
    """{case: [timed's result of each run]} over runs rounds; work: a directory to make (dockerd's
    roots and socket); timed: bench/run.py's."""
    os.mkdir(work)
    with dockercheck.Dockerd(work, os.path.dirname(hook_program)) as daemon:
        image = daemon.import_image(containers.make_rootfs(os.path.join(work, "rootfs")), IMAGE)
        client = daemon.client
        cases = {"docker run": client.argv(*client.run_args(None), image, "true"),
                 "docker run --gpus 1": client.argv(*client.run_args("1"), image, "true")}  # fmt: skip
        found = {}
        for round_ in range(runs + 1):  # round 0 warms up and is not kept
            for name, argv in cases.items():
                result = timed(argv)
                if round_:
                    found.setdefault(name, []).append(result)
        return found
