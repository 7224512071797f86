"""``pipeline(model)`` and ``node_groups(model)``: the one-line opt-in of an objective."""

from __future__ import annotations

import math
import threading
from typing import Any
import warnings
import weakref

import torch
from torch import nn

from waterwave_hpo import _checks
from waterwave_hpo.nodegroup._gates import GateSet
from waterwave_hpo.nodegroup._gates import _current_scheduler
from waterwave_hpo.nodegroup._gates import in_backward
from waterwave_hpo.nodegroup._group import NodeGroup
from waterwave_hpo.nodegroup._partition import partition
from waterwave_hpo.nodegroup._profile import Profiler
from waterwave_hpo.nodegroup._profile import iter_tensors
from waterwave_hpo.nodegroup._profile import tensor_bytes
from waterwave_hpo.scheduler import TrialProfile

#: ``groups="auto"`` never makes a group whose profiled forward is shorter than this (seconds):
#: a gate costs tens of microseconds, so shorter groups would cost more than they bring.
AUTO_MIN_GROUP_FORWARD_S = 2e-4
#: ``groups="auto"`` never makes more groups than this.
AUTO_MAX_GROUPS = 16
#: ``groups="auto"`` with a known budget: the smallest k whose largest group is at most this
#: fraction of the budget (the slack a co-hosted trial's waiting group needs).
AUTO_LARGEST_GROUP_FRACTION = 0.03


class _Pipeline:
    """Everything ``pipeline()`` attached to one model."""

    def __init__(self, model: nn.Module, groups: int | str) -> None:
        self.model_ref = weakref.ref(model)
        self.groups_arg = groups
        self.profiler = Profiler(model)
        self.gates: GateSet | None = None
        self.lock = threading.Lock()
        self.handles = [
            model.register_forward_pre_hook(self._root_pre, with_kwargs=True),
            model.register_forward_hook(self._root_post, with_kwargs=True),
        ]
        self.profiler.install()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.profiler.remove()
        if self.gates is not None:
            self.gates.remove()

    def build(self) -> GateSet | None:
        """Cut the model into groups once the profiled forward has ended."""
        if self.gates is not None or not self.profiler.ready:
            return self.gates
        with self.lock:
            if self.gates is None:
                model = self.model_ref()
                if model is None:
                    return None
                found = _current_scheduler()
                budget = found[0].budget_bytes if found is not None else None
                k = _choose_k(self.profiler, self.groups_arg, budget)
                groups, entries = self.profiler.groups(k)
                resident = sum(
                    tensor_bytes(p) * (2 if p.requires_grad else 1) for p in model.parameters()
                )
                profile = TrialProfile.of(resident, [g.reserve_bytes for g in groups])
                self.gates = GateSet(model, groups, entries, profile)
        return self.gates

    def _root_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if in_backward():  # a checkpointed re-run: never build (it reads timings) there
            return
        gates = self.gates if self.gates is not None else self.build()
        if gates is not None:
            gates.root_pre(module, args, kwargs)

    def _root_post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.gates is not None:
            self.gates.root_post(module, args, kwargs, output)


class _Registry:
    """Each gated model's pipeline, weakly both ways.

    A pipeline holds its model (its profiler's records and its gates name the model's
    modules), so a registry that held pipelines strongly would keep every trial's model, on a
    GPU its parameters, for the life of the process. The model's own root hooks keep its
    pipeline alive; the model and its pipeline are then one cycle the garbage collector frees
    once the trial drops the model.
    """

    def __init__(self) -> None:
        self._refs: weakref.WeakKeyDictionary[nn.Module, weakref.ref[_Pipeline]] = (
            weakref.WeakKeyDictionary()
        )

    def get(self, model: nn.Module) -> _Pipeline | None:
        ref = self._refs.get(model)
        return None if ref is None else ref()

    def pop(self, model: nn.Module, default: None = None) -> _Pipeline | None:
        ref = self._refs.pop(model, None)
        return None if ref is None else ref()

    def __setitem__(self, model: nn.Module, pipe: _Pipeline) -> None:
        self._refs[model] = weakref.ref(pipe)

    def __contains__(self, model: object) -> bool:
        return isinstance(model, nn.Module) and self.get(model) is not None


_PIPELINES = _Registry()


def _choose_k(profiler: Profiler, groups: int | str, budget_bytes: int | None) -> int:
    atoms = profiler.atoms()
    n = len(atoms)
    if isinstance(groups, int):
        if groups > n:
            warnings.warn(
                f"pipeline(groups={groups}) asked for more groups than the model has valid cut "
                f"points; using {n} groups (see node_groups(model)).",
                stacklevel=3,
            )
        return min(groups, n)
    forward_s = sum(a.forward_s for a in atoms)
    k_time = max(1, min(n, AUTO_MAX_GROUPS, math.floor(forward_s / AUTO_MIN_GROUP_FORWARD_S)))
    if budget_bytes is None:
        return k_time
    sizes = [a.saved_bytes for a in atoms]
    for k in range(1, k_time + 1):
        if partition(sizes, k).largest <= AUTO_LARGEST_GROUP_FRACTION * budget_bytes:
            return k
    return k_time


def pipeline(
    model: nn.Module,
    *,
    groups: int | str = "auto",
    example_input: Any = None,
) -> nn.Module:
    """Install NodeGroup gates on ``model`` and return it (the same object).

    One line in an ordinary objective: ``model = waterwave_hpo.pipeline(build(trial).to(dev))``.
    The model is profiled on its first forward with grad enabled (a real training step; that
    step runs ungated) or at once on ``example_input``; then it is cut into contiguous
    NodeGroups of least largest memory (:func:`~waterwave_hpo.nodegroup.partition`), and each
    group's start gets a gate that reserves the group's bytes in the scheduler of the running
    trial (Waterwave, IEEE TC 2023, Sec. 4). Outside a trial the gates pass straight through.
    Losses and gradients are exactly those of the bare model.

    What is cut: module boundaries where one tensor is all that crosses, checked on the
    autograd graph of the profiled step (chains, stacks of residual or transformer blocks,
    ``nn.Sequential`` nests). Not supported, and what happens then: a model whose top level is
    one non-chain computation (a single residual block, a U-Net whose skips span the whole
    model) has no valid inner cut and becomes one group: correct, no gain. Modules called more
    than once per forward, or taking several gradient-carrying tensors, are never a group's
    start. Activation checkpointing re-runs forwards inside backward: don't combine the two.
    Control flow that changes which modules run after the profiled step keeps the first
    step's groups and sizes.

    Args:
        model: The model, already on its device.
        groups: ``"auto"``: the smallest number of groups whose largest group is at most 3% of
            the running trial's budget, with no group shorter than 0.2 ms of forward and at
            most 16 groups; or an int ``>= 1`` (capped, with a warning, at the number of
            valid cuts).
        example_input: A batch to profile on now: a tensor, or a tuple of positional
            arguments. Runs one forward and backward (of the sum of the outputs) whose effects
            are undone (gradients, buffers such as BatchNorm statistics, and the RNG state are
            restored). ``None``: profile on the first real training step instead.

    Returns:
        ``model``, with hooks installed. Calling ``pipeline`` again re-installs from scratch.

    Raises:
        TypeError: If ``model`` is not an ``nn.Module``.
        ValueError: If ``groups`` is neither ``"auto"`` nor an int ``>= 1``, or
            ``example_input`` leads to no output that requires grad.
    """
    if not isinstance(model, nn.Module):
        raise _checks.type_error("model", model, "a torch.nn.Module", "pass the trial's model")
    if groups != "auto":
        _checks.check_int(
            "groups", groups, minimum=1, fix="pass groups='auto' or a number of NodeGroups"
        )
    old = _PIPELINES.pop(model, None)
    if old is not None:
        old.remove()
    pipe = _Pipeline(model, groups)
    _PIPELINES[model] = pipe
    if example_input is not None:
        try:
            _profile_on(model, example_input)
        except BaseException:
            # A refused example_input leaves no half-profiled pipeline behind, and above all no
            # saved-tensor hooks of the profiler pushed on this thread (every later backward of
            # the thread would pack through them).
            pipe.remove()
            _PIPELINES.pop(model, None)
            raise
        pipe.build()
    return model


def _profile_on(model: nn.Module, example_input: Any) -> None:
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    grads = {p: p.grad for p in model.parameters()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cpu_rng = torch.random.get_rng_state()
    # Only the generators of the devices this model runs on: another device's generator is
    # its trials' (co-hosted trials on other GPUs draw from it while this one profiles).
    cuda_rng = {index: torch.cuda.get_rng_state(index) for index in _cuda_devices(model, args)}
    try:
        with torch.enable_grad():  # type: ignore[no-untyped-call,unused-ignore]
            try:
                out = model(*args)
            except Exception as error:  # the model refused the batch: name the argument
                raise example_input_error(example_input, model, error) from error
            losses = [
                t.float().sum()
                for t in iter_tensors(out)
                if t.requires_grad and t.is_floating_point()
            ]
            if not losses:
                raise ValueError(
                    "example_input gave no floating-point output that requires grad, so no "
                    "backward could be profiled. Pass a batch the model trains on, or leave "
                    "example_input=None to profile the first real training step."
                )
            torch.stack(losses).sum().backward()  # type: ignore[no-untyped-call]
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads.items():
            p.grad = g
        torch.random.set_rng_state(cpu_rng)
        for index, state in cuda_rng.items():
            torch.cuda.set_rng_state(state, index)


def describe_input(example_input: Any) -> str:
    """A short description of a batch: shapes, dtypes and devices, not the values."""
    if isinstance(example_input, torch.Tensor):
        shape = tuple(example_input.shape)
        return f"tensor of shape {shape}, {example_input.dtype}, on {example_input.device}"
    if isinstance(example_input, tuple):
        return "(" + ", ".join(describe_input(item) for item in example_input) + ")"
    text = repr(example_input)
    return text if len(text) <= 80 else f"{text[:77]}..."


def example_input_error(example_input: Any, model: nn.Module, error: Exception) -> ValueError:
    """``model(*example_input)`` raised ``error`` while profiling: an error naming the argument.

    The model's own error (torch's ``mat1 and mat2 shapes cannot be multiplied``) names neither
    the argument nor the fix; this one does, and keeps it as ``__cause__`` when raised from it.
    """
    first = str(error).splitlines()[0] if str(error) else ""
    return ValueError(
        f"example_input={describe_input(example_input)}: {type(model).__name__}(example_input) "
        f"raised {type(error).__name__}: {first}; pass a batch the model trains on (a tensor, "
        "or a tuple of its forward's positional arguments, with the shape and dtype it takes, "
        "on its device)."
    )


def _cuda_devices(model: nn.Module, args: tuple[Any, ...]) -> list[int]:
    """Indices of the CUDA devices the model's parameters, buffers and ``args`` are on."""
    tensors = [*model.parameters(), *model.buffers(), *iter_tensors(args)]
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


def _pipeline_of(model: nn.Module) -> _Pipeline:
    pipe = _PIPELINES.get(model)
    if pipe is None:
        raise ValueError(
            f"model {type(model).__name__} has no NodeGroup gates; call "
            "waterwave_hpo.pipeline(model) first."
        )
    return pipe


def node_groups(model: nn.Module) -> tuple[NodeGroup, ...]:
    """The NodeGroups of a model wrapped by :func:`pipeline`, in execution order.

    Returns:
        The groups; contiguous, each module call in exactly one.

    Raises:
        ValueError: If ``pipeline(model)`` was not called.
        RuntimeError: If the model was not profiled yet (no forward with grad enabled ran
            and no ``example_input`` was given).
    """
    gates = _pipeline_of(model).build()
    if gates is None:
        raise RuntimeError(
            "the model was not profiled yet: run one training step (a forward with grad "
            "enabled, then backward) or call pipeline(model, example_input=batch)."
        )
    return gates.groups


def trial_profile(model: nn.Module) -> TrialProfile:
    """The model's per-step memory claim as the scheduler sees it.

    The model's per-step memory claim (resident bytes, per-group bytes) as the scheduler
    sees it; pass it to ``PipelineScheduler.admits``.

    Raises:
        ValueError: If ``pipeline(model)`` was not called.
        RuntimeError: If the model was not profiled yet.
    """
    node_groups(model)
    gates = _pipeline_of(model).gates
    assert gates is not None
    return gates.profile
