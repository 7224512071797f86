"""Memory plans for trials that do not fit (HOME), as ``WaterwaveExecutor(memory_plan="home")``.

HOME (He et al., "HOME: A Holistic GPU Memory Management Framework for Deep Learning", IEEE
Trans. Computers 2022) makes a model fit a memory budget by keeping, swapping or recomputing
each unit's saved activations (:func:`waterwave_hpo.fit_memory`). Here the executor is one user
of it: the objective registers its model with :func:`fit_trial_memory`; when the model's plain
training step does not fit the memory the trial's neighbours leave (admission), or when an
earlier attempt of its parameters ran out of memory or was evicted by the pipeline scheduler,
the model gets a plan for that budget instead of the trial waiting or failing. Ours: the
trigger points, the shrink rule for re-runs (:data:`waterwave_hpo.sim.PLAN_SHRINK`), and the
accounting (a registered model reserves its planned peak in the scheduler's ledger for the
trial's life).
"""

from __future__ import annotations

from dataclasses import asdict
from dataclasses import dataclass
import enum
import logging
import threading
from typing import Any

import torch
from torch import nn

from waterwave_hpo import _checks
from waterwave_hpo import _optuna_compat
from waterwave_hpo.host._attrs import ATTR_MEMORY_PLAN
from waterwave_hpo.planning import BUDGET_AWARE
from waterwave_hpo.planning import DEFAULT_BANDWIDTH_BYTES_PER_S
from waterwave_hpo.planning import MemoryPlan
from waterwave_hpo.planning import PlanDoesNotFitError
from waterwave_hpo.planning import remove_memory_plan
from waterwave_hpo.planning._internal import install_plan
from waterwave_hpo.planning._internal import plan_none
from waterwave_hpo.planning._internal import plan_smallest
from waterwave_hpo.planning._internal import profile_units
from waterwave_hpo.scheduler import Phase
from waterwave_hpo.scheduler import TrialProfile
from waterwave_hpo.sim import SimPlan
from waterwave_hpo.trial import current_or_none

_logger = logging.getLogger("waterwave_hpo")

#: A gated model whose gates' claim fits the budget but not beside its neighbours now keeps its
#: gates (and waits for the neighbours) when a plan for the room would make its step slower
#: than this; else the plan replaces the gates. On the simulated device
#: (``experiments/gates_vs_plans.py``), a plan of ~1.0x won or tied against waiting under the
#: gates at every capacity, and one of 1.5x lost at all but one (saturated device: always).
GATED_PLAN_MAX_SLOWDOWN = 1.05


class MemoryPlanMode(str, enum.Enum):
    """Whether the executor plans the memory of trials that do not fit.

    ``OFF``: never (a trial that does not fit waits, is evicted or re-runs with fewer
    neighbours). ``HOME``: a model registered with :func:`fit_trial_memory` runs with a
    keep/swap/recompute plan for the memory left beside its neighbours when its plain step does
    not fit there, and after an out-of-memory error or an eviction.
    """

    OFF = "off"
    HOME = "home"


@dataclass(frozen=True)
class PlanSettings:
    """The executor's planning settings for one ``optimize`` call.

    Attributes:
        mode: Whether to plan at all.
        planner: A budget-aware planner (``"pso"``, ``"capuchin"``, ``"exhaustive"``).
        bandwidth_bytes_per_s: Host<->device copy rate for the cost model.
    """

    mode: MemoryPlanMode = MemoryPlanMode.OFF
    planner: str = "pso"
    bandwidth_bytes_per_s: float = DEFAULT_BANDWIDTH_BYTES_PER_S


class NoPlanFitsError(RuntimeError):
    """Even the smallest memory plan of a trial's model exceeds the device's budget.

    The executor fails the trial alone (never re-runs it: no neighbour leaving can help) and
    records this message as its fail reason.

    Attributes:
        floor_bytes: Parameters + gradients + optimizer state + activations outside every
            placement unit: what no plan goes below.
        smallest_peak_bytes: The smallest planned peak found.
        budget_bytes: The device's budget.
    """

    def __init__(self, floor_bytes: int, smallest_peak_bytes: int, budget_bytes: int) -> None:
        self.floor_bytes = floor_bytes
        self.smallest_peak_bytes = smallest_peak_bytes
        self.budget_bytes = budget_bytes
        super().__init__(
            f"no memory plan fits the device's budget of {_checks.format_bytes(budget_bytes)}: "
            f"the smallest plan peaks at {_checks.format_bytes(smallest_peak_bytes)}, and the "
            f"floor no plan goes below (parameters + gradients + optimizer state + activations "
            f"outside the placement units) is {_checks.format_bytes(floor_bytes)}. Use a "
            "smaller batch or model, or a larger memory_budget_bytes."
        )


class DevicePlans:
    """What planning has learnt on one device: plain profiles and their smallest plans.

    Written by trial threads (:func:`fit_trial_memory`), read by the executor's thread for
    ``trials_per_device="auto"`` admission (thread-safe).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: dict[TrialProfile, SimPlan] = {}

    def record(self, plain: TrialProfile, plan: SimPlan) -> None:
        """Remember that a model with ``plain`` profile can be planned down as ``plan`` says."""
        with self._lock:
            self._plans[plain] = plan
            while len(self._plans) > 64:
                del self._plans[next(iter(self._plans))]

    def largest(self) -> tuple[TrialProfile, SimPlan] | None:
        """The largest plain profile seen (by peak bytes) with its plan, or ``None``."""
        with self._lock:
            if not self._plans:
                return None
            profile = max(self._plans, key=lambda p: p.peak_bytes)
            return profile, self._plans[profile]


@dataclass
class TrialPlanning:
    """One attempt's planning: what :func:`fit_trial_memory` needs, and what it decided.

    Created by the executor for each attempt when ``memory_plan="home"``; the attempt's
    thread fills in the results; the executor's thread reads them once the outcome is reported
    (the outcome queue orders the two).

    Attributes:
        settings: The executor's planning settings.
        cap_bytes: A re-run's limit: its plan may use at most this many bytes; ``None`` for a
            first attempt.
        device_plans: The device's record of plans (for admission), set by the slot.
        footprint_bytes: The peak bytes the registered model was admitted with (its plan's
            predicted peak, or its plain peak), or ``None`` before registration.
        smallest_peak_bytes: The smallest planned peak of the registered model.
        plan: The plan installed, or ``None`` when the plain step fitted.
    """

    settings: PlanSettings
    cap_bytes: int | None = None
    device_plans: DevicePlans | None = None
    footprint_bytes: int | None = None
    smallest_peak_bytes: int | None = None
    plan: MemoryPlan | None = None

    def rerun_cap_bytes(self, shrink: float) -> int | None:
        """The cap for a re-run after this attempt failed, or ``None`` if a plan cannot help.

        ``shrink`` times the footprint this attempt had, when the registered model can be
        planned that small; ``None`` when no model was registered or it cannot.
        """
        if self.footprint_bytes is None or self.smallest_peak_bytes is None:
            return None
        cap = int(shrink * self.footprint_bytes)
        return cap if cap >= self.smallest_peak_bytes else None


def fit_trial_memory(
    model: nn.Module,
    *,
    example_input: Any,
    optimizer: torch.optim.Optimizer | None = None,
) -> nn.Module:
    """Register the trial's model with the executor, which plans its memory if it must.

    Call it in an objective run by ``WaterwaveExecutor(memory_plan="home")``, on the model
    on its device, before training. It profiles ``example_input`` (two training steps whose
    effects are undone, as :func:`waterwave_hpo.fit_memory` does: their time is its cost, which
    matters for trials of few steps) and compares the step's peak with the memory the
    trial's neighbours leave on the device (the pipeline scheduler's budget less their claims):

    * it fits: the model runs as it is;
    * it does not, or an earlier attempt of the same parameters ran out of memory or was
      evicted: the model gets a HOME plan (keep/swap/recompute per unit, He et al., IEEE TC
      2022) for that memory, at most ``PLAN_SHRINK`` of the failed attempt's footprint for a
      re-run (:func:`waterwave_hpo.fit_memory` with the executor's ``memory_planner``); when
      even the smallest plan does not fit beside the neighbours, the smallest plan, which then
      waits for memory.

    The footprint it runs with (planned or plain peak) is reserved in the scheduler's ledger
    until the trial ends, so neighbours and ``trials_per_device="auto"`` count it; the plan is
    recorded in the trial's system attribute ``waterwave:memory_plan``
    (:func:`~waterwave_hpo.executor.trial_memory_plan`) and in ``trials.csv``. Outside such a
    trial (no executor, ``memory_plan="off"``) it returns ``model`` untouched.

    Example::

        def objective(trial):
            model = build(trial).to(ww.current().device)
            opt = torch.optim.Adam(model.parameters())
            model = ww.fit_trial_memory(model, example_input=batch, optimizer=opt)
            ...  # train as usual

        ww.WaterwaveExecutor(memory_budget_bytes=..., memory_plan="home").optimize(study, objective)

    Args:
        model: The trial's model, on its device, in training mode.
        example_input: A batch of the size it will train on (a tensor or a tuple of
            positional arguments).
        optimizer: The optimizer whose state counts towards the footprint, or ``None``.

    A model with ``ww.pipeline`` gates (Waterwave, Sec. 4) gets one of the two, picked by the
    bytes: the gates when their claim at the step's peak (parameters, gradients and every
    NodeGroup's saved bytes) fits the memory its neighbours leave, since they then cost no step
    time and release each group as its backward ends; else a plan for that memory, and the
    gates are removed from the model (its planned footprint is then its one claim, as for a
    model without gates). When the claim fits the budget and only the neighbours leave too
    little, the plan is taken only if it costs at most ``GATED_PLAN_MAX_SLOWDOWN`` (1.05x) of
    the step's time; else the gates wait for the neighbours. The gates are kept when they
    already reserve for this trial (a training step ran before this call) or when no plan
    fits. A re-run after an out-of-memory error or an eviction is planned, as any re-run.
    Measured in ``experiments/results/2026-11-25-gates-vs-plans/``.

    Returns:
        ``model`` (the same object), with a plan installed if it needed one.

    Raises:
        TypeError: If ``model`` is not an ``nn.Module``.
        ValueError: As :func:`waterwave_hpo.fit_memory`.
        NoPlanFitsError: If even the smallest plan exceeds the device's budget (the trial ends
            FAIL with this reason, naming the floor in bytes).
        waterwave_hpo.scheduler.BudgetExceededError: If the scheduler evicts the trial while it
            waits for its footprint (the executor re-runs it with a smaller plan).
    """
    from waterwave_hpo.nodegroup._internal import gated_claim_bytes
    from waterwave_hpo.nodegroup._internal import gates_declared
    from waterwave_hpo.nodegroup._internal import gates_muted
    from waterwave_hpo.nodegroup._internal import has_pipeline
    from waterwave_hpo.nodegroup._internal import remove_pipeline

    if not isinstance(model, nn.Module):
        raise _checks.type_error("model", model, "a torch.nn.Module", "pass the trial's model")
    context = current_or_none()
    planning: TrialPlanning | None = None if context is None else context.planning
    if context is None or planning is None or planning.settings.mode is MemoryPlanMode.OFF:
        return model
    scheduler = context.scheduler
    gated = has_pipeline(model)
    if gated and scheduler is not None and gates_declared(model, scheduler, context.trial_number):
        _keep_gates(context.trial_number, "they already reserve its memory for this trial")
        return model
    # The gates' own profile first: profiling for a plan installs saved-tensor hooks of its
    # own, under which the gates' profiler would see no saved bytes.
    claim = gated_claim_bytes(model, example_input) if gated else None
    settings = planning.settings
    bandwidth = settings.bandwidth_bytes_per_s
    with gates_muted():  # the two profiling steps reserve nothing
        profile, modules = profile_units(model, example_input, optimizer)
    plain = plan_none(profile, 0, bandwidth_bytes_per_s=bandwidth).prediction
    smallest = plan_smallest(profile, bandwidth_bytes_per_s=bandwidth).prediction
    planning.smallest_peak_bytes = smallest.peak_bytes
    # A registered model holds its footprint for the trial's life (no NodeGroup gates release
    # activations per step), so its claim is all resident: one empty group for the simulator.
    plain_profile = TrialProfile.of(plain.peak_bytes, (0,))
    if planning.device_plans is not None:
        planning.device_plans.record(
            plain_profile,
            SimPlan(smallest.peak_bytes, max(1.0, smallest.step_s / max(plain.step_s, 1e-12))),
        )
    budget = None if scheduler is None else int(scheduler.budget_bytes)
    plan: MemoryPlan | None = None
    if gated and budget is not None and smallest.peak_bytes > budget:
        _keep_gates(context.trial_number, "no memory plan fits the budget")
        return model
    if budget is not None and smallest.peak_bytes > budget:
        raise NoPlanFitsError(
            profile.static_bytes + profile.other_saved_bytes, smallest.peak_bytes, budget
        )
    if gated:
        claim = claim or plain.peak_bytes
        target = _target_bytes(planning, scheduler, context.trial_number, claim)
        if target is None:
            # The gates' claim fits beside the neighbours: they govern its memory. A re-run
            # after an OOM or an eviction is planned for PLAN_SHRINK of this claim.
            planning.footprint_bytes = claim
            _keep_gates(
                context.trial_number,
                f"their claim at the step's peak, {_checks.format_bytes(claim)}, fits the "
                "memory its neighbours leave",
            )
            return model
        if target < plain.peak_bytes:
            plan = _install(
                model,
                profile,
                modules,
                max(target, smallest.peak_bytes),
                settings,
                context.trial_number,
            )
            slowdown = plan.predicted_step_seconds / max(plain.step_s, 1e-12)
            fits_alone = budget is None or claim <= budget
            if planning.cap_bytes is None and fits_alone and slowdown > GATED_PLAN_MAX_SLOWDOWN:
                # Short of room only because of its neighbours, who will leave: waiting under
                # the gates beats a plan this slow (experiments/results/2026-11-25-gates-vs-plans).
                remove_memory_plan(model)
                planning.footprint_bytes = claim
                _keep_gates(
                    context.trial_number,
                    f"their claim, {_checks.format_bytes(claim)}, fits the budget but not "
                    f"beside its neighbours now, and a plan for the room would take "
                    f"{slowdown:.2f}x the step's time (over {GATED_PLAN_MAX_SLOWDOWN}x)",
                )
                return model
        remove_pipeline(model)  # the plan's footprint replaces the gates' claims
        _logger.info(
            "Trial %d: its ww.pipeline gates would claim %s at the step's peak, more than the "
            "%s it may use: the gates are removed and it runs with a memory plan instead.",
            context.trial_number,
            _checks.format_bytes(claim),
            _checks.format_bytes(max(target, 0)),
        )
    else:
        target = _target_bytes(planning, scheduler, context.trial_number, plain.peak_bytes)
    if plan is not None:
        footprint = plan.predicted_peak_bytes
    elif target is not None and target < plain.peak_bytes:
        target = max(target, smallest.peak_bytes)
        plan = _install(model, profile, modules, target, settings, context.trial_number)
        footprint = plan.predicted_peak_bytes
    else:
        remove_memory_plan(model)
        footprint = plain.peak_bytes
    planning.plan = plan
    planning.footprint_bytes = footprint
    if plan is not None:
        for trial in context.batch or (context.trial,):  # a fused batch: each of its trials
            _record_plan(trial, plan)
        _logger.info(
            "Trial %d: its plain step needs %s, more than the %s it may use; it runs with a "
            "%r memory plan (predicted peak %s, %.2fx the plain step's time).",
            context.trial_number,
            _checks.format_bytes(plain.peak_bytes),
            _checks.format_bytes(plan.budget_bytes),
            plan.planner,
            _checks.format_bytes(plan.predicted_peak_bytes),
            plan.predicted_step_seconds / max(plain.step_s, 1e-12),
        )
    if scheduler is not None:
        key = ("fit_trial_memory", id(model))
        scheduler.declare_profile(context.trial_number, TrialProfile.of(footprint, (0,)), key=key)
        scheduler.acquire(context.trial_number, -1, footprint, Phase.RESIDENT)
    return model


def _keep_gates(trial_number: int, why: str) -> None:
    _logger.info(
        "Trial %d: its model runs under its ww.pipeline gates, unplanned: %s.", trial_number, why
    )


def _target_bytes(
    planning: TrialPlanning, scheduler: Any, trial_number: int, plain_peak_bytes: int
) -> int | None:
    """The bytes to plan for, or ``None`` to run the plain step."""
    room = None
    if scheduler is not None:
        room = int(scheduler.room_bytes(trial_number)) - int(scheduler.held_bytes(trial_number))
    if planning.cap_bytes is not None:
        return planning.cap_bytes if room is None else min(room, planning.cap_bytes)
    if room is None or room >= plain_peak_bytes:
        return None
    return room


def _install(
    model: nn.Module,
    profile: Any,
    modules: Any,
    target_bytes: int,
    settings: PlanSettings,
    trial_number: int,
) -> MemoryPlan:
    try:
        return install_plan(
            model,
            profile,
            modules,
            target_bytes,
            planner=settings.planner,
            seed=0,
            bandwidth_bytes_per_s=settings.bandwidth_bytes_per_s,
        )
    except PlanDoesNotFitError:
        if settings.planner == "pso":
            raise
        # A greedy planner can miss what the swarm finds: HOME's swarm is seeded with the
        # smallest baseline plan, so it finds a plan for any target at or above its peak.
        return install_plan(
            model,
            profile,
            modules,
            target_bytes,
            planner="pso",
            seed=0,
            bandwidth_bytes_per_s=settings.bandwidth_bytes_per_s,
        )


def _record_plan(trial: Any, plan: MemoryPlan) -> None:
    """Write ``plan`` into the trial's system attributes (the executor's record)."""
    study = getattr(trial, "study", None)
    if study is None:  # a Ray Tune trial co-hosted by tune_hosts(): no Optuna record
        return
    _optuna_compat.set_system_attr(
        study, _optuna_compat.trial_id(trial), ATTR_MEMORY_PLAN, asdict(plan)
    )


def plan_settings(memory_plan: object, memory_planner: object) -> PlanSettings:
    """Check ``memory_plan=`` and ``memory_planner=`` (every executor's and ``tune_hosts()``'s).

    Raises:
        TypeError: If ``memory_plan`` is not a str, or as :func:`check_memory_planner`.
        ValueError: If ``memory_plan`` is not ``"home"`` or ``"off"``, or as
            :func:`check_memory_planner`.
    """
    if not isinstance(memory_plan, str):
        raise _checks.type_error("memory_plan", memory_plan, "a str", "pass 'home' or 'off'")
    return PlanSettings(
        mode=_checks.check_choice(
            "memory_plan",
            memory_plan,
            MemoryPlanMode,
            "pass 'home' to plan trials that do not fit, or 'off'",
        ),
        planner=check_memory_planner(memory_planner),
    )


def check_memory_planner(value: object) -> str:
    """Check ``memory_planner=`` of the executor: a budget-aware planner's name.

    Raises:
        TypeError: If ``value`` is not a string.
        ValueError: If it names no budget-aware planner.
    """
    if not isinstance(value, str):
        raise _checks.type_error(
            "memory_planner", value, "a str", f"pass one of {sorted(BUDGET_AWARE)}"
        )
    if value not in BUDGET_AWARE:
        raise _checks.value_error(
            "memory_planner",
            value,
            "is not a planner that plans for a budget",
            f"pass one of {sorted(BUDGET_AWARE)}",
        )
    return value


def find_no_plan_fits(error: BaseException | None) -> NoPlanFitsError | None:
    """The :class:`NoPlanFitsError` in ``error``'s cause chain, or ``None``."""
    seen: set[int] = set()
    current = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, NoPlanFitsError):
            return current
        current = current.__cause__ or current.__context__
    return None
