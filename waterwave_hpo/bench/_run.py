"""``run_bench``: every workload, every setting, every method, one run; writes the folder."""

from __future__ import annotations

from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace
import datetime
import json
import os
from pathlib import Path
import platform
import sys
from typing import TYPE_CHECKING
from typing import Any

import torch

from waterwave_hpo import _checks
from waterwave_hpo._owned_files import OwnedFolder
from waterwave_hpo._owned_files import check_out_value
from waterwave_hpo.bench._calibrate import BASE_BATCH
from waterwave_hpo.bench._calibrate import SEQ_LEN
from waterwave_hpo.bench._calibrate import PlanProfile
from waterwave_hpo.bench._calibrate import fit_batches
from waterwave_hpo.bench._calibrate import plan_profile
from waterwave_hpo.bench._calibrate import step_seconds
from waterwave_hpo.bench._folders import claim_results_folder
from waterwave_hpo.bench._folders import default_folder
from waterwave_hpo.bench._machine import device_name
from waterwave_hpo.bench._machine import machine
from waterwave_hpo.bench._machine import resolve_device
from waterwave_hpo.bench._machine import versions
from waterwave_hpo.bench._methods import Method
from waterwave_hpo.bench._methods import unavailable_reason
from waterwave_hpo.bench._plans import PlanComparison
from waterwave_hpo.bench._plans import compare_plans
from waterwave_hpo.bench._plots import plot_gantt
from waterwave_hpo.bench._plots import plot_memory
from waterwave_hpo.bench._plots import plot_throughput
from waterwave_hpo.bench._results import UNITS
from waterwave_hpo.bench._results import MethodResult
from waterwave_hpo.bench._results import result_of
from waterwave_hpo.bench._results import results_table
from waterwave_hpo.bench._runners import MethodRun
from waterwave_hpo.bench._runners import call_in_child
from waterwave_hpo.bench._runners import run_method
from waterwave_hpo.bench._validate import fit_parallelism
from waterwave_hpo.bench._validate import measure_process_start_s
from waterwave_hpo.bench._validate import planned_sim_trials
from waterwave_hpo.bench._validate import predict
from waterwave_hpo.bench._validate import sim_trials
from waterwave_hpo.bench._workloads import Setting
from waterwave_hpo.bench._workloads import Workload
from waterwave_hpo.bench._workloads import WorkloadSpec
from waterwave_hpo.bench._workloads import draw_params

if TYPE_CHECKING:
    import pandas as pd  # imported where a table is built: the bench's models need no pandas

CPU_NOTICE = (
    "CPU-only run: these numbers say nothing about GPUs. On the CPU co-hosted trials share the "
    "cores, cudaMallocAsync does not exist, the stream-aware pool is not used (CPU tensors "
    "cannot be routed through it) and only the waterwave scheduler's ledger enforces the "
    "(virtual) capacity; the stock-allocator methods cannot run out of memory here."
)


@dataclass(frozen=True)
class BenchConfig:
    """The ``waterwave-hpo bench`` flags.

    Attributes:
        out: The results folder; ``None``: ``experiments/results/<date>-<device>/``.
        device: ``auto`` (``cuda:0`` if there is one, else the CPU), ``cpu``, ``cuda`` or
            ``cuda:N``.
        k: Trials at once for every method but temporal (>= 1).
        trials: Trials per workload and setting (>= 1), the same parameter sets for every method.
        workloads: Which workloads.
        settings: Which settings.
        methods: Which methods (temporal is always run: it is the baseline of the ratios).
        steps: Training steps per trial; ``None``: fit to ``budget_s``.
        budget_s: Seconds the whole matrix should take (> 0), used to choose ``steps``.
        max_steps: The most steps per trial when fitting to the budget.
        capacity_bytes: Device memory to size the settings against, bytes; ``None``: on CUDA
            the device's total memory, on the CPU a virtual capacity (see ``fit_batches``).
        seed: Seeds the parameter draw, the models and the data.
        simulate: Print and record the simulator's prediction beside each measurement.
    """

    out: Path | None = None
    device: str = "auto"
    k: int = 4
    trials: int = 8
    workloads: tuple[Workload, ...] = tuple(Workload)
    settings: tuple[Setting, ...] = tuple(Setting)
    methods: tuple[Method, ...] = tuple(Method)
    steps: int | None = None
    budget_s: float = 600.0
    max_steps: int = 200
    capacity_bytes: int | None = None
    seed: int = 0
    simulate: bool = True
    command: tuple[str, ...] = field(default_factory=lambda: tuple(sys.argv))

    def __post_init__(self) -> None:
        for name, minimum in (("k", 1), ("trials", 1), ("max_steps", 1)):
            value = getattr(self, name)
            _checks.check_int(name, value, minimum=minimum)
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 1):
            raise _checks.value_error(
                "steps", self.steps, "must be an int >= 1", "pass steps, or None to fit budget_s"
            )
        _checks.check_finite_number("budget_s", self.budget_s, fix="pass seconds, e.g. 600")
        _checks.check_seed("seed", self.seed)
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise _checks.value_error(
                "capacity_bytes", self.capacity_bytes, "must be > 0", "pass bytes, or None"
            )
        resolve_device(self.device)  # a device that does not exist fails here, not mid-run
        if self.out is not None:
            check_out_value("out", self.out)  # not '', not a file
        if not self.workloads or not self.settings or not self.methods:
            raise ValueError(
                "workloads, settings and methods must each name at least one; got "
                f"workloads={self.workloads!r}, settings={self.settings!r}, "
                f"methods={self.methods!r}."
            )


@dataclass
class BenchResult:
    """What ``run_bench`` measured and where it wrote it.

    Attributes:
        out: The results folder.
        device: The device.
        results: One row per workload, setting and method.
        runs: The raw runs (every attempt of every trial).
        table: ``results`` as a DataFrame (``results.csv``).
        plan_comparison: Co-hosting with and without memory plans on the simulated device
            (``plans.csv``), when ``waterwave-plans`` ran and the simulator is on.
    """

    out: Path
    device: str
    results: list[MethodResult]
    runs: list[MethodRun]
    table: pd.DataFrame
    plan_comparison: list[PlanComparison] = field(default_factory=list)


def bench_file_names(config: BenchConfig) -> tuple[str, ...]:
    """Every file a run of ``config`` may write in its results folder (beside the manifest)."""
    tags = [f"{w.value}-{s.value}" for w in config.workloads for s in config.settings]
    return (
        "README.md",
        "results.csv",
        "results.json",
        "plans.csv",
        "throughput.png",
        *(f"gantt-{tag}.png" for tag in tags),
        *(f"memory-{tag}.png" for tag in tags),
    )


def run_bench(config: BenchConfig, log: Any = print) -> BenchResult:
    """Run the matrix and write the results folder.

    For each workload: draw ``config.trials`` parameter sets; fit the light and high batch
    sizes to the capacity (``fit_batches``); fit the steps per trial to ``budget_s``; then run
    every method on the same trials, one method after another; summarize, predict each run
    with the simulator, and write ``results.csv``, ``results.json``, ``README.md`` and the
    plots.

    Experimental on CUDA: the methods have never run on a GPU; the first CUDA run in a process
    emits :class:`waterwave_hpo.ExperimentalWarning`.

    Args:
        config: The settings.
        log: Called with each progress line (``print`` by default).

    Returns:
        The results and where they are.

    Raises:
        ValueError: For a device that does not exist.
        ForeignFileError: ``config.out`` holds a file of a name the bench writes that the
            project did not write (a ``ValueError``; nothing was written).
    """
    device = resolve_device(config.device)
    cuda = device.type == "cuda"
    kind = "cuda" if cuda else "cpu"
    started = datetime.datetime.now(datetime.timezone.utc)
    folder = claim_results_folder(
        config.out,
        default_folder(started, device_name(device)),
        "bench",
        bench_file_names(config),
    )
    out = folder.path
    if not cuda:
        log(CPU_NOTICE)
    capacity = config.capacity_bytes
    if capacity is None and cuda:
        capacity = int(torch.cuda.get_device_properties(device).total_memory)
    methods = [Method.TEMPORAL] + [m for m in config.methods if m is not Method.TEMPORAL]
    runnable = [m for m in methods if unavailable_reason(m, device) is None]
    plan: list[tuple[WorkloadSpec, list[dict[str, Any]], int, list[Any]]] = []
    # The memory-planning view of each trial, for the simulator's waterwave-plans prediction.
    plan_profiles: dict[tuple[Workload, Setting], list[PlanProfile]] = {}
    want_plans = config.simulate and Method.WATERWAVE_PLANS in runnable
    for workload in config.workloads:
        params = draw_params(workload, config.trials, config.seed)
        base = WorkloadSpec(
            workload, Setting.LIGHT, BASE_BATCH[kind][workload], 1, seq_len=SEQ_LEN[kind]
        )
        light, high, cap, light_profiles, high_profiles = fit_batches(
            base, params, config.k, capacity
        )
        light_plans = [plan_profile(light, p) for p in params] if want_plans else []
        for spec, profiles in ((light, light_profiles), (high, high_profiles)):
            if spec.setting in config.settings:
                plan.append((spec, params, cap, profiles))
                factor = spec.batch_size / light.batch_size
                plan_profiles[(workload, spec.setting)] = [p.scaled(factor) for p in light_plans]
    # Steps per trial: the temporal run of every spec and method must fit the budget.
    if config.steps is not None:
        plan = [(replace(s, steps=config.steps), p, c, pr) for s, p, c, pr in plan]
    else:
        share_s = config.budget_s / (len(plan) * len(runnable))
        fitted = []
        for spec, params, cap, profiles in plan:
            probe = params[max(range(len(params)), key=lambda i: profiles[i].peak_bytes)]
            step_s = (
                call_in_child(step_seconds, spec, probe, device)
                if cuda
                else step_seconds(spec, probe, device)
            )
            steps = int(share_s / (config.trials * max(step_s, 1e-4) * 1.5))
            steps = max(2, min(config.max_steps, steps))
            fitted.append((replace(spec, steps=steps), params, cap, profiles))
            log(
                f"{spec.workload.value}/{spec.setting.value}: {step_s * 1e3:.1f} ms/step solo, "
                f"{steps} steps per trial"
            )
        plan = fitted
    start_s = 0.0
    if config.simulate and Method.SPATIAL in runnable:
        start_s = measure_process_start_s(str(device))
        log(f"a spawned process needs {start_s:.2f} s to start (fed to the simulator)")
    results: list[MethodResult] = []
    runs: list[MethodRun] = []
    comparison: list[PlanComparison] = []
    for spec, params, cap, profiles in plan:
        peaks = sorted((p.peak_bytes for p in profiles), reverse=True)
        top_k = int(sum(peaks[: config.k]))
        log(
            f"== {spec.workload.value}, {spec.setting.value}: {config.trials} trials, batch "
            f"{spec.batch_size}, {spec.steps} steps, K={config.k}, capacity {cap / 2**20:.1f} "
            f"MiB, {config.k} largest solo peaks {top_k / 2**20:.1f} MiB"
        )
        spec_runs = []
        for method in methods:
            run = run_method(
                method, spec, params, device, config.k, seed=config.seed, capacity_bytes=cap
            )
            spec_runs.append(run)
        temporal = spec_runs[0]
        base_rate = temporal.samples / temporal.makespan_s if temporal.makespan_s > 0 else None
        spec_results = [result_of(r, config.trials, cap, top_k, base_rate) for r in spec_runs]
        if config.simulate:
            spec_results = _with_predictions(
                spec_results,
                spec_runs,
                profiles,
                cap,
                cuda,
                start_s,
                log,
                plan_profiles.get((spec.workload, spec.setting)),
            )
        for r in spec_results:
            log(_line(r))
        plan_profs = plan_profiles.get((spec.workload, spec.setting))
        trials = sim_trials(spec_runs[0], profiles) if plan_profs else None
        if plan_profs and trials is not None:
            rows = compare_plans(
                planned_sim_trials(trials, plan_profs),
                cap,
                config.k,
                workload=spec.workload.value,
                setting=spec.setting.value,
            )
            for row in rows:
                log(
                    f"   sim {row.sharing:<14} {row.makespan_s:7.2f} s  {row.ooms} OOM, "
                    f"{row.evictions} evicted, {row.reruns} re-runs, {row.planned_attempts} "
                    f"planned, {row.failed_trials} failed"
                )
            comparison += rows
        results += spec_results
        runs += spec_runs
    table = results_table(results)
    _write(folder, config, device, started, results, runs, table, comparison)
    log(f"wrote {out}/: README.md results.csv results.json *.png")
    return BenchResult(out, str(device), results, runs, table, comparison)


def _with_predictions(
    results: list[MethodResult],
    runs: list[MethodRun],
    profiles: list[Any],
    cap: int,
    cuda: bool,
    process_start_s: float,
    log: Any,
    plan_profiles: list[PlanProfile] | None = None,
) -> list[MethodResult]:
    trials = sim_trials(runs[0], profiles)
    if trials is None:
        return results
    threads = next((r for r in runs if r.method is Method.OPTUNA_THREADS and r.available), None)
    parallelism = fit_parallelism(threads, trials, cap, cuda) if threads is not None else 1.0
    log(f"   simulator: compute parallelism {parallelism:.2f} (fitted to optuna-threads only)")
    out = []
    for result, run in zip(results, runs, strict=True):
        if not run.available or result.makespan_s is None or run.method is Method.FUSED:
            out.append(result)  # the simulator does not model fused trials: no prediction
            continue
        if run.method is Method.WATERWAVE_PLANS:
            if not plan_profiles:
                out.append(result)
                continue
            run_trials = planned_sim_trials(trials, plan_profiles)
        else:
            run_trials = trials
        predicted = predict(run, run_trials, cap, cuda, parallelism, process_start_s)
        error = 100.0 * (predicted - result.makespan_s) / result.makespan_s
        out.append(replace(result, sim_makespan_s=predicted, sim_error_pct=error))
    return out


def _line(r: MethodResult) -> str:
    if not r.available:
        return f"   {r.method:<18} {r.note}"
    sim = (
        f"  sim {r.sim_makespan_s:7.2f} s ({r.sim_error_pct:+.0f}%)"
        if r.sim_makespan_s is not None
        else ""
    )
    peak = "" if r.peak_memory_bytes is None else f"  peak {r.peak_memory_bytes / 2**20:.1f} MiB"
    return (
        f"   {r.method:<18} {r.makespan_s:7.2f} s  {r.samples_per_s:9.1f} samples/s  "
        f"{r.ratio_to_temporal or 0:.2f}x temporal  {r.failed_trials} failed, {r.ooms} OOM, "
        f"{r.reruns} re-runs, {r.planned_attempts} planned"
        f"{peak}{sim}  [{r.allocator}]"
    )


def _write(
    folder: OwnedFolder,
    config: BenchConfig,
    device: torch.device,
    started: datetime.datetime,
    results: list[MethodResult],
    runs: list[MethodRun],
    table: pd.DataFrame,
    comparison: list[PlanComparison],
) -> None:
    folder.write("results.csv", lambda path: table.to_csv(path, index=False))
    if comparison:
        import pandas as pd

        plans = pd.DataFrame([asdict(c) for c in comparison])
        folder.write("plans.csv", lambda path: plans.to_csv(path, index=False))
    payload = {
        "cpu_only": device.type != "cuda",
        "notice": CPU_NOTICE if device.type != "cuda" else "",
        "started_utc": started.isoformat(),
        "command": list(config.command),
        "config": {
            k: (v if not isinstance(v, tuple) else [getattr(x, "value", x) for x in v])
            for k, v in asdict(config).items()
            if k not in ("out", "command")
        },
        "machine": machine(device),
        "versions": versions(),
        "units": UNITS,
        "results": [asdict(r) for r in results],
        "plan_comparison_simulated": [asdict(c) for c in comparison],
        "trials": [
            {
                "workload": run.spec.workload.value,
                "setting": run.spec.setting.value,
                "method": run.method.value,
                **{k: v for k, v in asdict(rec).items() if k != "memory"},
                "start_s": rec.start_s - run.start_s,
                "end_s": rec.end_s - run.start_s,
            }
            for run in runs
            for rec in run.records
        ],
    }
    folder.write_text("results.json", json.dumps(payload, indent=1, default=str) + "\n")
    title = f"{device_name(device)}" + (
        " (CPU-only: says nothing about GPUs)" if device.type != "cuda" else ""
    )
    folder.write(
        "throughput.png",
        lambda path: plot_throughput(results, path, f"Aggregate throughput, {title}"),
    )
    keys = sorted(
        {(r.spec.workload, r.spec.setting) for r in runs}, key=lambda k: (k[0].value, k[1].value)
    )
    for workload, setting in keys:
        group = [r for r in runs if (r.spec.workload, r.spec.setting) == (workload, setting)]
        tag = f"{workload.value}-{setting.value}"
        folder.write(
            f"gantt-{tag}.png",
            lambda path: plot_gantt(group, path, f"Trials over time: {tag}, {title}"),  # noqa: B023
        )
        mem = [
            r
            for r in group
            if r.method in (Method.WATERWAVE, Method.WATERWAVE_PLANS, Method.OPTUNA_THREADS)
        ]
        if mem:
            folder.write(
                f"memory-{tag}.png",
                lambda path: plot_memory(mem, path, f"Memory per trial: {tag}, {title}"),  # noqa: B023
            )
    folder.write_text("README.md", _readme(config, device, started, results, table, comparison))


def _fmt(x: Any, spec: str) -> str:
    return "" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def _readme(
    config: BenchConfig,
    device: torch.device,
    started: datetime.datetime,
    results: list[MethodResult],
    table: pd.DataFrame,
    comparison: list[PlanComparison],
) -> str:
    lines = [f"# waterwave-hpo bench: {device_name(device)}, {started:%Y-%m-%d %H:%M} UTC", ""]
    if device.type != "cuda":
        lines += [f"**{CPU_NOTICE}**", ""]
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    lines += [
        "Command: `" + " ".join(config.command) + "`",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
        + (
            f", load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min) when "
            "the run ended: a load above the core count means other jobs shared the machine "
            "and the timings are noisy"
            if load is not None
            else ""
        )
        + f"; torch intra-op threads per process: {torch.get_num_threads()}"
        + (
            f" (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})"
            if "OMP_NUM_THREADS" in os.environ
            else ""
        )
        + ".",
        "",
        f"Every workload ran under every method with the same {config.trials} trials (parameter "
        f"sets drawn once, seed {config.seed}), the same batch sizes and steps, {config.k} at a "
        "time (temporal: 1). *light*: the trials fit together; *high*: the sum of the "
        f"{config.k} largest solo peaks exceeds the capacity (the paper's high memory demand).",
        "",
        "| workload | setting | method | allocator | makespan s | samples/s | x temporal | "
        "failed | OOM | re-runs | planned | peak MiB | host ms/step | device ms/step | "
        "sim s (err) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r.available:
            lines.append(
                f"| {r.workload} | {r.setting} | {r.method} | | {r.note} | | | | | | | | | | |"
            )
            continue
        sim = (
            f"{r.sim_makespan_s:.2f} ({r.sim_error_pct:+.0f}%)"
            if r.sim_makespan_s is not None
            else ""
        )
        peak = "" if r.peak_memory_bytes is None else f"{r.peak_memory_bytes / 2**20:.1f}"
        lines.append(
            f"| {r.workload} | {r.setting} | {r.method} | {r.allocator} | "
            f"{_fmt(r.makespan_s, '.2f')} | "
            f"{_fmt(r.samples_per_s, '.1f')} | {_fmt(r.ratio_to_temporal, '.2f')} | "
            f"{r.failed_trials} | {r.ooms} | {r.reruns} | {r.planned_attempts} | {peak} | "
            f"{_fmt(None if r.host_s_per_step is None else r.host_s_per_step * 1e3, '.2f')} | "
            f"{_fmt(None if r.device_s_per_step is None else r.device_s_per_step * 1e3, '.2f')} | "
            f"{sim} |"
        )
    lines += [
        "",
        "Files: `results.csv` (one row per workload, setting and method; units in "
        "`results.json` under `units`), `results.json` (every number, the machine, versions, "
        "the command, every trial attempt), `throughput.png`, `gantt-<workload>-<setting>.png`, "
        "`memory-<workload>-<setting>.png`.",
        "",
        "How to read it:",
        "- *peak MiB*: on CUDA the device's used memory above the baseline (cudaMemGetInfo "
        "sampled every 5 ms, all processes); on the CPU only the waterwave scheduler's ledger "
        "(bytes accounted from NodeGroup profiles), elsewhere empty. Under waterwave each "
        "trial's first step profiles its model and runs ungated, so with one step per trial "
        "the ledger sees nothing.",
        "- *re-runs*: attempts that re-ran a trial after an out-of-memory error or an eviction; "
        "*planned*: attempts whose model ran with a HOME memory plan (`waterwave-plans`: the "
        'executor\'s `memory_plan="home"`, models registered with `ww.fit_trial_memory` '
        "instead of NodeGroup gates; a registered model holds its plain or planned peak in the "
        "ledger for the whole trial, without optimizer state, as the gates count).",
        "- *host ms/step*: median time Python takes to issue one training step. On CUDA it is "
        "the dispatch time, spent under the GIL by co-hosted trials; when it is not much "
        "smaller than *device ms/step* (CUDA events on the trial's stream) the model is "
        "dispatch-bound under co-hosting. On the CPU ops run synchronously, so host time is the "
        "whole step and device time is not separable.",
        "- *sim s (err)*: the simulator (`waterwave_hpo.sim`) predicting the makespan from the "
        "trials' profiles and their solo step times in the temporal run, and a separately "
        "measured process start-up time for spatial sharing; its one free parameter, the "
        "device's compute parallelism (below 1 when co-running trials interfere), is fitted to "
        "the optuna-threads run only, so the other methods' errors are predictions' errors.",
        "",
    ]
    if comparison:
        lines += [
            "## Co-hosting with and without memory plans, simulated (`plans.csv`)",
            "",
            "The same trials on the simulated device with the setting's capacity, K at a time, "
            "on a device that overlaps K trials' work: *stock* (no ledger: an allocation that "
            "does not fit is an out-of-memory error, the trial re-runs with fewer neighbours), "
            "*stock+plans* (models planned when they do not fit, re-runs planned for half their "
            "footprint), *ledger* (the executor's scheduler, registered models wait until their "
            'plain peak fits), *ledger+plans* (`memory_plan="home"`). Plans are the planning '
            "cost model's (smallest plan's peak and slowdown per trial, measured at the light "
            "batch and scaled).",
            "",
            "| workload | setting | sharing | K | makespan s | OOM | evicted | re-runs | planned "
            "| failed | peak MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {c.workload} | {c.setting} | {c.sharing} | {c.k} | {c.makespan_s:.2f} | "
            f"{c.ooms} | {c.evictions} | {c.reruns} | {c.planned_attempts} | "
            f"{c.failed_trials} | {c.peak_bytes / 2**20:.1f} |"
            for c in comparison
        ]
        lines.append("")
    return "\n".join(lines)
