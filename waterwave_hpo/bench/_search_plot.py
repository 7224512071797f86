"""The search bench's picture: best-so-far validation accuracy against wall seconds."""

from __future__ import annotations

import math
from pathlib import Path
import statistics

from waterwave_hpo.bench._plots import _figure
from waterwave_hpo.bench._search_methods import SearchMethod
from waterwave_hpo.bench._search_results import SearchRun
from waterwave_hpo.bench._search_results import Target

_COLOURS = {
    SearchMethod.TEMPORAL: "#757575",
    SearchMethod.OPTUNA_THREADS: "#1e88e5",
    SearchMethod.EXECUTOR_THREADS: "#2e7d32",
    SearchMethod.EXECUTOR_PROCESS: "#8e24aa",
    SearchMethod.FUSED: "#f9a825",
}
_GRID_POINTS = 200


def best_at(run: SearchRun, seconds: float) -> float:
    """The run's best validation accuracy at ``seconds`` on its clock (NaN before its first)."""
    best = math.nan
    for t, value in run.trajectory():
        if t > seconds:
            break
        best = value
    return best


def plot_search(runs: list[SearchRun], target: Target, path: Path, title: str) -> Path:
    """One line per method: the median over seeds of the best-so-far accuracy, and its spread.

    The line is drawn where every seed of the method has a completed trial (the median of
    all of them); the shaded band spans the lowest to the highest seed wherever any has one.
    The target is a dashed line. The x axis is seconds since each search's first ask, up to
    its budget.
    """
    figure = _figure(8, 4.8)
    axes = figure.add_subplot(1, 1, 1)
    budget = max((r.budget_s for r in runs), default=1.0)
    grid = [budget * i / (_GRID_POINTS - 1) for i in range(_GRID_POINTS)]
    lowest = 1.0
    for method in SearchMethod:
        mine = [r for r in runs if r.method == method.value and r.available]
        if not mine:
            continue
        colour = _COLOURS[method]
        columns = [[best_at(r, t) for r in mine] for t in grid]
        known = [[v for v in column if not math.isnan(v)] for column in columns]
        median = [
            statistics.median(column) if len(column) == len(mine) else math.nan for column in known
        ]
        low = [min(column) if column else math.nan for column in known]
        high = [max(column) if column else math.nan for column in known]
        label = f"{method.label} ({len(mine)} seed{'s' if len(mine) > 1 else ''})"
        axes.fill_between(grid, low, high, color=colour, alpha=0.18, linewidth=0, step="post")
        axes.step(grid, median, where="post", color=colour, linewidth=1.8, label=label)
        finite = [v for v in low if not math.isnan(v)]
        if finite:
            lowest = min(lowest, finite[len(finite) // 2])  # the band's middle, not its start
    if target.value is not None:
        axes.axhline(target.value, color="#c62828", linestyle="--", linewidth=1.0)
        axes.text(
            0, target.value, f" target {target.value:.4f}", va="bottom", fontsize=8, color="#c62828"
        )
        lowest = min(lowest, target.value)
    axes.set_xlim(0, budget)
    axes.set_ylim(max(0.0, lowest - 0.05), 1.0)
    axes.set_xlabel("wall seconds since the search's first trial was asked")
    axes.set_ylabel("best validation accuracy so far")
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=8, loc="lower left")
    else:
        axes.text(0.5, 0.5, "no search ran", transform=axes.transAxes, ha="center")
    axes.set_title(title, fontsize=9)
    figure.savefig(path, dpi=110)
    return path
