"""Process isolation keeps ``Study.optimize``'s meaning: samplers, grids, seeds, errors, setup.

What an Optuna user's script does under ``Study.optimize`` must do the same when its trials run
in worker processes: samplers that keep state in the study, exhaustive samplers that stop the
study, seeded samplers, the objective's traceback, the script's logging and warning filters,
and ``DataLoader`` workers started from a trial.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
import logging
import multiprocessing
import sys
import traceback
from typing import Any
import warnings

from fakes.samplers import ReseedCountingSampler
import optuna
from optuna.trial import TrialState
import pytest
import torch

import waterwave_hpo as ww
from waterwave_hpo.host import ATTR_SLOT
from waterwave_hpo.host import RemoteTraceback

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def _optimize(k: int, study: optuna.Study, objective: Callable[..., object], **kwargs: Any) -> None:
    """``optimize`` through K warm workers, ended before returning (none outlives the test)."""
    with ww.WaterwaveExecutor(devices="cpu", trials_per_device=k, isolation="process") as executor:
        executor.optimize(study, objective, **kwargs)


def _two_objectives(trial: optuna.trial.Trial) -> tuple[float, float]:
    x = trial.suggest_float("x", 0.0, 1.0)
    y = trial.suggest_int("y", 0, 3)
    trial.study.set_user_attr(f"seen-{trial.number}", True)  # a common habit
    return x + y, (1.0 - x) + (3 - y)


def _one_objective(trial: optuna.trial.Trial) -> float:
    x = trial.suggest_float("x", -1.0, 1.0)
    trial.study.set_user_attr(f"seen-{trial.number}", True)
    return x * x


def _grid_objective(trial: optuna.trial.Trial) -> float:
    x = trial.suggest_int("x", 0, 2)
    y = trial.suggest_categorical("y", ["a", "b"])
    trial.study.set_user_attr(f"seen-{trial.number}", True)
    return x + (y == "b")


def _gp_sampler() -> optuna.samplers.BaseSampler:
    try:
        sampler = optuna.samplers.GPSampler(seed=0, n_startup_trials=2)
        # Optuna imports the GP's dependencies (scipy, torch) lazily, at the first fit.
        import scipy  # noqa: F401
    except ImportError as error:  # pragma: no cover (both are installed here)
        pytest.skip(f"Optuna's GPSampler needs {error.name}, which is not installed")
    return sampler


_SAMPLERS: dict[str, tuple[Callable[[], optuna.samplers.BaseSampler], int, int]] = {
    # name: (sampler, number of objectives, trials)
    "nsga2": (lambda: optuna.samplers.NSGAIISampler(population_size=4, seed=0), 2, 10),
    "nsga3": (lambda: optuna.samplers.NSGAIIISampler(population_size=4, seed=0), 2, 10),
    "tpe-multi": (lambda: optuna.samplers.TPESampler(seed=0, n_startup_trials=3), 2, 6),
    "tpe": (lambda: optuna.samplers.TPESampler(seed=0, n_startup_trials=3), 1, 6),
    "qmc": (lambda: optuna.samplers.QMCSampler(seed=0), 1, 6),
    "gp": (_gp_sampler, 1, 4),
}


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("name", sorted(_SAMPLERS))
def test_samplers_that_keep_state_in_the_study_complete_it(name: str, k: int) -> None:
    make_sampler, n_objectives, n_trials = _SAMPLERS[name]
    study = optuna.create_study(directions=["minimize"] * n_objectives, sampler=make_sampler())
    objective = _two_objectives if n_objectives == 2 else _one_objective
    _optimize(k, study, objective, n_trials=n_trials)
    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * n_trials
    # trial.study.set_user_attr in the objective reached the driver's study.
    assert {key for key in study.user_attrs} == {f"seen-{t.number}" for t in trials}


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("sampler_name", ["grid", "brute-force"])
def test_exhaustive_samplers_end_the_study_quietly_when_the_grid_is_done(
    sampler_name: str, k: int
) -> None:
    sampler = (
        optuna.samplers.GridSampler({"x": [0, 1, 2], "y": ["a", "b"]}, seed=0)
        if sampler_name == "grid"
        # By default BruteForceSampler counts running trials' points as done, so with
        # n_jobs > 1 Optuna's own optimize may stop before the last point (about 6 runs in 100
        # at n_jobs=2, measured): its strict mode is the one with a guarantee to test.
        else optuna.samplers.BruteForceSampler(seed=0, avoid_premature_stop=k > 1)
    )
    study = optuna.create_study(sampler=sampler)
    # More trials than the grid has points: the sampler stops the study, as under optimize.
    _optimize(k, study, _grid_objective, n_trials=20)
    trials = study.get_trials(deepcopy=False)
    assert all(t.state is TrialState.COMPLETE for t in trials)
    assert {(t.params["x"], t.params["y"]) for t in trials} == {
        (x, y) for x in range(3) for y in "ab"
    }
    if k == 1:  # one trial at a time: exactly the grid, as Study.optimize
        assert len(trials) == 6
    else:  # a trial asked while others run may repeat a point, as with n_jobs > 1; the stop came
        assert 6 <= len(trials) < 20


def _tpe_params(run: Callable[[optuna.Study], None]) -> list[float]:
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=3))
    run(study)
    return [t.params["x"] for t in study.get_trials(deepcopy=False)]


def test_a_seeded_sampler_at_k1_draws_optunas_sequence() -> None:
    def through_workers(study: optuna.Study) -> None:
        _optimize(1, study, _one_objective, n_trials=6)

    first = _tpe_params(through_workers)
    assert _tpe_params(through_workers) == first
    assert _tpe_params(lambda study: study.optimize(_one_objective, n_trials=6)) == first


class _CountingSampler(optuna.samplers.RandomSampler):
    """Counts ``reseed_rng`` calls in the process that samples (a worker's copy)."""

    reseeds = 0

    def reseed_rng(self) -> None:
        type(self).reseeds += 1
        super().reseed_rng()


def _reseeds_seen(trial: optuna.trial.Trial) -> float:
    trial.set_user_attr("reseeds", type(trial.study.sampler).reseeds)
    return trial.suggest_float("x", 0.0, 1.0)


def test_workers_reseed_their_sampler_once_per_run_when_trials_run_at_once() -> None:
    # Each worker unpickles the same sampler: it reseeds its copy once as it opens a run (a
    # reseed costs more than the rest of a trivial trial's sampling), never per trial.
    with ww.WaterwaveExecutor(devices="cpu", trials_per_device=2, isolation="process") as executor:
        for run in (1, 2):
            study = optuna.create_study(sampler=_CountingSampler(seed=0))
            executor.optimize(study, _reseeds_seen, n_trials=6)
            trials = study.get_trials(deepcopy=False)
            # The count lives in each worker process: one more per run, whatever it ran.
            assert [t.user_attrs["reseeds"] for t in trials] == [run] * 6
            assert len({t.params["x"] for t in trials}) == 6


def test_the_driver_reseeds_its_sampler_once_per_run_when_workers_sample() -> None:
    # The trials sample in the workers (each reseeds its copy once per run); the driver's
    # sampler only sees before_trial and after_trial: one reseed per optimize call, as
    # Study.optimize(n_trials=1, n_jobs=2) makes one (Optuna's test_optimize_with_reseeding).
    sampler = ReseedCountingSampler()
    study = optuna.create_study(sampler=sampler)
    with ww.WaterwaveExecutor(devices="cpu", trials_per_device=2, isolation="process") as executor:
        executor.optimize(study, _one_objective, n_trials=6)
        assert sampler.reseeds == 1
        executor.optimize(study, _one_objective, n_trials=1)
    assert sampler.reseeds == 2
    assert len({t.params["x"] for t in study.get_trials(deepcopy=False)}) == 7


def test_one_worker_never_reseeds_its_sampler() -> None:
    # One trial at a time: never reseeded (Study.optimize with n_jobs=1).
    study = optuna.create_study(sampler=_CountingSampler(seed=0))
    _optimize(1, study, _reseeds_seen, n_trials=4)
    assert [t.user_attrs["reseeds"] for t in study.get_trials(deepcopy=False)] == [0] * 4


@pytest.mark.parametrize(
    "sampler",
    [
        lambda: optuna.samplers.RandomSampler(seed=0),
        lambda: optuna.samplers.TPESampler(seed=0, n_startup_trials=4),
    ],
    ids=["random", "tpe"],
)
def test_seeded_samplers_draw_distinct_parameters_in_each_worker(
    sampler: Callable[[], optuna.samplers.BaseSampler],
) -> None:
    # Without a reseed, K workers holding the same pickled sampler draw the same values.
    study = optuna.create_study(sampler=sampler())
    with ww.WaterwaveExecutor(
        devices="cpu", trials_per_device=3, isolation="process", record_trial_attrs=True
    ) as executor:
        executor.optimize(study, _one_objective, n_trials=12)
    values = [t.params["x"] for t in study.get_trials(deepcopy=False)]
    slots = {t.system_attrs[ATTR_SLOT] for t in study.get_trials(deepcopy=False)}
    assert len(slots) > 1  # trials ran in more than one worker
    assert len(set(values)) == 12


def _missing_key(trial: optuna.trial.Trial) -> float:
    table = {"a": 1.0}
    return table["b"]  # the user's bug: its frame must reach the user


@pytest.fixture
def optuna_records(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    optuna.logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING, logger="optuna"):
            yield caplog
    finally:
        optuna.logging.disable_propagation()


def test_an_uncaught_error_carries_the_objectives_traceback(
    optuna_records: pytest.LogCaptureFixture,
) -> None:
    study = optuna.create_study()
    with pytest.raises(KeyError, match="'b'") as raised:
        _optimize(1, study, _missing_key, n_trials=3)
    cause = raised.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    shown = "".join(traceback.format_exception(raised.value))  # what Python prints
    assert __file__ in shown and "in _missing_key" in shown and 'return table["b"]' in shown
    failed = [r for r in optuna_records.records if "Trial 0 failed with parameters" in r.message]
    assert len(failed) == 1 and failed[0].exc_info is not None
    logged = logging.Formatter().formatException(failed[0].exc_info)
    assert __file__ in logged and "in _missing_key" in logged
    assert [t.state for t in study.get_trials(deepcopy=False)] == [TrialState.FAIL]


class _NeedsTwoArguments(Exception):
    """An exception whose class cannot be rebuilt by pickle (its __init__ takes two)."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


def _raises_unpicklable(trial: optuna.trial.Trial) -> float:
    raise _NeedsTwoArguments("model", "diverged")


def test_an_error_that_cannot_be_pickled_keeps_its_name_and_traceback() -> None:
    study = optuna.create_study()
    with pytest.raises(RuntimeError, match="_NeedsTwoArguments: model: diverged") as raised:
        _optimize(1, study, _raises_unpicklable, n_trials=1)
    cause = raised.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert __file__ in cause.text and "in _raises_unpicklable" in cause.text


def _environment_seen(trial: optuna.trial.Trial) -> float:
    root = logging.getLogger()
    trial.set_user_attr("root_level", root.level)
    trial.set_user_attr(
        "root_handlers",
        [(type(h).__name__, h.level, getattr(h.formatter, "_fmt", None)) for h in root.handlers],
    )
    trial.set_user_attr("optuna_level", logging.getLogger("optuna").level)
    trial.set_user_attr("quiet_level", logging.getLogger("user.quiet").level)
    with warnings.catch_warnings(record=True) as shown:
        warnings.warn("waterwave-probe: ignored by the script", UserWarning, stacklevel=1)
    trial.set_user_attr("probe_warnings_shown", len(shown))
    trial.set_user_attr("start_method", multiprocessing.get_start_method())
    return 0.0


@pytest.fixture
def script_setup() -> Iterator[None]:
    """What a user's script sets up before optimize: levels, a handler, a warning filter."""
    root = logging.getLogger()
    saved = (root.level, list(root.handlers), logging.getLogger("optuna").level)
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.ERROR)
    handler.setFormatter(logging.Formatter("user: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    logging.getLogger("user.quiet").setLevel(logging.CRITICAL)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="waterwave-probe")
        try:
            yield
        finally:
            root.removeHandler(handler)
            root.setLevel(saved[0])
            optuna.logging.set_verbosity(saved[2])
            logging.getLogger("user.quiet").setLevel(logging.NOTSET)


@pytest.mark.usefixtures("script_setup")
def test_the_scripts_logging_and_warning_filters_reach_the_workers() -> None:
    study = optuna.create_study()
    _optimize(1, study, _environment_seen, n_trials=1)
    seen = study.trials[0].user_attrs
    assert seen["root_level"] == logging.DEBUG
    handlers = [tuple(handler) for handler in seen["root_handlers"]]
    assert ("StreamHandler", logging.ERROR, "user: %(message)s") in handlers
    assert seen["optuna_level"] == logging.ERROR
    assert seen["quiet_level"] == logging.CRITICAL
    assert seen["probe_warnings_shown"] == 0
    if sys.platform.startswith("linux"):
        assert seen["start_method"] == multiprocessing.get_start_method(allow_none=True) or "fork"


def _loads_a_dataset_defined_in_the_objective(trial: optuna.trial.Trial) -> float:
    # A class that exists in the worker only by value (cloudpickle): a DataLoader worker started
    # with spawn or forkserver could not unpickle it; a forked one inherits it.
    class Squares(torch.utils.data.Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.tensor(float(index * index))

    total = 0.0
    for _epoch in range(2):
        for batch in torch.utils.data.DataLoader(Squares(), batch_size=4, num_workers=2):
            total += float(batch.sum())
    return total


@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods() or sys.platform == "darwin",
    reason="DataLoader workers fork only where the platform forks",
)
def test_dataloader_workers_of_a_trial_fork_from_the_worker() -> None:
    study = optuna.create_study()
    _optimize(1, study, _loads_a_dataset_defined_in_the_objective, n_trials=1)
    assert study.trials[0].state is TrialState.COMPLETE
    assert study.trials[0].value == 2 * sum(i * i for i in range(8))
