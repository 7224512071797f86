"""A Gantt chart of trials over time, one row per device slot; a fused batch as its trials."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
import os
from pathlib import Path

from optuna.trial import FrozenTrial
from optuna.trial import TrialState

from waterwave_hpo import _checks
from waterwave_hpo.executor import trial_attr
from waterwave_hpo.host import ATTR_BATCH
from waterwave_hpo.host import ATTR_DEVICE
from waterwave_hpo.host import ATTR_SLOT
from waterwave_hpo.report._concurrency import check_trials

# What plot_timeline writes in its PNGs' Software text chunk, to know its own file again.
_MARK = "waterwave-hpo report.plot_timeline"
_COLOURS = {
    TrialState.COMPLETE: "#2e7d32",
    TrialState.PRUNED: "#f9a825",
    TrialState.FAIL: "#c62828",
}


def plot_timeline(
    trials: Iterable[FrozenTrial], path: str | Path, title: str = "", *, overwrite: bool = False
) -> Path:
    """Draw each finished trial as a bar from its start to its end, on its device slot's row.

    Rows are labelled ``<device> / slot <k>`` from the ``waterwave:device`` and ``waterwave:slot``
    system attributes that ``WaterwaveExecutor(record_trial_attrs=True)`` sets; trials without
    them (run without it, or by plain ``study.optimize``) share one row. Bars are coloured by
    state (complete, pruned, failed) and labelled with the trial number. A fused batch
    (``WaterwaveExecutor(fuse=K)``, the ``waterwave:batch`` attribute) is drawn as its trials:
    its slot's row is split into one thin row per trial, each with the trial's own state and
    end. Time is in seconds from the first start.

    A file already at ``path`` is replaced only when it is empty or a PNG this function wrote
    (it marks its PNGs in their ``Software`` text chunk); any other file, which may be the
    user's, is refused unless ``overwrite=True``.

    Args:
        trials: The trials to draw; those not finished are skipped.
        path: Where to write the PNG.
        title: The figure's title.
        overwrite: Replace whatever file is at ``path``.

    Returns:
        The path written.

    Raises:
        TypeError: If ``path`` is not a ``str`` or ``Path``, or ``overwrite`` not a bool.
        IsADirectoryError: If ``path`` is a directory.
        FileNotFoundError: If ``path``'s directory does not exist.
        FileExistsError: If a file at ``path`` is neither empty nor a timeline this function
            wrote, and ``overwrite`` is ``False`` (nothing is written).
    """
    if not isinstance(overwrite, bool):
        raise _checks.type_error("overwrite", overwrite, "a bool", "pass True or False")
    out = _check_output(path, overwrite)
    trials = check_trials("trials", trials)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    bars = timeline_bars(trials)
    rows = sorted({bar.row for bar in bars}, key=_row_order)
    figure = Figure(figsize=(10, 1.2 + 0.45 * max(1, len(rows))), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for bar in bars:
        axes.barh(
            bar.y,
            bar.width_s,
            left=bar.left_s,
            height=bar.height,
            color=_COLOURS.get(bar.state, "#757575"),
            edgecolor="white",
            linewidth=0.5 if bar.height > 0.3 else 0.2,
        )
        axes.text(
            bar.left_s + bar.width_s / 2,
            bar.y,
            str(bar.number),
            ha="center",
            va="center",
            fontsize=7 if bar.height > 0.3 else max(3.0, 20 * bar.height),
            color="white",
            clip_on=True,
        )
    axes.set_yticks(range(len(rows)), [_label(row) for row in rows])
    finished = {bar.number for bar in bars}
    axes.invert_yaxis()
    axes.set_xlabel("seconds since the first trial started")
    axes.set_title(title or f"{len(finished)} trials")
    axes.grid(axis="x", alpha=0.3)
    axes.legend(
        handles=[Patch(color=c, label=s.name.lower()) for s, c in _COLOURS.items()],
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=8,
        frameon=False,
    )
    # The format by the suffix, PNG without one (matplotlib would then append ".png" to a
    # name that is not the one checked and returned).
    file_format = out.suffix[1:].lower() or "png"
    figure.savefig(out, dpi=120, format=file_format, metadata=_metadata(file_format))
    return out


def _metadata(file_format: str) -> dict[str, str] | None:
    """``savefig``'s metadata that marks a PNG as this function's (other formats: none)."""
    if file_format != "png":
        return None
    import matplotlib

    return {"Software": f"{_MARK} (Matplotlib {matplotlib.__version__})"}


def _written_here(path: Path) -> bool:
    """Whether ``path`` is a PNG whose ``Software`` text chunk is :data:`_MARK`'s."""
    from PIL import Image  # a dependency of matplotlib

    try:
        with Image.open(path) as image:
            software = image.info.get("Software") if image.format == "PNG" else None
    except (OSError, SyntaxError, ValueError):  # not an image Pillow reads
        return False
    return isinstance(software, str) and software.startswith(f"{_MARK} ")


def _check_output(path: object, overwrite: bool) -> Path:
    """``path`` as a PNG file path whose directory exists (checked before drawing)."""
    if not isinstance(path, (str, Path)):
        raise _checks.type_error("path", path, "a str or Path", "pass e.g. 'timeline.png'")
    out = Path(path)
    if out.is_dir():
        raise IsADirectoryError(
            _checks.message(
                "path",
                str(path),
                "is a directory",
                f"pass a file in it, e.g. {str(out / 'timeline.png')!r}",
            )
        )
    if not out.parent.is_dir():
        raise FileNotFoundError(
            _checks.message(
                "path",
                str(path),
                f"its directory {str(out.parent)!r} does not exist",
                "create it first, or pass a path in an existing directory",
            )
        )
    if overwrite or not os.path.lexists(out):
        return out
    if out.is_symlink() or not out.is_file():
        problem = "exists and is not a regular file"
    elif out.stat().st_size == 0 or _written_here(out):
        return out  # nothing to lose, or this function's own timeline
    else:
        problem = "exists and is not a timeline plot_timeline wrote (it may be yours)"
    raise FileExistsError(
        _checks.message(
            "path",
            str(path),
            f"{problem}; nothing was written",
            "pass a new path, or overwrite=True to replace it",
        )
    )


@dataclass(frozen=True)
class TimelineBar:
    """One trial's bar: on row ``y`` (thin, within its slot's row, for a fused batch)."""

    number: int
    state: TrialState
    row: tuple[str, int | None]
    y: float
    height: float
    left_s: float
    width_s: float


def timeline_bars(trials: Iterable[FrozenTrial]) -> list[TimelineBar]:
    """The bars :func:`plot_timeline` draws: one per finished trial, in the order given.

    A slot's row ``r`` spans ``r - 0.35 .. r + 0.35``; a fused batch of ``K`` trials splits it
    into ``K`` rows of height ``0.7 / K``, the batch's ``i``-th trial on the ``i``-th from the
    top, so each trial of the batch shows its own state and end.
    """
    finished = [
        t
        for t in trials
        if t.datetime_start is not None
        and t.datetime_complete is not None
        and t.state.is_finished()
    ]
    rows = sorted({_row(t) for t in finished}, key=_row_order)
    index = {row: i for i, row in enumerate(rows)}
    t0 = min((t.datetime_start.timestamp() for t in finished), default=0.0)  # type: ignore[union-attr]
    bars = []
    for trial in finished:
        start = trial.datetime_start.timestamp() - t0  # type: ignore[union-attr]
        width = max(trial.datetime_complete.timestamp() - t0 - start, 1e-3)  # type: ignore[union-attr]
        row = _row(trial)
        y, height = float(index[row]), 0.7
        batch = trial_attr(trial, ATTR_BATCH)
        if isinstance(batch, list) and len(batch) > 1 and trial.number in batch:
            height = 0.7 / len(batch)
            y = index[row] - 0.35 + height * (batch.index(trial.number) + 0.5)
        bars.append(TimelineBar(trial.number, trial.state, row, y, height, start, width))
    return bars


def _row_order(row: tuple[str, int | None]) -> tuple[str, int]:
    return row[0], -1 if row[1] is None else row[1]


def _row(trial: FrozenTrial) -> tuple[str, int | None]:
    device = str(trial_attr(trial, ATTR_DEVICE, "trials"))
    slot = trial_attr(trial, ATTR_SLOT)
    return device, None if slot is None else int(slot)


def _label(row: tuple[str, int | None]) -> str:
    device, slot = row
    return device if slot is None else f"{device} / slot {slot}"
