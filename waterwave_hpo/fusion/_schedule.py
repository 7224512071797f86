"""Per-model learning-rate schedules for a fused optimizer: each model runs a stock torch scheduler.

Design: for model k, :class:`PerModelScheduler` builds a *proxy*, a stock optimizer of the fused
optimizer's class (``torch.optim.SGD``, ``Adam`` or ``AdamW``) with model k's hyperparameters
and one dummy parameter, and runs an ordinary ``torch.optim.lr_scheduler`` scheduler on it. After
each step it copies the proxy's numeric hyperparameters (``lr``, and ``momentum`` or ``betas``,
which e.g. ``OneCycleLR`` cycles) into the fused optimizer's ``(K,)`` tensors. So every stock
scheduler works per model, unchanged, and model k's schedule equals what that scheduler would
give model k trained alone, value for value. HFTA (Wang et al., MLSys 2021, arXiv:2102.02344)
also schedules each model of its fused array (its library's ``hfta.optim.lr_scheduler``).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
import functools
from typing import Any
from typing import TypeAlias

import torch
from torch.optim.lr_scheduler import LRScheduler

from waterwave_hpo._checks import type_error
from waterwave_hpo._checks import value_error
from waterwave_hpo.fusion._optim import _SPECS
from waterwave_hpo.fusion._optim import FusedOptimizer
from waterwave_hpo.fusion._optim import _Kind
from waterwave_hpo.fusion._optim import check_indices

SchedulerFactory: TypeAlias = Callable[[torch.optim.Optimizer], LRScheduler]
"""Builds a stock scheduler on the optimizer it is given, e.g. ``lambda o: StepLR(o, 10)``."""


class PerModelScheduler:
    """One stock ``torch.optim.lr_scheduler`` scheduler per model of a :class:`FusedOptimizer`.

    Call :meth:`step` where you would call the stock scheduler's ``step`` (after
    ``optimizer.step()``). ``optimizer.keep_models`` also drops the schedulers of the models it
    drops.

    Example: ``fusion.PerModelScheduler(opt, lambda o: torch.optim.lr_scheduler.StepLR(o, 10))``
    gives every model a step decay; a list of K factories gives each model its own scheduler.
    Use one per optimizer: each keeps its own proxies, so two would not compose as two stock
    schedulers on one optimizer do; compose inside the factory instead (``SequentialLR``,
    ``ChainedScheduler`` on the optimizer the factory is given).
    """

    def __init__(
        self,
        optimizer: FusedOptimizer,
        schedulers: SchedulerFactory | Sequence[SchedulerFactory],
    ) -> None:
        """Build model k's scheduler by calling its factory on model k's proxy optimizer.

        Args:
            optimizer: The fused optimizer whose per-model hyperparameters the schedules drive.
            schedulers: One factory for every model, or a sequence of K factories (model k's
                first). A factory takes an optimizer and returns a stock scheduler on it.

        Raises:
            TypeError: ``optimizer`` is not a :class:`FusedOptimizer`, a factory is not
                callable, or returns no scheduler of the optimizer it was given.
            ValueError: ``len(schedulers) != K``.
        """
        if not isinstance(optimizer, FusedOptimizer):
            raise type_error(
                "optimizer", optimizer, "a FusedOptimizer", "pass what fusion.optimizer() returned"
            )
        num_models = optimizer.num_models
        if callable(schedulers):
            factories: list[Any] = [schedulers] * num_models
        elif isinstance(schedulers, Sequence) and not isinstance(schedulers, (str, bytes)):
            factories = list(schedulers)
            if len(factories) != num_models:
                raise value_error(
                    "schedulers",
                    f"<{len(factories)} factories>",
                    f"has {len(factories)} entries but there are K={num_models} models",
                    f"pass one factory for all models, or exactly {num_models}, one per model",
                )
        else:
            raise type_error(
                "schedulers",
                schedulers,
                "a callable or a sequence of callables",
                "pass e.g. lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=10)",
            )
        self._optimizer = optimizer
        self._numeric = [
            n for n, h in _SPECS[optimizer.kind].hparams.items() if h is not _Kind.FLAG
        ]
        self._copied: dict[str, list[Any]] = {}
        self._seen_version = -1
        self._proxies: list[torch.optim.Optimizer] = []
        self._schedulers: list[LRScheduler] = []
        stock = _SPECS[optimizer.kind].stock
        for k, factory in enumerate(factories):
            if not callable(factory):
                raise type_error(
                    f"schedulers[{k}]",
                    factory,
                    "a callable",
                    "pass a function of an optimizer that returns a scheduler on it",
                )
            proxy = stock([torch.zeros(1, requires_grad=True)], **optimizer.hparams(k))
            scheduler = factory(proxy)
            if not isinstance(scheduler, LRScheduler) or scheduler.optimizer is not proxy:
                raise type_error(
                    f"schedulers[{k}]",
                    factory,
                    "a factory that returns a torch.optim.lr_scheduler scheduler of the "
                    "optimizer it is given",
                    "pass e.g. lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=10)",
                )
            self._proxies.append(proxy)
            self._schedulers.append(scheduler)
        optimizer._follow(self)
        self._copy_to_optimizer()  # schedulers set the initial values when built

    @property
    def schedulers(self) -> list[LRScheduler]:
        """The stock scheduler of each model, in the models' order (read them, do not step them)."""
        return list(self._schedulers)

    def step(self, metrics: Sequence[float] | None = None) -> None:
        """Advance every model's schedule by one step and write the values to the optimizer.

        Args:
            metrics: For ``ReduceLROnPlateau`` only: one metric per model, in the models' order.

        Raises:
            ValueError: ``metrics`` is given and ``len(metrics) != K``, or is missing for
                ``ReduceLROnPlateau``.
        """
        num_models = len(self._schedulers)
        if metrics is not None and len(metrics) != num_models:
            raise value_error(
                "metrics",
                list(metrics),
                f"has {len(metrics)} entries but there are K={num_models} models",
                f"pass {num_models} metrics, one per model",
            )
        for k, (proxy, scheduler) in enumerate(zip(self._proxies, self._schedulers, strict=True)):
            proxy.step()  # no gradients, so no update; tells the scheduler the optimizer stepped
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                if metrics is None:
                    raise value_error(
                        "metrics", None, "is required by ReduceLROnPlateau", "pass one per model"
                    )
                scheduler.step(metrics[k])
            else:
                scheduler.step()
        self._copy_to_optimizer()

    def get_last_lr(self) -> list[float]:
        """Each model's learning rate after the last step, in the models' order."""
        return [float(proxy.param_groups[0]["lr"]) for proxy in self._proxies]

    def state_dict(self) -> dict[str, Any]:
        """Every model's scheduler state and proxy hyperparameters (lambdas are not saved)."""
        return {
            "schedulers": [s.state_dict() for s in self._schedulers],
            "proxies": [p.state_dict() for p in self._proxies],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned, for as many models as there are now.

        Args:
            state_dict: A saved state with one entry per model.

        Raises:
            ValueError: it holds another number of models.
        """
        saved = len(state_dict.get("schedulers", []))
        if saved != len(self._schedulers) or len(state_dict.get("proxies", [])) != saved:
            raise value_error(
                "state_dict",
                f"<{saved} models>",
                f"holds {saved} models' schedules but there are K={len(self._schedulers)}",
                "load the state of a scheduler of as many models",
            )
        for proxy, scheduler, proxy_state, scheduler_state in zip(
            self._proxies,
            self._schedulers,
            state_dict["proxies"],
            state_dict["schedulers"],
            strict=True,
        ):
            proxy.load_state_dict(proxy_state)
            scheduler.load_state_dict(scheduler_state)
        self._copied = {}
        self._copy_to_optimizer()  # the loaded schedules' values win over the optimizer's

    def _keep_models(self, indices: list[int]) -> None:
        """Keep the schedules of these models, in this order (called by ``keep_models``)."""
        kept = check_indices(indices, len(self._schedulers))
        self._proxies = [self._proxies[i] for i in kept]
        self._schedulers = [self._schedulers[i] for i in kept]
        self._copied = {}  # the optimizer's values were sliced the same way; rewriting is cheap

    def _copy_to_optimizer(self) -> None:
        """Write the proxies' values into the optimizer's (K,) tensors, those that changed only.

        ``_copied`` is what this scheduler last wrote; if anything else changed the optimizer's
        hyperparameters since (``hparam_version``), every value is written again.
        """
        if self._optimizer.hparam_version != self._seen_version:
            self._copied = {}
        for name in self._numeric:
            values: list[Any] = [proxy.param_groups[0][name] for proxy in self._proxies]
            if name == "betas":
                values = [[float(b) for b in pair] for pair in values]
            else:
                values = [float(v) for v in values]
            if self._copied.get(name) != values:
                self._optimizer.set_hparam(name, values)
                self._copied[name] = values
        self._seen_version = self._optimizer.hparam_version


class LambdaLR(PerModelScheduler):
    """Model k's learning rate is its initial one times ``lr_lambdas[k](epoch)``.

    The per-model form of ``torch.optim.lr_scheduler.LambdaLR``; :meth:`step` once per epoch
    (or step, as you count).
    """

    def __init__(
        self, optimizer: FusedOptimizer, lr_lambdas: Sequence[Callable[[int], float]]
    ) -> None:
        """Give each model its own multiplicative factor of the epoch.

        Args:
            optimizer: The fused optimizer.
            lr_lambdas: K functions of the epoch count (an int), model k's first.

        Raises:
            TypeError: ``lr_lambdas`` is not a sequence of callables.
            ValueError: ``len(lr_lambdas) != K``.
        """
        if isinstance(lr_lambdas, (str, bytes)) or not isinstance(lr_lambdas, Sequence):
            raise type_error(
                "lr_lambdas", lr_lambdas, "a sequence of callables", "pass one function per model"
            )
        for k, fn in enumerate(lr_lambdas):
            if not callable(fn):
                raise type_error(
                    f"lr_lambdas[{k}]", fn, "a callable", "pass a function of the epoch count"
                )
        if isinstance(optimizer, FusedOptimizer) and len(lr_lambdas) != optimizer.num_models:
            raise value_error(
                "lr_lambdas",
                f"<{len(lr_lambdas)} functions>",
                f"has {len(lr_lambdas)} entries but there are K={optimizer.num_models} models",
                f"pass exactly {optimizer.num_models} functions, one per model",
            )
        super().__init__(
            optimizer,
            [
                functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=fn)
                for fn in lr_lambdas
            ],
        )
