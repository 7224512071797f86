"""What a hosted Tune trial and its host send each other, without torch.

The messages of ``tune_hosts()`` (:mod:`waterwave_hpo.cluster._hosted` is the host,
:mod:`waterwave_hpo.cluster._tune_trial` the Tune trial's side): a hosted trial's events, a
host's counts, and checkpoint directories packed to cross processes or nodes. Kept apart from
the host so that a Tune trial's process, which only relays them, never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
import io
from pathlib import Path
import tarfile
import tempfile
from typing import Any


@dataclass(frozen=True)
class HostedEvent:
    """One thing a hosted trial did, for its Tune trial to replay.

    Attributes:
        kind: ``"result"`` (a ``tune.report``), ``"done"`` (the function returned) or
            ``"error"`` (it raised).
        metrics: The reported metrics (``"result"``).
        checkpoint: The reported checkpoint directory as a gzipped tar (``"result"``), or
            ``None``.
        error: The traceback, as text (``"error"``).
        out_of_memory: Whether the error was the device running out of memory.
    """

    kind: str
    metrics: dict[str, Any] | None = None
    checkpoint: bytes | None = None
    error: str | None = None
    out_of_memory: bool = False


@dataclass(frozen=True)
class HostStats:
    """One host's trials at one moment.

    Attributes:
        device: The host's device.
        running: Trials whose function runs now.
        waiting: Trials started by Tune that wait for room on the device.
        peak_running: The most trials that ran at once so far.
        finished: Trials whose function returned, raised or was stopped.
    """

    device: str
    running: int
    waiting: int
    peak_running: int
    finished: int


def pack_directory(path: str | Path) -> bytes:
    """A directory's files as a gzipped tar (for a checkpoint crossing processes or nodes)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(str(path), arcname=".")
    return buffer.getvalue()


def unpack_directory(data: bytes) -> str:
    """Unpack a checkpoint directory into a new temporary directory.

    Unpack :func:`pack_directory`'s bytes into a new temporary directory; returns its path
    (the caller removes it).
    """
    directory = tempfile.mkdtemp(prefix="waterwave-checkpoint-")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4
            tar.extractall(directory, filter="data")
        else:  # pragma: no cover - older patch releases; the tar is our own
            tar.extractall(directory)
    return directory
