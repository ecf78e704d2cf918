"""The shared segment the ranks of a deployment map on one machine: every rank's counter words and mailboxes.

The CPU stand-in for symmetric memory (§1.2): one file, ``world`` equal parts, each rank's part its counter memory
(int64 words in the layout of ``kernels/contracts/peers.py``) followed by its MAILBOX buffers, 64-byte aligned, in
the program's buffer order. Every rank maps the whole file (``torch.from_file(shared=True)``), so a push is a
plain store into the peer's part and a signal an atomic add on the peer's word; x86-64 and AArch64 atomics on a
shared mapping are address-free, as the GPU's on symmetric memory. The layout is computed from the program alone
(every rank's program has the same counters and mailboxes: checked), so the ranks agree on it without talking.
See docs/architecture.md#megakernel-across-ranks.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

from kimik3.kernels.contracts.peers import counter_words
from kimik3.megakernel.instructions import Kind, Program

__all__ = ["PeerMemory", "segment_layout"]

_ALIGN = 64


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def segment_layout(program: Program, word_bytes: int = 8, capacity: int = 0) -> tuple[int, int, dict[int, int]]:
    """(counter words, bytes per rank, {mailbox buffer id: byte offset in a rank's part}). ``word_bytes``: 8 for the
    CPU executor's int64 words, 4 for the GPU kernel's; ``capacity``: counter words the part reserves at least (the
    kernel's counter tensor has a static shape)."""
    words = sum(counter_words(c.sources) for c in program.counters)
    if capacity and words > capacity:
        raise ValueError(f"{program}: {words} counter words > the kernel's {capacity}")
    at = _up(word_bytes * max(1, words, capacity))
    offsets = {}
    for i, b in enumerate(program.buffers):
        if b.kind == Kind.MAILBOX:
            offsets[i] = at
            at = _up(at + b.shape[0] * b.shape[1] * b.shape[2] * b.element_size)
    return words, at, offsets


class PeerMemory:
    """Rank ``rank``'s mapping of the segment at ``path`` for ``program`` (rank 0 creates it, zero-filled; the
    others open it once it exists — the caller orders that, e.g. with a barrier)."""

    def __init__(self, program: Program, path: str | Path, create: bool) -> None:
        if program.world < 2:
            raise ValueError(f"{program} is a single GPU's program: it has no peers to share memory with")
        self.program, self.path, self.world = program, Path(path), program.world
        self.words, self.rank_bytes, self.offsets = segment_layout(program)
        size = self.world * self.rank_bytes
        if create:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # never someone else's file
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
        elif not self.path.is_file() or self.path.stat().st_size != size:
            raise ValueError(f"{self.path}: no shared segment of {size} bytes for this program (a rank of another "
                             "program, or rank 0 has not created it yet)")
        self.raw = torch.from_file(str(self.path), shared=True, size=size, dtype=torch.uint8)

    def counters(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s counter words (int64)."""
        lo = rank * self.rank_bytes
        return self.raw[lo : lo + 8 * max(1, self.words)].view(torch.int64)

    def mailbox(self, rank: int, buf: int) -> torch.Tensor:
        """Rank ``rank``'s copy of MAILBOX buffer ``buf``, shaped and typed as the program declares it."""
        spec = self.program.buffers[buf]
        lo = rank * self.rank_bytes + self.offsets[buf]
        n = spec.shape[0] * spec.shape[1] * spec.shape[2] * spec.element_size
        return self.raw[lo : lo + n].view(spec.dtype).view(spec.shape)

    def addresses(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the executor takes: ``[world · NB]`` mailbox addresses (0 for other buffers) and ``[world]``
        counter-memory addresses."""
        nb = len(self.program.buffers)
        peer = torch.zeros(self.world * nb, dtype=torch.int64)
        for r in range(self.world):
            for b in self.offsets:
                peer[r * nb + b] = self.mailbox(r, b).data_ptr()
        ctr = torch.tensor([self.counters(r).data_ptr() for r in range(self.world)], dtype=torch.int64)
        return peer, ctr

    @classmethod
    def rendezvous(cls, program: Program, group: Any = None, directory: str | Path | None = None) -> PeerMemory:
        """Every rank of ``group`` (an initialised ``torch.distributed`` group of ``program.world`` ranks) maps one
        fresh segment: rank 0 creates it under ``directory`` (default ``/dev/shm`` where it exists, else the
        temporary folder) and sends its path; once all have mapped it rank 0 unlinks it, so nothing outlives the
        processes."""
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size(group) != program.world:
            raise ValueError(f"rank programs of {program.world} need an initialised torch.distributed group of "
                             f"{program.world} ranks (e.g. kimik3.scale.launch.run_local)")
        rank = dist.get_rank(group)
        if rank != program.rank:
            raise ValueError(f"process rank {rank} was handed the program of rank {program.rank}")
        path: list[str | None] = [None]
        if rank == 0:
            root = Path(directory) if directory else Path("/dev/shm") if Path("/dev/shm").is_dir() else \
                Path(tempfile.gettempdir())
            path[0] = str(root / f"kimik3-peers-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            mem = cls(program, path[0], create=True)
        dist.broadcast_object_list(path, src=0, group=group)
        if rank != 0:
            mem = cls(program, path[0], create=False)
        dist.barrier(group)
        if rank == 0:
            os.unlink(path[0])  # every rank holds its mapping: the name is no longer needed
        return mem
