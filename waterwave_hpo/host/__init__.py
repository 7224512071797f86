"""The device side: what runs trials on one device, in whichever process hosts them.

A :class:`DeviceHost` has slots (threads, one CUDA stream each) that run trials through one path
(:func:`run_attempt`: context, stream, pool account, memory plan, outcome), with the device's
memory machinery (the stream-aware pool, the pipeline scheduler). The driver's executor builds one
in its own process; a worker process (``waterwave_hpo.workers``) and a Ray actor
(``waterwave_hpo.cluster``) build one from a :class:`HostSpec` and serve it through a
:class:`HostRunner`. Nothing here imports the driver (``waterwave_hpo.executor``) or a transport
(``tests/test_import_direction.py``). Not part of the public API: the public names are
re-exported by ``waterwave_hpo.executor`` and ``waterwave_hpo``.
"""

from waterwave_hpo.host._attempt import TrialInterrupted
from waterwave_hpo.host._attempt import on_trial_stream
from waterwave_hpo.host._attempt import planned_rerun_cap
from waterwave_hpo.host._attempt import run_attempt
from waterwave_hpo.host._attrs import ATTR_ATTEMPT
from waterwave_hpo.host._attrs import ATTR_BATCH
from waterwave_hpo.host._attrs import ATTR_DEVICE
from waterwave_hpo.host._attrs import ATTR_FAIL_REASON
from waterwave_hpo.host._attrs import ATTR_MEMORY_PLAN
from waterwave_hpo.host._attrs import ATTR_PEAK_BYTES
from waterwave_hpo.host._attrs import ATTR_PLAN_CAP
from waterwave_hpo.host._attrs import ATTR_RETRY_OF
from waterwave_hpo.host._attrs import ATTR_SLOT
from waterwave_hpo.host._attrs import trial_attr
from waterwave_hpo.host._attrs import trial_memory_plan
from waterwave_hpo.host._batch import BatchedObjective
from waterwave_hpo.host._batch import batched
from waterwave_hpo.host._batch import check_fuse_matches
from waterwave_hpo.host._batch import is_batched
from waterwave_hpo.host._device_host import DeviceHost
from waterwave_hpo.host._device_host import RunSettings
from waterwave_hpo.host._devices import DeviceSpec
from waterwave_hpo.host._devices import resolve_devices
from waterwave_hpo.host._driver import device_total_bytes
from waterwave_hpo.host._memory import _TRIAL_ACCOUNT as TRIAL_ACCOUNT
from waterwave_hpo.host._memory import DeviceMemory
from waterwave_hpo.host._memory import MemoryPoolMode
from waterwave_hpo.host._memory import check_pool_device
from waterwave_hpo.host._memory import default_budget_bytes
from waterwave_hpo.host._memory import make_device_memory
from waterwave_hpo.host._memory import trial_memory_stats
from waterwave_hpo.host._oom import is_out_of_memory
from waterwave_hpo.host._oom import mark_never_fits
from waterwave_hpo.host._outcome import OnOOM
from waterwave_hpo.host._outcome import OutcomeKind
from waterwave_hpo.host._outcome import TrialJob
from waterwave_hpo.host._outcome import TrialOutcome
from waterwave_hpo.host._planning import MemoryPlanMode
from waterwave_hpo.host._planning import NoPlanFitsError
from waterwave_hpo.host._planning import PlanSettings
from waterwave_hpo.host._planning import TrialPlanning
from waterwave_hpo.host._planning import fit_trial_memory
from waterwave_hpo.host._planning import plan_settings
from waterwave_hpo.host._runner import HostRunner
from waterwave_hpo.host._runner import HostSnapshot
from waterwave_hpo.host._runner import HostSpec
from waterwave_hpo.host._runner import RemoteTraceback
from waterwave_hpo.host._runner import TrialRecord
from waterwave_hpo.host._runner import UnpicklableError
from waterwave_hpo.host._runner import fail_trial
from waterwave_hpo.host._runner import format_traceback
from waterwave_hpo.host._runner import picklable_error
from waterwave_hpo.host._runner import tell_record
from waterwave_hpo.host._runner import with_remote_traceback
from waterwave_hpo.host._slots import NoMemory
from waterwave_hpo.host._slots import SlotTable
from waterwave_hpo.host._streams import acquire_stream
from waterwave_hpo.host._streams import release_stream

__all__ = [
    "ATTR_ATTEMPT",
    "ATTR_BATCH",
    "ATTR_DEVICE",
    "ATTR_FAIL_REASON",
    "ATTR_MEMORY_PLAN",
    "ATTR_PEAK_BYTES",
    "ATTR_PLAN_CAP",
    "ATTR_RETRY_OF",
    "ATTR_SLOT",
    "TRIAL_ACCOUNT",
    "BatchedObjective",
    "DeviceHost",
    "DeviceMemory",
    "DeviceSpec",
    "HostRunner",
    "HostSnapshot",
    "HostSpec",
    "MemoryPlanMode",
    "MemoryPoolMode",
    "NoMemory",
    "NoPlanFitsError",
    "OnOOM",
    "OutcomeKind",
    "PlanSettings",
    "RemoteTraceback",
    "RunSettings",
    "SlotTable",
    "TrialInterrupted",
    "TrialJob",
    "TrialOutcome",
    "TrialPlanning",
    "TrialRecord",
    "UnpicklableError",
    "acquire_stream",
    "batched",
    "check_fuse_matches",
    "check_pool_device",
    "default_budget_bytes",
    "device_total_bytes",
    "fail_trial",
    "fit_trial_memory",
    "format_traceback",
    "is_batched",
    "is_out_of_memory",
    "make_device_memory",
    "mark_never_fits",
    "on_trial_stream",
    "picklable_error",
    "plan_settings",
    "planned_rerun_cap",
    "release_stream",
    "resolve_devices",
    "run_attempt",
    "tell_record",
    "trial_attr",
    "trial_memory_plan",
    "trial_memory_stats",
    "with_remote_traceback",
]
