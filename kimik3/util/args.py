"""Argument types shared by the command-line verbs (``python -m kimik3 ...``): one definition of what a positive
integer or a comma-separated list means on every command line. Map: docs/architecture.md (map).
"""

from __future__ import annotations

import argparse

__all__ = ["positive_int", "int_list", "name_list"]


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer >= 1, else an error naming what was given."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers (empty items skipped)."""
    return tuple(int(x) for x in text.split(",") if x.strip())


def name_list(text: str) -> tuple[str, ...]:
    """Comma-separated names, stripped (empty items skipped)."""
    return tuple(x.strip() for x in text.split(",") if x.strip())
