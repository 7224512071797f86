"""Optional dependencies of the Ray cluster executor, imported on first use with an install hint."""

from __future__ import annotations

from types import ModuleType

_HINT = (
    'Install the Ray extra: pip install "waterwave-hpo[ray]" (it brings ray[tune]; the cluster '
    "executor also needs grpcio for Optuna's gRPC storage proxy: pip install grpcio)."
)


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


def import_grpc() -> ModuleType:
    """Return the ``grpc`` module (Optuna's gRPC storage proxy needs it).

    Raises:
        ImportError: If grpcio is not installed, with the command that installs it.
    """
    try:
        import grpc
    except ImportError as error:
        raise ImportError(
            "waterwave_hpo.cluster serves the study to its host actors through Optuna's gRPC "
            f"storage proxy, which needs grpcio, and it is not installed. {_HINT}"
        ) from error
    module: ModuleType = grpc
    return module
