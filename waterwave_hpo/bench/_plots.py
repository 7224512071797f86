"""The bench's pictures: throughput bars, memory per trial over time, a Gantt of trials.

matplotlib through ``Figure`` and the Agg canvas only (no pyplot global state).
"""

from __future__ import annotations

from pathlib import Path

from waterwave_hpo.bench._methods import Method
from waterwave_hpo.bench._results import MethodResult
from waterwave_hpo.bench._runners import MethodRun

_COLOURS = {
    Method.TEMPORAL: "#757575",
    Method.OPTUNA_THREADS: "#1e88e5",
    Method.SPATIAL: "#8e24aa",
    Method.CUDA_MALLOC_ASYNC: "#f4511e",
    Method.WATERWAVE_FIFO: "#7cb342",
    Method.WATERWAVE: "#2e7d32",
    Method.WATERWAVE_PLANS: "#00897b",
    Method.FUSED: "#fdd835",
}


def _figure(width: float, height: float):  # type: ignore[no-untyped-def]
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def plot_throughput(results: list[MethodResult], path: Path, title: str) -> Path:
    """Bars of samples/s per method, one panel per workload and setting.

    Bars of samples/s per method, one panel per workload and setting; a method that is not
    available on the device is marked "n/a"; labels give the ratio to temporal sharing.
    """
    keys = sorted({(r.workload, r.setting) for r in results}, key=lambda k: (k[0], k[1] != "light"))
    cols = min(2, len(keys)) or 1
    rows = (len(keys) + cols - 1) // cols
    figure = _figure(6.5 * cols, 3.2 * max(1, rows))
    methods = [m for m in Method if any(r.method == m.value for r in results)]
    for i, key in enumerate(keys):
        axes = figure.add_subplot(rows, cols, i + 1)
        by_method = {r.method: r for r in results if (r.workload, r.setting) == key}
        for j, m in enumerate(methods):
            r = by_method.get(m.value)
            if r is None or not r.available or r.samples_per_s is None:
                axes.text(j, 0, "n/a", ha="center", va="bottom", fontsize=8, color="#9e9e9e")
                continue
            axes.bar(j, r.samples_per_s, color=_COLOURS[m])
            label = f"{r.ratio_to_temporal:.2f}x" if r.ratio_to_temporal else ""
            if r.failed_trials:
                label += f"\n{r.failed_trials} failed"
            axes.text(j, r.samples_per_s, label, ha="center", va="bottom", fontsize=7)
        axes.set_xticks(range(len(methods)), [m.label for m in methods], rotation=30, ha="right")
        axes.tick_params(axis="x", labelsize=7)
        axes.set_ylabel("samples / s")
        axes.set_title(f"{key[0]}, {key[1]} memory demand", fontsize=9)
        axes.margins(y=0.2)
    figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=110)
    return path


def plot_memory(runs: list[MethodRun], path: Path, title: str) -> Path:
    """Per-trial memory over time (bytes), one panel per run.

    Per-trial memory over time (bytes), one panel per run: the pool's per-stream bytes on
    CUDA or the scheduler's ledger on the CPU for waterwave; a run with nothing measurable
    per trial (the stock allocator shares one cache among threads) says so in its panel.
    """
    figure = _figure(11, 2.6 * max(1, len(runs)))
    for i, run in enumerate(runs):
        axes = figure.add_subplot(len(runs), 1, i + 1)
        measured = [r for r in run.records if r.memory]
        for r in measured:
            t = [s - run.start_s for s, _ in r.memory]
            b = [x / 2**20 for _, x in r.memory]
            axes.step(t, b, where="post", linewidth=0.9, label=f"trial {r.index}")
        if not measured:
            axes.text(
                0.5,
                0.5,
                "per-trial memory not measurable for this method on this device"
                if run.available
                else run.note,
                transform=axes.transAxes,
                ha="center",
                va="center",
                fontsize=8,
                color="#616161",
            )
        elif len(measured) <= 12:
            axes.legend(fontsize=6, loc="upper right", ncol=2)
        axes.set_ylabel("MiB")
        axes.set_title(
            f"{run.method.label} - {run.spec.workload.value}, {run.spec.setting.value}",
            fontsize=9,
        )
    figure.axes[-1].set_xlabel("seconds since the method started")
    figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=110)
    return path


def plot_gantt(runs: list[MethodRun], path: Path, title: str) -> Path:
    """Each attempt as a bar on its worker's row, one panel per method.

    Each attempt as a bar on its worker's row, one panel per method (green complete, red
    failed); the x axis is seconds since that method started.
    """
    shown = [r for r in runs if r.available]
    figure = _figure(11, 1.0 + 1.1 * sum(max(1, r.k) for r in shown) / 2 + 0.6 * len(shown))
    for i, run in enumerate(shown):
        axes = figure.add_subplot(len(shown), 1, i + 1)
        for rec in run.records:
            start = rec.start_s - run.start_s
            axes.barh(
                rec.slot,
                max(rec.end_s - rec.start_s, 1e-3),
                left=start,
                height=0.7,
                color="#2e7d32" if rec.complete else "#c62828",
                edgecolor="white",
                linewidth=0.5,
            )
            axes.text(
                start + (rec.end_s - rec.start_s) / 2,
                rec.slot,
                str(rec.index),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
                clip_on=True,
            )
        axes.set_yticks(range(run.k), [f"worker {s}" for s in range(run.k)], fontsize=7)
        axes.invert_yaxis()
        axes.set_xlim(0, max(run.makespan_s, 1e-3))
        axes.set_title(f"{run.method.label}: {run.makespan_s:.2f} s", fontsize=9)
    if shown:
        figure.axes[-1].set_xlabel("seconds since the method started")
    figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=110)
    return path
