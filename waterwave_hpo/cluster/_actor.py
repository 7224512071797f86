"""The device-host actor: one host (``executor``'s :class:`HostRunner`) in a Ray actor.

Each actor owns one device (the GPU Ray gave it, ``num_gpus=1``; the CPU where it has none) and
co-hosts trials on it exactly as on one machine: slot threads, one CUDA stream each, the pool and
the pipeline scheduler. It opens the study through the driver's storage channel (over Ray), runs
the trials the driver hands it and reports how each ended as records the driver tells. What does
not depend on Ray (the spec, the record, the host side) is ``host/_runner.py``'s, shared with
the worker processes of process isolation; this module adds where the actor runs.
"""

from __future__ import annotations

from dataclasses import dataclass
import os
from typing import Any

import optuna

from waterwave_hpo import _optuna_compat
from waterwave_hpo.host import HostRunner
from waterwave_hpo.host import HostSnapshot
from waterwave_hpo.host import HostSpec
from waterwave_hpo.host import TrialRecord
from waterwave_hpo.host import resolve_devices

__all__ = [
    "ATTR_HOST",
    "ATTR_NODE",
    "HostActor",
    "HostInfo",
    "HostSnapshot",
    "HostSpec",
    "TrialRecord",
]

ATTR_HOST = "waterwave:host"
"""The host actor that ran the trial: ``"<node ip>/pid<pid>/<device>"`` (Ray cluster only)."""
ATTR_NODE = "waterwave:node"
"""The Ray node id of the host actor that ran the trial (Ray cluster only)."""


@dataclass(frozen=True)
class HostInfo:
    """Where a host actor runs."""

    label: str
    device: str
    node_id: str
    pid: int


class HostActor:
    """One device host in a Ray actor (create it with ``ray.remote(HostActor).options(...)``).

    Methods are called by the driver's :class:`~waterwave_hpo.cluster._handle.RayHostHandle`; the
    actor is threaded (``max_concurrency > 1``) so that :meth:`submit` runs while :meth:`poll`
    waits for outcomes.

    Args:
        spec: The study, the objective and the executor's settings.

    Raises:
        StoragePermissionError: If the study is not the one the driver's channel serves.
    """

    def __init__(self, spec: HostSpec) -> None:
        import ray

        assert spec.storage is not None, "a host actor reaches the study through the relay"
        device = resolve_devices("auto")[0]
        # The driver tells each trial from this host's record (defer_finish): the user's
        # sampler and callbacks see it in the driver's process, and a trial's end costs no
        # storage round trip here.
        self._runner = HostRunner(spec, spec.storage.connect(defer_finish=True), device)
        self._study = self._runner.study
        node_ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self._info = HostInfo(
            label=f"{node_ip}/pid{os.getpid()}/{device}",
            device=str(device),
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
        )

    def info(self) -> HostInfo:
        """Where this host runs (also: the actor is up and its study is open)."""
        return self._info

    def submit(
        self,
        slot: int,
        members: list[tuple[int, int, int | None]],
        fused: bool = False,
        plan_cap_bytes: int | None = None,
        frozen: list[optuna.trial.FrozenTrial] | None = None,
    ) -> None:
        """Run the study's trials (asked by the driver) in slot ``slot``, as one job.

        :meth:`HostRunner.submit <waterwave_hpo.host.HostRunner.submit>`, with this host's
        bookkeeping attributes (``ATTR_HOST``, ``ATTR_NODE``) written here when the driver sent
        no ``frozen`` copies (with them, the driver wrote those attributes itself).
        """
        if frozen is None:
            for trial_id, _, _ in members:
                _optuna_compat.set_system_attr(self._study, trial_id, ATTR_HOST, self._info.label)
                _optuna_compat.set_system_attr(self._study, trial_id, ATTR_NODE, self._info.node_id)
        self._runner.submit(slot, members, fused, plan_cap_bytes, frozen)

    def poll(
        self, timeout_s: float, submits: list[tuple[Any, ...]] | None = None
    ) -> tuple[list[TrialRecord], HostSnapshot]:
        """Take the driver's next jobs, wait for trial attempts to end; return how they ended.

        The driver sends the jobs it asked since the last poll with the poll (one round trip
        per trial instead of two).

        Args:
            timeout_s: How long to wait for an attempt to end (seconds).
            submits: :meth:`submit`'s arguments, one tuple per job, run first (in order); a job
                that cannot start raises here, before any record is taken, as :meth:`submit`.
        """
        for args in submits or ():
            self.submit(*args)
        return self._runner.poll(timeout_s)

    def interrupt(self, slot: int) -> None:
        """Stop the trial running in ``slot`` (the driver has told it FAIL already)."""
        self._runner.interrupt(slot)

    def shutdown(self, timeout_s: float) -> None:
        """Stop the slot threads, waiting up to ``timeout_s`` seconds."""
        self._runner.shutdown(timeout_s=timeout_s)
