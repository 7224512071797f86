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


def start_ray(ray: ModuleType, caller: str) -> None:
    """Start a local Ray (``ray.init()``) unless Ray is initialized already.

    Args:
        ray: The ``ray`` module.
        caller: Who starts it, named in the error, e.g. ``"RayExecutor.optimize"``.

    Raises:
        RuntimeError: Ray could not start; the message says how to start it yourself, and
            Ray's own error is the ``__cause__``.
    """
    if ray.is_initialized():
        return
    try:
        ray.init()
    except Exception as error:
        raise RuntimeError(
            f"{caller} found Ray not initialized and could not start a local Ray "
            f"({type(error).__name__}: {error}). Start or join a cluster yourself first: "
            "ray.init() for a local one, ray.init(address='auto') to join a running cluster "
            "(`ray start --head` on its head node)."
        ) from error
