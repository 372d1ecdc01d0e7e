"""cgroup v2 device programs: instruction encoding (pure), and real bpf(2) on real cgroups (root).

The root tests put a child process into a fresh cgroup v2 directory and open device nodes made with
mknod. Major 195 (NVIDIA's) has no driver on a GPU-free machine, so an allowed open fails with
ENXIO and a denied one with EPERM: the device program's decision is visible without a GPU.
"""

import errno
import json
import os
import stat
import struct
import subprocess
import sys
import uuid

import pytest
from hookcheck import remove_cgroup

from oci_gpu_hook.start.linux import bpf, cgroups
from oci_gpu_hook.start.linux.bpf import BPF_F_ALLOW_MULTI, Insn
from oci_gpu_hook.start.linux.cgroups import CgroupError

# ------------------------------------------------------------------------------------------------
# Pure: encoding, the allow blocks' meaning, reuse checks.

DENY_ALL = [bpf.mov64_imm(bpf.R0, 0), bpf.exit_insn()]


def allow_one(major: int, minor: int) -> list:
    """A runc-like program: allow char major:minor (any access), deny the rest. Its deny ends in a
    two-slot ld_imm64, and its jumps skip several instructions, so a prefix that broke relative
    jumps or instruction boundaries would show."""
    return [
        bpf.ldx_w(bpf.R2, bpf.R1, 0),
        bpf.alu64_imm(bpf.BPF_AND, bpf.R2, 0xFFFF),
        bpf.jmp_imm(bpf.BPF_JNE, bpf.R2, bpf.BPF_DEVCG_DEV_CHAR, 6),
        bpf.ldx_w(bpf.R3, bpf.R1, 4),
        bpf.jmp_imm(bpf.BPF_JNE, bpf.R3, major, 4),
        bpf.ldx_w(bpf.R3, bpf.R1, 8),
        bpf.jmp_imm(bpf.BPF_JNE, bpf.R3, minor, 2),
        bpf.mov64_imm(bpf.R0, 1),
        bpf.exit_insn(),
        Insn(bpf.LD_IMM64, bpf.R0, 0, 0, 0),  # deny: r0 = 0 (64-bit immediate, two slots)
        Insn(0, 0, 0, 0, 0),
        bpf.exit_insn(),
    ]


def encode(insns) -> bytes:
    return b"".join(i.encode() for i in insns)


def run(program: bytes, access: str, major: int, minor: int, dev_type: int = bpf.BPF_DEVCG_DEV_CHAR) -> int:
    """A tiny interpreter for the instructions these programs use: the verdict (0 deny, 1 allow)."""
    ctx = {0: dev_type | (bpf.access_mask(access) << 16), 4: major, 8: minor}
    insns = bpf.decode(program)
    regs = {bpf.R1: "ctx"}
    pc = 0
    while True:
        i = insns[pc]
        pc += 1
        cls, op = i.code & 7, i.code & 0xF0
        if cls in (bpf.BPF_ALU64, bpf.BPF_JMP):
            operand = regs[i.src] if i.code & bpf.BPF_X else i.imm & 0xFFFFFFFFFFFFFFFF
        if i.code == bpf.LDX_MEM_W:
            assert regs[i.src] == "ctx"
            regs[i.dst] = ctx[i.off]
        elif i.code == bpf.LD_IMM64:
            regs[i.dst] = (i.imm & 0xFFFFFFFF) | (insns[pc].imm << 32)
            pc += 1
        elif cls == bpf.BPF_ALU64:
            ops = {bpf.BPF_MOV: lambda a, b: b, bpf.BPF_AND: lambda a, b: a & b, bpf.BPF_RSH: lambda a, b: a >> b}
            regs[i.dst] = ops[op](regs.get(i.dst), operand)
        elif i.code == bpf.BPF_JMP | bpf.BPF_EXIT:
            return regs[bpf.R0]
        elif cls == bpf.BPF_JMP:
            taken = {
                bpf.BPF_JA: lambda a, b: True,
                bpf.BPF_JNE: lambda a, b: a != b,
                bpf.BPF_JSET: lambda a, b: a & b != 0,
            }[op](regs.get(i.dst), operand)
            if taken:
                pc += i.off
        else:
            raise AssertionError(f"unexpected instruction {i}")


def test_encoding_matches_the_kernel_abi():
    assert bpf.mov64_imm(bpf.R0, 1).encode() == bytes.fromhex("b700000001000000")
    assert bpf.exit_insn().encode() == bytes.fromhex("9500000000000000")
    # dst in the low nibble, src in the high one; little-endian off and imm.
    assert bpf.ldx_w(bpf.R2, bpf.R1, 4).encode() == bytes.fromhex("6112040000000000")
    assert bpf.jmp_imm(bpf.BPF_JNE, bpf.R4, 195, 4).encode() == bytes.fromhex("550404 00c3000000".replace(" ", ""))
    assert bpf.jmp_imm(bpf.BPF_JSET, bpf.R2, -3, 2).encode() == bytes.fromhex("45020200fdffffff")
    assert bpf.mov64_reg(bpf.R3, bpf.R2).encode() == bytes.fromhex("bf23000000000000")


def test_decode_round_trip():
    insns = allow_one(195, 3)
    assert bpf.decode(encode(insns)) == insns
    with pytest.raises(CgroupError, match="not a whole number"):
        bpf.decode(b"\0" * 9)


def test_allow_prefix_layout():
    prefix = bpf.decode(bpf.allow_prefix([(195, 0, "rw"), (195, 255, "rwm")]))
    assert len(prefix) == len(bpf.PROLOGUE) + 2 * bpf.BLOCK_LEN
    assert all(i.dst != bpf.R1 for i in prefix)  # the old program needs its context pointer
    # Every jump of a block lands exactly on the next block (or the old program's first insn).
    for b in range(2):
        start = len(bpf.PROLOGUE) + b * bpf.BLOCK_LEN
        for pc in range(start, start + bpf.BLOCK_LEN):
            if prefix[pc].code & 0x07 == bpf.BPF_JMP and prefix[pc].code != bpf.BPF_JMP | bpf.BPF_EXIT:
                assert pc + 1 + prefix[pc].off == start + bpf.BLOCK_LEN


@pytest.mark.parametrize(
    "access, major, minor, dev_type, verdict",
    [
        ("r", 195, 0, bpf.BPF_DEVCG_DEV_CHAR, 1),
        ("w", 195, 0, bpf.BPF_DEVCG_DEV_CHAR, 1),
        ("rw", 195, 0, bpf.BPF_DEVCG_DEV_CHAR, 1),
        ("m", 195, 0, bpf.BPF_DEVCG_DEV_CHAR, 0),  # access beyond the allowed "rw"
        ("rwm", 195, 0, bpf.BPF_DEVCG_DEV_CHAR, 0),
        ("rw", 195, 0, bpf.BPF_DEVCG_DEV_BLOCK, 0),  # same numbers, block device
        ("rw", 195, 1, bpf.BPF_DEVCG_DEV_CHAR, 0),
        ("rw", 194, 0, bpf.BPF_DEVCG_DEV_CHAR, 0),
        ("m", 195, 255, bpf.BPF_DEVCG_DEV_CHAR, 1),
        ("r", 1, 3, bpf.BPF_DEVCG_DEV_CHAR, 1),  # falls through into the old program, which allows
        ("r", 1, 5, bpf.BPF_DEVCG_DEV_CHAR, 0),
    ],
)
def test_prefix_semantics(access, major, minor, dev_type, verdict):
    program = bpf.allow_prefix([(195, 0, "rw"), (195, 255, "rwm")]) + encode(allow_one(1, 3))
    assert run(program, access, major, minor, dev_type) == verdict


def test_old_program_alone_unchanged_by_interpreter():
    assert run(encode(allow_one(1, 3)), "rw", 1, 3) == 1
    assert run(encode(allow_one(1, 3)), "rw", 195, 0) == 0


@pytest.mark.parametrize("access", ["", "x", "rr", "R"])
def test_bad_access(access):
    with pytest.raises(CgroupError, match="not a combination"):
        bpf.allow_prefix([(195, 0, access)])


@pytest.mark.parametrize("major, minor", [(-1, 0), (4096, 0), (195, 1 << 20)])
def test_bad_device_number(major, minor):
    with pytest.raises(CgroupError, match="not a valid device number"):
        bpf.allow_prefix([(major, minor, "rw")])


def test_check_reusable():
    bpf.check_reusable(allow_one(195, 3))  # the ld_imm64's second half is not an instruction
    with pytest.raises(CgroupError, match="calls a helper"):
        bpf.check_reusable([Insn(bpf.BPF_JMP | bpf.BPF_CALL, imm=15), *DENY_ALL])
    with pytest.raises(CgroupError, match="map or other kernel object"):
        bpf.check_reusable([Insn(bpf.LD_IMM64, bpf.R2, 1, 0, 7), Insn(0), *DENY_ALL])
    with pytest.raises(CgroupError, match="register r11"):
        bpf.check_reusable([Insn(bpf.BPF_ALU64 | bpf.BPF_MOV | bpf.BPF_K, 11, 0, 0, 5), *DENY_ALL])


# ------------------------------------------------------------------------------------------------
# Root: real programs on a fresh cgroup.

PROBE = r"""
import errno, json, os, sys
cgroup, ops = sys.argv[1], json.loads(sys.argv[2])
with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
results = []
for op, path, major, minor in ops:
    try:
        if op == "m":
            os.mknod(path, 0o600 | 0o020000, os.makedev(major, minor))
            os.unlink(path)
        else:
            os.close(os.open(path, {"r": os.O_RDONLY, "w": os.O_WRONLY, "rw": os.O_RDWR}[op]))
        results.append("ok")
    except OSError as e:
        results.append(errno.errorcode[e.errno])
print(json.dumps(results))
"""


@pytest.fixture
def cgroup2_root(require):
    require("root")
    with open("/proc/self/mountinfo") as f:
        root = cgroups.v2_path("0::/\n", f.read())
    assert root, "no cgroup2 mount"
    return root


@pytest.fixture
def cgroup(cgroup2_root):
    """A fresh, empty cgroup v2 directory, removed (with anything attached) at the end."""
    path = os.path.join(cgroup2_root, f"oci-gpu-hook-test-{uuid.uuid4().hex[:12]}")
    os.mkdir(path)
    yield path
    for sub in sorted((e.path for e in os.scandir(path) if e.is_dir()), reverse=True):
        os.rmdir(sub)
    remove_cgroup(path)  # a just-reaped child may take a moment to leave the cgroup


@pytest.fixture
def nodes(tmp_path):
    """char 195:0..2 device nodes; a probe child tries them from inside the cgroup."""
    assert not os.statvfs(tmp_path).f_flag & os.ST_NODEV, f"{tmp_path} is mounted nodev"
    for minor in range(3):
        os.mknod(tmp_path / f"nv{minor}", 0o600 | stat.S_IFCHR, os.makedev(195, minor))
    return tmp_path


def probe(cgroup: str, nodes, *ops) -> list:
    """Results ("ok", "ENXIO", "EPERM", ...) of ops like ("rw", 0) = open nodes/nv0 O_RDWR, or
    ("m", 2) = mknod a new char 195:2, from a process inside cgroup."""
    spec = [[op, str(nodes / (f"nv{minor}" if op != "m" else f"new{minor}")), 195, minor] for op, minor in ops]
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, cgroup, json.dumps(spec)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def attach(cgroup: str, insns, flags: int = BPF_F_ALLOW_MULTI) -> None:
    fd = bpf.load_program(encode(insns))
    cg = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        bpf.attach_program(cg, fd, flags)
    finally:
        os.close(cg)
        os.close(fd)  # the cgroup holds the program now


def attached(cgroup: str):
    cg = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return bpf.query_programs(cg)
    finally:
        os.close(cg)


ALL = (("rw", 0), ("rw", 1), ("rw", 2))


def test_allow_then_undo(cgroup, nodes):
    attach(cgroup, DENY_ALL)  # runc attaches with BPF_F_ALLOW_MULTI
    original = attached(cgroup)
    assert probe(cgroup, nodes, *ALL) == ["EPERM"] * 3

    undo = bpf.allow_devices(cgroup, [(195, 0, "rw")])
    assert undo.changed
    flags, ids = attached(cgroup)
    assert flags == original[0] and len(ids) == 1 and ids != original[1]
    assert probe(cgroup, nodes, *ALL) == ["ENXIO", "EPERM", "EPERM"]  # ENXIO: allowed, no driver

    undo.undo()
    assert attached(cgroup) == original
    assert probe(cgroup, nodes, *ALL) == ["EPERM"] * 3
    undo.undo()  # a second undo has nothing left to do


def test_access_is_limited_to_what_is_asked(cgroup, nodes):
    attach(cgroup, DENY_ALL)
    undo = bpf.allow_devices(cgroup, [(195, 0, "r")])
    try:
        assert probe(cgroup, nodes, ("r", 0), ("w", 0), ("rw", 0), ("m", 0)) == ["ENXIO", "EPERM", "EPERM", "EPERM"]
    finally:
        undo.undo()  # closes its descriptors too
    undo = bpf.allow_devices(cgroup, [(195, 0, "rwm"), (195, 2, "w")])
    try:
        assert probe(cgroup, nodes, ("rw", 0), ("m", 0), ("w", 2), ("r", 2), ("m", 2)) == [
            "ENXIO", "ok", "ENXIO", "EPERM", "EPERM"]  # fmt: skip
    finally:
        undo.undo()  # closes its descriptors too


def test_two_programs_are_both_extended(cgroup, nodes):
    attach(cgroup, allow_one(195, 1))
    attach(cgroup, DENY_ALL)
    original = attached(cgroup)
    assert len(original[1]) == 2
    assert probe(cgroup, nodes, *ALL) == ["EPERM"] * 3  # 195:1: the deny-all program says no

    undo = bpf.allow_devices(cgroup, [(195, 0, "rw")])
    flags, ids = attached(cgroup)
    assert flags == BPF_F_ALLOW_MULTI and len(ids) == 2 and not set(ids) & set(original[1])
    assert probe(cgroup, nodes, *ALL) == ["ENXIO", "EPERM", "EPERM"]
    undo.undo()
    assert attached(cgroup) == original  # same programs, same order
    assert probe(cgroup, nodes, *ALL) == ["EPERM"] * 3


@pytest.mark.parametrize("flags", [0, bpf.BPF_F_ALLOW_OVERRIDE])
def test_single_program_mode_keeps_the_old_rules(cgroup, nodes, flags):
    attach(cgroup, allow_one(195, 1), flags)
    original = attached(cgroup)
    assert original[0] == flags
    assert probe(cgroup, nodes, *ALL) == ["EPERM", "ENXIO", "EPERM"]

    undo = bpf.allow_devices(cgroup, [(195, 0, "rw")])
    assert attached(cgroup)[0] == flags
    assert probe(cgroup, nodes, *ALL) == ["ENXIO", "ENXIO", "EPERM"]  # the old program still allows 195:1
    undo.undo()
    assert attached(cgroup) == original
    assert probe(cgroup, nodes, *ALL) == ["EPERM", "ENXIO", "EPERM"]


@pytest.mark.parametrize("fail_at", [1, 2])
def test_failure_midway_rolls_back(cgroup, nodes, monkeypatch, fail_at):
    attach(cgroup, DENY_ALL)
    attach(cgroup, DENY_ALL)
    original = attached(cgroup)
    real_replace, calls = bpf._replace, []

    def replace(*args):
        calls.append(args)
        if len(calls) == fail_at:  # after the extended programs are loaded (and, at 2, one attached)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_replace(*args)

    monkeypatch.setattr(bpf, "_replace", replace)
    fds_before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(CgroupError, match=r"cannot attach the extended device program: Input/output error$"):
        bpf.allow_devices(cgroup, [(195, 0, "rw")])
    assert len(calls) == 2 * fail_at - 1  # the attaches, then the rollback of those that succeeded
    assert attached(cgroup) == original
    assert probe(cgroup, nodes, *ALL) == ["EPERM"] * 3
    assert set(os.listdir("/proc/self/fd")) == fds_before  # no fd leaked


def test_no_program_means_nothing_to_do(cgroup, nodes):
    undo = bpf.allow_devices(cgroup, [(195, 0, "rw")])
    assert not undo.changed
    assert attached(cgroup) == (0, [])
    assert probe(cgroup, nodes, ("rw", 0)) == ["ENXIO"]
    undo.undo()


def test_filter_in_an_ancestor_is_refused(cgroup, nodes):
    attach(cgroup, DENY_ALL)
    child = os.path.join(cgroup, "child")
    os.mkdir(child)
    with pytest.raises(CgroupError, match="filtered by an ancestor"):
        bpf.allow_devices(child, [(195, 0, "rw")])
    assert attached(child) == (0, [])


def test_program_with_a_helper_call_is_left_alone(cgroup, nodes):
    bpf_func_get_current_uid_gid = 15
    attach(cgroup, [Insn(bpf.BPF_JMP | bpf.BPF_CALL, imm=bpf_func_get_current_uid_gid), *DENY_ALL])
    original = attached(cgroup)
    with pytest.raises(CgroupError, match="calls a helper"):
        bpf.allow_devices(cgroup, [(195, 0, "rw")])
    assert attached(cgroup) == original


def test_verifier_rejection_is_one_line(require):
    require("root")
    with pytest.raises(CgroupError, match="verifier rejected") as e:
        bpf.load_program(encode([bpf.exit_insn()]))  # r0 never set
    assert "\n" not in str(e.value)


def test_missing_cgroup(cgroup2_root):
    with pytest.raises(CgroupError, match="cannot open the cgroup: No such file"):
        bpf.allow_devices(os.path.join(cgroup2_root, "no-such-cgroup-here"), [(195, 0, "rw")])


def test_a_runc_sized_program_is_extended_with_one_load(cgroup, monkeypatch):
    """allow_devices is on every GPU container's start path: 8 GPUs + 4 control devices, on top of
    a runc-sized program (a dozen rules), cost one program load per attached program, on the
    verifier's fast path (no log, no retry), of the old program plus one block per device; undone,
    the next start extends the original again, not the last extension. (How long it takes is the
    bench's to measure, not a test's to assert.)"""
    runc_rules = [(1, minor, "rwm") for minor in (3, 5, 7, 8, 9)] + [(5, minor, "rwm") for minor in range(7)]
    rules = bpf.allow_prefix(runc_rules)
    attach(cgroup, bpf.decode(rules) + DENY_ALL)
    original = attached(cgroup)
    (old_id,) = original[1]
    old_fd = bpf.prog_fd_by_id(old_id)
    try:
        old_length = len(bpf.read_program(old_fd))
    finally:
        os.close(old_fd)
    control = [(195, 255, "rw"), (195, 254, "rw"), (511, 0, "rw"), (511, 1, "rw")]
    gpus = [(195, minor, "rw") for minor in range(8)] + control
    loads = []  # (instructions, log level) of every BPF_PROG_LOAD
    real_bpf = bpf._linux.bpf

    def counting_bpf(cmd, attr, what="bpf"):
        if cmd == bpf.BPF_PROG_LOAD:
            _type, insn_cnt, _insns, _license, log_level = struct.unpack_from("<IIQQI", attr)
            loads.append((insn_cnt, log_level))
        return real_bpf(cmd, attr, what)

    monkeypatch.setattr(bpf._linux, "bpf", counting_bpf)
    extended = len(bpf.PROLOGUE) + len(gpus) * bpf.BLOCK_LEN + old_length
    for start in range(3):
        loads.clear()
        undo = bpf.allow_devices(cgroup, gpus)
        assert loads == [(extended, 0)], f"start {start}"
        flags, ids = attached(cgroup)
        assert flags == original[0] and len(ids) == 1 and ids != original[1]  # replaced, not added
        undo.undo()
        assert attached(cgroup) == original


def test_instructions_withheld_without_privilege(run_as_nobody):
    """Without CAP_BPF/CAP_SYS_ADMIN the kernel reports a length of 0 instead of the instructions."""
    fd = bpf.load_program(encode(DENY_ALL))
    code = f"from oci_gpu_hook.start.linux import bpf\nbpf.read_program({fd})\n"
    try:
        proc = run_as_nobody(["-c", code], pass_fds=[fd], capture_output=True, text=True, timeout=60)
    finally:
        os.close(fd)
    assert proc.returncode == 1
    assert "CgroupError: the kernel withholds BPF program" in proc.stderr
