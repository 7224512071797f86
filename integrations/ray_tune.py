"""Ray Tune trials that share GPUs: ``shared_gpu()`` packs several trials on each GPU and the
trials on one GPU hold memory leases from a per-GPU broker so their peaks do not collide.

Importable as ``waterwave_hpo.integrations.ray_tune``; needs Ray Tune
(``pip install "waterwave-hpo[ray]"``). ``waterwave_hpo.shared_gpu`` is the same function.
"""

from __future__ import annotations

from waterwave_hpo.cluster._imports import import_ray

import_ray()  # fail here, with the install command, when Ray is missing

from waterwave_hpo.cluster._leases import LeaseStats  # noqa: E402
from waterwave_hpo.cluster._leases import MemoryLease  # noqa: E402
from waterwave_hpo.cluster._shared_gpu import shared_gpu  # noqa: E402
from waterwave_hpo.cluster._shared_gpu import with_shared_gpu  # noqa: E402
from waterwave_hpo.cluster._tune import LeaseTimeoutError  # noqa: E402
from waterwave_hpo.cluster._tune import SharedGPU  # noqa: E402
from waterwave_hpo.cluster._tune import lease_stats  # noqa: E402

__all__ = [
    "LeaseStats",
    "LeaseTimeoutError",
    "MemoryLease",
    "SharedGPU",
    "lease_stats",
    "shared_gpu",
    "with_shared_gpu",
]
