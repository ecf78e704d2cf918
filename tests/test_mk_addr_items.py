"""The GEMV opcodes' work items (``kimik3.kernels.contracts.addr.gemv_item``): item ``k`` of a GEMV instruction over
``n`` weight rows in ``nbt`` batch passes is a (weight row, pass) pair; warp ``w`` takes items ``w, w + NW, ...``
(``kernels/megakernel/gemv.py``). The mapping must cover every (row, pass) exactly once (a pair twice is a double
store, a missing one an output never written), go pass by pass (the warps share one pass's x rows), and within a pass
give each warp ascending rows (LM_HEAD's running arg-max keeps the first of equal scores by that order). Wrong mappings
planted here, and one planted in a copy of ``kernels/contracts/addr.py``, must be reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kimik3.kernels.contracts.addr import (
    GEMV_GROUP_PASSES,
    gemv_batch_tile,
    gemv_group_passes,
    gemv_group_row,
    gemv_groups,
    gemv_item,
    gemv_tile_rows,
    gemv_tiles,
)
from kimik3.kernels.megakernel.device_fns import NW
from kimik3.kernels.verify.host_exec import load_mutant

Item = Callable[[int, int, int], tuple[Any, Any]]

# row counts below, at and above one round of the warps, and not multiples of it; pass counts of real batches
# (B // gemv_batch_tile(B): 1 up to batch 8, 2 at 16, 8 at 64, 3 at 9, 11 at 11) and a few more
ROWS = (1, 5, NW - 1, NW, NW + 1, 2 * NW + 5, 100)
PASSES = tuple(sorted({1, 2, 3, 5, 8} | {b // gemv_batch_tile(b) for b in (1, 8, 9, 11, 16, 64)}))


def item_problems(item: Item, n: int, nbt: int) -> list[str]:
    """What is wrong with the work-item mapping ``item`` over ``n`` rows and ``nbt`` passes (empty: nothing)."""
    pairs = [item(k, n, nbt) for k in range(n * nbt)]
    out: list[str] = []
    bad = [(k, p) for k, p in enumerate(pairs) if not (0 <= p[0] < n and 0 <= p[1] < nbt)]
    if bad:
        return [f"items outside rows [0, {n}) x passes [0, {nbt}): {bad[:4]}"]
    seen: dict[tuple[int, int], int] = {}
    for k, (j, t) in enumerate(pairs):
        if (j, t) in seen:
            out.append(f"(row {j}, pass {t}) at items {seen[(j, t)]} and {k}")
        seen[(j, t)] = k
    missing = [(j, t) for t in range(nbt) for j in range(n) if (j, t) not in seen]
    if missing:
        out.append(f"{len(missing)} (row, pass) pairs never computed, e.g. {missing[:4]}")
    late = [k for k in range(1, len(pairs)) if pairs[k][1] < pairs[k - 1][1]]
    if late:
        k = late[0]
        out.append(f"item {k} goes back to pass {pairs[k][1]} after item {k - 1} in pass {pairs[k - 1][1]}")
    for w in range(NW):
        mine = pairs[w::NW]
        down = [(a, b) for a, b in zip(mine, mine[1:]) if a[1] == b[1] and b[0] <= a[0]]
        if down:
            out.append(f"warp {w}: rows not ascending within a pass: {down[0][0]} then {down[0][1]}")
    return out


@pytest.mark.parametrize("nbt", PASSES)
@pytest.mark.parametrize("n", ROWS)
def test_gemv_items_cover_each_row_and_pass_once_in_pass_order(n: int, nbt: int) -> None:
    assert item_problems(gemv_item, n, nbt) == []


def test_one_pass_is_the_row() -> None:
    """Up to batch 8 there is one pass: the item is the row, no pass arithmetic (the device loop stays minimal)."""
    assert [gemv_item(k, 7, 1) for k in range(7)] == [(k, 0) for k in range(7)]


@pytest.mark.parametrize("batch", [1, 3, 7, 8, 16, 33, 64])
def test_tiles_cover_the_box_rows(batch: int) -> None:
    """From batch 8 the GEMV opcodes take the tensor-core path: items are 16-row tiles (``megakernel.mma.MMA_ROWS``;
    ``contracts.addr`` cannot import it), the tiles cover every row and none starts past the box. Below: one row per
    item."""
    from kimik3.kernels.megakernel.mma import MMA_ROWS

    tr = gemv_tile_rows(batch)
    assert tr == (MMA_ROWS if batch >= 8 else 1)
    for n in ROWS:
        nt = gemv_tiles(n, tr)
        assert (nt - 1) * tr < n <= nt * tr, (n, tr, nt)


def group_problems(row: Callable[[int, int, int, int], int], batch: int, sources: int) -> list[str]:
    """What is wrong with the tensor-core GEMV's pass groups at ``batch`` (``row``: the device's ``gemv_group_row``):
    every batch row must be one (group, pass, column) exactly once, and the rows past the batch (read clamped, never
    stored) only in the last pass of the last group."""
    P, ng = gemv_group_passes(batch, sources), gemv_groups(batch, sources)
    seen: dict[int, tuple[int, int, int]] = {}
    out: list[str] = []
    for t in range(ng):
        for p in range(P):
            for c in range(8):
                b = row(t, p, c, P)
                if b < 0:
                    out.append(f"group {t} pass {p} column {c}: row {b}")
                elif b < batch:
                    if b in seen:
                        out.append(f"batch row {b} at {seen[b]} and {(t, p, c)}")
                    seen[b] = (t, p, c)
    missing = [b for b in range(batch) if b not in seen]
    if missing:
        out.append(f"batch rows never computed: {missing[:4]}")
    if P > GEMV_GROUP_PASSES[sources]:
        out.append(f"{P} passes per group for {sources} weights: over the register budget's "
                   f"{GEMV_GROUP_PASSES[sources]}")
    return out


@pytest.mark.parametrize("sources", [1, 2])
def test_pass_groups_cover_every_batch_row_once(sources: int) -> None:
    """Batch 8 to 64 (every width, odd ones included): each row computed once, in as few groups as the register
    budget allows (one read of a weight tile per group: a single group up to 32 rows for one weight, 16 for two)."""
    for batch in range(8, 65):
        assert group_problems(gemv_group_row, batch, sources) == [], batch
        passes = -(-batch // 8)
        assert gemv_groups(batch, sources) == -(-passes // GEMV_GROUP_PASSES[sources])
    assert [gemv_groups(b, 1) for b in (8, 32, 33, 64)] == [1, 1, 2, 2]
    assert [gemv_groups(b, 2) for b in (8, 16, 17, 64)] == [1, 1, 2, 4]


def test_planted_group_row_is_caught() -> None:
    """The check reads the real function: a pass stride off by one planted in a copy of ``kernels/contracts/addr.py``
    (passes overlapping, the group's last rows lost) and a group stride that forgets the passes fail it."""
    good = "    return (group * passes + p) * GEMV_BT + col\n"
    for bad, expect in (("    return (group * passes + p) * (GEMV_BT - 1) + col\n", "at"),
                        ("    return (group + p) * GEMV_BT + col\n", "at")):
        mutant = load_mutant("contracts.addr", [(good, bad)])
        found = [q for b in (16, 33, 64) for q in group_problems(mutant.gemv_group_row, b, 2)]
        assert found and any(expect in q for q in found), (bad, found[:3])


def test_the_warps_are_twelve() -> None:
    assert NW == 12  # 384 threads per CTA (isa.CTA_THREADS); the row counts above straddle one round of them


PLANTED: dict[str, tuple[Item, str]] = {
    # every pair once, but row by row: a warp's consecutive items switch x rows (passes) and come back
    "row-major": (lambda k, n, nbt: (k // nbt, k % nbt), "goes back to pass"),
    # pass by pass, every pair once, rows descending within a pass
    "rows-descending": (lambda k, n, nbt: (n - 1 - k % n, k // n), "not ascending"),
    # the pass stride off by one: rows of pass t spill into the next pass, the last row of each pass lost
    "pass-stride": (lambda k, n, nbt: (k % n, k // (n + 1)), "never computed"),
    # the one-pass shortcut taken for every pass count: passes 1.. never computed, rows out of range
    "always-one-pass": (lambda k, n, nbt: (k, 0), "outside rows"),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_mapping_is_caught(name: str) -> None:
    item, expect = PLANTED[name]
    found = [p for n in ROWS for nbt in PASSES if nbt > 1 or name == "rows-descending"
             for p in item_problems(item, n, nbt)]
    assert found, f"planted mapping {name} not caught"
    assert any(expect in p for p in found), (name, found[:3])


def test_planted_mapping_in_mk_addr_is_caught() -> None:
    """The check reads the real function: the same mapping planted in a copy of ``kernels/contracts/addr.py`` fails it.
    """
    mutant = load_mutant("contracts.addr", [("    return k % n, k // n\n", "    return k // nbt, k % nbt\n")])
    assert item_problems(mutant.gemv_item, NW + 1, 2)
    assert item_problems(gemv_item, NW + 1, 2) == []
