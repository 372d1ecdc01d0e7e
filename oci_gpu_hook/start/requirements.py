"""NVIDIA_REQUIRE_* conditions: parsing them from an image's environment and checking them against the host.

The rules follow NVIDIA's container stack (libnvidia-container's dsl.c and configure.c, the toolkit's
cuda_image.go) so that images behave the same; where that stack is vague we choose, and say so here.

Which variables
    Every environment variable whose name starts with ``NVIDIA_REQUIRE_`` (case-sensitive), except those
    starting with ``NVIDIA_REQUIRE_JETPACK``: NVIDIA's toolkit skips these (they hold Jetson mount flags
    such as ``csv-mounts=all``, not conditions; NGC images set ``NVIDIA_REQUIRE_JETPACK_HOST_MOUNTS=``).
    All variables must hold. A value that is empty or only whitespace is no requirement.

Syntax of a value
    Alternatives (OR) separated by whitespace; each alternative is terms (AND) separated by commas; empty
    terms and alternatives with no term (``,``) are skipped. A term is KEY OP VALUE. As in dsl.c, KEY runs
    up to the first of ``<>=!``, OP is the whole run of those characters and must be one of ``=``, ``!=``,
    ``<``, ``<=``, ``>``, ``>=`` (so ``==`` and ``=>`` are errors), VALUE is the rest and must not be empty.
    Keys, case-insensitive:

    - ``cuda``: the driver's CUDA version (``12.4``); VALUE a version such as ``12.4``.
    - ``driver``: the kernel module version (``535.104.05``); VALUE a version such as ``535`` or ``535.104.05``.
    - ``arch``: the GPU's compute capability (``8.0``); VALUE such as ``8.0`` (``sm_80`` is an error).
    - ``brand``: the GPU's NVML brand (driver.BRANDS), compared case-insensitively; only ``=`` and ``!=``
      (an order between brands means nothing; ``brand<tesla`` is an error). A name NVML does not know is
      accepted and simply never equal, so an image naming a brand newer than this hook still starts.

    Versions are digits and dots (1 to 4 fields, ASCII digits only) and compare numerically field by
    field, a missing field counting as 0: ``driver>=384`` holds for 384.81, ``cuda=12.4`` holds for 12.4.0.

Stricter than NVIDIA
    NVIDIA parses lazily: a malformed term is only an error when evaluation reaches it. We parse every
    term up front, and any malformed term is a RequestError naming the variable, its value and what is
    accepted. Values are bounded (MAX_VALUE_LENGTH characters, MAX_TERMS terms, MAX_VARIABLES
    variables) since they come from untrusted images; real CUDA 12 images carry 91 terms in ~1300 chars.

Evaluation
    Per selected GPU with GpuFacts(cuda, driver, arch, brand); a MIG device is judged by its parent GPU
    (the caller's job). With no GPU selected the caller passes only cuda and driver. As in configure.c, a
    term on a fact that is unknown (None: no GPU, or NVML did not answer) holds. A known fact that is not a
    version makes the check fail (NVIDIA: "invalid expression").

The failure message
    As libnvidia-container: ``unsatisfied condition: <the variable's first alternative, as written>``.
    With a single alternative that is the failing condition itself; for CUDA images
    (``cuda>=12.4 brand=tesla,driver>=470,driver<471 ...``) it is ``cuda>=12.4``, the text users know.
    The hint ``, please update your driver to a newer version, or use an earlier cuda container`` is added
    when that first alternative has an unsatisfied ``cuda>=``/``cuda>`` term: the host's CUDA is too old.
    (NVIDIA adds it whenever the value starts with ``cuda>=``, even when another term failed; we do not.)
    Variables are checked in name order, so the reported one is deterministic.

NVIDIA_DISABLE_REQUIRE
    parse_bool: Go's strconv.ParseBool spellings; anything else (including surrounding spaces) is false,
    as in the toolkit, which ignores the parse error.
"""

from __future__ import annotations

from oci_gpu_hook.errors import RequestError, RequirementError, printable
from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.start import driver

PREFIX = "NVIDIA_REQUIRE_"
IGNORED_PREFIX = "NVIDIA_REQUIRE_JETPACK"
MAX_VALUE_LENGTH = 4096
MAX_TERMS = 512  # per variable; a CUDA 12.4 image has 91
MAX_VARIABLES = 64

OPERATORS = ("=", "!=", "<", "<=", ">", ">=")
OPERATOR_CHARS = "<>=!"
KEYS = ("cuda", "driver", "arch", "brand")
CUDA_HINT = ", please update your driver to a newer version, or use an earlier cuda container"

_TRUE = frozenset(("1", "t", "T", "TRUE", "true", "True"))
# String checks rather than re: this module is on the start path, and re (with enum and
# functools) would cost every GPU container several milliseconds of imports.
_DIGITS = frozenset("0123456789")
_BRAND_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_SUFFIX_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.+-")
_ASCII_SPACE = " \t\n\r\f\v"


def _number(text: str) -> bool:
    """1 to 9 ASCII digits."""
    return 0 < len(text) <= 9 and _DIGITS.issuperset(text)


def _is_version(text: str, max_fields: int = 4) -> bool:
    """1 to max_fields numbers separated by dots."""
    fields = text.split(".")
    return len(fields) <= max_fields and all(_number(f) for f in fields)


def _split_space(value: str) -> list:
    """Split on runs of ASCII whitespace only (Unicode spaces stay inside terms, and fail there)."""
    for c in _ASCII_SPACE[1:]:
        value = value.replace(c, " ")
    return value.split(" ")


def _legacy_cuda(text: str):
    """(major, minor or None) of a semver-like CUDA_VERSION, or None: v?M(.m)?(.p){0,4}([-+]suffix)?"""
    if text.startswith("v"):
        text = text[1:]
    cut = min((i for i in (text.find("-"), text.find("+")) if i >= 0), default=len(text))
    core, suffix = text[:cut], text[cut + 1 :]
    if cut < len(text) and (len(suffix) > 64 or not _SUFFIX_CHARS.issuperset(suffix)):
        return None
    if not _is_version(core, max_fields=6):
        return None
    fields = core.split(".")
    return fields[0], fields[1] if len(fields) > 1 else None


_ACCEPTED_VALUES = {
    "cuda": "a CUDA version such as 12.4",
    "driver": "a driver version such as 535 or 535.104.05",
    "arch": "a compute capability such as 8.0 or 9.0, digits and dots (not sm_80)",
    "brand": "an NVML brand name: " + ", ".join(b.lower() for b in driver.BRANDS),
}
_FACT_NAMES = {"cuda": "CUDA version", "driver": "driver version", "arch": "compute capability"}


def parse_bool(value: str | None) -> bool:
    """Go's strconv.ParseBool, with an unparsable value (or None) read as false, as NVIDIA's toolkit does.

    True: 1, t, T, TRUE, true, True. Everything else, including " true" or "yes", is false.
    """
    return value in _TRUE


def _show(text: str, limit: int = 100) -> str:
    """Text from an image made safe for a one-line message: non-printables escaped, long text cut."""
    return printable(text[:limit]) + ("..." if len(text) > limit else "")


def _version(text: str) -> tuple[int, ...] | None:
    if not _is_version(text):
        return None
    return tuple(int(field) for field in text.split("."))


def _compare(left: tuple[int, ...], right: tuple[int, ...]) -> int:
    width = max(len(left), len(right))
    left = left + (0,) * (width - len(left))
    right = right + (0,) * (width - len(right))
    return (left > right) - (left < right)


_OP_HOLDS = {
    "=": lambda c: c == 0,
    "!=": lambda c: c != 0,
    "<": lambda c: c < 0,
    "<=": lambda c: c <= 0,
    ">": lambda c: c > 0,
    ">=": lambda c: c >= 0,
}


class GpuFacts(Frozen):
    """What requirements are checked against; None is unknown, and a term on an unknown fact holds."""

    __slots__ = ("cuda", "driver", "arch", "brand")
    _defaults = {"arch": None, "brand": None}
    cuda: str | None  # the driver's CUDA version, 12.4
    driver: str | None  # the kernel module version, 535.104.05
    arch: str | None  # compute capability, 8.0; None with no GPU selected
    brand: str | None  # NVML brand name (driver.BRANDS); None with no GPU selected


class Term(Frozen):
    __slots__ = ("key", "op", "value", "text", "version")
    _defaults = {"version": None}
    key: str  # one of KEYS, lower case
    op: str  # one of OPERATORS
    value: str  # as written
    text: str  # the whole term as written, for messages
    version: tuple[int, ...] | None  # the value parsed, except for brand

    def holds(self, facts: GpuFacts) -> bool:
        fact = getattr(facts, self.key)
        if fact is None:
            return True
        if self.key == "brand":
            equal = str(fact).lower() == self.value.lower()
            return equal if self.op == "=" else not equal
        host = _version(str(fact).strip())
        if host is None:
            raise RequirementError(
                f"cannot check {self.text}: the host's {_FACT_NAMES[self.key]} {_show(str(fact))!r} is not a version"
            )
        return _OP_HOLDS[self.op](_compare(host, self.version))


class Requirement(Frozen):
    """One NVIDIA_REQUIRE_* variable: it holds when any alternative has all its terms holding."""

    __slots__ = ("variable", "alternatives")
    variable: str
    alternatives: tuple[tuple[Term, ...], ...]  # never empty

    def describe(self) -> str:
        return " or ".join(",".join(t.text for t in alternative) for alternative in self.alternatives)

    def check(self, facts: GpuFacts) -> None:
        for alternative in self.alternatives:
            if all(term.holds(facts) for term in alternative):
                return
        first = self.alternatives[0]
        message = "unsatisfied condition: " + ",".join(t.text for t in first)
        if any(t.key == "cuda" and t.op in (">=", ">") and not t.holds(facts) for t in first):
            message += CUDA_HINT
        raise RequirementError(message)


class Requirements(Frozen):
    """The conditions of one container, in variable name order; empty when the image states none."""

    __slots__ = ("requirements",)
    _defaults = {"requirements": ()}
    requirements: tuple[Requirement, ...]

    def __bool__(self) -> bool:
        return bool(self.requirements)

    def check(self, facts: GpuFacts | None) -> None:
        """Raise RequirementError unless every variable holds for these facts (None: nothing known)."""
        facts = facts if facts is not None else GpuFacts(cuda=None, driver=None)
        for requirement in self.requirements:
            requirement.check(facts)

    def describe(self) -> str:
        if not self.requirements:
            return "none"
        return "; ".join(f"{r.variable}: {r.describe()}" for r in self.requirements)


def _parse_term(variable: str, value: str, text: str) -> Term:
    def fail(problem: str, accepted: str) -> RequestError:
        return RequestError(f"{variable}={_show(value)}: {problem} (accepted: {accepted})")

    key_end = next((i for i, c in enumerate(text) if c in OPERATOR_CHARS), len(text))
    op_end = key_end
    while op_end < len(text) and text[op_end] in OPERATOR_CHARS:
        op_end += 1
    key, op, operand = text[:key_end], text[key_end:op_end], text[op_end:]
    shown = _show(text)
    if not key or not op:
        missing = "no key" if not key else "no operator"
        raise fail(f"{shown!r} has {missing}", "KEY OP VALUE terms such as cuda>=12.4")
    if op not in OPERATORS:
        raise fail(f"unknown operator {_show(op)!r} in {shown!r}", " ".join(OPERATORS))
    canonical = key.lower() if key.isascii() else key
    if canonical not in KEYS:
        raise fail(f"unknown key {_show(key)!r} in {shown!r}", ", ".join(KEYS))
    if not operand:
        raise fail(f"{shown!r} has no value", _ACCEPTED_VALUES[canonical])
    if canonical == "brand":
        if op not in ("=", "!="):
            raise fail(f"brand cannot be ordered: {shown!r}", "brand=NAME or brand!=NAME")
        if not (0 < len(operand) <= 64 and _BRAND_CHARS.issuperset(operand)):
            raise fail(f"{_show(operand)!r} in {shown!r} is not a brand name", _ACCEPTED_VALUES["brand"])
        return Term(key=canonical, op=op, value=operand, text=text)
    version = _version(operand)
    if version is None:
        raise fail(f"{_show(operand)!r} in {shown!r} is not a version", _ACCEPTED_VALUES[canonical])
    return Term(key=canonical, op=op, value=operand, text=text, version=version)


def parse_requirement(variable: str, value: str) -> Requirement | None:
    """One variable's value -> its Requirement, or None when it states none. Raises RequestError."""
    if len(value) > MAX_VALUE_LENGTH:
        raise RequestError(f"{variable}: the value is longer than {MAX_VALUE_LENGTH} characters")
    texts = [[t for t in alternative.split(",") if t] for alternative in _split_space(value) if alternative]
    texts = [alternative for alternative in texts if alternative]
    if sum(len(alternative) for alternative in texts) > MAX_TERMS:
        raise RequestError(f"{variable}: the value has more than {MAX_TERMS} terms")
    alternatives = tuple(tuple(_parse_term(variable, value, t) for t in alternative) for alternative in texts)
    return Requirement(variable, alternatives) if alternatives else None


def parse_requirements(env: dict) -> Requirements:
    """Every NVIDIA_REQUIRE_* variable (but NVIDIA_REQUIRE_JETPACK*) of an environment. Raises RequestError."""
    names = sorted(name for name in env if name.startswith(PREFIX) and not name.startswith(IGNORED_PREFIX))
    if len(names) > MAX_VARIABLES:
        raise RequestError(f"the image sets more than {MAX_VARIABLES} {PREFIX}* variables")
    parsed = (parse_requirement(name, env[name]) for name in names)
    return Requirements(tuple(r for r in parsed if r is not None))


def legacy_cuda_requirement(cuda_version: str) -> str:
    """The condition a legacy image (CUDA_VERSION, no NVIDIA_REQUIRE_CUDA) gets: 10.2.89 -> cuda>=10.2.

    NVIDIA reads CUDA_VERSION as semver (v prefix, pre-release and build suffix allowed, a missing minor is
    0). We also accept a fourth field (NGC's 12.8.0.038) and surrounding spaces. Raises RequestError.
    """
    match = _legacy_cuda(cuda_version.strip())
    if match is None:
        raise RequestError(
            f"CUDA_VERSION={_show(cuda_version)}: not a CUDA version (accepted: MAJOR[.MINOR[.PATCH]] such as 12.4.1)"
        )
    major, minor = match
    return f"cuda>={int(major)}.{int(minor or 0)}"
