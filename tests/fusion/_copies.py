"""Which host-to-device copies fused code makes, seen on the CPU.

The ``meta`` device stands in for the GPU: a tensor made or moved there from the host is what
would be a host-to-device copy on CUDA. :class:`HostToDeviceCopies` records each such copy:

* through the dispatcher (``aten._to_copy``/``aten.copy_`` from a CPU tensor to another device,
  e.g. ``tensor.to(device, non_blocking=...)``), with its ``non_blocking`` flag and whether
  its source was pinned (``Tensor.pin_memory`` is replaced by a recorder: a CPU build of torch
  cannot pin);
* through factories given a device (``torch.tensor``/``torch.as_tensor(..., device=...)``),
  whose copy never reaches a dispatch mode and is always blocking.

A blocking copy is one made with ``non_blocking=False`` or from unpinned memory: on CUDA the host
waits for the stream each time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class Copy:
    """One host-to-device copy."""

    how: str  # "to" (through the dispatcher) or the factory's name
    non_blocking: bool
    pinned_source: bool

    @property
    def blocking(self) -> bool:
        return not (self.non_blocking and self.pinned_source)


class HostToDeviceCopies(TorchDispatchMode):
    """Records host-to-device copies while active; see the module docstring."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.copies: list[Copy] = []
        self._pinned: set[int] = set()
        pinned = self._pinned

        def pin_memory(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = tensor.clone()
            pinned.add(out.untyped_storage().data_ptr())
            return out

        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        for name in ("tensor", "as_tensor"):
            factory = getattr(torch, name)

            def recorded(
                *args: Any, _factory: Any = factory, _name: str = name, **kwargs: Any
            ) -> Any:
                device = kwargs.get("device")
                if device is not None and torch.device(device).type != "cpu":
                    self.copies.append(Copy(f"torch.{_name}", False, False))
                return _factory(*args, **kwargs)

            monkeypatch.setattr(torch, name, recorded)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            source, target = args[0], kwargs.get("device")
            self._note(source, target, bool(kwargs.get("non_blocking", False)))
        elif func is torch.ops.aten.copy_.default:
            target, source = args[0], args[1]
            self._note(source, target.device, bool(args[2] if len(args) > 2 else False))
        return func(*args, **kwargs)

    def _note(self, source: Any, target: Any, non_blocking: bool) -> None:
        if not isinstance(source, torch.Tensor) or source.device.type != "cpu":
            return
        if target is None or torch.device(target).type == "cpu":
            return
        pinned = source.untyped_storage().data_ptr() in self._pinned
        self.copies.append(Copy("to", non_blocking, pinned))

    @property
    def blocking(self) -> list[Copy]:
        """The copies on which the host would wait for the stream."""
        return [c for c in self.copies if c.blocking]
