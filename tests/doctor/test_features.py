"""The doctor's feature checks on the CPU: each runs its CPU or simulated counterpart and passes.

Each test can fail: the checks assert what the executor did (states, re-runs, plans, batches),
not that code ran.
"""

from __future__ import annotations

import pytest
import torch

from waterwave_hpo.doctor import CheckStatus
from waterwave_hpo.doctor import _features

CPU = torch.device("cpu")


def test_a_trial_beside_its_neighbour_runs_with_a_home_plan() -> None:
    result = _features.check_home_plans(CPU)
    assert result.status is CheckStatus.PASS, result.detail
    assert result.figure is not None and result.figure > 0


def test_an_oom_inside_backward_is_rerun_beside_a_neighbour() -> None:
    result = _features.check_oom_in_backward(CPU)
    assert result.status is CheckStatus.PASS, result.detail
    assert result.figure == 1.0


def test_cupy_running_out_of_memory_in_a_trial_is_rerun() -> None:
    result = _features.check_cupy_oom(CPU)
    assert result.status is CheckStatus.PASS, result.detail
    assert result.figure == 1.0


def test_the_cupy_check_fails_when_the_executor_treats_the_error_as_fatal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Finding 1's old behaviour: the pool's (and CuPy's) MemoryError not seen as out of memory.
    from waterwave_hpo.doctor._checks import guarded
    from waterwave_hpo.host import _attempt as _run

    monkeypatch.setattr(_run, "is_out_of_memory", lambda error: False)
    result = guarded("cupy_oom", lambda: _features.check_cupy_oom(CPU))
    assert result.status is CheckStatus.FAIL  # the study aborted on the trial's error
    assert "PoolOutOfMemoryError" in result.detail


@pytest.mark.slow
def test_laysa_trains_in_bf16_on_two_gloo_ranks() -> None:
    result = _features.check_laysa_bf16(CPU)
    assert result.status is CheckStatus.PASS, result.detail


def test_a_fused_batch_runs_k_trials_as_one_model() -> None:
    result = _features.check_fused_batch(CPU, k=3)
    assert result.status is CheckStatus.PASS, result.detail
    assert result.figure == 3.0


def test_every_device_without_a_gpu_is_the_simulated_counterpart() -> None:
    result = _features.check_every_gpu(CPU)
    assert result.status is CheckStatus.PASS, result.detail
    assert result.figure == 2.0 and "Not a GPU figure" in result.detail


def test_a_worker_killed_by_a_segfault_fails_its_trial_alone_and_is_replaced() -> None:
    result = _features.check_worker_crash(CPU)
    assert result.status is CheckStatus.PASS, result.detail
    assert result.figure is not None and result.figure >= 0
    assert "SIGSEGV" in result.detail


def test_the_worker_crash_check_fails_when_the_reason_names_no_signal() -> None:
    # A worker that exits without a signal: its trial fails alone, but no SIGSEGV is named.
    result = _features.check_worker_crash(CPU, crash="exit")
    assert result.status is CheckStatus.FAIL, result.detail
    assert "SIGSEGV" not in result.detail.split("pass:")[0]
