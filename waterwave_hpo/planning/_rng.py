"""Random numbers of a recomputed unit: recorded in its forward, replayed in its recompute.

Why: ``torch.utils.checkpoint`` (``preserve_rng_state=True``) saves the process-wide
generator's state before a unit's forward, and in backward sets it back, re-runs the unit and
restores the state it found. The generator is shared by every thread of the process, so with
co-hosted trials (one thread each) two things go wrong: a neighbour drawing between the save
and the unit's own draws shifts the numbers the unit saw, so its recompute draws different
ones (a different dropout mask: a silently wrong gradient); and the restore in backward sets
the generator back to where it was before the recompute, so the numbers a neighbour drew
meanwhile are drawn again (its stream is rewound).

What: a recompute unit runs under ``checkpoint(..., preserve_rng_state=False, context_fn=...)``
with two dispatch modes (thread-local, as ``torch.utils.checkpoint``'s selective checkpoint).
In forward, :class:`RandomRecorder` lets every random op draw from the generator as usual and
keeps a copy of what it produced; in the recompute, :class:`RandomReplayer` hands each random
op its recorded result instead of running it. The recompute draws nothing, so it sees exactly
its forward's numbers and no generator moves, whatever other threads draw. The cost: a
recompute unit keeps its random ops' outputs (a dropout's mask or noise) from forward to
backward; the profile counts them (``Unit.random_bytes``) and the cost model charges them.

A random op is one PyTorch tags ``nondeterministic_seeded`` (dropout, bernoulli, rand*,
randn*, randint*, normal, uniform_, exponential_, multinomial, the attention kernels with
dropout...), except an attention kernel called with ``dropout_p=0``. (PyTorch's own
``create_selective_checkpoint_contexts`` with ``MUST_SAVE`` for these ops does not serve: on
the CPU dropout fills a buffer with ``bernoulli_`` in place and scales it in place, which it
refuses as "Tensor cached during selective activation checkpoint has been mutated".)

Limits: only ops that pass PyTorch's dispatcher are seen. A kernel that draws from a generator
without being a PyTorch op (a CuPy or C++ extension kernel reading torch's generator state
itself) is re-run by the recompute and draws new numbers; keep or swap such a unit. The
record costs a copy of each random result and a Python dispatch per op of a recompute unit
(``experiments/results/2026-11-25-recompute-rng/``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
import torch.utils._pytree as pytree


class RecomputeMismatchError(RuntimeError):
    """A recompute ran other random ops than its forward (the unit's control flow changed)."""


def _argument(func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            if a.kwarg_only or i >= len(args):
                return kwargs.get(name, a.default_value if a.has_default_value() else None)
            return args[i]
    return None


_SEEDED: dict[Any, bool] = {}  # op -> tagged nondeterministic_seeded (every op passes here)


def draws_random(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the aten op ``func`` called with ``args``/``kwargs`` draws random numbers."""
    seeded = _SEEDED.get(func)
    if seeded is None:
        seeded = _SEEDED[func] = torch.Tag.nondeterministic_seeded in func.tags
    if not seeded:
        return False
    p = _argument(func, "dropout_p", args, kwargs)
    return not (isinstance(p, (int, float)) and p == 0)


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes into (``self`` of ``bernoulli_``, ``out=``)."""
    out: list[torch.Tensor] = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = kwargs.get(a.name) if (a.kwarg_only or i >= len(args)) else args[i]
            out.extend(t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))
    return out


class RandomRecord:
    """The random ops of one recompute unit's forward, in order, with copies of their results.

    Args:
        hold: Called with each recorded copy; what it returns is kept as long as the record
            (e.g. an entry of the plan's step ledger counting the copy's bytes until then).
    """

    def __init__(self, hold: Callable[[torch.Tensor], Any] = lambda t: None) -> None:
        self.hold = hold
        self.ops: list[tuple[Any, list[Any], Any]] = []  # (func, flat results, spec)
        self.holders: list[Any] = []

    def recorder(self) -> RandomRecorder:
        """The forward's mode (records)."""
        return RandomRecorder(self)

    def replayer(self) -> RandomReplayer:
        """The recompute's mode (replays; may be entered once per backward)."""
        return RandomReplayer(self)


class RandomRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call,unused-ignore]
    """Forward: run every op; keep a copy of each random op's results in the record."""

    def __init__(self, record: RandomRecord) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.record = record

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if draws_random(func, args, kwargs):
            flat, spec = pytree.tree_flatten(out)
            copies = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in flat]
            self.record.holders.extend(
                self.record.hold(t) for t in copies if isinstance(t, torch.Tensor)
            )
            self.record.ops.append((func, copies, spec))
        return out


class RandomReplayer(TorchDispatchMode):  # type: ignore[no-untyped-call,unused-ignore]
    """Recompute: run every op but the random ones, which return the forward's results.

    Raises:
        RecomputeMismatchError: If the recompute calls a random op the forward did not call
            at that point (the unit's forward depends on something that changed), rather than
            drawing numbers the forward never saw.
    """

    def __init__(self, record: RandomRecord) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.record = record
        self._next = 0

    def __enter__(self) -> RandomReplayer:
        self._next = 0
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if not draws_random(func, args, kwargs):
            return func(*args, **kwargs)
        ops = self.record.ops
        if self._next >= len(ops) or ops[self._next][0] is not func:
            seen = ops[self._next][0] if self._next < len(ops) else "no further random op"
            raise RecomputeMismatchError(
                f"The recompute of a planned unit called the random op {func} where its "
                f"forward called {seen}; its random numbers cannot be replayed. Make the "
                "unit's forward independent of state that changes between forward and "
                "backward, or plan it with placement keep or swap."
            )
        _, copies, spec = ops[self._next]
        self._next += 1
        written = _written(func, args, kwargs)
        if written:  # in place / out=: write the forward's numbers where the op would have
            for target, copy in zip(written, copies, strict=False):
                target.copy_(copy)
            return pytree.tree_unflatten(list(written[: len(copies)]), spec)
        return pytree.tree_unflatten(
            [c.clone() if isinstance(c, torch.Tensor) else c for c in copies], spec
        )


class RandomBytesCounter(TorchDispatchMode):  # type: ignore[no-untyped-call,unused-ignore]
    """Profiling: the bytes of the results of every random op, attributed by ``where()``.

    Args:
        where: Returns the index of the unit running now (``-1``: outside every unit).
    """

    def __init__(self, where: Callable[[], int], n_units: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.where = where
        self.random_bytes = [0] * n_units

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if draws_random(func, args, kwargs):
            u = self.where()
            if u >= 0:
                self.random_bytes[u] += sum(
                    t.numel() * t.element_size()
                    for t in pytree.tree_leaves(out)
                    if isinstance(t, torch.Tensor)
                )
        return out
