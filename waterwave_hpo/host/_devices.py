"""Resolving ``WaterwaveExecutor(devices=...)`` into concrete torch devices."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from waterwave_hpo import _checks

DeviceSpec = str | int | torch.device
"""One device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, an int ``N`` (``cuda:N``) or a torch.device."""


def resolve_devices(devices: DeviceSpec | Sequence[DeviceSpec]) -> list[torch.device]:
    """Turn the ``devices`` argument into a list of distinct, existing devices.

    Args:
        devices: ``"auto"`` (every visible CUDA device, else the CPU), one device spec, or a
            sequence of them. ``"cuda"`` means every visible CUDA device.

    Returns:
        The devices, in the order given, without duplicates. CUDA devices carry an index.

    Raises:
        ValueError: If a spec cannot be parsed, names a CUDA device while CUDA is unavailable,
            names an index past the last visible device, or the sequence is empty.
        TypeError: If a spec is not a str, int or torch.device.
    """
    if isinstance(devices, str) and devices == "auto":
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return [torch.device("cpu")]
    specs: Sequence[DeviceSpec]
    if isinstance(devices, (str, int, torch.device)):
        specs = [devices]
    elif isinstance(devices, Sequence):
        specs = devices
        if len(specs) == 0:
            raise _checks.value_error(
                "devices",
                devices,
                "names no device",
                "pass devices='auto', 'cpu', 'cuda', 'cuda:N' or a non-empty list of them",
            )
    else:
        raise _checks.type_error(
            "devices",
            devices,
            "a device or a list of devices",
            "pass 'auto', 'cpu', 'cuda', 'cuda:N', an int, a torch.device, or a list of them",
        )
    resolved: list[torch.device] = []
    for spec in specs:
        for device in _resolve_one(spec):
            if device not in resolved:
                resolved.append(device)
    return resolved


def _resolve_one(spec: DeviceSpec) -> list[torch.device]:
    if isinstance(spec, bool) or not isinstance(spec, (str, int, torch.device)):
        raise _checks.type_error(
            "devices entry",
            spec,
            "a device",
            "pass 'cpu', 'cuda', 'cuda:N', an int N or a torch.device",
        )
    if isinstance(spec, str) and spec == "auto":
        raise _checks.value_error(
            "devices entry", spec, "cannot be mixed with other devices in a list", "pass it alone"
        )
    if isinstance(spec, int):
        if spec < 0:
            raise _checks.value_error(
                "devices",
                spec,
                "is a negative CUDA device index",
                "pass an index >= 0 (cuda:0 is the first visible GPU), 'auto' or 'cpu'",
            )
        device = torch.device("cuda", spec)
    else:
        try:
            device = torch.device(spec)
        except (RuntimeError, ValueError) as error:
            raise _checks.value_error(
                "devices entry",
                spec,
                f"is not a device ({error})",
                "pass 'cpu', 'cuda', 'cuda:N' or an int N",
            ) from None
    if device.type == "cpu":
        return [torch.device("cpu")]
    if device.type != "cuda":
        raise _checks.value_error(
            "devices entry",
            spec,
            f"is a {device.type!r} device",
            "waterwave-hpo runs trials on 'cpu' and 'cuda' devices only",
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise _checks.value_error(
            "devices",
            spec,
            "asks for CUDA, but torch.cuda.is_available() is False on this machine "
            f"(torch {torch.__version__})",
            "pass devices='cpu' or devices='auto'",
        )
    if device.index is None:
        return [torch.device("cuda", i) for i in range(count)]
    if not 0 <= device.index < count:
        raise _checks.value_error(
            "devices",
            spec,
            f"names CUDA device {device.index}, but {count} CUDA device(s) are visible "
            f"(indices 0..{count - 1})",
            "pass an index in that range, or check CUDA_VISIBLE_DEVICES",
        )
    return [device]
