"""Placement units and their profile: the NodeGroup profiler's atoms, measured for planning.

Two observed training steps on an example batch, each undone afterwards (gradients, buffers
such as BatchNorm statistics and the RNG state are restored; parameters are not changed):
the first is the NodeGroup profiler's (:class:`~waterwave_hpo.nodegroup._profile.Profiler`:
where the model can be cut, forward and backward seconds per atom); the second attributes every
saved-for-backward tensor to the atom whose outermost module call saved it and records the
bytes each atom's module calls take as arguments (what a recompute keeps) and the bytes of the
results of its random ops (what a recompute keeps to replay them, ``planning/_rng.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
import warnings

import torch
from torch import nn

from waterwave_hpo.nodegroup._internal import ModuleObserver
from waterwave_hpo.nodegroup._internal import Profiler
from waterwave_hpo.nodegroup._internal import iter_tensors
from waterwave_hpo.nodegroup._internal import profile_on
from waterwave_hpo.nodegroup._internal import tensor_bytes
from waterwave_hpo.planning._plan import StepProfile
from waterwave_hpo.planning._plan import Unit
from waterwave_hpo.planning._rng import RandomBytesCounter

#: Optimizer state as a multiple of the trainable parameters' bytes, for an optimizer whose
#: state is still empty (before its first step): Adam keeps two moments, SGD with momentum one.
_STATE_PER_PARAM = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "RMSprop": 1}


class CheckpointedModelError(ValueError):
    """The model already runs part of its forward under ``torch.utils.checkpoint``."""


@dataclass(frozen=True)
class UnitModules:
    """Per unit, the outermost module calls that make it: ``(qualified name, module)`` pairs."""

    modules: tuple[tuple[tuple[str, nn.Module], ...], ...]


def optimizer_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of ``optimizer``'s state tensors (or their expected bytes before its first step).

    An empty state is estimated from the optimizer's type (Adam family: two moments per
    trainable parameter; SGD: one if ``momentum > 0``; others: two, erring high).
    """
    if optimizer is None:
        return 0
    state_bytes = sum(
        tensor_bytes(t)
        for st in optimizer.state.values()
        for t in iter_tensors(st)
        if t.numel() > 1
    )
    if state_bytes:
        return state_bytes
    trainable = sum(
        tensor_bytes(p)
        for group in optimizer.param_groups
        for p in group["params"]
        if p.requires_grad
    )
    name = type(optimizer).__name__
    if name == "SGD":
        factor = 1 if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    else:
        factor = _STATE_PER_PARAM.get(name, 2)
    return factor * trainable


def static_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Parameters + gradients (of trainable parameters) + optimizer state, in bytes."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += tensor_bytes(p) * (2 if p.requires_grad else 1)
    return total + optimizer_state_bytes(model, optimizer)


def profile_units(
    model: nn.Module, example_input: Any, optimizer: torch.optim.Optimizer | None = None
) -> tuple[StepProfile, UnitModules]:
    """Profile ``model`` on ``example_input`` into placement units.

    Args:
        model: The model, on its device, in training mode as it will train.
        example_input: A batch: a tensor, or a tuple of positional arguments.
        optimizer: The optimizer whose state counts in the static bytes, or ``None``.

    Returns:
        The step's profile and, per unit, its outermost module calls.

    Raises:
        CheckpointedModelError: If the model runs under ``torch.utils.checkpoint`` (or
            installs its own ``saved_tensors_hooks``) inside its forward.
        ValueError: If ``example_input`` gives no output that requires grad.
    """
    profiler = Profiler(model)
    profiler.install()
    try:
        profile_on(model, example_input)
    finally:
        profiler.remove()
    atoms = profiler.atoms()
    groups = profiler.atom_modules()
    backward = profiler.backward_s()
    if len(atoms) == 1:
        warnings.warn(
            f"{type(model).__name__} has no valid cut (no module boundary that one tensor alone "
            "crosses), so it is planned as one unit: keep, swap or recompute the whole "
            "forward.",
            stacklevel=3,
        )

    owner: dict[int, int] = {}
    twice: set[int] = set()
    for u, calls in enumerate(groups):
        for _name, m in calls:
            if id(m) in owner:
                twice.add(id(m))
            owner[id(m)] = u
    for key in twice:
        del owner[key]
    observer = _SavedObserver(model, owner, len(groups))
    observer.install()
    try:
        profile_on(model, example_input)
    finally:
        observer.remove()
    if observer.user_hooks_in is not None:
        raise CheckpointedModelError(
            f"model runs {observer.user_hooks_in!r} under torch.utils.checkpoint (or its own "
            "saved_tensors_hooks); fit_memory places activations itself. Remove the "
            "checkpointing from the model, or do not call fit_memory on it."
        )
    if observer.reentrant:
        raise CheckpointedModelError(
            "model's forward uses torch.utils.checkpoint(use_reentrant=True); fit_memory places "
            "activations itself. Remove the checkpointing from the model, or do not call "
            "fit_memory on it."
        )
    groups = tuple(tuple((n, m) for n, m in calls if id(m) not in twice) for calls in groups)
    places = [_sequential_place(model, calls) for calls in groups]
    units = tuple(
        Unit(
            name="+".join(name or "<model>" for name, _ in calls) or f"unit{u}",
            saved_bytes=observer.saved_bytes[u],
            input_bytes=observer.input_bytes[u],
            forward_s=atoms[u].forward_s,
            backward_s=backward[u],
            chains_previous=u > 0 and _follows(places[u - 1], places[u]),
            random_bytes=observer.random.random_bytes[u],
        )
        for u, calls in enumerate(groups)
    )
    profile = StepProfile(
        units=units,
        static_bytes=static_bytes(model, optimizer),
        other_saved_bytes=observer.other_bytes,
    )
    return profile, UnitModules(groups)


class _SavedObserver(ModuleObserver):
    """Attributes saved tensors to units during one forward (the second profiled step)."""

    def __init__(self, model: nn.Module, owner: dict[int, int], n: int) -> None:
        super().__init__(model)
        self.owner = owner
        self.saved_bytes = [0] * n
        self.input_bytes = [0] * n
        self.other_bytes = 0
        self.user_hooks_in: str | None = None
        self.reentrant = False
        self._seen: set[tuple[int, int]] = set()
        self._stack: list[int] = []
        self._hooks: Any = None
        self._names = {id(m): name for name, m in model.named_modules()}
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._done = False
        self.random = RandomBytesCounter(lambda: self._stack[-1] if self._stack else -1, n)
        self._counting = False

        def pack(t: torch.Tensor) -> torch.Tensor:
            self._on_pack(t)
            return t

        self._pack = pack

    def _leave(self) -> None:
        if self._counting:
            self._counting = False
            self.random.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._done:
            return
        if module is self.model and self._hooks is None:
            if not torch.is_grad_enabled():
                return
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _identity)
            self._hooks.__enter__()
            self.random.__enter__()  # type: ignore[no-untyped-call]
            self._counting = True
        if self._hooks is None:
            return
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or top[0] is not self._pack:
            if self.user_hooks_in is None:
                self.user_hooks_in = self._names.get(id(module), type(module).__name__)
        u = self.owner.get(id(module))
        if u is not None and (not self._stack or self._stack[-1] == -1):
            self.input_bytes[u] += sum(tensor_bytes(t) for t in iter_tensors((args, kwargs)))
        self._stack.append(u if u is not None else (self._stack[-1] if self._stack else -1))

    def _post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._hooks is None or not self._stack:
            return
        self._stack.pop()
        if module is self.model:
            self._leave()
            self._done = True
            roots = [t.grad_fn for t in iter_tensors(output) if t.grad_fn is not None]
            self.reentrant = _has_reentrant_checkpoint(roots)

    def _on_pack(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            return
        if ptr == 0 or ptr in self._params:
            return
        u = self._stack[-1] if self._stack else -1
        key = (u, ptr)
        if key in self._seen:
            return
        self._seen.add(key)
        if u >= 0:
            self.saved_bytes[u] += nbytes
        else:
            self.other_bytes += nbytes


def _follows(before: tuple[str, int, int] | None, after: tuple[str, int, int] | None) -> bool:
    """Whether ``after``'s modules come right after ``before``'s in the same Sequential."""
    return (
        before is not None
        and after is not None
        and before[0] == after[0]
        and after[1] == before[2] + 1
    )


def _sequential_place(
    model: nn.Module, calls: tuple[tuple[str, nn.Module], ...]
) -> tuple[str, int, int] | None:
    """The span of ``calls`` if they are consecutive children of one ``nn.Sequential``.

    ``(parent name, first index, last index)`` if ``calls`` are consecutive children of one
    plain ``nn.Sequential`` (whose forward only feeds each child's output to the next).
    """
    if not calls:
        return None
    parents = {name.rpartition(".")[0] for name, _ in calls}
    if len(parents) != 1 or any(name == "" for name, _ in calls):
        return None
    parent_name = parents.pop()
    parent = model.get_submodule(parent_name)
    if type(parent).forward is not nn.Sequential.forward:
        return None
    keys = list(parent._modules)
    try:
        idx = [keys.index(name.rpartition(".")[2]) for name, _ in calls]
    except ValueError:
        return None
    if idx != list(range(idx[0], idx[0] + len(idx))):
        return None
    return parent_name, idx[0], idx[-1]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _has_reentrant_checkpoint(roots: list[Any]) -> bool:
    stack = list(roots)
    seen = {id(r) for r in stack}
    while stack:
        node = stack.pop()
        if "CheckpointFunction" in type(node).__name__:
            return True
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen.add(id(nxt))
                stack.append(nxt)
    return False
