"""Training steps per second of K fused models against the same K one after another.

For K = 1, 2, 4, 8, 16 and three models (the digits MLP 64-128-128-10 at batch 64, a small CNN
on 8x8 digits-shaped images at batch 64, the bench's ResNet-style CNN at width 16, one block per
stage, 32x32 inputs at batch 32) it times the ways of training K models on the same batch
with SGD:

* ``sequential``: K ordinary models, one step each, one after another;
* ``vmap``: ``fusion.fuse(models, kernels=False)``: every layer batched by ``torch.func.vmap``;
* ``kernels``: ``fusion.fuse(models)``: for an ``nn.Sequential``, HFTA's direct path (Linear as
  ``torch.baddbmm``, Conv as one grouped conv, BatchNorm over K*C channels; HFTA, MLSys 2021);
  in the ResNet's residual blocks (the user's module class) vmap with the fused Linear/Conv
  kernels;
* ``handwritten`` (``--handwritten``, digits MLP only): the ceiling, stacked weights and
  ``baddbmm`` written by hand with one flat cross-entropy, no module machinery.

A step is forward, per-model cross-entropy, backward, ``SGD.step`` (one optimizer over the
fused parameters: the fused optimizers are fusopt's). The figure is *model-steps per second*
(K steps of one model count K). Methods are interleaved round by round, so the machine's load
(other engineers share its 2 cores) falls on all of them alike; the median of the rounds is
reported, with ``os.getloadavg()`` before and after each round. Run::

    python experiments/bench_fusion_kernels.py --handwritten --rounds 5 --min-time-s 0.5

Writes results.json and README.md to ``--out``
(default ``experiments/results/<date>-fusion-kernels/``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import datetime as dt
import json
import os
from pathlib import Path
import platform
import statistics
import sys
import time
from typing import Any

import optuna
import torch
from torch import nn
import torch.nn.functional as F

from waterwave_hpo import fusion
from waterwave_hpo.bench._workloads import build_resnet  # the bench's ResNet-style model

METHODS = ("sequential", "vmap", "kernels")


def digits_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 2 * 2, 64),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(64, 10),
    )


def resnet() -> nn.Module:
    return build_resnet(optuna.trial.FixedTrial({"width": 16, "blocks": 1}))


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "digits_mlp": (digits_mlp, (64, 64)),
    "small_cnn": (small_cnn, (64, 1, 8, 8)),
    "resnet": (resnet, (32, 3, 32, 32)),
}


def make_step(method: str, models: list[nn.Module], x: torch.Tensor, y: torch.Tensor) -> Any:
    """A closure doing one training step of all K models."""
    if method == "sequential":
        opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]

        def step() -> None:
            for model, opt in zip(models, opts, strict=True):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                opt.step()

        return step
    if method == "handwritten":
        return handwritten_step(models, x, y)
    fused = fusion.fuse(models, kernels=method == "kernels")
    opt = torch.optim.SGD(fused.parameters(), lr=0.01)

    def fused_step() -> None:
        opt.zero_grad(set_to_none=True)
        fusion.per_model_loss(F.cross_entropy, fused(x), y).sum().backward()
        opt.step()

    return fused_step


def handwritten_step(models: list[nn.Module], x: torch.Tensor, y: torch.Tensor) -> Any:
    """The ceiling for an MLP: HFTA's kernels written by hand (stacked weights, ``baddbmm``,
    one flat cross-entropy), no module machinery; ``models`` must be Linear/ReLU Sequentials."""
    k = len(models)
    weights = [
        torch.stack([model[i].weight.detach().t() for model in models]).requires_grad_()
        for i, layer in enumerate(models[0])
        if isinstance(layer, nn.Linear)
    ]
    biases = [
        torch.stack([model[i].bias.detach() for model in models]).unsqueeze(1).requires_grad_()
        for i, layer in enumerate(models[0])
        if isinstance(layer, nn.Linear)
    ]
    opt = torch.optim.SGD([*weights, *biases], lr=0.01)
    xs = x.unsqueeze(0).expand(k, *x.shape)
    ys = y.repeat(k)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        h = xs
        for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
            h = torch.baddbmm(b, h, w)
            if i < len(weights) - 1:
                h = torch.relu(h)
        loss = F.cross_entropy(h.reshape(-1, h.shape[-1]), ys, reduction="none")
        loss.view(k, -1).mean(1).sum().backward()
        opt.step()

    return step


def time_step(step: Any, min_time_s: float) -> float:
    """Steps per second of ``step``, after 2 warm-up steps, over at least ``min_time_s``."""
    for _ in range(2):
        step()
    n, start = 0, time.perf_counter()
    while True:
        step()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time_s and n >= 3:
            return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-time-s", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--render", action="store_true", help="only rewrite README.md of --out")
    parser.add_argument(
        "--handwritten", action="store_true", help="also time hand-written baddbmm (MLP only)"
    )
    args = parser.parse_args()
    if args.render:
        render(args.out)
        return
    torch.set_num_threads(args.threads)
    date = dt.datetime.now(dt.timezone.utc)
    out = args.out or Path("experiments/results") / f"{date:%Y-%m-%d}-fusion-kernels"
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for name in args.models:
        build, shape = MODELS[name]
        for k in args.ks:
            torch.manual_seed(0)
            models = [build() for _ in range(k)]
            x = torch.randn(*shape)
            y = torch.randint(0, 10, (shape[0],))
            methods = METHODS + (
                ("handwritten",) if args.handwritten and name == "digits_mlp" else ()
            )
            steps = {m: make_step(m, models, x, y) for m in methods}
            rates: dict[str, list[float]] = {m: [] for m in methods}
            loads = []
            for _ in range(args.rounds):
                load_before = os.getloadavg()[0]
                for method in methods:
                    rates[method].append(time_step(steps[method], args.min_time_s))
                loads.append((load_before, os.getloadavg()[0]))
            row = {
                "model": name,
                "K": k,
                **{f"{m}_model_steps_per_s": k * statistics.median(rates[m]) for m in methods},
                **{f"{m}_rounds_steps_per_s": rates[m] for m in methods},
                "loadavg_1min_before_after": loads,
            }
            seq = row["sequential_model_steps_per_s"]
            row["vmap_speedup"] = statistics.median(round_ratios(row, "vmap"))
            row["kernels_speedup"] = statistics.median(round_ratios(row, "kernels"))
            rows.append(row)
            print(
                f"{name:10s} K={k:2d} seq {seq:8.1f}  vmap {row['vmap_speedup']:.2f}x  "
                f"kernels {row['kernels_speedup']:.2f}x  load {loads}",
                flush=True,
            )
    meta = {
        "date_utc": date.isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": args.threads,
        "rounds": args.rounds,
        "min_time_s": args.min_time_s,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "command": "python " + " ".join(sys.argv),
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    render(out)


def round_ratios(row: dict[str, Any], method: str) -> list[float]:
    """Per round: the method's steps/s over sequential's in the same round (same load)."""
    pairs = zip(
        row[f"{method}_rounds_steps_per_s"], row["sequential_rounds_steps_per_s"], strict=True
    )
    return [fused / seq for fused, seq in pairs]


def render(out: Path) -> None:
    """Write README.md from results.json (median and range of the per-round speedups)."""
    data = json.loads((out / "results.json").read_text())
    meta, rows = data["meta"], data["rows"]
    lines = [
        "# Fused training: K fused models vs the same K one after another",
        "",
        f"Machine: {meta['machine']} ({meta['processor']}), {meta['cpu_count']} cores shared "
        f"with other engineers' jobs, torch {meta['torch']} with {meta['torch_threads']} "
        f"thread(s), Python {meta['python']}, {meta['date_utc']}. Command: "
        f"`{meta['command']}`. CPU only: no GPU figure.",
        "",
        "Speedup = model-steps/s of the fused module / model-steps/s of the K models trained "
        "one after another, measured in the same round (methods interleaved, so both see the "
        f"same load); median [min-max] over {meta['rounds']} rounds of >= {meta['min_time_s']} "
        "s each. A step: forward, per-model cross-entropy, backward, SGD step. The absolute "
        "sequential rate swings with the other jobs' load (1-min load average in the last "
        "column); read the ratios.",
        "",
        "| model | K | sequential model-steps/s (median) | vmap path | kernel path | "
        "hand-written baddbmm | load (1-min, per round) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        cells = []
        for method in ("vmap", "kernels", "handwritten"):
            if f"{method}_rounds_steps_per_s" not in row:
                cells.append("-")
                continue
            ratios = round_ratios(row, method)
            cells.append(f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")
        load = ", ".join(f"{a:.1f}->{b:.1f}" for a, b in row["loadavg_1min_before_after"])
        lines.append(
            f"| {row['model']} | {row['K']} | {row['sequential_model_steps_per_s']:.0f} | "
            f"{cells[0]} | {cells[1]} | {cells[2]} | {load} |"
        )
    reading = out / "reading.md"  # the interpretation, written by hand after the run
    if reading.exists():
        lines += ["", reading.read_text().rstrip()]
    (out / "README.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
