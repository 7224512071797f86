"""A fresh process per search, forked from one server that imported torch once."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
import contextlib
import multiprocessing
import os
import queue
from typing import Any

from waterwave_hpo.bench._search_methods import SearchMethod
from waterwave_hpo.bench._search_results import SearchRun
from waterwave_hpo.bench._search_run import SearchSettings

PRELOAD = (
    "torch",
    "torch._dynamo",  # the first optimizer of a process imports it: seconds on a busy CPU
    "optuna",
    "sklearn.datasets",
    "waterwave_hpo.bench",
    "waterwave_hpo.demo",
    "waterwave_hpo.fusion",
)
"""What the fork server imports once, so that a search's process starts in a moment."""


@contextlib.contextmanager
def search_processes(
    cuda: bool = False,
) -> Iterator[Callable[[SearchMethod, int, SearchSettings], SearchRun]]:
    """Yield ``run(method, seed, settings)``: one search in a process of its own.

    On the CPU each search's process is forked from a fork server (``multiprocessing``'s
    ``forkserver``) that imported :data:`PRELOAD` and never ran an OpenMP region, so a search
    inherits no other search's state (caches, allocators) and starts without importing torch
    again. On CUDA each is a fresh interpreter (``spawn``), as the throughput bench's methods
    are: a process forked from one that reached the CUDA driver cannot use CUDA, and each
    method must choose its allocator before CUDA starts. Either way OpenMP's idle threads are
    told to sleep (``OMP_WAIT_POLICY=PASSIVE``, as in the executor's worker processes; a value
    the user set is kept): spinning idle threads take the cores from busy ones whenever the
    machine runs more threads than it has cores.

    Args:
        cuda: Whether the searches run on a GPU.
    """
    set_here = "OMP_WAIT_POLICY" not in os.environ
    if set_here:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        context: Any
        if cuda:
            context = multiprocessing.get_context("spawn")
        else:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(list(PRELOAD))
        yield lambda method, seed, settings: _call(context, method, seed, settings)
    finally:
        if set_here:
            os.environ.pop("OMP_WAIT_POLICY", None)


def _call(context: Any, method: SearchMethod, seed: int, settings: SearchSettings) -> SearchRun:
    results: Any = context.Queue()
    child = context.Process(target=_child, args=(method, seed, settings, results))
    child.start()
    try:
        ok, value = _wait(child, results)
    finally:
        child.join()
    if not ok:
        k = 1 if method is SearchMethod.TEMPORAL else settings.k
        failed = SearchRun(method.value, seed, k, settings.budget_s, available=False)
        failed.skipped_reason = f"its process failed: {value}"
        return failed
    run: SearchRun = value
    return run


def _wait(child: Any, results: Any) -> tuple[bool, Any]:
    # A child killed by a signal (the OOM killer, a crash in native code) sends nothing.
    while True:
        try:
            answer: tuple[bool, Any] = results.get(timeout=1.0)
            return answer
        except queue.Empty:
            if not child.is_alive():
                try:
                    answer = results.get(timeout=1.0)
                    return answer
                except queue.Empty:
                    return False, f"it exited with code {child.exitcode} and sent no result"


def _child(method: SearchMethod, seed: int, settings: SearchSettings, results: Any) -> None:
    import optuna

    from waterwave_hpo.bench._search_run import run_search

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        results.put((True, run_search(method, seed, settings)))
    except BaseException as error:  # report it; never leave the bench waiting
        results.put((False, repr(error)))
