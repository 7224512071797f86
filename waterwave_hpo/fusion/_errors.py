"""The error fusion raises when a model cannot run fused, and where in the model it arose.

A layer that ``torch.func.vmap`` cannot batch (a read of a tensor's value into Python, an operator
without a batching rule) fails deep inside vmap with a message that names neither the layer nor a
fix. :func:`refusal` turns such an error into a :class:`FusionError` naming the module path (found
from the traceback: the innermost ``forward`` of a module of the model), the reason and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from waterwave_hpo._checks import message

if TYPE_CHECKING:
    from torch import nn


class FusionError(RuntimeError):
    """A model that cannot be trained fused, refused with the module at fault and the reason.

    Raised by :func:`~waterwave_hpo.fusion.verify` (and :func:`~waterwave_hpo.fusion.fuse` given
    an example input) before training, and by a fused forward that fails under vmap. A
    ``RuntimeError``, so code that caught vmap's own errors still catches it.

    Attributes:
        path: The dotted path of the module at fault in the user's model (``""`` for the model
            itself), or None when no module can be named (e.g. a failing backward).
        reason: Why, in words.
    """

    def __init__(self, text: str, *, path: str | None, reason: str) -> None:
        super().__init__(text)
        self.path = path
        self.reason = reason


class _Short:
    """A module shown as ``<TypeName>`` in an error message (its full repr is a whole model)."""

    def __init__(self, module: object) -> None:
        self.text = f"<{type(module).__name__}>"

    def __repr__(self) -> str:
        return self.text


def module_at_fault(error: BaseException, root: nn.Module) -> tuple[str, nn.Module] | None:
    """The innermost module of ``root`` whose ``forward`` is on ``error``'s traceback.

    Args:
        error: An exception raised while ``root`` (or a part of it) ran.
        root: The model whose modules to look for.

    Returns:
        ``(path, module)`` with ``path`` as in ``root.named_modules()``, or None if no frame of
        the traceback belongs to a module of ``root``.
    """
    paths = {id(module): (path, module) for path, module in root.named_modules()}
    found = None
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in paths:
            found = paths[id(owner)]
        tb = tb.tb_next
    return found


_FIX = (
    "train these models unfused (co-hosted trials), replace the layer, or make its forward "
    "batchable (no .item(), float() or bool() of a tensor, no data-dependent control flow)"
)


def refusal(error: BaseException, root: nn.Module, *, num_models: int, when: str) -> FusionError:
    """``error`` (raised under vmap while ``root`` ran) as a :class:`FusionError`.

    Args:
        error: The exception raised.
        root: The stacked model that ran (its paths are the user's model's paths).
        num_models: K, for the message.
        when: What was running, e.g. ``"the fused forward"``.

    Returns:
        The error to raise (``raise refusal(...) from error``).
    """
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    found = module_at_fault(error, root)
    # Outside every submodule's forward in a forward (e.g. vmap refusing the model's output):
    # the model itself; in a backward, no module can be named.
    path = found[0] if found is not None else ("" if "forward" in when else None)
    name = "model" if not path else f"model.{path}"
    value = _Short(found[1] if found is not None else root)
    reason = f"{type(error).__name__} under torch.func.vmap in {when}: {first_line}"
    text = message(
        name, value, f"cannot run batched for the {num_models} fused models ({reason})", _FIX
    )
    return FusionError(text, path=path, reason=reason)
