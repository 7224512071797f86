"""Fused optimizers: one optimizer steps K models at once, each with its own hyperparameters.

The idea is HFTA's fused optimizers (Wang et al., "Horizontally Fused Training Array: An Effective
Hardware Utilization Squeezer for Training Novel Deep Learning Models", MLSys 2021,
arXiv:2102.02344; its library's ``hfta.optim``): when K models of one structure are trained as
one, every parameter is stacked to shape ``(K, *shape)`` and every hyperparameter (learning
rate, momentum, weight decay, betas, ...) is held per model, a ``(K,)`` tensor, so the whole
array updates with the few kernels one model's optimizer needs.

Model ``k`` of a :class:`FusedOptimizer` follows the update rule of the stock optimizer it stands
for (``torch.optim.SGD``, ``Adam`` or ``AdamW``), with its own hyperparameters: a step runs
torch's foreach rules (``_update.py``) over the stacked parameters where the models share a
value and over every model's slice of them where they differ, model k's values as Python
numbers at its slices. The results agree with the stock optimizer to float
tolerance, not always bit for bit: where a value differs between the models (the learning rate,
say), ``x + value * y`` is a multiply and an add where the stock code adds with ``alpha=value``
in one kernel, and torch may pick its fused kernels for the stock optimizer on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
import enum
import inspect
import math
import numbers
from typing import Any
from typing import Protocol
import weakref

import torch
from torch import nn

from waterwave_hpo._checks import message
from waterwave_hpo._checks import type_error
from waterwave_hpo._checks import value_error
from waterwave_hpo.fusion import _update as update


class OptimizerKind(enum.Enum):
    """The stock optimizers a :class:`FusedOptimizer` can stand for."""

    SGD = "SGD"
    ADAM = "Adam"
    ADAMW = "AdamW"


class _Kind(enum.Enum):
    """How a hyperparameter is held: a number, a pair of numbers, or a flag."""

    NUMBER = "number"
    PAIR = "pair"
    FLAG = "flag"


@dataclass(frozen=True)
class _Spec:
    """The stock class and the hyperparameters a fused optimizer supports for it."""

    stock: type[torch.optim.Optimizer]
    hparams: Mapping[str, _Kind]


_SPECS: dict[OptimizerKind, _Spec] = {
    OptimizerKind.SGD: _Spec(
        torch.optim.SGD,
        {
            "lr": _Kind.NUMBER,
            "momentum": _Kind.NUMBER,
            "dampening": _Kind.NUMBER,
            "weight_decay": _Kind.NUMBER,
            "nesterov": _Kind.FLAG,
            "maximize": _Kind.FLAG,
        },
    ),
    OptimizerKind.ADAM: _Spec(
        torch.optim.Adam,
        {
            "lr": _Kind.NUMBER,
            "betas": _Kind.PAIR,
            "eps": _Kind.NUMBER,
            "weight_decay": _Kind.NUMBER,
            "amsgrad": _Kind.FLAG,
            "maximize": _Kind.FLAG,
        },
    ),
    OptimizerKind.ADAMW: _Spec(
        torch.optim.AdamW,
        {
            "lr": _Kind.NUMBER,
            "betas": _Kind.PAIR,
            "eps": _Kind.NUMBER,
            "weight_decay": _Kind.NUMBER,
            "amsgrad": _Kind.FLAG,
            "maximize": _Kind.FLAG,
        },
    ),
}

_SUPPORTED = ", ".join(f"torch.optim.{kind.value}" for kind in OptimizerKind)

# Hyperparameters are held in float64 so that Adam's bias corrections (``1 - beta ** step``) are
# computed at the precision of the stock optimizer's Python floats; each step casts them once to
# the parameters' dtype.
_HPARAM_DTYPE = torch.float64


class _PerModel(Protocol):
    """Something that holds one entry per model and follows :meth:`FusedOptimizer.keep_models`."""

    def _keep_models(self, indices: list[int]) -> None: ...


def _kind_of(cls: object) -> OptimizerKind:
    """The :class:`OptimizerKind` of a stock optimizer class, or a clear error."""
    for kind, spec in _SPECS.items():
        if cls is spec.stock:
            return kind
    if not isinstance(cls, type):
        raise type_error("cls", cls, "an optimizer class", f"pass one of {_SUPPORTED}")
    raise value_error(
        "cls",
        cls,
        "is not an optimizer fusion supports (subclasses are not accepted: they may change the "
        "update rule)",
        f"pass one of {_SUPPORTED}",
    )


def _stock_defaults(kind: OptimizerKind) -> dict[str, Any]:
    """The default of every supported hyperparameter, read from the stock class's signature."""
    spec = _SPECS[kind]
    parameters = inspect.signature(spec.stock.__init__).parameters
    return {name: parameters[name].default for name in spec.hparams}


def _is_number(value: object) -> bool:
    """A real number (Python or NumPy scalar), not a bool and not a tensor."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_value(kind: OptimizerKind, k: int, name: str, value: object) -> None:
    """Raise a clear TypeError if ``hparams[k][name]`` is not of its hyperparameter's type."""
    held = _SPECS[kind].hparams[name]
    where = f"hparams[{k}][{name!r}]"
    if held is _Kind.NUMBER and not _is_number(value):
        raise type_error(where, value, "a real number", "pass a Python int or float")
    if held is _Kind.FLAG and not isinstance(value, bool):
        raise type_error(where, value, "a bool", "pass True or False")
    if held is _Kind.PAIR and not (
        isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_number(v) for v in value)
    ):
        raise TypeError(
            message(where, value, "must be a pair of numbers", "pass e.g. (0.9, 0.999)")
        )
    if held is not _Kind.FLAG:
        numbers: Sequence[Any] = value if isinstance(value, (tuple, list)) else (value,)
        if not all(math.isfinite(float(v)) for v in numbers):
            raise value_error(where, value, "must be finite", "pass a finite number")


def _resolve_hparams(kind: OptimizerKind, hparams: object, num_models: int) -> list[dict[str, Any]]:
    """Each model's hyperparameters, stock defaults filled in, checked as the stock class would.

    Raises:
        TypeError: ``hparams`` is not a sequence of dicts, or a value has the wrong type.
        ValueError: its length is not ``num_models``; a name is unknown; a value is one the stock
            optimizer refuses (e.g. a negative learning rate, Nesterov without momentum).
    """
    if isinstance(hparams, (str, bytes, Mapping)) or not isinstance(hparams, Sequence):
        raise type_error(
            "hparams", hparams, "a sequence of dicts", "pass one dict per model, e.g. [{'lr': 0.1}]"
        )
    if len(hparams) != num_models:
        raise value_error(
            "hparams",
            f"<{len(hparams)} dicts>",
            f"has {len(hparams)} entries but there are K={num_models} models",
            f"pass exactly {num_models} dicts, one per model, in the models' order",
        )
    spec = _SPECS[kind]
    defaults = _stock_defaults(kind)
    supported = ", ".join(spec.hparams)
    resolved = []
    for k, given in enumerate(hparams):
        if not isinstance(given, Mapping):
            raise type_error(
                f"hparams[{k}]", given, "a dict", "pass a dict of hyperparameter names to values"
            )
        for name, value in given.items():
            if name not in spec.hparams:
                raise value_error(
                    f"hparams[{k}]",
                    dict(given),
                    f"names {name!r}, which fused {kind.value} does not support",
                    f"use only {supported}",
                )
            _check_value(kind, k, name, value)
        full = {**defaults, **given}
        if spec.hparams.get("betas") is _Kind.PAIR:
            full["betas"] = (float(full["betas"][0]), float(full["betas"][1]))
        try:  # the stock class's own checks, so model k is accepted iff stock would accept it
            spec.stock([torch.zeros(1, requires_grad=True)], **full)
        except ValueError as error:
            raise value_error(
                f"hparams[{k}]",
                dict(given),
                f"torch.optim.{kind.value} refuses it ({error})",
                "pass values the stock optimizer accepts",
            ) from None
        resolved.append(full)
    return resolved


def _named_parameters(
    fused_or_params: object, num_models: int | None
) -> tuple[list[tuple[str, nn.Parameter]], int]:
    """The parameters to optimize, with names for messages, and K.

    Raises:
        TypeError: ``fused_or_params`` is neither a module nor an iterable of tensors.
        ValueError: no parameters; ``num_models`` disagrees with the module; a parameter has no
            leading dim of size K.
    """
    if num_models is not None and (isinstance(num_models, bool) or not isinstance(num_models, int)):
        raise type_error("num_models", num_models, "an int >= 1", "pass K, the number of models")
    if num_models is not None and num_models < 1:
        raise value_error("num_models", num_models, "must be >= 1", "pass K, the number of models")
    if isinstance(fused_or_params, nn.Module):
        named = list(fused_or_params.named_parameters())
        module_k = getattr(fused_or_params, "num_models", None)
        if isinstance(module_k, int) and not isinstance(module_k, bool):
            if num_models is not None and num_models != module_k:
                raise value_error(
                    "num_models",
                    num_models,
                    f"disagrees with the module's num_models={module_k}",
                    "leave num_models out when passing a fused module",
                )
            num_models = module_k
    elif isinstance(fused_or_params, Iterable) and not isinstance(fused_or_params, torch.Tensor):
        items = list(fused_or_params)
        for i, p in enumerate(items):
            if isinstance(p, Mapping):
                raise type_error(
                    "fused_or_params",
                    f"<parameter group {i}>",
                    "a module or an iterable of tensors",
                    "pass the parameters themselves; every hyperparameter is set per model "
                    "through hparams, not per group",
                )
            if not isinstance(p, torch.Tensor):
                raise type_error(
                    f"fused_or_params[{i}]", p, "a tensor", "pass the fused module's parameters"
                )
        named = [(f"parameter {i}", p) for i, p in enumerate(items)]
    else:
        raise type_error(
            "fused_or_params",
            fused_or_params,
            "an nn.Module or an iterable of parameters",
            "pass the fused module, or its parameters() with num_models=K",
        )
    if not named:
        raise value_error(
            "fused_or_params",
            fused_or_params,
            "holds no parameters",
            "pass the fused module (or its parameters) after fusing the models",
        )
    if num_models is None:
        leading = {p.shape[0] if p.dim() > 0 else None for _, p in named}
        if len(leading) != 1 or None in leading:
            raise value_error(
                "num_models",
                None,
                f"cannot be inferred: the parameters' leading dims are {sorted(map(str, leading))}",
                "pass num_models=K, and parameters stacked to shape (K, ...)",
            )
        num_models = next(iter(leading))
    assert num_models is not None
    devices = {p.device for _, p in named}
    if len(devices) != 1:
        raise value_error(
            "fused_or_params",
            sorted(map(str, devices)),
            "has parameters on more than one device",
            "move the fused module to one device before building its optimizer",
        )
    for name, p in named:
        _check_leading_dim(name, p, num_models)
    return named, num_models


def _check_leading_dim(name: str, p: torch.Tensor, num_models: int) -> None:
    if not p.is_floating_point():
        raise value_error(
            name,
            f"<{p.dtype} tensor of shape {tuple(p.shape)}>",
            "is not a real floating-point tensor, which fused optimizers need",
            "optimize only floating-point parameters (complex ones are not supported)",
        )
    if p.dim() == 0 or p.shape[0] != num_models:
        raise value_error(
            name,
            f"<tensor of shape {tuple(p.shape)}>",
            f"has no leading dim of size K={num_models}",
            "pass parameters stacked over the K models to shape (K, *shape), e.g. a fused "
            "module's, and keep them and the optimizer at the same K (keep_models on both)",
        )


def host_to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` (a small host tensor) on ``device``, with no blocking host-to-device copy.

    On the CPU: ``values`` itself. Elsewhere the copy is queued on the current stream from pinned
    memory with ``non_blocking=True``: it is ordered before every kernel queued on that stream
    later (the step's kernels that read the result), and the host goes on at once. A copy from
    pageable memory (``torch.tensor(..., device=cuda)``, ``.to(cuda)``) is synchronous instead:
    the host waits for the stream each time. The pinned source may be
    dropped here: PyTorch's caching host allocator, which ``pin_memory()`` draws from, records an
    event on the copy's stream and reuses the block only once the copy has completed
    (``ATen/cuda/CachingHostAllocator.h``).

    Args:
        values: A host (CPU) tensor.
        device: Where it is needed.

    Returns:
        A tensor on ``device`` holding ``values`` once the copy has run (in stream order).
    """
    if device.type == "cpu":
        return values
    try:
        values = values.pin_memory()
    except RuntimeError:  # no pinned memory for this device type: still not a blocking call
        pass
    return values.to(device, non_blocking=True)


def _stack_hparams(
    kind: OptimizerKind, resolved: list[dict[str, Any]], device: torch.device
) -> dict[str, torch.Tensor]:
    """Each hyperparameter as a tensor over the models: (K,) numbers or flags, (K, 2) betas."""
    stacked: dict[str, torch.Tensor] = {}
    for name, held in _SPECS[kind].hparams.items():
        values = [hp[name] for hp in resolved]
        dtype = torch.bool if held is _Kind.FLAG else _HPARAM_DTYPE
        stacked[name] = torch.tensor(values, dtype=dtype, device=device)
    return stacked


class FusedOptimizer(torch.optim.Optimizer):
    """Steps K fused models at once; model k follows the stock optimizer with its own values.

    Build it with :func:`optimizer`. Every parameter has shape ``(K, *shape)``; each
    hyperparameter is a ``(K,)`` tensor (``betas``: ``(K, 2)``, flags: ``(K,)`` bool) in
    ``param_groups[0]``, on the parameters' device, held in float64. The one parameter group holds
    every parameter. State per parameter: the stock optimizer's buffers (``momentum_buffer``;
    ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` when a model uses AMSGrad), each with the
    parameter's shape, and Adam's ``step`` ``(K,)``. ``state_dict``/``load_state_dict``
    round-trip.

    A step runs torch's foreach update (``_multi_tensor_sgd``, ``_multi_tensor_adam``) over
    the stacked parameters where the models share a value and over every model's slice of
    every parameter where they differ, each model's values given as Python numbers from
    the host copies of the hyperparameters: a fixed number of operations per step (about 4 for
    SGD with momentum, 9 for Adam), whatever the number of parameters and K, and no read of a
    device tensor on the host. Hyperparameters are read from the host copies that
    :meth:`set_hparam` keeps; a group tensor replaced or written in place by hand is read back
    from the device once.

    Idea: HFTA's fused optimizers (Wang et al., MLSys 2021, arXiv:2102.02344).

    Attributes:
        hparam_version: Counts changes of the per-model hyperparameters (:meth:`set_hparam`,
            :meth:`keep_models`, :meth:`load_state_dict`); schedulers read it.
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        kind: OptimizerKind,
        hparams: list[dict[str, Any]],
        num_models: int,
    ) -> None:
        """Use :func:`optimizer`; this constructor trusts its checked arguments."""
        self._kind = kind
        self._num_models = num_models
        self._param_names = {id(p): name for name, p in named_params}
        self._followers: weakref.WeakSet[_PerModel] = weakref.WeakSet()
        device = named_params[0][1].device
        group: dict[str, Any] = {"params": [p for _, p in named_params]}
        group.update(_stack_hparams(kind, hparams, device))
        super().__init__([group], defaults={})
        # Host copies of the (K,) hyperparameters, each with the device tensor it mirrors:
        # what the host needs (which parts of the update run, hparams(k) for a scheduler) is
        # read here, never back from the device (a stream sync on CUDA).
        self._mirror: dict[str, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._set_mirror(_stack_hparams(kind, hparams, torch.device("cpu")))
        # Per parameter: Adam's step counts per model on the host, with the ``step`` tensor
        # they mirror (bias corrections are host numbers, as in the stock foreach code), and
        # which models' momentum buffers hold a value (the stock buffer exists), with the
        # buffer. A state tensor replaced by a load is read once (steps) or taken as started.
        self._host_steps: dict[int, tuple[torch.Tensor, list[float]]] = {}
        self._started: dict[int, tuple[torch.Tensor, list[bool]]] = {}
        # Each model's view of the parameters and state buffers, made once (see ``_Slices``).
        self._slices: dict[int, tuple[torch.Tensor, tuple[Any, ...], tuple[torch.Tensor, ...]]]
        self._slices = {}
        # Counts changes of the hyperparameters; a scheduler that sees another writer's change
        # writes all its values again.
        self.hparam_version = 0

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused after construction: a fused optimizer holds one group with per-model values.

        Args:
            param_group: The group (only the constructor's own group is accepted).

        Raises:
            ValueError: called after the optimizer was built.
        """
        if hasattr(self, "hparam_version"):  # set once the constructor's group is in
            raise value_error(
                "param_group",
                f"<group of {len(list(param_group.get('params', [])))} parameters>",
                "cannot be added to a fused optimizer (it holds one group, values per model)",
                "build one fusion.optimizer over all the fused parameters",
            )
        super().add_param_group(param_group)

    @property
    def kind(self) -> OptimizerKind:
        """Which stock optimizer this one stands for."""
        return self._kind

    @property
    def num_models(self) -> int:
        """K, the number of models (changes with :meth:`keep_models`)."""
        return self._num_models

    def _set_mirror(self, host: Mapping[str, torch.Tensor]) -> None:
        """Record ``host`` (CPU tensors) as the values of the group's hyperparameters now."""
        group = self.param_groups[0]
        for name, values in host.items():
            self._mirror[name] = (group[name], group[name]._version, values)

    def _host_hparams(self) -> dict[str, torch.Tensor]:
        """The group's hyperparameters on the host: the mirror, or a read where it is stale.

        Stale only where the group's tensor was replaced or written in place by hand (not
        through :meth:`set_hparam`); then the value is read back from the device once.
        """
        group = self.param_groups[0]
        host = {}
        for name in _SPECS[self._kind].hparams:
            value: torch.Tensor = group[name]
            entry = self._mirror.get(name)
            if entry is None or entry[0] is not value or entry[1] != value._version:
                entry = (value, value._version, value.detach().to("cpu"))
                self._mirror[name] = entry
            host[name] = entry[2]
        return host

    def hparams(self, k: int) -> dict[str, Any]:
        """Model ``k``'s hyperparameters now, as Python values (what the stock class would take).

        Args:
            k: The model's index, ``0 <= k < num_models``.

        Returns:
            ``{name: value}``; ``betas`` as a tuple.

        Raises:
            IndexError: ``k`` is out of range.
        """
        if not 0 <= k < self._num_models:
            raise IndexError(
                message("k", k, f"is out of range for K={self._num_models}", "pass 0 <= k < K")
            )
        host = self._host_hparams()
        out: dict[str, Any] = {}
        for name, held in _SPECS[self._kind].hparams.items():
            value = host[name][k].tolist()
            out[name] = tuple(value) if held is _Kind.PAIR else value
        return out

    def set_hparam(self, name: str, values: Sequence[float] | torch.Tensor) -> None:
        """Set a numeric hyperparameter of every model at once (what a scheduler does).

        Args:
            name: A numeric hyperparameter of this optimizer (``lr``, ``momentum``, ...,
                ``betas`` with ``values`` of shape ``(K, 2)``).
            values: One value per model, in the models' order.

        Raises:
            ValueError: ``name`` is not a numeric hyperparameter here, or ``values`` has the wrong
                shape.
        """
        held = _SPECS[self._kind].hparams.get(name)
        if held is None or held is _Kind.FLAG:
            numeric = [n for n, h in _SPECS[self._kind].hparams.items() if h is not _Kind.FLAG]
            raise value_error(
                "name", name, f"is not a numeric hyperparameter of fused {self._kind.value}",
                f"pass one of {', '.join(numeric)}",
            )  # fmt: skip
        target: torch.Tensor = self.param_groups[0][name]
        new = torch.as_tensor(values, dtype=_HPARAM_DTYPE)
        if new.shape != target.shape:
            raise value_error(
                "values",
                f"<shape {tuple(new.shape)}>",
                f"must have shape {tuple(target.shape)} (one value per model)",
                f"pass {self._num_models} values",
            )
        # a new tensor, not copy_(): a state_dict() taken earlier must keep the old values;
        # queued, not waited for: schedulers call this every step
        placed = host_to_device(new, target.device)
        self.param_groups[0][name] = placed
        self._mirror[name] = (placed, placed._version, new)
        self.hparam_version += 1

    def _follow(self, follower: _PerModel) -> None:
        """Register something per model (a scheduler) that :meth:`keep_models` must slice too."""
        self._followers.add(follower)

    def keep_models(self, indices: Sequence[int]) -> None:
        """Keep only these models, in this order: their hyperparameters, state and schedules.

        Call it with the same indices as ``fused.keep_models`` (which re-stacks the parameters;
        this slices the optimizer state, the per-model hyperparameters and every per-model
        scheduler built on this optimizer). K becomes ``len(indices)``.

        Args:
            indices: Distinct model indices, each ``0 <= i < num_models``; at least one.

        Raises:
            TypeError: ``indices`` is not a sequence of ints.
            ValueError: it is empty, has an index out of range, or repeats one.
        """
        kept = check_indices(indices, self._num_models)
        index = torch.tensor(kept, dtype=torch.long)
        group = self.param_groups[0]
        host = self._host_hparams()
        for name in _SPECS[self._kind].hparams:
            group[name] = group[name].index_select(0, index.to(group[name].device))
            host[name] = host[name].index_select(0, index)
        for p in group["params"]:
            state = self.state.get(p)
            if not state:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    if value.shape[0] != self._num_models:
                        raise RuntimeError(f"optimizer state {key!r} has shape {value.shape}")
                    state[key] = value.index_select(0, index.to(value.device))
            # The host records follow their tensors (no read back from the device).
            steps = self._host_steps.get(id(p))
            if steps is not None and "step" in state:
                self._host_steps[id(p)] = (state["step"], [steps[1][i] for i in kept])
            started = self._started.get(id(p))
            if started is not None and "momentum_buffer" in state:
                buf = state["momentum_buffer"]
                self._started[id(p)] = (buf, [started[1][i] for i in kept])
        self._set_mirror(host)
        self.hparam_version += 1
        for follower in list(self._followers):
            follower._keep_models(kept)
        self._num_models = len(kept)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state as ``torch.optim.Optimizer.state_dict`` gives it.

        Unlike the stock optimizer's floats, the per-model hyperparameters are tensors; they are
        cloned, so the returned dict keeps the values of now when a scheduler changes them later.
        (The per-parameter state tensors are references, as in ``torch.optim``.)

        Returns:
            ``{"state": ..., "param_groups": [...]}``.
        """
        saved = super().state_dict()
        for group in saved["param_groups"]:
            for name in _SPECS[self._kind].hparams:
                group[name] = group[name].clone()
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict` of a fused optimizer of the same kind.

        Args:
            state_dict: What :meth:`state_dict` returned (its K may differ from this optimizer's
                if the parameters were re-stacked to match it).

        Raises:
            ValueError: the saved optimizer is of another kind, or its K does not match the
                parameters.
        """
        groups = state_dict.get("param_groups", [])
        names = set(_SPECS[self._kind].hparams)
        if len(groups) != 1 or not names <= set(groups[0]):
            raise value_error(
                "state_dict",
                "<state dict>",
                f"was not saved by a fused {self._kind.value} optimizer",
                f"load the state_dict of a fusion.optimizer(torch.optim.{self._kind.value}, ...)",
            )
        saved_k = int(groups[0]["lr"].shape[0])
        super().load_state_dict(state_dict)
        group = self.param_groups[0]
        device = group["params"][0].device
        # Cloned: torch.optim's load keeps the saved tensors themselves where device and dtype
        # match, so an in-memory state_dict would share its buffers with this optimizer.
        for name in names:
            group[name] = group[name].to(device).clone()
        for p in group["params"]:
            _check_leading_dim(self._param_names.get(id(p), "parameter"), p, saved_k)
            state = self.state.get(p, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.clone()
            if "step" in state:
                state["step"] = state["step"].to(device=device, dtype=_HPARAM_DTYPE)
        self._mirror = {}
        self._host_hparams()  # one read of the loaded values
        self._host_steps = {}
        self._started = {}
        self._slices = {}
        self.hparam_version += 1
        self._num_models = saved_k

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every model.

        Args:
            closure: Re-evaluates the models and returns the loss (as in ``torch.optim``).

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: a parameter no longer has leading dim K (re-stacked by
                ``fused.keep_models`` without calling this optimizer's :meth:`keep_models`).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():  # type: ignore[no-untyped-call,unused-ignore]
                loss = closure()
        group = self.param_groups[0]
        # One foreach update per dtype (torch's foreach kernels take one dtype per list).
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            _check_leading_dim(self._param_names.get(id(p), "parameter"), p, self._num_models)
            if p.grad.is_sparse:
                raise value_error(
                    self._param_names.get(id(p), "parameter"),
                    "<sparse gradient>",
                    "has a sparse gradient, which fused optimizers do not support",
                    "use dense gradients (e.g. nn.Embedding(sparse=False))",
                )
            by_dtype.setdefault(p.dtype, []).append(p)
        if not by_dtype:
            return loss
        host = {name: value.tolist() for name, value in self._host_hparams().items()}
        slices = _Slices(self._slices)
        for params in by_dtype.values():
            if self._kind is OptimizerKind.SGD:
                self._sgd(params, host, slices)
            else:
                self._adam(params, host, slices, decoupled=self._kind is OptimizerKind.ADAMW)
        self._slices = slices.used
        return loss

    def _sgd(self, params: list[torch.Tensor], host: dict[str, Any], slices: _Slices) -> None:
        """``torch.optim.SGD``'s step of every model (see ``_update.sgd``)."""
        k = self._num_models
        values = update.SGDValues(
            lr=host["lr"],
            momentum=host["momentum"],
            dampening=host["dampening"],
            weight_decay=host["weight_decay"],
            nesterov=host["nesterov"],
            maximize=host["maximize"],
        )
        buffers: list[torch.Tensor] | None = None
        started: list[bool] = []
        if any(m != 0 for m in values.momentum):
            buffers = []
            for p in params:
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["momentum_buffer"] = buf
                    self._started[id(p)] = (buf, [False] * k)
                entry = self._started.get(id(p))
                if entry is None or entry[0] is not buf:  # loaded: the stock buffer exists
                    entry = self._started[id(p)] = (buf, [True] * k)
                buffers.append(buf)
                started += entry[1]
        update.sgd(
            update.Operand(k, params, slicer=slices),
            update.Operand(k, [_grad(p) for p in params]),
            None if buffers is None else update.Operand(k, buffers, slicer=slices),
            started,
            values,
        )
        if buffers is not None:
            for i, p in enumerate(params):
                self._started[id(p)][1][:] = started[i * k : (i + 1) * k]

    def _adam(
        self,
        params: list[torch.Tensor],
        host: dict[str, Any],
        slices: _Slices,
        *,
        decoupled: bool,
    ) -> None:
        """``torch.optim.Adam``'s step of every model, AdamW's if ``decoupled``."""
        k = self._num_models
        values = update.AdamValues(
            lr=host["lr"],
            beta1=[b[0] for b in host["betas"]],
            beta2=[b[1] for b in host["betas"]],
            eps=host["eps"],
            weight_decay=host["weight_decay"],
            amsgrad=host["amsgrad"],
            maximize=host["maximize"],
        )
        amsgrad = any(values.amsgrad)
        step_tensors, steps = [], []
        exp_avgs: list[torch.Tensor] = []
        exp_avg_sqs: list[torch.Tensor] = []
        maxima: list[torch.Tensor] = []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros_like(self.param_groups[0]["lr"])
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                self._host_steps[id(p)] = (state["step"], [0.0] * k)
            if amsgrad and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            entry = self._host_steps.get(id(p))
            if entry is None or entry[0] is not state["step"]:  # loaded: read once
                entry = self._host_steps[id(p)] = (state["step"], state["step"].tolist())
            counts = entry[1]
            counts[:] = [c + 1 for c in counts]
            steps += counts
            step_tensors.append(state["step"])
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if amsgrad:
                maxima.append(state["max_exp_avg_sq"])
        torch._foreach_add_(step_tensors, 1.0)
        update.adam(
            update.Operand(k, params, slicer=slices),
            update.Operand(k, [_grad(p) for p in params]),
            update.Operand(k, exp_avgs, slicer=slices),
            update.Operand(k, exp_avg_sqs, slicer=slices),
            update.Operand(k, maxima, slicer=slices) if amsgrad else None,
            steps,
            values,
            decoupled=decoupled,
        )


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, which the step checked is there."""
    assert p.grad is not None
    return p.grad


class _Slices:
    """Each model's view ``t[k]`` of a stacked tensor that lives across steps, made once.

    A step's foreach operations take every model's slice of every parameter and state buffer
    where the models' values differ;
    these views stay valid while the tensor keeps its storage (updates are in place), so they
    are made again only when the tensor was replaced (``keep_models``, ``swap_tensors``, a
    ``.data`` assignment, a load): the held views keep the old storage alive, so a new one
    cannot reuse its address. ``used`` holds this step's entries (the cache of the next), so
    the views of a replaced tensor are dropped at the next step.
    """

    def __init__(
        self, previous: dict[int, tuple[torch.Tensor, tuple[Any, ...], tuple[torch.Tensor, ...]]]
    ) -> None:
        self._previous = previous
        self.used: dict[int, tuple[torch.Tensor, tuple[Any, ...], tuple[torch.Tensor, ...]]] = {}

    def __call__(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``t.unbind(0)``, from the cache where ``t`` still has the same storage and shape."""
        key = (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
        entry = self._previous.get(id(t))
        if entry is None or entry[0] is not t or entry[1] != key:
            # Views of a detached alias (same storage, its own TensorImpl): holding them
            # does not count as a use of the parameter itself, which ``swap_tensors`` (the
            # fused module's ``keep_models``) refuses while anything else holds it.
            entry = (t, key, t.detach().unbind(0))
        self.used[id(t)] = entry
        return entry[2]


def check_indices(indices: object, num_models: int) -> list[int]:
    """``indices`` as a list of distinct model indices in ``range(num_models)``, or a clear error.

    Args:
        indices: The models to keep, in their new order.
        num_models: K, the number of models now.

    Returns:
        The indices as a list.

    Raises:
        TypeError: ``indices`` is not a sequence of ints.
        ValueError: it is empty, has an index out of range, or repeats one.
    """
    fix = f"pass distinct model indices in 0..{num_models - 1}, at least one"
    if isinstance(indices, (str, bytes)) or not isinstance(indices, Sequence):
        raise type_error("indices", indices, "a sequence of ints", fix)
    if any(isinstance(i, bool) or not isinstance(i, int) for i in indices):
        raise type_error("indices", indices, "a sequence of ints", fix)
    kept = list(indices)
    if not kept:
        raise value_error("indices", kept, "is empty (K would be 0)", fix)
    if any(not 0 <= i < num_models for i in kept):
        raise value_error("indices", kept, f"has an index out of range for K={num_models}", fix)
    if len(set(kept)) != len(kept):
        raise value_error("indices", kept, "repeats an index", fix)
    return kept


def optimizer(
    cls: type[torch.optim.Optimizer],
    fused_or_params: nn.Module | Iterable[torch.Tensor],
    hparams: Sequence[Mapping[str, Any]],
    *,
    num_models: int | None = None,
) -> FusedOptimizer:
    """A fused optimizer for K models: model k is updated as ``cls`` with ``hparams[k]`` would.

    Every parameter must be stacked over the models, shape ``(K, *shape)`` (a fused module's
    are). Each hyperparameter is held per model as a ``(K,)`` tensor (HFTA's fused optimizers,
    arXiv:2102.02344); a step is a fixed few foreach operations over the stacked parameters (or,
    where the models' values differ, their slices), whatever the number of parameters and K
    (:class:`FusedOptimizer`).

    Supported: ``torch.optim.SGD`` (``lr``, ``momentum``, ``dampening``, ``weight_decay``,
    ``nesterov``, ``maximize``), ``torch.optim.Adam`` and ``torch.optim.AdamW`` (``lr``,
    ``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``). A name left out takes the
    stock class's default. Per-model schedules: :class:`PerModelScheduler`, :class:`LambdaLR`.
    All K models use one optimizer class: trials that chose different classes belong in different
    fused groups (one optimizer each).

    Args:
        cls: ``torch.optim.SGD``, ``torch.optim.Adam`` or ``torch.optim.AdamW``.
        fused_or_params: A module all of whose parameters have leading dim K (a fused module),
            or such parameters (then K is ``num_models``, or inferred from the leading dims).
        hparams: One dict per model, ``len(hparams) == K``, in the models' order.
        num_models: K; needed only if it cannot be read from the module or the parameters.

    Returns:
        The optimizer.

    Raises:
        TypeError: an argument or a hyperparameter value has the wrong type.
        ValueError: ``cls`` is not supported; ``len(hparams) != K``; an unknown hyperparameter
            or one the stock class refuses; a parameter without leading dim K.

    >>> import torch
    >>> from waterwave_hpo import fusion
    >>> weight = torch.nn.Parameter(torch.zeros(2, 3))  # K=2 models of 3 weights
    >>> opt = fusion.optimizer(torch.optim.SGD, [weight], [{"lr": 0.1}, {"lr": 1.0}])
    >>> weight.grad = torch.ones(2, 3)
    >>> opt.step()
    >>> weight.data[:, 0].tolist()
    [-0.10000000149011612, -1.0]
    """
    kind = _kind_of(cls)
    named, k = _named_parameters(fused_or_params, num_models)
    resolved = _resolve_hparams(kind, hparams, k)
    return FusedOptimizer(named, kind, resolved, k)
