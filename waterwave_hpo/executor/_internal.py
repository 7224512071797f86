"""What the driver offers the project's other packages beyond its public facade.

The Ray executor (``waterwave_hpo.cluster``) drives its hosts with the executor's loop, so it
needs the loop's types and the driver's view of a host. It imports them from here, never from
the executor's other private modules, so those can change behind this one list
(``tests/test_private_imports.py`` keeps it so). The device side (what runs a trial on a device,
in any process) is ``waterwave_hpo.host``. Not part of the public API: no compatibility promise
to users.
"""

from __future__ import annotations

from waterwave_hpo.executor._executor import check_isolation
from waterwave_hpo.executor._handle import HostHandle
from waterwave_hpo.executor._optimize import Callback
from waterwave_hpo.executor._optimize import ObjectiveFunc

__all__ = ["Callback", "HostHandle", "ObjectiveFunc", "check_isolation"]
