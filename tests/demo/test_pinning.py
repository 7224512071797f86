"""StructurePinningSampler: a following trial takes its leader's structure, samples the rest."""

from __future__ import annotations

import pickle

import optuna
from optuna.trial import TrialState

from waterwave_hpo.demo import StructurePinningSampler

CHOICES = list(range(50))


def _suggest(trial: optuna.trial.Trial) -> None:
    trial.suggest_categorical("width", CHOICES)
    trial.suggest_int("depth", 1, 1000)
    trial.suggest_float("lr", 1e-5, 1.0, log=True)


def _study(base: optuna.samplers.BaseSampler) -> tuple[optuna.Study, StructurePinningSampler]:
    sampler = StructurePinningSampler(base, free=("lr",))
    return optuna.create_study(sampler=sampler), sampler


def _leader_and_follower(study: optuna.Study, sampler: StructurePinningSampler) -> tuple:
    leader = study.ask()
    _suggest(leader)
    follower = study.ask()
    sampler.follow(follower.number, leader.params)
    _suggest(follower)
    return leader, follower


def test_a_follower_takes_the_structure_and_samples_the_free_parameters() -> None:
    study, sampler = _study(optuna.samplers.RandomSampler(seed=3))
    leader, follower = _leader_and_follower(study, sampler)
    assert follower.params["width"] == leader.params["width"]
    assert follower.params["depth"] == leader.params["depth"]
    assert follower.params["lr"] != leader.params["lr"]  # sampled by the base sampler
    # Recorded as the follower's own parameters, with their distributions: TPE learns from it.
    assert set(follower.distributions) == {"width", "depth", "lr"}
    # A trial nobody told to follow samples everything.
    others = []
    for _ in range(5):
        other = study.ask()
        _suggest(other)
        others.append((other.params["width"], other.params["depth"]))
    assert any(o != (leader.params["width"], leader.params["depth"]) for o in others)


def test_relative_sampling_does_not_override_the_pinned_values() -> None:
    # Multivariate TPE samples every parameter of its relative search space at the first
    # suggestion; the follower's structure must still be the leader's.
    base = optuna.samplers.TPESampler(seed=0, n_startup_trials=3, multivariate=True)
    study, sampler = _study(base)
    for _ in range(6):
        trial = study.ask()
        _suggest(trial)
        study.tell(trial, trial.params["lr"])
    for _ in range(3):
        leader, follower = _leader_and_follower(study, sampler)
        assert follower.params["width"] == leader.params["width"]
        assert follower.params["depth"] == leader.params["depth"]
        study.tell(leader, 1.0)
        study.tell(follower, 1.0)


def test_a_finished_trial_is_forgotten_and_pins_survive_pickling() -> None:
    study, sampler = _study(optuna.samplers.RandomSampler(seed=0))
    leader, follower = _leader_and_follower(study, sampler)
    copy = pickle.loads(pickle.dumps(sampler))
    assert copy.pinned(follower.number) == {
        "width": leader.params["width"],
        "depth": leader.params["depth"],
    }
    study.tell(follower, state=TrialState.PRUNED)
    assert sampler.pinned(follower.number) == {}
