"""One row per (workload, setting, method): the numbers the bench reports, with units."""

from __future__ import annotations

from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import fields
import statistics
from typing import TYPE_CHECKING

from waterwave_hpo.bench._runners import MethodRun

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True)
class MethodResult:
    """What one method measured on one workload and setting (units in the names).

    Attributes:
        workload: ``resnet``, ``gpt`` or ``digits``.
        setting: ``light`` or ``high``.
        method: The :class:`Method` value.
        available: Whether it ran on this device (``note`` says why not).
        note: MPS, allocator backend, scheduler counters, how memory was measured.
        device: ``cpu`` or ``cuda:N``.
        k: Trials at once.
        n_trials: Trials run (the same parameter sets for every method).
        batch_size: Samples per step.
        steps_per_trial: Training steps per trial.
        capacity_bytes: The device memory the setting is sized against.
        solo_peaks_top_k_bytes: The sum of the ``k`` largest solo peaks (profiled): above
            ``capacity_bytes`` means high memory demand.
        makespan_s: Seconds from launch to the last trial's end.
        samples_per_s: Samples of completed trials per second of makespan.
        ratio_to_temporal: ``samples_per_s`` over temporal sharing's.
        peak_memory_bytes: Peak device memory; empty where not measurable.
        peak_memory_source: How it was measured.
        ooms: Attempts that ran out of memory (or were evicted by the scheduler).
        reruns: Attempts that re-ran a trial's parameters after an out-of-memory error or an
            eviction (the executor's ``on_oom="retry"``).
        planned_attempts: Attempts whose model ran with a memory plan (``waterwave-plans``).
        failed_trials: Trials that never completed.
        completed_trials: Trials that completed.
        host_s_per_step: Median over trials of the median host (dispatch) seconds per step.
        device_s_per_step: The same for device seconds (CUDA events); empty on the CPU.
        sim_makespan_s: The simulator's prediction of ``makespan_s``.
        sim_error_pct: ``100 * (sim - measured) / measured``.
        allocator: The device allocator the method's trials ran on (an :class:`Allocator`
            value: ``pytorch-caching``, ``cudaMallocAsync``, ``waterwave-pool``, ``cpu``);
            empty when it did not run.
    """

    workload: str
    setting: str
    method: str
    available: bool
    note: str
    device: str
    k: int
    n_trials: int
    batch_size: int
    steps_per_trial: int
    capacity_bytes: int
    solo_peaks_top_k_bytes: int
    makespan_s: float | None
    samples_per_s: float | None
    ratio_to_temporal: float | None
    peak_memory_bytes: int | None
    peak_memory_source: str
    ooms: int | None
    reruns: int | None
    planned_attempts: int | None
    failed_trials: int | None
    completed_trials: int | None
    host_s_per_step: float | None
    device_s_per_step: float | None
    sim_makespan_s: float | None = None
    sim_error_pct: float | None = None
    allocator: str = ""


UNITS = {
    "makespan_s": "seconds",
    "samples_per_s": "samples per second (images; sequences for gpt)",
    "ratio_to_temporal": "ratio (throughput / temporal throughput)",
    "peak_memory_bytes": "bytes",
    "capacity_bytes": "bytes",
    "solo_peaks_top_k_bytes": "bytes",
    "host_s_per_step": "seconds",
    "device_s_per_step": "seconds",
    "sim_makespan_s": "seconds",
    "sim_error_pct": "percent",
    "batch_size": "samples per step",
    "steps_per_trial": "steps",
    "k": "trials at once",
    "n_trials": "trials",
    "ooms": "attempts",
    "reruns": "attempts",
    "planned_attempts": "attempts",
    "failed_trials": "trials",
    "completed_trials": "trials",
}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def result_of(
    run: MethodRun,
    n_trials: int,
    capacity_bytes: int,
    solo_peaks_top_k_bytes: int,
    temporal_samples_per_s: float | None,
) -> MethodResult:
    """Summarize ``run`` as a row."""
    spec = run.spec
    common = dict(
        workload=spec.workload.value,
        setting=spec.setting.value,
        method=run.method.value,
        available=run.available,
        note=run.note,
        device=run.device,
        k=run.k,
        n_trials=n_trials,
        batch_size=spec.batch_size,
        steps_per_trial=spec.steps,
        capacity_bytes=capacity_bytes,
        solo_peaks_top_k_bytes=solo_peaks_top_k_bytes,
        peak_memory_source=run.peak_memory_source,
        allocator="" if run.allocator is None else run.allocator.value,
    )
    if not run.available:
        return MethodResult(
            **common,  # type: ignore[arg-type]
            makespan_s=None,
            samples_per_s=None,
            ratio_to_temporal=None,
            peak_memory_bytes=None,
            ooms=None,
            reruns=None,
            planned_attempts=None,
            failed_trials=None,
            completed_trials=None,
            host_s_per_step=None,
            device_s_per_step=None,
        )
    rate = run.samples / run.makespan_s if run.makespan_s > 0 else 0.0
    completed = [r for r in run.records if r.complete]
    return MethodResult(
        **common,  # type: ignore[arg-type]
        makespan_s=run.makespan_s,
        samples_per_s=rate,
        ratio_to_temporal=rate / temporal_samples_per_s if temporal_samples_per_s else None,
        peak_memory_bytes=run.peak_memory_bytes,
        ooms=sum(r.oom for r in run.records),
        reruns=sum(r.attempt > 0 for r in run.records),
        planned_attempts=sum(r.planned for r in run.records),
        failed_trials=n_trials - len(run.completed),
        completed_trials=len(run.completed),
        host_s_per_step=_median([r.host_s_per_step for r in completed if r.host_s_per_step]),
        device_s_per_step=_median(
            [r.device_s_per_step for r in completed if r.device_s_per_step is not None]
        ),
    )


def results_table(results: list[MethodResult]) -> pd.DataFrame:
    """The rows as a DataFrame, columns in :class:`MethodResult` order."""
    import pandas as pd  # here, not at the top: the bench's models import without pandas

    columns = [f.name for f in fields(MethodResult)]
    return pd.DataFrame([asdict(r) for r in results], columns=columns)
