"""WaterwaveExecutor(memory_plan="home"): trials that do not fit run with a HOME plan (CPU, ledger).

The device here is the pipeline scheduler's ledger (accounted bytes) and, for out-of-memory
errors, a simulated device of a fixed capacity that the objective checks against the plan's
measured ledger peak: what the executor does must follow from those bytes alone.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import optuna
from optuna.trial import TrialState
import pytest
import torch
from torch import nn

import waterwave_hpo as ww
from waterwave_hpo.executor import trial_memory_plan
from waterwave_hpo.nodegroup._internal import has_pipeline
from waterwave_hpo.planning import PLANNERS
from waterwave_hpo.planning import memory_ledger
from waterwave_hpo.planning import remove_memory_plan
from waterwave_hpo.planning import step_profile_of
from waterwave_hpo.report import trials_table

BATCH = 512
WIDTH = 256


def _mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))


def _peaks() -> tuple[int, int]:
    """(plain peak, smallest planned peak) of one step of the MLP with SGD, in bytes."""
    model = _mlp()
    ww.fit_memory(model, 1 << 40, example_input=_batch()[0], planner="none")
    profile = step_profile_of(model)
    remove_memory_plan(model)
    bw = ww.planning.DEFAULT_BANDWIDTH_BYTES_PER_S
    plain = PLANNERS["none"](profile, 0, bandwidth_bytes_per_s=bw, seed=0)
    smallest = min(
        PLANNERS[name](profile, 0, bandwidth_bytes_per_s=bw, seed=0).prediction.peak_bytes
        for name in ("swap_all", "checkpoint_sqrt")
    )
    return plain.prediction.peak_bytes, smallest


PLAIN_BYTES, SMALLEST_BYTES = _peaks()


def _train(model: nn.Module, steps: int, pause_s: float = 0.0) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = _batch()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        time.sleep(pause_s)
    return float(loss.item())


def _register(model: nn.Module) -> nn.Module:
    return ww.fit_trial_memory(model, example_input=_batch()[0])


def test_the_model_is_small_against_its_activations() -> None:
    # The scenarios below need a model whose plans can halve its step's peak.
    assert 2 * SMALLEST_BYTES < PLAIN_BYTES


def test_a_trial_that_does_not_fit_beside_its_neighbour_runs_with_a_plan_for_what_is_left() -> None:
    budget = PLAIN_BYTES + PLAIN_BYTES // 2
    registered = threading.Event()
    both = threading.Barrier(2, timeout=30)

    def objective(trial: optuna.trial.Trial) -> float:
        torch.manual_seed(trial.number)
        if trial.number == 1:
            assert registered.wait(timeout=30)
        model = _register(_mlp())
        if trial.number == 0:
            registered.set()
        both.wait()  # both hold their footprints at once
        return _train(model, 2)

    executor = ww.WaterwaveExecutor(
        "cpu",
        trials_per_device=2,
        memory_budget_bytes=budget,
        memory_plan="home",
        record_trial_attrs=True,
    )
    study = optuna.create_study()
    executor.optimize(study, objective, n_trials=2)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    assert trial_memory_plan(study.trials[0]) is None  # it fitted alone: no plan
    plan = trial_memory_plan(study.trials[1])
    assert plan is not None and plan.planner == "pso"
    assert plan.budget_bytes <= budget - PLAIN_BYTES
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert set(plan.choices.values()) != {"keep"}
    stats = executor.schedulers["cpu"].stats()
    assert stats.peak_bytes <= budget and stats.used_bytes == 0
    assert stats.evictions == 0


def test_a_trial_that_runs_out_of_memory_reruns_with_a_plan_and_completes(
    storage: optuna.storages.BaseStorage,
) -> None:
    # A simulated device smaller than the plain step (the budget the executor was told is
    # larger, as when the cost model errs on a GPU): the objective raises CUDA's OOM when the
    # step's measured peak (the plan's ledger; the plain peak without a plan) exceeds it.
    capacity = (PLAIN_BYTES * 6) // 10

    def objective(trial: optuna.trial.Trial) -> float:
        trial.suggest_float("lr", 1e-3, 1e-1, log=True)
        model = _register(_mlp())
        loss = _train(model, 2)
        try:
            static = step_profile_of(model).static_bytes
            peak = static + memory_ledger(model).peak_bytes
        except ValueError:  # no plan installed: the plain step
            peak = PLAIN_BYTES
        if peak > capacity:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory: {peak} > {capacity} bytes")
        return loss

    executor = ww.WaterwaveExecutor(
        "cpu",
        trials_per_device=1,
        memory_budget_bytes=4 * PLAIN_BYTES,
        memory_plan="home",
        memory_planner="capuchin",
        record_trial_attrs=True,
    )
    study = optuna.create_study(storage=storage)
    executor.optimize(study, objective, n_trials=1)
    first, rerun = study.trials
    assert first.state is TrialState.FAIL and "out of device memory" in str(
        first.system_attrs["waterwave:fail_reason"]
    )
    assert rerun.state is TrialState.COMPLETE
    assert rerun.params == first.params
    assert rerun.system_attrs["waterwave:retry_of"] == 0
    assert rerun.system_attrs["waterwave:plan_cap_bytes"] == PLAIN_BYTES // 2
    plan = trial_memory_plan(rerun)  # read back from the storage's system attributes
    assert plan is not None
    assert plan.budget_bytes <= PLAIN_BYTES // 2  # PLAN_SHRINK of the failed footprint
    table = trials_table(study)
    assert table["plan_planner"].tolist()[1] in ("capuchin", "pso")
    assert table["plan_peak_bytes"].tolist()[1] == plan.predicted_peak_bytes
    assert table["plan_peak_bytes"].isna().tolist()[0]
    assert '"recompute"' in table["plan_choices"][1] or '"swap"' in table["plan_choices"][1]


def test_an_attempt_the_scheduler_evicts_reruns_at_once_with_a_smaller_plan() -> None:
    # The pipeline scheduler evicts a trial (BudgetExceededError from its gate) to break a
    # deadlock; here the first attempt is evicted right after registering its model. Without
    # plans an evicted trial that was alone is not re-run; with plans it re-runs planned.
    from waterwave_hpo.scheduler import BudgetExceededError

    def objective(trial: optuna.trial.Trial) -> float:
        model = _register(_mlp())
        ctx = ww.current()
        if ctx.attempt == 0:
            raise BudgetExceededError(
                ctx.trial_number, 1, PLAIN_BYTES, 4 * PLAIN_BYTES, evicted=True
            )
        return _train(model, 1)

    for memory_plan, states in (
        ("off", [TrialState.FAIL]),
        ("home", [TrialState.FAIL, TrialState.COMPLETE]),
    ):
        executor = ww.WaterwaveExecutor(
            "cpu", trials_per_device=1, memory_budget_bytes=4 * PLAIN_BYTES, memory_plan=memory_plan
        )
        study = optuna.create_study()
        executor.optimize(study, objective, n_trials=1)
        assert [t.state for t in study.trials] == states
    plan = trial_memory_plan(study.trials[1])
    assert plan is not None and plan.predicted_peak_bytes <= PLAIN_BYTES // 2


def test_a_budget_no_plan_reaches_fails_the_trial_with_the_floor_named() -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        return _train(_register(_mlp()), 1)

    executor = ww.WaterwaveExecutor(
        "cpu",
        trials_per_device=2,
        memory_budget_bytes=SMALLEST_BYTES // 2,
        memory_plan="home",
        record_trial_attrs=True,
    )
    study = optuna.create_study()
    executor.optimize(study, objective, n_trials=2)  # does not raise, does not hang
    assert [t.state for t in study.trials] == [TrialState.FAIL] * 2  # never re-run
    reason = str(study.trials[0].system_attrs["waterwave:fail_reason"])
    assert "no memory plan fits" in reason and "floor" in reason and "bytes)" in reason
    assert executor.schedulers["cpu"].stats().used_bytes == 0


def test_auto_trials_per_device_admits_a_trial_at_its_planned_footprint() -> None:
    budget = PLAIN_BYTES + PLAIN_BYTES // 2
    lock = threading.Lock()
    running = {"now": 0, "peak": 0}

    def objective(trial: optuna.trial.Trial) -> float:
        model = _register(_mlp())
        with lock:
            running["now"] += 1
            running["peak"] = max(running["peak"], running["now"])
        try:
            return _train(model, 6, pause_s=0.02)
        finally:
            with lock:
                running["now"] -= 1

    def run(memory_plan: str) -> tuple[optuna.Study, ww.WaterwaveExecutor]:
        running["peak"] = 0
        executor = ww.WaterwaveExecutor(
            "cpu",
            trials_per_device="auto",
            max_trials_per_device=3,
            memory_budget_bytes=budget,
            memory_plan=memory_plan,
            record_trial_attrs=True,
        )
        study = optuna.create_study()
        executor.optimize(study, objective, n_trials=4)
        return study, executor

    # Without plans a registered model is not even measured: one trial at a time.
    study, executor = run("off")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    assert running["peak"] == 1 and executor.packing_predictions == {}
    study, executor = run("home")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    assert running["peak"] >= 2
    assert any(trial_memory_plan(t) is not None for t in study.trials)
    assert executor.schedulers["cpu"].stats().peak_bytes <= budget
    assert executor.packing_predictions["cpu"].best_k >= 2


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"memory_plan": "shrink"}, ValueError, "memory_plan='shrink'"),
        ({"memory_plan": 1}, TypeError, "memory_plan=1"),
        ({"memory_planner": "none"}, ValueError, "memory_planner='none'"),
        ({"memory_planner": 3}, TypeError, "memory_planner=3"),
    ],
)
def test_bad_memory_plan_arguments_name_the_argument(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ww.WaterwaveExecutor("cpu", **kwargs)  # type: ignore[arg-type]


def test_outside_a_planning_executor_the_model_is_returned_untouched() -> None:
    model = _mlp()
    assert ww.fit_trial_memory(model, example_input=_batch()[0]) is model
    with pytest.raises(ValueError, match="no memory plan"):
        ww.plan_of(model)
    with pytest.raises(TypeError, match="model="):
        ww.fit_trial_memory("model", example_input=_batch()[0])  # type: ignore[arg-type]


class _Fused(nn.Module):
    """K models run as one on the same batch (a stand-in for ``ww.fusion.fuse``'s model)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.models = nn.ModuleList(_mlp() for _ in range(k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([m(x) for m in self.models])


def test_a_fused_batch_that_does_not_fit_runs_its_model_with_one_plan_for_all_its_trials() -> None:
    # fuse=2 with memory_plan="home": the batch's fused model is planned as one.
    fused_plain = 2 * PLAIN_BYTES  # two MLPs' activations at once, roughly
    budget = fused_plain * 6 // 10
    seen: list[int] = []

    @ww.batched
    def objective(trials: list[optuna.trial.Trial]) -> list[float]:
        seen.append(len(trials))
        model = ww.fit_trial_memory(_Fused(len(trials)), example_input=_batch()[0])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = _batch()
        optimizer.zero_grad()
        out = model(x)
        losses = [nn.functional.cross_entropy(out[i], y) for i in range(len(trials))]
        torch.stack(losses).sum().backward()
        optimizer.step()
        return [float(loss.detach()) for loss in losses]

    executor = ww.WaterwaveExecutor(
        "cpu",
        trials_per_device=1,
        fuse=2,
        memory_budget_bytes=budget,
        memory_plan="home",
        record_trial_attrs=True,
    )
    study = optuna.create_study()
    executor.optimize(study, objective, n_trials=2)
    assert seen == [2]  # one call: one fused batch
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    plans = [trial_memory_plan(t) for t in study.trials]
    assert plans[0] is not None and plans[0] == plans[1]  # one plan, recorded on each trial
    assert plans[0].predicted_peak_bytes <= budget
    assert set(plans[0].choices.values()) != {"keep"}
    assert study.trials[0].system_attrs["waterwave:batch"] == [0, 1]
    stats = executor.schedulers["cpu"].stats()
    assert stats.used_bytes == 0 and stats.evictions == 0


def _gated_claim() -> int:
    """What the MLP's gates reserve at its step's peak (parameters, gradients, all groups)."""
    from waterwave_hpo.nodegroup import trial_profile

    model = ww.pipeline(_mlp(), example_input=_batch()[0])
    return trial_profile(model).peak_bytes


GATED_BYTES = _gated_claim()


def test_the_gates_claim_less_than_a_plain_step_and_more_than_the_smallest_plan() -> None:
    # The scenarios below need a budget between the smallest plan and the gates' claim.
    assert SMALLEST_BYTES < GATED_BYTES <= PLAIN_BYTES


def _gated_run(budget: int, caplog: pytest.LogCaptureFixture) -> tuple[optuna.Study, Any, list]:
    still_gated: list[bool] = []

    def objective(trial: optuna.trial.Trial) -> float:
        model = _register(ww.pipeline(_mlp()))
        still_gated.append(has_pipeline(model))
        return _train(model, 2)

    executor = ww.WaterwaveExecutor(
        "cpu",
        trials_per_device=1,
        memory_budget_bytes=budget,
        memory_plan="home",
        record_trial_attrs=True,
    )
    study = optuna.create_study()
    with caplog.at_level("INFO", logger="waterwave_hpo"):
        executor.optimize(study, objective, n_trials=1)
    return study, executor.schedulers["cpu"].stats(), still_gated


def test_a_gated_model_whose_gates_fit_runs_under_its_gates_unplanned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # memory_plan="home" with ww.pipeline gates: the gates' claim fits the budget,
    # so the gates govern its memory (no step time lost to a plan) and it gets no plan.
    study, stats, still_gated = _gated_run(4 * PLAIN_BYTES, caplog)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE]
    assert trial_memory_plan(study.trials[0]) is None and still_gated == [True]
    assert any("fits the memory its neighbours leave" in r.message for r in caplog.records)
    (trial,) = stats.trials
    assert trial.peak_held_bytes == GATED_BYTES  # the gates' reservations, nothing else
    assert trial.acquires > 1 and stats.used_bytes == 0


def test_a_gated_model_whose_gates_do_not_fit_runs_with_a_plan_instead_of_its_gates(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Below the gates' claim the gates can never admit the step (before: the trial failed
    # "out of device memory ... can never be admitted, even alone"); a plan for the budget
    # replaces them, and the ledger holds the plan's footprint alone (one claim).
    budget = (GATED_BYTES + SMALLEST_BYTES) // 2
    study, stats, still_gated = _gated_run(budget, caplog)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE]
    plan = trial_memory_plan(study.trials[0])
    assert plan is not None and plan.predicted_peak_bytes <= budget
    assert still_gated == [False]  # the plan replaced the gates
    assert any("the gates are removed" in r.message for r in caplog.records)
    (trial,) = stats.trials
    assert trial.acquires == 1 and trial.peak_held_bytes == plan.predicted_peak_bytes
    assert stats.peak_bytes <= budget and stats.used_bytes == 0


def _gated_beside_a_neighbour(caplog: pytest.LogCaptureFixture) -> tuple[optuna.Study, list]:
    # Trial 0 (no gates) holds its plain footprint; trial 1's gates' claim fits the budget
    # but not the room trial 0 leaves (between the smallest plan and the claim).
    budget = PLAIN_BYTES + (GATED_BYTES + SMALLEST_BYTES) // 2
    registered = [threading.Event(), threading.Event()]
    still_gated: list[bool] = []

    def objective(trial: optuna.trial.Trial) -> float:
        if trial.number == 1:
            assert registered[0].wait(timeout=30)
            model = _register(ww.pipeline(_mlp()))
            still_gated.append(has_pipeline(model))
        else:
            model = _register(_mlp())
        registered[trial.number].set()
        assert registered[1 - trial.number].wait(timeout=30)  # both registered beside each other
        return _train(model, 2)

    executor = ww.WaterwaveExecutor(
        "cpu",
        trials_per_device=2,
        memory_budget_bytes=budget,
        memory_plan="home",
        record_trial_attrs=True,
    )
    study = optuna.create_study()
    with caplog.at_level("INFO", logger="waterwave_hpo"):
        executor.optimize(study, objective, n_trials=2)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    assert trial_memory_plan(study.trials[0]) is None
    return study, still_gated


def test_a_gated_model_short_of_room_beside_a_neighbour_takes_a_plan_that_costs_no_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The cost model predicts ~1.0x the step time for the plan (CPU: copies are cheap against
    # the compute): the plan replaces the gates rather than waiting for the neighbour.
    study, still_gated = _gated_beside_a_neighbour(caplog)
    plan = trial_memory_plan(study.trials[1])
    assert plan is not None and still_gated == [False]
    assert plan.predicted_peak_bytes <= (GATED_BYTES + SMALLEST_BYTES) // 2


def test_a_gated_model_short_of_room_beside_a_neighbour_keeps_its_gates_when_a_plan_is_slow(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Any plan slower than the limit (here every plan: the limit is below 1x): its claim fits
    # the budget, so it waits for the neighbour under its gates, unplanned.
    monkeypatch.setattr("waterwave_hpo.host._planning.GATED_PLAN_MAX_SLOWDOWN", 0.5)
    study, still_gated = _gated_beside_a_neighbour(caplog)
    assert trial_memory_plan(study.trials[1]) is None and still_gated == [True]
    assert any("fits the budget but not beside its neighbours" in r.message for r in caplog.records)


def test_a_fused_batch_under_gates_that_do_not_fit_fails_and_re_runs_unfused_without_hanging() -> (
    None
):
    # fuse=2 + ww.pipeline gates, budget below the fused model's claim: the batch's
    # gates reserve under its first trial; its batch-mate is no scheduler trial of its own, so
    # the scheduler evicts the batch instead of waiting for the batch-mate to ask for memory
    # (before: the trial thread waited in the gate forever). Each trial re-runs unfused.
    from waterwave_hpo import fusion
    from waterwave_hpo.nodegroup import trial_profile

    x = _batch()[0]
    fused_claim = trial_profile(ww.pipeline(fusion.fuse([_mlp(), _mlp()]), example_input=x))
    budget = int(0.8 * fused_claim.peak_bytes)
    assert GATED_BYTES < budget  # one model alone fits under its gates

    @ww.batched
    def objective(trials: list[optuna.trial.Trial]) -> list[float]:
        model = ww.pipeline(fusion.fuse([_mlp() for _ in trials]))
        for _ in range(2):
            model(x).sum().backward()
        return [0.0] * len(trials)

    executor = ww.WaterwaveExecutor(
        "cpu", trials_per_device=1, fuse=2, memory_budget_bytes=budget, record_trial_attrs=True
    )
    study = optuna.create_study()
    runner = threading.Thread(
        target=executor.optimize, args=(study, objective), kwargs={"n_trials": 2}, daemon=True
    )
    runner.start()
    runner.join(timeout=120)
    assert not runner.is_alive(), "the fused batch waited in its gates forever"
    states = [t.state for t in study.trials]
    assert states == [TrialState.FAIL, TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    assert [len(t.system_attrs.get("waterwave:batch", [0])) for t in study.trials[2:]] == [1, 1]
