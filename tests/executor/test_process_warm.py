"""Warm worker processes (``workers/_pool.py``): started once per executor, kept across
``optimize`` calls and studies, ended by ``close()``; forked from a zygote that never ran the
user's script; what is refused before any trial; the CUDA cases with the fakes."""

from __future__ import annotations

from collections.abc import Iterator
import gc
import os
from pathlib import Path
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

from fakes.cuda_init import FakeCuda
import optuna
from optuna.trial import TrialState
import psutil
import pytest
import torch

import waterwave_hpo as ww
from waterwave_hpo.workers import WORKER_MARK

pytestmark = pytest.mark.filterwarnings("ignore::waterwave_hpo.ExperimentalWarning")


def _workers() -> list[int]:
    gc.collect()  # an executor an earlier test dropped ends its workers now
    pids = []
    for child in psutil.Process().children(recursive=True):
        try:
            if WORKER_MARK in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                pids.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return sorted(pids)


@pytest.fixture
def executor() -> Iterator[ww.WaterwaveExecutor]:
    with ww.WaterwaveExecutor("cpu", 2, isolation="process") as made:
        yield made
    assert _workers() == []


def _pid(trial: optuna.trial.Trial) -> float:
    trial.set_user_attr("pid", os.getpid())
    return trial.suggest_float("x", 0.0, 1.0)


def test_two_studies_run_on_the_same_warm_workers_and_close_ends_them(
    executor: ww.WaterwaveExecutor,
) -> None:
    first = optuna.create_study()
    executor.optimize(first, _pid, n_trials=6)
    workers = _workers()
    assert len(workers) == 2  # warm between the calls
    second = optuna.create_study(direction="maximize")
    executor.optimize(second, _pid, n_trials=6)
    assert [t.state for t in second.trials] == [TrialState.COMPLETE] * 6
    assert {t.user_attrs["pid"] for t in first.trials} == set(workers)
    assert {t.user_attrs["pid"] for t in second.trials} == set(workers)
    executor.close()
    assert _workers() == []
    executor.close()  # idempotent


@pytest.mark.slow  # over 10 s on the 2-core CI machine
def test_a_crashed_worker_is_replaced_ahead_of_the_next_call(
    executor: ww.WaterwaveExecutor,
) -> None:
    def crash_first(trial: optuna.trial.Trial) -> float:
        if trial.number == 0:
            os._exit(7)
        return _pid(trial)

    study = optuna.create_study()
    executor.optimize(study, crash_first, n_trials=1)
    assert study.trials[0].state is TrialState.FAIL
    assert "exit code 7" in study.trials[0].system_attrs["waterwave:fail_reason"]
    later = optuna.create_study()
    executor.optimize(later, _pid, n_trials=4)
    assert [t.state for t in later.trials] == [TrialState.COMPLETE] * 4
    assert len(_workers()) == 2


_QUICK_START = """
import optuna
import waterwave_hpo as ww

def objective(trial):
    x = trial.suggest_float("x", -10, 10)
    return (x - 2) ** 2

study = optuna.create_study(storage="sqlite:///{db}", study_name="quick")
with ww.WaterwaveExecutor("cpu", 2, isolation="process") as executor:
    executor.optimize(study, objective, n_trials=8)
print("states", sorted({{t.state.name for t in study.trials}}), len(study.trials))
"""


@pytest.mark.slow  # over 10 s on the 2-core CI machine
def test_a_script_without_the_main_guard_runs_its_trials(tmp_path: Path) -> None:
    script = tmp_path / "quick_start.py"
    script.write_text(_QUICK_START.format(db=tmp_path / "study.db"))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "states ['COMPLETE'] 8" in done.stdout
    study = optuna.load_study(study_name="quick", storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert len(study.trials) == 8  # the script ran once: no worker re-ran it


def test_when_every_worker_dies_at_start_optimize_raises_with_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from waterwave_hpo.workers import _starters

    # Workers that cannot import optuna (as a broken environment would): a new zygote
    # template, and the fresh interpreters where it cannot serve.
    for boot in ("_ZYGOTE_BOOT", "_SPAWN_BOOT"):
        broken = "import sys; sys.modules['optuna'] = None\n" + getattr(_starters, boot)
        monkeypatch.setattr(_starters, boot, broken)
    monkeypatch.setattr(_starters, "_TEMPLATE", _starters._ZygoteTemplate())
    study = optuna.create_study()
    with ww.WaterwaveExecutor("cpu", 2, isolation="process") as executor:
        with pytest.raises(RuntimeError, match=r"died at start.*could not start.*optuna"):
            executor.optimize(study, _pid, n_trials=4)
    assert study.trials == []  # no trial was asked, none failed


class _LooksLikeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA (what the check reads)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


DATA = torch.zeros(4).as_subclass(_LooksLikeCuda)


def _reads_global(trial: optuna.trial.Trial) -> float:
    return float(DATA.sum())


def test_an_objective_carrying_a_cuda_tensor_is_refused_naming_it() -> None:
    study = optuna.create_study()
    executor = ww.WaterwaveExecutor("cpu", 2, isolation="process")
    with pytest.raises(TypeError, match=r"the global 'DATA'.*move it inside the objective"):
        executor.optimize(study, _reads_global, n_trials=2)
    batches = {"train": torch.ones(2).as_subclass(_LooksLikeCuda)}

    def closes_over(trial: optuna.trial.Trial) -> float:
        return float(batches["train"].sum())

    with pytest.raises(TypeError, match=r"the closed-over variable 'batches'"):
        executor.optimize(study, closes_over, n_trials=2)
    assert study.trials == []
    assert _workers() == []  # refused before any worker started


def test_a_non_oom_error_on_cuda_probes_the_context_whatever_its_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from waterwave_hpo.workers._worker import poisons_context

    fake = FakeCuda().install(monkeypatch)
    fake._init()
    sticky = RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")
    synchronised: list[bool] = []

    def poisoned_sync(device: Any = None) -> None:
        synchronised.append(True)
        raise RuntimeError("CUDNN_STATUS_EXECUTION_FAILED")

    monkeypatch.setattr(torch.cuda, "synchronize", poisoned_sync)
    assert poisons_context(sticky)
    assert poisons_context(ValueError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronised.append(True))
    assert not poisons_context(ValueError("a user's own error"))  # the context is fine
    synchronised.clear()
    assert not poisons_context(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert synchronised == []  # an OOM never poisons: no probe


def test_on_cuda_other_workers_trials_are_not_a_trials_neighbours() -> None:
    # Each trial runs in a lease of its own: no re-run "with fewer neighbours" on CUDA.
    from waterwave_hpo.workers._worker import _Worker

    worker = _Worker(SimpleNamespace(), "cuda:0", 0)
    assert worker.outside_counter(torch.device("cuda", 0)) is None
    assert worker.outside_counter(torch.device("cpu")) is not None  # on the CPU they count


def test_the_default_lease_budget_leaves_a_context_per_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from waterwave_hpo.host import default_budget_bytes
    from waterwave_hpo.workers._lease_service import CONTEXT_RESERVE_BYTES
    from waterwave_hpo.workers._lease_service import DeviceLeases

    fake = FakeCuda(total_memory=80 << 30).install(monkeypatch)
    four = DeviceLeases(torch.device("cuda", 0), 4, None)
    expected = default_budget_bytes(fake.total_memory) - 4 * CONTEXT_RESERVE_BYTES
    assert four.budget_bytes == expected


def test_mps_is_detected_from_its_pipe_or_nvidia_smi() -> None:
    from waterwave_hpo.workers._mps import detect_mps
    from waterwave_hpo.workers._mps import pinned_memory_limit

    def smi(listing: str) -> Any:
        return lambda *a, **k: SimpleNamespace(stdout=listing, returncode=0)

    def no_smi(*a: object, **k: object) -> Any:
        raise FileNotFoundError("nvidia-smi")

    by_pipe = detect_mps({"CUDA_MPS_PIPE_DIRECTORY": "/run/mps"}, "/run/mps/control".__eq__, no_smi)
    assert by_pipe.running and "/run/mps/control" in by_pipe.evidence
    default_pipe = detect_mps({}, "/tmp/nvidia-mps/control".__eq__, no_smi)
    assert default_pipe.running
    by_smi = detect_mps({}, lambda p: False, smi("  Process ID : 42\n  nvidia-cuda-mps-server\n"))
    assert by_smi.running and "nvidia-smi" in by_smi.evidence
    assert not detect_mps({}, lambda p: False, smi("  Process ID : 42\n  python\n")).running
    assert not detect_mps({}, lambda p: False, no_smi).running
    assert pinned_memory_limit(1, 3 << 30) == {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "1=3072M"}


def test_without_mps_the_executor_says_once_that_processes_time_slice(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from waterwave_hpo.workers import _mps

    monkeypatch.setattr(_mps, "_warned", __import__("threading").Event())
    off = _mps.MpsStatus(False, "no pipe")
    with caplog.at_level("WARNING", logger="waterwave_hpo"):
        _mps.say_how_workers_share(off, 4)
        _mps.say_how_workers_share(off, 4)
    lines = [r.getMessage() for r in caplog.records if "time-slices" in r.getMessage()]
    assert len(lines) == 1
    assert "never overlap" in lines[0] and "nvidia-cuda-mps-control -d" in lines[0]


def test_workers_spawned_when_asked_run_the_trials_and_say_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from waterwave_hpo.workers import _starters

    monkeypatch.setenv("WATERWAVE_WORKER_START", "spawn")
    monkeypatch.setattr(_starters, "_said", __import__("threading").Event())
    study = optuna.create_study()
    with caplog.at_level("WARNING", logger="waterwave_hpo"):
        with ww.WaterwaveExecutor("cpu", 1, isolation="process") as executor:
            executor.optimize(study, _pid, n_trials=2)
            executor.optimize(study, _pid, n_trials=1)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3
    said = [r.getMessage() for r in caplog.records if "fresh interpreters" in r.getMessage()]
    assert len(said) == 1 and "WATERWAVE_WORKER_START=spawn" in said[0]
