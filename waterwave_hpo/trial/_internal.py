"""What the trial package offers the project's runners beyond its public facade.

The executor and the cluster's hosts set the running trial's context; only they need the
context variable itself. Not part of the public API.
"""

from __future__ import annotations

from waterwave_hpo.trial._context import _CURRENT as CURRENT_CONTEXT

__all__ = ["CURRENT_CONTEXT"]
