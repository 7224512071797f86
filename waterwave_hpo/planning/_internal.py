"""What the planning package offers the project's other packages beyond its public facade.

The executor plans a trial's model only when it does not fit the memory left beside its
neighbours: it profiles once (:func:`profile_units`), compares the plain step's peak and the
smallest plannable peak (:func:`plan_smallest`) with the room, then installs a plan from the
same profile (:func:`install_plan`). It imports these from here only. Not
part of the public API.
"""

from __future__ import annotations

from waterwave_hpo.planning._fit import install_plan
from waterwave_hpo.planning._planners import plan_none
from waterwave_hpo.planning._planners import plan_smallest
from waterwave_hpo.planning._units import UnitModules
from waterwave_hpo.planning._units import profile_units

__all__ = ["UnitModules", "install_plan", "plan_none", "plan_smallest", "profile_units"]
