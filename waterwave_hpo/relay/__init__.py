"""The study's storage reached from another process: the access policy, the client, the service.

A process that runs trials (a Ray host actor, a worker process under process isolation) cannot
share the driver's ``optuna.Study``; its trials use :class:`RelayedStorage`, whose calls a
transport carries to the driver's :class:`StorageService`, which checks each against the run's
:class:`StudyAccessPolicy` and runs it on the study's own storage. The transports
live with what they carry: over Ray in ``cluster/``, over a pipe in ``executor/``.
"""

from waterwave_hpo.relay._client import RelayedHeartbeatStorage
from waterwave_hpo.relay._client import RelayedStorage
from waterwave_hpo.relay._client import Transport
from waterwave_hpo.relay._policy import StoragePermissionError
from waterwave_hpo.relay._policy import StudyAccessPolicy
from waterwave_hpo.relay._service import StorageService
from waterwave_hpo.relay._service import sendable

__all__ = [
    "RelayedHeartbeatStorage",
    "RelayedStorage",
    "StoragePermissionError",
    "StorageService",
    "StudyAccessPolicy",
    "Transport",
    "sendable",
]
