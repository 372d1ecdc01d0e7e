import pytest

from oci_gpu_hook.start import digits


@pytest.mark.parametrize("text", ["0", "7", "0012", "65535", "1" * 40])
def test_ascii_digits_are_read_as_their_number(text):
    assert digits.is_decimal(text)
    assert digits.decimal(text) == int(text)


@pytest.mark.parametrize("text", ["", "¹", "13,¹", "٣", "２", "-1", "+1", " 1", "1 ", "1_000", "0x1", "1.0"])
def test_anything_else_is_no_number(text):
    assert not digits.is_decimal(text)
    assert digits.decimal(text) is None
