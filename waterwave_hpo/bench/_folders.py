"""The folder a bench writes its results into, claimed before anything runs."""

from __future__ import annotations

from collections.abc import Sequence
import datetime
from pathlib import Path

from waterwave_hpo import _checks
from waterwave_hpo._owned_files import OwnedFolder
from waterwave_hpo._owned_files import claim_folder


def claim_results_folder(
    out: Path | None, default: Path, kind: str, names: Sequence[str]
) -> OwnedFolder:
    """The results folder, claimed before anything runs (:mod:`waterwave_hpo._owned_files`).

    Args:
        out: The folder the user named: refused (:class:`ForeignFileError`) if it holds a
            file of one of ``names`` that an earlier run of ``kind`` did not write.
            ``None``: a new folder ``default``, or ``default-2``, ``-3``, ... when that one
            exists, so a second run on the same day never replaces the first.
        default: The folder to create when ``out`` is ``None``, e.g.
            ``experiments/results/<date>-<device>``.
        kind: What writes it (``bench``, ``search-bench``); a folder of another kind is
            refused.
        names: Every file the run may write there (beside the manifest).

    Raises:
        ForeignFileError: ``out`` holds a file of ``names`` that is not the project's.
        ValueError: ``default`` and its 998 numbered variants all exist.
        OSError: The folder cannot be created or written.
    """
    if out is not None:
        return claim_folder(out, kind=kind, names=names)
    for attempt in range(1, 1000):
        candidate = default if attempt == 1 else default.with_name(f"{default.name}-{attempt}")
        try:
            return claim_folder(candidate, kind=kind, names=names, fresh=True)
        except FileExistsError:
            continue
    raise _checks.value_error(
        "out", None, f"{default}-2 to {default}-999 all exist", "pass a results folder with --out"
    )


def default_folder(started: datetime.datetime, tag: str) -> Path:
    """``experiments/results/<date>-<tag>`` (relative to the working directory), the date UTC."""
    return Path("experiments/results") / f"{started:%Y-%m-%d}-{tag}"
