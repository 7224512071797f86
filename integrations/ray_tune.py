"""Ray Tune trials that share GPUs, two ways.

Ray Tune trials that share GPUs, two ways: ``shared_gpu()`` packs several trial processes on
each GPU and they hold memory leases from a per-GPU broker so their peaks do not collide;
``tune_hosts()`` runs the trials' functions co-hosted in one actor per GPU (streams, one pool,
the pipeline scheduler) and streams their results back to Tune.

Importable as ``waterwave_hpo.integrations.ray_tune``; needs Ray Tune
(``pip install "waterwave-hpo[ray]"``). ``waterwave_hpo.shared_gpu`` is the same function.
"""

from __future__ import annotations

from waterwave_hpo.cluster._imports import import_ray

import_ray()  # fail here, with the install command, when Ray is missing

from waterwave_hpo.cluster._hosted import HostedTrialStopped  # noqa: E402
from waterwave_hpo.cluster._hosted import TuneBatchTrial  # noqa: E402
from waterwave_hpo.cluster._hosted_events import HostStats  # noqa: E402
from waterwave_hpo.cluster._shared_gpu import shared_gpu  # noqa: E402
from waterwave_hpo.cluster._shared_gpu import with_shared_gpu  # noqa: E402
from waterwave_hpo.cluster._tune import LeaseTimeoutError  # noqa: E402
from waterwave_hpo.cluster._tune import SharedGPU  # noqa: E402
from waterwave_hpo.cluster._tune import lease_stats  # noqa: E402
from waterwave_hpo.cluster._tune_hosts import TuneHosts  # noqa: E402
from waterwave_hpo.cluster._tune_hosts_api import tune_hosts  # noqa: E402
from waterwave_hpo.cluster._tune_trial import HostedTrialError  # noqa: E402
from waterwave_hpo.memory._internal import LeaseStats  # noqa: E402
from waterwave_hpo.memory._internal import MemoryLease  # noqa: E402

__all__ = [
    "HostStats",
    "HostedTrialError",
    "HostedTrialStopped",
    "LeaseStats",
    "LeaseTimeoutError",
    "MemoryLease",
    "SharedGPU",
    "TuneBatchTrial",
    "TuneHosts",
    "lease_stats",
    "shared_gpu",
    "tune_hosts",
    "with_shared_gpu",
]
