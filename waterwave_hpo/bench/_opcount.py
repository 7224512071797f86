"""Count the ATen operations of a piece of work: about one kernel launch each.

On a GPU a small model's training step costs one kernel launch per ATen operation, whatever the
operation's size; fusing K models pays off there when a fused step runs about as many operations
as one model's step, not K times as many. The count is read on the CPU, where the same
operations run: :class:`OpCounter` is a ``TorchDispatchMode`` (per thread, seeing the operations
after autograd and vmap have turned them into kernels, backward included, since the CPU runs
backward in the calling thread).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class OpCount:
    """The operations one call ran.

    Attributes:
        total: Every ATen operation dispatched to a kernel.
        compute: Those that are not views (a view launches no kernel).
        by_op: ``{"aten.addmm.default": n, ...}``, every operation.
    """

    total: int
    compute: int
    by_op: dict[str, int]


class OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call,unused-ignore]
    """Counts each ATen operation that reaches a kernel while it is active (this thread)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Count ``func``, then run it."""
        self.ops[str(func)] += 1
        if getattr(func, "is_view", False):
            self.views += 1
        return func(*args, **(kwargs or {}))


def count_ops(work: Callable[[], object]) -> OpCount:
    """Run ``work()`` once and count the ATen operations it dispatched.

    Args:
        work: E.g. one training step (forward, loss, backward, optimizer step).

    Returns:
        The counts.

    >>> import torch
    >>> a = torch.randn(3, 3)
    >>> count_ops(lambda: a @ a + 1).total
    2
    """
    counter = OpCounter()
    with counter:
        work()
    total = sum(counter.ops.values())
    return OpCount(total, total - counter.views, dict(counter.ops))
