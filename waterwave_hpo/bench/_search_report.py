"""What the search bench writes: ``search.json``'s fields and the README's tables."""

from __future__ import annotations

from dataclasses import asdict
import statistics
from typing import Any

from waterwave_hpo.bench._search_methods import SearchMethod
from waterwave_hpo.bench._search_results import SearchRun
from waterwave_hpo.bench._search_results import Target

SEARCH_CPU_NOTICE = (
    "CPU-only run: these numbers say nothing about GPUs. On the CPU the concurrent methods "
    "split the cores between their trials (1/K of torch's threads each) and one at a time and "
    "fused keep them all; no CUDA stream, no memory pool, and no GPU's launch-bound small "
    "kernels are measured here."
)

UNITS = {
    "time_to_target_s": "seconds from the search's first ask (null: never within the budget)",
    "best_value_at_budget": "validation accuracy, fraction of 360 digits",
    "budget_s": "seconds",
    "startup_s": "seconds",
    "wall_s": "seconds",
    "trajectory": "[seconds, best validation accuracy so far] at each improvement",
    "trials_completed": "trials that completed within the budget",
    "trials_pruned": "trials the median pruner stopped within the budget",
    "trials_failed": "trials that failed within the budget",
    "trials_past_budget": "trials that ended after the budget (stopped at their next epoch)",
    "k": "trials at once (fused: trials per fused model)",
    "torch_threads": "torch intra-op threads per trial's process",
}


def run_entry(run: SearchRun, target: Target) -> dict[str, Any]:
    """``search.json``'s entry for one search (one method, one seed)."""
    counted = {state: len(run.in_budget(state)) for state in ("COMPLETE", "PRUNED", "FAIL")}
    return {
        "method": run.method,
        "label": SearchMethod(run.method).label,
        "seed": run.seed,
        "available": run.available,
        "skipped_reason": run.skipped_reason,
        "k": run.k,
        "torch_threads": run.torch_threads,
        "budget_s": run.budget_s,
        "startup_s": run.startup_s,
        "wall_s": run.wall_s,
        "load_average_1min_at_start": run.load_average_1min,
        "time_to_target_s": None if target.value is None else run.time_to(target.value),
        "best_value_at_budget": run.best_value_at_budget(),
        "trials_completed": counted["COMPLETE"],
        "trials_pruned": counted["PRUNED"],
        "trials_failed": counted["FAIL"],
        "trials_past_budget": len(run.trials) - sum(counted.values()),
        "trajectory": [list(point) for point in run.trajectory()],
        "trials": [asdict(t) for t in run.trials],
    }


def method_summaries(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method, over its seeds: how many reached the target, medians and ranges."""
    rows = []
    for method in SearchMethod:
        mine = [e for e in entries if e["method"] == method.value]
        if not mine:
            continue
        ran = [e for e in mine if e["available"]]
        times = [e["time_to_target_s"] for e in ran if e["time_to_target_s"] is not None]
        bests = [e["best_value_at_budget"] for e in ran if e["best_value_at_budget"] is not None]
        rows.append(
            {
                "method": method.value,
                "label": method.label,
                "seeds": len(mine),
                "ran": len(ran),
                "skipped_reason": next(
                    (e["skipped_reason"] for e in mine if not e["available"]), ""
                ),
                "with_a_result": len(bests),
                "reached_target": len(times),
                "time_to_target_s_median": _median(times),
                "time_to_target_s_min": min(times, default=None),
                "time_to_target_s_max": max(times, default=None),
                "best_value_at_budget_median": _median(bests),
                "best_value_at_budget_min": min(bests, default=None),
                "best_value_at_budget_max": max(bests, default=None),
                "trials_completed_median": _median([e["trials_completed"] for e in ran]),
                "startup_s_median": _median([e["startup_s"] for e in ran]),
            }
        )
    return rows


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _range(row: dict[str, Any], key: str, spec: str) -> str:
    low, high = row[f"{key}_min"], row[f"{key}_max"]
    if low is None:
        return "-"
    return f"{format(row[f'{key}_median'], spec)} ({format(low, spec)}-{format(high, spec)})"


def readme(payload: dict[str, Any]) -> str:
    """The results folder's ``README.md``: what ran, where, and the tables."""
    machine = payload["machine"]
    config = payload["config"]
    search = payload["search"]
    load_start, load_end = payload["load_average_at_start"], machine["load_average_1_5_15_min"]
    device = machine.get("gpu") or f"{machine['processor']}, {machine['cpu_count']} cores"
    lines = [f"# waterwave-hpo bench --search: {device}, {payload['started_utc'][:16]} UTC", ""]
    if payload["cpu_only"]:
        lines += [f"**{SEARCH_CPU_NOTICE}**", ""]
    lines += [
        "Command: `" + " ".join(payload["command"]) + "`",
        "",
        f"Machine: {machine['platform']}, {device}"
        + (
            f"; load average (1/5/15 min) {_load(load_start)} at the start, {_load(load_end)} "
            "at the end (above the core count: other jobs shared the machine, and the "
            "timings are noisy)"
            if load_end is not None
            else ""
        )
        + ".",
        "",
        f"The search: {search['space']} Sampler: {search['sampler']} Pruner: {search['pruner']} "
        f"Each method ran {config['seeds']} seeds ({', '.join(map(str, payload['seeds']))}), "
        f"K={config['k']}, each search with a trial budget of {config['trials']} and a time "
        f"budget of {search['search_budget_s']:.1f} s ({config['budget_s']:.0f} s over "
        f"{search['searches']} searches); {search['clock']}",
        "",
        f"Target: {payload['target']['description']}.",
        "",
        "| method | seeds run | reached target | time to target s, median (range) | best "
        "accuracy at budget, median (range) | trials completed, median | start-up s, median |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in payload["summary"]:
        if not row["ran"]:
            lines.append(
                f"| {row['label']} | 0 of {row['seeds']} | skipped: {row['skipped_reason']} "
                "| | | | |"
            )
            continue
        lines.append(
            f"| {row['label']} | {row['ran']} of {row['seeds']} | {row['reached_target']} of "
            f"{row['ran']} | {_range(row, 'time_to_target_s', '.1f')} | "
            f"{_range(row, 'best_value_at_budget', '.4f')}{_partial(row)} | "
            f"{_fmt(row['trials_completed_median'], '.0f')} | "
            f"{_fmt(row['startup_s_median'], '.1f')} |"
        )
    lines += [
        "",
        "Every search, one row (seconds on the search's own clock; *past budget*: trials that "
        "were running at the budget and were stopped at their next epoch):",
        "",
        "| method | seed | time to target s | best at budget | completed | pruned | failed | past "
        "budget | start-up s | torch threads | load at start |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in payload["runs"]:
        if not e["available"]:
            lines.append(
                f"| {e['label']} | {e['seed']} | skipped: {e['skipped_reason']} | | | | | | | | |"
            )
            continue
        lines.append(
            f"| {e['label']} | {e['seed']} | {_fmt(e['time_to_target_s'], '.1f')} | "
            f"{_fmt(e['best_value_at_budget'], '.4f')} | {e['trials_completed']} | "
            f"{e['trials_pruned']} | {e['trials_failed']} | {e['trials_past_budget']} | "
            f"{e['startup_s']:.1f} | {e['torch_threads']} | "
            f"{_fmt(e['load_average_1min_at_start'], '.1f')} |"
        )
    lines += [
        "",
        "Files: `search.json` (every number, units under `units`, each search's trajectory and "
        "trials, the machine, versions, the command), `search.png` (best-so-far accuracy "
        "against wall seconds: per method the median over seeds, the band from the lowest to "
        "the highest seed), this README.",
        "",
    ]
    return "\n".join(lines)


def _partial(row: dict[str, Any]) -> str:
    """Which seeds the best-at-budget figures come from, when not all of them completed a trial."""
    if row["with_a_result"] == row["ran"]:
        return ""
    return f", {row['with_a_result']} of {row['ran']} seeds completed a trial"


def _load(load: list[float] | None) -> str:
    return "unknown" if load is None else " / ".join(f"{x:.1f}" for x in load)
