"""The Tune trial's side of ``tune_hosts()``: a small process that relays its host's events.

Each Tune trial of :class:`~waterwave_hpo.cluster._tune_hosts.TuneHosts` is a process of its
own (a Ray actor Tune starts), but the training function runs in a host actor
(:mod:`waterwave_hpo.cluster._hosted`); the trial process only starts it there and replays its
``tune.report`` results. So this module imports Ray Tune and the messages
(:mod:`waterwave_hpo.cluster._hosted_events`), never torch nor the user's trainable: the
trainable crosses this process as the bytes the driver pickled it to, and only its host
unpickles it. Each trial process then costs Ray's worker and ``ray.tune`` (about 3 CPU-s to
start on the 2-core CPU VM), not torch's import (another 3.4) and its memory.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
import contextlib
import shutil
import threading
import time
from typing import Any
import uuid

from ray import tune

from waterwave_hpo.cluster._broker import NAMESPACE
from waterwave_hpo.cluster._hosted_events import HostedEvent
from waterwave_hpo.cluster._hosted_events import pack_directory
from waterwave_hpo.cluster._hosted_events import unpack_directory
from waterwave_hpo.cluster._nodes import describe_error

_POLL_S = 1.0
_LOAD_WAIT_S = 1.0
_LOAD_TIMEOUT_S = 30.0


class HostedTrialError(RuntimeError):
    """Raised in a Tune trial whose function failed inside its trial host.

    Raised in a Tune trial whose function failed inside its trial host; the message carries
    the function's own traceback. ``out_of_memory`` says whether the device ran out of memory
    (set ``tune.FailureConfig(max_failures=...)`` to run such a trial again).
    """

    def __init__(self, message: str, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory


def hosted_trainable(
    name: str,
    payload: bytes,
    prefix: str,
    fusion_token: str | None,
    batch_key: Callable[[dict[str, Any]], Hashable] | None,
    heartbeat_ttl_s: float,
) -> Callable[[dict[str, Any]], None]:
    """The function trainable Tune runs for ``TuneHosts.wrap``: it runs the trainable in a host.

    Args:
        name: The user's trainable's name (Tune names the trials after it).
        payload: The user's trainable, pickled by the driver (``ray.cloudpickle``); unpickled
            only in the host, so that the trial process imports none of its modules.
        prefix: The hosts' actor names' prefix (this ``tune_hosts()`` run's).
        fusion_token: With a batched trainable, this wrap's token: its trials share fused
            batches only with each other; ``None`` for a trainable run one trial per call.
        batch_key: With a batched trainable, trials whose configs give equal keys may share a
            batch; ``None``: any of this wrap's trials may.
        heartbeat_ttl_s: The hosts' ``heartbeat_ttl_s`` (seconds): the trial's process keeps
            its trial alive in the host at a quarter of it.
    """

    def hosted(config: dict[str, Any]) -> None:
        group = None
        if fusion_token is not None:
            key = "" if batch_key is None else repr(batch_key(config))
            group = f"{fusion_token}/{key}"
        run_in_host(prefix, payload, config, group, heartbeat_ttl_s)

    hosted.__name__ = hosted.__qualname__ = name
    return hosted


def run_in_host(
    prefix: str,
    payload: bytes,
    config: dict[str, Any],
    group: str | None = None,
    heartbeat_ttl_s: float = 30.0,
) -> None:
    """Start the pickled trainable in the least loaded alive host and replay its events.

    Hosts are found by name (``prefix`` + index) when the trial starts, so that hosts started
    on nodes that joined are used and hosts lost with their node are skipped. While this
    process waits in ``tune.report`` (Tune's driver takes each result in its own time), a
    thread keeps the trial alive in its host every ``heartbeat_ttl_s / 4`` seconds: the host
    stops only the trials whose process is gone.

    Raises:
        HostedTrialError: If the function failed in its host, its host was lost (Tune runs the
            trial again, from its last checkpoint, under ``tune.FailureConfig(max_failures=...)``),
            no host is alive, or the host stopped the trial for want of a heartbeat.
    """
    import ray

    host, where = _least_loaded_host(prefix)
    # Unique per run of the function: Tune may reuse a trial's process, or run a trial again.
    key = f"{tune.get_context().get_trial_id()}/{uuid.uuid4().hex[:12]}"
    checkpoint = tune.get_checkpoint()
    packed = None
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            packed = pack_directory(directory)
    finished = False
    beating = threading.Event()
    heart = threading.Thread(
        target=_heartbeat,
        args=(host, key, heartbeat_ttl_s / 4, beating),
        name=f"waterwave-tune-heartbeat-{key}",
        daemon=True,
    )
    try:
        ray.get(host.start.remote(key, payload, config, packed, group))
        heart.start()
        while not finished:
            try:
                events = ray.get(host.poll.remote(key, _POLL_S))
            except KeyError:  # Ray's error for the host's KeyError is one too
                finished = True  # the host no longer has it: nothing to stop
                raise HostedTrialError(
                    f"The trial's waterwave-hpo host {where} stopped it: nothing kept it alive "
                    f"for heartbeat_ttl_s={heartbeat_ttl_s:g} s, as when this trial's process "
                    "is stopped (a debugger, SIGSTOP, a machine under extreme load). Raise "
                    "ww.tune_hosts(heartbeat_ttl_s=...) if that is expected."
                ) from None
            for event in events:
                if event.kind == "result":
                    _report(event)
                    continue
                finished = True
                if event.kind == "error":
                    raise HostedTrialError(
                        f"The trial's function failed in its waterwave-hpo host:\n{event.error}",
                        out_of_memory=event.out_of_memory,
                    )
    except ray.exceptions.RayActorError as error:
        finished = True  # nothing to stop: the host is gone
        raise HostedTrialError(
            f"The trial's waterwave-hpo host {where} was lost ({describe_error(error)}). Set "
            "tune.FailureConfig(max_failures=...) to run the trial again, from its last "
            "checkpoint, in another host."
        ) from None
    finally:
        beating.set()
        if not finished:  # Tune stopped this trial (report raised SystemExit) or it failed here
            with contextlib.suppress(Exception):
                host.stop.remote(key)


def _heartbeat(host: Any, key: str, every_s: float, done: threading.Event) -> None:
    """Touch trial ``key`` in its host every ``every_s`` seconds until ``done`` is set."""
    while not done.wait(every_s):
        with contextlib.suppress(Exception):  # the host is gone: the poll says so
            host.touch.remote(key)


def _least_loaded_host(prefix: str) -> tuple[Any, str]:
    """The alive host of this run with the fewest trials, and its name.

    Raises:
        HostedTrialError: If no host of this run answers.
    """
    import ray

    names = sorted(
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == NAMESPACE and entry["name"].startswith(prefix)
    )
    asked: dict[Any, tuple[str, Any]] = {}  # the load() ref -> (name, handle)
    for name in names:
        with contextlib.suppress(ValueError):  # its name is gone: the host died
            host = ray.get_actor(name, namespace=NAMESPACE)
            asked[host.load.remote()] = (name, host)
    # The hosts that answer within _LOAD_WAIT_S; a host still starting, or on a node that is
    # gone, is not waited on, unless none answers (then up to _LOAD_TIMEOUT_S for the first).
    candidates: list[tuple[int, str, Any]] = []
    deadline = time.monotonic() + _LOAD_TIMEOUT_S
    waiting = list(asked)
    while waiting and not candidates and time.monotonic() < deadline:
        ready, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=_LOAD_WAIT_S)
        for ref in ready:
            with contextlib.suppress(ray.exceptions.RayActorError):
                candidates.append((ray.get(ref), *asked[ref]))
    if not candidates:
        raise HostedTrialError(
            f"No waterwave-hpo trial host of this run is alive ({len(names)} named "
            f"{prefix}*, none answering). Their GPU nodes may have left the cluster; run the "
            "trials again when GPU nodes are back."
        )
    _, name, host = min(candidates, key=lambda candidate: candidate[0])
    return host, name


def _report(event: HostedEvent) -> None:
    assert event.metrics is not None
    if event.checkpoint is None:
        tune.report(event.metrics)
        return
    directory = unpack_directory(event.checkpoint)
    try:
        tune.report(event.metrics, checkpoint=tune.Checkpoint.from_directory(directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
