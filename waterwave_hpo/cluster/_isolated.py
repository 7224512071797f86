"""Process isolation on Ray: one single-slot host actor per trial slot, its memory leased.

``RayExecutor(isolation="process")``: a Ray actor is a process already, so a trial isolated in
its own process is a host actor with one slot. Each GPU gets ``trials_per_device`` of them
(fractional ``num_gpus = 1 / trials_per_device``, Ray's placement), and each holds, for its
lifetime, a memory lease from the GPU's broker (the one :func:`~waterwave_hpo.shared_gpu`'s
Tune trials use, ``cluster/_broker.py``): ``budget / trials_per_device`` bytes, which become its
device's memory budget (the scheduler's ledger) and, on CUDA, bound each of its trials as
process isolation on one machine bounds a worker (``executor``'s ``bound_process``: the trial's
pool account gets the lease as its quota; without the pool, PyTorch's per-process memory
fraction; CuPy's default pool its limit), so the K processes' peaks do not collide.

A trial that crashes its process (a segmentation fault in native code, ``abort()``,
``os._exit``, the OOM killer) kills its actor only. The actor wrote its fatal-error report
(:mod:`faulthandler`: the signal and the Python stack) to a file on its node; the driver's
poller sees the actor die, asks the node's broker to free the dead process's lease and read
the report (:meth:`~waterwave_hpo.cluster._broker.GPUMemoryBroker.holder_died`), and tells the
trial FAIL with that reason (:func:`describe_loss`). A crash on an alive node is the trial's
own: it is not re-run (a re-run would most likely crash again). The fleet starts a new actor in
its place, and the study goes on. A host lost with its node is not the trial's fault: its
parameters are re-queued, as with threads (``max_host_retries``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
import faulthandler
import functools
import logging
import os
import threading
import time
from typing import IO
from typing import Any

from waterwave_hpo.cluster._actor import HostActor
from waterwave_hpo.cluster._actor import HostInfo
from waterwave_hpo.cluster._broker import CUDA_BUDGET_FRACTION
from waterwave_hpo.cluster._broker import crash_report_path
from waterwave_hpo.cluster._broker import cuda_device
from waterwave_hpo.cluster._broker import find_broker
from waterwave_hpo.cluster._broker import get_broker
from waterwave_hpo.cluster._broker import renew_lease
from waterwave_hpo.cluster._handle import RayHostHandle
from waterwave_hpo.cluster._nodes import alive_nodes
from waterwave_hpo.host import TRIAL_ACCOUNT
from waterwave_hpo.memory._internal import MemoryLease
from waterwave_hpo.workers import bound_process

_logger = logging.getLogger("waterwave_hpo")
_POLL_S = 0.05
_LEASE_TTL_S = 10.0
_BROKER_TIMEOUT_S = 10.0
_REPORT_FRAMES = 3

# faulthandler's names for the fatal signals it reports (Python/faulthandler.c).
_SIGNALS = {
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}


@dataclass(frozen=True)
class IsolatedSpec:
    """What an :class:`IsolatedHostActor` is created with.

    Attributes:
        host: The host spec every host actor gets (its ``n_slots`` is replaced by 1 and its
            ``memory_budget_bytes`` by the lease).
        trials_per_gpu: The single-slot host actors sharing one GPU (the lease is
            ``budget_bytes // trials_per_gpu``).
        budget_bytes: The GPU's memory the leases share; ``None``: 90 % of the GPU's total
            memory on CUDA, and no coordination without CUDA.
        lease_timeout_s: Seconds to wait for the lease before the actor gives up starting.
    """

    host: Any
    trials_per_gpu: int
    budget_bytes: int | None
    lease_timeout_s: float


@dataclass(frozen=True)
class LeasedHostInfo(HostInfo):
    """Where an isolated host runs, and the lease it holds (the driver frees it on its death)."""

    gpu_id: str = "cpu"
    """The Ray id of its GPU, or ``"cpu"`` for a host without one."""
    holder: str = ""
    """Its lease's holder id at the GPU's broker."""


class IsolatedHostActor(HostActor):
    """A single-slot host actor holding a memory lease (``ray.remote(IsolatedHostActor)``).

    Args:
        spec: The host spec, the GPU's sharing and the lease's timeout.

    Raises:
        TimeoutError: If no lease was granted within ``spec.lease_timeout_s``.
        StoragePermissionError: As :class:`~waterwave_hpo.cluster._actor.HostActor`.
    """

    def __init__(self, spec: IsolatedSpec) -> None:
        import ray

        pid = os.getpid()
        self._crash_file = _report_crashes(pid)
        node_id = ray.get_runtime_context().get_node_id()
        gpu_ids = ray.get_gpu_ids()
        gpu_id = str(gpu_ids[0]) if gpu_ids else "cpu"
        cuda = cuda_device()
        budget = spec.budget_bytes
        if budget is None and cuda is not None:
            import torch

            total = int(torch.cuda.get_device_properties(cuda).total_memory)
            budget = int(total * CUDA_BUDGET_FRACTION)
        self._broker = get_broker(node_id, gpu_id, budget, spec.trials_per_gpu, _LEASE_TTL_S)
        self._holder = f"host/{node_id[:8]}/pid{pid}"
        self._cuda = cuda
        self._renewing = threading.Event()
        lease = self._lease(budget, spec)
        try:
            threading.Thread(
                target=renew_lease,
                args=(self._broker, self._holder, self._renewing, _LEASE_TTL_S / 4),
                name="waterwave-lease",
                daemon=True,
            ).start()
            host = dataclasses.replace(spec.host, n_slots=1, memory_budget_bytes=lease.nbytes)
            if cuda is not None and lease.nbytes is not None:
                host = dataclasses.replace(host, func=bounded(host.func, cuda, lease.nbytes))
            super().__init__(host)
        except BaseException:
            self._release()
            raise
        base = dataclasses.asdict(self._info)
        self._info = LeasedHostInfo(**base, gpu_id=gpu_id, holder=self._holder)

    def _lease(self, budget: int | None, spec: IsolatedSpec) -> MemoryLease:
        import ray

        ray.get(
            self._broker.request.remote(
                self._holder, None, budget, spec.trials_per_gpu, _LEASE_TTL_S
            )
        )
        deadline = time.monotonic() + spec.lease_timeout_s
        while True:
            granted: MemoryLease | None = ray.get(self._broker.poll.remote(self._holder))
            if granted is not None:
                return granted
            if time.monotonic() > deadline:
                self._release()
                raise TimeoutError(
                    f"No memory lease for a host process within {spec.lease_timeout_s:g} s; "
                    f"the other processes on its GPU hold its {budget} bytes. Raise "
                    "startup_timeout_s or lower trials_per_device."
                )
            time.sleep(_POLL_S)

    def shutdown(self, timeout_s: float) -> None:
        """Stop the slot thread, then give the lease back (with the measured peak on CUDA)."""
        super().shutdown(timeout_s)
        self._release()
        with contextlib.suppress(Exception):
            faulthandler.disable()
            self._crash_file.close()
            os.unlink(self._crash_file.name)

    def _release(self) -> None:
        import ray

        self._renewing.set()
        peak = None
        if self._cuda is not None:
            with contextlib.suppress(Exception):
                import torch

                peak = int(torch.cuda.max_memory_reserved(self._cuda))  # without the pool
        with contextlib.suppress(Exception):
            ray.get(self._broker.release.remote(self._holder, peak), timeout=_BROKER_TIMEOUT_S)


def bounded(func: Any, device: Any, nbytes: int) -> Any:
    """``func`` that, in each trial, bounds this process's memory on ``device`` by ``nbytes``.

    The trial's pool account gets ``nbytes`` as its quota (without the pool: PyTorch's
    per-process memory fraction; CuPy's default pool: its limit), as a worker process of
    ``WaterwaveExecutor(isolation="process")`` is bounded by its lease.
    """

    @functools.wraps(func)
    def run(arg: Any) -> Any:
        bound_process(device, nbytes, TRIAL_ACCOUNT.get())
        return func(arg)

    return run


def _report_crashes(pid: int) -> IO[str]:
    """Send this process's fatal-error report (signal, Python stacks) to its crash file."""
    path = crash_report_path(pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    file = open(path, "w")  # faulthandler writes to it until the process ends
    faulthandler.enable(file=file, all_threads=True)
    return file


def describe_loss(ray: Any, host: RayHostHandle, error: BaseException) -> tuple[str, bool]:
    """Why an isolated host died, for its trial's fail reason, and whether to re-run the trial.

    Frees the dead process's lease and reads its crash report through the node's broker.

    Returns:
        ``(reason, re_queue)``: re-queue only when the host was lost with its node (not the
        trial's doing); a process that died on an alive node fails its trial for good.
    """
    info = host.info
    report = None
    if isinstance(info, LeasedHostInfo):
        with contextlib.suppress(Exception):
            broker = find_broker(info.node_id, info.gpu_id)
            report = ray.get(
                broker.holder_died.remote(info.holder, info.pid), timeout=_BROKER_TIMEOUT_S
            )
    message = str(error)
    node_lost = "its node has died" in message
    if not node_lost:
        with contextlib.suppress(Exception):
            node_lost = info.node_id not in {node.node_id for node in alive_nodes(ray)}
    where = f"its worker process (Ray actor, pid {info.pid}, {host.device})"
    if node_lost:
        return f"{where} was lost with its node: {_first_line(message)}", True
    if report is not None:
        return f"{where} crashed: {summarize_crash_report(report)}", False
    return (
        f"{where} died without a fatal-error report (os._exit, SIGKILL, e.g. the OOM killer; "
        f"Ray does not pass the exit code on): {_first_line(message)}",
        False,
    )


def summarize_crash_report(report: str) -> str:
    """``"SIGSEGV (Segmentation fault) at File ..., line N in f; ..."`` from faulthandler's text."""
    lines = [line.strip() for line in report.splitlines()]
    head = next((line for line in lines if line.startswith("Fatal Python error:")), lines[0])
    name = head.removeprefix("Fatal Python error:").strip()
    signal = _SIGNALS.get(name)
    summary = f"{signal} ({name})" if signal else name
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("Current thread"))
    except StopIteration:
        return summary
    frames = []
    for line in lines[start + 1 :]:
        if not line.startswith("File "):
            break
        frames.append(line)
    if frames:
        summary += " at " + "; ".join(frames[:_REPORT_FRAMES])
    return summary


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "(no message)"
