"""The executor on a real CUDA device: streams, OOM isolation, the demo (marked ``gpu``)."""

from __future__ import annotations

from pathlib import Path
import threading

import optuna
from optuna.trial import TrialState
import pytest
import torch

import waterwave_hpo as ww
from waterwave_hpo.demo import DemoConfig
from waterwave_hpo.demo import run_demo

pytestmark = pytest.mark.gpu


def test_each_running_trial_has_its_own_stream_current_in_its_thread() -> None:
    k = 6
    barrier = threading.Barrier(k, timeout=60)
    seen: dict[int, tuple[int, int]] = {}

    def objective(trial: optuna.trial.Trial) -> float:
        context = ww.current()
        assert context.stream is not None
        barrier.wait()  # all k trials hold their streams at once
        seen[trial.number] = (context.stream.cuda_stream, torch.cuda.current_stream().cuda_stream)
        x = torch.randn(256, 256, device=context.device)
        return float((x @ x).sum().item())

    study = optuna.create_study()
    ww.WaterwaveExecutor(devices="cuda:0", trials_per_device=k).optimize(
        study, objective, n_trials=k
    )
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * k
    assert all(own == current for own, current in seen.values())
    assert len({own for own, _ in seen.values()}) == k
    assert 0 not in {own for own, _ in seen.values()}  # never the legacy default stream


def test_more_trials_than_torch_stream_pool_never_share_a_stream() -> None:
    k = 40  # torch's pool has 32 streams per priority
    barrier = threading.Barrier(k, timeout=120)
    streams: list[int] = []
    lock = threading.Lock()

    def objective(trial: optuna.trial.Trial) -> float:
        barrier.wait()
        with lock:
            streams.append(torch.cuda.current_stream().cuda_stream)
        return 0.0

    study = optuna.create_study()
    ww.WaterwaveExecutor(devices="cuda:0", trials_per_device=k).optimize(
        study, objective, n_trials=k
    )
    assert len(set(streams)) == k


def test_real_cuda_oom_fails_only_its_trial() -> None:
    inside = threading.Barrier(3, timeout=60)

    def objective(trial: optuna.trial.Trial) -> float:
        device = ww.current().device
        inside.wait()
        if trial.number == 0:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.empty(4 * total, dtype=torch.uint8, device=device)  # cannot fit
        x = torch.ones(1024, 1024, device=device)
        return float(x.sum().item())

    study = optuna.create_study()
    executor = ww.WaterwaveExecutor("cuda:0", 3, on_oom="fail", record_trial_attrs=True)
    executor.optimize(study, objective, n_trials=3)
    states = [t.state for t in study.trials]
    assert states[0] is TrialState.FAIL
    assert states[1:] == [TrialState.COMPLETE] * 2
    assert "out of device memory" in study.trials[0].system_attrs["waterwave:fail_reason"]


def test_demo_runs_unchanged_on_the_gpu(tmp_path: Path) -> None:
    result = run_demo(
        DemoConfig(
            trials=4,
            concurrency=4,
            epochs=2,
            device="cuda",
            seed=0,
            out=tmp_path,
            show_progress_bar=False,
        )
    )
    assert result.summary["n_trials"] == 4
    assert result.summary["device"][0].startswith("cuda")
    assert result.summary["max_concurrent_trials"] >= 2
