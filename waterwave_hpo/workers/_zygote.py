"""The zygote: an executor's private fork server, which starts its worker processes.

A worker used to be a fresh interpreter that imported torch, Optuna and this package itself:
seconds per worker, and hundreds of MiB of private memory each. Here that interpreter is started
once per driver process: the *zygote template* (``python -c``, started by
:mod:`waterwave_hpo.workers._starters` when the first executor needs workers; never the user's
script, so a script without ``if __name__ == "__main__":`` is not run again). It imports what
every worker needs, runs one tiny CPU training step (PyTorch starts autograd and its optimizers
lazily), freezes what it built (``gc.freeze()``: a later process's garbage collections never
write to the pages it shares with the template) and then only forks: each executor gets a
*zygote* of its own, forked from the template in milliseconds, and the zygote forks that
executor's workers. A fork takes milliseconds and shares every page the child does not write:
the Android zygote's idea, and Python's own ``multiprocessing`` forkserver's, but private to
the library (that one is shared with the user's code, imports the user's ``__main__`` and its
preload is process-wide); an executor's workers, their lives and their strays are its own
zygote's alone.

Neither ever initialises CUDA: each worker creates its own context after the fork (a CUDA
context does not survive ``fork``), and the template refuses to serve if an import loaded
NVIDIA's driver. Each runs one thread, so no lock is held by another thread when it forks.

Their lives, and the workers':

- The driver sends the template ``("zygote",)`` with one end of a ``SOCK_SEQPACKET`` socket pair
  (``SCM_RIGHTS``, :func:`socket.send_fds`); the new zygote answers ``("ready", pid)`` on it.
  If the template cannot start, it answers ``("failed", reason, retry_with_spawn)`` there.
- The driver sends a zygote ``("fork", tag, env, cwd)`` with the worker's end of a socket pair;
  the zygote forks and answers ``("forked", tag, pid)``. The worker runs in a process group of
  its own, in the driver's working directory and environment of the moment, dies with the
  zygote (``PR_SET_PDEATHSIG``: the zygote's one thread forked it) and adopts the orphans of the
  processes its trials start (``PR_SET_CHILD_SUBREAPER``), so that none escapes it.
- A zygote is its workers' parent: it reaps each one and sends ``("exited", tag, pid, exitcode,
  ended)``: Python's ``Popen.returncode`` convention, and the processes the worker left behind,
  which the zygote ended (it is a subreaper too: a dead worker's orphans come to it).
  ``("kill", pid)`` ends a worker and its process group, by the one process that knows whether
  the pid still names that worker.
- When the driver process ends (its pid's file descriptor, else its pid polled) or asks
  (``("stop",)``), a zygote ends every worker and everything they left, then exits; the
  template exits when the driver does.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import ctypes
import gc
import os
import pickle
import select
import signal
import socket
import sys
import time
from typing import Any

ZYGOTE_MARK = "waterwave_hpo.workers._zygote"
"""The last argument of the template's (and so every zygote's) command line. A worker rewrites
it in place to ``WORKER_MARK`` (the same length), so that tools (and tests) tell them apart."""
WORKER_MARK = "waterwave_hpo.workers._worker"
"""A string in every worker process's command line (to find them, e.g. with psutil)."""
MAX_MESSAGE_BYTES = 1 << 20
"""The largest message of the zygote's socket (a fork request carries the environment)."""

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 1.0  # without a pid file descriptor: how often the driver's pid is checked
_END_WAIT_S = 10.0  # how long the zygote waits for what it killed to be gone, at its end


def prctl(option: int, value: int) -> bool:
    """``prctl(option, value)`` on Linux; ``False`` where it is not available or refused."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the thread that forked it exits."""
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


def adopt_orphans() -> bool:
    """Make this process a child subreaper: orphaned descendants become its children.

    A process a trial starts and detaches (``setsid cmd &``: its parent, the shell, exits at
    once) would otherwise go to init and outlive the worker; as a subreaper the worker (and
    the zygote above it) still has it as a child, to end.
    """
    return prctl(_PR_SET_CHILD_SUBREAPER, 1)


def cuda_driver_loaded() -> bool:
    """Whether NVIDIA's driver library (``libcuda.so``) is mapped into this process.

    The CUDA runtime loads it at its first call (``cudaGetDeviceCount`` included, which
    ``torch.cuda.is_available()`` makes); a process forked after that cannot use CUDA.
    """
    try:
        with open("/proc/self/maps") as maps:
            return any("/libcuda.so" in line for line in maps)
    except OSError:
        return False


def rename_process(old: str, new: str) -> bool:
    """Replace the argument ``old`` of this process's command line by ``new`` (same length).

    What ``/proc/<pid>/cmdline`` (``ps``, ``psutil``) shows is the memory the kernel wrote the
    arguments to at ``exec``; a forked child shares the zygote's until it writes there. Only
    the last argument is replaced, in place, and only if it is ``old``.
    """
    if len(old) != len(new):
        return False
    try:
        with open("/proc/self/stat") as file:
            stat = file.read()
        fields = stat[stat.rindex(")") + 2 :].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
        wanted = old.encode() + b"\0"
        at = end - len(wanted)
        if at < start or ctypes.string_at(at, len(wanted)) != wanted:
            return False
        ctypes.memmove(at, new.encode(), len(new))
    except (OSError, ValueError, IndexError):
        return False
    return True


def prepare_process() -> None:
    """Import what every worker needs, and start PyTorch's lazy CPU machinery.

    Done once in the zygote (or once in each spawned worker): torch, Optuna, the package's run
    path and relay, cloudpickle (the objective arrives pickled with it) and psutil (the stray
    processes of a trial). One tiny training step on the CPU: PyTorch initialises autograd and
    its optimizers lazily (4.8 s measured on a loaded 2-core VM), which every worker's first
    trial would otherwise pay. Its tensors are too small for any OpenMP parallel region: no
    thread pool exists when the zygote forks. CUDA is not touched.
    """
    import cloudpickle  # noqa: F401
    import optuna  # noqa: F401
    import psutil  # noqa: F401
    import torch

    from waterwave_hpo.host import HostRunner  # noqa: F401
    from waterwave_hpo.relay import RelayedStorage  # noqa: F401
    from waterwave_hpo.workers import _worker  # noqa: F401

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.zeros(1, 2)).sum().backward()
    optimizer.step()


class _Zygote:
    """The fork server's state: its socket to the driver, its workers, its wake-ups."""

    def __init__(self, sock: socket.socket, driver_pid: int) -> None:
        self.sock = sock
        self.pid = os.getpid()
        self.driver_pid = driver_pid
        self.workers: dict[int, Any] = {}  # pid -> the driver's tag
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        os.set_blocking(self.wake_write, False)
        self.driver_fd: int | None = None
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                self.driver_fd = os.pidfd_open(driver_pid)

    def send(self, message: tuple[Any, ...]) -> None:
        """Send ``message`` to the driver; a driver gone is noticed by the loop."""
        with contextlib.suppress(OSError):
            self.sock.send(pickle.dumps(message))

    def serve(self) -> None:
        """Fork, kill and reap on request until the driver ends or stops it. Never returns."""
        for ready, driver_gone in _turns(self):
            if driver_gone:
                self.end()
            self.reap()
            if self.sock in ready:
                self.receive()

    def receive(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE_BYTES, 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.end()
        if not data:  # the driver closed its end
            for fd in fds:
                os.close(fd)
            self.end()
        request = pickle.loads(data)
        kind = request[0]
        if kind == "fork":
            _, tag, env, cwd = request
            if not fds:
                self.send(("fork_failed", tag, "the request carried no socket"))
                return
            self.fork(tag, env, cwd, fds[0])
        elif kind == "kill":
            self.kill(request[1])
        elif kind == "stop":
            self.end()
        for fd in fds[1:] if kind == "fork" else fds:
            os.close(fd)

    def fork(self, tag: Any, env: dict[str, str], cwd: str, fd: int) -> None:
        try:
            pid = os.fork()
        except OSError as error:
            os.close(fd)
            self.send(("fork_failed", tag, f"fork() failed: {error}"))
            return
        if pid == 0:
            self.become_worker(fd, env, cwd)  # never returns
        os.close(fd)
        with contextlib.suppress(OSError):  # also done by the child: whichever runs first
            os.setpgid(pid, pid)
        self.workers[pid] = tag
        self.send(("forked", tag, pid))

    def become_worker(self, fd: int, env: dict[str, str], cwd: str) -> None:
        """The forked child: leave the zygote's duties behind and serve the driver as a worker."""
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            die_with_parent()
            if os.getppid() != self.pid:
                os._exit(0)  # the zygote died before the line above took effect
            for own in (self.sock.fileno(), self.wake_read, self.wake_write, self.driver_fd):
                if own is not None:
                    with contextlib.suppress(OSError):
                        os.close(own)
            with contextlib.suppress(OSError):
                os.setpgid(0, 0)
            adopt_orphans()
            rename_process(ZYGOTE_MARK, WORKER_MARK)
            os.environ.clear()
            os.environ.update(env)
            with contextlib.suppress(OSError):  # gone since: the zygote's, as a spawn would fail
                os.chdir(cwd)
            gc.enable()
            from waterwave_hpo.workers._worker import serve_driver

            serve_driver(fd)
        except BaseException:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)

    def kill(self, pid: int) -> None:
        """SIGKILL worker ``pid`` and its process group, if it has not been reaped yet."""
        if pid not in self.workers:
            return
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)

    def reap(self) -> None:
        """Reap every child that exited; report each worker, end what a dead worker left."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            tag = self.workers.pop(pid, None)
            if tag is None:
                continue  # an orphan of a dead worker (ended below), now gone
            # The orphans it left (they came here), then what is left of its process group.
            ended = self.end_orphans()
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            self.send(("exited", tag, pid, _exitcode(status), ended))

    def end_orphans(self) -> list[tuple[int, str]]:
        """SIGKILL this process's children that are not live workers: a dead worker's orphans.

        A live worker is a subreaper itself: only the descendants of dead workers come here.
        """
        ended = []
        for pid in _children(os.getpid()):
            if pid in self.workers:
                continue
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                ended.append((pid, _name(pid)))
        return ended

    def end(self) -> None:
        """End every worker and every process they left; then exit. Never returns."""
        deadline = time.monotonic() + _END_WAIT_S
        while time.monotonic() < deadline:
            children = _children(os.getpid())
            if not children:
                break
            for pid in children:
                with contextlib.suppress(OSError):
                    if pid in self.workers:
                        os.killpg(pid, signal.SIGKILL)
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0] != 0:
                    pass
            time.sleep(0.01)
        os._exit(0)


def _exitcode(status: int) -> int:
    """``Popen.returncode``'s convention: the exit code, or minus the signal's number."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _children(parent: int) -> list[int]:
    """The pids of ``parent``'s children (``/proc``: the zygote imports no more for this)."""
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as file:
                stat = file.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields and int(fields[1]) == parent and fields[0] != "Z":
            found.append(int(entry))
    return found


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as file:
            return file.read().strip()
    except OSError:
        return "gone"


class _Template:
    """The zygote template: forks a private zygote per request, nothing else."""

    def __init__(self, sock: socket.socket, driver_pid: int) -> None:
        self.sock = sock
        self.driver_pid = driver_pid
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        os.set_blocking(self.wake_write, False)
        self.driver_fd: int | None = None
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                self.driver_fd = os.pidfd_open(driver_pid)

    def refuse_all(self, reason: str, retry_with_spawn: bool) -> None:
        """Answer every queued request on its own socket: the template cannot serve. Exits."""
        self.sock.setblocking(False)
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE_BYTES, 1)
            except OSError:
                break
            if not data:
                break
            for fd in fds:
                with contextlib.suppress(OSError):
                    answer = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=fd)
                    answer.send(pickle.dumps(("failed", reason, retry_with_spawn)))
                    answer.close()
        os._exit(1)

    def serve(self) -> None:
        """Fork a zygote per request until the driver ends. Never returns."""
        for ready, driver_gone in _turns(self):
            if driver_gone:
                os._exit(0)  # each zygote ends its own workers when it sees the driver gone
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0] != 0:  # zygotes that ended
                    pass
            if self.sock in ready:
                self.receive()

    def receive(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE_BYTES, 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            os._exit(0)
        if not data:  # the driver closed its end: it is gone
            os._exit(0)
        if fds:
            self.fork_zygote(fds[0])
        for fd in fds[1:]:
            os.close(fd)

    def fork_zygote(self, fd: int) -> None:
        try:
            pid = os.fork()
        except OSError as error:
            with contextlib.suppress(OSError):
                answer = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=fd)
                answer.send(pickle.dumps(("failed", f"fork() failed: {error}", False)))
                answer.close()
            return
        if pid != 0:
            os.close(fd)
            return
        code = 1
        try:  # the new zygote: leave the template's duties behind
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for own in (self.sock.fileno(), self.wake_read, self.wake_write, self.driver_fd):
                if own is not None:
                    with contextlib.suppress(OSError):
                        os.close(own)
            adopt_orphans()
            zygote = _Zygote(
                socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=fd), self.driver_pid
            )
            zygote.send(("ready", os.getpid()))
            zygote.serve()
        except BaseException:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _turns(server: Any) -> Iterator[tuple[list[Any], bool]]:
    """The select loop of a zygote and of the template: per turn, what is ready, driver gone.

    The driver is gone when its pid file descriptor is readable, else when its pid is not alive.
    ``server`` has ``sock``, ``wake_read``/``wake_write`` (a child's exit wakes the loop through
    SIGCHLD's wakeup fd, drained here), ``driver_fd`` (or ``None``) and ``driver_pid``.
    """
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(server.wake_write)
    watched: list[Any] = [server.sock, server.wake_read]
    if server.driver_fd is not None:
        watched.append(server.driver_fd)
    while True:
        try:
            ready, _, _ = select.select(watched, [], [], _POLL_S)
        except InterruptedError:
            ready = []
        if server.driver_fd is not None:
            driver_gone = server.driver_fd in ready
        else:
            driver_gone = not _alive(server.driver_pid)
        if server.wake_read in ready:
            with contextlib.suppress(OSError):
                os.read(server.wake_read, 4096)
        yield ready, driver_gone


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (without a pid file descriptor to watch)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def zygote_main(fd: int, driver_pid: int) -> None:
    """The zygote template's body (``python -c`` calls it with its socket). Never returns.

    Prepares the process once, then forks a private zygote per request. If it cannot serve,
    every request gets ``("failed", reason, retry_with_spawn)``: ``retry_with_spawn`` when
    forking would not be safe here (CUDA was loaded while importing), so the driver starts
    fresh interpreters instead.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=fd)
    if os.getppid() != driver_pid:  # the driver died before the template started
        os._exit(0)
    template = _Template(sock, driver_pid)
    try:
        prepare_process()
        import torch

        if torch.cuda.is_initialized() or cuda_driver_loaded():  # type: ignore[no-untyped-call]
            template.refuse_all(
                "CUDA's driver was loaded while the worker processes' modules were imported "
                "(a module that asks CUDA at import, e.g. torch.cuda.is_available()); a "
                "process forked after that cannot use CUDA",
                True,
            )
    except BaseException as error:
        template.refuse_all(f"{type(error).__name__}: {error}", False)
    gc.collect()
    gc.freeze()  # what the template built stays shared: no later collection touches it
    template.serve()
