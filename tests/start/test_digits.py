import os
import subprocess
import sys

import pytest

from oci_gpu_hook.start import digits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("text", ["0", "7", "0012", "65535", "1" * 40])
def test_ascii_digits_are_read_as_their_number(text):
    assert digits.is_decimal(text)
    assert digits.decimal(text) == int(text)


@pytest.mark.parametrize("text", ["", "¹", "13,¹", "٣", "２", "-1", "+1", " 1", "1 ", "1_000", "0x1", "1.0"])
def test_anything_else_is_no_number(text):
    assert not digits.is_decimal(text)
    assert digits.decimal(text) is None


def test_imports_nothing_but_itself():
    """Every start-path parser asks here, so it must stay as light as they are (typing, which
    `Optional` needed, brought re and enum: about 10 ms of every cold start)."""
    code = (f"import sys; sys.path.insert(0, {REPO!r}); before = set(sys.modules)\n"
            "import oci_gpu_hook.start.digits\n"
            "print(' '.join(sorted(set(sys.modules) - before)))")  # fmt: skip
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["__future__", "oci_gpu_hook", "oci_gpu_hook.start", "oci_gpu_hook.start.digits"]
