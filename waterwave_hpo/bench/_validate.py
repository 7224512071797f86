"""The simulator beside the measurement: predicted makespan of every method, and the error."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

from waterwave_hpo.bench._calibrate import PlanProfile
from waterwave_hpo.bench._methods import Method
from waterwave_hpo.bench._runners import MethodRun
from waterwave_hpo.scheduler import TrialProfile
from waterwave_hpo.sim import Sharing
from waterwave_hpo.sim import SimDevice
from waterwave_hpo.sim import SimTrial
from waterwave_hpo.sim import simulate

#: A CUDA context's device memory, bytes (charged per process under spatial sharing). An assumed
#: value for the simulator's prediction, not a measurement; the bench's measured peaks are real.
CUDA_CONTEXT_BYTES = 300 << 20
_UNLIMITED = 1 << 62


def sim_trials(temporal: MethodRun, profiles: list[TrialProfile]) -> list[SimTrial] | None:
    """The trials as the simulator sees them.

    The trials as the simulator sees them: each trial's profile (bytes) and its solo step
    time, from the temporal run (its whole duration / steps: set-up included); ``None`` when
    the temporal run did not complete every trial.
    """
    solo: dict[int, float] = {}
    for r in temporal.records:
        if r.complete:
            solo[r.index] = (r.end_s - r.start_s) / temporal.spec.steps
    if len(solo) != len(profiles):
        return None
    return [
        SimTrial.uniform(p, solo[i], temporal.spec.steps, name=str(i))
        for i, p in enumerate(profiles)
    ]


def planned_sim_trials(trials: list[SimTrial], plans: list[PlanProfile]) -> list[SimTrial]:
    """``trials`` as ``waterwave-plans`` runs them.

    Each registered model holds its plain (or planned) peak for the whole trial, with no
    NodeGroups, and can be planned down as its :class:`PlanProfile` says; solo timings as in
    ``trials``.
    """
    out = []
    for trial, plan in zip(trials, plans, strict=True):
        step_s = sum(trial.forward_s) + sum(trial.backward_s)
        profile = TrialProfile.of(plan.plain_peak_bytes, (0,))
        out.append(
            SimTrial.uniform(profile, step_s, trial.steps, name=trial.name, plan=plan.sim_plan())
        )
    return out


def _started(device: str, results: Any) -> None:
    import torch

    import waterwave_hpo.bench._train  # noqa: F401  (what a spatial worker imports)

    if device.startswith("cuda"):
        torch.cuda.init()  # type: ignore[no-untyped-call]
        torch.zeros(1, device=device)
    results.put(time.time())


def measure_process_start_s(device: str) -> float:
    """Seconds from starting a spawned process until it is ready.

    Seconds from starting a spawned process until it has imported torch and the bench (and,
    on CUDA, created its context): what each of spatial sharing's processes pays first.
    Measured apart from the spatial run, so the simulator predicts that run, not fits it.
    """
    ctx = multiprocessing.get_context("spawn")
    results: Any = ctx.Queue()
    t0 = time.time()
    child = ctx.Process(target=_started, args=(device, results))
    child.start()
    ready = float(results.get())
    child.join()
    return max(0.0, ready - t0)


def sharing_of(method: Method, k: int, process_start_s: float = 0.0) -> Sharing:
    """How the simulator models ``method`` (``process_start_s``: spatial's start-up).

    Raises:
        ValueError: For ``Method.FUSED``: the simulator does not model fused trials.
    """
    if method is Method.FUSED:
        raise ValueError(
            "method=Method.FUSED: the simulator does not model fused trials (one model for K); "
            "compare the fused method's measured makespan instead"
        )
    if method is Method.TEMPORAL:
        return Sharing(1, policy=None, retry_on_oom=False)
    if method in (Method.OPTUNA_THREADS, Method.CUDA_MALLOC_ASYNC):
        return Sharing(k, policy=None, retry_on_oom=False)
    if method is Method.SPATIAL:
        return Sharing(
            k, policy=None, processes=True, retry_on_oom=False, process_start_s=process_start_s
        )
    policy = "fifo" if method is Method.WATERWAVE_FIFO else "waterwave"
    return Sharing(
        k, policy=policy, retry_on_oom=True, memory_plans=method is Method.WATERWAVE_PLANS
    )


def device_for(method: Method, capacity_bytes: int, cuda: bool, parallelism: float) -> SimDevice:
    """The simulated device.

    The simulated device: on the CPU only the waterwave scheduler enforces the capacity
    (the stock methods' memory is not bounded there); on CUDA every method meets it.
    """
    enforced = cuda or method.budgeted
    return SimDevice(
        capacity_bytes if enforced else _UNLIMITED,
        compute_parallelism=parallelism,
        context_bytes=CUDA_CONTEXT_BYTES if cuda else 0,
    )


def fit_parallelism(
    threads: MethodRun, trials: list[SimTrial], capacity_bytes: int, cuda: bool
) -> float:
    """The device's compute parallelism (0.25 ..

    k; below 1 when co-running trials interfere, as threads oversubscribing CPU cores do) that best
    reproduces the measured Optuna-threads makespan; the other methods are then predicted with it
    (not fitted to them).
    """
    best, best_err = 1.0, float("inf")
    top = float(max(threads.k, 1))
    grid = [0.25 + 0.05 * i for i in range(16)] + [1.0 + (top - 1.0) * i / 24 for i in range(25)]
    for p in grid:
        device = device_for(Method.OPTUNA_THREADS, capacity_bytes, cuda, p)
        predicted = simulate(trials, device, sharing_of(Method.OPTUNA_THREADS, threads.k))
        err = abs(predicted.makespan_s - threads.makespan_s)
        if err < best_err - 1e-12:
            best, best_err = p, err
    return best


def predict(
    run: MethodRun,
    trials: list[SimTrial],
    capacity_bytes: int,
    cuda: bool,
    parallelism: float,
    process_start_s: float = 0.0,
) -> float:
    """The simulator's makespan for ``run``'s method, seconds."""
    device = device_for(run.method, capacity_bytes, cuda, parallelism)
    sharing = sharing_of(run.method, run.k, process_start_s)
    return simulate(trials, device, sharing).makespan_s
