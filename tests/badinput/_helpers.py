"""What every bad-input case asserts beside its error: nothing RUNNING, no user file changed."""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import hashlib
from pathlib import Path
import shutil
import subprocess

import optuna
from optuna.trial import TrialState
import pytest


def file_hashes(*roots: Path) -> dict[str, str]:
    """SHA-256 of every file under ``roots`` (files or directories), by path."""
    hashes: dict[str, str] = {}
    for root in roots:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            hashes[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return hashes


def assert_none_running(study: optuna.Study) -> None:
    """No trial of ``study`` is RUNNING (every trial a run started has ended)."""
    running = [t.number for t in study.get_trials(states=(TrialState.RUNNING,))]
    assert running == [], f"trials left RUNNING: {running}"


def read_only_sqlite_url(path: Path) -> str:
    """SQLite's read-only URL of ``path``: refuses writes even to root (file modes do not)."""
    return f"sqlite:///file:{path}?mode=ro&uri=true"


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[None]:
    """``chattr +i path`` for the block: not even root can write it (tests run as root)."""
    chattr = shutil.which("chattr")
    if chattr is None:
        pytest.skip("chattr is not installed")
    done = subprocess.run([chattr, "+i", str(path)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"chattr +i is not supported here: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        make_mutable(path)


def make_mutable(path: Path) -> None:
    """``chattr -i path`` (idempotent)."""
    chattr = shutil.which("chattr")
    if chattr is not None:
        subprocess.run([chattr, "-i", str(path)], capture_output=True, check=False)
