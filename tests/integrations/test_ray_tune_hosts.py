"""tune_hosts() with Ray Tune on a local Ray cluster with one logical GPU: the trials'
functions run co-hosted in the GPU's host actor (on the CPU here; Ray's placement is real)."""

from __future__ import annotations

import os
from pathlib import Path
import subprocess
import sys
import threading
import time
from typing import Any
import uuid

import pytest

ray = pytest.importorskip("ray")
tune = pytest.importorskip("ray.tune")
import torch  # noqa: E402  (only trainables that use it take it to Ray's workers)
from waterwave_hpo.integrations import ray_tune as ww_tune  # noqa: E402

import waterwave_hpo as ww  # noqa: E402

pytestmark = [pytest.mark.usefixtures("ray_cluster")]


def _rendezvous(directory: str, n: int, timeout_s: float = 300.0) -> None:
    # Wait until n trials are running, so "ran at the same time" is not left to luck (Tune
    # starts its trial processes one after another, many seconds apart on a loaded machine:
    # the deadline is only a backstop); a later trial finds them there at once.
    Path(directory, f"{os.getpid()}-{time.time_ns()}").touch()
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(directory)) < n and time.monotonic() < deadline:
        time.sleep(0.02)


# A batch waits for its mates this long: they arrive as soon as Tune starts their processes,
# which on a loaded 2-core machine can be tens of seconds after the first (a shorter wait ran
# batches of one there).
FUSE_WAIT_S = 300.0


def _train(config: dict[str, Any]) -> None:
    pid = os.getpid()
    if "rendezvous" in config:
        _rendezvous(config["rendezvous"], 2)
    for step in range(1, config.get("steps", 4) + 1):
        time.sleep(config.get("sleep_s", 0.1))
        if config.get("fail_x") == config["x"]:
            raise ValueError(f"trial x={config['x']} diverged")
        tune.report({"score": config["x"] * step, "host_pid": pid})


class _TrialProcessLibraries(tune.Callback):
    """Whether each Tune trial's own process (the ``pid`` of its results) has torch loaded,
    read from its memory map while it runs."""

    def __init__(self) -> None:
        self.torch_loaded: dict[int, bool] = {}

    def on_trial_result(self, iteration: int, trials: Any, trial: Any, result: Any, **info: Any):
        pid = result["pid"]
        if pid not in self.torch_loaded:
            self.torch_loaded[pid] = "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
def test_trials_run_inside_one_host_and_report_to_tune(tmp_path: Path) -> None:
    (tmp_path / "rendezvous").mkdir()
    libraries = _TrialProcessLibraries()
    with ww.tune_hosts(trials_per_gpu=2, cpus_per_trial=0.5) as hosts:
        assert hosts.n_hosts == 1 and hosts.max_concurrent_trials == 2
        analysis = tune.run(
            hosts.wrap(_train),
            config={
                "x": tune.grid_search([0.1, 0.2, 0.3, 0.4]),
                "rendezvous": str(tmp_path / "rendezvous"),
            },
            resources_per_trial=hosts.resources,
            max_concurrent_trials=hosts.max_concurrent_trials,
            storage_path=str(tmp_path),
            verbose=0,
            callbacks=[libraries],
        )
        stats = hosts.stats()[0]
    trials = analysis.trials
    assert [t.status for t in trials] == ["TERMINATED"] * 4
    # The trials' own processes relay results: torch is loaded only where the functions run.
    assert len(libraries.torch_loaded) >= 2 and not any(libraries.torch_loaded.values())
    results = [t.last_result for t in trials]
    assert all(r["training_iteration"] == 4 for r in results)
    assert [r["score"] for r in results] == pytest.approx([4 * t.config["x"] for t in trials])
    assert len({r["host_pid"] for r in results}) == 1  # one process ran every trial's function
    assert results[0]["host_pid"] != os.getpid()
    assert stats.peak_running == 2 and stats.finished == 4 and stats.running == 0


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
@pytest.mark.parametrize("reuse_actors", [False, True])
def test_asha_stops_trials_in_the_host_and_a_failing_trial_fails_alone(
    tmp_path: Path, reuse_actors: bool
) -> None:
    # reuse_actors=True (docs/guide/ray.md): a stopped trial's process relays the next trial,
    # and the stopped trial must still end in the host.
    from ray.tune.schedulers import ASHAScheduler

    with ww.tune_hosts(trials_per_gpu=2, cpus_per_trial=0.5, heartbeat_ttl_s=5.0) as hosts:
        tuner = tune.Tuner(
            tune.with_resources(hosts.wrap(_train), hosts.resources),
            param_space={
                "x": tune.grid_search([1.0, 0.9, 0.2, 0.1, 0.5]),
                "steps": 8,
                "sleep_s": 0.05,
                "fail_x": 0.5,
            },
            tune_config=tune.TuneConfig(
                scheduler=ASHAScheduler(
                    metric="score", mode="max", max_t=8, grace_period=1, reduction_factor=2
                ),
                max_concurrent_trials=hosts.max_concurrent_trials,
                reuse_actors=reuse_actors,
            ),
            run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0),
        )
        grid = tuner.fit()
        deadline = time.monotonic() + 120.0  # stopped trials end after heartbeat_ttl_s
        while hosts.stats()[0].running and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = hosts.stats()[0]
    assert grid.num_errors == 1
    failed = [r for r in grid if r.error is not None]
    assert failed[0].config["x"] == 0.5
    assert "trial x=0.5 diverged" in str(failed[0].error)
    iterations = {r.config["x"]: r.metrics["training_iteration"] for r in grid if r.error is None}
    assert iterations[1.0] == 8  # the best ran to max_t
    assert min(iterations.values()) < 8  # ASHA stopped the weak ones early
    assert stats.running == 0 and stats.waiting == 0  # stopped in the host too
    relays = {r.metrics["pid"] for r in grid if r.error is None}  # Tune's: the trial's process
    assert len(relays) < 4 if reuse_actors else len(relays) == 4


def _checkpointing(config: dict[str, Any]) -> None:
    import tempfile

    start = 0
    loaded = tune.get_checkpoint()
    if loaded is not None:
        with loaded.as_directory() as directory:
            start = int(Path(directory, "state.txt").read_text())
    for step in range(start + 1, start + 3):
        with tempfile.TemporaryDirectory() as directory:
            Path(directory, "state.txt").write_text(str(step))
            tune.report({"score": step}, checkpoint=tune.Checkpoint.from_directory(directory))


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
def test_checkpoints_land_where_tune_puts_them(tmp_path: Path) -> None:
    with ww.tune_hosts(trials_per_gpu=2, cpus_per_trial=0.5) as hosts:
        tuner = tune.Tuner(
            tune.with_resources(hosts.wrap(_checkpointing), hosts.resources),
            tune_config=tune.TuneConfig(num_samples=2),
            run_config=tune.RunConfig(storage_path=str(tmp_path), name="ckpt", verbose=0),
        )
        grid = tuner.fit()
    assert grid.num_errors == 0 and len(grid) == 2
    for result in grid:
        assert result.metrics["score"] == 2
        assert result.checkpoint is not None
        assert Path(result.checkpoint.path).is_relative_to(tmp_path / "ckpt")
        with result.checkpoint.as_directory() as directory:
            assert Path(directory, "state.txt").read_text() == "2"


@ww.batched
def _fused_train(trials: list[Any]) -> None:
    # One call for a fused batch of Tune trials; the strongest reports first, so that Tune
    # hears the trials of a batch in a known order (ASHA's rungs depend on it).
    batch_id = uuid.uuid4().hex
    ordered = sorted(trials, key=lambda t: -t.config["x"])
    for step in range(1, trials[0].config.get("steps", 4) + 1):
        for t in ordered:
            time.sleep(trials[0].config.get("sleep_s", 0.05))
            t.report(
                {
                    "score": t.config["x"] * step,
                    "batch": len(trials),
                    "batch_id": batch_id,
                    "host_pid": os.getpid(),
                }
            )


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
def test_fused_trials_run_as_one_call_in_the_host_and_each_reports_to_tune(
    tmp_path: Path,
) -> None:
    with ww.tune_hosts(
        trials_per_gpu=1, cpus_per_trial=0.5, fuse=2, fuse_wait_s=FUSE_WAIT_S
    ) as hosts:
        assert hosts.max_concurrent_trials == 2  # one place, a batch of two in it
        analysis = tune.run(
            hosts.wrap(_fused_train),
            config={"x": tune.grid_search([0.1, 0.2, 0.3, 0.4])},
            resources_per_trial=hosts.resources,
            max_concurrent_trials=hosts.max_concurrent_trials,
            storage_path=str(tmp_path),
            verbose=0,
        )
        stats = hosts.stats()[0]
    trials = analysis.trials
    assert [t.status for t in trials] == ["TERMINATED"] * 4
    results = [t.last_result for t in trials]
    assert all(r["training_iteration"] == 4 for r in results)
    assert [r["score"] for r in results] == pytest.approx([4 * t.config["x"] for t in trials])
    assert [r["batch"] for r in results] == [2, 2, 2, 2]
    assert len({r["batch_id"] for r in results}) == 2  # two calls ran the four trials
    assert stats.peak_running == 2 and stats.finished == 4 and stats.running == 0


def test_asha_stops_one_trial_of_a_fused_batch_and_its_batch_mate_reports_on(
    tmp_path: Path,
) -> None:
    from ray.tune.schedulers import ASHAScheduler

    pairs = {1.0: 0, 0.1: 0, 0.9: 1, 0.2: 1}  # a strong and a weak trial in each batch
    with ww.tune_hosts(
        trials_per_gpu=1, cpus_per_trial=0.5, fuse=2, fuse_wait_s=FUSE_WAIT_S, heartbeat_ttl_s=5.0
    ) as hosts:
        tuner = tune.Tuner(
            tune.with_resources(
                hosts.wrap(_fused_train, batch_key=lambda c: pairs[c["x"]]), hosts.resources
            ),
            param_space={"x": tune.grid_search(list(pairs)), "steps": 8, "sleep_s": 0.15},
            tune_config=tune.TuneConfig(
                scheduler=ASHAScheduler(
                    metric="score", mode="max", max_t=8, grace_period=1, reduction_factor=2
                ),
                max_concurrent_trials=hosts.max_concurrent_trials,
            ),
            run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0),
        )
        grid = tuner.fit()
        deadline = time.monotonic() + 120.0  # stopped trials end after heartbeat_ttl_s
        while hosts.stats()[0].running and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = hosts.stats()[0]
    assert grid.num_errors == 0
    iterations = {r.config["x"]: r.metrics["training_iteration"] for r in grid}
    batches = {r.config["x"]: r.metrics["batch_id"] for r in grid}
    assert iterations[1.0] == 8  # the best ran to max_t
    assert all(r.metrics["batch"] == 2 for r in grid)
    assert batches[1.0] == batches[0.1] and batches[0.9] == batches[0.2] != batches[1.0]
    # ASHA stopped a weak trial early while its strong batch-mate reported on, in one call.
    assert any(
        iterations[weak] < iterations[strong] == 8 for strong, weak in ((1.0, 0.1), (0.9, 0.2))
    )
    assert stats.running == 0 and stats.waiting == 0  # the batches ended in the host too


class _SlowDriver(tune.Callback):
    """Holds Tune's driver loop on a trial's first result, as a slow callback or a checkpoint
    upload does: meanwhile the trial's process waits in ``tune.report``."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.held = False

    def on_trial_result(self, iteration: int, trials: Any, trial: Any, result: Any, **info: Any):
        if not self.held:
            self.held = True
            time.sleep(self.hold_s)


def test_a_trial_outlives_a_driver_slower_than_its_heartbeat(tmp_path: Path) -> None:
    # The host stops a trial that nothing kept alive for heartbeat_ttl_s; the driver holds its
    # loop three times that long, and the trial's process keeps it alive meanwhile (four
    # heartbeats per TTL: one late on a loaded machine does not lose it).
    with ww.tune_hosts(trials_per_gpu=1, cpus_per_trial=0.5, heartbeat_ttl_s=5.0) as hosts:
        analysis = tune.run(
            hosts.wrap(_train),
            config={"x": 0.5, "steps": 3},
            resources_per_trial=hosts.resources,
            callbacks=[_SlowDriver(hold_s=15.0)],
            storage_path=str(tmp_path),
            verbose=0,
            raise_on_failed_trial=False,
        )
    (trial,) = analysis.trials
    error_file = getattr(trial, "error_file", None)
    assert trial.status == "TERMINATED", error_file and Path(error_file).read_text()[-2000:]
    assert trial.last_result["training_iteration"] == 3
    assert trial.last_result["score"] == pytest.approx(1.5)


def test_wrap_checks_fuse_against_the_trainable() -> None:
    # The trainable is checked before anything needs the hosts: the same errors inside the
    # `with` block, without starting a host here.
    hosts = ww.tune_hosts(trials_per_gpu=1, fuse=2)
    with pytest.raises(TypeError, match=r"trainable=.*a batched trainable, since fuse=2"):
        hosts.wrap(_train)
    with pytest.raises(TypeError, match="batch_key=3"):
        hosts.wrap(_fused_train, batch_key=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fuse=None: must be set"):
        ww.tune_hosts(trials_per_gpu=1).wrap(_fused_train)
    with pytest.raises(RuntimeError, match="wrap\\(\\) needs started hosts"):
        hosts.wrap(_fused_train)  # a right trainable, outside the `with` block


def test_the_hosts_go_with_the_with_block() -> None:
    with ww.tune_hosts(trials_per_gpu=1) as hosts:
        assert len(hosts.stats()) == 1
    with pytest.raises(RuntimeError, match="once the hosts started"):
        _ = hosts.max_concurrent_trials
    deadline = time.monotonic() + 60.0
    while ray.available_resources().get("GPU", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("GPU", 0) == 1  # the host's GPU is given back


def _train_with_torch(config: dict[str, Any]) -> None:
    tune.report({"norm": float(torch.ones(2).norm())})


def test_wrap_pickles_the_trainable_for_the_hosts_alone(tmp_path: Path) -> None:
    # What Tune sends each trial's process: the driver pickled the user's trainable to bytes
    # only its host unpickles, so the trial's process imports neither torch nor the trainable's
    # module (this test module, which Ray pickles by value: tests/conftest.py).
    lock = threading.Lock()

    def holds_a_lock(config: dict[str, Any]) -> None:
        with lock:
            tune.report({"x": config["x"]})

    with ww.tune_hosts(trials_per_gpu=1, cpus_per_trial=0.5) as hosts:
        wrapped = hosts.wrap(_train_with_torch)
        with pytest.raises(TypeError, match=r"trainable=.*holds_a_lock.* cannot be pickled"):
            hosts.wrap(holds_a_lock)
    assert wrapped.__name__ == "_train_with_torch"
    pickled = tmp_path / "trainable.pkl"
    pickled.write_bytes(ray.cloudpickle.dumps(wrapped))
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import pickle, sys; fn = pickle.loads(open(sys.argv[1], 'rb').read());"
            "print(fn.__name__, sorted(m for m in ('torch', 'waterwave_hpo.host') if m in "
            "sys.modules))",
            str(pickled),
        ],
        cwd=tmp_path,  # not the checkout
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["_train_with_torch", "[]"]


def test_wrap_needs_started_hosts_and_a_function() -> None:
    hosts = ww.tune_hosts(trials_per_gpu=2)
    with pytest.raises(RuntimeError, match=r"inside `with ww\.tune_hosts"):
        hosts.wrap(_train)

    class Trainable(tune.Trainable):
        pass

    with pytest.raises(TypeError, match="class trainables cannot be hosted"):
        hosts.wrap(Trainable)
    assert ww_tune.tune_hosts is ww.tune_hosts


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"trials_per_gpu": 0}, ValueError, "trials_per_gpu=0: must be >= 1"),
        ({"trials_per_gpu": "many"}, TypeError, "trials_per_gpu='many': must be an int"),
        ({"cpus_per_trial": -1}, ValueError, "cpus_per_trial=-1"),
        ({"policy": "lifo"}, ValueError, "policy='lifo'"),
        ({"memory_pool": "maybe"}, ValueError, "memory_pool='maybe'"),
        ({"heartbeat_ttl_s": 0}, ValueError, "heartbeat_ttl_s=0"),
        ({"n_hosts": 0}, ValueError, "n_hosts=0: must be >= 1"),
        ({"memory_budget_bytes": 1.5}, TypeError, "memory_budget_bytes=1.5"),
        ({"fuse": 0}, ValueError, "fuse=0: must be >= 1"),
        ({"fuse_wait_s": -1}, ValueError, "fuse_wait_s=-1"),
    ],
)
def test_bad_arguments_name_the_argument(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ww.tune_hosts(**kwargs)
