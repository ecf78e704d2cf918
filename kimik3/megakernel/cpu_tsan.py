"""ThreadSanitizer runs of the CPU megakernel executor: dump a case, run it in a standalone TSan build.

Why a standalone driver: TSan inside a Python process with PyTorch loaded reports races in code it cannot see
(thread pools, allocator caches). The driver (``cpu_tsan_driver.cpp``) compiles the executor's own source with
``-fsanitize=thread`` and replays a dumped case: the encoded program, every buffer's bytes after prefill, and the
token ids / positions of each step. It writes each step's logits and greedy tokens back, so a run proves two
things at once: TSan saw no data race (every conflicting pair of accesses is ordered by the counters'
acquire/release, or by program order on one worker), and the result is the native executor's.

A program with one wait removed (the hazard checker's mutants) must then fail one way or the other: TSan reports
the unordered pair, or the result differs (activations are poisoned before each step, so an early read shows).
The ranks of a deployment are one case each, run together by one driver process (:func:`run_tsan` on a list).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kimik3.megakernel.cpu import SIMD_SOURCE, SOURCE, TSAN_FLAGS, CPUMegakernel, _build, model_params
from kimik3.megakernel.instructions import Program, encode_program

__all__ = ["DRIVER", "TsanResult", "build_tsan_driver", "dump_case", "run_tsan"]

DRIVER = Path(__file__).with_name("cpu_tsan_driver.cpp")


@dataclass
class TsanResult:
    returncode: int
    races: int  # number of "WARNING: ThreadSanitizer: data race" reports
    stderr: str
    logits: torch.Tensor | None  # [steps, B, V] fp32 (the steps that completed; rank 0's of several)
    next_tokens: torch.Tensor | None  # [steps, B]
    per_rank: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None  # (logits, next) by rank

    @property
    def clean(self) -> bool:
        return self.returncode == 0 and self.races == 0


def build_tsan_driver() -> Path:
    """The TSan build of the driver (cached like the executor library)."""
    return _build("tsan", TSAN_FLAGS, [DRIVER, SOURCE, SIMD_SOURCE], "mk_tsan_driver", shared=False)


def dump_case(runner: CPUMegakernel, directory: str | Path, ids: torch.Tensor, positions: torch.Tensor,
              program: Program | None = None, timeout_s: float = 20.0) -> Path:
    """Write a case for the driver: ``runner``'s buffers as they are now (bind the state first), its program or
    ``program`` (same buffers, e.g. a mutant), and ``ids`` / ``positions`` ``[steps, B]``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    p = program if program is not None else runner.program
    if p.buffers != runner.program.buffers:
        raise ValueError("the program to dump must declare the runner's buffers")
    if ids.shape != positions.shape or ids.dim() != 2 or ids.shape[1] != p.batch:
        raise ValueError(f"ids and positions must both be [steps, {p.batch}], got {list(ids.shape)} and "
                         f"{list(positions.shape)}")
    encode_program(p).numpy().tofile(d / "program.i32")
    torch.tensor(model_params(runner.model), dtype=torch.float64).numpy().tofile(d / "params.f64")
    for i, spec in enumerate(p.buffers):
        t = runner.tensors[spec.name].contiguous()
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        raw.numpy().tofile(d / f"buf{i}.bin")
    meta = [ids.shape[0], p.buffer_id("ids"), p.buffer_id("pos"), p.buffer_id("logits"), p.buffer_id("next_token"),
            int(timeout_s * 1000)]
    torch.tensor(meta, dtype=torch.int64).numpy().tofile(d / "meta.i64")
    ids.to(torch.int64).contiguous().numpy().tofile(d / "ids.i64")
    positions.to(torch.int64).contiguous().numpy().tofile(d / "pos.i64")
    return d


def run_tsan(directory: str | Path | Sequence[str | Path], timeout_s: float = 300.0) -> TsanResult:
    """Run the TSan driver on a dumped case — or on one case per rank, in rank order, run together — parse the race
    reports and read the results back."""
    dirs = [Path(directory)] if isinstance(directory, (str, Path)) else [Path(d) for d in directory]
    exe = build_tsan_driver()
    env = dict(os.environ)
    # a report must not stop the run (the results are still compared) and must show in the exit code
    env["TSAN_OPTIONS"] = "halt_on_error=0 exitcode=66 history_size=4 " + env.get("TSAN_OPTIONS", "")
    res = subprocess.run([str(exe), *map(str, dirs)], capture_output=True, text=True, env=env, timeout=timeout_s)
    if "FATAL: ThreadSanitizer" in res.stderr:
        raise RuntimeError(f"ThreadSanitizer could not run here:\n{res.stderr[-2000:]}")
    races = res.stderr.count("WARNING: ThreadSanitizer: data race")
    per_rank = [_results(d) for d in dirs]
    return TsanResult(res.returncode, races, res.stderr, *per_rank[0], per_rank if len(dirs) > 1 else None)


def _results(d: Path) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A case's logits [steps, B, V] and next tokens [steps, B] as the driver wrote them (None: none)."""
    meta = torch.from_file(str(d / "meta.i64"), size=6, dtype=torch.int64).tolist()
    prog = torch.from_file(str(d / "program.i32"), size=(d / "program.i32").stat().st_size // 4,
                           dtype=torch.int32)
    from kimik3.megakernel.instructions import decode_program

    p = decode_program(prog)
    B, V = p.batch, p.buffers[meta[3]].shape[2]
    logits = nxt = None
    lf, nf = d / "logits.f32", d / "next.i64"
    if lf.exists() and lf.stat().st_size:
        n = lf.stat().st_size // 4
        logits = torch.from_file(str(lf), size=n, dtype=torch.float32).view(-1, B, V).clone()
        nxt = torch.from_file(str(nf), size=nf.stat().st_size // 8, dtype=torch.int64).view(-1, B).clone()
    return logits, nxt
