"""Optimizer step time: one fused optimizer for K models against K stock optimizers.

K copies of the digits MLP (64-128-128-10, the demo's data: 8x8 images, 10 classes) are stacked
to (K, ...) parameters; gradients are set to fixed random values, so only ``optimizer.step()`` is
timed. Methods, run alternately in each round so they see the same load:

* ``stock``: K ``torch.optim`` optimizers, one per model, torch's default implementation
  (on the CPU the single-tensor loop);
* ``stock-foreach``: the same with ``foreach=True`` (torch's multi-tensor kernels);
* ``fused``: ``waterwave_hpo.fusion.optimizer`` over the stacked parameters (HFTA's fused
  optimizer, arXiv:2102.02344), every hyperparameter a (K,) tensor.

Besides wall-clock time (distorted by the machine's load, which is recorded), the ATen operators
dispatched per step are counted: a load-independent figure of the work each method launches (on a
GPU, roughly the kernel launches). Not a GPU number.

Usage::

    python experiments/bench_fused_optim.py [--models 8] [--steps 200] [--rounds 5]
        [--out experiments/results/2026-11-23-fusion-optim]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import datetime
import json
import os
from pathlib import Path
import platform
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from waterwave_hpo import fusion

SIZES = (64, 128, 128, 10)


class _CountOps(TorchDispatchMode):
    """Counts the ATen operators dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _models(num_models: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(
            nn.Linear(SIZES[0], SIZES[1]),
            nn.ReLU(),
            nn.Linear(SIZES[1], SIZES[2]),
            nn.ReLU(),
            nn.Linear(SIZES[2], SIZES[3]),
        )
        for _ in range(num_models)
    ]


def _hparams(name: str, num_models: int) -> list[dict[str, Any]]:
    if name == "SGD":
        return [
            {"lr": 0.01 * (k + 1), "momentum": 0.9, "nesterov": k % 2 == 0, "weight_decay": 1e-4}
            for k in range(num_models)
        ]
    return [
        {"lr": 1e-3 * (k + 1), "weight_decay": 0.01 * k, "amsgrad": k % 2 == 1}
        for k in range(num_models)
    ]


def _setups(name: str, num_models: int) -> dict[str, Callable[[], None]]:
    """Each method's step function, with gradients set (the same values for every method)."""
    cls: type[torch.optim.Optimizer] = getattr(torch.optim, name)
    hparams = _hparams(name, num_models)
    gen = torch.Generator().manual_seed(1)
    models = _models(num_models)
    stacked = {
        n: nn.Parameter(torch.stack([dict(m.named_parameters())[n].detach() for m in models]))
        for n, _ in models[0].named_parameters()
    }
    for p in stacked.values():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    for k, m in enumerate(models):
        for n, p in m.named_parameters():
            p.grad = stacked[n].grad[k].clone()  # type: ignore[index]
    stock = [cls(m.parameters(), **hp) for m, hp in zip(models, hparams, strict=True)]
    models_fe = _models(num_models)
    for m, src in zip(models_fe, models, strict=True):
        for p, q in zip(m.parameters(), src.parameters(), strict=True):
            p.grad = q.grad.clone()  # type: ignore[union-attr]
    stock_fe = [
        cls(m.parameters(), foreach=True, **hp) for m, hp in zip(models_fe, hparams, strict=True)
    ]
    fused = fusion.optimizer(cls, list(stacked.values()), hparams)

    def step_all(opts: list[torch.optim.Optimizer]) -> Callable[[], None]:
        def run() -> None:
            for opt in opts:
                opt.step()

        return run

    return {"stock": step_all(stock), "stock-foreach": step_all(stock_fe), "fused": fused.step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "cpu": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "models": args.models,
        "sizes": SIZES,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "loadavg_before": os.getloadavg(),
        "optimizers": {},
    }
    for name in ("SGD", "AdamW"):
        steps = _setups(name, args.models)
        ops = {}
        for method, run in steps.items():
            run()  # warm-up; state created
            with _CountOps() as counter:
                run()
            ops[method] = counter.count
        times: dict[str, list[float]] = {m: [] for m in steps}
        for _ in range(args.rounds):
            for method, run in steps.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    run()
                times[method].append((time.perf_counter() - start) / args.steps * 1e6)
        result["optimizers"][name] = {
            "aten_ops_per_step": ops,
            "step_us_per_round": times,
            "step_us_median": {m: statistics.median(t) for m, t in times.items()},
        }
        med = result["optimizers"][name]["step_us_median"]
        print(name, {m: f"{v:.0f} us" for m, v in med.items()}, "ops/step", ops)
    result["loadavg_after"] = os.getloadavg()
    print("load", result["loadavg_before"], "->", result["loadavg_after"])
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
