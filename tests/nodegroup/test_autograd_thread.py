"""NodeGroup gates and profiling under CUDA's autograd topology, reproduced on the CPU: every
trial's backward on one shared worker thread under an empty contextvars context, and checkpointed
forwards re-run inside backward."""

from __future__ import annotations

from collections.abc import Iterator
import threading

from fakes.autograd_worker import SharedAutogradWorker
import optuna
from optuna.trial import TrialState
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import waterwave_hpo as ww
from waterwave_hpo.nodegroup import pipeline
from waterwave_hpo.scheduler import PipelineScheduler

from ._zoo import in_trial


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[SharedAutogradWorker]:
    w = SharedAutogradWorker(timeout_s=30)
    w.install(monkeypatch)
    yield w
    w.close()


class _Checkpointed(nn.Module):
    """Two blocks whose forwards torch.utils.checkpoint re-runs during backward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, width), nn.ReLU())
        self.b = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.a, x, use_reentrant=False)
        x = checkpoint(self.b, x, use_reentrant=False)
        return self.head(x)  # type: ignore[no-any-return]


def test_co_hosted_gated_trials_finish_with_backward_on_one_shared_thread(
    worker: SharedAutogradWorker,
) -> None:
    in_hooks: list[object] = []
    lock = threading.Lock()

    def objective(trial: optuna.trial.Trial) -> float:
        width = trial.suggest_categorical("width", [32, 64])
        torch.manual_seed(trial.number)
        model = pipeline(_Checkpointed(width))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = torch.zeros(())
        for _ in range(4):
            opt.zero_grad()
            x = torch.randn(8, 16, requires_grad=True)

            def seen(grad: torch.Tensor) -> None:
                with lock:
                    in_hooks.append(ww.current_or_none())

            x.register_hook(seen)
            loss = model(x).square().mean()
            loss.backward()
        return float(loss.detach())

    study = optuna.create_study()
    executor = ww.WaterwaveExecutor("cpu", 2, memory_budget_bytes=1 << 30)
    executor.optimize(study, objective, n_trials=4)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    assert worker.backwards == 16  # every backward ran on the shared worker
    assert in_hooks and all(c is None for c in in_hooks)  # no trial is current in a hook
    stats = executor.schedulers["cpu"].stats()
    assert stats.used_bytes == 0 and stats.evictions == 0


def test_a_checkpointed_forward_re_run_in_backward_reserves_nothing_again() -> None:
    # On the CPU backward runs in the trial's thread, where the trial is current: the re-run
    # forward must not reserve its group a second time (it could wait, inside backward).
    torch.manual_seed(0)
    model = pipeline(_Checkpointed(32), groups=3, example_input=torch.randn(8, 16))
    scheduler = PipelineScheduler(1 << 30)
    with in_trial(scheduler, 1):
        # The whole gated model checkpointed: backward re-runs its forward, root gate included.
        loss = checkpoint(model, torch.randn(8, 16), use_reentrant=False).sum()
        after_forward = scheduler.stats().trial(1).acquires
        loss.backward()
        assert scheduler.stats().trial(1).acquires == after_forward
    assert scheduler.held_bytes(1) == 0
