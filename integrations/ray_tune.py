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

import importlib  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402
from typing import Any  # noqa: E402

if TYPE_CHECKING:  # what type checkers see; at run time each name is imported on first use
    from waterwave_hpo.cluster._hosted import HostedTrialStopped
    from waterwave_hpo.cluster._hosted import TuneBatchTrial
    from waterwave_hpo.cluster._hosted_events import HostStats
    from waterwave_hpo.cluster._shared_gpu import shared_gpu
    from waterwave_hpo.cluster._shared_gpu import with_shared_gpu
    from waterwave_hpo.cluster._tune import LeaseTimeoutError
    from waterwave_hpo.cluster._tune import SharedGPU
    from waterwave_hpo.cluster._tune import lease_stats
    from waterwave_hpo.cluster._tune_hosts import TuneHosts
    from waterwave_hpo.cluster._tune_hosts_api import tune_hosts
    from waterwave_hpo.cluster._tune_trial import HostedTrialError
    from waterwave_hpo.memory._internal import LeaseStats
    from waterwave_hpo.memory._internal import MemoryLease

# Each name is imported on first use (PEP 562), as the package's are: a shared_gpu() trial's
# process imports this module (its trainable and resources come from here) and needs neither
# torch nor the co-hosting machinery tune_hosts() brings (on the 2-core VM, importing every name
# at once took 6.3 CPU seconds, torch 3.3 of them; shared_gpu's names alone, 2.1 to 2.9).
_SOURCES = {
    "HostStats": "waterwave_hpo.cluster._hosted_events",
    "HostedTrialError": "waterwave_hpo.cluster._tune_trial",
    "HostedTrialStopped": "waterwave_hpo.cluster._hosted",
    "LeaseStats": "waterwave_hpo.memory._internal",
    "LeaseTimeoutError": "waterwave_hpo.cluster._tune",
    "MemoryLease": "waterwave_hpo.memory._internal",
    "SharedGPU": "waterwave_hpo.cluster._tune",
    "TuneBatchTrial": "waterwave_hpo.cluster._hosted",
    "TuneHosts": "waterwave_hpo.cluster._tune_hosts",
    "lease_stats": "waterwave_hpo.cluster._tune",
    "shared_gpu": "waterwave_hpo.cluster._shared_gpu",
    "tune_hosts": "waterwave_hpo.cluster._tune_hosts_api",
    "with_shared_gpu": "waterwave_hpo.cluster._shared_gpu",
}


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value  # later lookups find it without this call
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SOURCES))


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
