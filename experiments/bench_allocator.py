"""Benchmark of the stream-aware pool against the allocators it must beat, side by side, one GPU.

On CUDA, each allocator runs in its own subprocess of this script (an allocator is chosen once per
process, before CUDA's first allocation), one after another on the same GPU:

* ``torch-native``: PyTorch's caching allocator (never reuses a block across streams);
* ``torch-async``: PyTorch with ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``;
* ``cupy-pool``: CuPy's MemoryPool (a CuPy workload: latency only), if CuPy is installed;
* ``rmm-pool``: RMM's pool through ``rmm_torch_allocator``, if RMM is installed;
* ``waterwave``: ours (``waterwave_hpo.memory.use_pool``).

Measured: alloc+free latency (median, p99, microseconds) over a realistic size mix, and K = 1, 2,
4, 8 co-hosted training loops (one thread and one stream each; a small CNN and a small
transformer): aggregate throughput (samples/s) and peak reserved bytes (the allocator's own figure
where it has one, and the device's used memory sampled every 2 ms).

Without CUDA the same script runs the ``sim`` backend of our pool only, and says so: latency of the
C++ bookkeeping through ctypes, and K co-hosted synthetic training loops (allocation patterns of
forward/backward on the simulated device), with peak reserved bytes and cross-stream reuse counts.
These are not GPU numbers.

Usage::

    python experiments/bench_allocator.py [--quick] [--out experiments/results]

Writes ``bench_allocator-<utc time>.json`` and ``.md`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
from pathlib import Path
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

KiB = 1 << 10
MiB = 1 << 20
KS = (1, 2, 4, 8)
CONFIGS = ("torch-native", "torch-async", "cupy-pool", "rmm-pool", "waterwave")


def size_mix(n: int, seed: int = 0) -> list[int]:
    """A realistic training size mix (bytes): many small (bias, norms), activations, some large."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.45:
            out.append(rng.randint(1, 64) * 512)  # <= 32 KiB: biases, norm stats, scalars
        elif r < 0.85:
            out.append(rng.randint(64 * KiB, 4 * MiB) // 512 * 512)  # activations, weights
        else:
            out.append(rng.randint(4 * MiB, 64 * MiB) // 512 * 512)  # large activations
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# -- CUDA workers (one allocator per process) ------------------------------------------------


class DevicePeak:
    """Samples the device's used memory (bytes) every 2 ms in a thread; keeps the peak."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        free, total = torch.cuda.mem_get_info()
        self.baseline = total - free
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            free, total = self._torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(0.002)

    def __enter__(self) -> DevicePeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _models(kind: str) -> tuple[Any, Any, int]:
    """A fresh (model, batch maker, batch size) for a CNN or a transformer on CUDA."""
    import torch
    from torch import nn

    if kind == "cnn":
        model = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.Conv2d(64, 128, 3, padding=1, stride=2),
            nn.BatchNorm2d(128),
            nn.ReLU(),
            nn.Conv2d(128, 256, 3, padding=1, stride=2),
            nn.BatchNorm2d(256),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(256, 10),
        ).cuda()
        batch = 128

        def make(g: Any) -> tuple[Any, Any]:
            return (
                torch.randn(batch, 3, 32, 32, device="cuda", generator=g),
                torch.randint(0, 10, (batch,), device="cuda", generator=g),
            )
    else:
        layer = nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True)
        model = nn.Sequential(nn.TransformerEncoder(layer, 4), nn.Flatten(), nn.LazyLinear(10))
        model = model.cuda()
        batch = 32

        def make(g: Any) -> tuple[Any, Any]:
            return (
                torch.randn(batch, 64, 256, device="cuda", generator=g),
                torch.randint(0, 10, (batch,), device="cuda", generator=g),
            )

    return model, make, batch


def _train_k(kind: str, k: int, steps: int) -> float:
    """Runs k training loops at once (a thread and a stream each); returns samples per second."""
    import torch

    streams = [torch.cuda.Stream() for _ in range(k)]
    barrier = threading.Barrier(k + 1)
    counts = [0] * k
    errors: list[BaseException] = []

    def loop(i: int) -> None:
        try:
            with torch.cuda.stream(streams[i]):
                g = torch.Generator(device="cuda").manual_seed(i)
                model, make, batch = _models(kind)
                x, y = make(g)
                model(x)  # materialize lazy layers
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
                barrier.wait()
                for _ in range(steps):
                    x, y = make(g)
                    opt.zero_grad(set_to_none=True)
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                    counts[i] += batch
                streams[i].synchronize()
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(k)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return sum(counts) / elapsed


def worker(config: str, quick: bool) -> dict[str, Any]:
    """Runs one allocator's measurements in this process; returns a JSON-able dict."""
    sizes = size_mix(2000 if quick else 20000)
    result: dict[str, Any] = {"config": config}
    if config == "cupy-pool":
        import cupy

        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
        lat = []
        for n in sizes[:200]:
            del_ = cupy.empty(n, dtype=cupy.uint8)
            del del_
        for n in sizes:
            t0 = time.perf_counter_ns()
            a = cupy.empty(n, dtype=cupy.uint8)
            del a
            lat.append((time.perf_counter_ns() - t0) / 1000)
        result["latency_us"] = {"median": statistics.median(lat), "p99": percentile(lat, 0.99)}
        result["peak_reserved_bytes"] = cupy.get_default_memory_pool().total_bytes()
        return result

    import torch

    pool = None
    if config == "waterwave":
        import waterwave_hpo.memory as wm

        pool = wm.StreamAwarePool(backend="cuda")
        wm.use_pool(pool)
    elif config == "rmm-pool":
        import rmm
        from rmm.allocators.torch import rmm_torch_allocator

        rmm.reinitialize(pool_allocator=True)
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)

    def reserved_peak() -> int | None:
        if pool is not None:
            return pool.stats().peak_reserved_bytes
        if config in ("torch-native", "torch-async"):
            try:
                return int(torch.cuda.max_memory_reserved())
            except RuntimeError:
                return None
        return None

    def reset_peak() -> None:
        if pool is not None:
            pool.release_cached()
            pool.reset_peaks()
        elif config in ("torch-native", "torch-async"):
            torch.cuda.empty_cache()
            try:
                torch.cuda.reset_peak_memory_stats()
            except RuntimeError:
                pass

    for n in sizes[:200]:  # warm up the cache
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        del x
    lat = []
    for n in sizes:
        t0 = time.perf_counter_ns()
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        del x
        lat.append((time.perf_counter_ns() - t0) / 1000)
    result["latency_us"] = {"median": statistics.median(lat), "p99": percentile(lat, 0.99)}

    steps = 10 if quick else 50
    runs = []
    for kind in ("cnn", "transformer"):
        for k in KS:
            reset_peak()
            torch.cuda.synchronize()
            with DevicePeak() as dev:
                throughput = _train_k(kind, k, steps)
            runs.append(
                {
                    "model": kind,
                    "k": k,
                    "samples_per_s": throughput,
                    "peak_reserved_bytes": reserved_peak(),
                    "device_peak_used_bytes": dev.peak - dev.baseline,
                }
            )
    result["training"] = runs
    if pool is not None:
        s = pool.stats()
        result["pool"] = dataclasses.asdict(s)
    return result


def run_cuda(quick: bool) -> list[dict[str, Any]]:
    results = []
    for config in CONFIGS:
        env = dict(os.environ)
        if config == "torch-async":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
        else:
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        cmd = [sys.executable, __file__, "--worker", config] + (["--quick"] if quick else [])
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["?"])[-1]
            print(f"[{config}] skipped: {tail}", file=sys.stderr)
            results.append({"config": config, "skipped": tail})
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results


# -- sim backend (no GPU) ---------------------------------------------------------------------


def run_sim(quick: bool) -> list[dict[str, Any]]:
    import waterwave_hpo.memory as wm

    sizes = size_mix(2000 if quick else 50000)
    pool = wm.StreamAwarePool(4 << 30, backend="sim")
    for n in sizes[:200]:
        pool.free(pool.allocate(n, 1))
    lat = []
    for n in sizes:
        t0 = time.perf_counter_ns()
        p = pool.allocate(n, 1)
        pool.free(p)
        lat.append((time.perf_counter_ns() - t0) / 1000)
    pool.close()
    result: dict[str, Any] = {
        "config": "waterwave (sim backend, no GPU)",
        "latency_us": {"median": statistics.median(lat), "p99": percentile(lat, 0.99)},
    }

    # K synthetic training loops: each step allocates a forward "activation stack" and frees it
    # in reverse in backward, with simulated kernels queued on its stream.
    layers = {
        "cnn": [4 * MiB, 4 * MiB, 2 * MiB, 1 * MiB, 256 * KiB, 16 * KiB],
        "transformer": [8 * MiB, 2 * MiB, 2 * MiB, 8 * MiB, 512 * KiB] * 4,
    }
    steps = 20 if quick else 200
    runs = []
    for kind, acts in layers.items():
        for k in KS:
            pool = wm.StreamAwarePool(4 << 30, backend="sim")
            errors: list[BaseException] = []

            def loop(
                stream: int,
                acts: list[int] = acts,
                pool: Any = pool,
                errors: list[BaseException] = errors,
            ) -> None:
                try:
                    for _ in range(steps):
                        live = []
                        for n in acts:
                            live.append(pool.allocate(n, stream))
                            pool.sim.submit(stream)
                        for p in reversed(live):
                            pool.sim.submit(stream)
                            pool.free(p, stream)
                        if stream % 2 == 0:
                            pool.sim.finish(stream)
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=loop, args=(s + 1,)) for s in range(k)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - t0
            if errors:
                raise errors[0]
            s = pool.stats()
            runs.append(
                {
                    "model": f"{kind} (synthetic)",
                    "k": k,
                    "steps_per_s": k * steps / elapsed,
                    "peak_reserved_bytes": s.peak_reserved_bytes,
                    "same_stream": s.same_stream,
                    "completed_event": s.completed_event,
                    "stream_wait": s.stream_wait,
                    "new_segment": s.new_segment,
                }
            )
            pool.close()
    result["training"] = runs
    return [result]


def run_contention(threads: int, ops_per_thread: int, *, blocking_free: bool) -> dict[str, Any]:
    """The pool's mutex under K trial threads through PyTorch's entry points.

    Each thread allocates with ``waterwave_torch_try_malloc`` (ctypes releases the GIL, as
    PyTorch's ops do) and frees with ``waterwave_torch_free`` called through ``ctypes.PyDLL``, which
    keeps the GIL held for the call, as PyTorch's tensor deallocation does. A free that waits for
    the pool's mutex then stalls every Python thread. Sim backend; sizes <= 1 MiB.

    Args:
        threads: K, the trial threads.
        ops_per_thread: Allocations per thread.
        blocking_free: The pool's first behaviour (a free waits for the mutex, GIL held);
            False: the fix (a free that finds the mutex held is queued).

    Returns:
        ops/s, free latency (median, p99, max; microseconds, GIL held) and the pool's lock stats.
    """
    import ctypes

    import waterwave_hpo.memory as wm
    from waterwave_hpo.memory._lib import library_path
    from waterwave_hpo.memory._lib import load_library

    device = 63  # a C-level slot no real device uses; the sim pool never touches CUDA
    lib = load_library()
    gil_held = ctypes.PyDLL(str(library_path()))
    free = gil_held.waterwave_torch_free
    free.restype = None
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    malloc = lib.waterwave_torch_try_malloc
    malloc.restype = ctypes.c_int
    malloc.argtypes = [
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_void_p),
    ]
    pool = wm.StreamAwarePool(4 << 30, backend="sim")
    lib.ww_torch_set_pool(device, pool._handle())
    lib.ww_pool_set_torch_free_blocking(pool._handle(), int(blocking_free))
    sizes = [n for n in size_mix(4 * ops_per_thread) if n <= MiB][:ops_per_thread]
    free_ns: list[list[int]] = [[] for _ in range(threads)]
    barrier = threading.Barrier(threads + 1)

    def loop(i: int) -> None:
        stream = i + 1
        live: list[tuple[int, int]] = []
        out = ctypes.c_void_p()
        barrier.wait()
        for n in sizes:
            if malloc(n, device, stream, ctypes.byref(out)) == 0:
                live.append((int(out.value or 0), n))
            if len(live) > 16:
                ptr, m = live.pop(0)
                t0 = time.perf_counter_ns()
                free(ptr, m, device, stream)
                free_ns[i].append(time.perf_counter_ns() - t0)
        for ptr, m in live:
            free(ptr, m, device, stream)

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    load_before = os.getloadavg()
    barrier.wait()
    t0 = time.perf_counter()
    for t in workers:
        t.join()
    elapsed = time.perf_counter() - t0
    lock = pool.lock_stats()
    lib.ww_torch_set_pool(device, None)
    pool.close()
    lat = [x / 1000 for xs in free_ns for x in xs]
    return {
        "threads": threads,
        "free": "blocking (before)" if blocking_free else "queued when held (after)",
        "ops_per_s": 2 * threads * len(sizes) / elapsed,
        "free_us_gil_held": {
            "median": statistics.median(lat),
            "p99": percentile(lat, 0.99),
            "max": max(lat),
        },
        "lock": dataclasses.asdict(lock) | {"contended_fraction": lock.contended_fraction},
        "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
    }


def to_markdown(meta: dict[str, Any], results: list[dict[str, Any]]) -> str:
    lines = [
        f"# bench_allocator: {meta['mode']}",
        "",
        f"- when: {meta['when']}",
        f"- where: {meta['where']}",
        "",
    ]
    if meta["mode"].startswith("sim"):
        lines += [
            "**SIM BACKEND, NO GPU**: CPU bookkeeping costs through ctypes, not GPU timings.",
            "",
        ]
    lines += ["| allocator | alloc+free median (us) | p99 (us) |", "|---|---|---|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['config']} | skipped: {r['skipped']} | |")
        else:
            lat = r["latency_us"]
            lines.append(f"| {r['config']} | {lat['median']:.2f} | {lat['p99']:.2f} |")
    lines += [
        "",
        "| allocator | model | K | throughput | peak reserved (MiB) | extra |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        for t in r.get("training", []):
            thr = t.get("samples_per_s", t.get("steps_per_s", 0.0))
            unit = "samples/s" if "samples_per_s" in t else "steps/s"
            peak = t.get("peak_reserved_bytes")
            peak_s = f"{peak / MiB:.1f}" if peak is not None else "n/a"
            extra = {
                key: v
                for key, v in t.items()
                if key not in ("model", "k", "samples_per_s", "steps_per_s", "peak_reserved_bytes")
            }
            lines.append(
                f"| {r['config']} | {t['model']} | {t['k']} | {thr:.1f} {unit} | "
                f"{peak_s} | {extra} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and steps")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--force-sim", action="store_true", help="run the sim backend even on CUDA")
    parser.add_argument(
        "--contention",
        action="store_true",
        help="only the pool-mutex contention run (sim backend, K = 1 and 8 threads)",
    )
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.quick)))
        return
    if args.contention:
        ops = 5000 if args.quick else 40000
        # Before and after, interleaved in one run (the host's load drifts).
        runs = [
            run_contention(k, ops, blocking_free=blocking)
            for k in (1, 8)
            for _ in range(1 if k == 1 else 3)
            for blocking in (True, False)
        ]
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
        meta = {
            "mode": "contention (sim backend, no GPU)",
            "when": when,
            "where": f"{platform.node()} {platform.processor() or 'cpu'}, {os.cpu_count()} cpus",
        }
        print(json.dumps({"meta": meta, "runs": runs}, indent=2))
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"bench_allocator-contention-{when}.json"
        path.write_text(json.dumps({"meta": meta, "runs": runs}, indent=2))
        print(f"wrote {path}", file=sys.stderr)
        return
    try:
        import torch

        cuda = torch.cuda.is_available() and not args.force_sim
        device = torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"
    except ImportError:
        cuda, device = False, "cpu"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    if cuda:
        meta = {"mode": "cuda", "when": when, "where": device}
        results = run_cuda(args.quick)
    else:
        print(
            "No CUDA device: running the SIM backend of waterwave's pool only (CPU bookkeeping "
            "costs, not GPU timings).",
            file=sys.stderr,
        )
        meta = {"mode": "sim (no GPU)", "when": when, "where": f"{platform.node()} {device}"}
        results = run_sim(args.quick)
    md = to_markdown(meta, results)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"bench_allocator-{meta['mode'].split()[0]}-{when}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    stem.with_suffix(".md").write_text(md)
    print(f"wrote {stem}.json and .md", file=sys.stderr)


if __name__ == "__main__":
    main()
