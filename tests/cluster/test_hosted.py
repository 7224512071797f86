"""TrialHost: Tune function trainables co-hosted in one process, without a Ray cluster (the Ray
actor around it and the Tune side are tested in tests/integrations/test_ray_tune_hosts.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
import threading
import time
from typing import Any

import pytest

pytest.importorskip("ray.tune")

from ray import tune
from ray.train._internal import session as ray_session
import torch

import waterwave_hpo as ww
from waterwave_hpo.cluster._hosted import TrialHost
from waterwave_hpo.cluster._hosted_events import HostedEvent
from waterwave_hpo.cluster._hosted_events import unpack_directory


@pytest.fixture
def host() -> Iterator[TrialHost]:
    h = TrialHost(torch.device("cpu"), 2, heartbeat_ttl_s=30.0)
    yield h
    h.shutdown()


def _collect(host: TrialHost, key: str, timeout_s: float = 20.0) -> list[HostedEvent]:
    events: list[HostedEvent] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events += host.poll(key, 0.2)
        if events and events[-1].kind != "result":
            return events
    raise AssertionError(f"trial {key} did not end within {timeout_s} s: {events}")


def _steps(config: dict[str, Any]) -> None:
    for step in range(1, config["steps"] + 1):
        time.sleep(config.get("sleep_s", 0.05))
        tune.report({"step": step, "score": config["x"] * step, "device": str(ww.current().device)})


def test_reports_come_back_in_order_and_trials_share_the_device(host: TrialHost) -> None:
    for i in range(3):
        host.start(f"t{i}", _steps, {"steps": 4, "x": i, "sleep_s": 0.1})
    results = {f"t{i}": _collect(host, f"t{i}") for i in range(3)}
    for i in range(3):
        events = results[f"t{i}"]
        assert [e.kind for e in events] == ["result"] * 4 + ["done"]
        assert [e.metrics["score"] for e in events[:-1]] == [i * s for s in range(1, 5)]
        assert events[0].metrics["device"] == "cpu"
    stats = host.stats()
    assert stats.peak_running == 2  # two at once, never three
    assert (stats.running, stats.waiting, stats.finished) == (0, 0, 3)
    with pytest.raises(KeyError, match="t0"):
        host.poll("t0", 0.0)  # collected after its last event


def test_a_failing_trial_fails_alone(host: TrialHost) -> None:
    def broken(config: dict[str, Any]) -> None:
        tune.report({"score": 1})
        raise ValueError("bad learning rate")

    host.start("bad", broken, {})
    host.start("good", _steps, {"steps": 3, "x": 1})
    bad, good = _collect(host, "bad"), _collect(host, "good")
    assert [e.kind for e in bad] == ["result", "error"]
    assert "ValueError: bad learning rate" in (bad[-1].error or "")
    assert not bad[-1].out_of_memory
    assert [e.kind for e in good] == ["result"] * 3 + ["done"]


def test_a_hosted_trial_has_a_context_whose_optuna_trial_says_it_is_a_tune_trial(
    host: TrialHost,
) -> None:
    def uses_optuna(config: dict[str, Any]) -> None:
        context = ww.current()
        tune.report({"number": context.trial_number, "device": str(context.device)})
        context.trial.suggest_float("lr", 1e-4, 1e-1)  # not an Optuna trial

    host.start("t", uses_optuna, {})
    events = _collect(host, "t")
    assert [e.kind for e in events] == ["result", "error"]
    assert events[0].metrics is not None and events[0].metrics["device"] == "cpu"
    error = events[-1].error or ""
    assert "AttributeError: trial.suggest_float: this trial is run by tune_hosts()" in error


def test_stop_ends_a_running_trial_and_a_waiting_one_never_starts(host: TrialHost) -> None:
    started: list[str] = []

    def long(config: dict[str, Any]) -> None:
        started.append(config["name"])
        for step in range(1000):
            time.sleep(0.01)
            tune.report({"step": step})

    for name in ("a", "b", "c"):
        host.start(name, long, {"name": name})
    # Until both functions run: a trial the host counts as running may not have reached its
    # first line yet, and stopped then it ends before that line (a CI run met this).
    deadline = time.monotonic() + 30
    while len(started) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert host.stats().running == 2
    host.stop("c")  # waiting: never runs
    host.stop("a")
    host.stop("b")
    deadline = time.monotonic() + 10
    while host.stats().running and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = host.stats()
    assert stats.running == 0 and stats.waiting == 0
    assert sorted(started) == ["a", "b"]


def test_a_stop_that_lands_as_the_trial_takes_the_hosts_lock_leaves_the_lock_free(
    host: TrialHost,
) -> None:
    # The stop is raised in the trial's thread asynchronously (its next bytecode). A thread
    # blocked on the host's lock in tune.report when it arrives gets it right after taking the
    # lock: raised inside a Python-level __enter__ (threading.Condition's), the lock was never
    # released and every later call of the host waited forever (a Ray Tune test hung on it).
    reporting = threading.Event()

    def reports(config: dict[str, Any]) -> None:
        while True:
            reporting.set()
            tune.report({"score": 1.0})

    host.start("t", reports, {})
    assert reporting.wait(20.0)
    with host._cond:  # the trial thread now blocks in tune.report, on the host's lock
        time.sleep(0.2)
        host.stop("t")  # raised in it while it waits
    ended = threading.Event()
    threading.Thread(target=lambda: (host.stats(), ended.set()), daemon=True).start()
    assert ended.wait(20.0), "the host's lock was left held by the stopped trial's thread"
    deadline = time.monotonic() + 20.0
    while host.stats().running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert host.stats().running == 0


def test_a_trial_whose_tune_process_stops_polling_is_stopped() -> None:
    host = TrialHost(torch.device("cpu"), 1, heartbeat_ttl_s=0.3)
    try:
        steps: list[int] = []

        def long(config: dict[str, Any]) -> None:
            for step in range(1000):
                time.sleep(0.01)
                steps.append(step)
                tune.report({"step": step})

        host.start("lost", long, {})
        deadline = time.monotonic() + 10
        while host.stats().finished == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert host.stats().finished == 1
        assert len(steps) < 1000
    finally:
        host.shutdown()


def test_a_touched_trial_outlives_its_heartbeat_and_its_events_wait_for_the_poll() -> None:
    # What its Tune process does while Tune's driver is slow to take a result: it touches the
    # trial instead of polling; the host keeps it, with its events, past heartbeat_ttl_s.
    host = TrialHost(torch.device("cpu"), 1, heartbeat_ttl_s=0.3)
    try:

        def short(config: dict[str, Any]) -> None:
            for step in range(3):
                tune.report({"step": step})

        host.start("slow-driver", short, {})
        deadline = time.monotonic() + 1.5  # five heartbeats' worth, not one poll
        while time.monotonic() < deadline:
            assert host.touch("slow-driver")
            time.sleep(0.05)
        events = _collect(host, "slow-driver")
        assert [e.kind for e in events] == ["result", "result", "result", "done"]
        assert host.touch("slow-driver") is False  # collected: unknown from now on
        assert host.touch("never-started") is False
    finally:
        host.shutdown()


def test_checkpoints_travel_both_ways(host: TrialHost, tmp_path: Path) -> None:
    def saves(config: dict[str, Any]) -> None:
        loaded = tune.get_checkpoint()
        previous = 0
        if loaded is not None:
            with loaded.as_directory() as directory:
                previous = int(Path(directory, "step.txt").read_text())
        directory = tmp_path / f"ckpt-{previous}"
        directory.mkdir()
        (directory / "step.txt").write_text(str(previous + 1))
        tune.report({"step": previous + 1}, checkpoint=tune.Checkpoint.from_directory(directory))

    host.start("first", saves, {})
    first = _collect(host, "first")
    assert first[0].metrics == {"step": 1}
    assert first[0].checkpoint is not None
    unpacked = unpack_directory(first[0].checkpoint)
    assert Path(unpacked, "step.txt").read_text() == "1"
    host.start("resumed", saves, {}, checkpoint=first[0].checkpoint)
    assert _collect(host, "resumed")[0].metrics == {"step": 2}


def test_reports_from_other_threads_are_refused_and_the_session_goes_with_the_host() -> None:
    host = TrialHost(torch.device("cpu"), 1)
    errors: list[BaseException] = []

    def reports_from_a_thread_of_its_own(config: dict[str, Any]) -> None:
        def side() -> None:
            try:
                tune.report({"x": 1})
            except RuntimeError as error:
                errors.append(error)

        thread = threading.Thread(target=side)
        thread.start()
        thread.join()

    host.start("t", reports_from_a_thread_of_its_own, {})
    assert [e.kind for e in _collect(host, "t")] == ["done"]
    assert "outside a hosted trial's own thread" in str(errors[0])
    host.shutdown()
    assert ray_session.get_session() is None


def test_gates_see_the_hosts_scheduler() -> None:
    host = TrialHost(torch.device("cpu"), 2, memory_budget_bytes=1 << 30)
    try:
        seen: list[Any] = []

        def train(config: dict[str, Any]) -> None:
            model = ww.pipeline(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
            for _ in range(2):  # the first batch profiles the groups, the second is gated
                model(torch.randn(4, 8)).sum().backward()
            seen.append(ww.current().scheduler)
            tune.report({"ok": 1})

        host.start("g", train, {})
        assert [e.kind for e in _collect(host, "g")] == ["result", "done"]
        assert seen == [host.memory.scheduler] and seen[0] is not None
        assert seen[0].stats().used_bytes == 0  # the finished trial gave everything back
        assert seen[0].stats().peak_bytes > 0
    finally:
        host.shutdown()


def test_start_twice_is_refused(host: TrialHost) -> None:
    host.start("same", _steps, {"steps": 50, "x": 1})
    with pytest.raises(ValueError, match="'same' is already running or waiting"):
        host.start("same", _steps, {"steps": 1, "x": 1})
    host.stop("same")


def _mlp(width: int = 128) -> torch.nn.Module:
    return torch.nn.Sequential(
        *[m for _ in range(4) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())],
        torch.nn.Linear(width, 4),
    )


def test_tune_hosts_memory_plans_plan_a_registered_model_that_does_not_fit() -> None:
    # tune_hosts(memory_plan="home"): fit_trial_memory in a hosted Tune trial plans
    # the model for the memory its host's scheduler leaves, as WaterwaveExecutor does.
    from waterwave_hpo.planning import PLANNERS
    from waterwave_hpo.planning import remove_memory_plan
    from waterwave_hpo.planning import step_profile_of

    x = torch.randn(1024, 128)
    probe = _mlp()
    ww.fit_memory(probe, 1 << 40, example_input=x, planner="none")
    profile = step_profile_of(probe)
    remove_memory_plan(probe)
    bw = ww.planning.DEFAULT_BANDWIDTH_BYTES_PER_S
    plain = PLANNERS["none"](profile, 0, bandwidth_bytes_per_s=bw, seed=0).prediction.peak_bytes
    smallest = PLANNERS["swap_all"](profile, 0, bandwidth_bytes_per_s=bw, seed=0)
    budget = (plain + smallest.prediction.peak_bytes) // 2
    seen: list[Any] = []

    def train(config: dict[str, Any]) -> None:
        model = ww.fit_trial_memory(_mlp(), example_input=x)
        model(x).sum().backward()
        seen.append(ww.current().planning)
        tune.report({"ok": 1})

    host = TrialHost(torch.device("cpu"), 1, memory_budget_bytes=budget, memory_plan="home")
    try:
        host.start("p", train, {})
        assert [e.kind for e in _collect(host, "p")] == ["result", "done"]
        planning = seen[0]
        assert planning is not None and planning.plan is not None
        assert planning.footprint_bytes <= budget < plain
        assert host.memory.scheduler is not None
        assert host.memory.scheduler.stats().used_bytes == 0  # its footprint released at the end
    finally:
        host.shutdown()


def test_tune_hosts_checks_memory_plan_as_the_executor_does() -> None:
    with pytest.raises(ValueError, match="memory_plan"):
        ww.tune_hosts(memory_plan="yes")


# -- fuse=K: a batched trainable runs up to K Tune trials per call -----------------


def _fused_host(**kwargs: Any) -> TrialHost:
    settings: dict[str, Any] = {"fuse": 2, "fuse_wait_s": 5.0, "heartbeat_ttl_s": 30.0}
    settings.update(kwargs)
    return TrialHost(torch.device("cpu"), 1, **settings)


def _wait_until(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


def test_fused_trials_that_arrive_together_run_as_one_call_and_report_alone() -> None:
    calls: list[list[float]] = []

    @ww.batched
    def train(trials: list[Any]) -> None:
        calls.append([t.config["x"] for t in trials])
        for step in range(1, 4):
            for t in trials:
                t.report({"score": t.config["x"] * step, "batch": len(trials)})

    host = _fused_host()
    try:
        for i, x in enumerate((1.0, 2.0, 3.0)):
            host.start(f"t{i}", train, {"x": x}, group="g")
        events = {f"t{i}": _collect(host, f"t{i}") for i in range(3)}
        stats = host.stats()
    finally:
        host.shutdown()
    assert calls == [[1.0, 2.0], [3.0]]  # two arrived together; the third waited, then alone
    for i, x in enumerate((1.0, 2.0, 3.0)):
        assert [e.kind for e in events[f"t{i}"]] == ["result"] * 3 + ["done"]
        assert [e.metrics["score"] for e in events[f"t{i}"][:-1]] == [x, 2 * x, 3 * x]
    assert events["t0"][0].metrics["batch"] == 2 and events["t2"][0].metrics["batch"] == 1
    assert stats.peak_running == 2 and stats.finished == 3  # one place, two trials in it


def test_a_stopped_trial_drops_out_of_its_batch_and_its_batch_mate_goes_on() -> None:
    # ASHA stopping one trial of a fused batch must not stop its batch-mate's reporting.
    seen_stopped: list[bool] = []
    release = threading.Event()

    @ww.batched
    def train(trials: list[Any]) -> None:
        for step in range(1, 6):
            for t in trials:
                t.report({"step": step})
            if step == 2:
                release.wait(10)
        seen_stopped.extend(t.stopped for t in trials)

    host = _fused_host()
    try:
        host.start("weak", train, {}, group="g")
        host.start("strong", train, {}, group="g")
        _wait_until(lambda: host.stats().running == 2)
        weak: list[HostedEvent] = []
        while len(weak) < 2:  # the batch waits at step 2 for the release
            weak += host.poll("weak", 0.2)
        host.stop("weak")  # what _run_in_host does when Tune stops the trial
        release.set()
        strong = _collect(host, "strong")
        _wait_until(lambda: host.stats().running == 0)
        with pytest.raises(KeyError):
            host.poll("weak", 0.0)  # forgotten once stopped
    finally:
        host.shutdown()
    assert [e.kind for e in strong] == ["result"] * 5 + ["done"]
    assert [e.metrics["step"] for e in strong[:-1]] == [1, 2, 3, 4, 5]
    assert seen_stopped == [True, False]


def test_a_batch_is_stopped_once_all_its_trials_are() -> None:
    steps: list[int] = []

    @ww.batched
    def train(trials: list[Any]) -> None:
        for step in range(1000):
            time.sleep(0.01)
            steps.append(step)
            for t in trials:
                t.report({"step": step})

    host = _fused_host()
    try:
        host.start("a", train, {}, group="g")
        host.start("b", train, {}, group="g")
        _wait_until(lambda: len(steps) > 3)
        host.stop("a")
        time.sleep(0.1)
        assert host.stats().running == 2  # b still runs: the call goes on
        host.stop("b")
        _wait_until(lambda: host.stats().running == 0)
    finally:
        host.shutdown()
    assert len(steps) < 1000


def test_a_fused_batch_ends_each_trial_alone_or_together() -> None:
    @ww.batched
    def train(trials: list[Any]) -> list[Any]:
        for t in trials:
            t.report({"x": t.config["x"]})
        if any(t.config["x"] == "all" for t in trials):
            raise ValueError("the fused model diverged")
        return [
            ValueError(f"{t.config['x']} diverged") if t.config["x"] == "bad" else None
            for t in trials
        ]

    @ww.batched
    def uses_tune_report(trials: list[Any]) -> None:
        tune.report({"x": 1})

    host = _fused_host()
    try:
        host.start("bad", train, {"x": "bad"}, group="g1")
        host.start("good", train, {"x": "good"}, group="g1")
        host.start("all1", train, {"x": "all"}, group="g2")
        host.start("all2", train, {"x": "ok"}, group="g2")
        host.start("r1", uses_tune_report, {}, group="g3")
        host.start("r2", uses_tune_report, {}, group="g3")
        ends = {k: _collect(host, k)[-1] for k in ("bad", "good", "all1", "all2", "r1", "r2")}
    finally:
        host.shutdown()
    assert ends["good"].kind == "done"
    assert ends["bad"].kind == "error" and "ValueError: bad diverged" in (ends["bad"].error or "")
    for key in ("all1", "all2"):
        assert "the fused model diverged" in (ends[key].error or "")
    for key in ("r1", "r2"):
        assert "cannot tell which trial it is for" in (ends[key].error or "")


def test_only_trials_of_one_group_share_a_batch_and_checkpoints_stay_each_trials(
    tmp_path: Path,
) -> None:
    from waterwave_hpo.cluster._hosted_events import pack_directory

    calls: list[list[str]] = []

    @ww.batched
    def train(trials: list[Any]) -> None:
        calls.append(sorted(t.config["name"] for t in trials))
        for t in trials:
            loaded = t.get_checkpoint()
            start = "none"
            if loaded is not None:
                with loaded.as_directory() as directory:
                    start = Path(directory, "s.txt").read_text()
            t.report({"resumed_from": start})

    saved = tmp_path / "ckpt"
    saved.mkdir()
    (saved / "s.txt").write_text("7")
    host = _fused_host(fuse_wait_s=1.0)
    try:
        host.start("a", train, {"name": "a"}, pack_directory(saved), group="narrow")
        host.start("b", train, {"name": "b"}, group="wide")
        host.start("c", train, {"name": "c"}, group="narrow")
        events = {k: _collect(host, k) for k in "abc"}
    finally:
        host.shutdown()
    assert sorted(calls) == [["a", "c"], ["b"]]
    assert events["a"][0].metrics == {"resumed_from": "7"}
    assert events["c"][0].metrics == {"resumed_from": "none"}


def test_a_fused_batchs_model_is_planned_as_one_under_tune_hosts() -> None:
    # fuse + memory_plan="home" under tune_hosts(): the fused call registers one
    # model; it gets one plan for the memory left, and its footprint goes back at the end.
    from waterwave_hpo.planning import PLANNERS
    from waterwave_hpo.planning import remove_memory_plan
    from waterwave_hpo.planning import step_profile_of

    x = torch.randn(1024, 128)
    probe = _mlp()
    ww.fit_memory(probe, 1 << 40, example_input=x, planner="none")
    profile = step_profile_of(probe)
    remove_memory_plan(probe)
    bw = ww.planning.DEFAULT_BANDWIDTH_BYTES_PER_S
    plain = PLANNERS["none"](profile, 0, bandwidth_bytes_per_s=bw, seed=0).prediction.peak_bytes
    smallest = PLANNERS["swap_all"](profile, 0, bandwidth_bytes_per_s=bw, seed=0)
    budget = (plain + smallest.prediction.peak_bytes) // 2
    seen: list[Any] = []

    @ww.batched
    def train(trials: list[Any]) -> None:
        model = ww.fit_trial_memory(_mlp(), example_input=x)  # stands for the fused model
        model(x).sum().backward()
        seen.append((ww.current().planning, len(ww.current().batch)))
        for t in trials:
            t.report({"ok": 1})

    host = _fused_host(memory_budget_bytes=budget, memory_plan="home")
    try:
        host.start("p", train, {}, group="g")
        host.start("q", train, {}, group="g")
        assert [e.kind for e in _collect(host, "p")] == ["result", "done"]
        assert [e.kind for e in _collect(host, "q")] == ["result", "done"]
        assert host.memory.scheduler is not None
        assert host.memory.scheduler.stats().used_bytes == 0
    finally:
        host.shutdown()
    ((planning, batch_size),) = seen
    assert batch_size == 2
    assert planning is not None and planning.plan is not None
    assert planning.footprint_bytes <= budget < plain


def test_a_fused_gated_model_short_of_memory_runs_with_a_plan_under_tune_hosts() -> None:
    # fuse + ww.pipeline gates + memory_plan="home" under tune_hosts(): the fused
    # call's gated model does not fit under its gates, so a plan for the budget replaces them.
    from waterwave_hpo.nodegroup import trial_profile
    from waterwave_hpo.nodegroup._internal import has_pipeline

    class Fused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.models = torch.nn.ModuleList([_mlp(), _mlp()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.stack([m(x) for m in self.models])

    from waterwave_hpo.planning import PLANNERS
    from waterwave_hpo.planning import remove_memory_plan
    from waterwave_hpo.planning import step_profile_of

    x = torch.randn(1024, 128)
    claim = trial_profile(ww.pipeline(Fused(), example_input=x)).peak_bytes
    probe = Fused()
    ww.fit_memory(probe, 1 << 40, example_input=x, planner="none")
    profile = step_profile_of(probe)
    remove_memory_plan(probe)
    bw = ww.planning.DEFAULT_BANDWIDTH_BYTES_PER_S
    smallest = PLANNERS["swap_all"](profile, 0, bandwidth_bytes_per_s=bw, seed=0)
    assert smallest.prediction.peak_bytes < claim
    budget = (claim + smallest.prediction.peak_bytes) // 2
    seen: list[Any] = []

    @ww.batched
    def train(trials: list[Any]) -> None:
        model = ww.fit_trial_memory(ww.pipeline(Fused()), example_input=x)
        model(x).sum().backward()
        seen.append((ww.current().planning, has_pipeline(model)))
        for t in trials:
            t.report({"ok": 1})

    host = _fused_host(memory_budget_bytes=budget, memory_plan="home")
    try:
        host.start("p", train, {}, group="g")
        host.start("q", train, {}, group="g")
        assert [e.kind for e in _collect(host, "p")] == ["result", "done"]
        assert [e.kind for e in _collect(host, "q")] == ["result", "done"]
        assert host.memory.scheduler is not None
        stats = host.memory.scheduler.stats()
    finally:
        host.shutdown()
    ((planning, gated),) = seen
    assert planning is not None and planning.plan is not None and not gated
    assert planning.footprint_bytes <= budget < claim
    assert stats.used_bytes == 0 and stats.peak_bytes <= budget


def test_a_fused_call_under_gates_reserves_under_its_first_trial_alone() -> None:
    # fuse + ww.pipeline gates under tune_hosts(): one scheduler trial per call, so
    # the scheduler's deadlock resolution never waits on a batch-mate that never asks.
    peaks: list[int] = []

    @ww.batched
    def train(trials: list[Any]) -> None:
        model = ww.pipeline(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
        for _ in range(2):  # the first step profiles the groups, the second is gated
            model(torch.randn(4, 8)).sum().backward()
        scheduler = ww.current().scheduler
        assert scheduler is not None
        peaks.append(scheduler.stats().peak_bytes)
        for t in trials:
            t.report({"ok": 1})

    host = _fused_host(memory_budget_bytes=1 << 30)
    try:
        host.start("a", train, {}, group="g")
        host.start("b", train, {}, group="g")
        assert [e.kind for e in _collect(host, "a")] == ["result", "done"]
        assert [e.kind for e in _collect(host, "b")] == ["result", "done"]
        assert host.memory.scheduler is not None
        stats = host.memory.scheduler.stats()
    finally:
        host.shutdown()
    assert peaks[0] > 0 and stats.used_bytes == 0
    assert [t.trial_number for t in stats.trials] == [0]  # the call's first trial alone
