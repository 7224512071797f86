"""Bad arguments to the engine's public parts: scheduler, simulator, pool, LaySA, report,
doctor, demo and bench APIs (table-driven). Each names the argument, the value and a fix."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import torch

from badinput._helpers import Case
from badinput._helpers import case_params
from badinput._helpers import file_hashes
import waterwave_hpo as ww
from waterwave_hpo import bench
from waterwave_hpo import demo
from waterwave_hpo import distributed
from waterwave_hpo import doctor
from waterwave_hpo import memory
from waterwave_hpo import report
from waterwave_hpo import scheduler
from waterwave_hpo import sim

_PROFILE = scheduler.TrialProfile(1 << 20, (1 << 20,))

ENGINE = [
    Case("sched-budget", lambda: ww.PipelineScheduler(0), ValueError, "budget_bytes", "0", "range"),
    Case(
        "sched-budget-str",
        lambda: ww.PipelineScheduler("8GB"),
        TypeError,
        "budget_bytes",
        "'8GB'",
        "type",
    ),
    Case(
        "sched-policy",
        lambda: ww.PipelineScheduler(100, "lifo"),
        ValueError,
        "policy",
        "'lifo'",
        "range",
    ),
    Case(
        "sched-refresh",
        lambda: ww.PipelineScheduler(100, promise_refresh_s=-1),
        ValueError,
        "promise_refresh_s",
        "-1",
        "range",
    ),
    Case(
        "ledger-budget",
        lambda: scheduler.MemoryLedger(-5),
        ValueError,
        "budget_bytes",
        "-5",
        "range",
    ),
    Case("make-policy-int", lambda: scheduler.make_policy(3), TypeError, "policy", "3", "type"),
    Case(
        "sim-policy",
        lambda: sim.Sharing(policy="lifo"),
        ValueError,
        "policy",
        "'lifo'",
        "range",
    ),
    Case(
        "sim-empty",
        lambda: sim.simulate([], sim.SimDevice(1 << 30)),
        ValueError,
        "trials",
        "empty",
        "range",
    ),
    Case(
        "sim-str",
        lambda: sim.simulate("x", sim.SimDevice(1 << 30)),  # type: ignore[arg-type]
        TypeError,
        "trials[0]",
        "'str'",
        "type",
    ),
    Case(
        "auto-packing-k",
        lambda: sim.predict_auto_packing(_PROFILE, 1 << 30, "waterwave", 0),
        ValueError,
        "max_k",
        "0",
        "range",
    ),
    Case(
        "pool-capacity",
        lambda: memory.StreamAwarePool(-1, backend="sim"),
        ValueError,
        "capacity_bytes",
        "-1",
        "range",
    ),
    Case(
        "pool-backend",
        lambda: memory.StreamAwarePool(1 << 20, backend="tpu"),
        ValueError,
        "backend",
        "'tpu'",
        "range",
    ),
    Case(
        "pool-device",
        lambda: memory.StreamAwarePool(1 << 20, backend="sim", device=-1),
        ValueError,
        "device",
        "-1",
        "range",
    ),
    Case("round-size", lambda: memory.round_size(-1), ValueError, "nbytes", "-1", "range"),
    Case("stream-handle", lambda: memory.stream_handle("s"), TypeError, "stream", "'s'", "type"),
    Case("use-pool", lambda: memory.use_pool("p"), TypeError, "pool", "'p'", "type"),  # type: ignore[arg-type]
    Case(
        "laysa-density-zero",
        lambda: distributed.LaySAState(None, density=0),
        ValueError,
        "density",
        "0",
        "range",
    ),
    Case(
        "laysa-density-big",
        lambda: distributed.NaiveTopKState(None, density=1.5),
        ValueError,
        "density",
        "1.5",
        "range",
    ),
    Case(
        "laysa-not-ddp",
        lambda: distributed.laysa(torch.nn.Linear(2, 2), optimizer=None),  # type: ignore[arg-type]
        TypeError,
        "ddp_model",
        "Linear",
        "type",
    ),
    Case(
        "baseline-str",
        lambda: distributed.attach_baseline(torch.nn.Linear(2, 2), "x"),  # type: ignore[arg-type]
        TypeError,
        "baseline",
        "'x'",
        "type",
    ),
    Case("table-str", lambda: report.trials_table("s"), TypeError, "study", "'s'", "type"),  # type: ignore[arg-type]
    Case(
        "concurrency-int",
        lambda: report.max_concurrent_trials(3),  # type: ignore[arg-type]
        TypeError,
        "trials",
        "3",
        "type",
    ),
    Case(
        "concurrency-study",
        lambda: report.max_concurrent_trials([optuna.create_study()]),  # type: ignore[list-item]
        TypeError,
        "trials[0]",
        "Study",
        "type",
    ),
    Case(
        "timeline-missing-dir",
        lambda: report.plot_timeline([], "/nonexistent-dir/x.png"),
        FileNotFoundError,
        "path",
        "'/nonexistent-dir/x.png'",
        "path",
    ),
    Case(
        "doctor-device", lambda: doctor.run_doctor("tpu"), ValueError, "--device", "'tpu'", "range"
    ),
    Case(
        "doctor-missing-gpu",
        lambda: doctor.run_doctor("cuda:3"),
        ValueError,
        "--device",
        "'cuda:3'",
        "range",
    ),
    Case(
        "liveness-zero",
        lambda: demo.LivenessRule(heartbeat_interval_s=0),
        ValueError,
        "heartbeat_interval_s",
        "0",
        "range",
    ),
    Case(
        "liveness-grace",
        lambda: demo.LivenessRule(heartbeat_interval_s=10.0, grace_period_s=5.0),
        ValueError,
        "grace_period_s",
        "5.0",
        "range",
    ),
    Case(
        "digits-fraction", lambda: demo.load_digits(1.5), ValueError, "val_fraction", "1.5", "range"
    ),
    Case(
        "demo-trials",
        lambda: demo.run_demo(demo.DemoConfig(trials=-1)),
        demo.DemoSettingError,
        "trials",
        "-1",
        "range",
    ),
    Case(
        "demo-concurrency-str",
        lambda: demo.run_demo(demo.DemoConfig(concurrency="4")),  # type: ignore[arg-type]
        demo.DemoSettingError,
        "concurrency",
        "'4'",
        "type",
    ),
    Case(
        "demo-fuse",
        lambda: demo.run_demo(demo.DemoConfig(fuse=0)),
        demo.DemoSettingError,
        "fuse",
        "0",
        "range",
    ),
    Case(
        "demo-absurd-concurrency",
        lambda: demo.run_demo(demo.DemoConfig(concurrency=10**6, device="cpu")),
        demo.DemoSettingError,
        "concurrency",
        "1000000",
        "absurd",
    ),
    Case("bench-k", lambda: bench.BenchConfig(k=0), ValueError, "k", "0", "range"),
    Case("bench-trials", lambda: bench.BenchConfig(trials=-2), ValueError, "trials", "-2", "range"),
    Case(
        "bench-budget",
        lambda: bench.BenchConfig(budget_s=-1),
        ValueError,
        "budget_s",
        "-1",
        "range",
    ),
    Case(
        "bench-device",
        lambda: bench.BenchConfig(device="tpu"),
        ValueError,
        "device",
        "'tpu'",
        "range",
    ),
    Case(
        "bench-capacity",
        lambda: bench.BenchConfig(capacity_bytes=0),
        ValueError,
        "capacity_bytes",
        "0",
        "range",
    ),
]


@pytest.mark.parametrize("case", case_params(ENGINE))
def test_engine_api_refuses(case: Case) -> None:
    case.check()


def test_demo_out_that_is_a_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    out = tmp_path / "notes.txt"
    out.write_text("mine\n")
    before = file_hashes(tmp_path)
    Case(
        "demo-out-file",
        lambda: demo.run_demo(demo.DemoConfig(trials=0, device="cpu", out=out)),
        demo.DemoSettingError,
        "out",
        "notes.txt",
        "path",
    ).check()
    assert file_hashes(tmp_path) == before


def test_journal_paths_that_are_directories_are_refused(tmp_path: Path) -> None:
    before = file_hashes(tmp_path)
    Case(
        "journal-dir",
        lambda: demo.open_journal(tmp_path),
        IsADirectoryError,
        "path",
        str(tmp_path),
        "path",
    ).check()
    assert demo.check_journal(str(tmp_path / "absent.log")) is None  # a str path works too
    assert file_hashes(tmp_path) == before


def test_timeline_into_a_directory_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    Case(
        "timeline-dir",
        lambda: report.plot_timeline([], tmp_path),
        IsADirectoryError,
        "path",
        str(tmp_path),
        "path",
    ).check()
    assert list(tmp_path.iterdir()) == []
    assert not Path(f"{tmp_path}.png").exists()
