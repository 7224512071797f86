"""Forward hooks on every module of a model: how a training step is observed per module.

The NodeGroup profiler (:class:`~waterwave_hpo.nodegroup._profile.Profiler`) and the HOME
planner's saved-tensor observer (``planning/_units.py``) both watch one forward module by
module: a pre-hook and a post-hook (with keyword arguments) on each distinct module, removed
together, and a context (saved-tensor hooks, counters) left when observing stops.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn


class ModuleObserver:
    """Pre- and post-forward hooks on every distinct module of ``model``.

    Subclasses implement :meth:`_pre` and :meth:`_post` (``register_forward_pre_hook`` and
    ``register_forward_hook`` with ``with_kwargs=True``) and :meth:`_leave`, which ends whatever
    they entered for the observed forward (it must be safe to call when nothing was entered).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._handles: list[Any] = []

    def install(self) -> None:
        """Register the hooks on every module of the model (a module shared twice, once)."""
        for m in {id(m): m for m in self.model.modules()}.values():
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post, with_kwargs=True))

    def remove(self) -> None:
        """Remove the hooks and leave what the observed forward entered."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._leave()

    def _leave(self) -> None:
        """End what :meth:`_pre` entered for the observed forward (none here)."""

    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        raise NotImplementedError

    def _post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        raise NotImplementedError
