"""What the executor offers the project's other packages beyond its public facade.

The cluster (remote device hosts, co-hosted Tune trials), the report and the demo build on the
executor's bookkeeping and host machinery. They import it from here, never from the executor's
other private modules, so those can change behind this one list. Not part of the public API: no compatibility
promise to users.
"""

from __future__ import annotations

from waterwave_hpo.executor._attrs import ATTR_BATCH
from waterwave_hpo.executor._attrs import ATTR_DEVICE
from waterwave_hpo.executor._attrs import ATTR_FAIL_REASON
from waterwave_hpo.executor._attrs import ATTR_MEMORY_PLAN
from waterwave_hpo.executor._attrs import ATTR_PEAK_BYTES
from waterwave_hpo.executor._attrs import ATTR_RETRY_OF
from waterwave_hpo.executor._attrs import ATTR_SLOT
from waterwave_hpo.executor._batch import is_batched
from waterwave_hpo.executor._devices import resolve_devices
from waterwave_hpo.executor._host import DeviceHost
from waterwave_hpo.executor._host import RunSettings
from waterwave_hpo.executor._host_protocol import Host
from waterwave_hpo.executor._memory import _TRIAL_ACCOUNT as TRIAL_ACCOUNT
from waterwave_hpo.executor._memory import make_device_memory
from waterwave_hpo.executor._optimize import Callback
from waterwave_hpo.executor._optimize import ObjectiveFunc
from waterwave_hpo.executor._outcome import OutcomeKind
from waterwave_hpo.executor._outcome import TrialJob
from waterwave_hpo.executor._outcome import TrialOutcome
from waterwave_hpo.executor._planning import MemoryPlanMode
from waterwave_hpo.executor._planning import PlanSettings
from waterwave_hpo.executor._planning import TrialPlanning
from waterwave_hpo.executor._planning import plan_settings
from waterwave_hpo.executor._process._leases import bound_process
from waterwave_hpo.executor._remote import HostRunner
from waterwave_hpo.executor._remote import HostSnapshot
from waterwave_hpo.executor._remote import HostSpec
from waterwave_hpo.executor._remote import TrialRecord
from waterwave_hpo.executor._remote import fail_trial
from waterwave_hpo.executor._remote import tell_record
from waterwave_hpo.executor._run import on_trial_stream
from waterwave_hpo.executor._run import run_attempt
from waterwave_hpo.executor._streams import acquire_stream
from waterwave_hpo.executor._streams import release_stream
from waterwave_hpo.trial import NoOptunaTrial
from waterwave_hpo.trial._internal import CURRENT_CONTEXT

__all__ = [
    "ATTR_BATCH",
    "ATTR_DEVICE",
    "ATTR_FAIL_REASON",
    "ATTR_MEMORY_PLAN",
    "ATTR_PEAK_BYTES",
    "ATTR_RETRY_OF",
    "ATTR_SLOT",
    "CURRENT_CONTEXT",
    "TRIAL_ACCOUNT",
    "Callback",
    "DeviceHost",
    "Host",
    "HostRunner",
    "HostSnapshot",
    "HostSpec",
    "MemoryPlanMode",
    "NoOptunaTrial",
    "ObjectiveFunc",
    "OutcomeKind",
    "PlanSettings",
    "RunSettings",
    "TrialJob",
    "TrialOutcome",
    "TrialPlanning",
    "TrialRecord",
    "acquire_stream",
    "bound_process",
    "fail_trial",
    "is_batched",
    "make_device_memory",
    "on_trial_stream",
    "plan_settings",
    "release_stream",
    "resolve_devices",
    "run_attempt",
    "tell_record",
]
