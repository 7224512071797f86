"""Open the demo's journal (``study.log``) by absolute path, under a holder-naming lock, checked.

Nothing is appended to a journal before :func:`check_journal` has read it whole.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
import re
import shutil
import time

from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from waterwave_hpo.demo._lock import LOCK_SUFFIX
from waterwave_hpo.demo._lock import HolderNamingJournalFileLock

_logger = logging.getLogger("waterwave_hpo.demo")

# Staging files of a lock acquisition cut by a kill (see _lock.py) older than this are removed.
_STALE_STAGING_S = 60.0


class JournalDamagedError(ValueError):
    """The journal has a line that is not one of Optuna's journal records.

    The journal has a line that is not one of Optuna's journal records, other than a cut last
    line (which is repaired). Nothing was appended to it.
    """


def check_journal(path: Path) -> str | None:
    r"""Check every line of an Optuna journal file and repair a cut last line.

    A hard kill (``kill -9``, power loss) can cut only the last write, which Optuna does as one
    ``write`` of whole lines under the lock: the file then ends in a line without its ``\n``.
    Optuna's reader skips that line, but the next append would glue a record onto it and make the
    journal unreadable. Such a last line is cut off (the whole file is first copied to
    ``<path>.damaged-<time>``). Call this while holding the journal's lock: a neighbour's append
    in progress would look like a cut line.

    Args:
        path: The journal file (it may not exist yet).

    Returns:
        A message saying what was repaired and where the backup is, or ``None`` if the journal was
        whole.

    Raises:
        JournalDamagedError: If any other line is not a JSON journal record, naming the file, the
            line and the fix.
    """
    path = Path(path)
    if not path.exists():
        return None
    data = path.read_bytes()
    lines = data.split(b"\n")
    # data ends with b"\n" for a whole journal, so the last element is b"" then.
    for number, line in enumerate(lines[:-1], start=1):
        if not _is_record(line):
            preview = line[:80].decode("utf-8", errors="replace")
            raise JournalDamagedError(
                f"{path}, line {number} of {len(lines) - 1} is not an Optuna journal record "
                f"({preview!r}). The demo appends nothing to a damaged journal. Fix: keep a copy, "
                f"then delete that line (its change to the study is lost) or restore {path.name} "
                "from a backup; or start a new study with another --out."
            )
    cut = lines[-1]
    if not cut:
        return None
    backup = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
    with open(backup, "xb") as copy:  # "x": never over an existing file
        copy.write(data)
    shutil.copystat(path, backup)
    with open(path, "r+b") as journal:
        journal.truncate(len(data) - len(cut))
        journal.flush()
        os.fsync(journal.fileno())
    return (
        f"{path} ended in a cut line ({len(cut)} bytes, the last write of a process that was "
        f"killed while appending; Optuna never read it). Removed it; the file as it was is "
        f"kept in {backup}."
    )


def _is_record(line: bytes) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and "op_code" in record


def open_journal(path: str | os.PathLike[str], grace_period_s: float = 30.0) -> JournalStorage:
    """Open (or create) an Optuna journal file storage the demo can resume after any kill.

    The path is made absolute, the lock is a :class:`HolderNamingJournalFileLock` (a lock left
    by a dead process is released at once, with a warning), and the file is checked by
    :func:`check_journal` under that lock before Optuna reads it.

    Args:
        path: The journal file, e.g. ``<out>/study.log``.
        grace_period_s: Seconds before a lock whose holder cannot be checked (on another host) is
            forcibly released.

    Returns:
        A ``JournalStorage`` over the file.

    Raises:
        JournalDamagedError: If the journal is damaged beyond a cut last line.
    """
    journal = Path(path).absolute()
    if journal.is_dir():
        raise IsADirectoryError(
            f"path={str(path)!r}: is a directory, not a journal file; pass a file inside it, "
            f"e.g. {str(journal / 'study.log')!r}"
        )
    lock = HolderNamingJournalFileLock(journal, grace_period_s=grace_period_s)
    _remove_cut_staging_files(journal)
    lock.acquire()
    try:
        repaired = check_journal(journal)
    finally:
        lock.release()
    if repaired is not None:
        _logger.warning("%s", repaired)
    return JournalStorage(JournalFileBackend(str(journal), lock_obj=lock))


def _remove_cut_staging_files(journal: Path) -> None:
    # Only names the lock makes (<journal>.lock.<uuid hex>.tmp|released|broken): a user's file
    # of another name, e.g. study.log.lock.bak, is never removed.
    own = re.compile(
        re.escape(journal.name + LOCK_SUFFIX) + r"\.[0-9a-f]{32}\.(tmp|released|broken)"
    )
    now = time.time()
    for staging in journal.parent.glob(f"{journal.name}{LOCK_SUFFIX}.*"):
        if own.fullmatch(staging.name) is None:
            continue
        with contextlib.suppress(OSError):
            if now - staging.lstat().st_mtime > _STALE_STAGING_S:
                staging.unlink()
