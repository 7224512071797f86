"""The doctor's acceptance checks, each on the real GPU (``cuda``) or the simulated device.

Every check returns a :class:`CheckResult` and never raises: an unexpected error is a FAIL with
the error's text. The CUDA variants have never run on a GPU in this project's CI (it has none);
they are written against torch's and CuPy's documented APIs and are what a user's GPU run
reports back.
"""

from __future__ import annotations

from collections.abc import Callable
import ctypes
import random
import statistics
import time
from typing import Any

import torch

from waterwave_hpo.doctor._report import CheckResult
from waterwave_hpo.doctor._report import CheckStatus

MIB = 1 << 20
_LATENCY_SIZE_BYTES = 1 * MIB
_LATENCY_REPEATS = 2000
#: The pool's allocate + free through PyTorch may cost at most this multiple of PyTorch's own
#: caching allocator's (both are served from a cache after the first round).
LATENCY_RATIO_MAX = 2.0
#: Without a GPU: the pool's allocate + free through ctypes, median microseconds, at most.
SIM_LATENCY_MAX_US = 200.0
#: On a GPU, two co-hosted trials must not take longer than this fraction of one at a time.
COHOST_RATIO_MIN = 0.9


def guarded(name: str, check: Callable[[], CheckResult]) -> CheckResult:
    """Run ``check``; an exception becomes a FAIL naming it. Times the check."""
    t0 = time.perf_counter()
    try:
        result = check()
    except Exception as error:  # a check that crashes has failed, the others still run
        result = CheckResult(name, CheckStatus.FAIL, None, "", f"{type(error).__name__}: {error}")
    return CheckResult(
        result.name,
        result.status,
        result.figure,
        result.unit,
        result.detail,
        round(time.perf_counter() - t0, 3),
    )


def _passed(ok: bool) -> CheckStatus:
    return CheckStatus.PASS if ok else CheckStatus.FAIL


# -- the pool library -------------------------------------------------------------------------


def check_pool_library() -> CheckResult:
    """The C++ pool library is built and loads."""
    from waterwave_hpo.memory import library_path
    from waterwave_hpo.memory._internal import load_library

    load_library()
    return CheckResult(
        "pool_library", CheckStatus.PASS, None, "", f"built and loaded: {library_path()}"
    )


# -- install order ----------------------------------------------------------------------------


def check_install_order_cuda(device: torch.device) -> CheckResult:
    """The pool becomes PyTorch's allocator before CUDA initialises (call this first)."""
    from waterwave_hpo.memory import StreamAwarePool
    from waterwave_hpo.memory import installed_pool
    from waterwave_hpo.memory import use_pool

    index = device.index or 0
    initialised_before = bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]
    if installed_pool(index) is None:
        use_pool(StreamAwarePool(backend="cuda", device=index))
    x = torch.ones(1024, device=device)  # the first allocation goes through the pool
    backend = torch.cuda.get_allocator_backend()
    used = installed_pool(index)
    served = used is not None and used.stats().num_allocs > 0
    del x
    ok = not initialised_before and backend == "pluggable" and served
    return CheckResult(
        "install_order",
        _passed(ok),
        None,
        "",
        f"CUDA initialised before the pool: {initialised_before}; PyTorch's allocator "
        f"backend: {backend!r}; the first tensor was served by the pool: {served}",
    )


def check_install_order_sim() -> CheckResult:
    """Without a GPU: the executor must neither install a pool nor initialise CUDA."""
    import optuna

    from waterwave_hpo.executor import WaterwaveExecutor
    from waterwave_hpo.memory import installed_pool

    seen: dict[str, bool] = {}

    def objective(trial: optuna.trial.Trial) -> float:
        seen["pool"] = installed_pool(0) is not None
        seen["cuda"] = bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]
        return 0.0

    study = optuna.create_study()
    WaterwaveExecutor("cpu", 1).optimize(study, objective, n_trials=1)
    ok = seen == {"pool": False, "cuda": False}
    return CheckResult(
        "install_order",
        _passed(ok),
        None,
        "",
        f"CPU trial: pool installed {seen.get('pool')}, CUDA initialised {seen.get('cuda')} "
        "(CPU tensors cannot be routed through the pool; nothing may touch CUDA)",
    )


# -- allocation latency -----------------------------------------------------------------------


def _median_us(fn: Callable[[], None], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def torch_alloc_free_us(device: str, size_bytes: int, repeats: int) -> float:
    """Median microseconds of ``torch.empty`` + free on ``device``.

    Median microseconds of ``torch.empty`` + free on ``device`` with this process's allocator
    (run in a fresh process for PyTorch's own caching allocator).
    """
    dev = torch.device(device)

    def once() -> None:
        x = torch.empty(size_bytes, dtype=torch.uint8, device=dev)
        del x

    once()
    return _median_us(once, repeats)


def check_alloc_latency_cuda(device: torch.device) -> CheckResult:
    """The pool's allocate + free through PyTorch vs PyTorch's caching allocator."""
    from waterwave_hpo.bench._internal import call_in_child

    pool_us = torch_alloc_free_us(str(device), _LATENCY_SIZE_BYTES, _LATENCY_REPEATS)
    native_us = float(
        call_in_child(torch_alloc_free_us, str(device), _LATENCY_SIZE_BYTES, _LATENCY_REPEATS)
    )
    ratio = pool_us / native_us if native_us > 0 else float("inf")
    return CheckResult(
        "alloc_latency",
        _passed(ratio <= LATENCY_RATIO_MAX),
        ratio,
        "ratio",
        f"torch.empty({_LATENCY_SIZE_BYTES} B) + free, median of {_LATENCY_REPEATS}: pool "
        f"{pool_us:.2f} us, PyTorch's caching allocator {native_us:.2f} us (fresh process); "
        f"pass: ratio <= {LATENCY_RATIO_MAX}",
    )


def check_alloc_latency_sim() -> CheckResult:
    """The pool's allocate + free (ctypes) on the simulated device vs ``torch.empty`` on the CPU."""
    from waterwave_hpo.memory import StreamAwarePool

    pool = StreamAwarePool(capacity_bytes=64 * MIB, backend="sim")
    try:

        def once() -> None:
            pool.free(pool.allocate(_LATENCY_SIZE_BYTES, stream=1), stream=1)

        once()
        pool_us = _median_us(once, _LATENCY_REPEATS)
    finally:
        pool.close()
    cpu_us = torch_alloc_free_us("cpu", _LATENCY_SIZE_BYTES, _LATENCY_REPEATS)
    return CheckResult(
        "alloc_latency",
        _passed(pool_us <= SIM_LATENCY_MAX_US),
        pool_us,
        "us",
        f"simulated device: pool allocate + free of {_LATENCY_SIZE_BYTES} B, median of "
        f"{_LATENCY_REPEATS}: {pool_us:.2f} us (torch.empty on the CPU: {cpu_us:.2f} us, for "
        f"scale only); pass: <= {SIM_LATENCY_MAX_US} us. Not a GPU figure.",
    )


# -- the canary -------------------------------------------------------------------------------


def check_canary_sim(streams: int = 4, rounds: int = 300, seed: int = 0) -> CheckResult:
    """The canary: known patterns in blocks the pool recycles across streams.

    Streams write known patterns into blocks the pool recycles across streams (some freed on
    another stream than their own); every pattern is verified before its free, and the pool's
    trace is replayed against the safety rule (:class:`~waterwave_hpo.memory.testing.TraceChecker`).
    """
    from waterwave_hpo.memory import AllocationSource
    from waterwave_hpo.memory import StreamAwarePool
    from waterwave_hpo.memory.testing import TraceChecker
    from waterwave_hpo.memory.testing import TraceViolation

    rng = random.Random(seed)
    pool = StreamAwarePool(capacity_bytes=16 * MIB, backend="sim")
    checker = TraceChecker(capacity_bytes=pool.capacity_bytes)
    live: list[tuple[int, int, int, int]] = []  # ptr, nbytes, stream, pattern byte
    overwritten = checked = bad_frees = 0
    try:
        for step in range(rounds):
            stream = 1 + step % streams
            nbytes = rng.choice((4096, 65536, 512 * 1024, MIB))
            try:
                ptr = pool.allocate(nbytes, stream=stream)
            except MemoryError:
                ptr = 0
            if ptr:
                pattern = (step * 37 + stream) % 251 + 1
                ctypes.memset(ptr, pattern, nbytes)
                pool.sim.submit(stream)
                live.append((ptr, nbytes, stream, pattern))
            if live and (rng.random() < 0.5 or not ptr):
                ptr, nbytes, owner, pattern = live.pop(rng.randrange(len(live)))
                checked += 1
                if ctypes.string_at(ptr, nbytes) != bytes([pattern]) * nbytes:
                    overwritten += 1
                # One free in four is on another stream (the block's last use was there).
                user = owner if rng.random() < 0.75 else 1 + (owner % streams)
                pool.sim.submit(user)
                bad_frees += _free(pool, ptr, user)
            if rng.random() < 0.2:
                pool.sim.finish(1 + rng.randrange(streams))
            checker.feed(pool.sim.trace(checker.records_seen))
        for ptr, nbytes, owner, pattern in live:
            checked += 1
            overwritten += ctypes.string_at(ptr, nbytes) != bytes([pattern]) * nbytes
            bad_frees += _free(pool, ptr, owner)
        checker.feed(pool.sim.trace(checker.records_seen))
        stats = pool.stats()
        crossed = stats.count(AllocationSource.COMPLETED_EVENT) + stats.count(
            AllocationSource.STREAM_WAIT
        )
        violation = ""
    except TraceViolation as error:
        violation, crossed = str(error), 0
    finally:
        pool.close()
    if bad_frees and not violation:
        violation = f"{bad_frees} free(s) of a block the pool no longer held (handed out twice)"
    ok = overwritten == 0 and not violation and crossed > 0
    return CheckResult(
        "canary",
        _passed(ok),
        float(overwritten),
        "overwritten blocks",
        f"simulated device, {streams} streams, {checked} blocks verified, {crossed} handed "
        f"across streams; trace safety rule: {violation or 'held'}; pass: 0 overwritten, the "
        "rule held, some blocks crossed streams",
    )


def _free(pool: Any, ptr: int, stream: int) -> int:
    """Free ``ptr``; 1 if the pool refused (a block handed out twice), else 0."""
    try:
        pool.free(ptr, stream=stream)
    except ValueError:
        return 1
    return 0


#: GPU clock cycles a canary reader spins before it reads (``torch.cuda._sleep``): about 25 ms
#: at 2 GHz, far longer than the host takes to free the block and allocate the next one.
CANARY_SLEEP_CYCLES = 50_000_000


def check_canary_cuda(device: torch.device, streams: int = 4, rounds: int = 16) -> CheckResult:
    """A block a busy stream still reads is not handed to a third stream, or that stream waits.

    Each round: stream ``a`` fills a tensor with a known value; stream ``b`` waits for ``a``,
    spins (``torch.cuda._sleep``) and then reads it (``record_stream``); the tensor is freed
    while ``b`` still spins; a third stream ``c`` at once allocates a tensor of the same size
    and fills it with another value. If the pool handed ``c`` the block while ``b``'s read is
    pending, without making ``c`` wait, ``b`` reads ``c``'s value: every read is verified after
    every stream is synchronized. Also counted: blocks handed to ``c`` while ``b`` still ran
    (``record_stream`` promises none).
    """
    side = [torch.cuda.Stream(device) for _ in range(streams)]  # type: ignore[no-untyped-call]
    n = 256 * 1024
    expected: list[tuple[torch.Tensor, int]] = []
    reused_while_busy = 0
    for step in range(rounds):
        a, b, c = (side[(step + k) % streams] for k in range(3))
        value = step + 1
        with torch.cuda.stream(a):
            x = torch.full((n,), value, dtype=torch.int32, device=device)
        b.wait_stream(a)
        with torch.cuda.stream(b):
            torch.cuda._sleep(CANARY_SLEEP_CYCLES)  # type: ignore[no-untyped-call]  # b reads x late
            expected.append(((x * 1).sum(), value * n))
        x.record_stream(b)
        ptr = x.untyped_storage().data_ptr()
        del x  # freed on a while b's read is queued behind the spin
        with torch.cuda.stream(c):
            y = torch.full((n,), -value, dtype=torch.int32, device=device)
            expected.append((y.sum(), -value * n))
        reused_while_busy += int(y.untyped_storage().data_ptr() == ptr and not b.query())
        del y
    for s in side:
        s.synchronize()
    wrong = sum(int(total.item()) != want for total, want in expected)
    return CheckResult(
        "canary",
        _passed(wrong == 0 and reused_while_busy == 0),
        float(wrong),
        "overwritten tensors",
        f"{streams} streams, {len(expected)} tensors verified; each round a tensor read late on "
        "a spinning stream is freed and a third stream allocates and writes at once; "
        f"{reused_while_busy} block(s) handed to the third stream while the reader ran; pass: "
        "none overwritten, none handed out early",
    )


# -- out of memory ----------------------------------------------------------------------------


def check_oom_sim() -> CheckResult:
    """Exhaust a small simulated pool, see the typed error, free, allocate again."""
    from waterwave_hpo.executor import is_out_of_memory
    from waterwave_hpo.memory import PoolOutOfMemoryError
    from waterwave_hpo.memory import StreamAwarePool

    pool = StreamAwarePool(capacity_bytes=8 * MIB, backend="sim")
    held: list[int] = []
    error: BaseException | None = None
    at_oom = 0
    try:
        try:
            for _ in range(64):
                held.append(pool.allocate(2 * MIB, stream=1))
        except PoolOutOfMemoryError as exc:
            error = exc
            at_oom = len(held)
        pool.free(held.pop(), stream=1)
        held.append(pool.allocate(2 * MIB, stream=1))  # recovered
        recognised = is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    finally:
        for p in held:
            pool.free(p, stream=1)
        pool.close()
    ok = error is not None and recognised
    return CheckResult(
        "oom",
        _passed(ok),
        float(at_oom),
        "blocks held at OOM",
        f"simulated 8 MiB pool: {type(error).__name__} after {at_oom} blocks of 2 MiB, "
        f"then an allocation succeeded after a free; torch.OutOfMemoryError is recognised by "
        f"the executor: {recognised}",
    )


def check_oom_cuda(device: torch.device) -> CheckResult:
    """Out of memory through the pool is ``torch.OutOfMemoryError`` and is recovered.

    An allocation larger than the device raises ``torch.OutOfMemoryError`` through the pool
    (PyTorch's own type, so its internal fallbacks run), and the next allocation succeeds.
    """
    total = int(torch.cuda.get_device_properties(device).total_memory)
    raised: BaseException | None = None
    try:
        torch.empty(2 * total, dtype=torch.uint8, device=device)
    except Exception as exc:
        raised = exc
    x = torch.ones(MIB, device=device)
    recovered = bool(x.sum().item() == MIB)
    typed = isinstance(raised, torch.OutOfMemoryError)
    return CheckResult(
        "oom",
        _passed(typed and recovered),
        None,
        "",
        f"torch.empty(2 x {total} B) raised {type(raised).__name__} "
        f"(pass: torch.OutOfMemoryError); a 4 MiB tensor afterwards: {recovered}",
    )


# -- cuDNN ------------------------------------------------------------------------------------


def _conv_step(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A convolution's output and input gradient on ``device`` (CPU tensors, for comparison)."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 16, 3, padding=1)
    x = torch.randn(4, 8, 32, 32)
    conv = conv.to(device)
    xd = x.to(device).requires_grad_(True)
    out = conv(xd)
    out.square().mean().backward()
    assert xd.grad is not None
    return out.detach().cpu(), xd.grad.cpu()


#: Most relative error (:func:`relative_error`) of a convolution's output or input gradient
#: against the CPU's. Float32 throughout (TF32 off for the check): different algorithms agree to
#: about 1e-6 relative; a recycled block overwritten by a neighbour, or a gradient 1% off, is
#: far above.
CONV_REL_TOL = 1e-3


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` (Frobenius norms, float64); ``inf`` for a shape mismatch.

    Relative to the whole tensor's norm, so it judges a gradient of ~2e-5 per element as
    strictly as an output of ~1 (an absolute tolerance would pass nearly any gradient that
    small), and elements near zero, where an elementwise relative tolerance is noise, weigh by
    their size.
    """
    if got.shape != want.shape:
        return float("inf")
    diff = (got.double() - want.double()).norm()
    scale = want.double().norm()
    if scale == 0:
        return 0.0 if diff == 0 else float("inf")
    return float(diff / scale)


def conv_matches(got: torch.Tensor, want: torch.Tensor, rtol: float = CONV_REL_TOL) -> bool:
    """Whether ``got`` equals ``want`` to relative error ``rtol`` (:func:`relative_error`)."""
    return relative_error(got, want) <= rtol


def check_cudnn(device: torch.device) -> CheckResult:
    """Convolutions forward and backward, cuDNN's benchmark mode off and asked on, checked.

    Each run's output and input gradient must match the CPU's to a relative error of
    :data:`CONV_REL_TOL` (TF32 off for the check, restored after); and the benchmark flag must
    read back as what the allocator allows: refused (``False``) while the pool is PyTorch's
    allocator (its ``cacheInfo`` is missing), granted otherwise.
    """
    from waterwave_hpo.memory import allocator_swapped

    reference = _conv_step(torch.device("cpu"))
    outcomes = []
    ok = True
    worst = 0.0
    saved = torch.backends.cudnn.benchmark
    saved_tf32 = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = False  # float32 against the CPU's float32
        for flag in (False, True):
            torch.backends.cudnn.benchmark = flag
            effective = bool(torch.backends.cudnn.benchmark)
            want = flag and not allocator_swapped()
            out, grad = _conv_step(device)
            errors = (relative_error(out, reference[0]), relative_error(grad, reference[1]))
            close = all(e <= CONV_REL_TOL for e in errors)
            worst = max(worst, *errors)
            ok = ok and close and effective == want
            outcomes.append(
                f"benchmark={flag}: effective {effective} (expected {want}), "
                f"{'matches' if close else 'DIFFERS FROM'} the CPU (relative error: output "
                f"{errors[0]:.1e}, input gradient {errors[1]:.1e})"
            )
    finally:
        torch.backends.cudnn.benchmark = saved
        torch.backends.cudnn.allow_tf32 = saved_tf32
    return CheckResult(
        "cudnn_conv",
        _passed(ok),
        worst,
        "largest relative error",
        "; ".join(outcomes) + f"; pass: relative error <= {CONV_REL_TOL} and the flag as allowed",
    )


def check_cudnn_sim() -> CheckResult:
    """Without a GPU: the cuDNN benchmark guard and CPU convolutions.

    Without a GPU: the guard that keeps cuDNN's benchmark mode off under the pool, around a
    simulated pool, then convolutions on the CPU both ways.
    """
    import warnings

    from waterwave_hpo.memory import StreamAwarePool
    from waterwave_hpo.memory._internal import install_guards
    from waterwave_hpo.memory._internal import remove_guards

    pool = StreamAwarePool(capacity_bytes=8 * MIB, backend="sim")
    saved = torch.backends.cudnn.benchmark
    install_guards(lambda index: pool if index == 0 else None)
    try:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            torch.backends.cudnn.benchmark = True
            refused = torch.backends.cudnn.benchmark is False
    finally:
        remove_guards()
        torch.backends.cudnn.benchmark = saved
        pool.close()
    cpu = torch.device("cpu")
    _conv_step(cpu)
    return CheckResult(
        "cudnn_conv",
        _passed(refused),
        None,
        "",
        f"under the pool cuDNN benchmark mode is refused (it needs cacheInfo): {refused}; "
        "CPU convolutions ran (no cuDNN without a GPU)",
    )


# -- a co-hosted study ------------------------------------------------------------------------


def _study_makespan_s(device: str, k: int, trials: int, steps: int) -> tuple[float, int]:
    import optuna

    import waterwave_hpo as ww

    def objective(trial: optuna.trial.Trial) -> float:
        dev = ww.current().device
        width = trial.suggest_categorical("width", [64, 128])
        torch.manual_seed(trial.number)
        model = ww.pipeline(
            torch.nn.Sequential(
                torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, 10)
            ).to(dev)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(64, 64, device=dev)
        y = torch.randint(0, 10, (64,), device=dev)
        loss = torch.zeros(())
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
        return float(loss.item())

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    executor = ww.WaterwaveExecutor(device, k, memory_budget_bytes=1 << 30)
    t0 = time.perf_counter()
    executor.optimize(study, objective, n_trials=trials)
    makespan = time.perf_counter() - t0
    complete = sum(t.state is optuna.trial.TrialState.COMPLETE for t in study.trials)
    return makespan, complete


def check_cohosted(device: torch.device, trials: int = 4, steps: int = 20) -> CheckResult:
    """The same trials with NodeGroup gates, two at a time vs one at a time.

    The same trials with NodeGroup gates, two at a time vs one at a time (after a one-trial
    warm-up, so neither pays first use).
    """
    _study_makespan_s(str(device), 1, 1, 2)
    one_s, one_done = _study_makespan_s(str(device), 1, trials, steps)
    two_s, two_done = _study_makespan_s(str(device), 2, trials, steps)
    ratio = one_s / two_s if two_s > 0 else 0.0
    all_done = one_done == two_done == trials
    cuda = device.type == "cuda"
    ok = all_done and (ratio >= COHOST_RATIO_MIN if cuda else True)
    criterion = (
        f"all complete and ratio >= {COHOST_RATIO_MIN}"
        if cuda
        else "all complete (the CPU's cores are shared: the ratio is not a GPU figure)"
    )
    return CheckResult(
        "cohosted_study",
        _passed(ok),
        ratio,
        "makespan ratio (1 at a time / 2 co-hosted)",
        f"{trials} gated trials on {device}: one at a time {one_s:.2f} s ({one_done} complete), "
        f"two co-hosted {two_s:.2f} s ({two_done} complete); pass: {criterion}",
    )


# -- CuPy -------------------------------------------------------------------------------------


def check_cupy(device: torch.device | None) -> CheckResult:
    """A trial's CuPy work runs on the trial's stream."""
    try:
        import cupy
    except ImportError:
        return CheckResult(
            "cupy_stream",
            CheckStatus.SKIP,
            None,
            "",
            "CuPy is not installed (pip install 'waterwave-hpo[cuda12]' or '[cuda13]')",
        )
    if device is None:
        return CheckResult(
            "cupy_stream", CheckStatus.SKIP, None, "", "no GPU: CuPy needs a CUDA device"
        )
    import optuna

    import waterwave_hpo as ww

    seen: dict[str, Any] = {}

    def objective(trial: optuna.trial.Trial) -> float:
        ctx = ww.current()
        seen["trial"] = ctx.stream.cuda_stream if ctx.stream is not None else None
        seen["cupy"] = int(cupy.cuda.get_current_stream().ptr)
        return float(cupy.arange(10).sum().get())

    study = optuna.create_study()
    ww.WaterwaveExecutor(str(device), 1).optimize(study, objective, n_trials=1)
    ok = seen.get("trial") is not None and seen.get("trial") == seen.get("cupy")
    return CheckResult(
        "cupy_stream",
        _passed(ok),
        None,
        "",
        f"trial stream {seen.get('trial')}, CuPy's current stream in the trial {seen.get('cupy')}",
    )
