"""The mirror weight update: the optimizer steps on the averaged sparse gradient, while the
gradient bucket keeps the error-feedback residual.

LaySA's conflict (IEEE Access 2021): with error feedback, a layer's gradient memory is needed
twice after communication, once for the averaged gradient the weight update consumes and once
for the residual the next step adds back; naive top-k resolves it with one more dense copy per
layer. LaySA's mirror weight update applies the weight update from the exchanged sparse
gradient, so the gradient memory can keep the residual.

Ours, to fit any ``torch.optim.Optimizer`` (SGD, momentum, Adam, weight decay...): at
``optimizer.step()`` each sparse layer's averaged gradient is scattered from the received
(values, indices) into gradient memory, set as that parameter's ``.grad`` and stepped alone
(one layer at a time, LaySA's layer-centric reuse); the bucket (the residual) is never seen by
the optimizer. The gradient memory is the parameter's own ``.grad`` where DDP keeps one apart
from its bucket (``gradient_as_bucket_view=False``, DDP's default: no extra memory at all),
else one shared scratch the size of the largest layer. A ``.grad`` that is the bucket is left
``None`` after the step, so the user's ``zero_grad()`` (either mode) cannot touch the
residual; on the next backward a post-accumulate-grad hook adds the residual to the fresh
gradient before DDP copies it into the bucket.

Limits: ``optimizer.step(closure)`` (e.g. LBFGS) is not supported for sparse layers; the
optimizer is called once per sparse layer per step (cheap for a fused/foreach optimizer).
"""

from __future__ import annotations

from typing import Any

import torch

from waterwave_hpo.distributed._state import LaySAState


class MirrorWeightUpdate:
    """Attaches the mirror weight update to ``optimizer`` for the parameters of ``state``.

    Args:
        state: The LaySA hook state (knows which buckets were sent sparsely this step).
        optimizer: The optimizer stepping the DDP model's parameters.
        params: The parameters whose residuals the hook manages.
    """

    def __init__(
        self,
        state: LaySAState,
        optimizer: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
    ) -> None:
        self.state = state
        self.optimizer = optimizer
        self._inside_step = False
        self._added: set[int] = set()
        self._stashed: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]
        for param in params:
            self._handles.append(
                param.register_post_accumulate_grad_hook(self._add_residual)  # type: ignore[no-untyped-call]
            )

    def remove(self) -> None:
        """Detach every hook this object registered."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _add_residual(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: ``grad += residual`` once per step, before DDP sees it."""
        key = id(param)
        if key in self._added or param.grad is None:
            return
        self._added.add(key)
        pending = self.state.pending_residuals.pop(key, None)
        if pending is not None:
            param.grad.add_(pending.view_as(param.grad))
            return
        found = self.state.residual_views.get(key)
        if found is None:
            return
        view = found[1]
        if param.grad.data_ptr() == view.data_ptr():
            return  # the gradient accumulated into the bucket itself: g + r is there already
        param.grad.add_(view)

    def _sparse_params(self) -> list[torch.nn.Parameter]:
        return [slot.param for sent in self.state.sent for slot in sent.buffers.slots]

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._inside_step:
            return
        for param in self._sparse_params():
            view = self.state.residual_views[id(param)][1]
            grad = param.grad
            if grad is not None and grad.data_ptr() != view.data_ptr():
                self._stashed[id(param)] = grad  # DDP's copy of the bucket: reusable memory
            param.grad = None  # the bucket holds the residual, not a gradient to apply

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._inside_step:
            return
        self._added.clear()
        if not self.state.sent:
            return
        self._inside_step = True
        others = [
            (p, p.grad)
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        # own .grads go back after the loop (they hold the averaged gradient, as after dense
        # DDP); the shared scratch does not
        handed_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for p, _ in others:
                p.grad = None
            for sent in self.state.sent:
                values = sent.buffers.recv_values()
                indices = sent.buffers.recv_indices()
                for slot in sent.buffers.slots:
                    segment = slice(slot.segment, slot.segment + slot.k)
                    own = self._stashed.pop(id(slot.param), None)
                    if own is not None:  # gradient_as_bucket_view=False: no extra buffer
                        averaged = own.view(-1)
                    else:  # .grad is the bucket (the residual): the shared layer scratch
                        averaged = self.state.buffers.shared(
                            "layer", slot.numel, sent.buffers.dtype, slot.param.device
                        )
                    averaged.zero_()
                    for rank in range(sent.world_size):
                        averaged.index_add_(0, indices[rank, segment], values[rank, segment])
                    averaged.div_(sent.world_size)
                    slot.param.grad = averaged.view_as(slot.param)
                    optimizer.step()
                    slot.param.grad = None  # stepped alone: the next layer's step skips it
                    if own is not None:
                        handed_back.append((slot.param, own))

        finally:
            self._stashed.clear()
            self.state.sent.clear()
            for p, grad in (*others, *handed_back):
                p.grad = grad
            self._inside_step = False
