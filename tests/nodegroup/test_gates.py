"""Gates: exact gradients, reservations taken and released at the right moments, never leaked."""

from __future__ import annotations

import copy
import gc
import threading

import pytest
import torch

from waterwave_hpo.nodegroup import node_groups
from waterwave_hpo.nodegroup import pipeline
from waterwave_hpo.nodegroup import trial_profile
from waterwave_hpo.scheduler import BudgetExceededError
from waterwave_hpo.scheduler import PipelineScheduler

from ._zoo import MODELS
from ._zoo import batch_for
from ._zoo import build
from ._zoo import in_trial
from ._zoo import loss_of


def train_steps(name: str, model: torch.nn.Module, steps: int) -> list[torch.Tensor]:
    """Losses and every gradient of ``steps`` SGD steps (dropout included: RNG seeded)."""
    torch.manual_seed(123)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: list[torch.Tensor] = []
    for step in range(steps):
        x, y = batch_for(name, seed=step)
        opt.zero_grad()
        loss = loss_of(name, model(x), y)
        loss.backward()
        out.append(loss.detach().clone())
        out.extend(p.grad.clone() for p in model.parameters() if p.grad is not None)
        opt.step()
    return out


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("in_a_trial", [False, True])
def test_gradients_identical_with_and_without_gates(name: str, in_a_trial: bool) -> None:
    torch.manual_seed(0)
    bare = build(name)
    gated = pipeline(copy.deepcopy(bare), groups=4)
    expected = train_steps(name, bare, 3)
    scheduler = PipelineScheduler(2**30) if in_a_trial else None
    with in_trial(scheduler, 7):
        got = train_steps(name, gated, 3)
        if scheduler is not None:
            assert scheduler.stats().trial(7).acquires > 0, "the gates never ran"
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def _profiled(name: str, k: int = 4) -> torch.nn.Module:
    model = build(name)
    pipeline(model, groups=k, example_input=batch_for(name)[0])
    return model


@pytest.mark.parametrize("name", MODELS)
def test_forward_reserves_every_group_and_backward_releases_them(name: str) -> None:
    model = _profiled(name)
    profile = trial_profile(model)
    scheduler = PipelineScheduler(2**30)
    x, y = batch_for(name)
    with in_trial(scheduler, 1):
        loss = loss_of(name, model(x), y)
        assert scheduler.held_bytes(1) == profile.peak_bytes
        loss.backward()
        assert scheduler.held_bytes(1) == profile.resident_bytes
    assert scheduler.held_bytes(1) == 0


def test_groups_release_during_backward_not_only_at_its_end() -> None:
    model = _profiled("mlp", k=4)
    groups = node_groups(model)
    assert len(groups) == 4
    scheduler = PipelineScheduler(2**30)
    x, y = batch_for("mlp")
    seen: list[int] = []
    early: list[torch.Tensor] = []
    h = model[1].register_forward_hook(lambda m, a, out: early.append(out))
    with in_trial(scheduler, 1):
        out = model(x)
        h.remove()
        out.register_hook(lambda g: seen.append(scheduler.held_bytes(1)))  # backward starts
        # the gradient reaches the first ReLU's output: every later group's backward is done
        early[0].register_hook(lambda g: seen.append(scheduler.held_bytes(1)))
        loss_of("mlp", out, y).backward()
    resident = trial_profile(model).resident_bytes
    full = resident + sum(g.saved_bytes for g in groups)
    assert seen[0] == full
    assert len(seen) == 2
    assert resident < seen[1] < full, seen


def test_no_grad_and_eval_release_at_forward_end() -> None:
    model = _profiled("cnn")
    resident = trial_profile(model).resident_bytes
    scheduler = PipelineScheduler(2**30)
    x, _ = batch_for("cnn")
    with in_trial(scheduler, 1):
        with torch.no_grad():
            model(x)
        assert scheduler.held_bytes(1) == resident
        model.eval()
        model(x)
        assert scheduler.held_bytes(1) == resident
        peak = scheduler.stats().trial(1).peak_held_bytes
        assert peak < trial_profile(model).peak_bytes  # one group at a time, not all


def test_graph_dropped_without_backward_is_released() -> None:
    model = _profiled("mlp")
    resident = trial_profile(model).resident_bytes
    scheduler = PipelineScheduler(2**30)
    x, y = batch_for("mlp")
    with in_trial(scheduler, 1):
        loss = loss_of("mlp", model(x), y)
        assert scheduler.held_bytes(1) > resident
        del loss
        gc.collect()
        assert scheduler.held_bytes(1) == resident


def test_forward_that_raised_is_released_by_the_next_forward_and_by_trial_finished() -> None:
    model = _profiled("mlp", k=4)
    resident = trial_profile(model).resident_bytes
    scheduler = PipelineScheduler(2**30)
    x, _ = batch_for("mlp")

    def boom(module: torch.nn.Module, args: object) -> None:
        raise RuntimeError("boom")

    with in_trial(scheduler, 1):
        h = model[5].register_forward_pre_hook(boom)
        with pytest.raises(RuntimeError, match="boom"):
            model(x)
        h.remove()
        assert scheduler.held_bytes(1) > resident
        with torch.no_grad():
            model(x)
        assert scheduler.held_bytes(1) == resident
        kept = model(x)  # a graph kept alive past the trial's end
        assert scheduler.held_bytes(1) > resident
    assert scheduler.held_bytes(1) == 0
    assert scheduler.used_bytes == 0
    del kept


def test_outside_a_trial_gates_pass_through() -> None:
    model = _profiled("gpt")
    x, y = batch_for("gpt")
    loss_of("gpt", model(x), y).backward()  # no context: no scheduler to call, no error
    scheduler = PipelineScheduler(2**30)
    with in_trial(None, 3):  # a context without a scheduler
        model(x)
    assert scheduler.stats().trials == ()


def test_a_group_larger_than_the_budget_raises_budget_exceeded() -> None:
    model = _profiled("cnn", k=2)
    need = trial_profile(model).peak_bytes
    scheduler = PipelineScheduler(need - 1)
    x, _ = batch_for("cnn")
    with in_trial(scheduler, 4), pytest.raises(BudgetExceededError, match="Trial 4 wanted"):
        model(x)
    assert scheduler.used_bytes == 0


def test_two_trials_share_a_tight_budget_without_exceeding_it() -> None:
    """Two gated copies under the waterwave policy on a budget that fits one forward peak."""
    torch.manual_seed(0)
    models = [_profiled("resnet", k=4) for _ in range(2)]
    profile = trial_profile(models[0])
    budget = 2 * profile.resident_bytes + profile.activation_bytes + 1
    scheduler = PipelineScheduler(budget, "waterwave")
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with in_trial(scheduler, i):
                opt = torch.optim.SGD(models[i].parameters(), lr=0.01)
                for step in range(4):
                    x, y = batch_for("resnet", seed=step)
                    opt.zero_grad()
                    loss_of("resnet", models[i](x), y).backward()
                    opt.step()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a trial hung"
    assert errors == []
    stats = scheduler.stats()
    assert stats.peak_bytes <= budget
    assert stats.evictions == 0
    assert stats.used_bytes == 0
