"""is_out_of_memory: which errors count as running out of device memory."""

from __future__ import annotations

import threading
import time

from fakes import fake_cupy
import optuna
from optuna.trial import TrialState
import pytest
import torch

import waterwave_hpo as ww
from waterwave_hpo.executor import is_out_of_memory
from waterwave_hpo.memory import OOMReason
from waterwave_hpo.memory import PoolOutOfMemoryError


def test_torch_out_of_memory_error() -> None:
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate"))


def test_runtime_error_with_cuda_oom_message() -> None:
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))


def test_wrapped_oom_is_found_through_the_cause_chain() -> None:
    try:
        try:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        except RuntimeError as inner:
            raise ValueError("training step failed") from inner
    except ValueError as outer:
        assert is_out_of_memory(outer)


def test_other_errors_are_not_oom() -> None:
    assert not is_out_of_memory(ValueError("out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("host out of memory"))


def test_cublas_and_cudnn_allocation_failures_are_out_of_memory() -> None:
    cublas = RuntimeError(
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    )
    cudnn = RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")
    assert is_out_of_memory(cublas)
    assert is_out_of_memory(cudnn)
    assert not is_out_of_memory(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED"))


def _cupy_oom_from_the_pool(cupy: object) -> BaseException:
    """What ``pool.cupy_allocator()`` raises when the pool is exhausted (memory/_cupy.py)."""
    try:
        try:
            raise PoolOutOfMemoryError(
                "out of memory", nbytes=1 << 30, stream=7, reason=OOMReason.CAPACITY
            )
        except PoolOutOfMemoryError as exc:
            raise cupy.cuda.memory.OutOfMemoryError(1 << 30, 0, 1 << 30) from exc  # type: ignore[attr-defined]
    except MemoryError as raised:
        return raised


def test_cupy_out_of_memory_is_out_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = fake_cupy.install(monkeypatch)
    assert is_out_of_memory(_cupy_oom_from_the_pool(cupy))
    # CuPy's own pool running out (no waterwave pool in the chain) counts too.
    assert is_out_of_memory(cupy.cuda.memory.OutOfMemoryError(1024, 0))  # type: ignore[attr-defined]
    assert is_out_of_memory(
        PoolOutOfMemoryError("out of memory", nbytes=1, stream=0, reason=OOMReason.QUOTA)
    )
    assert not is_out_of_memory(MemoryError("host out of memory"))


def test_cupy_out_of_memory_in_a_trial_is_rerun_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = fake_cupy.install(monkeypatch)
    inside = threading.Barrier(2, timeout=20)

    def objective(trial: optuna.trial.Trial) -> float:
        x = trial.suggest_float("x", 0, 1)
        if trial.number < 2:
            inside.wait()  # the failure happens beside a neighbour, so it is re-run
        if trial.number == 0:
            raise _cupy_oom_from_the_pool(cupy)
        if trial.number == 1:  # stay until trial 0 is told FAIL: it fails beside a neighbour
            deadline = time.monotonic() + 60
            while trial.study.trials[0].state is not TrialState.FAIL:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        return x

    study = optuna.create_study()
    ww.WaterwaveExecutor(devices="cpu", trials_per_device=2, record_trial_attrs=True).optimize(
        study, objective, n_trials=2
    )
    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    assert trials[2].params == trials[0].params
    assert trials[2].system_attrs["waterwave:retry_of"] == 0
    assert "out of device memory" in trials[0].system_attrs["waterwave:fail_reason"]
