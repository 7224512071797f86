"""shared_gpu() with Ray Tune on a local Ray cluster with one logical GPU (the work runs on the
CPU; Ray's placement is real)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
import pickle
import time
from typing import Any

import pytest

ray = pytest.importorskip("ray")
tune = pytest.importorskip("ray.tune")

from waterwave_hpo.integrations import ray_tune as ww_tune  # noqa: E402

import waterwave_hpo as ww  # noqa: E402

BUDGET = 100  # bytes per logical GPU the leases share in these tests


pytestmark = [
    pytest.mark.usefixtures("ray_cluster"),
]  # tests/conftest.py


def _intervals_overlap(intervals: list[tuple[float, float]]) -> bool:
    ordered = sorted(intervals)
    return any(b[0] < a[1] for a, b in itertools.pairwise(ordered))


def _rendezvous(directory: str, n: int, timeout_s: float = 300.0) -> None:
    # Wait until n trials are running, so "ran at the same time" is not left to luck; a later
    # trial finds them there at once. On a loaded machine Tune starts the next trial's process
    # many seconds later: the deadline is only a backstop.
    Path(directory, f"{os.getpid()}-{time.time_ns()}").touch()
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(directory)) < n and time.monotonic() < deadline:
        time.sleep(0.02)


def _train(config: dict[str, Any]) -> None:
    start = time.time()
    _rendezvous(config["rendezvous"], 2)
    for step in range(1, 4):
        time.sleep(0.1)
        tune.report(
            {
                "score": config["x"] * step,
                "gpu_ids": ",".join(str(i) for i in ray.get_gpu_ids()),
                "start": start,
                "now": time.time(),
            }
        )


def test_shared_gpu_is_a_placement_group_factory_that_pickles() -> None:
    resources = ww.shared_gpu(trials_per_gpu=4, cpus_per_trial=0.5)
    assert isinstance(resources, tune.PlacementGroupFactory)
    assert resources.bundles == [{"CPU": 0.5, "GPU": 0.25}]
    copy = pickle.loads(pickle.dumps(resources))
    assert copy == resources and copy.trials_per_gpu == 4
    auto = ww.shared_gpu(max_trials_per_gpu=8)
    assert auto.auto and auto.bundles == [{"CPU": 1.0, "GPU": 0.125}]
    assert ww.shared_gpu(3).bundles[0]["GPU"] * 3 <= 1.0


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
def test_tune_run_packs_two_trials_on_one_logical_gpu(tmp_path: Path) -> None:
    (tmp_path / "rendezvous").mkdir()
    analysis = tune.run(
        _train,
        config={"x": tune.uniform(0.0, 1.0), "rendezvous": str(tmp_path / "rendezvous")},
        num_samples=4,
        resources_per_trial=ww.shared_gpu(trials_per_gpu=2),
        storage_path=str(tmp_path),
        verbose=0,
        reuse_actors=True,  # what the guide advises; the packing is the same either way
    )
    trials = analysis.trials
    assert [t.status for t in trials] == ["TERMINATED"] * 4
    results = [t.last_result for t in trials]
    assert all(r["training_iteration"] == 3 for r in results)
    assert all(
        r["score"] == pytest.approx(3 * t.config["x"]) for r, t in zip(results, trials, strict=True)
    )
    assert {r["gpu_ids"] for r in results} == {"0"}  # the one logical GPU, shared
    assert _intervals_overlap([(r["start"], r["now"]) for r in results])  # 2 at once on it


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
def test_tuner_with_resources_and_asha_stops_trials(tmp_path: Path) -> None:
    from ray.tune.schedulers import ASHAScheduler

    def train(config: dict[str, Any]) -> None:
        for step in range(1, 9):
            time.sleep(0.05)
            tune.report({"score": config["x"] * step})

    tuner = tune.Tuner(
        tune.with_resources(train, ww.shared_gpu(trials_per_gpu=2)),
        param_space={"x": tune.grid_search([1.0, 0.9, 0.2, 0.1])},
        tune_config=tune.TuneConfig(
            scheduler=ASHAScheduler(
                metric="score", mode="max", max_t=8, grace_period=1, reduction_factor=2
            ),
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0),
    )
    grid = tuner.fit()
    assert grid.num_errors == 0
    iterations = {r.config["x"]: r.metrics["training_iteration"] for r in grid}
    assert iterations[1.0] == 8  # the best ran to max_t
    assert min(iterations.values()) < 8  # ASHA stopped the weak ones early
    assert grid.get_best_result(metric="score", mode="max").config["x"] == 1.0


def _broker_stats() -> tuple[int, int]:
    stats = ww_tune.lease_stats(gpu_id=0)
    return stats.n_held, stats.granted_bytes


def _long_train(config: dict[str, Any]) -> None:
    for step in range(1, 9):
        time.sleep(0.05)
        tune.report({"score": config["x"] * step})


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
@pytest.mark.parametrize("reuse_actors", [False, True])
def test_trials_stopped_by_asha_give_their_leases_back(tmp_path: Path, reuse_actors: bool) -> None:
    # With reuse_actors=True a stopped trial's process lives on and runs the next trial: its
    # lease must be given back, not kept alive by the process's renewals.
    from ray.tune.schedulers import ASHAScheduler

    tuner = tune.Tuner(
        ww_tune.with_shared_gpu(
            _long_train, trials_per_gpu=2, memory_budget_bytes=BUDGET, lease_ttl_s=1.0
        ),
        param_space={"x": tune.grid_search([1.0, 0.9, 0.2, 0.1])},
        tune_config=tune.TuneConfig(
            scheduler=ASHAScheduler(
                metric="score", mode="max", max_t=8, grace_period=1, reduction_factor=2
            ),
            reuse_actors=reuse_actors,
        ),
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0),
    )
    grid = tuner.fit()
    assert grid.num_errors == 0
    assert min(r.metrics["training_iteration"] for r in grid) < 8
    processes = {r.metrics["pid"] for r in grid}  # Tune's own field: the trial's process
    assert len(processes) < len(grid) if reuse_actors else len(processes) == len(grid)
    deadline = time.monotonic() + 120.0  # the stopped trials' leases expire after 1 s
    while _broker_stats() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _broker_stats() == (0, 0)


def _checkpointing(config: dict[str, Any]) -> None:
    import tempfile

    for step in range(1, 3):
        with tempfile.TemporaryDirectory() as directory:
            Path(directory, "state.txt").write_text(str(step))
            tune.report({"score": step}, checkpoint=tune.Checkpoint.from_directory(directory))


def test_results_and_checkpoints_land_where_tune_puts_them(tmp_path: Path) -> None:
    tuner = tune.Tuner(
        ww_tune.with_shared_gpu(_checkpointing, trials_per_gpu=2, memory_budget_bytes=BUDGET),
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


def _leased_train(config: dict[str, Any]) -> None:
    meet = Path(config["meet"])
    resources: Any = config["resources"]
    with resources.lease(nbytes=config["nbytes"]) as lease:
        granted = time.time()
        holding = meet / f"holding-{os.getpid()}"
        holding.touch()  # after `granted`; removed before `released`: a mate that sees it
        # knows both leases were held at that moment, however late either process ran.
        # Hold the lease until a second trial is on the GPU beside us (seen holding) or waits
        # for our lease, or every other trial has ended. The deadline is only a backstop: on a
        # loaded machine Tune starts the next trial's process many seconds later.
        deadline = time.monotonic() + 300.0
        while time.monotonic() < deadline:
            if any(p != holding for p in meet.glob("holding-*")):
                break
            if ww_tune.lease_stats().n_waiting >= 1:
                break
            if len(list(meet.glob("done-*"))) >= config["n_trials"] - 1:
                break
            time.sleep(0.02)
        time.sleep(0.3)
        holding.unlink()
        released = time.time()  # before the lease goes back: a waiting mate is granted after
    (meet / f"done-{os.getpid()}").touch()
    tune.report(
        {
            "granted": granted,
            "released": released,
            "nbytes": lease.nbytes,
            "budget": lease.budget_bytes,
            "waited_s": lease.waited_s,
        }
    )


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
@pytest.mark.parametrize(("nbytes", "overlap"), [(60, False), (50, True)])
def test_memory_leases_keep_co_placed_trials_peaks_apart(
    tmp_path: Path, nbytes: int, overlap: bool
) -> None:
    (tmp_path / "meet").mkdir()
    resources = ww.shared_gpu(trials_per_gpu=2, memory_budget_bytes=BUDGET)
    analysis = tune.run(
        _leased_train,
        config={
            "resources": resources,
            "nbytes": nbytes,
            "meet": str(tmp_path / "meet"),
            "n_trials": 3,
        },
        num_samples=3,
        resources_per_trial=resources,
        storage_path=str(tmp_path),
        verbose=0,
    )
    results = [t.last_result for t in analysis.trials]
    assert [t.status for t in analysis.trials] == ["TERMINATED"] * 3
    assert {(r["nbytes"], r["budget"]) for r in results} == {(nbytes, BUDGET)}
    # Ray placed two trials on the GPU either way; only leases that fit together overlap.
    assert _intervals_overlap([(r["granted"], r["released"]) for r in results]) is overlap
    if not overlap:
        assert max(r["waited_s"] for r in results) > 0.2


def _fails_for_half(config: dict[str, Any]) -> None:
    if config["x"] == 0.5:
        raise ValueError("this trial fails")
    for step in range(2):
        time.sleep(0.05)
        tune.report({"score": config["x"] * step})


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
def test_a_failing_trial_fails_alone_and_releases_its_lease(tmp_path: Path) -> None:
    trainable = ww_tune.with_shared_gpu(
        _fails_for_half, trials_per_gpu=2, memory_budget_bytes=BUDGET, memory_per_trial_bytes=50
    )
    analysis = tune.run(
        trainable,
        config={"x": tune.grid_search([0.25, 0.5, 0.75])},
        storage_path=str(tmp_path),
        raise_on_failed_trial=False,
        verbose=0,
    )
    status = {t.config["x"]: t.status for t in analysis.trials}
    assert status == {0.25: "TERMINATED", 0.5: "ERROR", 0.75: "TERMINATED"}
    assert _broker_stats() == (0, 0)


def test_lease_stats_of_a_gpu_without_a_broker_is_a_lookup_error() -> None:
    with pytest.raises(LookupError, match="No memory broker for GPU 7"):
        ww_tune.lease_stats(gpu_id=7)


def test_lease_outside_a_gpu_trial_says_how_to_place_it() -> None:
    resources = ww.shared_gpu(trials_per_gpu=2)
    with pytest.raises(RuntimeError, match="holds no GPU share"), resources.lease():
        pass


def test_wrap_rejects_a_class_trainable() -> None:
    with pytest.raises(TypeError, match="function trainable"):
        ww.shared_gpu(2).wrap(tune.Trainable)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"trials_per_gpu": 0}, ValueError, "trials_per_gpu=0: must be >= 1"),
        ({"trials_per_gpu": "many"}, TypeError, "trials_per_gpu='many': must be an int"),
        ({"trials_per_gpu": 2.5}, TypeError, "trials_per_gpu=2.5"),
        ({"cpus_per_trial": -1}, ValueError, "cpus_per_trial=-1"),
        ({"memory_budget_bytes": 0}, ValueError, "memory_budget_bytes=0"),
        ({"max_trials_per_gpu": 0}, ValueError, "max_trials_per_gpu=0"),
        (
            {"memory_budget_bytes": 10, "memory_per_trial_bytes": 20},
            ValueError,
            "memory_per_trial_bytes=20: is more than memory_budget_bytes=10",
        ),
        ({"lease_ttl_s": 0}, ValueError, "lease_ttl_s=0"),
    ],
)
def test_bad_arguments_name_the_argument(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ww.shared_gpu(**kwargs)
