"""Keep a command line's table readable: compiler and autotune chatter goes to a log file, progress stays visible.

Why: Inductor writes its autotune tables straight to ``sys.stderr``, the C++ compiler it spawns writes to file
descriptor 2, and warnings from deep inside torch arrive the same way — around and inside the table a benchmark
prints. :func:`compiler_output_to` sends all of it (Python-level and descriptor-level) to a log file for the
duration and hands back a stream to the real terminal for progress bars.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

__all__ = ["compiler_output_to"]


@contextlib.contextmanager
def compiler_output_to(log_path: str | Path) -> Iterator[TextIO]:
    """Redirect standard error (the Python object and descriptor 2, so child processes too) to ``log_path``
    (appended) inside the block; yields a line-buffered stream to the original standard error for progress."""
    path = Path(log_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fd = os.dup(2)
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    old_stderr = sys.stderr
    with open(path, "a", buffering=1) as log:
        os.dup2(log.fileno(), 2)
        sys.stderr = log
        try:
            yield terminal
        finally:
            with contextlib.suppress(ValueError, OSError):
                log.flush()
            sys.stderr = old_stderr
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            terminal.close()
