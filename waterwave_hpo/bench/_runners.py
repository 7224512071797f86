"""Run one workload under one method: N trials, K at a time, measured the same way."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from dataclasses import field
import enum
import multiprocessing
import os
import queue
import threading
import time
from typing import Any

import optuna
import torch

from waterwave_hpo import _experimental
from waterwave_hpo.bench._methods import Method
from waterwave_hpo.bench._methods import mps_running
from waterwave_hpo.bench._methods import unavailable_reason
from waterwave_hpo.bench._train import TrialRecord
from waterwave_hpo.bench._train import train
from waterwave_hpo.bench._train import train_fused
from waterwave_hpo.bench._workloads import WorkloadSpec

_INDEX_ATTR = "bench:index"
_ASYNC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")


class Allocator(str, enum.Enum):
    """The device allocator a method's trials ran on (the bench's results say it per method)."""

    #: PyTorch's caching allocator (the default on CUDA).
    TORCH_CACHING = "pytorch-caching"
    #: PyTorch's ``backend:cudaMallocAsync`` (the driver's stream-ordered pool).
    CUDA_MALLOC_ASYNC = "cudaMallocAsync"
    #: waterwave's stream-aware pool as PyTorch's allocator.
    STREAM_AWARE_POOL = "waterwave-pool"
    #: The CPU (host memory; no device allocator).
    HOST = "cpu"


class PoolNotInstalledError(RuntimeError):
    """A method that measures the stream-aware pool could not make it PyTorch's allocator."""


@dataclass
class MethodRun:
    """What one method did with one workload.

    Attributes:
        method: The method.
        spec: The workload and setting.
        k: Trials at once (1 for temporal).
        device: The device, e.g. ``"cpu"``, ``"cuda:0"``.
        available: Whether the method ran; if not, ``note`` says why and nothing was measured.
        note: Anything the reader must know (MPS on or off, how memory was measured).
        records: Every attempt of every trial.
        start_s: Wall-clock start, seconds since the epoch.
        end_s: Wall-clock end, seconds since the epoch.
        peak_memory_bytes: Peak device memory of the run, bytes; ``None`` where not measurable.
        peak_memory_source: How ``peak_memory_bytes`` was measured.
        allocator: The allocator the trials ran on; ``None`` when the method did not run.
    """

    method: Method
    spec: WorkloadSpec
    k: int
    device: str
    available: bool = True
    note: str = ""
    records: list[TrialRecord] = field(default_factory=list)
    start_s: float = 0.0
    end_s: float = 0.0
    peak_memory_bytes: int | None = None
    peak_memory_source: str = ""
    allocator: Allocator | None = None

    @property
    def makespan_s(self) -> float:
        """Seconds from the first trial's launch to the last trial's end."""
        return self.end_s - self.start_s

    @property
    def completed(self) -> set[int]:
        """Indices of the trials that completed."""
        return {r.index for r in self.records if r.complete}

    @property
    def samples(self) -> int:
        """Samples trained by completed attempts."""
        return sum(r.samples for r in self.records if r.complete)


class _DevicePeak:
    """Samples the device's used bytes every 5 ms in a thread.

    Samples the device's used bytes (cudaMemGetInfo) every 5 ms in a thread; keeps the peak
    above the baseline at start. Counts every process on the device (spatial's included).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        free, total = torch.cuda.mem_get_info(device)
        self.base = total - free
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            free, total = torch.cuda.mem_get_info(self.device)
            self.peak = max(self.peak, total - free - self.base)

    def __enter__(self) -> _DevicePeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_method(
    method: Method,
    spec: WorkloadSpec,
    params: list[dict[str, Any]],
    device: torch.device,
    k: int,
    *,
    seed: int,
    capacity_bytes: int,
    isolate: bool | None = None,
) -> MethodRun:
    """Run ``len(params)`` trials of ``spec`` under ``method``, ``k`` at a time.

    Args:
        method: The way of sharing the device.
        spec: Workload, setting, batch size, steps.
        params: The trials' parameter sets, the same for every method.
        device: ``cpu`` or ``cuda:N``.
        k: Trials at once (ignored by ``TEMPORAL``, which runs 1).
        seed: Seeds models and data per trial.
        capacity_bytes: The device memory the waterwave executor's scheduler may hand out
            (``memory_budget_bytes``), in bytes.
        isolate: Run the method in a fresh process (spawned). ``None``: on CUDA yes (an
            allocator is chosen once per process, before CUDA's first allocation), on the CPU
            no.

    Returns:
        The run; ``available=False`` with the reason when the method does not exist on the
        device.

    Raises:
        ValueError: If ``k < 1`` or ``params`` is empty.
    """
    if k < 1:
        raise ValueError(f"k={k} must be >= 1 (trials at once).")
    if not params:
        raise ValueError("params is empty; draw the trials with draw_params(workload, n, seed).")
    k = 1 if method is Method.TEMPORAL else k
    reason = unavailable_reason(method, device)
    if reason is not None:
        return MethodRun(method, spec, k, str(device), available=False, note=reason)
    if device.type == "cuda":
        _experimental.warn_experimental(_experimental.ExperimentalPath.BENCH_CUDA)
    if isolate is None:
        isolate = device.type == "cuda"
    if isolate:
        return _run_isolated(method, spec, params, device, k, seed, capacity_bytes)
    return _run_here(method, spec, params, device, k, seed, capacity_bytes)


def _run_isolated(
    method: Method,
    spec: WorkloadSpec,
    params: list[dict[str, Any]],
    device: torch.device,
    k: int,
    seed: int,
    capacity_bytes: int,
) -> MethodRun:
    ctx = multiprocessing.get_context("spawn")
    results: Any = ctx.Queue()
    args = (method, spec, params, str(device), k, seed, capacity_bytes, results)
    child = ctx.Process(target=_isolated_child, args=args)
    saved = os.environ.get(_ASYNC_ENV[0])
    if method is Method.CUDA_MALLOC_ASYNC:
        os.environ[_ASYNC_ENV[0]] = _ASYNC_ENV[1]  # inherited by the child before torch loads
    try:
        child.start()
    finally:
        if method is Method.CUDA_MALLOC_ASYNC:
            if saved is None:
                os.environ.pop(_ASYNC_ENV[0], None)
            else:
                os.environ[_ASYNC_ENV[0]] = saved
    try:
        run: MethodRun = results.get()
    finally:
        child.join()
    return run


def _isolated_child(
    method: Method,
    spec: WorkloadSpec,
    params: list[dict[str, Any]],
    device: str,
    k: int,
    seed: int,
    capacity_bytes: int,
    results: Any,
) -> None:
    try:
        run = _run_here(method, spec, params, torch.device(device), k, seed, capacity_bytes)
    except BaseException as error:  # report, never hang the parent
        run = MethodRun(method, spec, k, device, available=False, note=f"crashed: {error!r}")
    results.put(run)


def _run_here(
    method: Method,
    spec: WorkloadSpec,
    params: list[dict[str, Any]],
    device: torch.device,
    k: int,
    seed: int,
    capacity_bytes: int,
) -> MethodRun:
    run = MethodRun(method, spec, k, str(device))
    cuda = device.type == "cuda"
    notes = []
    if cuda:
        # The pool must be PyTorch's allocator before anything initialises CUDA (the device
        # peak sampler, the warm-up): PyTorch cannot swap an initialised allocator.
        if method.budgeted:
            try:
                notes.append(_install_pool(device))
            except PoolNotInstalledError as error:
                run.available = False
                run.note = f"aborted: {error}"
                return run
        torch.cuda.init()  # type: ignore[no-untyped-call]
        peak: _DevicePeak | None = _DevicePeak(device)
        run.peak_memory_source = "device used bytes above the baseline (cudaMemGetInfo, 5 ms)"
    else:
        peak = None
        run.peak_memory_source = "not measurable on the CPU"
    run.allocator = _allocator_of(method, device)
    notes.append(f"allocator: {run.allocator.value}")
    if method is Method.SPATIAL:
        notes.append(
            ("MPS on" if mps_running() else "MPS not running: processes time-slice")
            if cuda
            else "CPU: K processes share the cores"
        )
    runner = {
        Method.TEMPORAL: _run_optuna,
        Method.OPTUNA_THREADS: _run_optuna,
        Method.CUDA_MALLOC_ASYNC: _run_optuna,
        Method.SPATIAL: _run_spatial,
        Method.WATERWAVE_FIFO: _run_waterwave,
        Method.WATERWAVE: _run_waterwave,
        Method.WATERWAVE_PLANS: _run_waterwave,
        Method.FUSED: _run_fused,
    }[method]
    if method is not Method.SPATIAL:  # spatial's workers are fresh processes: they start cold
        from waterwave_hpo.bench._calibrate import warm_up

        for p in params:  # every architecture and shape once, so no method pays first use
            warm_up(run.spec, p, device)
        if cuda:  # the warm-up ran on this thread's current stream; nothing else runs yet
            torch.cuda.current_stream(device).synchronize()
    run.start_s = time.time()
    if peak is not None:
        with peak:
            extra = runner(run, params, device, seed, capacity_bytes)
        run.peak_memory_bytes = int(peak.peak)
    else:
        extra = runner(run, params, device, seed, capacity_bytes)
    run.end_s = time.time()
    if extra:
        notes.append(extra)
    run.note = "; ".join(notes)
    return run


def _install_pool(device: torch.device) -> str:
    """Make the stream-aware pool PyTorch's allocator before CUDA is initialised.

    Make the stream-aware pool PyTorch's allocator before CUDA is initialised (the executor
    then finds it installed).

    Raises:
        PoolNotInstalledError: If it cannot be installed; the method must not run on PyTorch's
            allocator and be reported as the pool's figures.
    """
    from waterwave_hpo.memory import StreamAwarePool
    from waterwave_hpo.memory import installed_pool
    from waterwave_hpo.memory import use_pool

    index = device.index or 0
    if installed_pool(index) is None:
        try:
            use_pool(StreamAwarePool(backend="cuda", device=index))
        except (RuntimeError, ValueError, ImportError, OSError) as error:
            raise PoolNotInstalledError(
                f"the stream-aware pool could not be made PyTorch's allocator on {device} "
                f"({error}); this method measures the pool, so it did not run"
            ) from error
    return "stream-aware pool installed before CUDA initialised"


def _allocator_of(method: Method, device: torch.device) -> Allocator:
    """The allocator ``method``'s trials run on in this process (spatial's workers: theirs)."""
    if device.type != "cuda":
        return Allocator.HOST
    if method is Method.SPATIAL:
        return Allocator.TORCH_CACHING  # fresh processes on PyTorch's default allocator
    from waterwave_hpo.memory import installed_pool

    if installed_pool(device.index or 0) is not None:
        return Allocator.STREAM_AWARE_POOL
    if torch.cuda.get_allocator_backend() == "cudaMallocAsync":
        return Allocator.CUDA_MALLOC_ASYNC
    return Allocator.TORCH_CACHING


def call_in_child(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a spawned process, its return value sent back.

    ``fn(*args)`` in a spawned process, its return value sent back (on CUDA, so that the
    parent never holds device memory or a context while the methods are measured).

    Raises:
        RuntimeError: If the child failed (the message carries its error, which is the
            cause) or died before returning (a native crash, the OOM killer: its exit).
    """
    name = getattr(fn, "__name__", fn)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as child:
        future = child.submit(fn, *args)
        try:
            return future.result()
        except BrokenProcessPool as error:
            raise RuntimeError(
                f"{name} failed in a child process: the process died before returning ({error})"
            ) from error
        except Exception as error:
            raise RuntimeError(f"{name} failed in a child process: {error!r}") from error


def _study(params: list[dict[str, Any]]) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for i, p in enumerate(params):
        study.enqueue_trial(p, user_attrs={_INDEX_ATTR: i})
    return study


def _suggest_all(trial: optuna.trial.Trial, spec: WorkloadSpec) -> dict[str, Any]:
    from waterwave_hpo.bench._workloads import _BUILDERS

    _BUILDERS[spec.workload](trial)
    trial.suggest_float("lr", 1e-4, 1e-2, log=True)
    return dict(trial.params)


def _run_optuna(
    run: MethodRun,
    params: list[dict[str, Any]],
    device: torch.device,
    seed: int,
    capacity_bytes: int,
) -> str:
    """Temporal, Optuna threads and cudaMallocAsync: ``study.optimize`` on a stock allocator.

    Temporal (n_jobs=1), Optuna threads (n_jobs=K), cudaMallocAsync (K threads, a stream
    each): ``study.optimize`` on the stock or the async allocator.
    """
    lock = threading.Lock()
    local = threading.local()
    slots: dict[int, int] = {}
    per_stream = run.method is Method.CUDA_MALLOC_ASYNC

    def objective(trial: optuna.trial.Trial) -> float:
        index = int(trial.user_attrs[_INDEX_ATTR])
        trial_params = _suggest_all(trial, run.spec)
        with lock:
            slot = slots.setdefault(threading.get_ident(), len(slots))
            record = TrialRecord(index=index, slot=slot)
            run.records.append(record)
        if per_stream and device.type == "cuda":
            if not hasattr(local, "stream"):
                local.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            with torch.cuda.stream(local.stream):
                return train(run.spec, trial_params, record, device, seed=seed, stream=local.stream)
        return train(run.spec, trial_params, record, device, seed=seed)

    study = _study(params)
    study.optimize(objective, n_trials=len(params), n_jobs=run.k, catch=(Exception,))
    return ""


def _run_spatial(
    run: MethodRun,
    params: list[dict[str, Any]],
    device: torch.device,
    seed: int,
    capacity_bytes: int,
) -> str:
    """K spawned processes pull trial indices from one queue.

    K spawned processes pull trial indices from one queue (what K Optuna worker processes
    on one storage do); their start-up (importing torch, a CUDA context each) is part of the
    makespan, as it is for users.
    """
    ctx = multiprocessing.get_context("spawn")
    tasks: Any = ctx.Queue()
    results: Any = ctx.Queue()
    for i in range(len(params)):
        tasks.put(i)
    for _ in range(run.k):
        tasks.put(None)
    workers = [
        ctx.Process(
            target=_spatial_worker,
            args=(run.spec, params, str(device), seed, slot, tasks, results),
        )
        for slot in range(run.k)
    ]
    for w in workers:
        w.start()
    done = 0
    while done < run.k:
        try:
            item = results.get(timeout=1.0)
        except queue.Empty:
            if not any(w.is_alive() for w in workers):
                break
            continue
        if item is None:
            done += 1
        else:
            run.records.append(item)
    for w in workers:
        w.join()
    return ""


def _spatial_worker(
    spec: WorkloadSpec,
    params: list[dict[str, Any]],
    device: str,
    seed: int,
    slot: int,
    tasks: Any,
    results: Any,
) -> None:
    dev = torch.device(device)
    try:
        while True:
            index = tasks.get()
            if index is None:
                break
            record = TrialRecord(index=index, slot=slot)
            try:
                train(spec, params[index], record, dev, seed=seed)
            except Exception:  # the trial fails alone, as with catch=(Exception,)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            results.put(record)
    finally:
        results.put(None)


def _run_waterwave(
    run: MethodRun,
    params: list[dict[str, Any]],
    device: torch.device,
    seed: int,
    capacity_bytes: int,
) -> str:
    """The executor: K slots, NodeGroup gates or memory plans, the scheduler's budget.

    The executor: K slots, the scheduler's budget ``capacity_bytes``, and NodeGroup gates
    (``waterwave``, ``waterwave-fifo``) or models registered for HOME memory plans
    (``waterwave-plans``: ``memory_plan="home"``); on CUDA the stream-aware pool
    (``memory_pool="auto"``), one stream per slot.
    """
    planned = run.method is Method.WATERWAVE_PLANS
    from waterwave_hpo.executor import WaterwaveExecutor
    from waterwave_hpo.executor import current

    lock = threading.Lock()
    number_to_index: dict[int, int] = {}
    fresh = iter(range(len(params)))

    # The trials are not enqueued up front: the executor re-queues an out-of-memory trial with
    # study.enqueue_trial and expects the next ask() to return it, which pre-enqueued trials
    # would pre-empt (ask() pops the oldest waiting trial). So each fresh trial takes the next
    # parameter set from the list, a re-run the set of the trial it repeats; the objective
    # never calls suggest, so the sampler cannot change the trials.
    def objective(trial: optuna.trial.Trial) -> float:
        ctx = current()
        with lock:
            retry_of = ctx.retry_of
            index = next(fresh) if retry_of is None else number_to_index[int(retry_of)]
            number_to_index[trial.number] = index
            record = TrialRecord(index=index, attempt=ctx.attempt, slot=ctx.slot)
            run.records.append(record)
        trial.set_user_attr(_INDEX_ATTR, index)
        return train(
            run.spec,
            params[index],
            record,
            ctx.device,
            seed=seed,
            gated=not planned,
            planned=planned,
            stream=ctx.stream,
        )

    policy = "fifo" if run.method is Method.WATERWAVE_FIFO else "waterwave"
    executor = WaterwaveExecutor(
        devices=str(device),
        trials_per_device=run.k,
        memory_budget_bytes=capacity_bytes,
        policy=policy,
        # On CUDA the pool is installed by _run_here; "on" makes any fallback an error, never
        # a hidden warning.
        memory_pool="on" if device.type == "cuda" else "auto",
        record_trial_attrs=True,
        memory_plan="home" if planned else "off",
    )
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    executor.optimize(study, objective, n_trials=len(params), catch=(Exception,))
    scheduler = executor.schedulers.get(str(device))
    note = ""
    if scheduler is not None:
        stats = scheduler.stats()
        note = (
            f"scheduler: budget {stats.budget_bytes} B, ledger peak {stats.peak_bytes} B, "
            f"{stats.deadlocks_resolved} deadlocks resolved, {stats.evictions} evictions"
        )
        if planned:
            note += f", {sum(r.planned for r in run.records)} attempts ran with a memory plan"
        if device.type != "cuda":
            run.peak_memory_bytes = int(stats.peak_bytes)
            run.peak_memory_source = "scheduler ledger (bytes accounted from profiles; CPU)"
    return note


def _run_fused(
    run: MethodRun,
    params: list[dict[str, Any]],
    device: torch.device,
    seed: int,
    capacity_bytes: int,
) -> str:
    """The executor with ``fuse=K``: batches of up to K trials, each structure group fused.

    The trials are taken in an order that puts equal structures
    (:func:`waterwave_hpo.fusion.structure_key`) next to each other, so a batch holds as many
    of one structure as there are (what a user of fusion does: one structure per search).
    A group of one trains alone with :func:`train`, exactly as the temporal method does.
    """
    from waterwave_hpo import fusion
    from waterwave_hpo.bench._workloads import build
    from waterwave_hpo.executor import WaterwaveExecutor
    from waterwave_hpo.executor import batched
    from waterwave_hpo.executor import current

    keys = [str(fusion.structure_key(build(run.spec.workload, p))) for p in params]
    order = iter(sorted(range(len(params)), key=lambda i: (keys[i], i)))
    groups: list[int] = []

    def objective(trials: list[optuna.trial.Trial]) -> list[object]:
        ctx = current()
        indices = [next(order) for _ in trials]
        records = [TrialRecord(index=i, slot=ctx.slot) for i in indices]
        run.records.extend(records)
        entries: list[object] = [None] * len(trials)
        by_key: dict[str, list[int]] = {}
        for position, index in enumerate(indices):
            trials[position].set_user_attr(_INDEX_ATTR, index)
            by_key.setdefault(keys[index], []).append(position)
        for positions in by_key.values():
            groups.append(len(positions))
            try:
                if len(positions) == 1:
                    (position,) = positions
                    values = [
                        train(
                            run.spec,
                            params[indices[position]],
                            records[position],
                            device,
                            seed=seed,
                        )
                    ]
                else:
                    values = train_fused(
                        run.spec,
                        [params[indices[p]] for p in positions],
                        [records[p] for p in positions],
                        device,
                        seed=seed,
                    )
                for position, value in zip(positions, values, strict=True):
                    entries[position] = value
            except Exception as error:  # this group's trials fail; the batch's others go on
                for position in positions:
                    entries[position] = error
        return entries

    executor = WaterwaveExecutor(devices=str(device), trials_per_device=1, fuse=run.k)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    executor.optimize(study, batched(objective), n_trials=len(params))
    return f"fused groups of sizes {sorted(groups, reverse=True)} (K={run.k})"
