"""``run_search_bench``: the demo's search under every method and seed; writes the folder."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
import contextlib
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
import datetime
import json
import os
from pathlib import Path
import sys
from typing import Any

from waterwave_hpo import _checks
from waterwave_hpo import _experimental
from waterwave_hpo._owned_files import check_out_value
from waterwave_hpo.bench._folders import claim_results_folder
from waterwave_hpo.bench._folders import default_folder
from waterwave_hpo.bench._machine import device_name
from waterwave_hpo.bench._machine import machine
from waterwave_hpo.bench._machine import resolve_device
from waterwave_hpo.bench._machine import versions
from waterwave_hpo.bench._search_children import search_processes
from waterwave_hpo.bench._search_methods import SearchMethod
from waterwave_hpo.bench._search_plot import plot_search
from waterwave_hpo.bench._search_report import SEARCH_CPU_NOTICE
from waterwave_hpo.bench._search_report import UNITS
from waterwave_hpo.bench._search_report import method_summaries
from waterwave_hpo.bench._search_report import readme
from waterwave_hpo.bench._search_report import run_entry
from waterwave_hpo.bench._search_results import SearchRun
from waterwave_hpo.bench._search_results import Target
from waterwave_hpo.bench._search_run import SearchSettings
from waterwave_hpo.bench._search_run import run_search

SEARCH_FILES = ("search.json", "search.png", "README.md")
"""Every file the search bench writes in its results folder (beside the manifest)."""


@dataclass(frozen=True)
class SearchConfig:
    """The ``waterwave-hpo bench --search`` flags.

    Attributes:
        out: The results folder; ``None``: ``experiments/results/<date>-search-<device>/``.
        device: ``auto`` (``cuda:0`` if there is one, else the CPU), ``cpu``, ``cuda`` or
            ``cuda:N``.
        k: Trials at once for the concurrent methods, trials per fused model for ``fused``
            (>= 1).
        methods: Which methods.
        seeds: Searches per method (>= 1), seeded ``seed``, ``seed + 1``, ...
        seed: The first seed.
        trials: The trial budget of each search (>= 1).
        epochs: Training epochs per trial (>= 1; the demo's default is 5).
        budget_s: Wall seconds the searches take in all (> 0), split evenly: each search's
            time budget is ``budget_s / (len(methods) * seeds)``. Start-up (a fresh process
            per search, an executor's worker processes) comes on top.
        target_fraction: The target is this fraction of the best validation accuracy any
            search found within its budget, in (0, 1].
        isolate: Run each search in a fresh process (forked from a server that imported
            torch once; on CUDA spawned; OpenMP's idle threads sleep, as in the executor's
            workers), so no search inherits another's caches, and on CUDA each method gets its
            own allocator. ``False``: all in this process (for tests).
        command: The command line, recorded in the results.
    """

    out: Path | None = None
    device: str = "auto"
    k: int = 4
    methods: tuple[SearchMethod, ...] = tuple(SearchMethod)
    seeds: int = 3
    seed: int = 0
    trials: int = 100
    epochs: int = 5
    budget_s: float = 600.0
    target_fraction: float = 0.99
    isolate: bool = True
    command: tuple[str, ...] = field(default_factory=lambda: tuple(sys.argv))

    def __post_init__(self) -> None:
        for name in ("k", "seeds", "trials", "epochs"):
            _checks.check_int(name, getattr(self, name), minimum=1)
        _checks.check_seed("seed", self.seed)
        _checks.check_finite_number("budget_s", self.budget_s, fix="pass seconds, e.g. 600")
        fraction = _checks.check_number(
            "target_fraction", self.target_fraction, fix="pass a fraction in (0, 1], e.g. 0.99"
        )
        if fraction > 1:
            raise _checks.value_error(
                "target_fraction", fraction, "must be <= 1", "pass a fraction in (0, 1], e.g. 0.99"
            )
        if not self.methods or not all(isinstance(m, SearchMethod) for m in self.methods):
            raise _checks.value_error(
                "methods",
                self.methods,
                "must name at least one SearchMethod",
                "pass some of " + ", ".join(m.value for m in SearchMethod),
            )
        resolve_device(self.device)  # a device that does not exist fails here, not mid-run
        if self.out is not None:
            check_out_value("out", self.out)

    @property
    def search_budget_s(self) -> float:
        """Each search's time budget, seconds."""
        return self.budget_s / (len(self.methods) * self.seeds)


@dataclass
class SearchBenchResult:
    """What :func:`run_search_bench` measured and where it wrote it.

    Attributes:
        out: The results folder.
        runs: One search per method and seed.
        target: The accuracy ``time_to_target_s`` counts to.
        payload: ``search.json``'s content.
    """

    out: Path
    runs: list[SearchRun]
    target: Target
    payload: dict[str, Any]


def run_search_bench(
    config: SearchConfig, log: Callable[[str], object] = print
) -> SearchBenchResult:
    """Run the demo's NAS + HPO search under every method and seed; write the folder.

    Each method runs the same search (:func:`waterwave_hpo.demo.make_objective`'s space,
    TPE seeded, the median pruner) for each seed, with the same trial budget and time budget,
    one search after another, the methods interleaved seed by seed (so a change of the
    machine's load falls on every method). Then the target is set at ``target_fraction`` of
    the best any search found, and ``search.json``, ``search.png`` and ``README.md`` are
    written.

    Experimental on CUDA: the executor's CUDA paths emit
    :class:`waterwave_hpo.ExperimentalWarning`.

    Args:
        config: The settings.
        log: Called with each progress line.

    Returns:
        The runs, the target and where they are.

    Raises:
        ValueError: For a device that does not exist.
        ForeignFileError: ``config.out`` holds a file of a name the search bench writes that
            the project did not write (a ``ValueError``; nothing was written).
    """
    device = resolve_device(config.device)
    started = datetime.datetime.now(datetime.timezone.utc)
    folder = claim_results_folder(
        config.out,
        default_folder(started, f"search-{device_name(device)}"),
        "search-bench",
        SEARCH_FILES,
    )
    load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    if device.type == "cuda":
        _experimental.warn_experimental(_experimental.ExperimentalPath.BENCH_CUDA)
    else:
        log(SEARCH_CPU_NOTICE)
    settings = SearchSettings(
        device=str(device),
        k=config.k,
        trials=config.trials,
        epochs=config.epochs,
        budget_s=config.search_budget_s,
    )
    seeds = [config.seed + i for i in range(config.seeds)]
    log(
        f"{len(config.methods)} methods x {len(seeds)} seeds, each search {settings.budget_s:.1f} "
        f"s or {config.trials} trials, K={config.k}, {config.epochs} epochs per trial"
    )
    runs: list[SearchRun] = []
    with search_processes(device.type == "cuda") if config.isolate else _here() as run_one:
        for seed in seeds:
            for method in config.methods:
                runs.append(run_one(method, seed, settings))
                log(_line(runs[-1]))
    target = Target.of(runs, config.target_fraction)
    payload = _payload(config, device, started, load_at_start, seeds, runs, target)
    folder.write_text("search.json", json.dumps(payload, indent=1) + "\n")
    title = f"The demo's search on {device_name(device)}" + (
        " (CPU-only: says nothing about GPUs)" if device.type != "cuda" else ""
    )
    folder.write("search.png", lambda path: plot_search(runs, target, path, title))
    folder.write_text("README.md", readme(payload))
    log(f"target: {target.describe()}")
    for row in payload["summary"]:
        log(_summary_line(row))
    log(f"wrote {folder.path}/: {' '.join(SEARCH_FILES)}")
    return SearchBenchResult(folder.path, runs, target, payload)


@contextlib.contextmanager
def _here() -> Iterator[Callable[[SearchMethod, int, SearchSettings], SearchRun]]:
    yield run_search


def _line(run: SearchRun) -> str:
    head = f"seed {run.seed} {SearchMethod(run.method).label:<32}"
    if not run.available:
        return f"{head} skipped: {run.skipped_reason}"
    best = run.best_value_at_budget()
    return (
        f"{head} best {'-' if best is None else f'{best:.4f}'} at budget, "
        f"{len(run.in_budget('COMPLETE'))} completed, {len(run.in_budget('PRUNED'))} pruned, "
        f"start-up {run.startup_s:.1f} s, {run.wall_s:.1f} s"
    )


def _summary_line(row: dict[str, Any]) -> str:
    if not row["ran"]:
        return f"{row['label']:<32} skipped: {row['skipped_reason']}"
    median = row["time_to_target_s_median"]
    best = row["best_value_at_budget_median"]
    return (
        f"{row['label']:<32} reached the target in {row['reached_target']} of {row['ran']} "
        f"seeds, median {'-' if median is None else f'{median:.1f} s'}; best at budget, median "
        f"{'-' if best is None else f'{best:.4f}'}"
    )


def _payload(
    config: SearchConfig,
    device: Any,
    started: datetime.datetime,
    load_at_start: list[float] | None,
    seeds: list[int],
    runs: list[SearchRun],
    target: Target,
) -> dict[str, Any]:
    entries = [run_entry(run, target) for run in runs]
    settings = {k: v for k, v in asdict(config).items() if k not in ("out", "command")}
    settings["methods"] = [m.value for m in config.methods]
    cuda = device.type == "cuda"
    return {
        "cpu_only": not cuda,
        "notice": "" if cuda else SEARCH_CPU_NOTICE,
        "started_utc": started.isoformat(),
        "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "command": list(config.command),
        "config": settings,
        "seeds": seeds,
        "search": {
            "space": "the demo's NAS + HPO space (waterwave_hpo.demo.build_model: 1-3 conv "
            "blocks, channels 8-64, kernels 3/5, hidden 32-128, dropout 0-0.5; optimizer "
            "adam/adamw/sgd, learning rate 1e-4-3e-2 log, batch size 32/64/128) on "
            f"scikit-learn's digits (1437 training, 360 validation images), {config.epochs} "
            "epochs per trial, validation accuracy reported every epoch.",
            "sampler": "TPE (waterwave_hpo.demo.demo_sampler), seeded with the search's seed, "
            "constant_liar=True for every method but one at a time (where nothing else "
            "runs); with K trials at once Optuna and the executor reseed the sampler, so a "
            "seed names a repetition, not the same trials.",
            "pruner": "the median pruner (waterwave_hpo.demo.demo_pruner: after 4 trials, "
            "from the second epoch), and at the search's time budget every running trial is "
            "stopped at its next epoch.",
            "fused": "fused (fuse=K): each batch's first trial samples the whole space; the "
            "other K-1 take its architecture, optimizer and batch size and sample only their "
            "learning rate and dropout; the K models train as one fused model on one order "
            "of training images.",
            "clock": "the clock starts at the first ask, after the executor (and, with "
            'isolation="process", its K worker processes, warmed up) started: start-up '
            "is reported apart; only trials that ended within the budget count.",
            "search_budget_s": config.search_budget_s,
            "searches": len(config.methods) * config.seeds,
        },
        "target": {
            "fraction": target.fraction,
            "best_any_run": target.best_any_run,
            "value": target.value,
            "description": target.describe(),
        },
        "methods": {m.value: m.label for m in config.methods},
        "machine": machine(device),
        "load_average_at_start": load_at_start,
        "versions": versions(),
        "units": UNITS,
        "summary": method_summaries(entries),
        "runs": entries,
    }
