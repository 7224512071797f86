"""NodeGroup gates: forward pre-hooks that reserve a group's bytes, backward hooks that free them.

Semantics (Waterwave, IEEE TC 2023, Sec. 4), for a model wrapped by ``pipeline`` and run
inside a trial whose context carries a scheduler:

* Forward, group ``g`` starts: the gate calls ``scheduler.acquire(trial, g, saved_bytes)`` and
  blocks (GIL released) until admitted. Group 0's gate is the model's own forward pre-hook; it
  first declares the model's profile and reserves its parameters and gradients (``RESIDENT``,
  held until ``trial_finished``).
* Training (grad enabled and ``model.training``): group ``g``'s bytes are released when the
  gradient with respect to the group's input has been computed, i.e. when the group's backward
  is done (a tensor hook on the input). A group whose input needs no gradient (group 0 on
  data) is released when the whole backward ends (an autograd-engine callback queued by a hook
  on the model's outputs); that callback also releases anything a hook missed.
* Inference (``torch.no_grad()``, ``torch.inference_mode()`` or ``model.eval()``): group
  ``g``'s bytes are released when group ``g + 1`` starts, the last group's when the forward
  returns.
* Never leaked: a pass whose graph is dropped without backward is released when the graph
  is freed (a finalizer on an object owned by the graph's output node); a forward that raised
  is released when the next forward of the model starts in that thread; and
  ``trial_finished`` releases everything.
* Outside a trial (no context, or a context without scheduler) every gate returns at once.
* While :func:`gates_muted` is entered in the thread every gate returns at once: the executor
  profiles a gated model for a memory plan that way (``fit_trial_memory``), whose two
  profiling steps must not reserve anything.
* Inside a backward pass every gate returns at once (:func:`in_backward`): a checkpointed
  forward re-run by ``torch.utils.checkpoint`` during backward holds memory its original
  forward's reservation already covers, and on CUDA it runs on autograd's device thread, which
  every co-hosted trial's backward shares, so a gate that waited there would stall them all.

Backward hooks here never call :func:`~waterwave_hpo.current` (on CUDA they run on autograd's
device thread under an empty ``contextvars`` context, where no trial is current) and never wait:
they carry their scheduler and reservation, and releasing only takes the ledger's lock briefly.

The hooks never change a tensor: they return ``None``, so losses and gradients equal the
bare model's exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import threading
from typing import TYPE_CHECKING
from typing import Any
import weakref

import torch

from waterwave_hpo.nodegroup._profile import iter_tensors
from waterwave_hpo.scheduler import Phase
from waterwave_hpo.scheduler import Reservation
from waterwave_hpo.trial import current_or_none

if TYPE_CHECKING:
    from waterwave_hpo.nodegroup._group import NodeGroup
    from waterwave_hpo.scheduler import PipelineScheduler
    from waterwave_hpo.scheduler import TrialProfile


def in_backward() -> bool:
    """Whether the calling code runs inside an autograd backward pass.

    Whether the calling code runs inside an autograd backward pass (a hook, or a forward
    that ``torch.utils.checkpoint`` re-runs during backward); torch's own checkpoint reads the
    same ``torch._C._current_graph_task_id()`` (-1 outside backward).
    """
    return bool(torch._C._current_graph_task_id() != -1)


_MUTED = threading.local()


@contextlib.contextmanager
def gates_muted() -> Iterator[None]:
    """Every gate returns at once in this thread for the block (nothing reserved or waited)."""
    _MUTED.depth = getattr(_MUTED, "depth", 0) + 1
    try:
        yield
    finally:
        _MUTED.depth -= 1


def _muted() -> bool:
    return bool(getattr(_MUTED, "depth", 0))


def _current_scheduler() -> tuple[PipelineScheduler, int] | None:
    ctx = current_or_none()
    if ctx is None or ctx.scheduler is None:
        return None
    return ctx.scheduler, ctx.trial_number


class _Pass:
    """The reservations of one forward pass of one model in one thread."""

    __slots__ = ("scheduler", "tokens", "training", "trial_number")

    def __init__(self, scheduler: PipelineScheduler, trial_number: int, training: bool) -> None:
        self.scheduler = scheduler
        self.trial_number = trial_number
        self.training = training
        self.tokens: list[Reservation] = []

    def release_all(self) -> None:
        for r in self.tokens:
            self.scheduler.release(r)
        self.tokens.clear()


class _ReleaseOnGrad:
    """Tensor hook on a group's input: the group's backward is done."""

    __slots__ = ("reservation", "scheduler")

    def __init__(self, scheduler: PipelineScheduler, reservation: Reservation) -> None:
        self.scheduler = scheduler
        self.reservation = reservation

    def __call__(self, grad: torch.Tensor) -> None:
        self.scheduler.release(self.reservation)


class _Sentinel:
    """Owned by the output's graph node; its finalizer frees a pass dropped without backward."""


class _ReleaseAtBackwardEnd:
    """Tensor hook on the model's outputs: queue the release of the pass at backward's end."""

    __slots__ = ("done", "scheduler", "sentinel", "tokens")

    def __init__(
        self, scheduler: PipelineScheduler, tokens: tuple[Reservation, ...], sentinel: _Sentinel
    ) -> None:
        self.scheduler = scheduler
        self.tokens = tokens
        self.sentinel = sentinel
        self.done = False

    def __call__(self, grad: torch.Tensor) -> None:
        if not self.done:
            self.done = True
            torch.autograd.Variable._execution_engine.queue_callback(self._release)

    def _release(self) -> None:
        for r in self.tokens:
            self.scheduler.release(r)


class GateSet:
    """The gates installed on one model (one per ``pipeline(model)`` call).

    Args:
        model: The model; held weakly.
        groups: Its NodeGroups.
        entries: Per group, the module whose forward pre-hook is the gate (``entries[0]`` is
            the model).
        profile: The model's per-step claim, declared to each trial's scheduler.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        groups: tuple[NodeGroup, ...],
        entries: tuple[torch.nn.Module, ...],
        profile: TrialProfile,
    ) -> None:
        self._model = weakref.ref(model)
        self.groups = groups
        self.profile = profile
        self._entries = entries
        self._nbytes = tuple(g.reserve_bytes for g in groups)
        self._local = threading.local()
        self._handles: list[Any] = []
        for g in range(1, len(groups)):
            self._handles.append(
                entries[g].register_forward_pre_hook(self._sub_gate(g), with_kwargs=True)
            )

    def remove(self) -> None:
        """Remove the gate hooks of groups 1.. (group 0 runs from the pipeline's root hook)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ hooks
    def root_pre(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        """Group 0's gate: the start of a forward pass."""
        if in_backward():  # a checkpointed forward re-run during backward: already reserved
            return
        if _muted():
            return
        stale: _Pass | None = getattr(self._local, "current", None)
        if stale is not None:  # the previous forward in this thread raised
            self._local.current = None
            stale.release_all()
        found = _current_scheduler()
        if found is None:
            return
        scheduler, trial_number = found
        key = id(self)
        if not scheduler.declared(trial_number, key=key):
            scheduler.declare_profile(trial_number, self.profile, key=key)
            if self.profile.resident_bytes:
                scheduler.acquire(trial_number, -1, self.profile.resident_bytes, Phase.RESIDENT)
        p = _Pass(scheduler, trial_number, torch.is_grad_enabled() and module.training)
        self._local.current = p
        self._enter(p, 0, args, kwargs)

    def root_post(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """The end of a forward pass."""
        p: _Pass | None = getattr(self._local, "current", None)
        if p is None:
            return
        self._local.current = None
        outs = [t for t in iter_tensors(output) if t.requires_grad] if p.training else []
        if not outs:
            p.release_all()
            return
        tokens = tuple(p.tokens)
        sentinel = _Sentinel()
        weakref.finalize(sentinel, p.scheduler.release_later, tokens)
        hook = _ReleaseAtBackwardEnd(p.scheduler, tokens, sentinel)
        for t in outs:
            t.register_hook(hook)  # type: ignore[no-untyped-call]

    def _sub_gate(self, g: int) -> Any:
        def gate(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            p: _Pass | None = getattr(self._local, "current", None)
            if p is not None and not in_backward():
                self._enter(p, g, args, kwargs)

        return gate

    def _enter(self, p: _Pass, g: int, args: Any, kwargs: Any) -> None:
        if not p.training:
            p.release_all()  # the previous groups' forwards are over; nothing is saved
        reservation = p.scheduler.acquire(p.trial_number, g, self._nbytes[g], Phase.FORWARD)
        p.tokens.append(reservation)
        if p.training:
            if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
                grads = [args[0]] if args[0].requires_grad else []  # the common case, fast
            else:
                grads = [t for t in iter_tensors((args, kwargs)) if t.requires_grad]
            if len(grads) == 1:
                hook = _ReleaseOnGrad(p.scheduler, reservation)
                grads[0].register_hook(hook)  # type: ignore[no-untyped-call]
