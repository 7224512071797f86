"""The demo's NAS search, fused: a batch shares its first trial's structure, trains as one."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState
import pytest

import waterwave_hpo as ww
from waterwave_hpo.demo import PER_MODEL_PARAMS
from waterwave_hpo.demo import demo_pruner
from waterwave_hpo.demo import demo_sampler
from waterwave_hpo.demo import load_digits
from waterwave_hpo.demo import make_fused_nas_objective
from waterwave_hpo.demo import nas_pinning_sampler

# Small leaders, so the test trains little; their followers are sampled (pinned by the sampler).
LEADERS = [
    {"n_conv": 1, "channels_0": 8, "kernel_0": 3, "hidden": 32, "optimizer": "adam"},
    {"n_conv": 1, "channels_0": 16, "kernel_0": 5, "hidden": 32, "optimizer": "sgd"},
]


def test_each_batch_trains_one_structure_and_every_trial_ends() -> None:
    sampler = nas_pinning_sampler(demo_sampler(0))
    study = optuna.create_study(direction="maximize", sampler=sampler, pruner=demo_pruner())
    for leader in LEADERS:
        study.enqueue_trial({**leader, "batch_size": 128, "lr": 0.01, "dropout": 0.1})
        study.enqueue_trial({})  # the follower: nothing fixed, its structure pinned
    objective = make_fused_nas_objective(load_digits(), epochs=1, seed=0, sampler=sampler)
    executor = ww.WaterwaveExecutor("cpu", trials_per_device=1, fuse=2, record_trial_attrs=True)
    executor.optimize(study, objective, n_trials=4)
    trials = study.get_trials(deepcopy=False)
    assert all(t.state is TrialState.COMPLETE for t in trials), [t.state for t in trials]
    assert all(0.0 <= t.value <= 1.0 for t in trials)  # type: ignore[operator]
    batches = {tuple(t.system_attrs["waterwave:batch"]) for t in trials}
    assert batches == {(0, 1), (2, 3)}
    for first, second in batches:
        a, b = trials[first].params, trials[second].params
        structure = {k: v for k, v in a.items() if k not in PER_MODEL_PARAMS}
        assert structure and structure == {k: v for k, v in b.items() if k not in PER_MODEL_PARAMS}
        assert a["lr"] != b["lr"]  # each model its own learning rate
    assert [trials[n].params["optimizer"] for n in (1, 3)] == ["adam", "sgd"]


def test_a_study_without_the_pinning_sampler_is_refused() -> None:
    sampler = nas_pinning_sampler(demo_sampler(0))
    study = optuna.create_study(direction="maximize", sampler=demo_sampler(0))
    objective = make_fused_nas_objective(load_digits(), epochs=1, seed=0, sampler=sampler)
    trials = [study.ask(), study.ask()]
    with pytest.raises(ValueError, match=r"not the study.s sampler.*create the study with"):
        objective(trials)
    for trial in trials:
        study.tell(trial, state=TrialState.FAIL)
