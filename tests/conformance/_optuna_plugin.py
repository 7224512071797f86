"""A pytest plugin for Optuna's own test files: ``Study.optimize`` runs through the executor.

Loaded only in the inner pytest run that ``test_optuna_conformance.py`` starts (``-p
_optuna_plugin``), never in this project's own test session. ``WATERWAVE_CONFORMANCE_K`` is the
executor's ``trials_per_device``; ``WATERWAVE_CONFORMANCE_ISOLATION`` its ``isolation``
(``threads`` by default: an executor per call; or ``process``: one executor for the whole run,
closed at its end, so its workers start once); ``WATERWAVE_CONFORMANCE_REPORT`` is the JSON file
the plugin writes at the end: every collected test's outcome and whether it reached
``optimize``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from _expected_different import expected_different
import optuna
import pytest

import waterwave_hpo as ww

_K = int(os.environ.get("WATERWAVE_CONFORMANCE_K", "1"))
_ISOLATION = os.environ.get("WATERWAVE_CONFORMANCE_ISOLATION", "threads")
_REPORT = os.environ.get("WATERWAVE_CONFORMANCE_REPORT", "")
# Optuna parametrizes many tests over its STORAGE_MODES; these run here ("all": every one).
_STORAGES = os.environ.get("WATERWAVE_CONFORMANCE_STORAGES", "all")
_current_nodeid: str | None = None
_reached: set[str] = set()
_outcomes: dict[str, str] = {}
_original_optimize = optuna.Study.optimize
# Under isolation="process", one executor for the whole inner run, made at the first optimize:
# its K warm workers start once and serve every Optuna test, one study after another, whatever
# the previous test left behind (an objective that raised, a stop, an interrupt, a timeout,
# another storage), as a user's notebook reuses one executor. With threads, an executor per call.
_executor: ww.WaterwaveExecutor | None = None
# Process-wide functions that an Optuna test patches from inside its objective
# (test_hyperband_no_call_of_filter_study_in_should_prune: ``mock.patch`` around each trial's
# body). ``mock.patch`` is not thread-safe: with K trials at once, one trial's patch can save a
# neighbour's mock as "the original" and put it back on exit, leaving the mock installed for
# the rest of the process; every later ``study.tell`` then told the mock, not the storage, and
# 18 pruner tests failed after it (CI, threads at K=4, on a loaded machine). That test is
# expected to differ at K > 1 (_expected_different.py); the original is restored after each
# test so that what it leaves cannot fail the tests that follow, and the test is named.
_PATCHED_FROM_OBJECTIVES: list[tuple[Any, str, Any]] = [
    (optuna.pruners, "_filter_study", optuna.pruners._filter_study),
]
_restored_after: list[str] = []


def _executor_for_this_call() -> ww.WaterwaveExecutor:
    global _executor
    if _ISOLATION != "process":
        return ww.WaterwaveExecutor(devices="cpu", trials_per_device=_K, isolation=_ISOLATION)
    if _executor is None:
        _executor = ww.WaterwaveExecutor(devices="cpu", trials_per_device=_K, isolation=_ISOLATION)
    return _executor


def _optimize_through_executor(
    self: optuna.Study,
    func: Any,
    n_trials: int | None = None,
    timeout: float | None = None,
    n_jobs: int = 1,
    catch: Any = (),
    callbacks: Any = None,
    gc_after_trial: bool = False,
    show_progress_bar: bool = False,
) -> None:
    # n_jobs is Optuna's thread pool; the executor's trials_per_device takes its place.
    if _current_nodeid is not None:
        _reached.add(_current_nodeid)
    _executor_for_this_call().optimize(
        self,
        func,
        n_trials=n_trials,
        timeout=timeout,
        catch=catch,
        callbacks=callbacks,
        gc_after_trial=gc_after_trial,
        show_progress_bar=show_progress_bar,
    )


def pytest_configure(config: pytest.Config) -> None:
    optuna.Study.optimize = _optimize_through_executor  # type: ignore[method-assign]


def pytest_unconfigure(config: pytest.Config) -> None:
    global _executor
    optuna.Study.optimize = _original_optimize  # type: ignore[method-assign]
    if _executor is not None:
        _executor.close()
        _executor = None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _STORAGES != "all":
        keep = set(_STORAGES.split(","))
        selected, deselected = [], []
        for item in items:
            # Every storage a test is parametrized over: ``storage_mode``, and both ends of
            # the copy tests (``from_storage_mode``, ``to_storage_mode``: 6 x 6 pairs of them,
            # each a gRPC or SQLite server, were 70% of an inner run's time).
            callspec = getattr(item, "callspec", None)
            params = callspec.params if callspec is not None else {}
            modes = {v for k, v in params.items() if k.endswith("storage_mode")}
            (deselected if modes - keep else selected).append(item)
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
    expected = expected_different(_K, _ISOLATION)
    for item in items:
        reason = expected.get(item.nodeid) or expected.get(item.nodeid.split("[")[0])
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=f"expected to differ: {reason}", strict=False))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    global _current_nodeid
    _current_nodeid = item.nodeid
    try:
        return (yield)
    finally:
        _current_nodeid = None
        for owner, name, original in _PATCHED_FROM_OBJECTIVES:
            if getattr(owner, name) is not original:
                setattr(owner, name, original)
                _restored_after.append(f"{item.nodeid}: {owner.__name__}.{name}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        if hasattr(report, "wasxfail"):
            outcome = "xpassed" if report.passed else "xfailed"
        else:
            outcome = report.outcome
        if report.nodeid not in _outcomes or outcome != "passed":
            _outcomes[report.nodeid] = outcome


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:  # e.g. a missing test dependency: Optuna's file never ran
        _outcomes[report.nodeid] = "collection error"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _REPORT:
        return
    with open(_REPORT, "w", encoding="utf-8") as file:
        json.dump(
            {
                "k": _K,
                "isolation": _ISOLATION,
                "outcomes": _outcomes,
                "reached_optimize": sorted(_reached),
                "restored_after": _restored_after,
            },
            file,
            indent=1,
        )
