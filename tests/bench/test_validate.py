"""The simulator's model of each method, and its one fitted parameter."""

from __future__ import annotations

import pytest

from waterwave_hpo.bench import Method
from waterwave_hpo.bench import MethodRun
from waterwave_hpo.bench import Setting
from waterwave_hpo.bench import TrialRecord
from waterwave_hpo.bench import Workload
from waterwave_hpo.bench import WorkloadSpec
from waterwave_hpo.bench._validate import fit_parallelism
from waterwave_hpo.bench._validate import sharing_of
from waterwave_hpo.bench._validate import sim_trials
from waterwave_hpo.scheduler import TrialProfile

SPEC = WorkloadSpec(Workload.RESNET, Setting.LIGHT, batch_size=4, steps=2)


def run_of(method: Method, k: int, spans: list[tuple[float, float]]) -> MethodRun:
    run = MethodRun(method, SPEC, k, "cpu", start_s=0.0, end_s=max(e for _, e in spans))
    run.records = [
        TrialRecord(index=i, start_s=s, end_s=e, complete=True, samples=8)
        for i, (s, e) in enumerate(spans)
    ]
    return run


def test_methods_map_to_the_simulator() -> None:
    assert sharing_of(Method.TEMPORAL, 4).concurrency == 1
    assert sharing_of(Method.OPTUNA_THREADS, 4).policy is None
    assert sharing_of(Method.SPATIAL, 4).processes
    assert sharing_of(Method.WATERWAVE_FIFO, 4).policy == "fifo"
    assert sharing_of(Method.WATERWAVE, 4).policy == "waterwave"


def test_solo_times_come_from_the_temporal_run() -> None:
    profiles = [TrialProfile.of(0, [10]), TrialProfile.of(0, [10])]
    temporal = run_of(Method.TEMPORAL, 1, [(0.0, 2.0), (2.0, 6.0)])
    trials = sim_trials(temporal, profiles)
    assert trials is not None
    assert [t.solo_s for t in trials] == pytest.approx([2.0, 4.0])
    temporal.records[1].complete = False
    assert sim_trials(temporal, profiles) is None


@pytest.mark.parametrize(("measured", "expected"), [(6.0, 1.0), (4.0, 2.0)])
def test_parallelism_is_fitted_to_threads(measured: float, expected: float) -> None:
    # Two solo trials of 2 s and 4 s: in one thread pool with parallelism 1 they end at 6 s,
    # with parallelism 2 at 4 s.
    profiles = [TrialProfile.of(0, [10]), TrialProfile.of(0, [10])]
    trials = sim_trials(run_of(Method.TEMPORAL, 1, [(0.0, 2.0), (2.0, 6.0)]), profiles)
    assert trials is not None
    threads = run_of(Method.OPTUNA_THREADS, 2, [(0.0, measured), (0.0, measured)])
    assert fit_parallelism(threads, trials, 1 << 30, cuda=False) == pytest.approx(expected)
