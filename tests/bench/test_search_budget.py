"""DeadlinePruner: the search's pruner until the budget is spent, then every trial stops."""

from __future__ import annotations

import pickle
import time

import optuna

from waterwave_hpo.bench import DeadlinePruner


class _PruneOne(optuna.pruners.BasePruner):
    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        return trial.number == 1


def _trials(pruner: optuna.pruners.BasePruner) -> tuple[optuna.Study, list]:
    study = optuna.create_study(pruner=pruner)
    trials = [study.ask() for _ in range(3)]
    for trial in trials:
        trial.report(0.5, 0)
    return study, trials


def test_before_the_deadline_the_search_pruner_decides() -> None:
    pruner = DeadlinePruner(_PruneOne())
    pruner.start(3600.0)
    _, trials = _trials(pruner)
    assert [t.should_prune() for t in trials] == [False, True, False]


def test_after_the_deadline_every_trial_is_pruned() -> None:
    pruner = DeadlinePruner(_PruneOne(), deadline_s=time.time() - 1.0)
    _, trials = _trials(pruner)
    assert [t.should_prune() for t in trials] == [True, True, True]


def test_start_sets_the_deadline_from_now_and_it_survives_pickling() -> None:
    pruner = DeadlinePruner(_PruneOne())
    before = time.time()
    now = pruner.start(12.5)
    assert before <= now <= time.time() and pruner.deadline_s == now + 12.5
    copy = pickle.loads(pickle.dumps(pruner))  # workers of isolation="process" ask a copy
    assert copy.deadline_s == pruner.deadline_s and isinstance(copy.base, _PruneOne)


def test_past_the_deadline_the_callback_stops_the_study() -> None:
    pruner = DeadlinePruner(_PruneOne())
    pruner.start(3600.0)
    study = optuna.create_study(pruner=pruner)
    study.optimize(lambda t: 0.0, n_trials=2, callbacks=[pruner.stop_study])
    assert len(study.trials) == 2  # before the deadline: nothing stopped
    pruner.deadline_s = time.time() - 1.0
    study.optimize(lambda t: 0.0, n_trials=5, callbacks=[pruner.stop_study])
    assert len(study.trials) == 3  # the first trial past the deadline stopped the study
