"""The cross-rank protocol of a rank program: mailboxes, per-source counters, who writes and who waits (§1.2).

Defined once, beside the ISA (``kernels/contracts/isa.py``), for the host program builder, the hazard checker, the
interpreters and the device code. Push, never pull: a producer writes its share into a MAILBOX on every rank of its
peer range (``Mode.PUSH``), then adds to its own word of the consumer's cross-rank counter; a consumer spins on its
own memory only. A cross-rank counter has one word per source rank, each written by that rank alone, so the
monotonic per-step epochs of the local counters carry over: nothing is ever reset. Why epochs and not Lamport
sentinels, and why these slot counts suffice: docs/architecture.md#megakernel-across-ranks. Standard library only.
"""

from __future__ import annotations

__all__ = ["AR_SLOTS", "MOE_SLOTS", "MAX_WORLD", "mailbox_row", "counter_words", "counter_bases",
           "wait_met", "epoch_target"]

# all-reduce mailbox slots, used in turn by the step's all-reduces: a producer may rewrite a slot two collectives
# later, when the data it pushed in between proves every peer has consumed the slot (one slot would not: a peer
# still reading collective k could see k+1 land on it)
AR_SLOTS = 2
# the LatentMoE's latent-sum mailbox: one slot, rewritten one MoE layer later, after the all-reduce in between has
# waited on every peer's FFN_OUT (the slot's only readers)
MOE_SLOTS = 1
# ranks one program may name (the peer range and the counter words are int32; 72 is one NVL72 rack)
MAX_WORLD = 128


def mailbox_row(slot: int, src: int, world: int) -> int:
    """Row of a MAILBOX (its dimension 1, the batch its dimension 0: a row is addressed as a stream entry is) that
    source rank ``src`` pushes to in ``slot``: ``slot·world + src``."""
    if not 0 <= src < world:
        raise ValueError(f"source rank {src} outside a world of {world}")
    return slot * world + src


def counter_words(sources: int) -> int:
    """Words a counter occupies in a rank's counter memory: one for a local counter (``sources`` 0), else one per
    source rank."""
    if not 0 <= sources <= MAX_WORLD:
        raise ValueError(f"a counter has 0..{MAX_WORLD} sources, got {sources}")
    return max(1, sources)


def counter_bases(sources: list[int]) -> list[int]:
    """First word of each counter in counter memory: counters laid out in table order, ``counter_words`` each."""
    out, at = [], 0
    for s in sources:
        out.append(at)
        at += counter_words(s)
    return out


def epoch_target(step: int, total: int, target: int) -> int:
    """What a wait "``target`` of ``total`` per step" needs in ``step``: every word at least ``step·total + target``
    (counters grow by ``total`` per step and per source, so a step's wait cannot be met by an earlier step)."""
    return step * total + target


def wait_met(words: list[int], base: int, sources: int, need: int) -> bool:
    """A wait on a counter starting at ``base``: every one of its words (one, or one per source) reached ``need``."""
    return all(words[base + k] >= need for k in range(counter_words(sources)))
