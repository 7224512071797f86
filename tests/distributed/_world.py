"""Run a function on every rank of a real gloo group of spawned CPU processes."""

from __future__ import annotations

from collections.abc import Callable
import os
from pathlib import Path
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(
    rank: int, world_size: int, init_file: str, fn: Callable[[int, int], Any], out_dir: str
) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        torch.manual_seed(0)
        result = fn(rank, world_size)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    # The rank's work is done and saved. Skip the interpreter's finalization: with gloo's C++
    # threads still being torn down it can abort ("terminate called without an active
    # exception", seen once in CI on torch 2.15; see pytorch/pytorch#179291), which mp.spawn
    # reports as a failed rank although every result was recorded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_world(fn: Callable[[int, int], Any], world_size: int, tmp_path: Path) -> list[Any]:
    """``fn(rank, world_size)`` on ``world_size`` spawned processes in one gloo group.

    ``fn`` must be importable (a module-level function). Returns every rank's result.
    """
    init_file = tmp_path / "rendezvous"
    mp.spawn(
        _entry,
        args=(world_size, str(init_file), fn, str(tmp_path)),
        nprocs=world_size,
        join=True,
    )
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
