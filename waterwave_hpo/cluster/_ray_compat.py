"""The Ray internals waterwave-hpo relies on, in one place (as ``_optuna_compat`` for Optuna).

``ray.tune.report`` and ``ray.tune.get_checkpoint`` reach the process's one training session,
``ray.train._internal.session._session`` (private; Ray 2.x). In a ``tune_hosts()`` host
process, which runs many Tune trials' functions in threads, a session object of ours stands
there and routes each call to the trial of the calling thread.
"""

from __future__ import annotations

from collections.abc import Callable
import threading
from typing import Any

from waterwave_hpo.cluster._hosted_events import pack_directory
from waterwave_hpo.cluster._imports import import_ray

_lock = threading.Lock()


class _HostedSession:
    """Stands in for Ray's session in a host process; dispatches by the calling thread."""

    world_rank = None  # what Ray's ``_in_tune_session()`` reads: a Tune (not Train) session

    def __init__(self) -> None:
        self.providers: list[Callable[[], Any]] = []

    def _trial(self) -> Any:
        for provider in list(self.providers):
            trial = provider()
            if trial is not None:
                return trial
        raise RuntimeError(
            "ray.tune.report()/get_checkpoint() was called in a waterwave-hpo trial host "
            "outside a hosted trial's own thread (a thread the trial started itself?). Call it "
            "from the thread that runs the training function."
        )

    def report(self, metrics: dict[str, Any], checkpoint: Any = None, **_: Any) -> None:
        self._trial().report(metrics, checkpoint)

    @property
    def loaded_checkpoint(self) -> Any:
        return self._trial().loaded_checkpoint

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"Ray's session attribute {name!r} is not available to trials hosted by "
            "waterwave_hpo.tune_hosts(); ray.tune.report and ray.tune.get_checkpoint are."
        )


def _session_module() -> Any:
    import_ray()
    from ray.train._internal import session

    return session


def install_session(provider: Callable[[], Any]) -> None:
    """Route ``tune.report``/``tune.get_checkpoint`` in this process through ``provider``.

    Route ``tune.report``/``tune.get_checkpoint`` in this process through ``provider``
    (called in the reporting thread; returns that thread's trial or ``None``).

    Raises:
        RuntimeError: If this process already runs a real Ray Train/Tune session (a trial
            host must be its own process, e.g. a Ray actor).
    """
    module = _session_module()
    with _lock:
        current = getattr(module, "_session", None)
        if isinstance(current, _HostedSession):
            current.providers.append(provider)
            return
        if current is not None:
            raise RuntimeError(
                "A waterwave-hpo trial host cannot start in a process that runs a Ray "
                "Train/Tune session itself; tune_hosts() runs hosts as their own Ray actors."
            )
        session = _HostedSession()
        session.providers.append(provider)
        module._session = session


def uninstall_session(provider: Callable[[], Any]) -> None:
    """Undo :func:`install_session`; the process's session is cleared with the last one."""
    module = _session_module()
    with _lock:
        current = getattr(module, "_session", None)
        if not isinstance(current, _HostedSession):
            return
        if provider in current.providers:
            current.providers.remove(provider)
        if not current.providers:
            module._session = None


def pack_checkpoint(checkpoint: Any) -> bytes:
    """A ``ray.tune.Checkpoint``'s directory as a gzipped tar (see :func:`pack_directory`)."""
    with checkpoint.as_directory() as directory:
        return pack_directory(directory)


def checkpoint_from_directory(directory: str) -> Any:
    """``ray.tune.Checkpoint.from_directory(directory)``."""
    import_ray()
    from ray.tune import Checkpoint

    return Checkpoint.from_directory(directory)
