"""Numbers written in ASCII decimal digits, the only kind any file or setting of ours holds.

str.isdigit() also takes '¹', '٣' and other digits, some of which int() refuses with a ValueError
and some of which it reads as numbers no file meant: every parser asks here instead.
"""

from __future__ import annotations


def is_decimal(text: str) -> bool:
    """True when text is one or more ASCII digits and nothing else (no sign, no space)."""
    return text.isascii() and text.isdigit()


def decimal(text: str) -> int | None:
    """The number text spells in ASCII digits, or None when it is anything else."""
    return int(text) if is_decimal(text) else None
