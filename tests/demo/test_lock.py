"""The journal lock that names its holder: released at once when its holder is gone."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
import subprocess
import sys
import threading
import time

import pytest

from waterwave_hpo.demo import HolderNamingJournalFileLock
from waterwave_hpo.demo._process import this_process


def _dead_process_identity() -> dict[str, object]:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    import psutil

    identity = this_process().to_json()
    identity["pid"] = child.pid
    identity["start_time_s"] = psutil.Process(child.pid).create_time()
    child.wait()
    return identity


def test_lock_left_by_a_dead_process_is_released_at_once_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = tmp_path / "study.log"
    dead = _dead_process_identity()
    lock_file = tmp_path / "study.log.lock"
    lock_file.write_text(json.dumps({"holder": dead, "acquired_at_s": time.time()}))
    os.utime(lock_file, (time.time() - 7, time.time() - 7))
    lock = HolderNamingJournalFileLock(journal, grace_period_s=30)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="waterwave_hpo.demo"):
        assert lock.acquire()
    assert time.monotonic() - started < 5  # not the 30 s grace period
    assert f"pid {dead['pid']}" in caplog.text and "is gone" in caplog.text
    assert "left 7." in caplog.text  # how long ago
    assert json.loads(lock_file.read_text())["holder"]["pid"] == os.getpid()
    lock.release()
    assert not lock_file.exists()


def test_lock_of_a_live_holder_is_waited_for_not_broken(tmp_path: Path) -> None:
    journal = tmp_path / "study.log"
    holder = HolderNamingJournalFileLock(journal, grace_period_s=30)
    waiter = HolderNamingJournalFileLock(journal, grace_period_s=30)
    holder.acquire()
    got = threading.Event()
    thread = threading.Thread(target=lambda: (waiter.acquire(), got.set()))
    thread.start()
    assert not got.wait(1.0)  # this process is alive: its lock stands
    holder.release()
    assert got.wait(5.0)
    thread.join()
    waiter.release()


def test_optunas_dangling_relative_symlink_lock_is_broken_after_the_grace_period(
    tmp_path: Path,
) -> None:
    # What Optuna's JournalFileSymlinkLock left behind for a relative journal path:
    # a link whose target does not resolve, which Optuna 5.0's own wait loop never breaks.
    journal = tmp_path / "study.log"
    lock_file = tmp_path / "study.log.lock"
    os.symlink("waterwave-demo/study.log", lock_file)
    lock = HolderNamingJournalFileLock(journal, grace_period_s=1.0)
    started = time.monotonic()
    assert lock.acquire()
    assert 0.9 < time.monotonic() - started < 10
    lock.release()


def test_grace_period_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^grace_period_s=0: must be > 0; pass seconds"):
        HolderNamingJournalFileLock(tmp_path / "study.log", grace_period_s=0)
