"""Fused trials (HFTA, arXiv:2102.02344) against one after another and co-hosting.

Every method runs the same trials (a seeded random sampler: the same parameters in the same
order whatever the batching) of one model structure on scikit-learn's digits, through
``WaterwaveExecutor``, so the executor's overhead is the same for all::

    python experiments/bench_fusion.py --models mlp cnn --ks 1 2 4 8 16 --trials 16 --rounds 3

Measured, in one process, methods interleaved round by round (so they share the load):

* trials per hour (``--threads`` intra-op threads, default 1, for every method): ``--trials``
  trials of ``--epochs`` epochs each, one after another
  (``trials_per_device=1``), co-hosted (``trials_per_device=K`` threads), and fused
  (``fuse=K`` on one slot: each batch trained as one fused model). Median over ``--rounds``;
  ratios to one-after-another are taken within each round.
* memory per trial, in bytes (exact, not sampled): parameters + gradients + optimizer state +
  the tensors autograd saves for backward in one training step (``saved_tensors_hooks``,
  unique storages), for one model and for K fused, divided by K.
* search quality: best validation accuracy over the same trial budget, TPE + median pruner,
  fused ``K=8`` against one after another, for 3 seeds.

Writes results.json, README.md and fusion_*.png to ``--out`` (default
``experiments/results/<date>-fusion/``). A shared 2-core CPU says little about a GPU: the load
average is recorded beside every timed figure.
"""

from __future__ import annotations

import argparse
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

import waterwave_hpo as ww
from waterwave_hpo import fusion
from waterwave_hpo.demo import FixedModel
from waterwave_hpo.demo import build_fixed_model
from waterwave_hpo.demo import load_digits
from waterwave_hpo.demo import make_fused_objective
from waterwave_hpo.demo import make_unfused_objective

BATCH = 64


def _study(seed: int, pruned: bool = False, tpe: bool = False) -> optuna.Study:
    sampler: optuna.samplers.BaseSampler = (
        optuna.samplers.TPESampler(seed=seed, constant_liar=True)
        if tpe
        else optuna.samplers.RandomSampler(seed=seed)
    )
    pruner = (
        optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1)
        if pruned
        else optuna.pruners.NopPruner()
    )
    return optuna.create_study(direction="maximize", sampler=sampler, pruner=pruner)


def _run(method: str, k: int, model: FixedModel, trials: int, epochs: int, seed: int) -> float:
    """Seconds to run ``trials`` trials with ``method`` at ``k``."""
    data = load_digits()
    study = _study(seed)
    if method == "fused":
        executor = ww.WaterwaveExecutor("cpu", trials_per_device=1, fuse=k)
        func: Any = make_fused_objective(data, epochs, seed, model)
    else:
        executor = ww.WaterwaveExecutor("cpu", trials_per_device=1 if method == "one" else k)
        func = make_unfused_objective(data, epochs, seed, model)
    started = time.perf_counter()
    executor.optimize(study, func, n_trials=trials)
    seconds = time.perf_counter() - started
    states = {t.state for t in study.trials}
    assert states == {optuna.trial.TrialState.COMPLETE}, states
    return seconds


def throughput(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for model in args.models:
        kind = FixedModel(model)
        cells = [("one", 1)] + [("fused", k) for k in args.ks]
        cells += [("cohosted", k) for k in args.cohost_ks]
        _run("fused", 2, kind, 2, 1, 0)  # warm-up: first-use costs of torch.func / kernels
        per_round: dict[tuple[str, int], list[float]] = {cell: [] for cell in cells}
        loads: list[float] = []
        for _ in range(args.rounds):
            for cell in cells:
                per_round[cell].append(_run(*cell, kind, args.trials, args.epochs, args.seed))
                loads.append(os.getloadavg()[0])
        for (method, k), seconds in per_round.items():
            ratios = [one / s for one, s in zip(per_round[("one", 1)], seconds, strict=True)]
            rows.append(
                {
                    "model": model,
                    "method": method,
                    "k": k,
                    "seconds": seconds,
                    "trials_per_hour_median": 3600 * args.trials / statistics.median(seconds),
                    "speedup_vs_one_per_round": ratios,
                    "speedup_vs_one_median": statistics.median(ratios),
                    "load1_during": [min(loads), max(loads)],
                }
            )
            rate = 3600 * args.trials / statistics.median(seconds)
            print(
                f"{model:4} {method:9} K={k:2}: {rate:8.0f}"
                f" trials/h, x{statistics.median(ratios):.2f} vs one after another "
                f"(rounds {', '.join(f'{r:.2f}' for r in ratios)})",
                flush=True,
            )
    return rows


def _step_bytes(module: nn.Module, optimizer: torch.optim.Optimizer, step: Any) -> int:
    """Bytes of parameters, gradients, optimizer state and saved activations of one step."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    optimizer.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    optimizer.step()
    parameters = {id(p): p for p in module.parameters()}
    param_ids = {p.untyped_storage().data_ptr() for p in parameters.values()}
    activations = sum(n for ptr, n in saved.items() if ptr not in param_ids)
    weights = sum(p.nbytes for p in parameters.values())
    grads = sum(p.grad.nbytes for p in parameters.values() if p.grad is not None)
    state = sum(
        v.nbytes
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return int(weights + grads + state + activations)


def memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    data = load_digits()
    x, y = data.x_train[:BATCH], data.y_train[:BATCH]
    hyper = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
    for model in args.models:
        kind = FixedModel(model)
        single = build_fixed_model(kind, 0.1)
        opt = torch.optim.SGD(single.parameters(), **hyper)
        one = _step_bytes(single, opt, lambda m=single: nn.functional.cross_entropy(m(x), y))
        for k in args.ks:
            fused = fusion.fuse([build_fixed_model(kind, 0.1) for _ in range(k)])
            fopt = fusion.optimizer(torch.optim.SGD, fused, [hyper] * k)
            total = _step_bytes(
                fused,
                fopt,
                lambda f=fused: fusion.per_model_loss(
                    nn.functional.cross_entropy, f(x), y, target_stacked=False
                ).sum(),
            )
            rows.append(
                {
                    "model": model,
                    "k": k,
                    "one_model_bytes": one,
                    "fused_total_bytes": total,
                    "fused_per_trial_bytes": total // k,
                    "per_trial_ratio": total / k / one,
                }
            )
            print(f"{model:4} K={k:2}: {total // k} B per trial fused, {one} B alone", flush=True)
    return rows


def quality(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    data = load_digits()
    kind = FixedModel(args.quality_model)
    for seed in range(3):
        for method in ("one", "fused"):
            study = _study(seed, pruned=True, tpe=True)
            if method == "fused":
                executor = ww.WaterwaveExecutor("cpu", trials_per_device=1, fuse=8)
                func: Any = make_fused_objective(data, args.quality_epochs, seed, kind)
            else:
                executor = ww.WaterwaveExecutor("cpu", trials_per_device=1)
                func = make_unfused_objective(data, args.quality_epochs, seed, kind)
            started = time.perf_counter()
            executor.optimize(study, func, n_trials=args.quality_trials)
            seconds = time.perf_counter() - started
            states = [t.state.name for t in study.trials]
            rows.append(
                {
                    "seed": seed,
                    "method": method,
                    "best_accuracy": study.best_value,
                    "n_complete": states.count("COMPLETE"),
                    "n_pruned": states.count("PRUNED"),
                    "n_fail": states.count("FAIL"),
                    "seconds": seconds,
                    "load1": os.getloadavg()[0],
                }
            )
            print(
                f"quality seed {seed} {method:5}: best {study.best_value:.4f} in {seconds:.1f} s",
                flush=True,
            )
    return rows


def steps(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One training step: K fused (fused kernels on and off) against K stock steps."""
    data = load_digits()
    x, y = data.x_train[:BATCH], data.y_train[:BATCH]
    hyper = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}

    def timed(step: Any, n: int = 40) -> float:
        for _ in range(5):
            step()
        started = time.perf_counter()
        for _ in range(n):
            step()
        return (time.perf_counter() - started) / n

    rows = []
    for model in args.models:
        kind = FixedModel(model)
        single = build_fixed_model(kind, 0.1)
        opt = torch.optim.SGD(single.parameters(), **hyper)

        def one_step(m: nn.Module = single, o: torch.optim.Optimizer = opt) -> None:
            o.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(m(x), y).backward()  # type: ignore[no-untyped-call]
            o.step()

        for k in args.ks:
            for kernels in (True, False):
                fused = fusion.fuse(
                    [build_fixed_model(kind, 0.1) for _ in range(k)], kernels=kernels
                )
                fopt = fusion.optimizer(torch.optim.SGD, fused, [hyper] * k)

                def fused_step(f: Any = fused, o: Any = fopt) -> None:
                    o.zero_grad(set_to_none=True)
                    loss = fusion.per_model_loss(
                        nn.functional.cross_entropy, f(x), y, target_stacked=False
                    )
                    loss.sum().backward()
                    o.step()

                alone_s = timed(one_step)
                fused_s = timed(fused_step)
                rows.append(
                    {
                        "model": model,
                        "k": k,
                        "kernels": kernels,
                        "one_step_s": alone_s,
                        "fused_step_s": fused_s,
                        "speedup_vs_k_steps": k * alone_s / fused_s,
                        "load1": os.getloadavg()[0],
                    }
                )
                print(
                    f"step {model} K={k:2} kernels={kernels!s:5}: fused {fused_s * 1e3:.2f} ms, "
                    f"one {alone_s * 1e3:.2f} ms, x{k * alone_s / fused_s:.2f}",
                    flush=True,
                )
    return rows


def plot(out: Path, rows: list[dict[str, Any]], quality_rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        one = next(r for r in rows if r["model"] == model and r["method"] == "one")
        for method, style in (("fused", "o-"), ("cohosted", "s--")):
            pts = sorted(
                (r["k"], r["speedup_vs_one_median"])
                for r in rows
                if r["model"] == model and r["method"] == method
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=method)
        ax.axhline(1.0, color="grey", lw=0.8, label="one after another")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("K (trials per fused model / co-hosted threads)")
        ax.set_ylabel("trials per hour / one after another")
        ax.set_title(f"digits {model}: one after another {one['trials_per_hour_median']:.0f}/h")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fusion_throughput.png", dpi=120)
    if quality_rows:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for i, method in enumerate(("one", "fused")):
            vals = [r["best_accuracy"] for r in quality_rows if r["method"] == method]
            ax.bar(
                [s + 0.35 * i for s in range(len(vals))],
                vals,
                width=0.35,
                label="one after another" if method == "one" else "fused K=8",
            )
        ax.set_ylim(0.8, 1.0)
        ax.set_xlabel("seed")
        ax.set_ylabel("best validation accuracy")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "fusion_quality.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--cohost-ks", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quality-trials", type=int, default=32)
    parser.add_argument("--quality-epochs", type=int, default=4)
    parser.add_argument("--quality-model", default="mlp", choices=["mlp", "cnn"])
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument(
        "--steps-only",
        action="store_true",
        help="only time one training step, fused vs K stock steps; writes steps.json",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared machine two threads per step "
        "oversubscribe the cores; co-hosted trials still use one core each)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out = args.out or Path("experiments/results") / f"{dt.date.today():%Y-%m-%d}-fusion"
    out.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.timezone.utc)
    load_before = os.getloadavg()
    if args.steps_only:
        step_rows = steps(args)
        (out / "steps.json").write_text(
            json.dumps(
                {
                    "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                    "started_utc": started.isoformat(timespec="seconds"),
                    "load_before": load_before,
                    "load_after": os.getloadavg(),
                    "torch_threads": torch.get_num_threads(),
                    "steps": step_rows,
                },
                indent=2,
            )
            + "\n"
        )
        return
    mem_rows = memory(args)
    rows = throughput(args)
    quality_rows = [] if args.skip_quality else quality(args)
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "started_utc": started.isoformat(timespec="seconds"),
        "finished_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "versions": {
            "waterwave_hpo": ww.__version__,
            "torch": torch.__version__,
            "optuna": optuna.__version__,
            "python": platform.python_version(),
        },
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "settings": vars(args) | {"out": str(out)},
        "throughput": rows,
        "memory": mem_rows,
        "quality": quality_rows,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(out, rows, quality_rows)
    print(f"wrote {out}/")


if __name__ == "__main__":
    main()
