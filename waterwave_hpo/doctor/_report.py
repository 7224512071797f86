"""The doctor's report: one result per check, versions, and what device the checks ran on."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from pathlib import Path
from typing import Any

from waterwave_hpo._owned_files import ForeignFileError
from waterwave_hpo._owned_files import OutFolderError

_REPORT_KEYS = frozenset({"gpu_found", "device", "versions", "machine", "checks", "exit_code"})


def check_report_path(path: object, argument: str = "json") -> Path:
    """``path`` if the doctor may write its report there: absent, or an earlier doctor report.

    Checked before the checks run, so a refusal costs nothing.

    Args:
        path: Where the report goes (``--json``).
        argument: The argument's name, for messages.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        OutFolderError: ``path`` is empty or a directory (a ``ValueError``).
        ForeignFileError: ``path`` exists and is not a report the doctor wrote (its JSON keys),
            so it is not replaced.
    """
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text.strip():
        raise OutFolderError(
            argument, path, "is not a file path", "pass a file path, e.g. waterwave-doctor.json"
        )
    target = Path(text)
    if target.is_dir():
        raise OutFolderError(
            argument,
            path,
            "is a directory",
            f"pass a file path, e.g. {target / 'waterwave-doctor.json'}",
        )
    if os.path.lexists(target) and not _is_doctor_report(target):
        raise ForeignFileError(
            argument,
            path,
            target,
            "exists and is not a report of waterwave-hpo doctor; it was not changed",
            "pass another path, or move that file out of the way",
        )
    return target


def _is_doctor_report(path: Path) -> bool:
    if path.is_symlink() or not path.is_file():
        return False
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and _REPORT_KEYS <= data.keys()


class CheckStatus(str, enum.Enum):
    """How a check ended. ``SKIP`` says why it could not run here (it is not a failure)."""

    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One acceptance check.

    Attributes:
        name: The check's name (``install_order``, ``alloc_latency``, ...).
        status: PASS, FAIL or SKIP.
        figure: The number the check measured (``None`` where it measures none).
        unit: ``figure``'s unit (``us``, ``ratio``, ``blocks``, ...).
        detail: What was done and seen, and the pass criterion.
        seconds: Wall seconds the check took.
    """

    name: str
    status: CheckStatus
    figure: float | None
    unit: str
    detail: str
    seconds: float = 0.0


@dataclasses.dataclass
class DoctorReport:
    """Everything the doctor found.

    Attributes:
        gpu_found: Whether a CUDA device was found; ``False``: the checks ran on the simulated
            device and the CPU.
        device: The device checked (``cuda:N``, or ``sim`` without a GPU).
        versions: Package and driver versions (``None`` for what is not installed).
        machine: Host facts (platform, CPUs, load average at the start).
        checks: The checks, in the order they ran.
    """

    gpu_found: bool
    device: str
    versions: dict[str, str | None]
    machine: dict[str, Any]
    checks: list[CheckResult] = dataclasses.field(default_factory=list)

    @property
    def failed(self) -> list[CheckResult]:
        """The checks that failed."""
        return [c for c in self.checks if c.status is CheckStatus.FAIL]

    @property
    def exit_code(self) -> int:
        """0 when no check failed, else 1."""
        return 1 if self.failed else 0

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        data = dataclasses.asdict(self)
        data["checks"] = [{**dataclasses.asdict(c), "status": c.status.value} for c in self.checks]
        data["exit_code"] = self.exit_code
        return data

    def write(self, path: Path) -> None:
        """Write the JSON report to ``path`` (parents created).

        Raises:
            ForeignFileError: ``path`` exists and is not an earlier doctor report (see
                :func:`check_report_path`); it is left as it was.
        """
        path = check_report_path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")

    def text(self) -> str:
        """A human-readable summary, one line per check."""
        lines = []
        if not self.gpu_found:
            lines.append(
                "No GPU was found: the checks ran on waterwave's simulated device and the CPU. "
                "Run `waterwave-hpo doctor` on a machine with CUDA to check the GPU path."
            )
        versions = ", ".join(f"{k} {v}" for k, v in self.versions.items() if v is not None)
        lines.append(f"device: {self.device}; {versions}")
        for c in self.checks:
            figure = "" if c.figure is None else f" {c.figure:.4g} {c.unit}"
            lines.append(f"{c.status.value:4}  {c.name:<16}{figure}  {c.detail}")
        n = len(self.checks)
        lines.append(f"{n - len(self.failed)}/{n} checks did not fail.")
        return "\n".join(lines)
