"""A worker process of process isolation: one slot of a device, over a pipe, across runs.

A worker is forked by the executor's zygote (:mod:`waterwave_hpo.workers._zygote`: an
interpreter that imported torch, Optuna and this package once and never touched CUDA), or,
where fork cannot serve, it is a fresh interpreter (``python -c``, :func:`worker_main`). Either
way the user's script is never imported (a script without ``if __name__ == "__main__":``
works) and nothing of the driver's process is inherited (no CUDA context, no lock, no thread).
It gets its end of a socket pair as a file descriptor, warms up once (on CUDA the device's
context and the stream-aware pool), and then serves one ``optimize`` call after another: each
run sends the cloudpickled :class:`~waterwave_hpo.host._runner.HostSpec` (the objective goes by
value when it is a closure, a lambda or defined in ``__main__``), the worker opens the study
through :class:`~waterwave_hpo.relay.RelayedStorage` over the pipe and runs the jobs the driver
sends on a one-slot :class:`~waterwave_hpo.host._runner.HostRunner` (the executor's one run
path); the records of how they ended go back over the same pipe.

Messages (tuples, first item the kind). Driver to worker: ``("init", sys_path, device, slot,
torch_threads, memory_pool)`` (first, once), ``("begin", payload)``, ``("submit", members,
fused, cap, frozen)`` (``frozen``: the trials, pickled apart), ``("end",)``, ``("stop",)``,
``("answer", call_id, ok, payload)`` (``payload`` pickled apart). Worker to driver: ``("warm",
pid)``, ``("ready", pid)`` (the run's study is open), ``("setup_error", error, fatal)``
(``fatal``: the worker exits), ``("records", records, snapshot, retire)`` (``retire``: a
trial's CUDA error may have poisoned the worker's context, so it exits and a new worker takes
the slot), ``("refused", trial_ids, reason)`` (a submit whose trials the worker could not
read: they fail with the reason, the worker goes on), ``("ended",)`` (the run's host is shut
down; the worker waits for the next run), ``("call", call_id, target, method, args)`` (target
``"storage"`` or ``"neighbours"``: the other workers' running trials, asked when a trial ran
out of memory), ``("post", target, method, args)`` (a storage write to a trial the worker
runs, answered by nobody: the driver runs it in order; an error fails the trial when its record
comes) and ``("batch", [pickled message, ...])`` (posted writes and the message that followed
them, in order, read as one). What a driver's message carries of the user's (a trial's
attributes, a storage's answer) is pickled apart from the message itself, so that a value the
worker cannot load (a class the worker cannot import) fails that trial or that call with the
reason, not the worker.

A trivial trial (one ``suggest``, one ``set_user_attr``) so costs one message each way (the
submit; its writes and record in one batch), no round trip the trial waits on and no thread
hand-off in the worker: one thread, the slot's, reads the submit, runs the trial and sends its
record. Nobody reads the pipe while a trial runs unless it waits for an answer: a thread that
waits for a message reads the pipe itself when no other thread is reading it, and hands on
what is not its own (:class:`PipeLink`).

Messages are pickled with :mod:`pickle` (fast) and, when that fails or the message refers to
``__main__`` (a class of the user's script, which the other process's ``__main__`` is not),
with cloudpickle; either is read by ``pickle.loads``.

The worker ends with its driver: when the pipe closes (the driver exited or was killed) the
next read sees EOF and the process exits at once; the kernel also sends it SIGKILL when its
parent dies (``PR_SET_PDEATHSIG``: the zygote, which ends its workers when the driver ends, or
for a spawned worker the driver's thread that started it), so a worker in a long trial
(nobody reading) ends too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
import itertools
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any

from waterwave_hpo.workers._strays import end_stray_children
from waterwave_hpo.workers._strays import warn_of_threads_left
from waterwave_hpo.workers._zygote import adopt_orphans
from waterwave_hpo.workers._zygote import die_with_parent
from waterwave_hpo.workers._zygote import prepare_process

_FLUSH_S = 0.1
_END_TIMEOUT_S = 5.0


def dumps(message: Any) -> bytes:
    """``message`` pickled: with :mod:`pickle` when it can, else by value with cloudpickle.

    Also by value when :mod:`pickle`'s bytes name ``__main__``: pickle refers to a class or
    function of the user's script by its module, and the other process's ``__main__`` is not
    the user's script.
    """
    try:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if b"__main__" not in data:
            return data
    except Exception:
        pass
    import cloudpickle

    return bytes(cloudpickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def loads_or_reason(data: bytes, what: str) -> tuple[Any, str | None]:
    """``(pickle.loads(data), None)``, or ``(None, why it could not be read)``."""
    try:
        return pickle.loads(data), None
    except Exception as error:
        return None, (
            f"the worker process (pid {os.getpid()}) could not read {what} the driver sent: "
            f"{type(error).__name__}: {error} (a class or function the worker cannot import: "
            "define it in an importable module, or keep such values out of the study)"
        )


class PipeLink:
    """The worker's end of the pipe: thread-safe sends, posted writes, calls the driver answers.

    Storage writes to the trials the worker runs are *posted* (:meth:`post`): pickled at once
    (an unpicklable value raises at the objective's call) and sent with the next message,
    before it, in one ``("batch", ...)`` message: a call, the trial's record, or the periodic
    :meth:`flush`. So a trial that writes and returns sends the driver one message, and waits
    for no answer.

    No thread of its own reads the pipe: a thread that waits for a message (the slot's thread
    for the driver's next request, :meth:`next_request`; a caller for its answer, :meth:`call`)
    reads it itself while no other thread does, keeps what is its own and leaves the rest for
    the thread it belongs to (leader and followers). So the slot's thread reads its submit and
    runs the trial with no hand-off, and a call made while it waits for a request (a thread
    the trial left running) still gets its answer. The process exits (``os._exit(0)``) when a
    read meets the end of the pipe (the driver is gone) or the driver's ``("stop",)``.

    Args:
        conn: The worker's ``multiprocessing.connection.Connection``.
    """

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._posted: list[bytes] = []  # pickled ("post", target, method, args), not sent yet
        # Guards what follows; taken as `with self._messages_lock` (C-level: taken and entered in
        # one step), so that a trial interrupted asynchronously while it takes it cannot leave it
        # held (raised in Condition.__enter__, Python, right after the lock was taken).
        self._messages_lock = threading.RLock()
        self._messages = threading.Condition(self._messages_lock)
        self._reading = False  # a thread is reading the pipe now
        self._answers: dict[int, tuple[bool, Any]] = {}  # read, not yet taken by their caller
        self._requests: deque[tuple[Any, ...]] = deque()  # the driver's, read by a caller

    def send(self, message: tuple[Any, ...]) -> None:
        """Send one message (after the posted writes, in one batch when there are any)."""
        data = dumps(message)
        with self._send_lock:
            if self._posted:
                posted, self._posted = self._posted, []
                data = dumps(("batch", [*posted, data]))
            self.conn.send_bytes(data)

    def post(self, target: str, method: str, args: tuple[Any, ...]) -> None:
        """Send ``method`` of the driver's ``target`` with ``args`` later; never waits.

        The driver runs posted calls in order, before the next message that follows them.

        Raises:
            pickle.PicklingError: (or another pickling error) if ``args`` cannot be sent.
        """
        data = dumps(("post", target, method, args))
        with self._send_lock:
            self._posted.append(data)

    def flush(self) -> None:
        """Send the posted writes now, if any."""
        with self._send_lock:
            if not self._posted:
                return
            posted, self._posted = self._posted, []
            self.conn.send_bytes(dumps(("batch", posted)))

    def call(self, target: str, method: str, args: tuple[Any, ...]) -> tuple[bool, Any]:
        """Call ``method`` of the driver's ``target`` with ``args``; ``(ok, result or error)``.

        An answer the worker cannot read is an error of the call (``RuntimeError``).
        """
        call_id = next(self._ids)
        self.send(("call", call_id, target, method, args))
        ok, data = self._take(lambda: self._answers.pop(call_id, None))
        payload, unreadable = loads_or_reason(data, f"the answer to {target}.{method}")
        if unreadable is not None:
            return False, RuntimeError(unreadable)
        return bool(ok), payload

    def next_request(self) -> tuple[Any, ...]:
        """The driver's next request (a ``begin``, a ``submit``, an ``end``), in order."""
        request: tuple[Any, ...] = self._take(
            lambda: self._requests.popleft() if self._requests else None
        )
        return request

    def _take(self, mine: Callable[[], Any]) -> Any:
        """Wait for what ``mine`` returns (not ``None``), reading the pipe while no one else is."""
        while True:
            with self._messages_lock:
                while True:
                    found = mine()
                    if found is not None:
                        return found
                    if not self._reading:
                        self._reading = True
                        break
                    self._messages.wait()
            try:
                data = self.conn.recv_bytes()
            except BaseException:  # the pipe closed: the driver is gone
                os._exit(0)
            try:
                # The driver's messages hold only builtins (what is the user's is pickled
                # apart): one that cannot be read is a broken stream, not a value.
                message = pickle.loads(data)
            except BaseException as error:
                print(
                    f"waterwave-hpo worker {os.getpid()}: a message from the driver cannot be "
                    f"read ({type(error).__name__}: {error}); the worker exits",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)
            kind = message[0]
            if kind == "stop":
                os._exit(0)
            with self._messages_lock:
                self._reading = False
                if kind == "answer":
                    _, call_id, ok, payload = message
                    self._answers[call_id] = (ok, payload)
                else:
                    self._requests.append(message)
                self._messages.notify_all()

    def storage_transport(self) -> Callable[[str, tuple[Any, ...]], tuple[bool, Any]]:
        """The :data:`waterwave_hpo.relay.Transport` of the study's storage over this pipe."""
        return lambda method, args: self.call("storage", method, args)

    def storage_post(self) -> Callable[[str, tuple[Any, ...]], None]:
        """The :data:`waterwave_hpo.relay.Post` of the study's storage over this pipe."""
        return lambda method, args: self.post("storage", method, args)


class _Worker:
    """The worker's state: its device, its current run's :class:`HostRunner` (if any)."""

    def __init__(self, link: PipeLink, device: str, slot: int) -> None:
        self.link = link
        self.device = device
        self.slot = slot
        self.runner: Any = None  # the current run's HostRunner; None between runs
        self._ended: list[int] = []  # numbers of the running job's trials recorded so far
        self._strays_run: Any = None  # the run those belong to

    # -- the slot's thread: the driver's requests --------------------------------------------

    def begin(self, payload: bytes) -> None:
        """Open the run's study and build its one-slot host; ``ready`` or ``setup_error``."""
        import torch

        from waterwave_hpo.host import HostRunner
        from waterwave_hpo.relay import RelayedHeartbeatStorage
        from waterwave_hpo.relay import RelayedStorage

        try:
            spec, heartbeat, environment = pickle.loads(payload)
            # The driver's logging, warning filters and start method (DataLoader workers fork,
            # as they would in the driver), before the run's first trial.
            environment.apply()
            device = torch.device(self.device)
            if device.type == "cuda" and spec.memory_budget_bytes is not None:
                from dataclasses import replace

                from waterwave_hpo.workers._lease_service import leased

                # The worker's lease: its share of the device's budget, fixed for the run.
                spec = replace(spec, func=leased(spec.func, device, spec.memory_budget_bytes))
            storage_class = RelayedHeartbeatStorage if heartbeat else RelayedStorage
            # The driver tells each trial from the worker's record (defer_finish), so the
            # user's sampler and callbacks see every end in the driver's process, as with
            # threads. Writes to the worker's trials are posted: the trial waits for none.
            storage = storage_class(
                self.link.storage_transport(), defer_finish=True, post=self.link.storage_post()
            )
            runner = HostRunner(spec, storage, device, slot_indices=[self.slot], report=self.report)
            runner.host.count_outside = self.outside_counter(device)
        except BaseException as error:  # the driver refuses the run with it
            self.link.send(("setup_error", _setup_error(error), False))
            return
        self.runner = runner
        self.link.send(("ready", os.getpid()))

    def end(self) -> None:
        """Shut the run's host down and forget it (the driver has seen every trial end)."""
        runner, self.runner = self.runner, None
        if runner is not None:
            # No gc.collect() here: a full collection in a process that imported torch takes
            # a second on a busy machine, and every optimize call would wait for it.
            runner.shutdown(timeout_s=_END_TIMEOUT_S)
        self.link.send(("ended",))

    def serve(self) -> None:
        """Take the driver's requests in order and run them, trials included. Never returns.

        This thread is the slot's: it reads a submit and runs its trial itself (the records go
        from here too). An error of the worker's own (not the trial's, which the run path
        records) ends the process: the driver fails the trial it ran and starts a new worker.
        """
        try:
            while True:
                message = self.link.next_request()
                kind = message[0]
                if kind == "begin":
                    self.begin(message[1])
                elif kind == "end":
                    self.end()
                elif kind == "submit":
                    self.run(message)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)

    def run(self, message: tuple[Any, ...]) -> None:
        """Run a submitted job in this thread; its records are sent before this returns."""
        runner = self.runner
        if runner is None:  # its run failed to begin: the driver failed the trial
            return
        _, members, fused, cap, frozen_data = message
        frozen, unreadable = loads_or_reason(frozen_data, "the trial")
        if unreadable is not None:  # the driver fails the trials with the reason
            self.link.send(("refused", [trial_id for trial_id, _, _ in members], unreadable))
            return
        runner.run_here(self.slot, members, fused, cap, frozen)

    def outside_counter(self, device: Any) -> Callable[[], int] | None:
        """What the run's host asks, on OOM, for the trials beside it in other workers.

        ``None`` on CUDA: each trial runs in a lease of its own, so other workers' trials
        cannot be why it ran out of memory and do not count (no futile re-run).
        """
        return None if device.type == "cuda" else self.count_outside

    def count_outside(self) -> int:
        """How many other workers of the driver's host run a trial now (asked on OOM)."""
        ok, payload = self.link.call("neighbours", "count", ())
        return int(payload) if ok else 0

    # -- the slot's thread: records ------------------------------------------------------------

    def report(self, records: list[Any], snapshot: Any) -> None:
        """Send the records of ended attempts, from the slot's thread that ran them.

        The trial's posted writes go first, in the same message. A trial whose CUDA error may
        have poisoned the context retires the worker after its record is sent.
        """
        self._end_strays_if_idle(records)
        retire = any(poisons_context(record.error) for record in records)
        try:
            self.link.send(("records", records, snapshot, retire))
        except BaseException as error:  # the pipe broke: the driver is gone
            print(f"waterwave-hpo worker {os.getpid()}: {error!r}", file=sys.stderr, flush=True)
            os._exit(1)
        if retire:  # the driver starts a new worker for the slot's next trial
            os._exit(0)

    def _end_strays_if_idle(self, records: list[Any]) -> None:
        """End the child processes the slot's job left running, once every trial of it is recorded.

        Runs before the records go (:func:`~waterwave_hpo.workers._strays.end_stray_children`):
        the driver sends the next trial only after it has them, so none of those processes can
        be the next trial's.
        """
        runner = self.runner
        if runner is not self._strays_run:  # a new run: nothing of the last one is pending
            self._ended, self._strays_run = [], runner
        self._ended += [record.number for record in records]
        if self._ended and runner is not None and runner.idle():
            end_stray_children(self._ended)
            warn_of_threads_left(self._ended, own=(threading.get_ident(),))
            self._ended = []

    # -- the main thread ----------------------------------------------------------------------

    def keep_flushing(self) -> None:
        """Send the posted writes of long trials every ``_FLUSH_S`` seconds. Never returns.

        A trial's writes otherwise go with its next call or its record: here they reach the
        driver's storage (and whoever watches it) within ``_FLUSH_S`` seconds.
        """
        while True:
            time.sleep(_FLUSH_S)
            self.link.flush()


def worker_main(fd: int, parent: int) -> None:
    """A spawned worker process's body (``python -c`` calls it). Never returns.

    Where the zygote cannot fork workers (:mod:`waterwave_hpo.workers._starters`).

    Args:
        fd: Its end of the socket pair to the driver.
        parent: The driver's pid (the worker exits if the driver is gone already).
    """
    # Ctrl+C in a terminal reaches every process of the foreground group; the driver decides
    # (it tells the trials FAIL, then ends the workers).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    if os.getppid() != parent:  # the driver died before the line above took effect
        os._exit(0)
    adopt_orphans()
    try:
        prepare_process()
    except BaseException as error:  # the driver reports it (and raises if no worker starts)
        from multiprocessing.connection import Connection

        try:
            link = PipeLink(Connection(fd))
            link.conn.recv_bytes()  # the init
            link.send(("setup_error", _setup_error(error), True))
        finally:
            os._exit(1)
    serve_driver(fd)


def serve_driver(fd: int) -> None:
    """Serve the driver over socket ``fd``: the init, then its runs. Never returns.

    What a forked worker runs (the zygote prepared the process) and a spawned one after its
    imports.
    """
    from multiprocessing.connection import Connection

    link = PipeLink(Connection(fd))
    try:
        _, sys_path, device, slot, torch_threads, memory_pool = pickle.loads(link.conn.recv_bytes())
        sys.path[:] = list(sys_path)  # the objective's module is importable as in the driver
        warm_up(device, torch_threads, memory_pool)
    except BaseException as error:  # the driver reports it (and raises if no worker starts)
        try:
            link.send(("setup_error", _setup_error(error), True))
        finally:
            os._exit(1)
    worker = _Worker(link, device, slot)
    # Not a daemon: a thread a trial starts inherits its daemon flag, and in a script a thread
    # is not a daemon unless asked (the worker exits with os._exit, whoever runs).
    threading.Thread(target=worker.serve, name="waterwave-worker-slot", daemon=False).start()
    link.send(("warm", os.getpid()))
    try:
        worker.keep_flushing()
    except BaseException as error:  # the pipe broke: the driver is gone
        print(f"waterwave-hpo worker {os.getpid()}: {error!r}", file=sys.stderr, flush=True)
        os._exit(1)


def warm_up(device_name: str, torch_threads: int, memory_pool: str) -> None:
    """What every run of this worker needs, done once: its threads, on CUDA context and pool.

    On CUDA: the device's context (with its default stream), and the stream-aware pool
    installed as PyTorch's allocator before anything allocates (``memory_pool``), so a trial
    never meets a cold worker. The imports and PyTorch's lazy CPU start are
    :func:`~waterwave_hpo.workers._zygote.prepare_process`'s, done before.
    """
    import torch

    from waterwave_hpo.host import MemoryPoolMode
    from waterwave_hpo.host import make_device_memory

    torch.set_num_threads(torch_threads)
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # The pool first (it must be PyTorch's allocator before any allocation), then the
        # context: one synchronisation creates it.
        make_device_memory(device, MemoryPoolMode(memory_pool), None, "fifo", max_trials=1)
        torch.cuda.synchronize(device)


def poisons_context(error: BaseException | None) -> bool:
    """Whether a trial's ``error`` has left this process's CUDA context unusable.

    An out-of-memory error never does; the pool's backend errors always do. Any other error
    while CUDA is in use is checked, whatever its message says (Triton's "Triton Error
    [CUDA]", cuDNN's ``CUDNN_STATUS_EXECUTION_FAILED`` and an illegal address all leave a
    sticky error behind): the device is synchronised, and an error there means every later
    CUDA call of the process would fail too. An error that names CUDA's own error words is
    taken as poisoning even if the synchronisation passes (an asynchronous error may surface
    later). The worker is then replaced instead of reused.
    """
    if error is None:
        return False
    from waterwave_hpo.host import is_out_of_memory
    from waterwave_hpo.memory import PoolBackendError

    if isinstance(error, PoolBackendError):
        return True
    if not isinstance(error, Exception) or is_out_of_memory(error):
        return False
    import torch

    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    if isinstance(error, RuntimeError) and "CUDA error" in str(error):
        return True
    return context_poisoned()


def context_poisoned() -> bool:
    """Whether this process's CUDA context fails a synchronisation (a sticky error).

    ``False`` when CUDA was never initialised here (the trial ran on the CPU).
    """
    import torch

    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return False
    try:
        torch.cuda.synchronize()
    except Exception:
        return True
    return False


def _setup_error(error: BaseException) -> BaseException:
    from waterwave_hpo.host import picklable_error

    wrapped = RuntimeError(
        f"The worker process {os.getpid()} could not start: {type(error).__name__}: {error}. "
        "A worker never runs your script: the objective's module must be importable there "
        "(on sys.path, or the objective defined in the script run)."
    )
    return picklable_error(wrapped) or wrapped
