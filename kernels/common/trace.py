"""Trace-time switch between the GPU build of the kernels' helpers and their host execution (``host_exec``).

The helpers are traced twice: inside a ``@cute.kernel`` for the GPU, and inside a host driver that executes them
on the CPU. One thing differs: the L1 eviction-priority hint on activation loads, a cache policy with no effect on
the values loaded, is a device instruction that aborts the process on the host. The host driver traces with
:func:`host_trace` active, which drops the hint; every address and every arithmetic operation stays the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["host_trace", "tracing_for_host", "evict_last"]

_HOST: list[bool] = [False]


@contextlib.contextmanager
def host_trace() -> Iterator[None]:
    """Trace (compile) the helpers for host execution inside the block."""
    old = _HOST[0]
    _HOST[0] = True
    try:
        yield
    finally:
        _HOST[0] = old


def tracing_for_host() -> bool:
    return _HOST[0]


def evict_last() -> dict[str, Any]:
    """Copy-atom keyword arguments for an activation load kept in L1 (``evict_last``); none on the host."""
    if _HOST[0]:
        return {}
    import cutlass.cute as cute

    return {"l1c_evict_priority": cute.nvgpu.CacheEvictionPriority.EVICT_LAST}
