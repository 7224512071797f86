"""``predict_packing``: how many trials to co-host, decided by simulation before launching."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from waterwave_hpo import _checks
from waterwave_hpo.scheduler import TrialProfile
from waterwave_hpo.scheduler import make_policy
from waterwave_hpo.sim._engine import simulate
from waterwave_hpo.sim._result import SimResult
from waterwave_hpo.sim._spec import Sharing
from waterwave_hpo.sim._spec import SimDevice
from waterwave_hpo.sim._spec import SimPlan
from waterwave_hpo.sim._spec import SimTrial


@dataclass(frozen=True)
class PackingOption:
    """One candidate packing: ``k`` trials at once.

    Attributes:
        k: Trials co-hosted at once.
        fits: Whether the policy's ``fits`` admits ``k`` of the largest trials together.
        makespan_s: Simulated seconds for all trials.
        evictions: Simulated evictions (deadlocks the scheduler broke by failing a trial).
        ooms: Simulated out-of-memory errors (only without a ledger).
        n_failed: Trials that ended failed.
    """

    k: int
    fits: bool
    makespan_s: float
    evictions: int
    ooms: int
    n_failed: int


@dataclass(frozen=True)
class PackingPrediction:
    """The simulator's choice of ``trials_per_device``.

    Attributes:
        best_k: The ``k`` with the shortest makespan among those where no trial fails (ties:
            the smaller ``k``, fewer threads and less risk).
        speedup: ``makespan_s(k=1) / makespan_s(best_k)``.
        options: Every ``k`` simulated, ascending.
    """

    best_k: int
    speedup: float
    options: tuple[PackingOption, ...]

    def option(self, k: int) -> PackingOption:
        """The option for ``k``.

        Raises:
            KeyError: If ``k`` was not simulated.
        """
        for o in self.options:
            if o.k == k:
                return o
        raise KeyError(f"k={k} was not simulated; options are k in {[o.k for o in self.options]}.")


def predict_packing(
    trials: Sequence[SimTrial | TrialProfile],
    capacity_bytes: int,
    policy: object = "waterwave",
    *,
    max_k: int = 16,
    compute_parallelism: float = 1.0,
    step_s: float = 1.0,
    steps: int = 4,
    memory_plans: bool = False,
) -> PackingPrediction:
    """Predict the best ``trials_per_device`` for these trials on a device, before launching.

    Simulates the trials (:func:`simulate`) with ``k = 1 .. max_k`` at once under ``policy`` and
    picks the fastest ``k`` in which no trial fails. ``trials_per_device="auto"`` calls it
    (through :func:`predict_auto_packing`) once a trial's NodeGroup gates have declared its
    profile (``waterwave_hpo.nodegroup.trial_profile``).

    Args:
        trials: The trials to run. A bare :class:`~waterwave_hpo.scheduler.TrialProfile` is
            timed as :meth:`SimTrial.uniform` with ``step_s`` seconds per step and ``steps``
            steps (only memory then tells the options apart, plus ``compute_parallelism``).
        capacity_bytes: The device's memory for trials, in bytes (> 0).
        policy: ``"waterwave"``, ``"fifo"``, a ``Policy``, or ``None`` (stock allocator: an
            allocation that does not fit is an out-of-memory error).
        max_k: The largest ``k`` to try (>= 1).
        compute_parallelism: How many solo trials' kernels the device runs at once (>= 1);
            see :class:`SimDevice`.
        step_s: Seconds per step for bare profiles (> 0).
        steps: Steps per trial for bare profiles (>= 1).
        memory_plans: Simulate ``WaterwaveExecutor(memory_plan="home")``: trials with a
            :class:`SimPlan` that do not fit beside their neighbours run with a plan
            (``Sharing(memory_plans=True)``). Call once with and once without to compare
            co-hosting with and without plans.

    Returns:
        The prediction; ``best_k`` is 1 if every larger ``k`` fails a trial or is slower.

    Raises:
        ValueError: If ``trials`` is empty, ``capacity_bytes`` or ``max_k`` is out of range,
            a policy name is unknown, or a single trial does not fit ``capacity_bytes`` alone.
    """
    _checks.check_int("max_k", max_k, minimum=1, fix="pass the most trials at once to try")
    if not step_s > 0:
        raise _checks.value_error("step_s", step_s, "must be > 0", "pass seconds")
    sim_trials = [
        t if isinstance(t, SimTrial) else SimTrial.uniform(t, step_s, steps) for t in trials
    ]
    if not sim_trials:
        raise ValueError("trials is empty; pass the profiles of the trials to run.")
    device = SimDevice(capacity_bytes, compute_parallelism=compute_parallelism)
    too_big = [
        i
        for i, t in enumerate(sim_trials)
        if min(
            t.profile.peak_bytes,
            t.plan.peak_bytes if memory_plans and t.plan is not None else t.profile.peak_bytes,
        )
        > capacity_bytes
    ]
    if too_big:
        i = too_big[0]
        raise ValueError(
            f"trial {i} needs {sim_trials[i].profile.peak_bytes} bytes alone, more than "
            f"capacity_bytes={capacity_bytes}; it cannot run on this device at any packing. "
            "Lower its batch size or pass a larger capacity."
        )
    fits_policy = make_policy("fifo" if policy is None else policy)  # type: ignore[arg-type]
    largest = max((t.profile for t in sim_trials), key=lambda p: p.peak_bytes)
    options = []
    for k in range(1, min(max_k, len(sim_trials)) + 1):
        result: SimResult = simulate(
            sim_trials,
            device,
            Sharing(concurrency=k, policy=policy, retry_on_oom=True, memory_plans=memory_plans),
        )
        options.append(
            PackingOption(
                k=k,
                fits=fits_policy.fits([largest] * k, capacity_bytes),
                makespan_s=result.makespan_s,
                evictions=result.evictions,
                ooms=result.ooms,
                n_failed=result.n_failed,
            )
        )
    ok = [o for o in options if o.n_failed == 0] or options[:1]
    best = min(ok, key=lambda o: (round(o.makespan_s, 9), o.k))
    base = options[0].makespan_s
    return PackingPrediction(
        best_k=best.k,
        speedup=base / best.makespan_s if best.makespan_s > 0 else 1.0,
        options=tuple(options),
    )


#: Trials simulated per candidate ``k`` by :func:`predict_auto_packing`, as a multiple of the
#: largest ``k`` (enough for each ``k`` to reach a steady state and for its last wave to matter).
AUTO_TRIALS_PER_K = 2
#: Training steps per simulated trial in :func:`predict_auto_packing`.
AUTO_STEPS = 2


def predict_auto_packing(
    profile: TrialProfile,
    capacity_bytes: int,
    policy: object,
    max_k: int,
    *,
    plan: SimPlan | None = None,
) -> PackingPrediction:
    """The prediction ``trials_per_device="auto"`` follows, for trials like ``profile``.

    Simulates ``AUTO_TRIALS_PER_K * max_k`` copies of ``profile`` (the largest NodeGroup
    profile the device has seen: the conservative choice when an HPO search mixes model sizes)
    for ``k = 1 .. max_k``. Only memory tells the options apart: each step's time is spread over
    the groups in proportion to their bytes, and the device is assumed to overlap up to
    ``max_k`` co-hosted trials' kernels (``compute_parallelism=max_k``: the setting Waterwave
    targets, trials that each leave the GPU underused). So ``best_k`` is
    the point past which another trial's resident bytes (parameters, gradients) take more from
    the NodeGroup pipeline than its extra work gives: more trials would wait at their gates
    instead of running. The executor then admits a trial only while fewer than ``best_k`` run
    on the device (and the policy's ``fits`` admits it). Work outside the NodeGroups (the
    optimizer step, data loading) is not modelled, and would let more trials overlap: the
    prediction errs towards fewer trials. It takes a fraction of a second (about 0.2-0.5 s on a
    2-core machine for ``max_k=16``); the executor runs it once per new largest profile.

    Args:
        profile: Bytes per step of one trial (> 0 groups).
        capacity_bytes: The device's budget for trials, in bytes (> 0).
        policy: The scheduler's policy (name or :class:`~waterwave_hpo.scheduler.Policy`).
        max_k: The most trials at once to consider (>= 1), ``max_trials_per_device``.
        plan: What a memory plan can do for such a trial
            (``WaterwaveExecutor(memory_plan="home")``), or ``None`` for no plans.

    Raises:
        ValueError: As :func:`predict_packing`; in particular if ``profile`` alone does not fit
            ``capacity_bytes``.
    """
    n = AUTO_TRIALS_PER_K * max_k
    trial = SimTrial.uniform(profile, 1.0, AUTO_STEPS, plan=plan)
    return predict_packing(
        [trial] * n,
        capacity_bytes,
        policy,
        max_k=max_k,
        compute_parallelism=float(max_k),
        memory_plans=plan is not None,
    )
