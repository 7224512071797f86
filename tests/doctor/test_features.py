"""The doctor's feature checks on the CPU: each runs its CPU or simulated counterpart and passes.

Each test can fail: the checks assert what the executor did (states, re-runs, plans, batches),
not that code ran.
"""

from __future__ import annotations

from pathlib import Path
import re
from typing import Any

import pytest
import torch

from waterwave_hpo.doctor import CheckStatus
from waterwave_hpo.doctor import _features

CPU = torch.device("cpu")


def test_a_trial_beside_its_neighbour_runs_with_a_home_plan() -> None:
    result = _features.check_home_plans(CPU)
    assert result.status is CheckStatus.PASS, result.detail
    assert result.figure is not None and result.figure > 0


def _slow_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fast GPU's case: copies cost so much against compute that PSO picks recompute only,
    in a budget (1.85 plain footprints, the check's own 1.5 of a footprint scaled up) where a
    recompute-only plan fits beside the neighbour."""
    from waterwave_hpo.planning import PLANNERS

    pso = PLANNERS["pso"]

    def pso_slow_copies(
        profile: Any, budget: int, *, bandwidth_bytes_per_s: float, seed: int
    ) -> Any:
        return pso(profile, budget, bandwidth_bytes_per_s=1.0, seed=seed)

    monkeypatch.setitem(PLANNERS, "pso", pso_slow_copies)
    plain = _features._plain_peak_bytes
    monkeypatch.setattr(_features, "_plain_peak_bytes", lambda d: int(plain(d) * 1.85 / 1.5))


def test_a_plan_that_recomputes_instead_of_swapping_keeps_its_promise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _slow_copies(monkeypatch)
    result = _features.check_home_plans(CPU)
    assert result.status is CheckStatus.PASS, result.detail
    assert "0 swap" in result.detail and result.figure is not None and result.figure > 0


def test_a_recompute_that_draws_new_dropout_masks_fails_the_plan_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from waterwave_hpo.planning import _rng

    _slow_copies(monkeypatch)

    def draw_again(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))  # no replay: the recompute's masks are new

    monkeypatch.setattr(_rng.RandomReplayer, "__torch_dispatch__", draw_again)
    # Every unit recomputed, dropout's among them (HOME's search may recompute only units
    # without random draws: then no mask is drawn again and the numbers rightly agree).
    import dataclasses

    from waterwave_hpo.planning import PLANNERS
    from waterwave_hpo.planning._plan import Placement

    pso = PLANNERS["pso"]

    def recompute_all(profile: Any, budget: int, **kwargs: Any) -> Any:
        found = pso(profile, budget, **kwargs)
        return dataclasses.replace(found, choices=(Placement.RECOMPUTE,) * len(found.choices))

    monkeypatch.setitem(PLANNERS, "pso", recompute_all)
    result = _features.check_home_plans(CPU)
    assert result.status is CheckStatus.FAIL, result.detail
    assert "states ['COMPLETE', 'COMPLETE']" in result.detail  # it ran; its numbers differ
    found = re.search(r"without a plan: relative error (\S+);", result.detail)
    assert found is not None and float(found.group(1)) > _features.PLAN_REL_TOL


def test_the_late_path_check_is_a_skip_without_a_gpu() -> None:
    result = _features.check_late_path(CPU)
    assert result.status is CheckStatus.SKIP and "no GPU" in result.detail


def test_the_late_path_study_runs_in_a_process_of_its_own() -> None:
    result = _features.late_path_result("cpu")
    assert result.status is CheckStatus.PASS, result.detail
    assert result.figure == float(_features.LATE_TRIALS)


def test_the_late_path_process_imports_this_package_whatever_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Run from a source checkout with the package installed (not editable), the working
    # directory's unbuilt tree came first on the child's sys.path (`python -c`). Here the
    # working directory shadows both the package and torch (an editable install's finder
    # would still find the package; nothing finds torch before sys.path).
    for name in ("waterwave_hpo", "torch"):
        shadow = tmp_path / name
        shadow.mkdir()
        (shadow / "__init__.py").write_text(f"raise ImportError('{name} of the checkout')\n")
    monkeypatch.chdir(tmp_path)
    result = _features.late_path_result("cpu")
    assert result.status is CheckStatus.PASS, result.detail


def test_a_late_path_process_that_aborts_fails_the_check_with_the_signal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What a C++ exception thrown in a destructor does (std::terminate): the process aborts.
    monkeypatch.setattr(_features, "_LATE_CHILD", "import os\nos.abort()\n")
    result = _features.late_path_result("cpu")
    assert result.status is CheckStatus.FAIL
    assert "killed by SIGABRT" in result.detail and result.figure == 0.0


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_k4_study_after_cuda_was_touched_first_completes() -> None:
    result = _features.late_path_result("cuda:0", k=4, n_trials=8)
    assert result.status is CheckStatus.PASS, result.detail
