"""An error that cannot be pickled keeps its type (or its type's name); its traceback crosses.

Errors raised in a worker process (``isolation="process"``) or a Ray host cross to the driver
pickled; a traceback never does (its text crosses beside it and becomes the error's cause), and
some errors cannot be pickled at all.
"""

from __future__ import annotations

import pickle
import threading

import optuna
import pytest

import waterwave_hpo as ww
from waterwave_hpo.host import RemoteTraceback
from waterwave_hpo.host import format_traceback
from waterwave_hpo.host import picklable_error
from waterwave_hpo.host import with_remote_traceback


class HoldsALockError(Exception):
    """A user's error with an attribute pickle refuses."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class TwoArgumentError(Exception):
    """Its pickled args (one message) do not fit its ``__init__``, and it holds a lock."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code {code}: {detail}")
        self.lock = threading.Lock()


def _raised(error: BaseException) -> BaseException:
    def deep_in_the_objective() -> None:
        raise error

    try:
        deep_in_the_objective()
    except BaseException as caught:
        return caught
    raise AssertionError("unreachable")


def _crossed(error: BaseException | None) -> BaseException:
    assert error is not None
    return pickle.loads(pickle.dumps(error))  # what the driver receives


def test_an_error_with_an_unpicklable_attribute_keeps_its_type() -> None:
    received = _crossed(picklable_error(_raised(HoldsALockError("bad batch"))))
    assert type(received) is HoldsALockError and str(received) == "bad batch"


def test_an_error_that_cannot_be_rebuilt_names_its_type() -> None:
    received = _crossed(picklable_error(_raised(TwoArgumentError(7, "disk full"))))
    assert isinstance(received, RuntimeError)
    assert str(received) == f"{__name__}.TwoArgumentError: code 7: disk full"


def test_a_picklable_error_crosses_as_itself_and_its_traceback_as_text() -> None:
    raised = _raised(KeyError("objective bug"))
    text = format_traceback(raised)
    received = _crossed(picklable_error(raised))
    assert type(received) is KeyError and received.args == ("objective bug",)
    assert text is not None and "deep_in_the_objective" in text
    assert isinstance(with_remote_traceback(received, text).__cause__, RemoteTraceback)


def test_from_a_worker_process_the_users_error_type_reaches_optimize() -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        raise HoldsALockError("raised in the worker")

    executor = ww.WaterwaveExecutor("cpu", trials_per_device=1, isolation="process")
    with pytest.raises(HoldsALockError, match="raised in the worker") as caught:
        executor.optimize(optuna.create_study(), objective, n_trials=1)
    cause = caught.value.__cause__
    assert isinstance(cause, RemoteTraceback) and "raised in the worker" in cause.text
