"""A journal file lock that names its holder, so a lock left by a dead process is released.

Optuna's :class:`~optuna.storages.journal.JournalFileSymlinkLock` (the default of
``JournalFileBackend``) breaks a lock only after ``grace_period`` seconds without a change of the
lock's ``mtime``, read through the symbolic link: with a relative journal path the link dangles,
``os.stat`` fails and Optuna 5.0's wait loop retries forever without sleeping. This lock
is the same file name (``<journal>.lock``), created atomically with its holder's identity in it,
so a process that finds it can tell at once whether the holder is gone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
import time
import uuid

from optuna.storages.journal._file import BaseJournalFileLock  # not re-exported by Optuna

from waterwave_hpo import _checks
from waterwave_hpo.demo._process import ProcessIdentity
from waterwave_hpo.demo._process import this_process

_logger = logging.getLogger("waterwave_hpo.demo")

LOCK_SUFFIX = ".lock"
_POLL_S = 0.01
_MAX_POLL_S = 0.2
_WARNING_INTERVAL_S = 10.0


class HolderNamingJournalFileLock(BaseJournalFileLock):
    """Mutual exclusion for appends to a journal file, safe after ``kill -9`` of the holder.

    The lock is the file ``<journal>.lock``. Acquiring links a fully written file holding the
    holder's :class:`ProcessIdentity` to that name (``os.link`` is atomic and fails if the name
    exists), so the lock never exists without its holder's name. A waiter reads the name:

    - holder on this host and gone (its pid has exited or belongs to a newer process): the lock
      is released at once, with a warning naming the process and how long the lock was held;
    - anything else (a live holder, a holder on another host, Optuna's own symbolic-link lock
      from a plain ``optuna`` process on the same journal): released only after
      ``grace_period_s`` without a change, as Optuna does, judged by the lock's own ``lstat``
      time, so a dangling link cannot stall the wait.

    The two kinds of lock exclude each other: ``os.symlink`` and ``os.link`` both fail on an
    existing name.

    Args:
        journal_path: The journal file; made absolute.
        grace_period_s: Seconds a lock whose holder cannot be checked may stay unchanged before it
            is forcibly released (Optuna's default is 30).

    Raises:
        ValueError: If ``grace_period_s`` is not positive.
    """

    def __init__(self, journal_path: str | os.PathLike[str], grace_period_s: float = 30.0) -> None:
        if not grace_period_s > 0:
            raise _checks.value_error(
                "grace_period_s", grace_period_s, "must be > 0", "pass seconds, e.g. 30"
            )
        self.journal_path = Path(journal_path).absolute()
        self.lock_path = Path(str(self.journal_path) + LOCK_SUFFIX)
        self.grace_period_s = float(grace_period_s)
        self._me = this_process()

    def acquire(self) -> bool:
        """Take the lock, waiting (with sleeps) while a live holder has it.

        Returns:
            ``True`` once the lock is held.
        """
        sleep_s = _POLL_S
        waited_since = time.monotonic()
        last_warning = waited_since
        while True:
            if self._try_link():
                return True
            if self._break_if_abandoned():
                sleep_s = _POLL_S
                continue
            now = time.monotonic()
            if now - last_warning > _WARNING_INTERVAL_S:
                _logger.warning(
                    "Waiting %.0f s for %s, held by %s.",
                    now - waited_since,
                    self.lock_path,
                    self._holder_text(),
                )
                last_warning = now
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, _MAX_POLL_S)

    def _try_link(self) -> bool:
        record = {"holder": self._me.to_json(), "acquired_at_s": time.time()}
        staging = self.lock_path.with_name(f"{self.lock_path.name}.{uuid.uuid4().hex}.tmp")
        staging.write_text(json.dumps(record))
        try:
            os.link(staging, self.lock_path)
            return True
        except FileExistsError:
            return False
        finally:
            staging.unlink(missing_ok=True)

    def release(self) -> None:
        """Release the lock (rename, then unlink, as Optuna does).

        Raises:
            RuntimeError: If the lock is not there to release.
        """
        moved = self.lock_path.with_name(f"{self.lock_path.name}.{uuid.uuid4().hex}.released")
        try:
            os.rename(self.lock_path, moved)
        except OSError as error:
            raise RuntimeError(f"{self.lock_path} is not held: {error}") from error
        moved.unlink(missing_ok=True)

    def _break_if_abandoned(self) -> bool:
        """Release a lock whose holder is gone; ``True`` if one was released (or vanished)."""
        try:
            stat = os.lstat(self.lock_path)
        except FileNotFoundError:
            return True  # released meanwhile
        holder = self._read_holder()
        age_s = time.time() - stat.st_mtime
        if holder is not None and holder.is_on_this_host():
            if not holder.is_gone():
                return False
            why = f"its holder, {holder.describe()}, is gone"
        elif age_s > self.grace_period_s:
            who = holder.describe() if holder is not None else "a process it does not name"
            why = f"it was held by {who} for more than {self.grace_period_s:g} s"
        else:
            return False
        # Move it aside, then check that what was moved is the lock judged abandoned: a neighbour
        # may have broken it and taken a new one in between; that one is put back.
        moved = self.lock_path.with_name(f"{self.lock_path.name}.{uuid.uuid4().hex}.broken")
        try:
            os.rename(self.lock_path, moved)
        except FileNotFoundError:
            return True
        try:
            moved_stat = os.lstat(moved)
            if (moved_stat.st_ino, moved_stat.st_mtime) != (stat.st_ino, stat.st_mtime):
                with contextlib.suppress(FileExistsError):
                    os.link(moved, self.lock_path, follow_symlinks=False)
                return False
        finally:
            moved.unlink(missing_ok=True)
        _logger.warning(
            "Released the journal lock %s left %.1f s ago: %s.", self.lock_path, age_s, why
        )
        return True

    def _read_holder(self) -> ProcessIdentity | None:
        if os.path.islink(self.lock_path):
            return None  # Optuna's JournalFileSymlinkLock: it names no holder
        try:
            record = json.loads(self.lock_path.read_text())
        except (OSError, ValueError):
            return None
        return ProcessIdentity.from_json(record.get("holder") if isinstance(record, dict) else None)

    def _holder_text(self) -> str:
        holder = self._read_holder()
        return holder.describe() if holder is not None else "a process it does not name"
