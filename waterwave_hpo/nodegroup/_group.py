"""The NodeGroup: a contiguous slice of a model's execution, with its profiled sizes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeGroup:
    """One contiguous group of a model's modules, in execution order (Waterwave Sec. 4).

    Sizes come from the profiling pass (one real or example training step); times are wall
    seconds of that one step, so treat them as rough.

    Attributes:
        index: Position in execution order, ``0 <= index < len(groups)``.
        modules: Qualified names (as in ``model.named_modules()``; ``""`` is the model itself)
            of the outermost modules whose whole call lies in this group, in call order.
            Groups never share a module; a container that spans groups (e.g. the model, an
            ``nn.Sequential`` cut in two) is named by none of them.
        saved_bytes: Bytes of tensors its operations save for backward (each storage counted
            once, in the first group that saves it; parameters excluded). This is what the
            group's forward gate reserves until the group's backward ends.
        output_bytes: Bytes of the tensor(s) it hands to the next group (the model's
            outputs for the last group).
        param_bytes: Bytes of the parameters of its modules (a shared parameter counts in
            the first group that uses it).
        grad_bytes: Bytes of their gradients (parameters with ``requires_grad``).
        forward_s: Forward seconds in the profiled step.
        backward_s: Backward seconds in the profiled step (0.0 if no backward was profiled).
    """

    index: int
    modules: tuple[str, ...]
    saved_bytes: int
    output_bytes: int
    param_bytes: int
    grad_bytes: int
    forward_s: float
    backward_s: float

    @property
    def reserve_bytes(self) -> int:
        """What the group's forward gate reserves in the ledger: ``saved_bytes``."""
        return self.saved_bytes
