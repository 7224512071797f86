"""The stream-aware memory pool (Waterwave's first mechanism), under PyTorch and CuPy.

One pool for all co-hosted trials on a GPU: memory one trial frees is usable by another as soon
as it is *scheduled* safe. See :class:`StreamAwarePool`.
"""

from __future__ import annotations

from waterwave_hpo.memory._errors import OOMReason
from waterwave_hpo.memory._errors import PoolBackendError
from waterwave_hpo.memory._errors import PoolOutOfMemoryError
from waterwave_hpo.memory._lib import LIBRARY_ENV_VAR
from waterwave_hpo.memory._lib import library_path
from waterwave_hpo.memory._pool import SIM_DEFAULT_CAPACITY_BYTES
from waterwave_hpo.memory._pool import Account
from waterwave_hpo.memory._pool import Backend
from waterwave_hpo.memory._pool import StreamAwarePool
from waterwave_hpo.memory._pool import round_size
from waterwave_hpo.memory._sim import AllocRecord
from waterwave_hpo.memory._sim import FinishRecord
from waterwave_hpo.memory._sim import FreeRecord
from waterwave_hpo.memory._sim import OOMRecord
from waterwave_hpo.memory._sim import SegmentRecord
from waterwave_hpo.memory._sim import SimDevice
from waterwave_hpo.memory._sim import StreamHazard
from waterwave_hpo.memory._sim import StreamWaitRecord
from waterwave_hpo.memory._sim import SubmitRecord
from waterwave_hpo.memory._sim import TraceKind
from waterwave_hpo.memory._sim import TraceRecord
from waterwave_hpo.memory._stats import AllocationSource
from waterwave_hpo.memory._stats import BlockInfo
from waterwave_hpo.memory._stats import DriverStats
from waterwave_hpo.memory._stats import LockStats
from waterwave_hpo.memory._stats import PoolStats
from waterwave_hpo.memory._stats import UsageStats
from waterwave_hpo.memory._streams import stream_handle
from waterwave_hpo.memory._torch import NO_POOL_MARKER
from waterwave_hpo.memory._torch import OOM_MARKER
from waterwave_hpo.memory._torch import TorchAllocatorInfo
from waterwave_hpo.memory._torch import allocator_info
from waterwave_hpo.memory._torch import allocator_swapped
from waterwave_hpo.memory._torch import device_pool
from waterwave_hpo.memory._torch import installed_pool
from waterwave_hpo.memory._torch import is_pool_oom
from waterwave_hpo.memory._torch import translate_oom
from waterwave_hpo.memory._torch import use_pool

__all__ = [
    "LIBRARY_ENV_VAR",
    "NO_POOL_MARKER",
    "OOM_MARKER",
    "SIM_DEFAULT_CAPACITY_BYTES",
    "Account",
    "AllocRecord",
    "AllocationSource",
    "Backend",
    "BlockInfo",
    "DriverStats",
    "FinishRecord",
    "FreeRecord",
    "LockStats",
    "OOMReason",
    "OOMRecord",
    "PoolBackendError",
    "PoolOutOfMemoryError",
    "PoolStats",
    "SegmentRecord",
    "SimDevice",
    "StreamAwarePool",
    "StreamHazard",
    "StreamWaitRecord",
    "SubmitRecord",
    "TorchAllocatorInfo",
    "TraceKind",
    "TraceRecord",
    "UsageStats",
    "allocator_info",
    "allocator_swapped",
    "device_pool",
    "installed_pool",
    "is_pool_oom",
    "library_path",
    "round_size",
    "stream_handle",
    "translate_oom",
    "use_pool",
]
