"""NVIDIA_VISIBLE_DEVICES read as libnvidia-container reads it (its CLI's select_devices), form by
form: each accepted form with the devices it selects, each refused one with its reason.

The host is test_plan.py's literal inventory: GPUs 0, 1 and 2 at PCI 0000:07:00.0, 0000:3b:00.0 and
0000:af:00.0; GPU 1 in MIG mode with MIG devices 1:0 and 1:1. A selected device is (GPU index,
MIG index or None). Where we differ from NVIDIA on purpose, the case says why.
"""

import re

import pytest
from test_plan import container, gpu_uuid, mig_uuid, no_file_system, plan_for, selected

from oci_gpu_hook.errors import RequestError
from oci_gpu_hook.start.request import parse_request
from oci_gpu_hook.start.settings import Settings

EVERYTHING = [(0, None), (1, None), (2, None), (1, 0), (1, 1)]

ACCEPTED = [
    # indices (strtoumax: leading zeros and a '+' are read as NVIDIA reads them)
    ("0", [(0, None)]),
    ("2", [(2, None)]),
    ("00", [(0, None)]),
    ("+1", [(1, None)]),
    ("2,0", [(2, None), (0, None)]),  # the order asked for
    ("0,0,0", [(0, None)]),  # duplicates collapse
    (",0,,2,", [(0, None), (2, None)]),  # empty entries are tolerated
    (" 0 , 2 ", [(0, None), (2, None)]),  # spaces around ids (NVIDIA refuses a trailing one)
    # GPU UUIDs, any case
    (gpu_uuid(1), [(1, None)]),
    (gpu_uuid(1).upper(), [(1, None)]),
    (gpu_uuid(1).lower(), [(1, None)]),  # gpu-<uuid>: NVIDIA compares the prefix case-insensitively
    ("Gpu-" + gpu_uuid(2)[4:], [(2, None)]),
    # PCI bus ids, with or without leading zeros in each field
    ("0000:3b:00.0", [(1, None)]),
    ("00000000:3b:00.0", [(1, None)]),  # NVML's 8-digit domain
    ("0:3b:0.0", [(1, None)]),
    ("0:7:0.0", [(0, None)]),
    ("000:07:0.0", [(0, None)]),
    ("0000:AF:00.0", [(2, None)]),
    ("3b:00.0", [(1, None)]),  # no domain: 0000 (NVIDIA needs the domain; we also take this short form)
    # MIG devices: <gpu>:<mig>, MIG UUIDs (any case), the pre-R470 MIG-GPU-<uuid>/<gi>/<ci>
    ("1:0", [(1, 0)]),
    ("1:1", [(1, 1)]),
    ("01:+1", [(1, 1)]),
    ("1:0,1:1,1:0", [(1, 0), (1, 1)]),
    (mig_uuid(2, 1), [(1, 1)]),
    (mig_uuid(2, 1).lower(), [(1, 1)]),
    ("mig-" + mig_uuid(2, 0)[4:].upper(), [(1, 0)]),
    (f"MIG-{gpu_uuid(1)}/2/0", [(1, 1)]),
    ("1,1:0", [(1, None), (1, 0)]),  # the whole GPU and one of its MIG devices
    # all: every GPU and every MIG device, in any case; it ends the list
    ("all", EVERYTHING),
    ("ALL", EVERYTHING),
    ("All", EVERYTHING),
    ("2,all", [(2, None), (0, None), (1, None), (1, 0), (1, 1)]),  # what came first keeps its place
    ("all,99", EVERYTHING),  # NVIDIA stops at "all": what follows is not read
    ("all,not a device", EVERYTHING),
    # none: the driver but no GPU
    ("none", []),
]

REFUSED = [
    ("3", "=3: no GPU 3 (this host has GPUs 0-2 and MIG devices 1:0-1:1)"),  # no GPU 3
    ("99,all", "=99,all: no GPU 99 "),  # read before "all", as NVIDIA reads it
    ("1:2", "no MIG device 1:2 "),  # GPU 1 has two MIG devices
    ("0:0", "no MIG device 0:0 "),  # GPU 0 is not in MIG mode
    ("-1", "unknown device"),
    ("1.0", "unknown device"),
    ("GPU-", "unknown device"),
    ("GPU-00000000-0000-0000-0000-000000000000", "no GPU GPU-00000000-0000-0000-0000-000000000000 "),  # no such GPU
    ("MIG-00000000-0000-0000-0000-000000000000", "no MIG device MIG-00000000-"),
    ("0000:d8:00.0", "no GPU at PCI 0000:d8:00.0 "),  # no GPU at that address
    # 0:3b:00.1 is a function with no GPU. NVIDIA's sscanf stops at the function and would select
    # 3b:00.0; we do not give a GPU for an address that is not its own.
    ("0:3b:00.1", "no GPU at PCI 0:3b:00.1 "),
    # Trailing text after a bus id or an index: NVIDIA's sscanf ignores it; we refuse it.
    ("0:7:0.0junk", "unknown device"),
    ("0x1", "unknown device"),
    ("0:7:0", "unknown device"),
    ("123456789:07:00.0", "unknown device"),  # 9-digit domain
    ("0:107:00.0", "unknown device"),  # 3-digit bus
    ("GPU-../../etc", "unknown device"),
    ("/dev/nvidia0", "unknown device"),
]


@pytest.mark.parametrize("value, expected", ACCEPTED, ids=[v for v, _ in ACCEPTED])
def test_accepted(value, expected):
    with no_file_system():
        plan = plan_for(value)
    assert selected(plan) == expected


@pytest.mark.parametrize("value, reason", REFUSED, ids=[v for v, _ in REFUSED])
def test_refused(value, reason):
    with no_file_system(), pytest.raises(RequestError, match=re.escape(reason)) as e:
        plan_for(value)
    assert "\n" not in e.value.message


@pytest.mark.parametrize("value", ["void", "", " ", ",", "0,void"])
def test_no_gpu_container(value):
    """void, or nothing: not a GPU container at all (no plan)."""
    with no_file_system():
        assert parse_request(container({"NVIDIA_VISIBLE_DEVICES": value}), Settings()) is None
