"""The collectives the hooks call, as futures of tensors (DDP's comm-hook return type)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import cast

import torch
import torch.distributed as dist


def completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future already holding ``tensor``."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def all_reduce_mean(
    buffer: torch.Tensor, group: dist.ProcessGroup
) -> torch.futures.Future[torch.Tensor]:
    """Average ``buffer`` (any shape) over ``group`` in place, as DDP's ``allreduce_hook``.

    Divides first (no overflow in low precision), then all-reduces asynchronously.
    """
    buffer.div_(group.size())
    work = dist.all_reduce(buffer, group=group, async_op=True)
    assert work is not None  # async_op=True
    return cast(
        "torch.futures.Future[torch.Tensor]",
        work.get_future().then(lambda fut: fut.value()[0]),
    )


def all_gather_then(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    then: Callable[[Any], torch.Tensor],
) -> torch.futures.Future[torch.Tensor]:
    """Gather every rank's ``input`` into ``output``, asynchronously.

    Gather every rank's ``input`` (``[n]``) into ``output`` (``[world_size * n]``, rank-major),
    asynchronously, then run ``then`` on the completed future.

    Uses ``dist.all_gather_single`` where it exists (torch >= 2.13), else
    ``dist.all_gather_into_tensor``.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(output, input, group=group, async_op=True)
    assert work is not None  # async_op=True returns a Work (typed Work | None from torch 2.15)
    return cast("torch.futures.Future[torch.Tensor]", work.get_future().then(then))
