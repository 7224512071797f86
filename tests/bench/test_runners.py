"""Every method runs the same trials end to end on the CPU, at a tiny setting."""

from __future__ import annotations

import pytest
import torch

from waterwave_hpo.bench import Method
from waterwave_hpo.bench import Setting
from waterwave_hpo.bench import Workload
from waterwave_hpo.bench import WorkloadSpec
from waterwave_hpo.bench import draw_params
from waterwave_hpo.bench import run_method
from waterwave_hpo.bench import unavailable_reason

CPU = torch.device("cpu")
SPEC = WorkloadSpec(Workload.DIGITS, Setting.LIGHT, batch_size=16, steps=2)
PARAMS = draw_params(Workload.DIGITS, 3, seed=0)


@pytest.mark.parametrize(
    "method",
    [
        # SPATIAL starts K processes, each importing torch: over 20 s in the suite
        # (tests/durations.json)
        pytest.param(m, marks=pytest.mark.slow) if m is Method.SPATIAL else m
        for m in Method
        if m is not Method.CUDA_MALLOC_ASYNC
    ],
)
def test_method_runs_every_trial(method: Method) -> None:
    run = run_method(method, SPEC, PARAMS, CPU, k=2, seed=0, capacity_bytes=64 << 20)
    assert run.available, run.note
    assert run.completed == {0, 1, 2}
    assert run.samples == 3 * 2 * 16
    assert run.makespan_s > 0
    assert run.k == (1 if method is Method.TEMPORAL else 2)
    for record in run.records:
        assert run.start_s <= record.start_s <= record.end_s <= run.end_s
        assert record.host_s_per_step is not None and record.host_s_per_step > 0
        assert record.device_s_per_step is None  # not separable on the CPU
    assert {r.slot for r in run.records} <= set(range(run.k))
    if method is Method.SPATIAL:
        assert "K processes share the cores" in run.note
    if method.budgeted:  # the ledger measured each trial's bytes and the run's peak
        assert run.peak_memory_bytes is not None and run.peak_memory_bytes > 0
        assert all(r.peak_bytes and r.memory for r in run.records)
        assert "ledger" in run.peak_memory_source
    else:
        assert run.peak_memory_bytes is None
        assert "not measurable" in run.peak_memory_source


def test_cuda_only_methods_are_reported_not_faked() -> None:
    reason = unavailable_reason(Method.CUDA_MALLOC_ASYNC, CPU)
    assert reason is not None and "not available on this device" in reason
    run = run_method(Method.CUDA_MALLOC_ASYNC, SPEC, PARAMS, CPU, k=2, seed=0, capacity_bytes=1)
    assert not run.available and run.records == [] and run.note == reason


def test_waterwave_budget_too_small_fails_trials_not_the_run() -> None:
    run = run_method(Method.WATERWAVE, SPEC, PARAMS, CPU, k=2, seed=0, capacity_bytes=1000)
    assert run.completed == set()
    assert all(r.oom and "BudgetExceededError" in r.error for r in run.records)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="k=0"):
        run_method(Method.TEMPORAL, SPEC, PARAMS, CPU, k=0, seed=0, capacity_bytes=1)
    with pytest.raises(ValueError, match="params is empty"):
        run_method(Method.TEMPORAL, SPEC, [], CPU, k=1, seed=0, capacity_bytes=1)


def test_call_in_child_returns_the_value_or_the_error() -> None:
    import math

    from waterwave_hpo.bench._runners import call_in_child

    assert call_in_child(math.factorial, 5) == 120
    with pytest.raises(RuntimeError, match="factorial failed in a child process"):
        call_in_child(math.factorial, -1)


def test_call_in_child_says_so_when_the_child_dies_instead_of_waiting_forever() -> None:
    import os

    from waterwave_hpo.bench._runners import call_in_child

    # A native crash or the OOM killer: the child never answers.
    with pytest.raises(RuntimeError, match="_exit failed in a child process: the process died"):
        call_in_child(os._exit, 3)


def test_waterwave_reruns_an_evicted_trial_with_the_same_parameters() -> None:
    # fifo with 4 trials of the same model at a budget that fits 2 peaks but not 3 in step:
    # a deadlock evicts a trial; the executor re-runs it, and the re-run trains the same
    # parameter set (same index), so every index completes.
    from waterwave_hpo.bench import profile_trial

    spec = WorkloadSpec(Workload.GPT, Setting.HIGH, batch_size=8, steps=6, seq_len=16)
    params = [draw_params(Workload.GPT, 1, seed=0)[0]] * 4
    peak = profile_trial(spec, params[0]).peak_bytes
    run = run_method(
        Method.WATERWAVE_FIFO, spec, params, CPU, k=4, seed=0, capacity_bytes=int(2.2 * peak)
    )
    assert run.completed == {0, 1, 2, 3}
    retried = [r for r in run.records if r.attempt > 0]
    assert retried, run.note  # the budget forces at least one eviction
    for r in retried:
        assert any(o.index == r.index and o.oom for o in run.records if o.attempt == 0)


def test_waterwave_plans_fit_the_trials_that_do_not_fit_instead_of_evicting_them() -> None:
    # The same high-demand setting as above: with memory plans no trial is evicted or re-run;
    # the ones that do not fit beside their neighbours run planned, and every one completes.
    from waterwave_hpo.bench import profile_trial

    spec = WorkloadSpec(Workload.GPT, Setting.HIGH, batch_size=8, steps=6, seq_len=16)
    params = [draw_params(Workload.GPT, 1, seed=0)[0]] * 4
    peak = profile_trial(spec, params[0]).peak_bytes
    run = run_method(
        Method.WATERWAVE_PLANS, spec, params, CPU, k=4, seed=0, capacity_bytes=int(2.2 * peak)
    )
    assert run.completed == {0, 1, 2, 3}
    assert not any(r.oom for r in run.records) and all(r.attempt == 0 for r in run.records)
    assert any(r.planned for r in run.records), run.note
    assert "attempts ran with a memory plan" in run.note
    assert run.peak_memory_bytes is not None and run.peak_memory_bytes <= int(2.2 * peak)


def test_a_pool_method_installs_the_pool_before_cuda_initialises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import waterwave_hpo.bench._runners as runners
    import waterwave_hpo.memory as memory

    calls: list[str] = []
    installed: dict[int, object] = {}
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append("cuda init"))
    monkeypatch.setattr(memory, "installed_pool", lambda index=0: installed.get(index))
    monkeypatch.setattr(memory, "StreamAwarePool", lambda **kwargs: object())

    def use_pool(pool: object) -> None:
        if "cuda init" in calls:
            raise RuntimeError("use_pool() must be called before CUDA's first allocation")
        calls.append("pool installed")
        installed[0] = pool

    monkeypatch.setattr(memory, "use_pool", use_pool)
    monkeypatch.setattr(runners, "_DevicePeak", lambda device: None)
    monkeypatch.setattr(runners, "_run_waterwave", lambda *args: "")
    monkeypatch.setattr("waterwave_hpo.bench._calibrate.warm_up", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _NoStream())
    run = run_method(
        Method.WATERWAVE,
        SPEC,
        PARAMS,
        torch.device("cuda:0"),
        k=2,
        seed=0,
        capacity_bytes=1 << 20,
        isolate=False,
    )
    assert calls[:2] == ["pool installed", "cuda init"]
    assert run.available and run.allocator is runners.Allocator.STREAM_AWARE_POOL
    assert "allocator: waterwave-pool" in run.note


def test_a_pool_method_aborts_when_the_pool_cannot_be_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import waterwave_hpo.bench._runners as runners
    import waterwave_hpo.memory as memory

    ran: list[str] = []

    def refuse(pool: object) -> None:
        raise RuntimeError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(memory, "installed_pool", lambda index=0: None)
    monkeypatch.setattr(memory, "StreamAwarePool", lambda **kwargs: object())
    monkeypatch.setattr(memory, "use_pool", refuse)
    monkeypatch.setattr(torch.cuda, "init", lambda: ran.append("cuda init"))
    monkeypatch.setattr(runners, "_run_waterwave", lambda *args: ran.append("ran") or "")
    run = run_method(
        Method.WATERWAVE_FIFO,
        SPEC,
        PARAMS,
        torch.device("cuda:0"),
        k=2,
        seed=0,
        capacity_bytes=1 << 20,
        isolate=False,
    )
    assert not run.available and ran == []
    assert run.note.startswith("aborted: the stream-aware pool could not be made")
    assert "libcuda.so.1" in run.note and run.allocator is None


def test_results_say_which_allocator_each_method_ran_on() -> None:
    run = run_method(Method.TEMPORAL, SPEC, PARAMS[:1], CPU, k=1, seed=0, capacity_bytes=1 << 20)
    assert run.allocator is not None and run.allocator.value == "cpu"
    from waterwave_hpo.bench._results import result_of

    assert result_of(run, 1, 1 << 20, 0, None).allocator == "cpu"


class _NoStream:
    def synchronize(self) -> None:
        pass


def test_fused_method_trains_trials_of_one_structure_as_one_model() -> None:
    same_structure = [dict(PARAMS[0], lr=lr) for lr in (1e-3, 3e-3, 1e-2)]
    run = run_method(Method.FUSED, SPEC, same_structure, CPU, k=3, seed=0, capacity_bytes=1)
    assert run.completed == {0, 1, 2}
    assert "fused groups of sizes [3]" in run.note
    # One array: the three trials share start, end and step time.
    assert len({(r.start_s, r.end_s, r.host_s_per_step) for r in run.records}) == 1
