"""Which RUNNING trials of a shared study are stale, judged by their owner's liveness.

Optuna's RDB storage fails a trial whose heartbeat is older than ``grace_period``
(``optuna/storages/_heartbeat.py``); Optuna 5.0's ``JournalStorage`` records no heartbeats. The
demo gives the journal the same idea, per process: every trial records its owner (host, pid,
process start time) in its system attributes as the objective starts, and every demo process
writes a heartbeat (a study system attribute) every ``heartbeat_interval_s``. A RUNNING trial is
stale iff

- its owner runs on this host and that process is gone (its pid exited or was reused), or
- its owner runs on another host and its last heartbeat is older than ``grace_period_s``, or
- it has no owner yet (its process died between ``ask`` and the objective's first line) and
  either it started more than ``grace_period_s`` ago or no other demo process is alive.

Never merely because it is RUNNING when a process starts: two demo processes may share one
``--out``. A stale trial's parameters are queued again (a WAITING trial with ``fixed_params``,
as ``Study.enqueue_trial`` makes, marked :data:`ATTR_RERUN_OF`), then it is told FAIL with the
reason; it no longer counts toward ``--trials``; its re-run does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
import threading
import time
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import FrozenTrial
from optuna.trial import TrialState

from waterwave_hpo import _checks
from waterwave_hpo import _optuna_compat
from waterwave_hpo.demo._process import ProcessIdentity
from waterwave_hpo.host import ATTR_FAIL_REASON
from waterwave_hpo.host import ATTR_RETRY_OF

ATTR_OWNER = "waterwave:owner"
"""Trial system attribute: the :class:`ProcessIdentity` (as JSON) of the process running it."""
ATTR_RERUN_OF = "waterwave:rerun_of"
"""Trial system attribute: the number of the interrupted trial whose parameters this one runs."""
HEARTBEAT_PREFIX = "waterwave:heartbeat:"
"""Study system attribute prefix; ``<prefix><owner key>`` holds ``{"owner", "at_s"}``."""


@dataclass(frozen=True)
class LivenessRule:
    """How often a demo process proves it is alive, and how long silence makes it dead.

    Attributes:
        heartbeat_interval_s: Seconds between heartbeats (Optuna's ``heartbeat_interval``).
        grace_period_s: Seconds without a heartbeat after which a process on another host is
            dead (Optuna's ``grace_period``); also the age after which an ownerless RUNNING
            trial is stale.
    """

    heartbeat_interval_s: float = 10.0
    grace_period_s: float = 60.0

    def __post_init__(self) -> None:
        _checks.check_number(
            "heartbeat_interval_s", self.heartbeat_interval_s, fix="pass seconds, e.g. 10.0"
        )
        _checks.check_number("grace_period_s", self.grace_period_s, fix="pass seconds, e.g. 60.0")
        if self.grace_period_s <= self.heartbeat_interval_s:
            raise _checks.value_error(
                "grace_period_s",
                self.grace_period_s,
                f"must exceed heartbeat_interval_s={self.heartbeat_interval_s!r}, or live "
                "processes look dead between two heartbeats",
                "pass a grace period of several heartbeat intervals, e.g. 6x",
            )


class Heartbeat:
    """A daemon thread writing this process's heartbeat into the study until stopped.

    Use as a context manager around everything that asks for trials.
    """

    def __init__(self, study: optuna.Study, me: ProcessIdentity, rule: LivenessRule) -> None:
        self._study = study
        self._me = me
        self._rule = rule
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="waterwave-heartbeat", daemon=True)

    def beat(self) -> None:
        """Write one heartbeat now."""
        _set_study_system_attr(
            self._study,
            HEARTBEAT_PREFIX + self._me.key,
            {"owner": self._me.to_json(), "at_s": time.time()},
        )

    def __enter__(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._rule.heartbeat_interval_s):
            try:
                self.beat()
            except Exception:  # the next beat may succeed; a missed one costs nothing yet
                continue


def record_owner(trial: optuna.trial.Trial, me: ProcessIdentity) -> None:
    """Record ``me`` as the owner of a running trial (first thing in the objective)."""
    _optuna_compat.set_system_attr(
        trial.study, _optuna_compat.trial_id(trial), ATTR_OWNER, me.to_json()
    )


def owner_of(trial: FrozenTrial) -> ProcessIdentity | None:
    """The process that ran (or runs) ``trial``, if it recorded itself."""
    return ProcessIdentity.from_json(trial.system_attrs.get(ATTR_OWNER))


def stale_trials(
    study: optuna.Study, me: ProcessIdentity, rule: LivenessRule
) -> list[tuple[FrozenTrial, str]]:
    """The RUNNING trials of ``study`` whose process is gone, each with why.

    Args:
        study: The shared study.
        me: The calling process (its own trials are never stale).
        rule: Heartbeat interval and grace period.

    Returns:
        ``(trial, reason)`` pairs, by trial number.
    """
    now_s = time.time()
    heartbeats = _heartbeats(study)
    live_others = [
        owner
        for owner, at_s in heartbeats.values()
        if owner != me and _is_alive(owner, at_s, now_s, rule)
    ]
    stale: list[tuple[FrozenTrial, str]] = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = owner_of(trial)
        age_s = _age_s(trial, now_s)
        if owner is None:
            if age_s > rule.grace_period_s:
                why = f"it names no owner and started {age_s:.0f} s ago"
            elif not live_others:
                why = "it names no owner and no other demo process on this study is alive"
            else:
                continue
        elif owner == me:
            continue
        elif owner.is_on_this_host():
            if not owner.is_gone():
                continue
            why = f"its process, {owner.describe()}, is gone"
        else:
            last = heartbeats.get(owner.key)
            silent_s = now_s - last[1] if last is not None else age_s
            if silent_s <= rule.grace_period_s:
                continue
            why = f"its process, {owner.describe()}, sent no heartbeat for {silent_s:.0f} s"
        stale.append((trial, why))
    return stale


def requeue_and_fail(study: optuna.Study, trial: FrozenTrial, reason: str) -> bool:
    """Queue ``trial``'s parameters again, then tell it FAIL with ``reason``.

    In this order, so a kill in between leaves the trial RUNNING (stale again, and its re-run
    already queued is not queued twice) rather than FAIL without a re-run.

    Returns:
        ``True`` if this call failed the trial; ``False`` if it had finished meanwhile (a
        neighbour process failed it first).
    """
    if not any(rerun_of(t) == trial.number for t in study.get_trials(deepcopy=False)):
        requeue(study, trial)
    try:
        _optuna_compat.set_system_attr(
            study, _optuna_compat.trial_id(trial), ATTR_FAIL_REASON, reason
        )
        _optuna_compat.fail_trial(study, _optuna_compat.trial_id(trial))
    except UpdateFinishedTrialError:
        return False
    return True


def requeue(study: optuna.Study, trial: FrozenTrial) -> None:
    """Add a WAITING trial that runs ``trial``'s parameters again, marked :data:`ATTR_RERUN_OF`.

    This is what ``Study.enqueue_trial`` does (a WAITING trial with ``fixed_params``), with the
    mark in the system attributes instead of the user's.
    """
    # A trial that was itself a re-run may have been killed before suggesting all its fixed
    # parameters: keep them all.
    fixed = trial.system_attrs.get("fixed_params")
    params = {**(fixed if isinstance(fixed, dict) else {}), **trial.params}
    study.add_trial(
        optuna.trial.create_trial(
            state=TrialState.WAITING,
            system_attrs={"fixed_params": params, ATTR_RERUN_OF: trial.number},
        )
    )


def rerun_of(trial: FrozenTrial) -> int | None:
    """The interrupted trial whose parameters ``trial`` runs again, if it is such a re-run."""
    value = trial.system_attrs.get(ATTR_RERUN_OF)
    return value if isinstance(value, int) else None


def counted_trials(trials: Iterable[FrozenTrial]) -> list[FrozenTrial]:
    """The trials that count toward ``--trials``.

    Not counted: WAITING trials (not started), interrupted trials (a re-run of them exists; the
    re-run counts once it starts), and the executor's re-runs after an out-of-memory error (the
    first attempt counts).
    """
    trials = list(trials)
    interrupted = {n for n in map(rerun_of, trials) if n is not None}
    return [
        t
        for t in trials
        if t.state is not TrialState.WAITING
        and t.number not in interrupted
        and _attr(t, ATTR_RETRY_OF) is None
    ]


def _attr(trial: FrozenTrial, key: str) -> Any:
    # The executor's bookkeeping moves from user to system attributes; read either.
    return trial.system_attrs.get(key, trial.user_attrs.get(key))


def _heartbeats(study: optuna.Study) -> dict[str, tuple[ProcessIdentity, float]]:
    attrs = _optuna_compat.study_system_attrs(study)
    beats: dict[str, tuple[ProcessIdentity, float]] = {}
    for key, value in attrs.items():
        if not key.startswith(HEARTBEAT_PREFIX) or not isinstance(value, dict):
            continue
        owner = ProcessIdentity.from_json(value.get("owner"))
        at_s = value.get("at_s")
        if owner is not None and isinstance(at_s, (int, float)):
            beats[owner.key] = (owner, float(at_s))
    return beats


def _is_alive(owner: ProcessIdentity, at_s: float, now_s: float, rule: LivenessRule) -> bool:
    if owner.is_on_this_host():
        return not owner.is_gone()
    return now_s - at_s <= rule.grace_period_s


def _age_s(trial: FrozenTrial, now_s: float) -> float:
    # Optuna stores datetime_start as naive local time, which .timestamp() reads as such.
    start = trial.datetime_start
    return 0.0 if start is None else now_s - start.timestamp()


def _set_study_system_attr(study: optuna.Study, key: str, value: Any) -> None:
    _optuna_compat.set_study_system_attr(study, key, value)
