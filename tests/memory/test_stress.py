"""Many trial threads on one sim pool at once (ctypes releases the GIL around every pool call).

Each thread allocates on its own stream (bound to its own account), writes a pattern into its
blocks and checks it before freeing (an overlap between threads would corrupt it), frees on its own
or a neighbour's stream, and submits/finishes simulated work. Afterwards the whole trace must be
safe and the accounting must return to zero.
"""

from __future__ import annotations

import ctypes
import random
import threading

from waterwave_hpo.memory import PoolOutOfMemoryError
from waterwave_hpo.memory import StreamAwarePool
from waterwave_hpo.memory.testing import TraceChecker

KiB = 1 << 10
MiB = 1 << 20
THREADS = 8
ITERATIONS = 400
CAPACITY = 32 * MiB


def _worker(pool: StreamAwarePool, index: int, errors: list[BaseException]) -> None:
    rng = random.Random(index)
    stream = index + 1
    account = pool.open_account(f"trial-{index}", streams=(stream,))
    live: list[tuple[int, int, int]] = []  # (ptr, nbytes, pattern byte)
    try:
        for _ in range(ITERATIONS):
            op = rng.random()
            if op < 0.5 or not live:
                nbytes = rng.choice([rng.randint(1, 8 * KiB), rng.randint(8 * KiB, 2 * MiB)])
                try:
                    ptr = pool.allocate(nbytes, stream)
                except PoolOutOfMemoryError:
                    continue
                pattern = rng.randint(1, 255)
                ctypes.memset(ptr, pattern, min(nbytes, 4 * KiB))
                ctypes.memset(ptr + max(nbytes - 64, 0), pattern, min(nbytes, 64))
                live.append((ptr, nbytes, pattern))
            elif op < 0.85:
                ptr, nbytes, pattern = live.pop(rng.randrange(len(live)))
                head = ctypes.string_at(ptr, min(nbytes, 4 * KiB))
                tail = ctypes.string_at(ptr + max(nbytes - 64, 0), min(nbytes, 64))
                assert head == bytes([pattern]) * len(head), "block overwritten by another owner"
                assert tail == bytes([pattern]) * len(tail), "block overwritten by another owner"
                pool.sim.submit(stream)
                free_stream = stream if rng.random() < 0.8 else (stream % THREADS) + 1
                pool.free(ptr, free_stream)
            elif op < 0.95:
                pool.sim.finish(stream)
            else:
                pool.sim.finish_all()
        for ptr, _, _ in live:
            pool.free(ptr)
        assert account.stats().allocated_bytes == 0
    except BaseException as exc:  # reported by the main thread
        errors.append(exc)
    finally:
        account.close()


def test_many_threads_share_one_pool_safely() -> None:
    pool = StreamAwarePool(CAPACITY, backend="sim")
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_worker, args=(pool, i, errors)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    pool.sim.finish_all()
    checker = TraceChecker(CAPACITY)
    checker.feed(pool.sim.trace())
    s = pool.stats()
    assert s.allocated_bytes == 0 and checker.allocated_bytes == 0
    assert s.num_allocs == s.num_frees > THREADS * ITERATIONS // 4
    assert s.reserved_bytes == checker.reserved_bytes <= CAPACITY
    # Memory flowed between trials, not only within one.
    assert s.completed_event + s.stream_wait > 0
    pool.release_cached()
    assert pool.stats().reserved_bytes == 0
    pool.close()


def test_pytorch_path_frees_with_the_gil_held_never_wait_and_lose_nothing() -> None:
    # waterwave_torch_free is called by PyTorch from tensor deallocation with the GIL held; it
    # queues the free when the pool's mutex is held instead of waiting there.
    # ctypes.PyDLL keeps the GIL held for the call, as PyTorch does.
    from waterwave_hpo.memory._lib import library_path
    from waterwave_hpo.memory._lib import load_library

    device = 62  # a C-level slot no real device uses
    lib = load_library()
    gil_held_free = ctypes.PyDLL(str(library_path())).waterwave_torch_free
    gil_held_free.restype = None
    gil_held_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    pool = StreamAwarePool(CAPACITY * 4, backend="sim")
    lib.ww_torch_set_pool(device, pool._handle())
    errors: list[BaseException] = []

    def worker(stream: int) -> None:
        try:
            for i in range(2000):
                p = pool.allocate(512 * (1 + i % 64), stream)
                gil_held_free(p, 0, device, stream)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s + 1,)) for s in range(THREADS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        stats = pool.stats()  # drains any queued free first
        assert stats.allocated_bytes == 0
        assert stats.num_frees == stats.num_allocs == THREADS * 2000
        lock = pool.lock_stats()
        assert lock.torch_free_waits == 0  # never waited with the GIL held
        assert lock.acquisitions >= THREADS * 2000
    finally:
        lib.ww_torch_set_pool(device, None)
        pool.close()
