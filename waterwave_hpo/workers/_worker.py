"""A worker process of process isolation: one slot of the driver's host, over a pipe.

Started by the driver (``multiprocessing``'s spawn context) with its end of a pipe, the pickled
:class:`~waterwave_hpo.host._runner.HostSpec` (cloudpickle: the objective goes by value
when it is a closure or a lambda), its device and its slot's index. It opens the study through
:class:`~waterwave_hpo.relay.RelayedStorage` over the pipe and runs the jobs the driver sends on
a one-slot :class:`~waterwave_hpo.host._runner.HostRunner` (the executor's one run path);
the records of how they ended go back over the same pipe.

Messages (tuples, first item the kind). Driver to worker: ``("submit", members, fused, cap)``,
``("neighbours", n)``, ``("interrupt",)``, ``("stop",)``, ``("answer", call_id, ok, payload)``.
Worker to driver: ``("ready", pid)``, ``("setup_error", error)``, ``("records", records,
snapshot, retire)`` (``retire``: a trial's CUDA error may have poisoned the worker's context,
so it exits and the slot's next trial gets a new worker), ``("call", call_id, target, method,
args)`` (target ``"storage"`` or ``"lease"``).

The worker ends with its driver: when the pipe closes (the driver exited or was killed) the
reader sees EOF and the process exits at once; on Linux the kernel also sends it SIGKILL when
the thread that started it dies (``PR_SET_PDEATHSIG``), in case the reader is stuck.
"""

from __future__ import annotations

from collections.abc import Callable
import ctypes
import itertools
import multiprocessing
import os
import queue
import signal
import sys
import threading
from typing import Any

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.1


class PipeLink:
    """The worker's end of the pipe: thread-safe sends and calls answered by the driver.

    Args:
        conn: The worker's ``multiprocessing.connection.Connection``.
    """

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[threading.Event, list[Any]]] = {}
        self._lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        """Send one message (pickled with cloudpickle: errors and records of any kind)."""
        import cloudpickle

        data = cloudpickle.dumps(message)
        with self._send_lock:
            self.conn.send_bytes(data)

    def call(self, target: str, method: str, args: tuple[Any, ...]) -> tuple[bool, Any]:
        """Call ``method`` of the driver's ``target`` with ``args``; ``(ok, result or error)``."""
        call_id = next(self._ids)
        done = threading.Event()
        answer: list[Any] = []
        with self._lock:
            self._waiting[call_id] = (done, answer)
        self.send(("call", call_id, target, method, args))
        done.wait()
        ok, payload = answer[0]
        return bool(ok), payload

    def answered(self, call_id: int, ok: bool, payload: Any) -> None:
        """Deliver the driver's answer to the waiting call ``call_id``."""
        with self._lock:
            waiting = self._waiting.pop(call_id, None)
        if waiting is not None:
            done, answer = waiting
            answer.append((ok, payload))
            done.set()

    def storage_transport(self) -> Callable[[str, tuple[Any, ...]], tuple[bool, Any]]:
        """The :data:`waterwave_hpo.relay.Transport` of the study's storage over this pipe."""
        return lambda method, args: self.call("storage", method, args)


def worker_main(conn: Any, payload: bytes, device: str, slot: int, torch_threads: int) -> None:
    """The worker process's body (the target ``multiprocessing`` starts). Never returns.

    Args:
        conn: The worker's end of the pipe.
        payload: The cloudpickled ``HostSpec``.
        device: Its device (``"cpu"``, ``"cuda:1"``).
        slot: The index of the driver's slot it runs.
        torch_threads: PyTorch's intra-op threads in the driver, kept here so a trial computes
            as it would have in the driver, whatever the number of workers.
    """
    # Ctrl+C in a terminal reaches every process of the foreground group; the driver decides
    # (it tells the trials FAIL, then ends the workers).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The driver starts its workers as daemons (multiprocessing ends them if it exits
    # without stopping them); a worker itself is not one, so a trial may start processes
    # of its own (DataLoader(num_workers=2), multiprocessing.Pool). They end with it: the
    # worker exits with os._exit, and DataLoader's workers watch their parent.
    multiprocessing.current_process().daemon = False
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the driver died before the line above took effect
        os._exit(0)
    link = PipeLink(conn)
    runner = None
    try:
        import cloudpickle
        import torch

        torch.set_num_threads(torch_threads)
        from waterwave_hpo.host import HostRunner
        from waterwave_hpo.relay import RelayedHeartbeatStorage
        from waterwave_hpo.relay import RelayedStorage

        spec, heartbeat, environment = cloudpickle.loads(payload)
        # The driver's logging, warning filters and start method (DataLoader workers fork, as
        # they would in the driver), before the first trial.
        environment.apply()
        if torch.device(device).type == "cuda":
            from dataclasses import replace

            from waterwave_hpo.workers._lease_service import leased

            spec = replace(
                spec, func=leased(spec.func, link.call, torch.device(device), os.getpid())
            )
        storage_class = RelayedHeartbeatStorage if heartbeat else RelayedStorage
        # The driver tells each trial from the worker's record (defer_finish), so the user's
        # sampler and callbacks see every end in the driver's process, as with threads.
        storage = storage_class(link.storage_transport(), defer_finish=True)
        # The reader must run while the study opens: opening it is storage calls on the pipe.
        threading.Thread(target=_read, args=(link, lambda: runner), daemon=True).start()
        runner = HostRunner(spec, storage, torch.device(device), slot_indices=[slot])
    except BaseException as error:  # reported with the first job; the driver fails it
        from waterwave_hpo.host import picklable_error

        try:
            link.send(("setup_error", picklable_error(_with_context(error))))
        finally:
            os._exit(1)
    link.send(("ready", os.getpid()))
    try:
        while True:
            records, snapshot = runner.poll(_POLL_S)
            retire = any(poisons_context(record.error) for record in records)
            if records or snapshot.stop_requested:
                link.send(("records", records, snapshot, retire))
            if retire:  # the driver starts a new worker for the slot's next trial
                os._exit(0)
    except BaseException as error:  # the pipe broke: the driver is gone
        print(f"waterwave-hpo worker {os.getpid()}: {error!r}", file=sys.stderr, flush=True)
        os._exit(1)


def poisons_context(error: BaseException | None) -> bool:
    """Whether a trial's ``error`` may have left this process's CUDA context unusable.

    Any CUDA error other than out of memory (an illegal address, a device-side assert, a
    launch failure are sticky: every later CUDA call of the process fails), and the pool's
    backend errors. The worker is then replaced instead of reused.
    """
    if error is None:
        return False
    from waterwave_hpo.host import is_out_of_memory
    from waterwave_hpo.memory import PoolBackendError

    if isinstance(error, PoolBackendError):
        return True
    if not isinstance(error, Exception) or is_out_of_memory(error):
        return False
    accelerator_error = getattr(__import__("torch"), "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return isinstance(error, RuntimeError) and "CUDA error" in str(error)


def _read(link: PipeLink, runner: Callable[[], Any]) -> None:
    """Take the driver's messages until the pipe closes; then the process exits.

    Answers are delivered here; the driver's requests run in a thread of their own (a submit
    makes storage calls, whose answers this thread must be free to take).
    """
    import cloudpickle

    requests: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
    threading.Thread(target=_serve_requests, args=(requests, runner), daemon=True).start()
    try:
        while True:
            message = cloudpickle.loads(link.conn.recv_bytes())
            if message[0] == "answer":
                link.answered(*message[1:])
            elif message[0] == "stop":
                break
            else:
                requests.put(message)
    except (EOFError, OSError):
        pass  # the driver closed the pipe or died
    finally:
        os._exit(0)


def _serve_requests(
    requests: queue.SimpleQueue[tuple[Any, ...]], runner: Callable[[], Any]
) -> None:
    while True:
        message = requests.get()
        kind = message[0]
        if kind == "submit":
            runner().submit(_slot(runner), message[1], message[2], message[3])
        elif kind == "neighbours":
            runner().host.outside_neighbours = int(message[1])
        elif kind == "interrupt":
            runner().interrupt(_slot(runner))


def _slot(runner: Callable[[], Any]) -> int:
    return int(runner().host.slots[0].index)


def _with_context(error: BaseException) -> BaseException:
    return RuntimeError(
        f"The worker process {os.getpid()} could not start: {type(error).__name__}: {error}. "
        "A worker is a fresh interpreter: the objective's module must be importable there "
        "(on sys.path, or the objective defined in the script run, under "
        "if __name__ == '__main__':)."
    )


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the thread that started it exits."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
