"""The megakernel's ranks as real processes on the CPU: a greedy run per rank, and the W = 2 vs W = 1 benchmark.

:func:`run_rank` is what each process of :func:`kimik3.scale.launch.run_local` runs: stage ``megakernel-cpu`` with
``world = W`` (its program's collectives through the shared segment of :mod:`kimik3.megakernel.peer_memory`),
greedy from a seeded prompt, with the launch's wall time, the time its workers spent waiting on peers and the last
step's measured timeline; rank 0 also decodes with ``naive`` in the same process for the comparison.
``python -m kimik3.megakernel.cpu_ranks`` measures, in one sitting, ``W`` ranks of one worker each against one
process of ``W`` workers and writes the figures with their provenance (no figure is typed in).
See docs/architecture.md#megakernel-across-ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import torch
import torch.distributed as dist

from kimik3.scale.launch import run_local, seeded_prompt

__all__ = ["run_rank", "run_ranks", "bench", "main"]

RUN_TIMEOUT_S = 600.0


def _spread(xs: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(xs, n=10) if len(xs) > 1 else [xs[0]] * 9
    return {"median": statistics.median(xs), "p10": qs[0], "p90": qs[-1], "min": min(xs), "n": len(xs)}


@torch.no_grad()
def _greedy(dec: Any, prompt: torch.Tensor, steps: int, feed: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, list[torch.Tensor], list[float], list[float]]:
    """Tokens [B, steps + 1] (prefill's first), the logits, the launch seconds and cross-rank wait seconds per
    step. ``feed`` [B, steps + 1]: teacher-force these tokens instead of the run's own."""
    logits = dec.prefill(prompt)
    toks, out, launch, waited = [logits.argmax(-1)], [logits], [], []
    runner = getattr(dec.stage, "runner", None)
    for s in range(steps):
        logits = dec.step(toks[-1] if feed is None else feed[:, s])
        toks.append(logits.argmax(-1))
        out.append(logits)
        if runner is not None:
            launch.append(runner.last_step_s)
            waited.append(float(runner.peer_wait_ns().sum()) * 1e-9)
    return torch.stack(toks, 1), out, launch, waited


def run_rank(preset: str = "micro", batch: int = 1, steps: int = 32, seed: int = 0, prompt_len: int = 4,
             workers: int = 1, pin: bool = True, reference: bool = True) -> dict[str, Any]:
    """One rank's greedy run (inside an initialised group; fp32 weights from ``kimik3.from_preset``)."""
    from kimik3 import Decoder, from_preset
    from kimik3.validation.metric import rel_error

    rank, world = dist.get_rank(), dist.get_world_size()
    model = from_preset(preset, seed=seed, dtype=torch.float32)
    prompt = seeded_prompt(model.config.vocab_size, batch, prompt_len, seed)
    max_len = prompt_len + steps + 1
    dec = Decoder(model, "megakernel-cpu", batch_size=batch, max_seq_len=max_len, num_sms=workers, world=world,
                  pin=pin)
    ref = feed = None
    if reference:  # naive first (rank 0), so every rank is fed naive's greedy tokens (teacher-forced)
        feed = torch.zeros(batch, steps + 1, dtype=torch.int64)
        if rank == 0:
            ref = _greedy(Decoder(model, "naive", batch_size=batch, max_seq_len=max_len), prompt, steps)
            feed.copy_(ref[0])
        dist.broadcast(feed, src=0)
    tokens, logits, launch, waited = _greedy(dec, prompt, steps, feed)
    runner = dec.stage.runner
    tl = runner.timeline()
    tl["peer_wait_ns"] = runner.peer_wait_ns().numpy()
    out = {"rank": rank, "world": world, "preset": preset, "batch": batch, "steps": steps, "workers": workers,
           "tokens": tokens, "launch_s": launch, "peer_wait_s": waited, "timeline": tl.to_dict("list"),
           "next_token_agrees": bool(torch.equal(runner.tensors["next_token"][:, 0, 0], tokens[:, -1]))}
    out["logits"] = torch.stack(logits)
    if ref is not None:
        out["reference_tokens"] = ref[0]
        out["tokens_match"] = bool(torch.equal(ref[0], tokens))
        out["errors"] = [rel_error(a, b) for a, b in zip(logits, ref[1])]
    return out


def run_ranks(world: int, timeout_s: float = RUN_TIMEOUT_S, **kwargs: Any) -> list[dict[str, Any]]:
    """:func:`run_rank` on ``world`` fresh processes (:func:`kimik3.scale.launch.run_local`)."""
    return run_local(world, "kimik3.megakernel.cpu_ranks:run_rank", timeout_s, prefix="kimik3-mk-", **kwargs)


def bench(preset: str = "tiny", batch: int = 1, steps: int = 32, world: int = 2, seed: int = 0,
          pin: bool = True) -> dict[str, Any]:
    """``world`` ranks of one worker each (processes) against one process of ``world`` workers, same weights,
    measured in one call: per-step launch time (median, p10, p90) and the share of worker time spent waiting on
    peers (Σ cross-rank wait / (workers × launch time))."""
    from kimik3 import Decoder, from_preset
    from kimik3.perf.provenance import provenance

    model = from_preset(preset, seed=seed, dtype=torch.float32)
    prompt = seeded_prompt(model.config.vocab_size, batch, 4, seed)
    one = Decoder(model, "megakernel-cpu", batch_size=batch, max_seq_len=4 + steps + 1, num_sms=world, pin=pin)
    tok1, _, launch1, _ = _greedy(one, prompt, steps)
    ranks = run_ranks(world, preset=preset, batch=batch, steps=steps, seed=seed, workers=1, pin=pin,
                      reference=False)
    same = all(torch.equal(r["tokens"], tok1) for r in ranks)
    warm = slice(1, None)  # the first step pays first-touch costs in both runs
    per_rank = []
    for r in ranks:
        share = [w / (t * r["workers"]) for w, t in zip(r["peer_wait_s"][warm], r["launch_s"][warm])]
        per_rank.append({"rank": r["rank"], "launch_s": _spread(r["launch_s"][warm]),
                         "peer_wait_share": _spread(share)})
    step_w = [max(ts) for ts in zip(*(r["launch_s"][warm] for r in ranks))]  # a step ends when its last rank does
    one_s = _spread(launch1[warm])
    base = {"block": "step:ranks", "stage": "megakernel-cpu", "preset": preset, "batch_size": batch,
            "dtype": "float32", "steps_timed": len(step_w), "clock": "wall-clock, the launch alone"}
    records = [dict(base, world=1, workers=world, seconds=one_s["median"], p10_s=one_s["p10"], p90_s=one_s["p90"]),
               dict(base, world=world, workers=1, seconds=statistics.median(step_w), p10_s=_spread(step_w)["p10"],
                    p90_s=_spread(step_w)["p90"], per_rank=per_rank)]
    return {"kind": "megakernel-ranks", **provenance("cpu"), "source": "kimik3.megakernel.cpu_ranks",
            "what": f"{preset} batch {batch}, {steps} greedy steps, fp32: {world} ranks x 1 worker (processes, "
                    f"shared-memory mailboxes) against 1 process x {world} workers, the first step left out",
            "ratio_median": records[1]["seconds"] / records[0]["seconds"], "tokens_identical": same,
            "records": records}


def main(argv: list[str] | None = None) -> int:
    """``python -m kimik3.megakernel.cpu_ranks``: the ranks-vs-one-process benchmark, printed and (``--out``)
    written as JSON with its provenance. Exit status 1 when the two runs' tokens differ."""
    from kimik3.kernels.contracts.peers import MAX_WORLD
    from kimik3.megakernel.cpu import MAX_BATCH
    from kimik3.util.args import MAX_STEPS, bounded_int, output_file
    from kimik3.util.files import atomic_write_text
    from kimik3.util.text import refuse

    ap = argparse.ArgumentParser(prog="python -m kimik3.megakernel.cpu_ranks", description=main.__doc__)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=bounded_int(1, MAX_BATCH), default=1)
    ap.add_argument("--steps", type=bounded_int(2, MAX_STEPS), default=32)
    ap.add_argument("--world", type=bounded_int(2, MAX_WORLD), default=2)
    ap.add_argument("--no-pin", action="store_true", help="leave workers unpinned")
    ap.add_argument("--out", type=output_file, default=None, help="write the result here (JSON)")
    args = ap.parse_args(argv)
    try:
        res = bench(args.preset, args.batch, args.steps, args.world, pin=not args.no_pin)
    except ValueError as e:  # an unknown preset, a world the model does not divide into, no compiler, ...
        return refuse(ap.prog, e)
    one, many = res["records"]
    print(res["what"])
    for r, name in ((one, f"1 process x {args.world} workers"), (many, f"{args.world} ranks x 1 worker")):
        print(f"  {name}: {r['seconds'] * 1e3:.2f} ms/step (p10 {r['p10_s'] * 1e3:.2f}, p90 {r['p90_s'] * 1e3:.2f}, "
              f"{r['steps_timed']} steps)")
    print(f"  ratio of medians {res['ratio_median']:.2f}")
    for pr in many["per_rank"]:
        print(f"  rank {pr['rank']}: waits on peers {pr['peer_wait_share']['median']:.0%} of its step (median)")
    print(f"  tokens identical: {res['tokens_identical']}")
    if args.out:
        atomic_write_text(args.out, json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0 if res["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
