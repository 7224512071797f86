"""The simulator beside the measurement: predicted makespan of every method, and the error."""

from __future__ import annotations

from waterwave_hpo.bench._methods import Method
from waterwave_hpo.bench._runners import MethodRun
from waterwave_hpo.scheduler import TrialProfile
from waterwave_hpo.sim import Sharing
from waterwave_hpo.sim import SimDevice
from waterwave_hpo.sim import SimTrial
from waterwave_hpo.sim import simulate

#: A CUDA context's device memory, bytes (charged per process under spatial sharing).
CUDA_CONTEXT_BYTES = 300 << 20
_UNLIMITED = 1 << 62


def sim_trials(temporal: MethodRun, profiles: list[TrialProfile]) -> list[SimTrial] | None:
    """The trials as the simulator sees them: each trial's profile (bytes) and its solo step
    time, from the temporal run (its whole duration / steps: set-up included); ``None`` when
    the temporal run did not complete every trial."""
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


def sharing_of(method: Method, k: int) -> Sharing:
    """How the simulator models ``method``."""
    if method is Method.TEMPORAL:
        return Sharing(1, policy=None, retry_on_oom=False)
    if method in (Method.OPTUNA_THREADS, Method.CUDA_MALLOC_ASYNC):
        return Sharing(k, policy=None, retry_on_oom=False)
    if method is Method.SPATIAL:
        return Sharing(k, policy=None, processes=True, retry_on_oom=False)
    policy = "fifo" if method is Method.WATERWAVE_FIFO else "waterwave"
    return Sharing(k, policy=policy, retry_on_oom=True)


def device_for(method: Method, capacity_bytes: int, cuda: bool, parallelism: float) -> SimDevice:
    """The simulated device: on the CPU only the waterwave scheduler enforces the capacity
    (the stock methods' memory is not bounded there); on CUDA every method meets it."""
    enforced = cuda or method.gated
    return SimDevice(
        capacity_bytes if enforced else _UNLIMITED,
        compute_parallelism=parallelism,
        context_bytes=CUDA_CONTEXT_BYTES if cuda else 0,
    )


def fit_parallelism(
    threads: MethodRun, trials: list[SimTrial], capacity_bytes: int, cuda: bool
) -> float:
    """The device's compute parallelism (>= 1) that best reproduces the measured Optuna-threads
    makespan; the other methods are then predicted with it (not fitted to them)."""
    best, best_err = 1.0, float("inf")
    steps = 24
    for i in range(steps + 1):
        p = 1.0 + (max(threads.k, 1) - 1.0) * i / steps
        device = device_for(Method.OPTUNA_THREADS, capacity_bytes, cuda, p)
        predicted = simulate(trials, device, sharing_of(Method.OPTUNA_THREADS, threads.k))
        err = abs(predicted.makespan_s - threads.makespan_s)
        if err < best_err - 1e-12:
            best, best_err = p, err
    return best


def predict(
    run: MethodRun, trials: list[SimTrial], capacity_bytes: int, cuda: bool, parallelism: float
) -> float:
    """The simulator's makespan for ``run``'s method, seconds."""
    device = device_for(run.method, capacity_bytes, cuda, parallelism)
    return simulate(trials, device, sharing_of(run.method, run.k)).makespan_s
