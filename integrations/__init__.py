"""Adapters to HPO frameworks, importable as ``waterwave_hpo.integrations``.

- :mod:`waterwave_hpo.integrations.optuna`: ``create_study``/``load_study`` returning a study whose
  ``optimize`` takes ``executor=``.
- :mod:`waterwave_hpo.integrations.ray_tune`: ``shared_gpu()`` for Ray Tune, memory leases per GPU
  (needs the ``ray`` extra).
- :mod:`waterwave_hpo.integrations.transformers`: ``hyperparameter_search()``, Hugging Face
  ``Trainer`` searches run by the executor (needs the ``frameworks`` extra).
- :mod:`waterwave_hpo.integrations.lightning`: ``trainer_kwargs()``, a Lightning ``Trainer`` per
  co-hosted trial (needs the ``frameworks`` extra).

Each submodule is imported on first use, so ``waterwave_hpo.integrations.ray_tune.X`` works
after ``import waterwave_hpo`` and a missing optional dependency fails only there.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("lightning", "optuna", "ray_tune", "transformers")


def __getattr__(name: str) -> Any:
    """Import the submodule ``name`` on first attribute access.

    Raises:
        AttributeError: If ``name`` is no submodule of this package.
        ImportError: If the submodule's optional dependency is missing (with the extra to install).
    """
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
