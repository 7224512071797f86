"""The LaySA DDP communication hook: per-layer top-k with error feedback, sparse all-gather.

Which parts are LaySA's (IEEE Access 2021, "Bridging the Gap Between Memory and Communication
Efficiency on Distributed Deep Learning Systems") and which are ours:

* LaySA's: per-layer top-k sparsification with error feedback; layer-centric reuse of the
  buffers this needs; the mirror weight update so that weight gradients need no separate
  residual copy.
* Ours: the realisation as a ``DistributedDataParallel`` comm hook on ``GradBucket`` (one
  packed all-gather of (values, int32 indices) per bucket, fixed per-bucket message layout,
  the residual kept in DDP's own bucket between steps, dense warm-up, the exact byte ledger,
  the checkpoint format after ``PowerSGDState``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import cast
import warnings

import torch
import torch.distributed as dist

from waterwave_hpo.distributed._buffers import LayerSlot
from waterwave_hpo.distributed._buffers import k_for
from waterwave_hpo.distributed._collectives import all_gather_then
from waterwave_hpo.distributed._collectives import all_reduce_mean
from waterwave_hpo.distributed._collectives import completed
from waterwave_hpo.distributed._state import LaySAState
from waterwave_hpo.distributed._state import SentBucket

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket


def _slots(state: LaySAState, bucket: GradBucket) -> list[LayerSlot]:
    buffer = bucket.buffer()
    slots = []
    segment = 0
    for param, view in zip(bucket.parameters(), bucket.gradients(), strict=True):
        offset = int(view.storage_offset() - buffer.storage_offset())
        numel = view.numel()
        k = k_for(numel, state.density)
        slots.append(LayerSlot(cast(torch.nn.Parameter, param), offset, numel, k, segment))
        segment += k
    return slots


def laysa_hook(state: LaySAState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Communicate one bucket's gradients sparsely: top-k per layer, error feedback.

    Dense steps (warm-up, or ``density == 1``) all-reduce the bucket and average it in place,
    exactly as DDP's default. Sparse steps, per layer (parameter) of the bucket:

    1. the bucket already holds ``g + r`` (this step's gradient plus the residual the
       mirror update added on accumulation);
    2. ``k = max(1, floor(density * numel))`` entries of largest magnitude are selected
       (chunk by chunk, in shared buffers) and packed into the bucket's send buffer
       (values, int32 indices);
    3. the sent entries are zeroed in the bucket, which leaves exactly the new residual there.

    One ``all_gather_into_tensor`` per bucket exchanges the packed messages. The returned
    future holds the bucket itself (the residual): the averaged sparse gradient is applied by
    the mirror weight update (:class:`MirrorWeightUpdate`) at ``optimizer.step()``. A group of
    one process warns once and returns the gradient unchanged (dense).

    Args:
        state: The hook's state (settings, buffers, residual bookkeeping).
        bucket: DDP's bucket; ``bucket.buffer()`` is a flat tensor ``[N]`` of the bucket's
            gradients, ``bucket.gradients()`` views of it, one per parameter.

    Returns:
        A future of the tensor DDP writes back to the parameters' gradients.
    """
    group = state.process_group
    world_size = group.size()
    buffer = bucket.buffer()
    if world_size == 1:
        if not state.warned_single_process:
            state.warned_single_process = True
            warnings.warn(
                "LaySA: the process group has one process, so there is nothing to communicate; "
                "training runs dense (every gradient applied as computed).",
                RuntimeWarning,
                stacklevel=2,
            )
        if bucket.is_last():
            state.end_step()
        return completed(buffer)

    if state.is_dense_step():
        for param in bucket.parameters():
            state.residual_views.pop(id(param), None)
        state.count_sent(buffer.nbytes)
        if bucket.is_last():
            state.end_step()
        return all_reduce_mean(buffer, group)

    slots = _slots(state, bucket)
    buffers = state.buffers.for_bucket(
        bucket.index(), slots, buffer.dtype, buffer.device, world_size
    )
    send_values = buffers.send_values()
    send_indices = buffers.send_indices()
    for slot, view in zip(slots, bucket.gradients(), strict=True):
        flat = buffer[slot.offset : slot.offset + slot.numel]
        top_indices = state.buffers.select_top_k(flat, slot.k)
        segment = slice(slot.segment, slot.segment + slot.k)
        torch.index_select(flat, 0, top_indices, out=send_values[segment])
        send_indices[segment].copy_(top_indices)
        flat.index_fill_(0, top_indices, 0)  # what was not sent stays: the residual
        state.residual_views[id(slot.param)] = (slot.param, view)
    state.sent.append(SentBucket(buffers, world_size))
    state.count_sent(buffers.send.nbytes)
    if bucket.is_last():
        state.end_step()
    return all_gather_then(buffers.recv, buffers.send, group, lambda _: buffer)


# DDP's register_comm_hook checks the annotations by identity; with postponed evaluation
# (``from __future__ import annotations``) they are strings, so give it the real objects.
laysa_hook.__annotations__.update(
    state=LaySAState,
    bucket=dist.GradBucket,  # type: ignore[attr-defined]
    **{"return": torch.futures.Future[torch.Tensor]},
)
