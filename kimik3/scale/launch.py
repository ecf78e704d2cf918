"""Start ``world`` local CPU processes as one ``torch.distributed`` (gloo) group and bring their results back.

The one launcher of the multi-process runs (expert parallelism, the megakernel's ranks): why not torchrun — tests
and notebooks need the results back as objects and a hard deadline. The ranks rendezvous through a file store in
a private temporary folder (no port to pick; gloo's own connections are pinned to loopback); the function each
rank runs is named ``"module:function"`` (spawned processes import it) and receives that folder as ``workdir``
when it asks for it. After ``timeout_s`` in all, the parent kills any process it started and raises
TimeoutError; a rank that raises makes this raise with its traceback. See docs/architecture.md (map).
"""

from __future__ import annotations

import datetime
import importlib
import inspect
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_local", "seeded_prompt"]


def seeded_prompt(vocab: int, batch: int, prompt_len: int, seed: int) -> torch.Tensor:
    """The same random prompt on every rank of a run (its own generator: independent of the weight init stream)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(0, vocab, (batch, prompt_len), generator=gen)


def _worker(rank: int, world: int, target: str, store_path: str, out_dir: str, kwargs: dict[str, Any],
            timeout_s: float) -> None:
    """Body of one process: one torch thread, loopback-only gloo, the target's result saved for the parent."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's data connections stay on the loopback interface
    torch.set_num_threads(1)
    module, name = target.split(":")
    fn = getattr(importlib.import_module(module), name)
    if "workdir" in inspect.signature(fn).parameters:
        kwargs = dict(kwargs, workdir=out_dir)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        res = fn(**kwargs)
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while another still runs
    finally:
        dist.destroy_process_group()


def run_local(world: int, target: str, timeout_s: float, prefix: str = "kimik3-", **kwargs: Any
              ) -> list[dict[str, Any]]:
    """Run ``target(**kwargs)`` (``"module:function"``) on ``world`` freshly spawned processes; a result per rank."""
    import torch.multiprocessing as mp

    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.start_processes(_worker, args=(world, target, store, tmp, kwargs, timeout_s), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"run_local: {world} ranks did not finish within {timeout_s:.0f} s")
        finally:
            for p in ctx.processes:  # only the processes this call started
                if p.is_alive():
                    p.kill()
                    p.join(5)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]
