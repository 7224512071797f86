"""Baselines LaySA is measured against, attachable the same way.

* ``DENSE``: DDP's all-reduce (PyTorch's ``default_hooks.allreduce_hook``, identical to no
  hook, but its collective is visible to byte counters).
* ``FP16``: PyTorch's ``default_hooks.fp16_compress_hook``.
* ``POWERSGD``: PyTorch's ``powerSGD_hook.powerSGD_hook`` (rank 1 by default here, error
  feedback and warm start on, as PyTorch recommends).
* ``NAIVE_TOPK``: top-k with error feedback as usually written: a dense residual per
  parameter kept across steps, fresh buffers every step (accumulated gradient, magnitudes,
  selection, messages, a dense averaged result). Same selection rule and wire format as
  LaySA, so the two differ only in memory handling.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from waterwave_hpo import _checks
from waterwave_hpo.distributed._buffers import INDEX_DTYPE
from waterwave_hpo.distributed._buffers import k_for
from waterwave_hpo.distributed._buffers import packed_offsets
from waterwave_hpo.distributed._collectives import all_gather_then
from waterwave_hpo.distributed._collectives import all_reduce_mean
from waterwave_hpo.distributed._ledger import CommMemoryLedger
from waterwave_hpo.distributed._state import check_backend
from waterwave_hpo.distributed._state import check_density
from waterwave_hpo.distributed._state import check_process_group
from waterwave_hpo.distributed._state import register_comm_hook

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket


class Baseline(enum.Enum):
    """A gradient-communication scheme LaySA is compared with."""

    DENSE = "dense"
    FP16 = "fp16"
    POWERSGD = "powersgd"
    NAIVE_TOPK = "naive_topk"


class NaiveTopKState:
    """State of :func:`naive_topk_hook`: a dense residual per parameter, and a ledger.

    Args:
        process_group: The data-parallel group (``None``: the default group).
        density: Fraction of each layer's entries sent per step, in (0, 1].
        warmup_steps: Dense steps first (>= 1).

    Raises:
        ValueError: If ``density`` is outside (0, 1] or the backend is not gloo or nccl.
        RuntimeError: torch.distributed is not initialised or ``process_group`` was destroyed.
    """

    def __init__(
        self, process_group: dist.ProcessGroup | None, density: float, warmup_steps: int = 1
    ) -> None:
        self.density = check_density(density)
        group = check_process_group(process_group)
        check_backend(group)
        self.process_group: dist.ProcessGroup = group
        self.warmup_steps = max(1, warmup_steps)
        self.iteration = 0
        self.ledger = CommMemoryLedger()
        self.residuals: dict[int, torch.Tensor] = {}
        self.bytes_sent_last_step = 0
        self._bytes_this_step = 0

    def end_step(self) -> None:
        """Called after the last bucket of a step."""
        self.iteration += 1
        self.bytes_sent_last_step = self._bytes_this_step
        self._bytes_this_step = 0


def naive_topk_hook(
    state: NaiveTopKState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Top-k with error feedback, written the naive way (fresh buffers, dense residuals).

    Args:
        state: The residuals and the ledger.
        bucket: DDP's bucket (flat ``[N]`` buffer, per-parameter views).

    Returns:
        A future of the averaged dense gradient ``[N]`` (a new tensor DDP copies back).
    """
    group = state.process_group
    world_size = group.size()
    buffer = bucket.buffer()
    last = bucket.is_last()
    if state.density >= 1.0 or state.iteration < state.warmup_steps or world_size == 1:
        state._bytes_this_step += buffer.nbytes
        if last:
            state.end_step()
        return all_reduce_mean(buffer, group)
    ledger = state.ledger
    values: list[torch.Tensor] = []
    indices: list[torch.Tensor] = []
    shapes: list[tuple[int, int, int]] = []  # (offset, numel, k)
    for param, view in zip(bucket.parameters(), bucket.gradients(), strict=True):
        residual = state.residuals.get(id(param))
        if residual is None:
            residual = ledger.allocate(
                torch.zeros(view.numel(), dtype=view.dtype, device=view.device)
            )
        accumulated = ledger.allocate(view.flatten() + residual)
        magnitude = ledger.allocate(accumulated.abs())
        k = k_for(view.numel(), state.density)
        _, top = torch.topk(magnitude, k, sorted=False)
        ledger.allocate(top)
        values.append(ledger.allocate(accumulated[top]))
        indices.append(ledger.allocate(top.to(INDEX_DTYPE)))
        accumulated.index_fill_(0, top, 0)
        ledger.release(residual)
        state.residuals[id(param)] = accumulated  # the new residual
        ledger.release(magnitude)
        ledger.release(top)
        offset = int(view.storage_offset() - buffer.storage_offset())
        shapes.append((offset, view.numel(), k))
    total_k = sum(k for _, _, k in shapes)
    (_, index_offset), message_bytes = packed_offsets(
        [(buffer.dtype, total_k), (INDEX_DTYPE, total_k)]
    )
    value_bytes = total_k * buffer.element_size()
    index_end = index_offset + total_k * INDEX_DTYPE.itemsize
    send = ledger.allocate(torch.zeros(message_bytes, dtype=torch.uint8, device=buffer.device))
    torch.cat(values, out=send[:value_bytes].view(buffer.dtype))
    torch.cat(indices, out=send[index_offset:index_end].view(INDEX_DTYPE))
    for tensor in (*values, *indices):
        ledger.release(tensor)
    recv = ledger.allocate(
        torch.empty(world_size * send.numel(), dtype=torch.uint8, device=buffer.device)
    )
    state._bytes_this_step += send.nbytes
    if last:
        state.end_step()

    def average(_: Any) -> torch.Tensor:
        result = ledger.allocate(torch.zeros_like(buffer))
        by_rank = recv.view(world_size, -1)
        all_values = by_rank[:, :value_bytes].view(buffer.dtype)
        all_indices = by_rank[:, index_offset:index_end].view(INDEX_DTYPE)
        segment = 0
        for offset, numel, k in shapes:
            target = result[offset : offset + numel]
            for rank in range(world_size):
                target.index_add_(
                    0,
                    all_indices[rank, segment : segment + k],
                    all_values[rank, segment : segment + k],
                    alpha=1 / world_size,  # divide first, as DDP: no fp16 overflow in the sum
                )
            segment += k
        ledger.release(send)
        ledger.release(recv)
        ledger.release(result)  # DDP copies it into the gradients and drops it
        return result

    return all_gather_then(recv, send, group, average)


def attach_baseline(
    ddp_model: DistributedDataParallel,
    baseline: Baseline,
    *,
    density: float = 0.01,
    powersgd_rank: int = 1,
    warmup_steps: int = 1,
    process_group: dist.ProcessGroup | None = None,
) -> NaiveTopKState | powerSGD_hook.PowerSGDState | None:
    """Register ``baseline``'s comm hook on ``ddp_model``.

    Args:
        ddp_model: The DDP model.
        baseline: Which scheme.
        density: ``NAIVE_TOPK`` only: fraction of entries sent.
        powersgd_rank: ``POWERSGD`` only: the matrix approximation rank.
        warmup_steps: ``NAIVE_TOPK`` and ``POWERSGD``: dense steps first (PowerSGD needs >= 2,
            so it takes ``max(2, warmup_steps)``).
        process_group: The group (``None``: default).

    Returns:
        The hook's state (``NaiveTopKState``, ``PowerSGDState``) or ``None`` for the stateless
        hooks.

    Raises:
        TypeError: If ``baseline`` is not a :class:`Baseline`, or ``process_group`` not a
            ``ProcessGroup``.
        RuntimeError: torch.distributed is not initialised or ``process_group`` was destroyed.
    """
    if not isinstance(baseline, Baseline):
        raise _checks.type_error(
            "baseline", baseline, "a Baseline", f"pass one of {[b.name for b in Baseline]}"
        )
    group = check_process_group(process_group)
    if baseline is Baseline.DENSE:
        register_comm_hook(ddp_model, group, default_hooks.allreduce_hook, "dense")
        return None
    if baseline is Baseline.FP16:
        register_comm_hook(ddp_model, group, default_hooks.fp16_compress_hook, "FP16")
        return None
    if baseline is Baseline.POWERSGD:
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=max(2, warmup_steps),
            min_compression_rate=1,
        )
        register_comm_hook(ddp_model, state, powerSGD_hook.powerSGD_hook, "PowerSGD")
        return state
    naive = NaiveTopKState(group, density, warmup_steps)
    register_comm_hook(ddp_model, naive, naive_topk_hook, "naive top-k")
    return naive


# DDP's register_comm_hook checks the annotations by identity (see _hook.py).
naive_topk_hook.__annotations__.update(
    state=NaiveTopKState,
    bucket=dist.GradBucket,  # type: ignore[attr-defined]
    **{"return": torch.futures.Future[torch.Tensor]},
)
