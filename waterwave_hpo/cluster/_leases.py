"""The per-GPU broker's book-keeping, which lives below the executor and the cluster.

:class:`LeaseBook` moved to ``waterwave_hpo/memory/_leases.py``: the executor's
worker processes (process isolation) lease memory from it as Ray's packed trials do through
``cluster/_broker.py``. The names stay importable from here for the cluster's modules.
"""

from __future__ import annotations

from waterwave_hpo.memory._internal import LeaseBook
from waterwave_hpo.memory._internal import LeaseStats
from waterwave_hpo.memory._internal import MemoryLease

__all__ = ["LeaseBook", "LeaseStats", "MemoryLease"]
