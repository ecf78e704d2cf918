"""Text from files shown safely: a file name, key or field can hold terminal escape sequences (colour, cursor moves,
a forged prompt) or bidirectional overrides; every message that may quote one is escaped before it reaches a
terminal, the way ``repr`` shows a string. Map: docs/architecture.md (map).
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from typing import TypeVar

__all__ = ["printable", "escaped_errors", "refuse"]

# C0 controls but tab and newline, DEL, C1 controls, and the Unicode bidirectional overrides and isolates
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
F = TypeVar("F", bound=Callable)


def printable(text: str) -> str:
    """``text`` with every control or direction-changing character written as its escape (``\\x1b``, ``\\u202e``)."""
    return _UNSAFE.sub(lambda m: repr(m.group())[1:-1], text)


def escaped_errors(fn: F) -> F:
    """A ``ValueError`` leaving ``fn`` carries a printable message (same exception, same traceback)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            if len(e.args) == 1 and isinstance(e.args[0], str):
                e.args = (printable(e.args[0]),)
            raise
    return wrapper  # type: ignore[return-value]


def refuse(command: str, error: BaseException) -> int:
    """Print ``command: <reason>`` to standard error, escaped, and return the exit status of a refusal (2)."""
    print(f"{command}: {printable(str(error))}", file=sys.stderr)
    return 2
