"""Fuse K models of one structure into one module (horizontal fusion, HFTA).

HFTA (Wang et al., "Horizontally Fused Training Array", MLSys 2021, arXiv:2102.02344) trains K
models that run the same operators on the same shapes as one model whose operators are batched.
HFTA asks the user to rewrite the model with its fused operators; here the user's model runs
unchanged: its parameters and buffers are stacked to ``(K, ...)`` and its ``forward`` runs under
``torch.func.vmap`` over them (``functional_call``), with ``randomness="different"`` so each
model draws its own dropout mask. Where a layer has a fused kernel (``_kernels.py``), vmap calls
that kernel with the whole array at once.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
import copy
from typing import Any

import torch
from torch import fx
from torch import nn
from torch.func import functional_call
from torch.func import vmap
from torch.utils import _pytree as pytree

from waterwave_hpo import _checks
from waterwave_hpo._checks import message
from waterwave_hpo._checks import type_error
from waterwave_hpo._checks import value_error
from waterwave_hpo.fusion import _graph as graph
from waterwave_hpo.fusion._attention import MathAttention
from waterwave_hpo.fusion._direct import Layout
from waterwave_hpo.fusion._direct import Result
from waterwave_hpo.fusion._direct import direct_form
from waterwave_hpo.fusion._direct import stacked
from waterwave_hpo.fusion._dropout import PerModelDropout
from waterwave_hpo.fusion._errors import FusionError
from waterwave_hpo.fusion._errors import _Short
from waterwave_hpo.fusion._errors import refusal
from waterwave_hpo.fusion._kernels import kernel_module
from waterwave_hpo.fusion._structure import structure_key
from waterwave_hpo.fusion._structure import unsupported_layer
from waterwave_hpo.fusion._verify import verify_fused


def _replace_modules(root: nn.Module, replacements: dict[int, nn.Module]) -> nn.Module:
    """``root`` with each module whose ``id`` is in ``replacements`` replaced at every path.

    A module shared by two parents (one position encoding for every block of a stage) is
    replaced under both by the one new module, so they stay shared. Returns the new root when
    ``root`` itself is replaced.
    """
    if id(root) in replacements:
        return replacements[id(root)]
    for parent in list(root.modules()):  # each parent once: its slots are every path's
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in replacements:
                setattr(parent, name, replacements[id(child)])
    return root


def _device_of(model: nn.Module) -> torch.device | None:
    """The one device of the model's tensors (None if it has none)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        return tensor.device
    return None


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer slot of ``module`` by one name each, tied tensors under all.

    ``functional_call`` swaps each name given in and back. A submodule reached by two paths (a
    layer shared by two blocks, as CoaT's convolutional position encoding) has one slot; swapping
    it once per path, as ``functional_call``'s own weight tying does, restores it in the wrong
    order: the module kept vmap's batched tensor after the call and the stacked parameter got
    no gradient. Here each ``(module, slot)`` gets its first path's name, and a tensor held in two
    slots (tied weights, an embedding and an output layer) is given under each slot's name.
    """
    state: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, str]] = set()
    for path, sub in module.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for slots in (sub._parameters, sub._buffers):
            for local, tensor in slots.items():
                if tensor is None or (id(sub), local) in seen:
                    continue
                seen.add((id(sub), local))
                state[prefix + local] = tensor
    return state


DirectStep = tuple[nn.Module, "Callable[[nn.Module, torch.Tensor, Layout, int], Result] | None"]


def _layers(sequential: nn.Sequential) -> list[nn.Module]:
    """The layers of a Sequential in call order, nested Sequentials opened."""
    layers: list[nn.Module] = []
    for child in sequential:
        if type(child) is nn.Sequential:
            layers += _layers(child)
        else:
            layers.append(child)
    return layers


def _has_hooks(model: nn.Module) -> bool:
    """Whether a module of ``model`` has forward hooks (the direct path would skip them)."""
    return any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())


def _check_models(models: object) -> list[nn.Module]:
    """``models`` as a list after every check :func:`fuse` promises (see its ``Raises:``)."""
    if isinstance(models, nn.Module) or not isinstance(models, Sequence):
        raise type_error(
            "models", models, "a sequence of nn.Module", "pass a list of K models, e.g. [m1, m2]"
        )
    models = list(models)
    if not models:
        raise value_error(
            "models", models, "must hold at least one model (K >= 1)", "pass a list of K models"
        )
    for index, model in enumerate(models):
        if not isinstance(model, nn.Module):
            raise type_error(f"models[{index}]", model, "an nn.Module", "pass PyTorch models")
        for path, module in model.named_modules():
            if isinstance(module, FusedModule):
                raise ValueError(
                    message(
                        f"models[{index}]" + (f".{path}" if path else ""),
                        _Short(module),
                        "is already a FusedModule",
                        "fuse the original models, or the models its unfuse() returns",
                    )
                )
    found = unsupported_layer(models[0])
    if found is not None:
        path, module, reason, fix = found
        kind = type(module)
        raise TypeError(
            message(
                f"models[0].{path}" if path else "models[0]",
                _Short(module),
                f"{kind.__module__}.{kind.__qualname__} is not supported: {reason}",
                fix,
            )
        )
    key = structure_key(models[0])
    device = _device_of(models[0])
    for index, model in enumerate(models[1:], start=1):
        difference = key.difference(structure_key(model))
        if difference is not None:
            raise ValueError(
                message(
                    f"models[{index}]",
                    _Short(model),
                    f"differs from models[0] in structure: {difference}",
                    "only models with equal fusion.structure_key(model) fuse: group the models "
                    "by their key and fuse each group",
                )
            )
        other = _device_of(model)
        if other != device:
            raise ValueError(
                message(
                    f"models[{index}]",
                    _Short(model),
                    f"is on device {other} but models[0] on {device}",
                    "move every model to one device (model.to(device)) before fusing",
                )
            )
    return models


class FusedModule(nn.Module):
    """K models of one structure trained as one module (HFTA, MLSys 2021).

    Every parameter and buffer has shape ``(K, *shape_in_one_model)``; ``fused(x)`` runs the K
    models on one batch and stacks their outputs. Built by :func:`fuse`; not constructed
    directly.

    Attributes:
        stacked: A copy of the first model whose parameters and buffers are the stacked ones
            (names as in the original model, e.g. ``stacked.0.weight``), whose ``nn.Dropout``
            layers are :class:`PerModelDropout` and, with kernels, whose supported layers are
            fused kernels. Not to be called directly: :meth:`forward` runs it (through vmap,
            or layer by layer on the direct path).
    """

    def __init__(self, models: list[nn.Module], *, kernels: bool) -> None:
        super().__init__()
        self._num_models = len(models)
        template = models[0]
        # The user's structure, without storage, to build unfuse()'s models from.
        self._skeleton = (copy.deepcopy(template).to("meta"),)
        self._dropout_paths = [
            path for path, module in template.named_modules() if type(module) is nn.Dropout
        ]
        self._dropout_p = {
            path: [float(model.get_submodule(path).p) for model in models]  # type: ignore[arg-type]
            for path in self._dropout_paths
        }
        stacked = copy.deepcopy(template)
        self._stack_tensors(stacked, models)
        dropouts: dict[int, nn.Module] = {}
        for path in self._dropout_paths:
            dropout = PerModelDropout(0.0).to(_device_of(stacked))
            dropout.set_rates(self._dropout_p[path])
            dropouts[id(stacked.get_submodule(path))] = dropout
        stacked = _replace_modules(stacked, dropouts)
        if kernels:
            replaced: dict[int, nn.Module] = {}
            for module in stacked.modules():
                fused = kernel_module(module)
                if fused is not None:
                    replaced[id(module)] = fused
            stacked = _replace_modules(stacked, replaced)
        self.stacked = stacked
        # HFTA's direct path for a Sequential: its forward is its layers in order.
        self._direct: list[DirectStep] | None = None
        if kernels and type(stacked) is nn.Sequential and not _has_hooks(stacked):
            self._direct = [(layer, direct_form(layer)) for layer in _layers(stacked)]
        # Any other model: its forward traced once per train/eval mode (None: not traceable
        # or not all its nodes run on the array; then it runs whole under vmap).
        self._graph_ok = kernels and self._direct is None and not _has_hooks(stacked)
        self._graphs: dict[bool, fx.Graph | None] = {}
        self.train(template.training)

    @staticmethod
    def _stack_tensors(stacked: nn.Module, models: list[nn.Module]) -> None:
        """Replace every parameter and buffer of ``stacked`` by the K models' stacked."""
        with torch.no_grad():
            new_params: dict[int, nn.Parameter] = {}
            for name, param in stacked.named_parameters():
                data = torch.stack([model.get_parameter(name).detach() for model in models])
                new_params[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            for module in stacked.modules():
                for local, old in module._parameters.items():
                    if old is not None:
                        module._parameters[local] = new_params[id(old)]
            for module_path, module in stacked.named_modules():
                for local, buffer in module._buffers.items():
                    if buffer is None:
                        continue
                    name = f"{module_path}.{local}" if module_path else local
                    module._buffers[local] = torch.stack(
                        [model.get_buffer(name).detach() for model in models]
                    ).clone()

    @property
    def num_models(self) -> int:
        """K, the number of models fused."""
        return self._num_models

    def forward(self, *inputs: Any, stacked: bool = False, **kwargs: Any) -> Any:
        """Run the K models.

        Args:
            *inputs: The model's positional inputs. Shared (``stacked=False``): each
                ``(B, ...)``, the same batch for every model. Stacked: each ``(K, B, ...)``, one
                batch per model.
            stacked: Whether the inputs hold one batch per model.
            **kwargs: The model's keyword inputs (e.g. ``input_ids=``, ``attention_mask=`` of
                a transformers model), shared or stacked like ``inputs``; values that are not
                tensors (None, bools, ints) are passed to every model as they are.

        Returns:
            The K outputs stacked: ``(K, B, ...)`` for a model returning ``(B, ...)`` (tuples,
            dicts and transformers' ``ModelOutput`` of tensors likewise, each stacked).

        Raises:
            ValueError: ``stacked=True`` and an input's first dimension is not K.
            FusionError: The model cannot run batched under vmap (the module at fault and the
                reason are named; :func:`verify` finds this before training).
        """
        if stacked:
            named = [(f"inputs[{i}]", x) for i, x in enumerate(inputs)]
            named += [(f"kwargs[{name!r}]", x) for name, x in kwargs.items()]
            for name, x in named:
                for leaf in pytree.tree_leaves(x):
                    if isinstance(leaf, torch.Tensor) and (
                        leaf.dim() == 0 or leaf.shape[0] != self._num_models
                    ):
                        raise value_error(
                            f"{name}.shape",
                            tuple(leaf.shape),
                            f"must start with K={self._num_models} when stacked=True",
                            "pass one batch per model, (K, B, ...), or stacked=False to share one",
                        )
        if (
            self._direct is not None
            and not kwargs
            and len(inputs) == 1
            and isinstance(inputs[0], torch.Tensor)
        ):
            return self._forward_direct(inputs[0], shared=not stacked)
        if (
            self._graph_ok
            and not kwargs
            and len(inputs) == 1
            and isinstance(inputs[0], torch.Tensor)
        ):
            if self.training not in self._graphs:
                self._graphs[self.training] = graph.trace(self.stacked)
            traced = self._graphs[self.training]
            if traced is not None:
                return graph.run(
                    traced,
                    self.stacked,
                    inputs[0],
                    Layout.STACKED if stacked else Layout.SHARED,
                    self._num_models,
                    lambda module, xs, kws, shared: self._vmap(module, xs, kws, shared=shared),
                )
        return self._vmap(self.stacked, inputs, kwargs, shared=not stacked)

    def _vmap(
        self,
        module: nn.Module,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        shared: bool,
    ) -> Any:
        """Run ``module`` (part of the stacked model) for the K models under vmap."""
        tensors = _state(module)
        args: tuple[Any, dict[str, Any]] = (inputs, kwargs)
        if shared and not tensors:
            # Nothing of the models' own to batch (e.g. a Softmax): vmap needs a batched input.
            k = self._num_models
            args = pytree.tree_map(
                lambda x: x.unsqueeze(0).expand(k, *x.shape) if isinstance(x, torch.Tensor) else x,
                args,
            )
            shared = False
        # One in_dim per leaf: 0 for a stacked tensor, None for shared ones and non-tensors.
        dims = pytree.tree_map(
            lambda x: 0 if isinstance(x, torch.Tensor) and not shared else None, args
        )

        def call(state: dict[str, torch.Tensor], xs: tuple[Any, ...], kws: dict[str, Any]) -> Any:
            # ``_state`` names each slot once, tied tensors included: no tying needed.
            return functional_call(module, state, xs, kws, tie_weights=False)

        batched = vmap(call, in_dims=(0, *dims), randomness="different")
        on_cpu = all(t.device.type == "cpu" for t in tensors.values())
        try:
            if on_cpu:
                with MathAttention():
                    return batched(tensors, *args)
            return batched(tensors, *args)
        except (RuntimeError, ValueError, TypeError) as error:
            if isinstance(error, FusionError):
                raise
            raise refusal(
                error, self.stacked, num_models=self._num_models, when="the fused forward"
            ) from error

    def _forward_direct(self, x: torch.Tensor, *, shared: bool) -> torch.Tensor:
        """The Sequential's layers in order, each fused directly or else through vmap.

        Activations keep the layout each layer leaves them in (HFTA's ``(N, K*C, *S)`` through
        convolutions, norms, pools and activations); only a layer that needs another changes it.
        """
        assert self._direct is not None
        k = self._num_models
        layout = Layout.SHARED if shared else Layout.STACKED
        for layer, form in self._direct:
            result = None if form is None else form(layer, x, layout, k)
            if result is None:
                if layout is Layout.CHANNELS:
                    x, layout = stacked(x, layout, k), Layout.STACKED
                vmapped = self._vmap(layer, (x,), {}, shared=layout is Layout.SHARED)
                x, layout = vmapped, Layout.STACKED
            else:
                x, layout = result
        if layout is Layout.SHARED:
            return x.unsqueeze(0).expand(k, *x.shape)
        return stacked(x, layout, k)

    def keep_models(self, indices: Sequence[int]) -> None:
        """Keep only the models at ``indices``, in that order (the others stop costing compute).

        Parameter objects keep their identity (an optimizer holding them stays valid); their
        ``.data`` and ``.grad`` are re-stacked to ``(K', ...)``, buffers likewise, and K becomes
        ``len(indices)``.

        Args:
            indices: Distinct positions in ``range(K)``, at least one.

        Raises:
            TypeError: ``indices`` is not a sequence of ints.
            ValueError: ``indices`` is empty, repeats a position or holds one out of range.
        """
        fix = f"pass distinct positions in range({self._num_models}), at least one"
        if not isinstance(indices, Sequence) or isinstance(indices, str):
            raise type_error("indices", indices, "a sequence of ints", fix)
        kept = list(indices)
        if any(isinstance(i, bool) or not isinstance(i, int) for i in kept):
            raise type_error("indices", indices, "a sequence of ints", fix)
        if not kept or len(set(kept)) != len(kept):
            raise value_error("indices", indices, "must be distinct and non-empty", fix)
        if any(not 0 <= i < self._num_models for i in kept):
            raise value_error("indices", indices, f"must lie in range({self._num_models})", fix)
        with torch.no_grad():
            for param in self.stacked.parameters():
                index = torch.tensor(kept, device=param.device)
                grad: torch.Tensor | None = param.grad
                # Not ``param.data = ...``: the parameter's AccumulateGrad node outlives a
                # ``.data`` swap while any graph of an earlier step is alive (torch resets it
                # only on a dtype or device change), so the next backward would check gradients
                # against the old K and fail. ``swap_tensors`` gives the same Python object a
                # new tensor and autograd state; optimizers keyed by the object stay valid.
                torch.utils.swap_tensors(  # type: ignore[no-untyped-call]
                    param, nn.Parameter(param.index_select(0, index), param.requires_grad)
                )
                if grad is not None:
                    param.grad = grad.index_select(0, index)
            for module in self.stacked.modules():
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        index = torch.tensor(kept, device=buffer.device)
                        module._buffers[name] = buffer.index_select(0, index)
        self._dropout_p = {path: [ps[i] for i in kept] for path, ps in self._dropout_p.items()}
        for path, rates in self._dropout_p.items():
            layer = self.stacked.get_submodule(path)
            if isinstance(layer, PerModelDropout):
                layer.set_rates(rates)
        self._num_models = len(kept)

    def unfuse(self) -> list[nn.Module]:
        """K ordinary modules holding the fused models' current weights and buffers.

        Each is a deep copy of the first original model's structure, with model k's
        parameters, buffers (e.g. BatchNorm running statistics) and dropout rate, in the fused
        module's train/eval mode. The fused module is left as it is.

        Returns:
            The K models, in the fused order (after :meth:`keep_models`, the kept ones).
        """
        # Every name, tied ones included: a tensor the model shares between two places
        # (tied weights) is one stacked tensor, and becomes one tensor again in each model.
        params = dict(self.stacked.named_parameters(remove_duplicate=False))
        buffers = dict(self.stacked.named_buffers(remove_duplicate=False))
        models = []
        for k in range(self._num_models):
            model = copy.deepcopy(self._skeleton[0])
            made: dict[int, nn.Parameter] = {}
            made_buffers: dict[int, torch.Tensor] = {}
            with torch.no_grad():
                for path, module in model.named_modules(remove_duplicate=False):
                    prefix = f"{path}." if path else ""
                    for local, old in module._parameters.items():
                        if old is not None:
                            source = params[prefix + local]
                            if id(source) not in made:
                                made[id(source)] = nn.Parameter(
                                    source[k].clone(), requires_grad=source.requires_grad
                                )
                            module._parameters[local] = made[id(source)]
                    for local, old in module._buffers.items():
                        if old is not None:
                            stacked_buffer = buffers[prefix + local]
                            if id(stacked_buffer) not in made_buffers:
                                made_buffers[id(stacked_buffer)] = stacked_buffer[k].clone()
                            module._buffers[local] = made_buffers[id(stacked_buffer)]
            for path in self._dropout_paths:
                dropout: nn.Dropout = model.get_submodule(path)  # type: ignore[assignment]
                dropout.p = self._dropout_p[path][k]
            models.append(model.train(self.training))
        return models

    def extra_repr(self) -> str:
        """``num_models=K``."""
        return f"num_models={self._num_models}"


def fuse(
    models: Sequence[nn.Module],
    *,
    kernels: bool = True,
    example_inputs: Any = None,
    example_kwargs: dict[str, Any] | None = None,
) -> FusedModule:
    """Fuse K models of one structure into one module (HFTA, MLSys 2021).

    The models are copied (they are left as they are). Model k of the fused module starts
    with model k's parameters, buffers and dropout rate. Given an example input, the fused
    module is proven before it is returned (:func:`verify`: forward and backward against the K
    models, on copies); without one, a model that cannot run batched fails at its first forward
    with a :class:`FusionError` naming the module.

    Args:
        models: K >= 1 models with equal :func:`structure_key`, on one device. Any layers
            (torch's, the user's, timm's, transformers'...) except the few refused up front
            (recurrent layers, ``SyncBatchNorm``, BatchNorm with ``momentum=None``).
        kernels: Use fused kernels (HFTA). An ``nn.Sequential`` without hooks then runs
            layer by layer on the array without vmap (Linear as one batched matmul, Conv1d/2d
            as one grouped convolution, or on the CPU, where a one-time timing finds it faster,
            a Conv2d as im2col and one batched matmul (:class:`FusedConv`); BatchNorm over K*C
            channels, LayerNorm, Embedding, dropout, pooling; other layers through vmap),
            activations kept in HFTA's ``(N, K*C, *S)`` layout between them. Any other model
            without hooks whose forward ``torch.fx`` traces into layers and elementwise
            arithmetic (``+``, ``*``, ``+=``, ``relu``, ``torch.flatten``: a ResNet) runs the
            same way node by node; the rest runs under vmap with Linear and Conv1d/2d as fused
            kernels. False: every layer through vmap's own batching rules. All give the same
            results (to float rounding).
        example_inputs: A positional input of one model (a tensor), or a tuple of them,
            ``(B, ...)``; with ``example_kwargs``, what :func:`verify` runs. None (and no
            ``example_kwargs``): not verified (:func:`verify` can be called later).
        example_kwargs: Keyword inputs of one model for :func:`verify`, e.g.
            ``{"input_ids": ids, "attention_mask": mask}``.

    Returns:
        The fused module, K = ``len(models)``.

    Raises:
        TypeError: ``models`` is not a sequence of ``nn.Module``, or a model holds a layer
            known not to run fused (named with its path).
        ValueError: ``models`` is empty, a model is (or holds) a :class:`FusedModule`, the
            structures differ (the first difference is named) or the devices differ.
        FusionError: Given an example input, the fused module cannot run it batched or does
            not match the K models (the module and the reason are named).

    >>> import torch
    >>> from torch import nn
    >>> models = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(3)]
    >>> fused = fuse(models, example_inputs=torch.randn(5, 4))
    >>> fused(torch.randn(5, 4)).shape
    torch.Size([3, 5, 2])
    >>> fused.stacked[0].weight.shape
    torch.Size([3, 8, 4])
    """
    if not isinstance(kernels, bool):
        raise _checks.type_error(
            "kernels", kernels, "a bool", "pass True (fused kernels) or False (vmap only)"
        )
    checked = _check_models(models)
    fused = FusedModule(checked, kernels=kernels)
    if example_inputs is not None or example_kwargs is not None:
        if example_kwargs is not None and not isinstance(example_kwargs, dict):
            raise type_error(
                "example_kwargs",
                example_kwargs,
                "a dict of keyword inputs",
                "pass e.g. {'input_ids': ids}, or None",
            )
        if example_inputs is None:
            args: tuple[Any, ...] = ()
        elif isinstance(example_inputs, tuple):
            args = example_inputs
        else:
            args = (example_inputs,)
        verify_fused(
            fused,
            args,
            example_kwargs or {},
            models=checked,
            stacked=False,
            rtol=2e-4,
            grad_rtol=1e-2,
        )
    return fused
