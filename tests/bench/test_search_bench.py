"""``waterwave-hpo bench --search`` at toy scale: search.json's fields, its times, the plot."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from waterwave_hpo.bench import SEARCH_FILES
from waterwave_hpo.bench import SearchConfig
from waterwave_hpo.bench import SearchMethod
from waterwave_hpo.bench import SearchSettings
from waterwave_hpo.bench import run_search_bench
from waterwave_hpo.cli import main

TRIALS = 3
RUN_FIELDS = {
    "method",
    "label",
    "seed",
    "available",
    "skipped_reason",
    "k",
    "torch_threads",
    "budget_s",
    "startup_s",
    "wall_s",
    "load_average_1min_at_start",
    "time_to_target_s",
    "best_value_at_budget",
    "trials_completed",
    "trials_pruned",
    "trials_failed",
    "trials_past_budget",
    "trajectory",
    "trials",
}


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # Each search ends at its trial budget (3 trials of one epoch) long before its time budget
    # (60 s), so the outcome does not depend on how busy the machine is. One torch thread: this
    # process's OpenMP threads spin while idle, which on a busy machine slows two threads
    # 10x (the command line's searches run in processes where they sleep).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    config = SearchConfig(
        out=tmp_path_factory.mktemp("search"),
        device="cpu",
        k=2,
        seeds=1,
        trials=TRIALS,
        epochs=1,
        budget_s=60.0 * len(SearchMethod),
        isolate=False,
        command=("test",),
    )
    try:
        return run_search_bench(config, log=lambda line: None)
    finally:
        torch.set_num_threads(threads)


def test_every_method_and_seed_has_its_fields(bench: Any) -> None:
    data = json.loads((bench.out / "search.json").read_text())
    assert data["command"] == ["test"] and data["cpu_only"] is True
    assert {"machine", "versions", "units", "target", "search", "summary"} <= set(data)
    assert data["machine"]["cpu_count"] == os.cpu_count() and data["versions"]["optuna"]
    assert [(r["method"], r["seed"]) for r in data["runs"]] == [(m.value, 0) for m in SearchMethod]
    for run in data["runs"]:
        assert set(run) == RUN_FIELDS
        assert run["available"], run["skipped_reason"]
        assert run["budget_s"] == 60.0
        # The trial budget ended the search: every trial ended within the time budget.
        assert len(run["trials"]) == TRIALS and run["trials_past_budget"] == 0
        assert run["trials_completed"] + run["trials_pruned"] + run["trials_failed"] == TRIALS
        assert run["trials_completed"] >= 1 and run["best_value_at_budget"] is not None
    assert [row["method"] for row in data["summary"]] == [m.value for m in SearchMethod]
    fused = next(r for r in data["runs"] if r["method"] == "fused")
    first, second = (fused["trials"][n]["params"] for n in (0, 1))  # one batch of K=2
    assert {k: v for k, v in first.items() if k not in ("lr", "dropout")} == {
        k: v for k, v in second.items() if k not in ("lr", "dropout")
    }


def _best_so_far(run: dict[str, Any]) -> list[list[float]]:
    # Recomputed from the trials, independently of the bench's own trajectory.
    done = [t for t in run["trials"] if t["state"] == "COMPLETE" and t["end_s"] <= run["budget_s"]]
    points: list[list[float]] = []
    for t in sorted(done, key=lambda t: t["end_s"]):
        if not points or t["value"] > points[-1][1]:
            points.append([t["end_s"], t["value"]])
    return points


def test_time_to_target_is_where_the_trajectory_first_reaches_the_target(bench: Any) -> None:
    data = json.loads((bench.out / "search.json").read_text())
    target = data["target"]
    bests = [r["best_value_at_budget"] for r in data["runs"]]
    assert target["fraction"] == 0.99 and target["best_any_run"] == max(bests)
    assert target["value"] == pytest.approx(0.99 * max(bests))
    reached = 0
    for run in data["runs"]:
        trajectory = run["trajectory"]
        assert trajectory == _best_so_far(run)
        assert run["best_value_at_budget"] == trajectory[-1][1]
        first = next((t for t, best in trajectory if best >= target["value"]), None)
        assert run["time_to_target_s"] == first
        reached += first is not None
    # The best search reached its own target; the summary counts each method's.
    assert reached >= 1
    assert sum(row["reached_target"] for row in data["summary"]) == reached


def test_the_plot_and_the_readme_are_beside_it(bench: Any) -> None:
    assert sorted(p.name for p in bench.out.iterdir()) == sorted(
        [*SEARCH_FILES, "waterwave-run.json"]
    )
    assert (bench.out / "search.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    readme = (bench.out / "README.md").read_text()
    assert "CPU-only run" in readme and "| method | seeds run | reached target |" in readme
    for method in SearchMethod:
        assert f"| {method.label} | 1 of 1 |" in readme


def test_the_command_line_runs_the_search_bench_with_its_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import waterwave_hpo.bench as bench_package

    seen: list[SearchConfig] = []
    monkeypatch.setattr(bench_package, "run_search_bench", lambda config: seen.append(config))
    args = ["bench", "--search", "--device", "cpu", "--budget-s", "300", "--out", str(tmp_path)]
    assert main(args) == 0
    (config,) = seen
    assert (config.seeds, config.trials, config.epochs, config.k) == (3, 100, 5, 4)
    assert config.target_fraction == 0.99 and config.isolate
    assert config.methods == tuple(SearchMethod) and config.search_budget_s == 20.0
    assert config.command[:2] == ("waterwave-hpo", "bench") or config.command[0] == "waterwave-hpo"


def test_a_method_that_cannot_start_here_is_recorded_as_skipped_with_the_reason(
    tmp_path: Path,
) -> None:
    config = SearchConfig(
        out=tmp_path,
        device="cpu",
        k=1000,  # worker processes this machine has no memory for: refused up front
        methods=(SearchMethod.EXECUTOR_PROCESS,),
        seeds=1,
        trials=1,
        epochs=1,
        budget_s=1.0,
        isolate=False,
    )
    result = run_search_bench(config, log=lambda line: None)
    (run,) = json.loads((tmp_path / "search.json").read_text())["runs"]
    assert not run["available"] and "host memory" in run["skipped_reason"]
    assert run["trials"] == [] and run["time_to_target_s"] is None
    assert result.target.value is None
    readme = (tmp_path / "README.md").read_text()
    assert '| executor, isolation="process" | 0 of 1 | skipped: ValueError: ' in readme
    assert (tmp_path / "search.png").exists()


@pytest.mark.slow
def test_a_search_runs_in_a_process_of_its_own() -> None:
    from waterwave_hpo.bench._search_children import search_processes

    settings = SearchSettings(device="cpu", k=2, trials=1, epochs=1, budget_s=60.0)
    policy = os.environ.get("OMP_WAIT_POLICY")
    with search_processes() as run:
        result = run(SearchMethod.TEMPORAL, 0, settings)
    assert os.environ.get("OMP_WAIT_POLICY") == policy
    assert result.available and [t.state for t in result.trials] == ["COMPLETE"]
