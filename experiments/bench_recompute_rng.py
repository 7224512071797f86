"""What replaying a recomputed unit's random numbers costs: step time, three ways, on the CPU.

* ``bare``: the model without a plan;
* ``rng_restore``: ``checkpoint_sqrt`` recomputing through ``torch.utils.checkpoint`` with
  ``preserve_rng_state=True`` (the first code: wrong under co-hosting);
* ``replay``: the same plan with the random results recorded in forward and replayed
  (``waterwave_hpo/planning/_rng.py``: two dispatch modes around every recompute unit).

An MLP of 8 blocks (Linear 256 -> GELU -> Dropout 0.1), batch 64, one intra-op thread::

    python experiments/bench_recompute_rng.py --steps 60 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import torch
from torch import nn
import torch.utils.checkpoint

import waterwave_hpo as ww


def _model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Dropout(0.1)) for _ in range(8)]
    return nn.Sequential(*blocks, nn.Linear(256, 10))


def _ms_per_step(model: nn.Module, x: torch.Tensor, steps: int) -> float:
    for _ in range(5):
        model(x).sum().backward()
    started = time.perf_counter()
    for _ in range(steps):
        model.zero_grad()
        model(x).sum().backward()
    return (time.perf_counter() - started) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    x = torch.randn(64, 256)
    real = torch.utils.checkpoint.checkpoint

    def rng_restore(fn: Any, *a: Any, **k: Any) -> Any:
        k.pop("context_fn", None)
        k["preserve_rng_state"] = True
        return real(fn, *a, **k)

    results: dict[str, list[float]] = {"bare": [], "rng_restore": [], "replay": []}
    for _ in range(args.repeats):
        for name in results:
            model = _model()
            if name != "bare":
                ww.fit_memory(model, 1 << 40, example_input=x, planner="checkpoint_sqrt")
            torch.utils.checkpoint.checkpoint = rng_restore if name == "rng_restore" else real
            try:
                results[name].append(round(_ms_per_step(model, x, args.steps), 2))
            finally:
                torch.utils.checkpoint.checkpoint = real
    print(
        json.dumps(
            {
                "ms_per_step": results,
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only",
                "torch": torch.__version__,
                "loadavg": open("/proc/loadavg").read().split()[:3],
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
