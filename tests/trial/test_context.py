"""current() and trial_scope(): the running trial's context outside the executor."""

from __future__ import annotations

import pytest
import torch

import waterwave_hpo as ww
from waterwave_hpo.scheduler import PipelineScheduler
from waterwave_hpo.trial import trial_scope


def test_trial_scope_makes_a_context_current_and_registers_the_trial() -> None:
    scheduler = PipelineScheduler(1 << 20)
    with trial_scope(scheduler, 7) as context:
        assert ww.current() is context
        assert context.trial_number == 7
        assert context.device == torch.device("cpu")
        scheduler.acquire(7, 0, 1000)
        assert scheduler.held_bytes(7) == 1000
    assert ww.current_or_none() is None
    assert scheduler.held_bytes(7) == 0  # finished: everything it held is released


def test_trial_scope_releases_on_error() -> None:
    scheduler = PipelineScheduler(1 << 20)
    with pytest.raises(ValueError, match="boom"), trial_scope(scheduler, 1):
        scheduler.acquire(1, 0, 512)
        raise ValueError("boom")
    assert scheduler.used_bytes == 0
    assert ww.current_or_none() is None


def test_trial_scope_without_a_scheduler() -> None:
    with trial_scope(None, 3, device="cpu") as context:
        assert ww.current().scheduler is None
        assert context.trial_number == 3


def test_the_public_names_are_the_trial_packages_own() -> None:
    import waterwave_hpo.executor as executor
    import waterwave_hpo.trial as trial

    for name in ("current", "current_or_none", "trial_scope", "TrialContext", "NotInTrialError"):
        assert getattr(ww, name, getattr(executor, name)) is getattr(trial, name)
        assert getattr(executor, name) is getattr(trial, name)
