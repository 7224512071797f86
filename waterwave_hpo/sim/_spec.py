"""What the simulator is given: the trials, the device, and how the device is shared."""

from __future__ import annotations

from dataclasses import dataclass

from waterwave_hpo.scheduler import TrialProfile

#: A re-run after an out-of-memory error (or an eviction) with memory plans on is planned for
#: at most this fraction of the footprint its failed attempt had (the executor's rule, and the
#: simulator's): the cost model erred, or the neighbours grew, so it must shrink for sure.
PLAN_SHRINK = 0.5


@dataclass(frozen=True)
class SimPlan:
    """What a memory plan (HOME) can do for a trial, as the simulator runs it.

    With ``Sharing(memory_plans=True)``, a trial whose plain peak does not fit the room left
    beside its neighbours (the capacity less their claims) runs with a plan for that room
    instead of waiting, as ``WaterwaveExecutor(memory_plan="home")`` does: it reserves the
    planned peak for its whole run (the executor's accounting of a planned model) and its step
    takes longer. Between the plain peak and ``peak_bytes`` the slowdown is interpolated
    linearly in the bytes saved (an assumption of ours; the planners' predictions lie on such a
    curve only roughly, and the extremes are exact).

    Attributes:
        peak_bytes: The smallest planned peak, in bytes (parameters, gradients, optimizer
            state and the activations the plan keeps on the device).
        slowdown: Step seconds with that plan over step seconds without one (>= 1).
    """

    peak_bytes: int
    slowdown: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.peak_bytes, bool) or not isinstance(self.peak_bytes, int):
            raise TypeError(f"SimPlan peak_bytes={self.peak_bytes!r} must be an int (bytes).")
        if self.peak_bytes < 0 or not self.slowdown >= 1.0:
            raise ValueError(
                f"SimPlan peak_bytes={self.peak_bytes!r} must be >= 0 and "
                f"slowdown={self.slowdown!r} >= 1 (a plan never makes a step faster)."
            )

    def at(self, plain_peak_bytes: int, room_bytes: int) -> tuple[int, float] | None:
        """The plan for ``room_bytes``: ``(planned peak bytes, slowdown)``, or ``None``.

        ``None`` when even the smallest plan does not fit ``room_bytes``; ``(plain peak, 1.0)``
        when the plain step fits.
        """
        if room_bytes >= plain_peak_bytes:
            return plain_peak_bytes, 1.0
        if room_bytes < self.peak_bytes:
            return None
        span = plain_peak_bytes - self.peak_bytes
        saved = (plain_peak_bytes - room_bytes) / span if span > 0 else 1.0
        return room_bytes, 1.0 + (self.slowdown - 1.0) * saved


@dataclass(frozen=True)
class SimTrial:
    """One trial as the simulator runs it: its NodeGroup profile and its solo timings.

    A training step is: for each group ``g`` in order, reserve ``profile.group_bytes[g]`` and run
    its forward; then for each group in reverse, run its backward and free its bytes
    (Waterwave, IEEE TC 2023, Sec. 4). ``profile.resident_bytes`` (parameters and gradients) is
    reserved once, at the trial's start, and held until it ends.

    Attributes:
        profile: Bytes per step (resident, per group).
        forward_s: Per group, seconds of device work of its forward when the trial runs alone.
        backward_s: Per group, seconds of device work of its backward when alone.
        steps: Training steps (>= 1).
        host_s: Seconds of host-side work (Python op dispatch, holding the GIL) per group pass,
            forward and backward each; it overlaps with the device work of the same pass
            (asynchronous launches), and co-hosted trials of one process share one host.
        name: A label for tables and plots.
        plan: What a memory plan can do for it (``Sharing(memory_plans=True)``), or ``None``.
    """

    profile: TrialProfile
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    steps: int = 1
    host_s: float = 0.0
    name: str = ""
    plan: SimPlan | None = None

    def __post_init__(self) -> None:
        n = len(self.profile.group_bytes)
        if len(self.forward_s) != n or len(self.backward_s) != n:
            raise ValueError(
                f"SimTrial needs one forward_s and one backward_s per NodeGroup: the profile has "
                f"{n} groups, got forward_s={self.forward_s!r} and backward_s={self.backward_s!r}."
            )
        if any(s < 0 for s in (*self.forward_s, *self.backward_s)) or self.host_s < 0:
            raise ValueError(
                f"SimTrial times must be >= 0 seconds, got forward_s={self.forward_s!r}, "
                f"backward_s={self.backward_s!r}, host_s={self.host_s!r}."
            )
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"SimTrial steps={self.steps!r} must be an int >= 1.")

    @classmethod
    def uniform(
        cls,
        profile: TrialProfile,
        step_s: float,
        steps: int = 1,
        *,
        backward_ratio: float = 2.0,
        host_s: float = 0.0,
        name: str = "",
        plan: SimPlan | None = None,
    ) -> SimTrial:
        """A trial whose solo step takes ``step_s`` seconds.

        A trial whose solo step takes ``step_s`` seconds, spread over its groups in
        proportion to their bytes (evenly if all are 0), backward ``backward_ratio`` times as
        long as forward.

        Raises:
            ValueError: If ``step_s`` or ``backward_ratio`` is negative, or the profile has no
                groups.
        """
        n = len(profile.group_bytes)
        if n == 0:
            raise ValueError("SimTrial.uniform needs a profile with at least one NodeGroup.")
        if step_s < 0 or backward_ratio < 0:
            raise ValueError(
                f"step_s={step_s!r} and backward_ratio={backward_ratio!r} must be >= 0."
            )
        total = sum(profile.group_bytes)
        weights = [b / total for b in profile.group_bytes] if total else [1.0 / n] * n
        fwd = tuple(step_s * w / (1.0 + backward_ratio) for w in weights)
        bwd = tuple(f * backward_ratio for f in fwd)
        return cls(profile, fwd, bwd, steps, host_s, name, plan)

    @property
    def solo_s(self) -> float:
        """Seconds the trial takes alone on the device (device work only, host overlapped)."""
        per_step = sum(
            max(f, self.host_s) + max(b, self.host_s)
            for f, b in zip(self.forward_s, self.backward_s, strict=True)
        )
        return per_step * self.steps


@dataclass(frozen=True)
class SimDevice:
    """One shared device.

    Attributes:
        capacity_bytes: Memory the trials may use, in bytes (> 0).
        compute_parallelism: How many solo trials' worth of work the device does per second
            while two or more trials' pieces run on it (> 0); a piece running alone always runs
            at its solo speed. ``1``: a co-hosted trial slows every other down in proportion (a
            saturated device); ``K``: K small trials overlap for free; below ``1``: co-running
            pieces interfere and together do less than one alone (e.g. CPU thread
            oversubscription). Running pieces share it equally (processor sharing).
        context_bytes: Memory each extra process costs (its CUDA context); charged per trial
            under process sharing.
        mps: Whether kernels of different processes overlap (CUDA MPS); without it processes
            are time-sliced (parallelism 1 across processes).
        name: A label.
    """

    capacity_bytes: int
    compute_parallelism: float = 1.0
    context_bytes: int = 0
    mps: bool = False
    name: str = "device"

    def __post_init__(self) -> None:
        if (
            isinstance(self.capacity_bytes, bool)
            or not isinstance(self.capacity_bytes, int)
            or self.capacity_bytes <= 0
        ):
            raise ValueError(
                f"SimDevice capacity_bytes={self.capacity_bytes!r} must be an int > 0 (bytes)."
            )
        if not self.compute_parallelism > 0:
            raise ValueError(
                f"SimDevice compute_parallelism={self.compute_parallelism!r} must be > 0 "
                "(1: kernels of co-hosted trials share the device's time)."
            )
        if self.context_bytes < 0:
            raise ValueError(f"SimDevice context_bytes={self.context_bytes!r} must be >= 0.")


@dataclass(frozen=True)
class Sharing:
    """How trials share the device.

    Attributes:
        concurrency: Trials running at once (>= 1), or ``"auto"``: start another trial while
            the policy's ``fits`` admits the running profiles plus the next one and, with a
            policy, fewer run than :func:`~waterwave_hpo.sim.predict_auto_packing` picks for the
            largest profile seen (the executor's ``trials_per_device="auto"``), up to
            ``max_concurrency``.
        policy: ``"waterwave"``, ``"fifo"`` or a :class:`~waterwave_hpo.scheduler.Policy`: the
            pipeline scheduler's ledger gates every NodeGroup. ``None``: no ledger (PyTorch's
            stock allocator): an allocation that does not fit is an out-of-memory error.
        processes: Each trial in its own process: its own host (no shared GIL), plus
            ``SimDevice.context_bytes``, and kernels overlap only with MPS.
        retry_on_oom: A trial that ran out of memory (or was evicted by the scheduler) beside
            others is re-queued, to run with fewer neighbours (the executor's
            ``on_oom="retry"``); at most ``max_retries`` times. Otherwise it fails.
        max_retries: See ``retry_on_oom``.
        max_concurrency: The cap for ``concurrency="auto"``.
        process_start_s: With ``processes``, seconds each process needs before its first trial
            (starting Python, importing torch, creating a CUDA context); the processes start
            together.
        memory_plans: A trial with a :class:`SimPlan` whose plain peak does not fit the room
            beside its neighbours runs with a plan for that room (``concurrency="auto"``
            admits it at its planned footprint), and a re-run after an out-of-memory error or
            an eviction runs with a plan for at most ``PLAN_SHRINK`` of the footprint it failed
            with, beside any number of neighbours (``WaterwaveExecutor(memory_plan="home")``).
    """

    concurrency: int | str = 1
    policy: object = "waterwave"
    processes: bool = False
    retry_on_oom: bool = True
    max_retries: int = 2
    max_concurrency: int = 16
    process_start_s: float = 0.0
    memory_plans: bool = False

    def __post_init__(self) -> None:
        if not self.process_start_s >= 0:
            raise ValueError(
                f"Sharing process_start_s={self.process_start_s!r} must be >= 0 seconds."
            )
        if isinstance(self.policy, str) and self.policy not in ("waterwave", "fifo"):
            raise ValueError(
                f"Sharing policy={self.policy!r} is not a known policy; pass 'waterwave', "
                "'fifo' or a waterwave_hpo.scheduler.Policy."
            )
        c = self.concurrency
        if c != "auto" and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"Sharing concurrency={c!r} must be an int >= 1 or 'auto'.")
        if self.max_concurrency < 1 or self.max_retries < 0:
            raise ValueError(
                f"Sharing max_concurrency={self.max_concurrency!r} must be >= 1 and "
                f"max_retries={self.max_retries!r} >= 0."
            )
