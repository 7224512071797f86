"""``fit_memory(model, budget_bytes)`` and ``plan_of(model)``: HOME for any training loop."""

from __future__ import annotations

from dataclasses import dataclass
import time
from typing import Any
import weakref

import torch
from torch import nn

from waterwave_hpo import _checks
from waterwave_hpo.nodegroup._internal import has_pipeline
from waterwave_hpo.planning._apply import PlanHooks
from waterwave_hpo.planning._cost import DEFAULT_BANDWIDTH_BYTES_PER_S
from waterwave_hpo.planning._ledger import StepLedger
from waterwave_hpo.planning._plan import MemoryPlan
from waterwave_hpo.planning._plan import StepProfile
from waterwave_hpo.planning._planners import PLANNERS
from waterwave_hpo.planning._units import UnitModules
from waterwave_hpo.planning._units import profile_units


@dataclass
class _Installed:
    plan: MemoryPlan
    profile: StepProfile
    hooks: PlanHooks
    ledger: StepLedger


_INSTALLED: weakref.WeakKeyDictionary[nn.Module, _Installed] = weakref.WeakKeyDictionary()


def fit_memory(
    model: nn.Module,
    budget_bytes: int,
    *,
    example_input: Any,
    planner: str = "pso",
    optimizer: torch.optim.Optimizer | None = None,
    seed: int = 0,
    bandwidth_bytes_per_s: float = DEFAULT_BANDWIDTH_BYTES_PER_S,
) -> nn.Module:
    """Make one training step of ``model`` fit in ``budget_bytes``: keep, swap or recompute.

    HOME (He et al., "HOME: A Holistic GPU Memory Management Framework for Deep Learning",
    IEEE Trans. Computers 2022): every placement unit (the NodeGroup profiler's atoms: module
    boundaries one tensor alone crosses) keeps its saved activations on the device, swaps them
    to host memory and back before backward, or recomputes them in backward; the placement of
    the whole model is chosen at once by a planner over a cost model of step time and peak
    bytes. Profiles one step on ``example_input`` (undone: parameters, gradients, buffers such
    as BatchNorm statistics and the RNG state are left as they were), plans, and installs the
    plan with hooks. Losses and gradients are those of the bare model, bit for bit where the
    ops are deterministic, dropout included.

    Example::

        model = ww.fit_memory(model, 2 << 30, example_input=batch, optimizer=opt)
        ww.plan_of(model).choices  # {"layer1": "keep", "layer2": "recompute", ...}

    Args:
        model: The model, on its device, in the mode it trains in.
        budget_bytes: Device bytes one step may use at its peak: parameters, gradients,
            optimizer state and saved activations (``> 0``).
        example_input: A batch of the size it will train on: a tensor, or a tuple of positional
            arguments.
        planner: ``"pso"`` (HOME), ``"exhaustive"`` (exact, at most 10 units),
            ``"capuchin"`` (greedy), or a baseline that ignores the budget: ``"none"``
            (PyTorch), ``"swap_all"`` (vDNN), ``"checkpoint_sqrt"`` (Chen et al. 2016).
        optimizer: The optimizer whose state counts towards the budget (estimated from its
            type before its first step), or ``None``.
        seed: Seed of the ``"pso"`` planner; the same seed gives the same plan.
        bandwidth_bytes_per_s: Host<->device copy rate for the cost model (on CUDA measure it;
            on the CPU the default, 12 GB/s, models a PCIe 3.0 x16 link).

    Returns:
        ``model`` (the same object), with the plan installed. Calling again re-plans.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If ``budget_bytes <= 0``, ``planner`` is unknown, the model has
            ``ww.pipeline`` gates, or ``budget_bytes`` is below the floor (parameters +
            gradients + optimizer state), named in bytes in the message.
        PlanDoesNotFitError: (a ``ValueError``) If a budget-aware planner finds no plan whose
            predicted peak is within the budget.
        CheckpointedModelError: (a ``ValueError``) If the model already uses
            ``torch.utils.checkpoint``.
    """
    if not isinstance(model, nn.Module):
        raise _checks.type_error("model", model, "a torch.nn.Module", "pass the model to plan")
    _checks.check_int("budget_bytes", budget_bytes, minimum=1, fix="pass the budget in bytes")
    if not isinstance(planner, str) or planner not in PLANNERS:
        raise _checks.value_error(
            "planner", planner, "is not a planner", f"pass one of {sorted(PLANNERS)}"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise _checks.type_error(
            "optimizer", optimizer, "a torch.optim.Optimizer or None", "pass the trial's optimizer"
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise _checks.type_error("seed", seed, "an int", "pass e.g. seed=0")
    _checks.check_number(
        "bandwidth_bytes_per_s", bandwidth_bytes_per_s, fix="pass the copy bandwidth in bytes/s"
    )
    if has_pipeline(model):
        raise ValueError(
            "model has ww.pipeline gates; fit_memory does not combine with them: the gates "
            "reserve each NodeGroup's profiled (unplanned) saved bytes, which a plan changes. "
            "Use one or the other; under WaterwaveExecutor(memory_plan='home'), "
            "ww.fit_trial_memory picks one by bytes."
        )
    if example_input is None:
        raise _checks.type_error(
            "example_input",
            example_input,
            "a tensor or a tuple of positional arguments",
            "pass a batch of the size the model trains on, e.g. example_input=x_batch",
        )
    old = _INSTALLED.pop(model, None)
    if old is not None:
        old.hooks.remove()  # profile the bare model
    try:
        profile, modules = profile_units(model, example_input, optimizer)
        install_plan(
            model,
            profile,
            modules,
            budget_bytes,
            planner=planner,
            seed=seed,
            bandwidth_bytes_per_s=float(bandwidth_bytes_per_s),
        )
    except BaseException:
        # A refused re-plan leaves the working plan in place, not a bare model.
        if old is not None and model not in _INSTALLED:
            old.hooks.install()
            _INSTALLED[model] = old
        raise
    return model


def install_plan(
    model: nn.Module,
    profile: StepProfile,
    modules: UnitModules,
    budget_bytes: int,
    *,
    planner: str,
    seed: int = 0,
    bandwidth_bytes_per_s: float = DEFAULT_BANDWIDTH_BYTES_PER_S,
) -> MemoryPlan:
    """Plan ``model`` from its profile for ``budget_bytes`` and install the plan.

    The second half of :func:`fit_memory`, for callers that profiled the model already
    (:func:`~waterwave_hpo.planning._units.profile_units`), such as the executor, which decides
    from the profile whether a trial needs a plan at all. Replaces a plan installed before.

    Args:
        model: The model ``profile`` and ``modules`` were measured on.
        profile: Its step profile.
        modules: Its units' module calls, from the same profiling.
        budget_bytes: Device bytes one step may use at its peak (``> 0``).
        planner: A name in ``PLANNERS``.
        seed: Seed of the ``"pso"`` planner.
        bandwidth_bytes_per_s: Host<->device copy rate for the cost model.

    Returns:
        The installed plan.

    Raises:
        ValueError: If ``budget_bytes`` is below the floor (parameters + gradients + optimizer
            state), named in bytes in the message.
        PlanDoesNotFitError: (a ``ValueError``) If a budget-aware planner finds no plan whose
            predicted peak is within the budget.
    """
    old = _INSTALLED.pop(model, None)
    if old is not None:
        old.hooks.remove()
    if profile.static_bytes > budget_bytes:
        raise ValueError(
            f"budget_bytes={budget_bytes} is below the floor no plan can go under: "
            f"{profile.static_bytes} bytes of parameters + gradients + optimizer state. "
            "Raise the budget or shrink the model."
        )
    started = time.perf_counter()
    result = PLANNERS[planner](
        profile, budget_bytes, bandwidth_bytes_per_s=bandwidth_bytes_per_s, seed=seed
    )
    search_s = time.perf_counter() - started
    names = _unique([u.name for u in profile.units])
    plan = MemoryPlan(
        choices={name: c.value for name, c in zip(names, result.choices, strict=True)},
        predicted_peak_bytes=result.prediction.peak_bytes,
        predicted_step_seconds=result.prediction.step_s,
        planner=planner,
        budget_bytes=budget_bytes,
        search_s=search_s,
    )
    ledger = StepLedger()
    hooks = PlanHooks(model, modules, profile, result.choices, ledger)
    hooks.install()
    _INSTALLED[model] = _Installed(plan, profile, hooks, ledger)
    return plan


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        k = seen.get(name, 0)
        seen[name] = k + 1
        out.append(name if k == 0 else f"{name}#{k}")
    return out


def _installed(model: nn.Module) -> _Installed:
    found = _INSTALLED.get(model)
    if found is None:
        raise ValueError(
            f"model {type(model).__name__} has no memory plan; call "
            "waterwave_hpo.fit_memory(model, budget_bytes, example_input=batch) first."
        )
    return found


def plan_of(model: nn.Module) -> MemoryPlan:
    """The :class:`MemoryPlan` that :func:`fit_memory` installed on ``model``.

    Raises:
        ValueError: If ``fit_memory`` was not called on ``model``.
    """
    return _installed(model).plan


def step_profile_of(model: nn.Module) -> StepProfile:
    """The profile (units, static bytes) the installed plan was made from.

    Raises:
        ValueError: If ``fit_memory`` was not called on ``model``.
    """
    return _installed(model).profile


def memory_ledger(model: nn.Module) -> StepLedger:
    """The ledger of saved-activation device bytes the installed plan's hooks keep.

    ``ledger.peak_bytes + step_profile_of(model).static_bytes`` is the measured peak that
    ``plan_of(model).predicted_peak_bytes`` bounds; ``ledger.reset_peak()`` between steps.

    Raises:
        ValueError: If ``fit_memory`` was not called on ``model``.
    """
    return _installed(model).ledger


def remove_memory_plan(model: nn.Module) -> None:
    """Take the installed plan off ``model`` (no-op without one)."""
    old = _INSTALLED.pop(model, None)
    if old is not None:
        old.hooks.remove()
