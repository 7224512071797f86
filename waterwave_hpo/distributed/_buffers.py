"""Layer-centric buffer reuse for sparse gradient communication (LaySA, IEEE Access 2021).

LaySA's observation: top-k compression with error feedback "balloons" memory when every
step allocates fresh residual, selection, send and receive buffers per layer. Its answer is
layer-centric reuse: the buffers a layer needs are used one layer at a time and handed to the
next layer. Here (our realisation for DDP's comm hooks):

* one *magnitude chunk* (``|g|`` of at most ``SELECTION_CHUNK_ELEMENTS`` entries) and one set
  of top-k candidates sized to the largest layer's ``k``, shared by every layer and bucket:
  top-k is taken chunk by chunk and merged (exact), so no buffer scales with the layer;
* per bucket, one packed send buffer and one receive buffer of fixed size (a layer's ``k``
  is fixed by its size and the density, so the layout never changes), allocated once and
  reused every step.

The error-feedback residual needs no buffer of its own: it stays in DDP's gradient bucket
(see ``_mirror.py``). All buffers are counted exactly in a :class:`CommMemoryLedger`.
"""

from __future__ import annotations

from dataclasses import dataclass
import math

import torch

from waterwave_hpo.distributed._ledger import CommMemoryLedger

SELECTION_CHUNK_ELEMENTS = 1 << 14
"""Elements of the magnitude chunk top-k selection works in (64 KiB in fp32, 32 KiB in bf16)."""

INDEX_DTYPE = torch.int32
"""Indices on the wire: int32 (a layer's offset fits; half of int64's bytes)."""


def k_for(numel: int, density: float) -> int:
    """Number of entries a layer of ``numel`` elements sends at ``density`` (at least 1).

    Args:
        numel: Elements in the layer's gradient.
        density: Fraction of entries sent, in (0, 1].

    Returns:
        ``max(1, floor(density * numel))``, capped at ``numel``.
    """
    return min(numel, max(1, math.floor(density * numel)))


@dataclass(frozen=True)
class LayerSlot:
    """Where one layer (parameter) lives in its bucket and in the bucket's packed messages.

    Attributes:
        param: The parameter.
        offset: Element offset of the parameter's gradient in the bucket buffer.
        numel: Elements of the parameter.
        k: Entries the layer sends per step.
        segment: Offset of the layer's ``k`` entries in the bucket's message.
    """

    param: torch.nn.Parameter
    offset: int
    numel: int
    k: int
    segment: int


def packed_offsets(regions: list[tuple[torch.dtype, int]]) -> tuple[list[int], int]:
    """Byte offsets of typed regions packed in one byte buffer, each aligned to its dtype.

    A typed view of a byte buffer (``buffer[a:b].view(dtype)``) needs its byte offset to be a
    multiple of ``dtype.itemsize`` (PyTorch refuses otherwise, and a GPU kernel reading the
    dtype needs that alignment). Each region starts at the first multiple of its itemsize after
    the previous one ends; the total is rounded up to the largest itemsize, so the rows of a
    ``[world_size, total]`` receive buffer are aligned too. Padding is at most
    ``itemsize - 1`` bytes per region (none for fp32 values with int32 indices).

    Args:
        regions: ``(dtype, elements)`` per region, in order.

    Returns:
        The byte offset of each region and the packed size in bytes.
    """
    offsets = []
    end = 0
    widest = 1
    for dtype, numel in regions:
        size = dtype.itemsize
        widest = max(widest, size)
        start = -(-end // size) * size
        offsets.append(start)
        end = start + numel * size
    return offsets, -(-end // widest) * widest


class BucketBuffers:
    """The fixed send and receive buffers of one DDP bucket.

    A message is ``K`` values (the gradient dtype) followed by ``K`` int32 indices, packed in
    one uint8 buffer so one ``all_gather_into_tensor`` moves both; the indices start at the
    first multiple of 4 bytes after the values (:func:`packed_offsets`: with 2-byte bf16/fp16
    values and an odd ``K`` that is 2 bytes of padding). Shapes: ``send`` is
    ``[message_bytes]``, ``recv`` is ``[world_size * message_bytes]`` (flat for gloo),
    rank-major, with ``message_bytes >= K * (value_bytes + 4)``.
    """

    def __init__(
        self,
        slots: list[LayerSlot],
        dtype: torch.dtype,
        device: torch.device,
        world_size: int,
        ledger: CommMemoryLedger,
    ) -> None:
        self.slots = slots
        self.dtype = dtype
        self.total_k = sum(s.k for s in slots)
        (_, self._index_offset), message_bytes = packed_offsets(
            [(dtype, self.total_k), (INDEX_DTYPE, self.total_k)]
        )
        self._value_bytes_total = self.total_k * dtype.itemsize
        self._index_bytes_total = self.total_k * INDEX_DTYPE.itemsize
        self.send = ledger.allocate(torch.empty(message_bytes, dtype=torch.uint8, device=device))
        self.recv = ledger.allocate(
            torch.empty(world_size * message_bytes, dtype=torch.uint8, device=device)
        )
        self._by_rank = self.recv.view(world_size, message_bytes)
        self.param_ids = tuple(id(s.param) for s in slots)

    def _indices(self, message: torch.Tensor) -> torch.Tensor:
        return message[..., self._index_offset : self._index_offset + self._index_bytes_total]

    def send_values(self) -> torch.Tensor:
        """The send buffer's values, shape ``[K]``, the gradient dtype (a view)."""
        return self.send[: self._value_bytes_total].view(self.dtype)

    def send_indices(self) -> torch.Tensor:
        """The send buffer's indices, shape ``[K]``, int32 (a view)."""
        return self._indices(self.send).view(INDEX_DTYPE)

    def recv_values(self) -> torch.Tensor:
        """Every rank's values, shape ``[world_size, K]`` (a view)."""
        return self._by_rank[:, : self._value_bytes_total].view(self.dtype)

    def recv_indices(self) -> torch.Tensor:
        """Every rank's indices, shape ``[world_size, K]``, int32 (a view)."""
        return self._indices(self._by_rank).view(INDEX_DTYPE)

    def release(self, ledger: CommMemoryLedger) -> None:
        """Give both buffers back to the ledger."""
        ledger.release(self.send)
        ledger.release(self.recv)


class LayerCentricBuffers:
    """Every buffer the LaySA hook uses, allocated once and reused layer by layer.

    Shared by all layers and buckets (grow-only, so they are allocated in the first sparse
    step and then constant): the magnitude chunk ``[min(chunk, largest layer)]``, the top-k
    candidates ``[2 * k_max]`` (values and int64 indices), the top-k result ``[k_max]`` and a
    gather buffer ``[k_max]``; and, only where a parameter's ``.grad`` *is* its bucket view
    (``gradient_as_bucket_view=True``), a layer scratch ``[largest layer]`` for the mirror
    weight update. Per bucket: its send and receive buffers (:class:`BucketBuffers`).

    Args:
        ledger: Where the bytes are counted.
        chunk_elements: Elements of the magnitude chunk; top-k of a larger layer is taken
            chunk by chunk and merged (exact: the layer's top k are among the chunks' top k).
    """

    def __init__(self, ledger: CommMemoryLedger, chunk_elements: int = SELECTION_CHUNK_ELEMENTS):
        self.ledger = ledger
        self.chunk_elements = chunk_elements
        self.buckets: dict[int, BucketBuffers] = {}
        self._shared: dict[str, torch.Tensor] = {}

    def for_bucket(
        self,
        index: int,
        slots: list[LayerSlot],
        dtype: torch.dtype,
        device: torch.device,
        world_size: int,
    ) -> BucketBuffers:
        """The buffers of bucket ``index``; (re)allocated only when its layout changes.

        DDP rebuilds its buckets once after the first iteration; a changed parameter list
        frees the old buffers first.
        """
        ids = tuple(id(s.param) for s in slots)
        found = self.buckets.get(index)
        if found is not None and found.param_ids == ids and found.dtype == dtype:
            return found
        if found is not None:
            found.release(self.ledger)
        buffers = BucketBuffers(slots, dtype, device, world_size, self.ledger)
        self.buckets[index] = buffers
        return buffers

    def shared(
        self, name: str, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The first ``numel`` elements of the shared buffer ``name``, as ``dtype`` (a view).

        Each shared buffer is bytes, grown (never shrunk) to the largest request, and viewed
        as the requested dtype from byte 0 (aligned for any dtype), so the buckets of a model
        mixing dtypes (DDP buckets by dtype: e.g. bf16 weights with fp32 norms) reuse one
        buffer instead of reallocating it at every change of dtype.
        """
        nbytes = numel * dtype.itemsize
        found = self._shared.get(name)
        if found is None or found.numel() < nbytes:
            if found is not None:
                self.ledger.release(found)
            found = self.ledger.allocate(torch.empty(nbytes, dtype=torch.uint8, device=device))
            self._shared[name] = found
        return found[:nbytes].view(dtype)

    def select_top_k(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Indices of the ``k`` entries of largest magnitude of ``flat`` (``[n]`` -> ``[k]``).

        Exact (up to ties), with memory ``O(chunk + k)`` instead of ``O(n)``: each chunk's
        top k is merged into a running top k. Returns a view of a shared int64 buffer, valid
        until the next call.
        """
        n, dtype, device = flat.numel(), flat.dtype, flat.device
        chunk = min(self.chunk_elements, n)
        magnitude = self.shared("magnitude", chunk, dtype, device)
        top_values = self.shared("top_values", k, dtype, device)
        top_indices = self.shared("top_indices", k, torch.int64, device)
        if n <= chunk:
            torch.abs(flat, out=magnitude[:n])
            torch.topk(magnitude[:n], k, sorted=False, out=(top_values, top_indices))
            return top_indices
        cand_values = self.shared("candidate_values", 2 * k, dtype, device)
        cand_indices = self.shared("candidate_indices", 2 * k, torch.int64, device)
        gathered = self.shared("gathered", k, torch.int64, device)
        filled = 0
        for start in range(0, n, chunk):
            size = min(chunk, n - start)
            take = min(k, size)
            torch.abs(flat[start : start + size], out=magnitude[:size])
            torch.topk(
                magnitude[:size],
                take,
                sorted=False,
                out=(cand_values[filled : filled + take], cand_indices[filled : filled + take]),
            )
            cand_indices[filled : filled + take].add_(start)
            filled += take
            if filled > k:  # merge down to the running top k
                torch.topk(cand_values[:filled], k, sorted=False, out=(top_values, top_indices))
                torch.index_select(cand_indices[:filled], 0, top_indices, out=gathered)
                cand_values[:k].copy_(top_values)
                cand_indices[:k].copy_(gathered)
                filled = k
        top_indices.copy_(cand_indices[:k])
        return top_indices
