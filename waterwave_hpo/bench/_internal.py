"""What the bench offers the project's other packages beyond its public facade.

``waterwave-hpo doctor`` runs its CUDA checks in a child process the way the bench runs a method.
It imports this from here only. Not part of the public API.
"""

from __future__ import annotations

from waterwave_hpo.bench._runners import call_in_child

__all__ = ["call_in_child"]
