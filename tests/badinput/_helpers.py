"""What every bad-input case asserts beside its error: nothing RUNNING, no user file changed."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
import contextlib
from dataclasses import dataclass
import hashlib
from pathlib import Path
import re
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


_FIX_WORDS = re.compile(
    r"(?i)\b(pass|use|set|call|install|drop|start|create|run|give|check|raise|make|declare|"
    r"open|keep|define|mark|wrap|resume|restore|delete|fix|free|lower|shrink|return|choose|"
    r"leave|remove|omit|register|move|enter|ask|group|build)\b"
)


@dataclass(frozen=True)
class Case:
    """One bad input: the call, the error a user must see, and what its message must name.

    ``argument`` and ``shown`` (how the value appears, e.g. ``"-1"`` or ``"'x'"``) must both
    appear in the message, and a fix after them (a verb such as "pass" or "use").
    """

    id: str
    call: Callable[[], object]
    error: type[BaseException]
    argument: str
    shown: str
    klass: str  # the class of bad input: type, range, absurd, path, storage, objective, order

    def check(self) -> BaseException:
        """Run the call; assert the error, its argument, value and fix. Returns the error."""
        with pytest.raises(self.error) as caught:
            self.call()
        text = str(caught.value)
        assert self.argument in text, f"{self.argument!r} not named in: {text}"
        assert self.shown in text, f"value {self.shown!r} not shown in: {text}"
        tail = text[text.index(self.argument) :]
        assert _FIX_WORDS.search(tail), f"no fix in: {text}"
        return caught.value


def case_params(cases: list[Case]) -> list[object]:
    """``pytest.param`` per case, with its id."""
    return [pytest.param(case, id=f"{case.klass}-{case.id}") for case in cases]
