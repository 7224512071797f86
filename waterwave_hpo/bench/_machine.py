"""The device a bench runs on, and the machine and versions its results name."""

from __future__ import annotations

import os
import platform
from typing import Any

import optuna
import torch

from waterwave_hpo._version import __version__


def resolve_device(device: str) -> torch.device:
    """``auto`` -> ``cuda:0`` if CUDA is available, else ``cpu``; ``cuda`` -> ``cuda:0``.

    Raises:
        ValueError: If the device is not ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` of an
            existing GPU.
    """
    if device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"device={device!r} is not a device; pass auto, cpu, cuda or cuda:N."
        ) from None
    if dev.type == "cuda":
        index = dev.index or 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ValueError(
                f"device={device!r} does not exist here ({torch.cuda.device_count()} CUDA "
                "devices); pass --device cpu or an existing cuda:N."
            )
        return torch.device(f"cuda:{index}")
    if dev.type != "cpu":
        raise ValueError(f"device={device!r} is not a device; pass auto, cpu, cuda or cuda:N.")
    return dev


def device_name(device: torch.device) -> str:
    """A short name for folders: ``cpu`` or the GPU's name (``nvidia-h100-80gb-hbm3``)."""
    if device.type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(device).lower().replace(" ", "-")


def versions() -> dict[str, str]:
    """The versions of what the bench's figures depend on (Python, torch, CUDA, Optuna, ...)."""
    import matplotlib
    import pandas as pd

    return {
        "waterwave_hpo": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "optuna": optuna.__version__,
        "pandas": pd.__version__,
        "matplotlib": matplotlib.__version__,
    }


def machine(device: torch.device) -> dict[str, Any]:
    """The machine the bench ran on: device, platform, cores, load average, torch threads, GPU."""
    info: dict[str, Any] = {
        "device": str(device),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15_min": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch_intra_op_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_total_memory_bytes=int(props.total_memory))
    return info
