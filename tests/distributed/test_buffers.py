"""LaySA's packed messages: every typed view of the byte buffers works for any dtype and k."""

from __future__ import annotations

import itertools

import pytest
import torch

from waterwave_hpo.distributed._buffers import INDEX_DTYPE
from waterwave_hpo.distributed._buffers import BucketBuffers
from waterwave_hpo.distributed._buffers import LayerCentricBuffers
from waterwave_hpo.distributed._buffers import LayerSlot
from waterwave_hpo.distributed._buffers import packed_offsets
from waterwave_hpo.distributed._ledger import CommMemoryLedger

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _slots(ks: tuple[int, ...], dtype: torch.dtype) -> list[LayerSlot]:
    slots, offset, segment = [], 0, 0
    for k in ks:
        numel = 4 * k + 1
        param = torch.nn.Parameter(torch.zeros(numel, dtype=dtype))
        slots.append(LayerSlot(param, offset, numel, k, segment))
        offset += numel
        segment += k
    return slots


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ks", [(1,), (3,), (2, 3), (61, 134, 6, 1)])
@pytest.mark.parametrize("world_size", [2, 3])
def test_send_and_receive_views_round_trip_values_and_indices_for_any_dtype_and_k(
    dtype: torch.dtype, ks: tuple[int, ...], world_size: int
) -> None:
    ledger = CommMemoryLedger()
    buffers = BucketBuffers(_slots(ks, dtype), dtype, torch.device("cpu"), world_size, ledger)
    total = sum(ks)
    values = torch.arange(total).to(dtype) - 7
    indices = torch.arange(total, dtype=INDEX_DTYPE) * 3 + 1
    buffers.send_values().copy_(values)
    buffers.send_indices().copy_(indices)
    # what all_gather_into_tensor does: every rank's message, rank-major
    buffers.recv.copy_(buffers.send.repeat(world_size))
    assert buffers.send_values().dtype == dtype
    assert buffers.recv_values().shape == buffers.recv_indices().shape == (world_size, total)
    for rank in range(world_size):
        assert torch.equal(buffers.recv_values()[rank], values)
        assert torch.equal(buffers.recv_indices()[rank], indices)
    # every byte is counted, padding included, and padding is below one index's width
    assert ledger.current_bytes == buffers.send.nbytes * (1 + world_size)
    assert buffers.send.nbytes - total * (dtype.itemsize + 4) < max(dtype.itemsize, 4)


def test_packed_offsets_align_every_region_and_the_total() -> None:
    pairs = itertools.permutations((*DTYPES, INDEX_DTYPE), 2)
    for (a, b), n, m in itertools.product(pairs, range(4), range(4)):
        (first, second), total = packed_offsets([(a, n), (b, m)])
        assert first == 0
        assert second % b.itemsize == 0 and second >= n * a.itemsize
        assert total % max(a.itemsize, b.itemsize) == 0 and total >= second + m * b.itemsize
    assert packed_offsets([(torch.float32, 5), (INDEX_DTYPE, 5)]) == ([0, 20], 40)  # no padding
    assert packed_offsets([(torch.bfloat16, 5), (INDEX_DTYPE, 5)]) == ([0, 12], 32)


def test_shared_buffers_are_reused_across_dtypes_without_reallocating() -> None:
    ledger = CommMemoryLedger()
    shared = LayerCentricBuffers(ledger)
    wide = shared.shared("magnitude", 100, torch.float32, torch.device("cpu"))
    held = ledger.current_bytes
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.bfloat16):
        view = shared.shared("magnitude", 100, dtype, torch.device("cpu"))
        assert view.dtype == dtype and view.numel() == 100
        assert view.untyped_storage().data_ptr() == wide.untyped_storage().data_ptr()
    assert ledger.current_bytes == ledger.peak_bytes == held == 400
