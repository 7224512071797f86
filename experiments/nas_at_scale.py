"""NAS at scale on Ray: one search space, run through the Optuna path and the Ray Tune path.

Three modes, each on a Ray cluster (``--address``) or a local Ray instance started here:

* ``optuna``: ``waterwave_hpo.RayExecutor``: one device-host actor per GPU, each co-hosting
  ``--trials-per-device`` trials (threads, streams, the pool); a median pruner stops weak
  architectures; the study is the driver's, served to the hosts over Ray.
* ``tune``: Ray Tune with ``waterwave_hpo.shared_gpu(trials_per_gpu=K)``: K trial processes per
  GPU holding memory leases from the GPU's broker (``--design broker``), or with
  ``waterwave_hpo.tune_hosts(K)``: the trials' functions co-hosted in one actor per GPU
  (``--design hosts``); ASHA stops weak architectures.
* ``compare`` (meant for one CUDA GPU): the same sampled architectures run three ways under Tune,
  one after another on the same GPU, without early stopping so that the work is identical:
  ``shared_gpu`` (K per GPU, memory leases of 1/K of the budget each), ``shared_gpu_auto`` (up
  to K per GPU, leases sized by measured peaks), ``tune_hosts`` (K co-hosted per GPU in one
  process: streams, one pool; a trial's ``peak_bytes`` there is the host process's peak, not
  the trial's own), ``fractional`` (plain ``{"GPU": 1/K}``, Ray's
  book-keeping only) and ``one_per_gpu`` (``{"GPU": 1}``). Measured: makespan (s), trials that
  ran out of memory, each trial's peak allocated bytes (its pool account,
  ``waterwave_hpo.trial_memory_stats()``, where the pool is PyTorch's allocator; else
  ``torch.cuda.max_memory_allocated``) and
  the device's peak used bytes (``nvidia-smi``, sampled every 0.1 s).

Search spaces (``--space``):

* ``digits``: small CNNs on scikit-learn's bundled 8x8 digits (the demo's data; real accuracy).
* ``cells``: a CIFAR-style cell network on synthetic 32x32x3 data (random images and labels, so
  accuracy is meaningless; it exists to load the GPU's memory): 2-6 cells, each a conv3, conv5,
  separable conv3 or max-pool op at a width of 32-256 channels (``--width-scale`` multiplies),
  batch 64-512 (``--batch-scale`` multiplies).

Without CUDA everything runs on the CPU against logical GPUs (``--logical-gpus``), which checks
the plumbing and says so in the results; those are not GPU numbers, and ``compare`` refuses to
run without ``--allow-cpu``.

Usage::

    python experiments/nas_at_scale.py optuna --space digits --trials 16 --trials-per-device 4
    python experiments/nas_at_scale.py tune --space digits --samples 16 --trials-per-gpu 4
    python experiments/nas_at_scale.py compare --space cells --samples 16 --k 4 \\
        --width-scale 2 --batch-scale 2

Writes ``nas_at_scale-<mode>-<utc time>.json`` and ``.md`` to ``--out`` (default
``experiments/results``) with the device, versions, command and every trial's row.

Start it from anywhere but the repository root when the package is installed: Ray puts the
driver's working directory first on its workers' ``sys.path`` (this script ``chdir``s to its
output directory while Ray starts, for that reason).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
from pathlib import Path
import platform
import random
import shutil
import subprocess
import sys
import threading
import time
from typing import Any
import zlib

import optuna
import torch
from torch import nn

# -- the search space: plain dicts, so Optuna and Tune sample the same thing ------------------

DIGITS_SPACE: dict[str, list[Any] | tuple[float, float]] = {
    "n_conv": [1, 2, 3],
    "channels": [8, 16, 32, 64],
    "kernel": [3, 5],
    "hidden": [32, 64, 128],
    "dropout": (0.0, 0.5),
    "lr": (1e-4, 3e-2),
    "batch_size": [32, 64, 128],
}
CELLS_SPACE: dict[str, list[Any] | tuple[float, float]] = {
    "n_cells": [2, 3, 4, 5, 6],
    "width": [32, 64, 128, 256],
    **{f"op_{i}": ["conv3", "conv5", "sep3", "pool"] for i in range(6)},
    "lr": (1e-4, 3e-2),
    "batch_size": [64, 128, 256, 512],
}
SPACES = {"digits": DIGITS_SPACE, "cells": CELLS_SPACE}


def suggest(trial: optuna.trial.Trial, space: str) -> dict[str, Any]:
    """Sample ``space`` with an Optuna trial (floats log-uniform for ``lr``)."""
    config: dict[str, Any] = {}
    for name, domain in SPACES[space].items():
        if isinstance(domain, tuple):
            config[name] = trial.suggest_float(name, *domain, log=name == "lr")
        else:
            config[name] = trial.suggest_categorical(name, domain)
    return config


def tune_space(space: str) -> dict[str, Any]:
    """``space`` as a Ray Tune ``param_space``."""
    from ray import tune

    result: dict[str, Any] = {}
    for name, domain in SPACES[space].items():
        if isinstance(domain, tuple):
            result[name] = (tune.loguniform if name == "lr" else tune.uniform)(*domain)
        else:
            result[name] = tune.choice(domain)
    return result


def sample(space: str, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` configurations drawn with a seeded RNG (``compare`` runs the same ones 3 ways)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        config: dict[str, Any] = {}
        for name, domain in SPACES[space].items():
            if isinstance(domain, tuple):
                low, high = domain
                config[name] = (
                    low * (high / low) ** rng.random() if name == "lr" else (rng.uniform(low, high))
                )
            else:
                config[name] = rng.choice(domain)
        out.append(config)
    return out


# -- models and training ---------------------------------------------------------------------


def build(config: dict[str, Any], space: str, width_scale: float) -> nn.Module:
    """The network ``config`` describes: ``[B, 1, 8, 8]`` (digits) or ``[B, 3, 32, 32]``
    (cells) images to ``[B, 10]`` logits."""
    layers: list[nn.Module] = []
    if space == "digits":
        channels, size, c_in = int(config["channels"]), 8, 1
        for i in range(int(config["n_conv"])):
            k = int(config["kernel"])
            layers += [nn.Conv2d(c_in, channels, k, padding=k // 2), nn.BatchNorm2d(channels)]
            layers += [nn.ReLU()] + ([nn.MaxPool2d(2)] if i < 2 else [])
            size = size // 2 if i < 2 else size
            c_in = channels
        layers += [nn.Flatten(), nn.Linear(c_in * size * size, int(config["hidden"]))]
        layers += [nn.ReLU(), nn.Dropout(float(config["dropout"])), nn.Linear(config["hidden"], 10)]
        return nn.Sequential(*layers)
    width = max(8, int(int(config["width"]) * width_scale))
    layers += [nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
    for i in range(int(config["n_cells"])):
        op = config[f"op_{i}"]
        if op == "pool":
            layers.append(nn.MaxPool2d(3, stride=1, padding=1))
        elif op == "sep3":
            layers += [
                nn.Conv2d(width, width, 3, padding=1, groups=width),
                nn.Conv2d(width, width, 1),
            ]
        else:
            k = 3 if op == "conv3" else 5
            layers += [nn.Conv2d(width, width, k, padding=k // 2)]
        layers += [nn.BatchNorm2d(width), nn.ReLU()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10)]
    return nn.Sequential(*layers)


def _pool_installed(device: torch.device) -> bool:
    """Whether waterwave's stream-aware pool is PyTorch's allocator on ``device``."""
    from waterwave_hpo.memory import installed_pool

    return installed_pool(device.index or 0) is not None


def _trial_peak_bytes(device: torch.device) -> int:
    """The running trial's peak allocated bytes since it started: its pool account under the
    pool (torch's per-device peak would count the co-hosted trials, and the pluggable allocator
    has no per-device stats to reset), else PyTorch's ``max_memory_allocated``; 0 on the CPU."""
    import waterwave_hpo as ww

    if device.type != "cuda":
        return 0
    stats = ww.trial_memory_stats()
    if stats is not None:
        return int(stats.peak_allocated_bytes)
    return int(torch.cuda.max_memory_allocated(device))


class Workload:
    """Training data and settings shared by every trial of one run (picklable)."""

    def __init__(self, space: str, epochs: int, steps: int, width_scale: float, batch_scale: float):
        self.space = space
        self.epochs = epochs
        self.steps = steps
        self.width_scale = width_scale
        self.batch_scale = batch_scale
        self.digits: Any = None
        if space == "digits":
            from waterwave_hpo.demo._data import load_digits

            self.digits = load_digits()

    def train(self, config: dict[str, Any], device: torch.device, report: Any) -> float:
        """Train ``config`` on ``device``; ``report(epoch, accuracy, peak_bytes)`` after each
        epoch (it may raise to stop the trial). Returns the last accuracy in [0, 1]."""
        seed = zlib.crc32(json.dumps(config, sort_keys=True, default=str).encode())
        generator = torch.Generator().manual_seed(seed)
        model = build(config, self.space, self.width_scale).to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=float(config["lr"]))
        loss_fn = nn.CrossEntropyLoss()
        batch = max(1, int(int(config["batch_size"]) * self.batch_scale))
        if device.type == "cuda" and not _pool_installed(device):
            torch.cuda.reset_peak_memory_stats(device)  # a pool account starts at the trial
        accuracy = 0.0
        for epoch in range(self.epochs):
            model.train()
            for x, y in self._batches(batch, device, generator):
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                optimizer.step()
            accuracy = self._accuracy(model, device, generator)
            report(epoch, accuracy, _trial_peak_bytes(device))
        return accuracy

    def _batches(self, batch: int, device: torch.device, generator: torch.Generator) -> Any:
        if self.digits is not None:
            x, y = self.digits.x_train, self.digits.y_train
            order = torch.randperm(x.shape[0], generator=generator)
            for start in range(0, x.shape[0], batch):
                index = order[start : start + batch]
                yield x[index].to(device), y[index].to(device)
            return
        for _ in range(self.steps):
            x = torch.randn(batch, 3, 32, 32, generator=generator).to(device)
            yield x, torch.randint(0, 10, (batch,), generator=generator).to(device)

    def _accuracy(
        self, model: nn.Module, device: torch.device, generator: torch.Generator
    ) -> float:
        model.eval()
        with torch.no_grad():
            if self.digits is not None:
                x, y = self.digits.x_val.to(device), self.digits.y_val.to(device)
            else:
                x = torch.randn(256, 3, 32, 32, generator=generator).to(device)
                y = torch.randint(0, 10, (256,), generator=generator).to(device)
            return float((model(x).argmax(dim=1) == y).float().mean().item())


def _trial_device() -> torch.device:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# -- the Optuna path ---------------------------------------------------------------------------


def run_optuna(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    import waterwave_hpo as ww

    space = args.space
    intra_op = max(1, (os.cpu_count() or 1) // args.trials_per_device)

    def objective(trial: optuna.trial.Trial) -> float:
        torch.set_num_threads(intra_op)
        config = suggest(trial, space)

        def report(epoch: int, accuracy: float, peak_bytes: int) -> None:
            trial.report(accuracy, epoch)
            trial.set_user_attr("peak_bytes", peak_bytes)
            if trial.should_prune():
                raise optuna.TrialPruned()

        return workload.train(config, ww.current().device, report)

    study = ww.create_study(
        direction="maximize",
        pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1),
        sampler=optuna.samplers.TPESampler(seed=args.seed),
    )
    executor = ww.RayExecutor(
        n_hosts="auto" if args.hosts == "auto" else int(args.hosts),
        trials_per_device=args.trials_per_device,
        num_gpus_per_host=0 if args.cpu_hosts else 1,
        num_cpus_per_host=args.cpus_per_host,
    )
    start = time.monotonic()
    study.optimize(objective, n_trials=args.trials, executor=executor, catch=(RuntimeError,))
    makespan = time.monotonic() - start
    rows = [
        {
            "number": t.number,
            "state": t.state.name,
            "value": t.value,
            "host": t.system_attrs.get("waterwave:host"),
            "peak_bytes": t.user_attrs.get("peak_bytes"),
            "duration_s": (t.datetime_complete - t.datetime_start).total_seconds()
            if t.datetime_complete and t.datetime_start
            else None,
            "params": t.params,
        }
        for t in study.trials
    ]
    best = study.best_trial if any(t.state.name == "COMPLETE" for t in study.trials) else None
    return {
        "makespan_s": makespan,
        "n_trials": len(rows),
        "states": {s: sum(r["state"] == s for r in rows) for s in {r["state"] for r in rows}},
        "hosts": sorted({r["host"] for r in rows if r["host"]}),
        "best_value": None if best is None else best.value,
        "best_params": None if best is None else best.params,
        "trials": rows,
    }


# -- the Tune path -----------------------------------------------------------------------------


def _make_trainable(workload: Workload, oom_counts: bool) -> Any:
    from ray import tune

    def trainable(config: dict[str, Any]) -> None:
        torch.set_num_threads(1)
        device = _trial_device()

        def report(epoch: int, accuracy: float, peak_bytes: int) -> None:
            tune.report({"accuracy": accuracy, "peak_bytes": peak_bytes, "oom": 0})

        try:
            workload.train(config, device, report)
        except torch.cuda.OutOfMemoryError:
            if oom_counts:
                tune.report({"accuracy": 0.0, "peak_bytes": 0, "oom": 1})
            raise

    return trainable


def run_tune(
    args: argparse.Namespace,
    workload: Workload,
    resources: Any,
    configs: list[dict[str, Any]] | None,
    name: str,
    asha: bool,
) -> dict[str, Any]:
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from waterwave_hpo.integrations.ray_tune import SharedGPU
    from waterwave_hpo.integrations.ray_tune import TuneHosts

    trainable: Any = _make_trainable(workload, oom_counts=True)
    hosts: TuneHosts | None = None
    if isinstance(resources, TuneHosts):  # the functions run co-hosted in one actor per GPU
        hosts = resources.__enter__()
        trainable = hosts.wrap(trainable)
        resources = hosts.resources
    elif isinstance(resources, SharedGPU):
        trainable = resources.wrap(trainable)
    if configs is None:
        param_space, num_samples = tune_space(args.space), args.samples
    else:
        param_space = {"index": tune.grid_search(list(range(len(configs))))}
        num_samples = 1
        inner = trainable

        def trainable(config: dict[str, Any]) -> None:
            inner(configs[config["index"]])

    tuner = tune.Tuner(
        tune.with_resources(trainable, resources),
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric="accuracy",
            mode="max",
            num_samples=num_samples,
            scheduler=ASHAScheduler(max_t=workload.epochs, grace_period=1) if asha else None,
            max_concurrent_trials=None if hosts is None else hosts.max_concurrent_trials,
        ),
        run_config=tune.RunConfig(
            storage_path=str(Path(args.out).resolve() / "tune"),
            name=name,
            verbose=0,
            failure_config=tune.FailureConfig(max_failures=0),
        ),
    )
    sampler = _DeviceMemorySampler() if args.mode == "compare" else None
    start = time.monotonic()
    try:
        with sampler or contextlib.nullcontext():
            grid = tuner.fit()
        makespan = time.monotonic() - start
        host_stats = None if hosts is None else [str(h) for h in hosts.stats()]
    finally:
        if hosts is not None:
            hosts.__exit__(None, None, None)
    rows = []
    for result in grid:
        metrics = result.metrics or {}
        rows.append(
            {
                "config": result.config,
                "iterations": metrics.get("training_iteration"),
                "accuracy": metrics.get("accuracy"),
                "peak_bytes": metrics.get("peak_bytes"),
                "error": None if result.error is None else repr(result.error)[:300],
                "oom": bool(metrics.get("oom"))
                or (result.error is not None and "out of memory" in repr(result.error).lower()),
            }
        )
    peaks = [r["peak_bytes"] for r in rows if r["peak_bytes"]]
    return {
        "resources": str(resources) if hosts is None else f"tune_hosts: {resources}",
        "host_stats": host_stats,
        "makespan_s": makespan,
        "n_trials": len(rows),
        "n_errors": sum(r["error"] is not None for r in rows),
        "n_oom": sum(r["oom"] for r in rows),
        "max_trial_peak_bytes": max(peaks) if peaks else None,
        "device_peak_used_bytes": None if sampler is None else sampler.peak_bytes,
        "trials": rows,
    }


class _DeviceMemorySampler:
    """The GPU's used memory, sampled every 0.1 s with nvidia-smi (no CUDA context here)."""

    def __init__(self) -> None:
        self.peak_bytes: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _DeviceMemorySampler:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def _run(self) -> None:
        command = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.wait(0.1):
            with contextlib.suppress(Exception):
                used_mib = int(subprocess.check_output(command, text=True).split()[0])
                self.peak_bytes = max(self.peak_bytes or 0, used_mib << 20)


# -- driver ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["optuna", "tune", "compare"])
    parser.add_argument("--space", choices=sorted(SPACES), default="digits")
    parser.add_argument("--trials", type=int, default=16, help="optuna: trials")
    parser.add_argument("--samples", type=int, default=16, help="tune/compare: trials")
    parser.add_argument("--trials-per-device", type=int, default=4, help="optuna: per host")
    parser.add_argument("--trials-per-gpu", default="4", help="tune: int or 'auto'")
    parser.add_argument(
        "--design",
        choices=["broker", "hosts"],
        default="broker",
        help="tune: shared_gpu() (processes + lease broker) or tune_hosts() (co-hosted)",
    )
    parser.add_argument("--k", type=int, default=4, help="compare: trials per GPU")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="cells: batches per epoch")
    parser.add_argument("--width-scale", type=float, default=1.0)
    parser.add_argument("--batch-scale", type=float, default=1.0)
    parser.add_argument("--hosts", default="auto", help="optuna: host actors, int or 'auto'")
    parser.add_argument("--cpu-hosts", action="store_true", help="optuna: hosts without GPUs")
    parser.add_argument("--cpus-per-host", type=float, default=1.0)
    parser.add_argument("--cpus-per-trial", type=float, default=1.0)
    parser.add_argument("--address", default=None, help="Ray cluster address; default: local")
    parser.add_argument("--local-cpus", type=int, default=None)
    parser.add_argument("--logical-gpus", type=int, default=1, help="local, without CUDA")
    parser.add_argument("--allow-cpu", action="store_true", help="compare without CUDA")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)

    import ray

    import waterwave_hpo as ww

    cuda = torch.cuda.is_available()
    if args.mode == "compare" and not cuda and not args.allow_cpu:
        parser.error("compare measures GPU memory and needs CUDA; --allow-cpu runs the plumbing")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(out)  # Ray's workers get the driver's cwd first on sys.path: not the source tree
    try:
        init: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if args.address is None:
            init["num_cpus"] = args.local_cpus
            if not cuda:
                init["num_gpus"] = args.logical_gpus
        ray.init(address=args.address, **init)
    finally:
        os.chdir(cwd)
    workload = Workload(args.space, args.epochs, args.steps, args.width_scale, args.batch_scale)
    result: dict[str, Any] = {}
    if args.mode == "optuna":
        result["optuna"] = run_optuna(args, workload)
    elif args.mode == "tune":
        per_gpu: int | str = (
            args.trials_per_gpu if args.trials_per_gpu == "auto" else int(args.trials_per_gpu)
        )
        resources: Any = ww.shared_gpu(per_gpu, cpus_per_trial=args.cpus_per_trial)
        if args.design == "hosts":
            resources = ww.tune_hosts(per_gpu, cpus_per_trial=args.cpus_per_trial)
        result[f"tune_{args.design}"] = run_tune(
            args, workload, resources, None, "nas_tune", asha=True
        )
    else:
        from ray import tune

        configs = sample(args.space, args.samples, args.seed)
        k = args.k
        ways = {
            "shared_gpu": ww.shared_gpu(k, cpus_per_trial=args.cpus_per_trial),
            "shared_gpu_auto": ww.shared_gpu(
                "auto", cpus_per_trial=args.cpus_per_trial, max_trials_per_gpu=k
            ),
            "tune_hosts": ww.tune_hosts(k, cpus_per_trial=args.cpus_per_trial),
            "fractional": tune.PlacementGroupFactory(
                [{"CPU": args.cpus_per_trial, "GPU": int(10_000 / k) / 10_000}]
            ),
            "one_per_gpu": tune.PlacementGroupFactory([{"CPU": args.cpus_per_trial, "GPU": 1}]),
        }
        for name, resources in ways.items():
            print(f"compare: {name} ...", flush=True)
            result[name] = run_tune(args, workload, resources, configs, f"compare_{name}", False)
    ray.shutdown()

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    summary = {
        "mode": args.mode,
        "space": args.space,
        "when_utc": stamp,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (logical GPUs: not GPU numbers)",
        "host": platform.node(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "optuna": optuna.__version__,
            "ray": ray.__version__,
            "waterwave_hpo": ww.__version__,
        },
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "results": result,
    }
    path = out / f"nas_at_scale-{args.mode}-{stamp}.json"
    path.write_text(json.dumps(summary, indent=2, default=str))
    lines = [
        f"# nas_at_scale {args.mode} ({args.space}), {stamp}",
        "",
        f"device: {summary['device']}",
        "",
    ]
    lines += [
        "| run | trials | makespan_s | errors | OOMs | max trial peak bytes | device peak bytes |"
    ]
    lines += ["|---|---|---|---|---|---|---|"]
    for name, r in result.items():
        lines.append(
            f"| {name} | {r['n_trials']} | {r['makespan_s']:.1f} | {r.get('n_errors', '-')} | "
            f"{r.get('n_oom', '-')} | {r.get('max_trial_peak_bytes', '-')} | "
            f"{r.get('device_peak_used_bytes', '-')} |"
        )
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
