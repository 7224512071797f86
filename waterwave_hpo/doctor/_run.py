"""Run every check in the right order and gather versions (``waterwave-hpo doctor``)."""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import platform
import sys

import torch

from waterwave_hpo.doctor import _checks as checks
from waterwave_hpo.doctor import _features as features
from waterwave_hpo.doctor._report import DoctorReport
from waterwave_hpo.doctor._shim_check import check_torch_shim


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    """The CUDA driver's version (``cuDriverGetVersion``, no context created), or ``None``."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    if driver.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def versions() -> dict[str, str | None]:
    """Versions of Python, torch (and its CUDA), the driver, CuPy, Optuna, Ray, waterwave-hpo."""
    from waterwave_hpo._version import __version__

    cupy = next(
        (v for p in ("cupy-cuda13x", "cupy-cuda12x", "cupy") if (v := _version(p)) is not None),
        None,
    )
    return {
        "python": platform.python_version(),
        "waterwave_hpo": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_driver": _driver_version(),
        "cupy": cupy,
        "optuna": _version("optuna"),
        "ray": _version("ray"),
    }


def _gpu(device: str) -> torch.device | None:
    """The CUDA device to check, or ``None`` (no GPU, or ``device="cpu"``).

    Raises:
        ValueError: ``device`` is not ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` of a device here.
    """
    if device == "cpu":
        return None
    if device == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else None
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type != "cuda":
        raise ValueError(f"--device {device!r} is not a device; pass auto, cpu, cuda or cuda:N.")
    index = dev.index or 0
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        raise ValueError(
            f"--device {device!r}: no such CUDA device here ({torch.cuda.device_count()} "
            "visible); use --device auto or cpu."
        )
    return torch.device("cuda", index)


def run_doctor(device: str = "auto") -> DoctorReport:
    """Run every check and return the report.

    On CUDA the pool is installed first (before anything initialises CUDA, the first check),
    so call this at the start of a fresh process. Without a GPU the same checks run on the
    simulated device and the CPU.

    Args:
        device: ``auto`` (the first GPU, else the simulated device), ``cpu`` (the simulated
            device even where a GPU exists), ``cuda`` or ``cuda:N``.

    Returns:
        The report; its ``exit_code`` is 1 if any check failed.

    Raises:
        ValueError: ``device`` names no device here.
    """
    gpu = _gpu(device)
    report = DoctorReport(
        gpu_found=gpu is not None,
        device=str(gpu) if gpu is not None else "sim",
        versions=versions(),
        machine={
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "executable": sys.executable,
            "gpu": None,  # filled after the checks: asking for it initialises CUDA
        },
    )
    plan = [("pool_library", checks.check_pool_library), ("torch_shim", check_torch_shim)]
    if gpu is not None:
        plan += [
            ("install_order", lambda: checks.check_install_order_cuda(gpu)),
            ("alloc_latency", lambda: checks.check_alloc_latency_cuda(gpu)),
            ("canary", lambda: checks.check_canary_cuda(gpu)),
            ("oom", lambda: checks.check_oom_cuda(gpu)),
            ("cudnn_conv", lambda: checks.check_cudnn(gpu)),
            ("cohosted_study", lambda: checks.check_cohosted(gpu)),
        ]
    else:
        plan += [
            ("install_order", checks.check_install_order_sim),
            ("alloc_latency", checks.check_alloc_latency_sim),
            ("canary", checks.check_canary_sim),
            ("oom", checks.check_oom_sim),
            ("cudnn_conv", checks.check_cudnn_sim),
            ("cohosted_study", lambda: checks.check_cohosted(torch.device("cpu"))),
        ]
    plan.append(("cupy_stream", lambda: checks.check_cupy(gpu)))
    # Every feature as the executor runs it: on the GPU, else the CPU/sim.
    feature_device = gpu if gpu is not None else torch.device("cpu")
    for name, feature in features.FEATURE_CHECKS:
        plan.append((name, lambda feature=feature: feature(feature_device)))  # type: ignore[misc]
    for name, check in plan:
        report.checks.append(checks.guarded(name, check))
    if gpu is not None:
        report.machine["gpu"] = torch.cuda.get_device_name(gpu)
    return report
