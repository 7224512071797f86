"""Process isolation: each slot of a device runs its trials in a worker process.

``WaterwaveExecutor(isolation="process")``: ``_host.py`` is the driver's side (a host whose
slots own worker processes, the pipes' service, crash handling), ``_worker.py`` the worker's,
``_leases.py`` the device-memory leases that keep the workers' peaks apart, ``_payload.py`` what
a worker starts from (the pickled objective and settings).
"""

from waterwave_hpo.executor._process._host import ProcessHost
from waterwave_hpo.executor._process._host import exit_reason
from waterwave_hpo.executor._process._payload import process_hosts

__all__ = ["ProcessHost", "exit_reason", "process_hosts"]
