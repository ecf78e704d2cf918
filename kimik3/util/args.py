"""Argument types shared by the command-line verbs (``python -m kimik3 ...``, ``python -m kimik3.perf.hardware``):
one definition of what a positive integer, a list, a dtype or an output path means on every command line, each
refusing a bad value at parse time, naming it, before any work. Map: docs/architecture.md (map).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

__all__ = ["positive_int", "nonnegative_int", "bounded_int", "int_list", "positive_int_list", "name_list",
           "choice_list", "output_file", "output_folder", "seed_int", "MAX_SEED", "MAX_STEPS",
           "MAX_THREADS"]

MAX_SEED = 2**63 - 1  # what torch.Generator.manual_seed takes without wrapping
MAX_STEPS = 100_000  # decode steps per run: far past any measurement's need, far below a cache's end
MAX_THREADS = 1024  # CPU threads: past any machine here, short of what would exhaust memory in thread stacks


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer >= 1, else an error naming what was given."""
    v = _int(text, "a positive integer")
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    v = _int(text, "a non-negative integer")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {v}")
    return v


def bounded_int(lo: int, hi: int, why: str = "") -> Callable[[str], int]:
    """An integer in ``lo..hi`` (``why``: what the upper bound protects)."""
    def parse(text: str) -> int:
        v = _int(text, f"an integer in {lo}..{hi}")
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}{f' ({why})' if why else ''}, got {v}")
        return v
    return parse


def _items(text: str, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        raise argparse.ArgumentTypeError(f"must name at least one {what}, got {text!r}")
    if not all(items):
        raise argparse.ArgumentTypeError(f"has an empty item: {text!r} (comma-separated {what}s)")
    return items


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers, at least one, no empty items."""
    return tuple(_int(x, "a comma-separated list of integers") for x in _items(text, "integer"))


def positive_int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers >= 1 (batch sizes, steps), at least one."""
    out = int_list(text)
    bad = [v for v in out if v < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"must be positive integers, got {', '.join(map(str, bad))} in {text!r}")
    return out


def bounded_int_list(lo: int, hi: int, why: str = "") -> Callable[[str], tuple[int, ...]]:
    """Comma-separated integers, each in ``lo..hi`` (``why``: what the upper bound protects), at least one."""
    def parse(text: str) -> tuple[int, ...]:
        out = int_list(text)
        bad = [v for v in out if not lo <= v <= hi]
        if bad:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}{f' ({why})' if why else ''}, got "
                                             f"{', '.join(map(str, bad))}")
        return out
    return parse


def name_list(text: str) -> tuple[str, ...]:
    """Comma-separated names, stripped, at least one, no empty items."""
    return tuple(_items(text, "name"))


def choice_list(choices: Iterable[str], what: str = "name") -> Callable[[str], tuple[str, ...]]:
    """Comma-separated names, each one of ``choices``."""
    allowed = tuple(choices)

    def parse(text: str) -> tuple[str, ...]:
        out = tuple(_items(text, what))
        bad = [x for x in out if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {', '.join(map(repr, bad))}; choose from "
                                             f"{', '.join(allowed)}")
        return out
    return parse


def output_file(text: str) -> str:
    """A path to write a file to: absent, or a regular file (or a symlink to one), never a device, FIFO or folder
    (``kimik3.util.files.check_output_file``)."""
    from kimik3.util.files import check_output_file

    try:
        check_output_file(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def output_folder(text: str) -> str:
    """A path to write a folder to: absent or a folder (or a symlink to one); never empty text, a file or a symlink
    to nothing. Whether a non-empty folder may be written into is the command's to say
    (``kimik3.util.files.check_output_folder``)."""
    from kimik3.util.files import check_output_folder

    if not text.strip():
        raise argparse.ArgumentTypeError(f"must name a folder, got {text!r}")
    try:
        check_output_folder(text, overwrite=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


seed_int = bounded_int(0, MAX_SEED, "a torch seed")
