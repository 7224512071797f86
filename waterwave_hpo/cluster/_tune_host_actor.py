"""The Ray actor of ``tune_hosts()``: a trial host on its GPU.

A module of its own, importing nothing heavy at its top: Ray imports an actor's class module in
every process that looks the actor up by name, and each Tune trial's process does
(:mod:`waterwave_hpo.cluster._tune_trial`); torch and the host are imported in the actor only.
"""

from __future__ import annotations

import threading
from typing import Any

from waterwave_hpo.cluster._hosted_events import HostedEvent
from waterwave_hpo.cluster._hosted_events import HostStats


class TuneHostActor:
    """The Ray actor: a :class:`~waterwave_hpo.cluster._hosted.TrialHost` on its GPU."""

    def __init__(self, settings: dict[str, Any]) -> None:
        import ray
        import torch

        from waterwave_hpo.cluster._hosted import TrialHost

        gpu_ids = ray.get_gpu_ids()
        device = torch.device("cpu")
        if gpu_ids and torch.cuda.is_available() and torch.cuda.device_count() > 0:
            device = torch.device("cuda", 0)  # Ray made this actor's GPU the only one visible
        self._host = TrialHost(device, **settings)
        # Each wrap's trainable, unpickled once here from the bytes every one of its Tune
        # trials sends (the trials' own processes never unpickle it).
        self._trainables: dict[bytes, Any] = {}
        self._trainables_lock = threading.Lock()

    def start(
        self,
        key: str,
        payload: bytes,
        config: dict[str, Any],
        checkpoint: bytes | None,
        group: str | None = None,
    ) -> None:
        import ray

        with self._trainables_lock:
            fn = self._trainables.get(payload)
            if fn is None:
                fn = self._trainables[payload] = ray.cloudpickle.loads(payload)
        self._host.start(key, fn, config, checkpoint, group)

    def poll(self, key: str, timeout_s: float) -> list[HostedEvent]:
        return self._host.poll(key, timeout_s)

    def touch(self, key: str) -> bool:
        return self._host.touch(key)

    def stop(self, key: str) -> None:
        self._host.stop(key)

    def load(self) -> int:
        return self._host.load()

    def stats(self) -> HostStats:
        return self._host.stats()

    def shutdown(self) -> None:
        self._host.shutdown()
