"""Each device's memory machinery for the executor: the stream-aware pool and the scheduler.

On CUDA, ``WaterwaveExecutor(memory_pool="auto")`` makes one :class:`StreamAwarePool` per device
PyTorch's allocator (Waterwave, IEEE TC 2023, Sec. 3: memory freed by one trial flows to another)
and opens one pool account per trial, so each trial's peak bytes are measured. The pipeline
scheduler (Sec. 4) gets one ledger per device; its budget is ``memory_budget_bytes`` when given,
else the device's total memory less a reserve for the CUDA context and the libraries' own
workspaces (:func:`default_budget_bytes`), or the pool's capacity if smaller. On the CPU there
is no pool (CPU tensors cannot be routed through it) and a scheduler only when
``memory_budget_bytes`` is given.

``trials_per_device="auto"`` admits another trial while the measured demand leaves room and,
once NodeGroup gates have declared a profile, while fewer trials run than the simulator
predicts is best for that profile (:func:`waterwave_hpo.sim.predict_auto_packing`).
"""

from __future__ import annotations

from collections import deque
from contextvars import ContextVar
import enum
import logging
import threading
from typing import Any
import warnings

import torch

from waterwave_hpo import _checks
from waterwave_hpo import _experimental
from waterwave_hpo.host._planning import DevicePlans
from waterwave_hpo.scheduler import PipelineScheduler
from waterwave_hpo.scheduler import Policy
from waterwave_hpo.scheduler import PolicyName
from waterwave_hpo.scheduler import TrialProfile
from waterwave_hpo.sim import PackingPrediction
from waterwave_hpo.sim import SimPlan
from waterwave_hpo.sim import predict_auto_packing
from waterwave_hpo.trial import current_or_none

_logger = logging.getLogger("waterwave_hpo")
#: Device memory the default budget leaves outside the pool and the scheduler's ledger: the CUDA
#: context, the loaded kernel modules, and cuBLAS/cuDNN handles' own state are allocated by the
#: driver and the libraries directly, not through PyTorch's allocator. A few hundred MiB on
#: current GPUs (an assumption, not measured here: this project has no GPU); the reserve is
#: the larger of 512 MiB and 5% of the device. Pass ``memory_budget_bytes`` to override it.
CUDA_RESERVE_MIN_BYTES = 512 << 20
CUDA_RESERVE_FRACTION = 0.05


def default_budget_bytes(total_bytes: int) -> int:
    """The default memory budget of a CUDA device with ``total_bytes`` (bytes).

    The default memory budget of a CUDA device with ``total_bytes`` (bytes): the total less
    the reserve for what lives outside the pool (:data:`CUDA_RESERVE_MIN_BYTES`,
    :data:`CUDA_RESERVE_FRACTION`).
    """
    reserve = max(CUDA_RESERVE_MIN_BYTES, int(total_bytes * CUDA_RESERVE_FRACTION))
    return max(total_bytes - reserve, total_bytes // 2)


_HISTORY = 32  # finished trials' peaks kept per device for admission
# The running trial's pool account, set in the trial's thread while the account is open.
_TRIAL_ACCOUNT: ContextVar[Any] = ContextVar("waterwave_hpo_trial_account", default=None)


def trial_memory_stats() -> Any:
    """The running trial's own device memory counters, from its pool account.

    Use it where ``torch.cuda.max_memory_allocated`` would be used for one trial: that figure
    is per device, so it counts every co-hosted trial, and the trial's own peak is
    ``trial_memory_stats().peak_allocated_bytes`` (bytes, since the trial started).

    Call it in the trial's thread (an objective, a forward hook), not in a backward hook: on
    CUDA those run on autograd's device thread, where no trial is current.

    Returns:
        The account's :class:`~waterwave_hpo.memory.UsageStats`, or ``None`` outside a trial
        and for trials that run without the pool (the CPU, ``memory_pool="off"``).
    """
    account = _TRIAL_ACCOUNT.get()
    if current_or_none() is None or account is None or account.closed:
        return None
    return account.stats()


class MemoryPoolMode(str, enum.Enum):
    """Whether the executor routes PyTorch's CUDA allocations through the stream-aware pool.

    ``AUTO``: on CUDA, make the pool PyTorch's allocator if CUDA has not initialised yet in this
    process; once it has (the user's script touched the GPU first: the *late path*), or where
    the pool cannot be installed, warn once with the cause, what is lost and the fix, and run
    the trials on PyTorch's own caching allocator. ``ON``: the pool, or raise. ``OFF``: PyTorch's
    allocator, without a word.
    """

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class DeviceMemory:
    """The pool (CUDA only), the scheduler and the measured peaks of one device.

    Args:
        device: The device.
        pool: The device's installed pool, or ``None``.
        scheduler: The device's scheduler, or ``None``.
        budget_bytes: The device's memory budget in bytes, or ``None`` for no budget.
        max_trials: The most trials the device may run at once (``max_trials_per_device``); the
            largest packing :meth:`has_room` simulates.
        plans: What memory planning has learnt on the device (``memory_plan="home"``), or
            ``None`` without planning.
    """

    def __init__(
        self,
        device: torch.device,
        pool: Any = None,
        scheduler: PipelineScheduler | None = None,
        budget_bytes: int | None = None,
        max_trials: int = 1,
        plans: DevicePlans | None = None,
    ) -> None:
        self.device = device
        self.plans = plans
        self.budget_bytes = budget_bytes
        self.max_trials = max_trials
        # (the profile simulated, its prediction); read by other threads, replaced whole.
        self._packing: tuple[TrialProfile, PackingPrediction | None] | None = None
        self.pool = pool
        self.scheduler = scheduler
        self._lock = threading.Lock()
        self._peaks: deque[int] = deque(maxlen=_HISTORY)
        self._running: dict[int, Any] = {}  # trial number -> open pool account

    def trial_admitted(self, trial: Any, *, scheduled: bool = True) -> None:
        """Count ``trial`` as running from the moment the executor hands it to a slot.

        Called in the executor's thread, so that admission (:meth:`has_room`) never sees a
        trial that was started but whose thread has not registered it yet. ``scheduled=False``
        for a fused batch's other trials: the batch's one call reserves memory under its first
        trial alone, and a scheduler trial that never asks for memory would stall the
        scheduler's deadlock resolution (it waits until every running trial waits).
        """
        if self.scheduler is not None and scheduled:
            self.scheduler.trial_started(trial.number, trial)
        with self._lock:
            self._running.setdefault(trial.number, None)

    def trial_ended(self, trial_number: int) -> None:
        """Forget ``trial_number``; release what it holds in the scheduler. Idempotent."""
        if self.scheduler is not None:
            self.scheduler.trial_finished(trial_number)
        with self._lock:
            self._running.pop(trial_number, None)

    def open_account(self, trial_number: int, stream: torch.cuda.Stream | None) -> Any:
        """Open the trial's pool account bound to its stream; ``None`` without a pool."""
        if self.pool is None or stream is None:
            return None
        account = self.pool.open_account(f"trial {trial_number}", streams=(stream,))
        with self._lock:
            self._running[trial_number] = account
        _TRIAL_ACCOUNT.set(account)
        return account

    def close_account(self, trial_number: int, account: Any) -> int | None:
        """Close the trial's account; returns its peak allocated bytes (``None`` without one)."""
        if account is None:
            return None
        peak = int(account.stats().peak_allocated_bytes)
        if _TRIAL_ACCOUNT.get() is account:
            _TRIAL_ACCOUNT.set(None)
        account.close()
        with self._lock:
            if trial_number in self._running:
                self._running[trial_number] = None
            self._peaks.append(peak)
        return peak

    @property
    def packing(self) -> PackingPrediction | None:
        """The simulator's prediction that admission follows now.

        The simulator's prediction that admission follows now (``None`` before any NodeGroup
        profile was declared, without a scheduler, or for a profile that does not fit alone).
        """
        packing = self._packing
        return None if packing is None else packing[1]

    def has_room(self) -> bool:
        """Whether measured demand leaves room for another trial (trials_per_device="auto").

        Demand is the current peak of every running trial's account plus the typical (median)
        peak of finished trials for the newcomer; it must fit the budget, and the scheduler
        (when there is one) must admit the largest NodeGroup profile it has seen, with fewer
        trials running than the simulator's best packing for that profile (:attr:`packing`).
        With memory planning, a newcomer that does not fit plainly is admitted at its planned
        footprint (the smallest plan of the largest registered model), and the simulator
        predicts with plans.
        Without a pool and without NodeGroup profiles nothing is measured, and trials run one at
        a time. Call it from one thread (the executor's): it may run the simulator.
        """
        if self.scheduler is not None and not self.scheduler.admits(None):
            planned = self._smallest_planned_profile()
            if planned is None or not self.scheduler.admits(planned):
                return False
        best_k = self._predicted_k()
        if best_k is not None:
            with self._lock:
                if len(self._running) >= best_k:
                    return False
        if self.pool is None or self.budget_bytes is None:
            return self.scheduler is not None
        with self._lock:
            accounts = list(self._running.values())
            history = sorted(self._peaks)
        if not history:
            return not accounts  # the first trial measures what a trial needs
        typical = history[len(history) // 2]
        # A trial whose account is not open yet is expected to need the typical peak.
        running = sum(
            typical if a is None else max(typical, int(a.stats().peak_allocated_bytes))
            for a in accounts
        )
        return running + typical <= self.budget_bytes

    def _smallest_planned_profile(self) -> TrialProfile | None:
        """The planned footprint a newcomer is admitted at, or ``None`` without planning."""
        largest = None if self.plans is None else self.plans.largest()
        if largest is None:
            return None
        return TrialProfile.of(largest[1].peak_bytes, (0,))

    def _predicted_k(self) -> int | None:
        """The simulator's best trials-at-once for the largest profile seen (cached per profile)."""
        if self.scheduler is None:
            return None
        profile = self.scheduler.largest_profile
        plan: SimPlan | None = None
        largest = None if self.plans is None else self.plans.largest()
        if largest is not None and (profile is None or largest[0].peak_bytes >= profile.peak_bytes):
            profile, plan = largest
        if profile is None:
            return None
        cached = self._packing
        if cached is None or cached[0] != profile:
            try:
                prediction: PackingPrediction | None = predict_auto_packing(
                    profile,
                    self.scheduler.budget_bytes,
                    self.scheduler.policy,
                    self.max_trials,
                    plan=plan,
                )
            except ValueError:  # it does not fit alone: such a trial fails alone, runs alone
                prediction = None
            cached = self._packing = (profile, prediction)
            if prediction is not None:
                _logger.info(
                    "%s: the simulator predicts %d trial(s) at once is best for the largest "
                    "NodeGroup profile seen (%d bytes resident + %d in %d groups; %.2fx one at "
                    "a time); trials_per_device='auto' admits up to that.",
                    self.device,
                    prediction.best_k,
                    profile.resident_bytes,
                    profile.activation_bytes,
                    len(profile.group_bytes),
                    prediction.speedup,
                )
        prediction = cached[1]
        return None if prediction is None else prediction.best_k


def check_pool_device(mode: MemoryPoolMode, device: torch.device) -> None:
    """Refuse ``memory_pool="on"`` for a device the stream-aware pool does not serve.

    The pool holds CUDA memory only; ``"on"`` means raise rather than run without it.

    Raises:
        ValueError: ``mode`` is ``ON`` and ``device`` is not a CUDA device.
    """
    if mode is MemoryPoolMode.ON and device.type != "cuda":
        raise _checks.value_error(
            "memory_pool",
            mode.value,
            f"asks for the stream-aware pool on every device, but {device} is not a CUDA "
            "device and the pool holds CUDA memory only ('on' raises rather than run without "
            "it)",
            "pass memory_pool='auto' (the pool on CUDA devices, PyTorch's allocator elsewhere) "
            "or 'off', or CUDA devices only",
        )


def make_device_memory(
    device: torch.device,
    pool_mode: MemoryPoolMode,
    budget_bytes: int | None,
    policy: str | PolicyName | Policy,
    *,
    max_trials: int,
    plans: bool = False,
) -> DeviceMemory:
    """Set up one device's pool and scheduler for an ``optimize`` call.

    Set up one device's pool and scheduler for an ``optimize`` call; ``max_trials`` is the
    most trials the device may run at once; ``plans``: record memory plans for admission
    (``memory_plan="home"``).

    Raises:
        ValueError: With ``memory_pool="on"``, if ``device`` is not a CUDA device.
        RuntimeError: With ``memory_pool="on"``, if the pool cannot be installed (PyTorch has
            already allocated on CUDA, the pool library cannot reach the driver, or the torch
            shim cannot be built: the compiler's message is attached).
    """
    check_pool_device(pool_mode, device)
    if device.type == "cuda":
        _experimental.warn_experimental(_experimental.ExperimentalPath.EXECUTOR_CUDA)
    pool = _device_pool(device, pool_mode) if device.type == "cuda" else None
    budget = budget_bytes
    if budget is None and device.type == "cuda":
        total = int(torch.cuda.get_device_properties(device).total_memory)
        capacity = None if pool is None else pool.capacity_bytes
        budget = default_budget_bytes(total)
        if capacity is not None and capacity < budget:
            budget = int(capacity)
    scheduler = None if budget is None else PipelineScheduler(budget, policy)
    return DeviceMemory(
        device, pool, scheduler, budget, max_trials, DevicePlans() if plans else None
    )


def _device_pool(device: torch.device, mode: MemoryPoolMode) -> Any:
    if mode is MemoryPoolMode.OFF:
        return None
    from waterwave_hpo.memory import StreamAwarePool
    from waterwave_hpo.memory import allocator_swapped
    from waterwave_hpo.memory import device_pool
    from waterwave_hpo.memory import installed_pool
    from waterwave_hpo.memory import use_pool

    index = device.index if device.index is not None else 0
    existing = installed_pool(index)
    if existing is not None:
        return existing
    if not allocator_swapped() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return _late_path(device, mode)
    try:
        pool = StreamAwarePool(backend="cuda", device=index)
        # "on": no allocator swap without the complete torch shim (its compiler's message).
        use_pool(pool, require_shim=mode is MemoryPoolMode.ON)
    except (RuntimeError, ValueError, ImportError, OSError) as error:
        if allocator_swapped():
            # PyTorch's allocator is the pool's, process-wide: this device cannot fall back to
            # PyTorch's own. Its pass-through pool serves it, if any.
            fallback = device_pool(index)
            if fallback is not None and mode is not MemoryPoolMode.ON:
                _logger.warning(
                    "Trials on %s use the pool's pass-through pool (no budget, no per-trial "
                    "accounts): a pool of its own could not be installed: %s",
                    device,
                    error,
                )
                return fallback
            raise RuntimeError(
                f"{device} has no stream-aware pool of its own ({error}) and cannot use "
                "PyTorch's allocator: the pool replaced it process-wide when another device's "
                "pool was installed. Install pools for every device before CUDA work starts, or "
                "leave this device out."
            ) from error
        if mode is MemoryPoolMode.ON:
            raise RuntimeError(
                f"memory_pool='on' could not install the stream-aware pool on {device}: {error}"
            ) from error
        _logger.warning(
            "Trials on %s use PyTorch's own CUDA allocator, not the stream-aware pool: %s "
            "(pass memory_pool='off' to silence this).",
            device,
            error,
        )
        return None
    return pool


#: Why PyTorch's allocator can no longer be swapped, and the usual causes (for the warning).
_LATE_CAUSE = (
    "PyTorch initialised CUDA in this process before the executor set up the device (a tensor "
    "or model moved to the GPU, a device property read, a Hugging Face Trainer's __init__, an "
    "earlier study or process-isolated run in this process), so its allocator can no longer "
    "be replaced"
)
#: What running on PyTorch's caching allocator instead of the pool loses, and the fix.
_LATE_LOSS = (
    "memory a trial frees stays cached for its own CUDA stream and reaches a co-hosted trial "
    "only when that trial's allocation fails (PyTorch then frees every cached block, "
    "synchronising the device, and retries), instead of block by block as the pool hands it "
    "on; trials have no pool account (waterwave_hpo.trial_memory_stats() returns None) and "
    "trials_per_device='auto' has no measured peaks to pack by. PyTorch's own memory stats, "
    "cuDNN benchmark mode, CUDA graphs and record_stream work as usual"
)
_LATE_FIX = (
    "Fix: build the WaterwaveExecutor (or call waterwave_hpo.memory.use_pool) before the "
    "script's first CUDA call; memory_pool='off' silences this."
)


def _late_path(device: torch.device, mode: MemoryPoolMode) -> None:
    """The late path: PyTorch's own allocator, said once with what it loses, or raised.

    The pool is not put under the trials' streams through private ``torch.cuda.MemPool``s:
    while any stream is routed to one, PyTorch's caching allocator skips its out-of-memory
    recovery and defers every ``record_stream`` free, and a ``MemPool`` destroyed while another
    is routed aborts the process (``~MemPool`` -> ``emptyCache`` asserts no capture is
    underway). Replayed on the CPU, PyTorch's allocator completes the most trials of what the
    late path can have (``experiments/results/2026-11-28-late-path-flow/``).
    """
    message = (
        f"Trials on {device} use PyTorch's own CUDA allocator, not the stream-aware pool: "
        f"{_LATE_CAUSE}. What this loses: {_LATE_LOSS}. {_LATE_FIX}"
    )
    if mode is MemoryPoolMode.ON:
        raise RuntimeError(f"memory_pool='on': {message}")
    warnings.warn(message, RuntimeWarning, stacklevel=4)
