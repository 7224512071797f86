"""A barrier across processes for the process-isolation tests (files in a shared directory)."""

from __future__ import annotations

from pathlib import Path
import time
import uuid

WAIT_S = 120.0  # a worker's first trial waits for its interpreter and torch to import


def arrive(directory: Path, name: str, n: int) -> None:
    """Wait until ``n`` callers arrived at ``name``; ``TimeoutError`` after :data:`WAIT_S` s."""
    (directory / f"{name}.{uuid.uuid4().hex}").touch()
    deadline = time.monotonic() + WAIT_S
    while len(list(directory.glob(f"{name}.*"))) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: fewer than {n} arrived")
        time.sleep(0.01)
