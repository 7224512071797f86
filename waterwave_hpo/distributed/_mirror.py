"""The mirror weight update (LaySA).

The mirror weight update: the optimizer steps on the averaged sparse gradient, while the
gradient bucket keeps the error-feedback residual.

LaySA's conflict (IEEE Access 2021): with error feedback, a layer's gradient memory is needed
twice after communication, once for the averaged gradient the weight update consumes and once
for the residual the next step adds back; naive top-k resolves it with one more dense copy per
layer. LaySA's mirror weight update applies the weight update from the exchanged sparse
gradient, so the gradient memory can keep the residual.

Ours, to fit any ``torch.optim.Optimizer`` (SGD, momentum, Adam, weight decay...): when
``optimizer.step()`` starts, each sparse layer's averaged gradient is scattered from the
received (values, indices) into gradient memory the optimizer then steps on; the bucket (the
residual) is never seen by the optimizer. Where DDP keeps ``.grad`` apart from its bucket
(``gradient_as_bucket_view=False``, DDP's default), that memory is the parameter's own
``.grad`` and the user's step applies every layer at once: no extra memory at all. Where
``.grad`` *is* the bucket (``gradient_as_bucket_view=True``), each such layer is stepped alone
after the user's step through one shared scratch the size of the largest layer (LaySA's
layer-centric reuse), and its ``.grad`` is left ``None``, so the user's ``zero_grad()`` (either
mode) cannot touch the residual. On the next backward a post-accumulate-grad hook adds the
residual to the fresh gradient before DDP copies it into the bucket.

Between ``backward()`` and ``step()`` a sparse layer's ``.grad`` holds DDP's copy of the
residual, not the averaged gradient: clip or inspect gradients inside the optimizer (or at
``density=1``), not in that window.

Precision: the residual stays in the gradient's dtype (DDP's bucket), as PyTorch's PowerSGD
keeps its error feedback in the bucket's dtype. A model whose parameters are bf16 or fp16
therefore accumulates ``g + r`` in that dtype, where a gradient entry far below the residual's
magnitude rounds away (bf16 keeps 8 significant bits); under ``torch.autocast`` the parameters
and gradients are fp32 and nothing is lost. The averaged gradient divides each rank's values
before summing them (as DDP does), so fp16 gradients whose sum would overflow do not.

Limits: ``optimizer.step(closure)`` (e.g. LBFGS) is not supported for sparse layers; with
``gradient_as_bucket_view=True`` the optimizer is called once more per sparse layer per step.
"""

from __future__ import annotations

from typing import Any

import torch

from waterwave_hpo.distributed._buffers import LayerSlot
from waterwave_hpo.distributed._state import LaySAState
from waterwave_hpo.distributed._state import SentBucket


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
        self._deferred: list[tuple[SentBucket, LayerSlot]] = []
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

    @staticmethod
    def _average_into(out: torch.Tensor, sent: SentBucket, slot: LayerSlot) -> None:
        """``out`` (``[numel]``) <- the layer's averaged sparse gradient over all ranks.

        Each rank's values are scaled by ``1 / world_size`` before they are summed, as DDP
        divides before its all-reduce: in fp16 the sum of the ranks' values could overflow
        (``inf``) where their mean does not.
        """
        values = sent.buffers.recv_values()
        indices = sent.buffers.recv_indices()
        segment = slice(slot.segment, slot.segment + slot.k)
        out.zero_()
        for rank in range(sent.world_size):
            out.index_add_(
                0, indices[rank, segment], values[rank, segment], alpha=1 / sent.world_size
            )

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._inside_step:
            return
        for sent in self.state.sent:
            for slot in sent.buffers.slots:
                param = slot.param
                view = self.state.residual_views[id(param)][1]
                grad = param.grad
                if grad is not None and grad.is_contiguous() and grad.data_ptr() != view.data_ptr():
                    # DDP keeps .grad apart from its bucket (its default): the averaged
                    # gradient goes there and this very step applies it with every layer
                    self._average_into(grad.view(-1), sent, slot)
                else:
                    param.grad = None  # .grad is the bucket (the residual): after the step
                    self._deferred.append((sent, slot))
        self.state.sent.clear()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._inside_step:
            return
        self._added.clear()
        if not self._deferred:
            return
        self._inside_step = True
        others = [
            (p, p.grad)
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        try:
            for p, _ in others:
                p.grad = None  # stepped already
            for sent, slot in self._deferred:
                averaged = self.state.buffers.shared(
                    "layer", slot.numel, sent.buffers.dtype, slot.param.device
                )
                self._average_into(averaged, sent, slot)
                slot.param.grad = averaged.view_as(slot.param)
                optimizer.step()  # this layer alone
                slot.param.grad = None  # the scratch is the next layer's
        finally:
            self._deferred.clear()
            for p, grad in others:
                p.grad = grad
            self._inside_step = False
