"""Prove a fused module before training: it runs batched and matches the K models.

:func:`verify` runs one forward and one backward of the fused module and of the K models it
holds (its :meth:`~waterwave_hpo.fusion.FusedModule.unfuse`), on copies, and compares outputs and
every parameter's gradient. A model that cannot run under ``torch.func.vmap`` or does not match
is refused with a :class:`FusionError` naming the module path and the reason, so no error from
inside vmap reaches a training step. HFTA (Wang et al., MLSys 2021) argues fused training is
equivalent to the K separate ones; this checks it for the user's model on the user's input.
"""

from __future__ import annotations

from collections.abc import Sequence
import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from waterwave_hpo._checks import message
from waterwave_hpo._checks import type_error
from waterwave_hpo._checks import value_error
from waterwave_hpo.fusion._dropout import PerModelDropout
from waterwave_hpo.fusion._errors import FusionError
from waterwave_hpo.fusion._errors import _Short
from waterwave_hpo.fusion._errors import refusal

if TYPE_CHECKING:
    from waterwave_hpo.fusion._fuse import FusedModule


@dataclass(frozen=True)
class Verification:
    """What :func:`verify` measured (it raises instead of returning a mismatch).

    Attributes:
        output_error: The largest difference between a fused model's output and the model
            alone, relative to the largest magnitude of that output (0 = equal).
        gradient_error: The same for parameter gradients, per parameter, the largest (relative
            to at least 1/100 of the model's largest gradient).
        worst_parameter: The parameter with that largest gradient difference (``""`` if none).
    """

    output_error: float
    gradient_error: float
    worst_parameter: str


def _relative(a: torch.Tensor, b: torch.Tensor, *, floor: float = 0.0) -> float:
    """``max|a - b| / max(max|b|, floor)`` in float64 (0 when both are all zeros)."""
    a64, b64 = a.detach().double(), b.detach().double()
    diff = float((a64 - b64).abs().max()) if a64.numel() else 0.0
    scale = max(float(b64.abs().max()) if b64.numel() else 0.0, floor)
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0.0 else float("inf")


def _dropout_off(module: nn.Module) -> None:
    """Zero the rate of every torch dropout layer (masks cannot match across the two runs)."""
    for layer in module.modules():
        if isinstance(layer, PerModelDropout):
            layer.set_rates([0.0] * len(layer._rates))
        elif isinstance(layer, nn.modules.dropout._DropoutNd):
            layer.p = 0.0


def _refuse(fused: FusedModule, path: str | None, reason: str) -> FusionError:
    """A refusal for a mismatch (not an exception under vmap)."""
    module = fused.stacked.get_submodule(path) if path else fused.stacked
    name = f"model.{path}" if path else "model"
    text = message(
        name,
        _Short(module),
        f"the fused models do not match the models alone: {reason}",
        "train these models unfused (co-hosted trials), or report the layer; if the model "
        "draws random numbers outside torch's dropout layers, verify with those rates at 0",
    )
    return FusionError(text, path=path, reason=reason)


def _owner(name: str) -> str:
    """The module path of a parameter name (``"a.b.weight"`` -> ``"a.b"``)."""
    return name.rpartition(".")[0]


def verify(
    fused: FusedModule,
    *inputs: Any,
    models: Sequence[nn.Module] | None = None,
    stacked: bool = False,
    rtol: float = 2e-4,
    grad_rtol: float = 1e-2,
    **kwargs: Any,
) -> Verification:
    """Run ``fused`` and its K models on one input, forward and backward, and compare.

    Works on copies (``fused`` and its parameters, buffers, gradients and the random number
    generators are left as they are), in ``fused``'s train/eval mode. The fused copy first runs
    forward and backward as it will in training (its dtype, its dropout; only that it runs is
    checked); then fused and alone are compared with torch's dropout layers at rate 0: each
    model's outputs and parameter gradients (of the sum of its outputs weighted by fixed random
    numbers) must equal the fused model's. A float32 model is compared in float64 (copies),
    where fusion must match to 1e-6 (float32 gradients of a deep net at a small batch differ by
    up to ~1e-1 between two exact summation orders: xception41 fused vs alone, 8.6e-15 in
    float64); a model that does not run in float64, and any other dtype, is compared in its
    own dtype within ``rtol`` and ``grad_rtol``.

    Args:
        fused: The module :func:`~waterwave_hpo.fusion.fuse` returned.
        *inputs: The model's positional inputs, as for ``fused(*inputs)``.
        models: The K models ``fused`` was built from, in their state at fusing (copied, left
            as they are); :func:`~waterwave_hpo.fusion.fuse` passes them. None: ``fused``'s own
            :meth:`~waterwave_hpo.fusion.FusedModule.unfuse`, which carries what fusion stacked
            (parameters, buffers, dropout rates) but not a tensor kept as a plain attribute.
        stacked: Whether the inputs hold one batch per model, ``(K, B, ...)``.
        rtol: Outside float64: the largest output difference accepted, relative to the
            output's largest magnitude.
        grad_rtol: Outside float64: the same for each parameter's gradient, relative to the
            larger of its largest magnitude and 1/100 of the model's largest gradient.
        **kwargs: The model's keyword inputs, as for ``fused(*inputs, **kwargs)``.

    Returns:
        The differences measured (all within ``rtol``).

    Raises:
        TypeError: ``fused`` is not a :class:`~waterwave_hpo.fusion.FusedModule`.
        ValueError: The input does not run on the model alone (the input is wrong, not fusion).
        FusionError: The fused module cannot run the input batched (forward or backward), or
            an output or a gradient differs from the model alone; the module path and the
            reason are named.

    >>> import torch
    >>> from torch import nn
    >>> from waterwave_hpo import fusion
    >>> fused = fusion.fuse([nn.Sequential(nn.Linear(4, 2), nn.Hardswish()) for _ in range(2)])
    >>> fusion.verify(fused, torch.randn(3, 4)).output_error < 1e-6
    True
    """
    from waterwave_hpo.fusion._fuse import FusedModule

    if not isinstance(fused, FusedModule):
        raise type_error("fused", fused, "a FusedModule", "pass what fusion.fuse(models) returned")
    return verify_fused(
        fused, inputs, kwargs, models=models, stacked=stacked, rtol=rtol, grad_rtol=grad_rtol
    )


def verify_fused(
    fused: FusedModule,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    models: Sequence[nn.Module] | None,
    stacked: bool,
    rtol: float,
    grad_rtol: float,
) -> Verification:
    """:func:`verify` without its type check on ``fused`` (for :func:`fuse`, which built it)."""
    for name, value in (("rtol", rtol), ("grad_rtol", grad_rtol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise value_error(name, value, "must be a positive number", "pass e.g. 1e-3")
    k = fused.num_models
    devices = [d for d in {p.device for p in fused.parameters()} if d.type == "cuda"]
    if models is not None and len(models) != k:
        raise value_error(
            "models",
            _Short(models),
            f"holds {len(models)} models, fused {k}",
            "pass the models fused was built from",
        )
    with torch.random.fork_rng(devices=devices), torch.enable_grad():  # type: ignore[no-untyped-call,unused-ignore]
        _runs_alone(fused, models, inputs, kwargs, stacked=stacked)
        # As in training (the model's dtype, its dropout): it must run, forward and backward.
        _run(copy.deepcopy(fused), inputs, kwargs, stacked=stacked)
        single = {p.dtype for p in fused.parameters() if p.is_floating_point()} == {torch.float32}
        if single:
            # In float64 fusion must match to rounding (float32 gradients of a deep net at a
            # small batch differ by up to ~1e-1 between two exact orders of summation).
            try:
                return _compare_copies(
                    fused, models, inputs, kwargs, stacked=stacked, rtol=(1e-6, 1e-6), dtype=True
                )
            except FusionError:
                raise
            except Exception:  # the model does not run in float64: compare in its own dtype
                pass
        return _compare_copies(
            fused, models, inputs, kwargs, stacked=stacked, rtol=(rtol, grad_rtol), dtype=False
        )


def _compare_copies(
    fused: FusedModule,
    models: Sequence[nn.Module] | None,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    stacked: bool,
    rtol: tuple[float, float],
    dtype: bool,
) -> Verification:
    """Copies of ``fused`` and the K models, dropout off (in float64 if ``dtype``), compared."""
    alone = (
        fused.unfuse()
        if models is None
        else [copy.deepcopy(model).train(fused.training) for model in models]
    )
    trial = copy.deepcopy(fused)
    for module in (*alone, trial):
        _dropout_off(module)
        if dtype:
            module.double()
    for param in trial.parameters():
        param.grad = None
    if dtype:
        inputs, kwargs = pytree.tree_map(
            lambda x: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
            (inputs, kwargs),
        )
    return _compare(trial, alone, inputs, kwargs, stacked=stacked, k=fused.num_models, rtol=rtol)


def _runs_alone(
    fused: FusedModule,
    models: Sequence[nn.Module] | None,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    stacked: bool,
) -> None:
    """Raise ValueError if the input does not run on the first model alone (not fusion's)."""
    model = copy.deepcopy(models[0]) if models is not None else fused.unfuse()[0]
    args, kws = inputs, kwargs
    if stacked:
        args, kws = pytree.tree_map(
            lambda x: x[0] if isinstance(x, torch.Tensor) else x, (inputs, kwargs)
        )
    try:
        with torch.no_grad():
            model(*args, **kws)
    except Exception as error:
        raise ValueError(
            message(
                "inputs",
                _Short(args[0] if args else kws),
                f"does not run on model 0 alone ({type(error).__name__}: {error})",
                "pass an input the model itself accepts",
            )
        ) from error


def _run(trial: FusedModule, inputs: Any, kwargs: dict[str, Any], *, stacked: bool) -> None:
    """One forward and backward of ``trial`` as in training; refused if either raises."""
    k = trial.num_models
    try:
        out = trial(*inputs, stacked=stacked, **kwargs)
    except FusionError:
        raise
    except Exception as error:
        raise refusal(error, trial.stacked, num_models=k, when="the fused forward") from error
    leaves = [
        leaf
        for leaf in pytree.tree_leaves(out)
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad
    ]
    if leaves:
        try:
            sum(leaf.sum() for leaf in leaves).backward()  # type: ignore[union-attr]
        except Exception as error:
            raise refusal(error, trial.stacked, num_models=k, when="the fused backward") from error


def _compare(
    trial: FusedModule,
    models: list[nn.Module],
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    stacked: bool,
    k: int,
    rtol: tuple[float, float],
) -> Verification:
    """The body of :func:`verify`, on copies; ``rtol`` for outputs and for gradients."""
    output_rtol, grad_rtol = rtol
    references = []
    for index, model in enumerate(models):
        args, kws = (inputs, kwargs)
        if stacked:
            args, kws = pytree.tree_map(
                lambda x, i=index: x[i] if isinstance(x, torch.Tensor) else x, (inputs, kwargs)
            )
        try:
            references.append(model(*args, **kws))
        except Exception as error:
            raise ValueError(
                message(
                    "inputs",
                    _Short(args[0] if args else kws),
                    f"does not run on model {index} alone ({type(error).__name__}: {error})",
                    "pass an input the model itself accepts",
                )
            ) from error
    try:
        out = trial(*inputs, stacked=stacked, **kwargs)
    except FusionError:
        raise
    except Exception as error:  # a fused kernel or the direct path, outside vmap
        raise refusal(error, trial.stacked, num_models=k, when="the fused forward") from error
    fused_leaves, fused_spec = pytree.tree_flatten(out)
    generator = torch.Generator().manual_seed(0)
    fused_loss: torch.Tensor | None = None
    output_error = 0.0
    for index, reference in enumerate(references):
        leaves, spec = pytree.tree_flatten(reference)
        if spec != fused_spec:
            reason = f"model {index} returns {spec}, the fused model {fused_spec}"
            raise _refuse(trial, None, reason)
        loss = None
        for leaf, whole in zip(leaves, fused_leaves, strict=True):
            if not isinstance(leaf, torch.Tensor):
                continue
            mine = whole[index]
            if mine.shape != leaf.shape:
                raise _refuse(
                    trial,
                    None,
                    f"an output of model {index} has shape {tuple(leaf.shape)}, the fused "
                    f"model's {tuple(mine.shape)}",
                )
            if not leaf.is_floating_point():
                if not torch.equal(mine, leaf):
                    raise _refuse(trial, None, f"an integer output of model {index} differs")
                continue
            difference = _relative(mine, leaf)
            output_error = max(output_error, difference)
            if difference > output_rtol:
                raise _refuse(
                    trial,
                    None,
                    f"an output of model {index} differs by {difference:.3g} of its largest "
                    f"magnitude (rtol={output_rtol:g})",
                )
            if leaf.requires_grad:
                weight = torch.randn(leaf.shape, generator=generator).to(leaf.device, leaf.dtype)
                loss = (leaf * weight).sum() + (0 if loss is None else loss)
                term = (mine * weight).sum()
                fused_loss = term if fused_loss is None else fused_loss + term
        if loss is not None:
            loss.backward()  # type: ignore[no-untyped-call]
    if fused_loss is None:
        return Verification(output_error, 0.0, "")
    try:
        fused_loss.backward()  # type: ignore[no-untyped-call]
    except Exception as error:
        raise refusal(error, trial.stacked, num_models=k, when="the fused backward") from error
    return _compare_grads(trial, models, output_error, grad_rtol)


def _compare_grads(
    trial: FusedModule, models: list[nn.Module], output_error: float, rtol: float
) -> Verification:
    """Each parameter's gradient, fused against each model alone.

    A gradient that is zero in exact arithmetic (an attention key's bias, a bias before a
    normalization) is float rounding of cancelling terms as large as the model's other
    gradients; each difference is therefore relative to the larger of that gradient's largest
    magnitude and 1/100 of the largest gradient of the whole model.
    """
    worst, worst_name = 0.0, ""
    floors = []
    for model in models:
        grads = [p.grad.detach().abs().max() for p in model.parameters() if p.grad is not None]
        grads = [g for g in grads if g.numel()]
        floors.append(0.01 * float(max(grads)) if grads else 0.0)
    for name, param in trial.stacked.named_parameters():
        for index, model in enumerate(models):
            reference = model.get_parameter(name).grad
            mine = None if param.grad is None else param.grad[index]
            if reference is None and mine is None:
                continue
            if reference is None or mine is None:
                if mine is not None and not mine.any():
                    continue
                if reference is not None and not reference.any():
                    continue
                raise _refuse(
                    trial,
                    _owner(name),
                    f"parameter {name!r} gets a gradient in one run only (model {index})",
                )
            error = _relative(mine, reference, floor=floors[index])
            if error > worst:
                worst, worst_name = error, name
            if error > rtol:
                raise _refuse(
                    trial,
                    _owner(name),
                    f"the gradient of {name!r} in model {index} differs by {error:.3g} of its "
                    f"largest magnitude (grad_rtol={rtol:g})",
                )
    return Verification(output_error, worst, worst_name)
