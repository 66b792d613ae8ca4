"""How an error message shows what is at fault: one line, whatever the value or the parser's
message (a number of 400 digits, a JSON error with its whole context)."""

from __future__ import annotations

MAX_SHOWN = 40  # characters of a value an error message shows in full


def shown(value: object) -> str:
    """``value``'s repr, cut to fit a line: ``'12345678901234567890... (400 characters)'``."""
    text = repr(value)
    if len(text) <= MAX_SHOWN:
        return text
    return f"{text[: MAX_SHOWN // 2]}... ({len(text)} characters)"


def reason(exc: BaseException) -> str:
    """A parser's message without its context (what comes after the first ';')."""
    return str(exc).split(";")[0]


def first_line(exc: BaseException) -> str:
    """An exception's first line of message (its type's name where it has none)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
