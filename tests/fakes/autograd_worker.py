"""CUDA's autograd topology on the CPU: every backward on one shared worker thread.

On CUDA, autograd runs the backward of every tensor on a device on one worker thread per
device, shared by all threads of the process, under an empty ``contextvars`` context; the
thread that called ``backward()`` waits. On the CPU backward runs in the calling thread, which
hides three classes of bug: a backward hook that blocks (it would stall every co-hosted trial),
one that relies on :func:`waterwave_hpo.current` (no trial is current there), and one that
relies on thread-local state of the trial's thread. :class:`SharedAutogradWorker` reproduces
the CUDA topology: install it and every ``Tensor.backward`` / ``torch.autograd.backward`` runs
on one shared daemon thread in a fresh ``contextvars.Context()``, with a timeout that turns a
blocked hook into a test failure instead of a hang.

Like the engine (``Engine::ready_queue`` in ``torch/csrc/autograd/engine.cpp``), a thread that
turned multithreaded backward off (``torch.autograd.set_multithreading_enabled(False)``, a flag
of the calling thread's ``c10::AutogradState``) runs its backward itself, in its own context:
counted in :attr:`SharedAutogradWorker.inline_backwards`, not in ``backwards``.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from typing import Any

import pytest
import torch


class BackwardTimeoutError(AssertionError):
    """A backward did not finish in time on the shared worker: a hook blocked it."""


class SharedAutogradWorker:
    """One shared backward thread (one fake device), as CUDA's autograd engine has.

    Args:
        timeout_s: Seconds a ``backward()`` may take before the test fails.
    """

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.backwards = 0
        #: Backwards run in the calling thread because it turned multithreading off.
        self.inline_backwards = 0
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._inline = threading.local()
        self._thread = threading.Thread(
            target=self._run, name="fake-autograd-device-0", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, done = job
            try:
                done.put((True, contextvars.Context().run(fn)))  # a fresh, empty context
            except BaseException as error:
                done.put((False, error))

    def on_worker(self) -> bool:
        """Whether the caller is the worker thread."""
        return threading.current_thread() is self._thread

    def run(self, fn: Any) -> Any:
        """Run ``fn()`` on the worker and wait for it (at most ``timeout_s``)."""
        if self.on_worker():  # a backward inside a backward (e.g. a reentrant checkpoint)
            return fn()
        if not torch._C._is_multithreading_enabled():  # this thread's flag, as the engine reads it
            if getattr(self._inline, "depth", 0):  # Tensor.backward calls autograd.backward
                return fn()
            self.inline_backwards += 1
            self._inline.depth = 1
            try:
                return fn()
            finally:
                self._inline.depth = 0
        done: queue.Queue[Any] = queue.Queue()
        self._jobs.put((fn, done))
        try:
            ok, value = done.get(timeout=self.timeout_s)
        except queue.Empty:
            raise BackwardTimeoutError(
                f"a backward took more than {self.timeout_s} s on the shared autograd worker: "
                "a backward hook blocked (on CUDA that stalls every co-hosted trial)"
            ) from None
        self.backwards += 1
        if not ok:
            raise value
        return value

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Route ``Tensor.backward``, ``torch.autograd.backward`` and ``.grad`` to the worker."""
        tensor_backward = torch.Tensor.backward
        autograd_backward = torch.autograd.backward
        autograd_grad = torch.autograd.grad

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            self.run(lambda: tensor_backward(tensor, *args, **kwargs))

        def functional(*args: Any, **kwargs: Any) -> None:
            self.run(lambda: autograd_backward(*args, **kwargs))

        def grad(*args: Any, **kwargs: Any) -> Any:
            return self.run(lambda: autograd_grad(*args, **kwargs))

        monkeypatch.setattr(torch.Tensor, "backward", backward)
        monkeypatch.setattr(torch.autograd, "backward", functional)
        monkeypatch.setattr(torch.autograd, "grad", grad)

    def close(self) -> None:
        """Stop the worker (it is a daemon: a blocked one does not keep the process alive)."""
        self._jobs.put(None)
