"""What one trial's model needs per training step, as the scheduler plans with it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TrialProfile:
    """A model's memory per training step, from its NodeGroup profile.

    Attributes:
        resident_bytes: Parameters plus gradients, held for the trial's whole life.
        group_bytes: Per NodeGroup, in execution order, the bytes its forward gate
            reserves (saved for backward) until its backward ends.
    """

    resident_bytes: int
    group_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.resident_bytes < 0 or any(b < 0 for b in self.group_bytes):
            raise ValueError(
                f"TrialProfile sizes must be >= 0 bytes, got resident_bytes={self.resident_bytes} "
                f"and group_bytes={self.group_bytes}."
            )

    @classmethod
    def of(cls, resident_bytes: int, group_bytes: Sequence[int]) -> TrialProfile:
        """Build a profile from any sequence of group sizes (bytes)."""
        return cls(int(resident_bytes), tuple(int(b) for b in group_bytes))

    @property
    def activation_bytes(self) -> int:
        """Bytes the forward pass holds at its peak (all groups), before backward frees."""
        return sum(self.group_bytes)

    @property
    def largest_group_bytes(self) -> int:
        """The largest single group's reservation (0 with no groups)."""
        return max(self.group_bytes, default=0)

    @property
    def peak_bytes(self) -> int:
        """``resident_bytes + activation_bytes``: the trial's peak when run alone."""
        return self.resident_bytes + self.activation_bytes

    def combine(self, other: TrialProfile) -> TrialProfile:
        """Two models in one trial (e.g. a GAN): both residents, one after the other's groups."""
        return TrialProfile(
            self.resident_bytes + other.resident_bytes, self.group_bytes + other.group_bytes
        )
