"""search.json's per-method summary: medians over the seeds that have a figure, and how many."""

from __future__ import annotations

from waterwave_hpo.bench import SearchRun
from waterwave_hpo.bench import Target
from waterwave_hpo.bench import TrialOutcome
from waterwave_hpo.bench._search_report import method_summaries
from waterwave_hpo.bench._search_report import run_entry


def _run(seed: int, *values_at: tuple[float, float], method: str = "fused") -> SearchRun:
    trials = [TrialOutcome(n, "COMPLETE", v, 0.0, t) for n, (t, v) in enumerate(values_at)]
    return SearchRun(method, seed, 4, 20.0, trials=trials)


def test_a_method_is_summarized_over_its_seeds_and_says_how_many_had_a_result() -> None:
    runs = [
        _run(0, (5.0, 0.90), (8.0, 0.97)),
        _run(1, (12.0, 0.98)),
        _run(2),  # completed nothing within its budget
        _run(0, (1.0, 0.99), method="temporal"),
        SearchRun("optuna-threads", 0, 4, 20.0, available=False, skipped_reason="no room"),
    ]
    target = Target.of(runs, 0.98)  # 0.98 * 0.99 = 0.9702
    rows = {row["method"]: row for row in method_summaries([run_entry(r, target) for r in runs])}
    fused = rows["fused"]
    assert (fused["seeds"], fused["ran"], fused["with_a_result"]) == (3, 3, 2)
    assert fused["reached_target"] == 1 and fused["time_to_target_s_median"] == 12.0
    assert fused["best_value_at_budget_median"] == (0.97 + 0.98) / 2
    assert (fused["best_value_at_budget_min"], fused["best_value_at_budget_max"]) == (0.97, 0.98)
    assert fused["trials_completed_median"] == 1
    assert rows["temporal"]["time_to_target_s_median"] == 1.0
    skipped = rows["optuna-threads"]
    assert skipped["ran"] == 0 and skipped["skipped_reason"] == "no room"
    assert list(rows) == ["temporal", "optuna-threads", "fused"]  # the methods' order
