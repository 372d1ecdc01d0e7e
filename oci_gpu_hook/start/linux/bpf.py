"""cgroup v2 device access: extend the cgroup's eBPF device programs so they allow our devices.

On cgroup v2 there are no devices.allow files: a BPF_PROG_TYPE_CGROUP_DEVICE program attached to
the cgroup decides every open()/mknod() of a device node (return 1 allows, 0 gives EPERM). The
runtime (runc, crun, systemd) attached one when it created the container's cgroup. Like NVIDIA's
stack we cannot edit a loaded program, so for each program attached to the cgroup we:

  1. read its instructions back from the kernel (BPF_OBJ_GET_INFO_BY_FD, xlated_prog_insns),
  2. load a new program = our allow blocks + the old instructions,
  3. attach the new program in place of the old one (BPF_F_REPLACE: atomic, same position).

Decisions (the reasons are in the comments where they apply):

- Every program attached to the cgroup is extended, not just one. With BPF_F_ALLOW_MULTI (runc,
  systemd) all of them must allow an access, so extending one would not be enough; attaching an
  extra allow-only program would not help either.
- Each allow block returns 1 on a match and otherwise falls through into the next block and
  finally into the old program, unchanged: the old program keeps deciding everything else.
- Only the cgroup's own programs are changed, never an ancestor's. If the cgroup has none of its
  own but an ancestor's program filters it, we raise rather than attach an allow-only program:
  under a parent attached with BPF_F_ALLOW_OVERRIDE that would lift all of the parent's rules.
  If nothing filters the cgroup at all, every device is already allowed: nothing is done.
- An old program is reused only if its instructions can be loaded again as they are: no helper or
  function calls (their immediates are rewritten into kernel addresses in the dump), no map or
  other kernel-object references, no register beyond r10 (constant blinding's hidden register,
  net.core.bpf_jit_harden=2). runc's and systemd's device programs use none of these.
- Any failure rolls back what was done (the original programs are attached again) and raises a
  CgroupError with a one-line message; Undo.undo() restores the original attachment exactly.

Limits: a runtime that later re-applies its own rules (runc update, systemctl daemon-reload for
systemd-managed units) attaches programs without the GPU nodes and the container loses the access;
for systemd's scopes the hook tells systemd the nodes too (systemd.py, called by apply.py), so its
re-applied program has them. Programs attached through a bpf_link cannot be replaced this way: the
kernel refuses, and we roll back and say so.

bpf(2)'s number comes from arch.py (x86_64 and aarch64). The struct layouts and the instruction
encoding are the same on both: little-endian, 64-bit fields 8-aligned (__aligned_u64).
"""

from __future__ import annotations

import errno
import os
import struct

from oci_gpu_hook.start.linux import _linux
from oci_gpu_hook.start.linux.cgroups import CgroupError

# bpf(2) commands.
BPF_PROG_LOAD = 5
BPF_PROG_ATTACH = 8
BPF_PROG_DETACH = 9
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_PROG_QUERY = 16

BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6  # attach type

# Attach flags. A cgroup's programs of one attach type share one mode: none (single program, no
# sub-cgroup may attach), ALLOW_OVERRIDE (single, a sub-cgroup's program replaces it) or
# ALLOW_MULTI (a list; every program of the cgroup and of its ancestors must allow).
BPF_F_ALLOW_OVERRIDE = 1
BPF_F_ALLOW_MULTI = 2
BPF_F_REPLACE = 4
BPF_F_QUERY_EFFECTIVE = 1

# struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }: access_type's low 16 bits
# are the device type, its high 16 bits the access asked for.
CTX_ACCESS_TYPE = 0
CTX_MAJOR = 4
CTX_MINOR = 8
BPF_DEVCG_DEV_BLOCK = 1
BPF_DEVCG_DEV_CHAR = 2
BPF_DEVCG_ACC_MKNOD = 1
BPF_DEVCG_ACC_READ = 2
BPF_DEVCG_ACC_WRITE = 4
ACCESS_BITS = {"m": BPF_DEVCG_ACC_MKNOD, "r": BPF_DEVCG_ACC_READ, "w": BPF_DEVCG_ACC_WRITE}

# Instruction opcodes: class | size/op | mode/source.
BPF_LD, BPF_LDX, BPF_ST, BPF_STX, BPF_ALU, BPF_JMP, BPF_JMP32, BPF_ALU64 = range(8)
BPF_W = 0x00  # 32-bit load
BPF_DW = 0x18  # 64-bit (only in ld_imm64)
BPF_IMM = 0x00
BPF_MEM = 0x60
BPF_K = 0x00  # operand is the immediate
BPF_X = 0x08  # operand is src_reg
BPF_AND = 0x50
BPF_RSH = 0x70
BPF_MOV = 0xB0
BPF_JA = 0x00
BPF_JSET = 0x40
BPF_JNE = 0x50
BPF_CALL = 0x80
BPF_EXIT = 0x90
BPF_TAIL_CALL = 0xF0  # the kernel's internal opcode; dumps show it as a call

LDX_MEM_W = BPF_LDX | BPF_MEM | BPF_W
LD_IMM64 = BPF_LD | BPF_IMM | BPF_DW
MAX_REG = 10  # r0..r10; r11 is the verifier's private register

# Registers. At entry r1 points to the context and r10 to the stack; nothing else is set.
R0, R1, R2, R3, R4, R5 = range(6)

# struct bpf_insn { u8 code; u8 dst_reg:4, src_reg:4; s16 off; s32 imm; } (dst in the low nibble).
_INSN = struct.Struct("<BBhi")
INSN_SIZE = _INSN.size

PROGRAM_NAME = b"oci_gpu_hook"  # shows in bpftool prog; [a-zA-Z0-9_.], at most 15 bytes
LICENSE = b"Apache-2.0"  # device programs call no GPL-only helpers

# Struct bpf_prog_info offsets we use, and a buffer size past the end of every field we touch
# (the kernel accepts a longer, zero-filled struct and reads only what it knows).
_INFO_TYPE, _INFO_ID, _INFO_XLATED_LEN, _INFO_XLATED_INSNS = 0, 4, 20, 32
_INFO_SIZE = 256
_ATTR_SIZE = 128  # union bpf_attr, zero-padded; longer than every command's part we fill


class Insn:
    """One eBPF instruction (struct bpf_insn). A plain class, not a NamedTuple: typing would cost
    the cgroup v2 start path 10 ms of imports (docs/performance.md)."""

    __slots__ = ("code", "dst", "src", "off", "imm")

    def __init__(self, code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0):
        self.code, self.dst, self.src, self.off, self.imm = code, dst, src, off, imm

    def _key(self) -> tuple:
        return (self.code, self.dst, self.src, self.off, self.imm)

    def __eq__(self, other) -> bool:
        return isinstance(other, Insn) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return "Insn(code={}, dst={}, src={}, off={}, imm={})".format(*self._key())

    def encode(self) -> bytes:
        return _INSN.pack(self.code, (self.src << 4) | self.dst, self.off, self.imm)


def decode(blob: bytes) -> list[Insn]:
    if len(blob) % INSN_SIZE:
        raise CgroupError(f"BPF program of {len(blob)} bytes is not a whole number of instructions")
    out = []
    for code, regs, off, imm in _INSN.iter_unpack(blob):
        out.append(Insn(code, regs & 0x0F, regs >> 4, off, imm))
    return out


def ldx_w(dst: int, src: int, off: int) -> Insn:
    """dst = *(u32 *)(src + off); zero-extends to 64 bits."""
    return Insn(LDX_MEM_W, dst, src, off)


def alu64_imm(op: int, dst: int, imm: int) -> Insn:
    return Insn(BPF_ALU64 | op | BPF_K, dst, 0, 0, imm)


def mov64_reg(dst: int, src: int) -> Insn:
    return Insn(BPF_ALU64 | BPF_MOV | BPF_X, dst, src)


def mov64_imm(dst: int, imm: int) -> Insn:
    return alu64_imm(BPF_MOV, dst, imm)


def jmp_imm(op: int, dst: int, imm: int, off: int) -> Insn:
    """if (dst op imm) goto pc + 1 + off (imm is sign-extended to 64 bits)."""
    return Insn(BPF_JMP | op | BPF_K, dst, 0, off, imm)


def exit_insn() -> Insn:
    return Insn(BPF_JMP | BPF_EXIT)


def access_mask(access: str) -> int:
    if not access or any(c not in ACCESS_BITS for c in access) or len(set(access)) != len(access):
        raise CgroupError(f"device access '{access}' is not a combination of r, w and m")
    mask = 0
    for c in access:
        mask |= ACCESS_BITS[c]
    return mask


# The prologue loads the context into registers once; r1 (the context pointer) is left alone
# because the old program, which runs after us, expects it there, and it needs nothing else: the
# verifier accepted it reading only r1 and r10 before writing a register.
PROLOGUE = (
    ldx_w(R2, R1, CTX_ACCESS_TYPE),  # r2 = access_type
    mov64_reg(R3, R2),
    alu64_imm(BPF_AND, R3, 0xFFFF),  # r3 = device type (low 16 bits)
    alu64_imm(BPF_RSH, R2, 16),  # r2 = access asked for (high 16 bits)
    ldx_w(R4, R1, CTX_MAJOR),  # r4 = major
    ldx_w(R5, R1, CTX_MINOR),  # r5 = minor
)
BLOCK_LEN = 6


def allow_block(dev_type: int, major: int, minor: int, mask: int) -> tuple[Insn, ...]:
    """Return 1 (allow) if the context is this device and asks only for access within mask.

    Every mismatch jumps to the instruction right after the block (pc + 1 + off with off = the
    instructions left in the block): the next block or, after the last, the old program's first
    instruction. The old program's own jumps are relative and stay inside it, so putting blocks
    in front of it changes none of them.
    """
    if not (0 <= major < 1 << 12 and 0 <= minor < 1 << 20):
        raise CgroupError(f"device {major}:{minor} is not a valid device number")
    block = (
        jmp_imm(BPF_JNE, R3, dev_type, 5),
        jmp_imm(BPF_JNE, R4, major, 4),
        jmp_imm(BPF_JNE, R5, minor, 3),
        jmp_imm(BPF_JSET, R2, ~mask & 0xFFFF, 2),  # asks for a bit outside mask
        mov64_imm(R0, 1),
        exit_insn(),
    )
    assert len(block) == BLOCK_LEN
    return block


def allow_prefix(devices: list[tuple[int, int, str]]) -> bytes:
    """The instructions to put in front of an old program: prologue + one block per char device."""
    insns = list(PROLOGUE)
    for major, minor, access in devices:
        insns.extend(allow_block(BPF_DEVCG_DEV_CHAR, major, minor, access_mask(access)))
    return b"".join(i.encode() for i in insns)


def check_reusable(insns: list[Insn]) -> None:
    """Raise CgroupError unless a dumped (xlated) program can be loaded again as it is."""
    i = 0
    while i < len(insns):
        insn = insns[i]
        if insn.dst > MAX_REG or insn.src > MAX_REG:
            raise CgroupError(
                f"instruction {i} uses register r{max(insn.dst, insn.src)} (constant blinding: net.core.bpf_jit_harden)"
            )
        cls, op = insn.code & 0x07, insn.code & 0xF0
        if cls in (BPF_JMP, BPF_JMP32) and op in (BPF_CALL, BPF_TAIL_CALL):
            raise CgroupError(f"instruction {i} calls a helper or function, which a dump cannot reproduce")
        if insn.code == LD_IMM64:
            if insn.src != 0:
                raise CgroupError(f"instruction {i} references a map or other kernel object")
            i += 2  # the second half holds the upper 32 bits
            continue
        i += 1


# ---------------------------------------------------------------------------------------------
# bpf(2) commands. Every fd the kernel returns here is close-on-exec.


def _attr(fmt: str, *values) -> bytearray:
    attr = bytearray(_ATTR_SIZE)
    struct.pack_into(fmt, attr, 0, *values)
    return attr


def query_programs(cgroup_fd: int, effective: bool = False) -> tuple[int, list[int]]:
    """(attach flags, ids) of the device programs attached to the cgroup itself, or with effective
    those that apply to it (its own and its ancestors')."""
    query_flags = BPF_F_QUERY_EFFECTIVE if effective else 0
    for _ in range(8):
        # struct { u32 target_fd, attach_type, query_flags, attach_flags; u64 prog_ids; u32 prog_cnt; }
        attr = _attr("<IIIIQI", cgroup_fd, BPF_CGROUP_DEVICE, query_flags, 0, 0, 0)
        _linux.bpf(BPF_PROG_QUERY, attr, "BPF_PROG_QUERY")
        count = struct.unpack_from("<I", attr, 24)[0]
        if count == 0:
            return struct.unpack_from("<I", attr, 12)[0], []
        ids = bytearray(4 * count)
        attr = _attr("<IIIIQI", cgroup_fd, BPF_CGROUP_DEVICE, query_flags, 0, _linux.address_of(ids), count)
        try:
            _linux.bpf(BPF_PROG_QUERY, attr, "BPF_PROG_QUERY")
        except OSError as e:
            if e.errno == errno.ENOSPC:  # a program was attached between the two calls
                continue
            raise
        flags, _, count = struct.unpack_from("<IQI", attr, 12)
        return flags, list(struct.unpack_from(f"<{count}I", ids))
    raise OSError(errno.EAGAIN, "BPF_PROG_QUERY: the attached programs keep changing")


def prog_fd_by_id(prog_id: int) -> int:
    return _linux.bpf(BPF_PROG_GET_FD_BY_ID, _attr("<I", prog_id), "BPF_PROG_GET_FD_BY_ID")


def _prog_info(prog_fd: int, insns: bytearray | None = None) -> bytearray:
    info = bytearray(_INFO_SIZE)
    if insns is not None:
        struct.pack_into("<I", info, _INFO_XLATED_LEN, len(insns))
        struct.pack_into("<Q", info, _INFO_XLATED_INSNS, _linux.address_of(insns))
    # struct { u32 bpf_fd; u32 info_len; u64 info; }
    attr = _attr("<IIQ", prog_fd, len(info), _linux.address_of(info))
    _linux.bpf(BPF_OBJ_GET_INFO_BY_FD, attr, "BPF_OBJ_GET_INFO_BY_FD")
    return info


def read_program(prog_fd: int) -> list[Insn]:
    """The instructions of a loaded device program, as the kernel dumps them (xlated)."""
    info = _prog_info(prog_fd)
    prog_type, prog_id = struct.unpack_from("<II", info, _INFO_TYPE)
    if prog_type != BPF_PROG_TYPE_CGROUP_DEVICE:
        raise CgroupError(f"BPF program {prog_id} is of type {prog_type}, not a cgroup device program")
    length = struct.unpack_from("<I", info, _INFO_XLATED_LEN)[0]
    if length == 0:
        # The kernel hides instructions from callers without CAP_BPF (or CAP_SYS_ADMIN).
        raise CgroupError(f"the kernel withholds BPF program {prog_id}'s instructions (needs CAP_BPF or CAP_SYS_ADMIN)")
    insns = bytearray(length)
    info = _prog_info(prog_fd, insns)
    if struct.unpack_from("<I", info, _INFO_XLATED_LEN)[0] != length:
        raise CgroupError(f"BPF program {prog_id}'s length changed while being read")
    return decode(bytes(insns))


def prog_id(prog_fd: int) -> int:
    return struct.unpack_from("<I", _prog_info(prog_fd), _INFO_ID)[0]


def load_program(insns: bytes) -> int:
    """Load a cgroup device program; returns its fd. A verifier rejection raises CgroupError with
    the verifier's last line."""
    code = bytearray(insns)
    license_ = bytearray(LICENSE + b"\0")

    def load(log_level: int, log: bytearray | None) -> int:
        # struct { u32 prog_type, insn_cnt; u64 insns, license; u32 log_level, log_size; u64 log_buf;
        #          u32 kern_version, prog_flags; char prog_name[16]; u32 prog_ifindex, expected_attach_type; }
        attr = _attr(
            "<IIQQIIQII16sII",
            BPF_PROG_TYPE_CGROUP_DEVICE,
            len(code) // INSN_SIZE,
            _linux.address_of(code),
            _linux.address_of(license_),
            log_level,
            len(log) if log else 0,
            _linux.address_of(log) if log else 0,
            0,
            0,
            PROGRAM_NAME,
            0,
            BPF_CGROUP_DEVICE,
        )
        return _linux.bpf(BPF_PROG_LOAD, attr, "BPF_PROG_LOAD")

    try:
        return load(0, None)  # no log on the fast path: the verifier runs faster without one
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EACCES, errno.E2BIG):
            raise
    log = bytearray(1 << 18)
    try:
        return load(1, log)  # loaded this time after all
    except OSError as e:
        lines = [line for line in log.split(b"\0", 1)[0].decode(errors="replace").splitlines() if line.strip()]
        reason = f" ({lines[-1].strip()})" if lines else ""
        raise CgroupError(f"the kernel's verifier rejected the device program: {e.strerror}{reason}") from None


def attach_program(cgroup_fd: int, prog_fd: int, flags: int, replace_fd: int = 0) -> None:
    # struct { u32 target_fd, attach_bpf_fd, attach_type, attach_flags, replace_bpf_fd; }
    attr = _attr("<IIIII", cgroup_fd, prog_fd, BPF_CGROUP_DEVICE, flags, replace_fd)
    _linux.bpf(BPF_PROG_ATTACH, attr, "BPF_PROG_ATTACH")


def detach_program(cgroup_fd: int, prog_fd: int) -> None:
    attr = _attr("<IIII", cgroup_fd, prog_fd, BPF_CGROUP_DEVICE, 0)
    _linux.bpf(BPF_PROG_DETACH, attr, "BPF_PROG_DETACH")


def _replace(cgroup_fd: int, flags: int, current_fd: int, new_fd: int) -> None:
    """Put new_fd's program where current_fd's is attached, keeping the cgroup's attach mode."""
    if not flags & BPF_F_ALLOW_MULTI:
        # Single-program modes: attaching with the same flags replaces the program atomically.
        attach_program(cgroup_fd, new_fd, flags)
        return
    try:
        attach_program(cgroup_fd, new_fd, flags | BPF_F_REPLACE, current_fd)
        return
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    # Kernels before 5.6 have no BPF_F_REPLACE: attach, then detach. In between both programs are
    # attached and both must allow, so the access is never wider than the old program's alone.
    attach_program(cgroup_fd, new_fd, flags)
    try:
        detach_program(cgroup_fd, current_fd)
    except OSError:
        detach_program(cgroup_fd, new_fd)
        raise


# ---------------------------------------------------------------------------------------------
# The API.


class _Swap:
    __slots__ = ("old_fd", "new_fd")

    def __init__(self, old_fd: int, new_fd: int):
        self.old_fd, self.new_fd = old_fd, new_fd


class Undo:
    """What allow_devices changed. undo() restores the original programs; close() keeps the change
    and releases the file descriptors (the cgroup keeps its attached programs alive)."""

    def __init__(self, cgroup_dir: str, cgroup_fd: int = -1, flags: int = 0, swaps: list[_Swap] | tuple = ()):
        self.cgroup_dir = cgroup_dir
        self._cgroup_fd = cgroup_fd
        self._flags = flags
        self._swaps = list(swaps)

    @property
    def changed(self) -> bool:
        return bool(self._swaps)

    def undo(self) -> None:
        failures = []
        for swap in reversed(self._swaps):
            try:
                _replace(self._cgroup_fd, self._flags, swap.new_fd, swap.old_fd)
            except OSError as e:
                failures.append(e.strerror)
        self.close()
        if failures:
            raise CgroupError(f"{self.cgroup_dir}: cannot restore the original device program: {failures[0]}")

    def close(self) -> None:
        for swap in self._swaps:
            os.close(swap.old_fd)
            os.close(swap.new_fd)
        self._swaps = []
        if self._cgroup_fd >= 0:
            os.close(self._cgroup_fd)
            self._cgroup_fd = -1


def allow_devices(cgroup_dir: str, devices: list[tuple[int, int, str]]) -> Undo:
    """Allow the char devices (major, minor, access) with access from "r", "w", "m", in the cgroup
    v2 directory cgroup_dir, by extending every device program attached to it (see the module
    docstring). Returns the Undo; raises CgroupError, with nothing changed, on failure."""
    prefix = allow_prefix(devices)  # validates the devices before anything is touched
    if not devices:
        return Undo(cgroup_dir)
    try:
        cgroup_fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise CgroupError(f"{cgroup_dir}: cannot open the cgroup: {e.strerror}") from None
    olds: list[int] = []
    news: list[int] = []
    done: list[_Swap] = []
    flags = 0
    step = "query its device programs"
    try:
        flags, ids = query_programs(cgroup_fd)
        flags &= BPF_F_ALLOW_OVERRIDE | BPF_F_ALLOW_MULTI
        if not ids:
            step = "query its effective device programs"
            if query_programs(cgroup_fd, effective=True)[1]:
                raise CgroupError(
                    f"{cgroup_dir}: device access is filtered by an ancestor cgroup's BPF program, "
                    "which this hook does not change"
                )
            os.close(cgroup_fd)  # nothing filters devices here: all are allowed already
            return Undo(cgroup_dir)
        for prog in ids:
            step = f"open device program {prog}"
            olds.append(prog_fd_by_id(prog))
            step = f"read device program {prog}"
            insns = read_program(olds[-1])
            check_reusable(insns)
            step = f"load the extension of device program {prog}"
            news.append(load_program(prefix + b"".join(i.encode() for i in insns)))
        for old_fd, new_fd in zip(olds, news):
            step = "attach the extended device program"
            _replace(cgroup_fd, flags, old_fd, new_fd)
            done.append(_Swap(old_fd, new_fd))
    except (OSError, CgroupError) as e:
        message = f"{cgroup_dir}: cannot {step}: {e.strerror}" if isinstance(e, OSError) else str(e)
        if not message.startswith(cgroup_dir):
            message = f"{cgroup_dir}: {step}: {message}"
        try:
            Undo(cgroup_dir, os.dup(cgroup_fd), flags, done).undo()
        except CgroupError as rollback:
            message += f"; rollback failed too: {rollback}"
        finally:
            for fd in olds[len(done) :] + news[len(done) :] + [cgroup_fd]:
                os.close(fd)
        raise CgroupError(message) from None
    return Undo(cgroup_dir, cgroup_fd, flags, done)
