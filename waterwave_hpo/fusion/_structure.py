"""Which models can be fused: the structure key and the layers fusion supports.

Two models fuse (HFTA, Wang et al., MLSys 2021: a training array of models that run the
same operators on the same shapes) when they have the same module tree, the same module
configuration and the same parameters and buffers (names, shapes, dtypes). The key states all
of it; the one number that may differ is the rate of an ``nn.Dropout``, which fusion keeps per
model.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
import dataclasses
from dataclasses import dataclass
import enum
import functools
import hashlib
import types

import torch
from torch import nn

from waterwave_hpo._checks import type_error

SUPPORTED_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Sequential,
    nn.Identity,
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.LayerNorm,
    nn.Embedding,
    nn.Dropout,
    nn.Flatten,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
)
"""The ``torch.nn`` layers fusion runs with its own fused kernels or HFTA's direct forms.

Not a gate: every other layer (activations, pooling, upsampling, attention,
``Conv3d``, normalizations, the user's and other libraries' modules) runs under
``torch.func.vmap``; :func:`~waterwave_hpo.fusion.verify` (or ``fuse(..., example_inputs=...)``)
proves a model runs fused and matches the K models before training. Only layers known not to
batch are refused up front (:func:`unsupported_layer`).
"""

_NO_BATCH_RULE: tuple[type[nn.Module], ...] = (nn.RNNBase, nn.RNNCellBase)
"""Layers whose operator (``aten::lstm``, ``gru``, ``rnn_tanh``, ``lstm_cell``...) has no vmap
batching rule in torch: refused by :func:`fuse` with the path, before any input is seen."""


class TensorKind(enum.Enum):
    """Whether a tensor of a model is a parameter or a buffer."""

    PARAMETER = "parameter"
    BUFFER = "buffer"


@dataclass(frozen=True)
class ModuleEntry:
    """One module of a model, as the structure key sees it.

    Attributes:
        path: Its name in ``model.named_modules()`` (``""`` for the model itself).
        type_name: Its class, ``type(module).__qualname__``.
        config: Its configuration: every attribute its forward may read (e.g. ``Conv2d``
            stride, ``BatchNorm`` eps and momentum, a config dict, an activation function),
            private ones included, as ``(name, description)`` pairs described by value
            (recursively for plain data, by qualified name and closure for functions), except
            ``nn.Module``'s own bookkeeping and the ``p`` of an ``nn.Dropout``.
    """

    path: str
    type_name: str
    config: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        """``path: Type(name=value, ...)``."""
        return f"{self.path or '<model>'}: {self.layer()}"

    def layer(self) -> str:
        """``Type(name=value, ...)``, without the path."""
        args = ", ".join(f"{name}={value}" for name, value in self.config)
        return f"{self.type_name}({args})"


@dataclass(frozen=True)
class TensorEntry:
    """One parameter or buffer of a model, as the structure key sees it.

    Attributes:
        kind: Parameter or buffer.
        name: Its name in ``named_parameters()`` / ``named_buffers()``.
        shape: Its shape.
        dtype: Its dtype, e.g. ``"torch.float32"``.
        requires_grad: Whether it is trained (always False for buffers).
    """

    kind: TensorKind
    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool

    def __str__(self) -> str:
        """``name: kind shape dtype``."""
        frozen = "" if self.requires_grad or self.kind is TensorKind.BUFFER else " (frozen)"
        return f"{self.name}: {self.kind.value} {self.shape} {self.dtype}{frozen}"


@dataclass(frozen=True)
class StructureKey:
    """What must be equal for models to fuse; hashable, readable with ``str()``.

    Equal iff the module types, the module configuration (every attribute a forward may read,
    by value: ``Conv2d`` stride and padding, ``BatchNorm`` eps and momentum, ``LeakyReLU``
    slope, and a model's own config dicts, strings, numbers, functions, tensors that are not
    buffers), and the parameter and buffer names, shapes, dtypes and ``requires_grad`` match.
    The rate ``p`` of an ``nn.Dropout`` does not enter the key: fused models keep their own rate.
    The device does not enter the key (:func:`~waterwave_hpo.fusion.fuse` checks it).

    Attributes:
        modules: Every module, in ``named_modules()`` order.
        tensors: Every parameter, then every buffer, in ``named_parameters()`` /
            ``named_buffers()`` order.
    """

    modules: tuple[ModuleEntry, ...]
    tensors: tuple[TensorEntry, ...]

    def __str__(self) -> str:
        """One line per module, then one per tensor."""
        return "\n".join([*map(str, self.modules), *map(str, self.tensors)])

    def difference(self, other: StructureKey) -> str | None:
        """The first difference from ``other`` in words, or None if the keys are equal.

        Args:
            other: The key to compare with.

        Returns:
            E.g. ``"'0.weight': parameter (128, 64) torch.float32 vs parameter (64, 64)
            torch.float32"``, or None.
        """
        for mine, theirs in zip(self.modules, other.modules, strict=False):
            if mine != theirs:
                if mine.path != theirs.path:
                    return f"module '{mine.path}' vs module '{theirs.path}'"
                return f"module '{mine.path or '<model>'}': {mine.layer()} vs {theirs.layer()}"
        if len(self.modules) != len(other.modules):
            return _extra("module", self.modules, other.modules)
        for t_mine, t_theirs in zip(self.tensors, other.tensors, strict=False):
            if t_mine != t_theirs:
                if t_mine.name != t_theirs.name:
                    return f"{t_mine.kind.value} '{t_mine.name}' vs '{t_theirs.name}'"
                return (
                    f"'{t_mine.name}': {t_mine.kind.value} {t_mine.shape} {t_mine.dtype} "
                    f"requires_grad={t_mine.requires_grad} vs {t_theirs.kind.value} "
                    f"{t_theirs.shape} {t_theirs.dtype} requires_grad={t_theirs.requires_grad}"
                )
        if len(self.tensors) != len(other.tensors):
            return _extra("tensor", self.tensors, other.tensors)
        return None


def _extra(
    what: str,
    mine: Sequence[ModuleEntry | TensorEntry],
    theirs: Sequence[ModuleEntry | TensorEntry],
) -> str:
    """Name the first entry one side has and the other lacks."""
    if len(mine) > len(theirs):
        return f"{what} {mine[len(theirs)]} is missing in the other model"
    return f"the other model has an extra {what} {theirs[len(mine)]}"


_MODULE_INTERNALS = frozenset(vars(nn.Module()))
"""``nn.Module``'s own bookkeeping: parameters, buffers and submodules enter the key on their
own; ``training`` is the fused module's; hooks are the fused copy's (model 0's: observers such
as a profiler on one trial do not keep it from fusing). Every other attribute, private ones
included, is a value the forward may read."""

_DEPTH = 6
"""How deep :func:`_describe` opens nested containers and objects before it falls back to
identity (a value nested deeper than this is described by its ``id``: equal only if shared)."""

_MAX_ITEMS = 256
"""How many items of one container are described by value; a longer one is fingerprinted."""


def _qualified(obj: object) -> str:
    """``module.qualname`` of a function or class."""
    module = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if name is None:
        name = type(obj).__qualname__
    return f"{module}.{name}" if module else str(name)


def _fingerprint(data: bytes) -> str:
    """A short digest of ``data`` (values too long to show, compared by content)."""
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _describe_tensor(value: torch.Tensor) -> str:
    """Shape, dtype and a digest of the values of a tensor that is not a buffer.

    Such a tensor is not stacked: model 0's would serve every model, so only equal values fuse.
    """
    head = f"tensor{tuple(value.shape)} {value.dtype}"
    if value.device.type == "meta" or value.is_sparse or value.is_quantized:
        return head
    try:
        data = value.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError):
        return head
    return f"{head} #{_fingerprint(data)}"


def _describe(value: object, depth: int = 0, seen: frozenset[int] = frozenset()) -> str:
    """A value a forward may read, in words that are equal exactly when the values are.

    Plain data (numbers, strings, tuples, lists, dicts, sets, dataclasses, objects with a
    ``__dict__``) is described by value, recursively; tensors by shape, dtype and a digest of
    their values; functions by qualified name, source line, defaults and closure values;
    ``functools.partial`` by its function and arguments; bound methods by function and owner.
    A value that cannot be described by value (nested deeper than ``_DEPTH``, a cycle, an
    object without ``__dict__`` whose ``repr`` carries an address) is described by identity:
    two models fuse only if they share it.
    """
    if value is None or isinstance(
        value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)
    ):
        return repr(value)
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, torch.Tensor):
        return _describe_tensor(value)
    if isinstance(value, nn.Module):
        # A module held outside the module tree (e.g. in a plain list) is not stacked.
        return f"<{type(value).__qualname__} at {id(value):#x}>"
    if depth >= _DEPTH or id(value) in seen:
        return f"<{type(value).__qualname__} at {id(value):#x}>"
    inner = seen | {id(value)}

    def sub(item: object) -> str:
        return _describe(item, depth + 1, inner)

    if isinstance(value, (tuple, list)):
        if len(value) > _MAX_ITEMS:
            return f"{type(value).__qualname__}[{len(value)}] #" + _fingerprint(
                "\n".join(map(sub, value)).encode()
            )
        body = ", ".join(map(sub, value))
        return f"({body})" if isinstance(value, tuple) else f"[{body}]"
    if isinstance(value, Mapping):
        items = [f"{sub(k)}: {sub(v)}" for k, v in value.items()]
        if len(items) > _MAX_ITEMS:
            return f"dict[{len(items)}] #" + _fingerprint("\n".join(items).encode())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(map(sub, value))) + "}"
    if isinstance(value, type):
        return _qualified(value)
    if isinstance(value, functools.partial):
        args = ", ".join(
            [*map(sub, value.args), *(f"{k}={sub(v)}" for k, v in value.keywords.items())]
        )
        return f"partial({sub(value.func)}, {args})"
    if isinstance(value, types.MethodType):
        owner = value.__self__
        of = type(owner).__qualname__ if isinstance(owner, nn.Module) else sub(owner)
        return f"{sub(value.__func__)} of {of}"
    if isinstance(value, types.FunctionType):
        code = value.__code__
        text = f"{_qualified(value)} ({code.co_filename}:{code.co_firstlineno})"
        if value.__defaults__:
            text += f" defaults={sub(value.__defaults__)}"
        if value.__kwdefaults__:
            text += f" kwdefaults={sub(value.__kwdefaults__)}"
        if value.__closure__:
            cells = []
            for name, cell in zip(code.co_freevars, value.__closure__, strict=False):
                try:
                    cells.append(f"{name}={sub(cell.cell_contents)}")
                except ValueError:  # an empty cell
                    cells.append(f"{name}=<empty>")
            text += " closure=(" + ", ".join(cells) + ")"
        return text
    if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)) or (
        callable(value) and not hasattr(value, "__dict__") and hasattr(value, "__qualname__")
    ):
        owner = getattr(value, "__self__", None)
        if owner is not None and not isinstance(owner, types.ModuleType):
            return f"{_qualified(value)} of {sub(owner)}"
        return _qualified(value)
    if dataclasses.is_dataclass(value):
        fields = ", ".join(
            f"{field.name}={sub(getattr(value, field.name, None))}"
            for field in dataclasses.fields(value)
        )
        return f"{type(value).__qualname__}({fields})"
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict):
        fields = ", ".join(f"{k}={sub(v)}" for k, v in sorted(state.items()))
        return f"{type(value).__qualname__}({fields})"
    text = repr(value)
    if " at 0x" in text or len(text) > 1000:
        return f"<{type(value).__qualname__} at {id(value):#x}>"
    return f"{type(value).__qualname__}:{text}"


def _config(module: nn.Module) -> tuple[tuple[str, str], ...]:
    """Every attribute the forward may read, described by value.

    Except ``nn.Module``'s bookkeeping and the rate of an ``nn.Dropout`` (kept per model).
    """
    items = []
    for name, value in sorted(vars(module).items()):
        if name in _MODULE_INTERNALS:
            continue
        if type(module) is nn.Dropout and name == "p":
            continue
        items.append((name, _describe(value)))
    return tuple(items)


def structure_key(model: nn.Module) -> StructureKey:
    """The structure key of ``model``: models with equal keys can be fused.

    Args:
        model: Any module.

    Returns:
        Its key (see :class:`StructureKey` for what enters it).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    >>> from torch import nn
    >>> a = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1))
    >>> b = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5))
    >>> structure_key(a) == structure_key(b)
    True
    >>> print(structure_key(nn.Linear(4, 8)).tensors[0])
    weight: parameter (8, 4) torch.float32
    """
    if not isinstance(model, nn.Module):
        raise type_error("model", model, "an nn.Module", "pass a PyTorch model")
    modules = tuple(
        ModuleEntry(path, type(module).__qualname__, _config(module))
        for path, module in model.named_modules()
    )
    tensors = tuple(
        TensorEntry(TensorKind.PARAMETER, name, tuple(p.shape), str(p.dtype), bool(p.requires_grad))
        for name, p in model.named_parameters()
    ) + tuple(
        TensorEntry(TensorKind.BUFFER, name, tuple(b.shape), str(b.dtype), False)
        for name, b in model.named_buffers()
    )
    return StructureKey(modules, tensors)


def unsupported_layer(model: nn.Module) -> tuple[str, nn.Module, str, str] | None:
    """The first layer of ``model`` known not to run under fusion, with its path, why, the fix.

    Everything else is accepted here and proven (or refused) by running it:
    :func:`~waterwave_hpo.fusion.verify`.

    Args:
        model: The model to check.

    Returns:
        ``(path, module, reason, fix)`` of the first such module, or None.
    """
    for path, module in model.named_modules():
        if isinstance(module, nn.SyncBatchNorm):
            return (
                path,
                module,
                "SyncBatchNorm averages statistics across processes, one model per process",
                "use nn.BatchNorm2d (the fused models already share one process)",
            )
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None:
            return (
                path,
                module,
                "momentum=None (a cumulative average) reads num_batches_tracked as a Python "
                "number, which vmap cannot batch",
                "give the layer a float momentum, e.g. 0.1",
            )
        if isinstance(module, _NO_BATCH_RULE):
            return (
                path,
                module,
                "torch has no vmap batching rule for its recurrent operator "
                "(aten::lstm, aten::gru, aten::rnn_tanh, aten::*_cell)",
                "train such models unfused (co-hosted trials)",
            )
    return None
