"""Process isolation: each slot of a device runs its trials in a worker process.

``WaterwaveExecutor(isolation="process")``. Both ends of the pipe live here, as both ends of Ray's
wire live in ``waterwave_hpo.cluster``: ``_handle.py`` is the driver's end (the driver's handle
to a device whose slots own worker processes, the pipes' service, crash handling),
``_pool.py`` the warm workers (started once per executor, kept across ``optimize``
calls), ``_worker.py`` the worker's end (a :class:`~waterwave_hpo.host.HostRunner` over a pipe),
``_lease_service.py`` the device-memory leases that keep the workers' peaks apart,
``_payload.py`` what a worker starts from (the pickled objective and settings). Below the
executor; never imports it.
"""

from waterwave_hpo.workers._handle import ProcessHostHandle
from waterwave_hpo.workers._lease_service import bound_process
from waterwave_hpo.workers._payload import process_hosts
from waterwave_hpo.workers._pool import WORKER_MARK
from waterwave_hpo.workers._pool import WorkerPools
from waterwave_hpo.workers._pool import exit_reason

__all__ = [
    "WORKER_MARK",
    "ProcessHostHandle",
    "WorkerPools",
    "bound_process",
    "exit_reason",
    "process_hosts",
]
