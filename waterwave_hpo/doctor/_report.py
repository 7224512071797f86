"""The doctor's report: one result per check, versions, and what device the checks ran on."""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import Any


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
        """Write the JSON report to ``path`` (parents created)."""
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
