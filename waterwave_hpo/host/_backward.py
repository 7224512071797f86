"""A trial's backward runs in the trial's own thread, not on autograd's device thread.

On CUDA, PyTorch's autograd engine runs the backward of every graph on a device on one worker
thread per device, shared by the whole process (``torch/csrc/autograd/engine.cpp``:
``Engine::ready_queue`` hands device work to the device's queue). With K co-hosted trials that
one thread serialises their kernel launches and Python hooks, runs CuPy code on CuPy's null
stream (CuPy's current stream is thread-local: the worker never made the trial's stream
current), and sees none of the trial thread's thread-local or ``contextvars`` state
(:func:`waterwave_hpo.current` included).

``torch.autograd.set_multithreading_enabled(False)`` sets a flag in the calling thread's
``c10::AutogradState`` (thread-local: ``AutogradState::get_tls_state()``), which the engine reads
when it routes the graph's work: with the flag off every node runs on the calling thread's own
ready queue, so the thread that called ``backward()`` runs its backward, on the streams autograd
records per node (the trial's stream). Other threads, and the device threads that exist for
them, are untouched; threads the trial starts itself keep the default.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib

import torch


@contextlib.contextmanager
def backward_in_this_thread() -> Iterator[None]:
    """Run every backward the calling thread starts in this thread, for the block's duration.

    The previous setting of this thread is restored on exit, also when the block raises.
    """
    with torch.autograd.set_multithreading_enabled(False):
        yield
