"""Optional dependencies of the Ray cluster executor, imported on first use with an install hint."""

from __future__ import annotations

from types import ModuleType

_HINT = 'Install the Ray extra: pip install "waterwave-hpo[ray]" (it brings ray[tune]).'


def import_ray() -> ModuleType:
    """Return the ``ray`` module.

    Raises:
        ImportError: If Ray is not installed, with the command that installs it.
    """
    try:
        import ray
    except ImportError as error:
        raise ImportError(
            f"waterwave_hpo.cluster needs Ray, which is not installed. {_HINT}"
        ) from error
    return ray
